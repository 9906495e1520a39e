"""Grouped matmuls over rows sorted by group: the routed experts' SwiGLU, sized by the routed rows.

``swiglu(rows, groups, num_groups, w_gate, w_up, w_down)`` runs each row of
``rows`` [R, embed] through the SwiGLU of the expert ``groups`` [R] names
(``num_groups``: a row that takes no part, left zero). The rows are laid out
sorted by group, each group padded with zero rows to a multiple of the
kernel's row tile, never to a worst case: the layout has ``R + groups ·
(tile − 1)`` rows at most, so each row tile belongs to one group. Three
grouped matmuls run over it, on each platform with a kernel whose work
follows the rows (``gmm``):

- TPU: megablox's ``gmm`` / ``tgmm`` (Pallas, in jax), whose grid visits
  only the tiles that hold rows — forward, the inputs' gradient and the
  weights' gradient by group;
- GPU: the Triton grouped GEMM of ``gmm_triton`` where it is installed, else
  ``jax.lax.ragged_dot``;
- CPU: one batched matmul over the row tiles, each tile with its group's
  weights (XLA expands ``ragged_dot`` into every group × every row).

Inside ``fp8.active`` the matmuls take FP8 operands (current scaling) over the
same layout: on GPUs with FP8 (compute capability 8.9 and up: Ada, Hopper)
through the same Triton kernels (``fp8.grouped_matmul`` with
``gmm_triton.Fp8Products``: the forward product on FP8 operands, the two
backward ones as float16), elsewhere through ``fp8.ragged_dot``.

Each kernel runs under a name scope ``grouped_matmul(rows=…,k=…,n=…)``
giving the rows it multiplies under even routing, which ``podplan.hlo``
reads to count a custom call's FLOPs: a kernel's program is opaque to it.

Not for: routing and the all-to-all (``experts.py``).
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp

from distrib_train.common.versions import gpu_capability
from distrib_train.kernels import fp8
from distrib_train.sharding.axis_rules import active_device

TILE = {"tpu": 128, "gpu": 128, "cpu": 64}  # rows per tile, at most
SCOPE = "grouped_matmul"


def platform_of(mesh=None) -> str:
  """``tpu``, ``gpu`` or ``cpu``: where the program runs (a mesh's devices, else the default backend's)."""
  name = mesh.devices.flat[0].platform if mesh is not None else jax.devices()[0].platform
  return "gpu" if name in ("gpu", "cuda", "rocm") else name


def tile_rows(platform: str, rows: int, groups: int) -> int:
  """The row tile: the platform's, smaller (a power of two, ≥ 16) when the groups hold few rows each."""
  mean = max(1, -(-rows // max(groups, 1)))
  return min(TILE.get(platform, 64), max(16, 1 << (mean - 1).bit_length()))


def layout_rows(rows: int, groups: int, tile: int) -> int:
  """Rows of the padded layout: room for every group padded to the tile, rounded to a tile."""
  return -(-(rows + groups * (tile - 1)) // tile) * tile


def _megablox():
  return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _tiling(tile: int, k: int, n: int) -> tuple[int, int, int]:
  pick = lambda size: next((b for b in (512, 256, 128) if size % b == 0), 128)
  return tile, pick(k), pick(n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tpu_gmm(lhs, rhs, sizes, tile, interpret):
  k, n = lhs.shape[1], rhs.shape[2]
  return _megablox().gmm(lhs, rhs, sizes, lhs.dtype, _tiling(tile, k, n), interpret=interpret)


def _tpu_gmm_fwd(lhs, rhs, sizes, tile, interpret):
  return _tpu_gmm(lhs, rhs, sizes, tile, interpret), (lhs, rhs, sizes)


def _tpu_gmm_bwd(tile, interpret, residual, grad):
  lhs, rhs, sizes = residual
  k, n = lhs.shape[1], rhs.shape[2]
  backend = _megablox()
  d_lhs = backend.gmm(grad, rhs, sizes, lhs.dtype, _tiling(tile, n, k), transpose_rhs=True, interpret=interpret)
  d_rhs = backend.tgmm(
    lhs.swapaxes(0, 1), grad, sizes, rhs.dtype, _tiling(tile, k, n), num_actual_groups=rhs.shape[0], interpret=interpret
  )
  return d_lhs, d_rhs, None


_tpu_gmm.defvjp(_tpu_gmm_fwd, _tpu_gmm_bwd)


def _tiled_gmm(lhs, rhs, tile_groups, tile):
  """Every row tile times its group's weights, as one batched matmul (tiles past the groups: zero)."""
  tiles = lhs.shape[0] // tile
  weights = rhs[jnp.maximum(tile_groups, 0)]
  out = jnp.einsum("ctk,ckn->ctn", lhs.reshape(tiles, tile, lhs.shape[1]), weights)
  out = jnp.where((tile_groups >= 0)[:, None, None], out, 0)
  return out.reshape(lhs.shape[0], rhs.shape[2])


def gmm(
  lhs: jax.Array,
  rhs: jax.Array,
  sizes: jax.Array,
  tile_groups: jax.Array,
  *,
  tile: int,
  platform: str,
  routed_rows: int,
  amax_axes: tuple[str, ...] = (),
  interpret: bool = False,
) -> jax.Array:
  """``lhs`` [M, K] in the padded layout (module docstring) times ``rhs`` [G, K, N] by group → [M, N].

  ``sizes`` [G]: each group's rows, padded; ``tile_groups`` [M / tile]: each tile's group, -1 past the last;
  ``routed_rows``: the rows under even routing, for the plan's FLOP count.
  """
  k, n = lhs.shape[1], rhs.shape[2]
  with jax.named_scope(f"{SCOPE}(rows={routed_rows},k={k},n={n})"):
    if fp8.mode() != "none":
      kernels = _gpu_fp8_kernels(rhs.shape[0], tile) if platform == "gpu" and not interpret else None
      if kernels is not None:
        return fp8.grouped_matmul(lhs, rhs, kernels, tile_groups, amax_axes)
      return fp8.ragged_dot(lhs, rhs, sizes, amax_axes)
    if platform == "tpu" or interpret:
      return _tpu_gmm(lhs, rhs.astype(lhs.dtype), sizes, tile, interpret)
    if platform == "gpu":
      return _gpu_gmm(lhs, rhs.astype(lhs.dtype), sizes, tile_groups, tile)
    return _tiled_gmm(lhs, rhs.astype(lhs.dtype), tile_groups, tile)


FP8_KERNEL_CAPABILITY = (8, 9)  # Ada and Hopper: Triton's FP8 dot and casts from e4m3 (refused below)


def _target_device():
  """The device a Pallas kernel is lowered for: JAX's default device where one is set (Pallas reads that
  one), else the first of the mesh the model is traced for, else JAX's first."""
  device = jax.config.jax_default_device
  return active_device() if device is None else device


def _gpu_fp8_kernels(groups: int, tile: int):
  """The Triton kernels' FP8 products, where the target GPU has FP8 (else None: ``fp8.ragged_dot``)."""
  if gpu_capability(_target_device()) < FP8_KERNEL_CAPABILITY:
    return None
  try:
    return importlib.import_module("distrib_train.kernels.gmm_triton").fp8_products(groups, tile_m=tile)
  except ImportError:
    return None


def _gpu_gmm(lhs, rhs, sizes, tile_groups, tile):
  try:
    triton = importlib.import_module("distrib_train.kernels.gmm_triton")
  except ImportError:
    return jax.lax.ragged_dot(lhs, rhs, sizes)
  return triton.gmm(lhs, rhs, tile_groups, tile_m=tile)


@jax.custom_vjp
def move_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
  """``x[index]`` (rows past ``x``'s end: zero), where ``index`` is one-to-one and ``inverse`` undoes it: its
  gradient is a gather by ``inverse`` too, not a scatter (XLA:CPU scatters a row at a time)."""
  return x.at[index].get(mode="fill", fill_value=0)


def _move_fwd(x, index, inverse):
  return move_rows(x, index, inverse), (index, inverse)


def _move_bwd(residual, grad):
  index, inverse = residual
  zero = lambda a: jnp.zeros(a.shape, jax.dtypes.float0)
  return grad.at[inverse].get(mode="fill", fill_value=0), zero(index), zero(inverse)


move_rows.defvjp(_move_fwd, _move_bwd)


def inverse_of(index: jax.Array, size: int) -> jax.Array:
  """The inverse of a one-to-one ``index`` into ``size`` rows (``index`` values past ``size``: none)."""
  return (
    jnp.full((size,), index.shape[0], jnp.int32).at[index].set(jnp.arange(index.shape[0], dtype=jnp.int32), mode="drop")
  )


def padded_layout(groups: jax.Array, num_groups: int, tile: int) -> tuple[jax.Array, jax.Array, jax.Array, int]:
  """Where each row goes in the padded layout: ``(positions [R] (M for a row of no group), sizes [G],
  tile_groups [M / tile], M)``."""
  rows = groups.shape[0]
  m = layout_rows(rows, num_groups, tile)
  counts = jnp.bincount(groups, length=num_groups + 1)[:num_groups].astype(jnp.int32)
  padded = -(-counts // tile) * tile
  starts = jnp.cumsum(padded) - padded
  order = jnp.argsort(groups, stable=True)
  first = jnp.cumsum(counts) - counts  # each group's first row in sorted order
  ranked = jnp.arange(rows, dtype=jnp.int32) - jnp.concatenate([first, jnp.array([rows], jnp.int32)])[groups[order]]
  rank = jnp.zeros((rows,), jnp.int32).at[order].set(ranked)
  inside = groups < num_groups
  positions = jnp.where(inside, starts[jnp.minimum(groups, num_groups - 1)] + rank, m)
  tile_starts = jnp.arange(m // tile, dtype=jnp.int32) * tile
  ends = jnp.cumsum(padded)
  tile_groups = jnp.searchsorted(ends, tile_starts, side="right").astype(jnp.int32)
  tile_groups = jnp.where(tile_groups < num_groups, tile_groups, -1)
  return positions, padded, tile_groups, m


def silu_gate(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jax.nn.silu(gate) * up


def _by_tile(bias: jax.Array, tile_groups: jax.Array, tile: int) -> jax.Array:
  """Each laid row's group's ``bias`` [G, n] → [M, n] (a tile of no group: zero)."""
  rows = jnp.repeat(tile_groups, tile)
  return jnp.where((rows >= 0)[:, None], bias[jnp.maximum(rows, 0)], 0).astype(bias.dtype)


def swiglu(
  rows: jax.Array,
  groups: jax.Array,
  num_groups: int,
  w_gate: jax.Array,
  w_up: jax.Array,
  w_down: jax.Array,
  *,
  platform: str,
  routed_rows: int | None = None,
  amax_axes: tuple[str, ...] = (),
  interpret: bool = False,
  activation=silu_gate,
  gate_bias: jax.Array | None = None,
  up_bias: jax.Array | None = None,
) -> jax.Array:
  """Each row of ``rows`` [R, embed] through its group's gated MLP → [R, embed] (rows of no group: zero).

  ``w_gate``, ``w_up`` [G, embed, hidden], ``w_down`` [G, hidden, embed] (a ``hidden`` split over a
  mesh axis gives partial sums, which the caller adds); ``routed_rows``: rows that reach these groups under
  even routing (default ``R``); ``activation(gate, up)`` (default SwiGLU: ``silu(gate) · up``) with the
  groups' ``gate_bias`` and ``up_bias`` [G, hidden] added first (gpt-oss's experts).
  """
  tile = tile_rows(platform, routed_rows or rows.shape[0], num_groups)
  positions, sizes, tile_groups, m = padded_layout(groups, num_groups, tile)
  expected = num_groups * -(-(routed_rows or rows.shape[0]) // (num_groups * tile)) * tile
  source = inverse_of(positions, m)  # each laid row's row of ``rows`` (past its end: padding)
  laid = move_rows(rows, source, positions)
  dot = functools.partial(
    gmm,
    sizes=sizes,
    tile_groups=tile_groups,
    tile=tile,
    platform=platform,
    routed_rows=min(m, expected),
    amax_axes=amax_axes,
    interpret=interpret,
  )
  gate, up = dot(laid, w_gate), dot(laid, w_up)
  if gate_bias is not None:
    gate, up = gate + _by_tile(gate_bias, tile_groups, tile), up + _by_tile(up_bias, tile_groups, tile)
  hidden = activation(gate, up)
  return move_rows(dot(hidden, w_down), positions, source)


def flops_tag(op_name: str) -> float:
  """FLOPs of one grouped-matmul kernel from its name scope (``2 · rows · k · n``), 0 for another op."""
  start = op_name.rfind(SCOPE + "(")
  if start < 0:
    return 0.0
  fields = dict(part.split("=") for part in op_name[start + len(SCOPE) + 1 :].split(")")[0].split(","))
  return 2.0 * math.prod(int(fields[key]) for key in ("rows", "k", "n"))
