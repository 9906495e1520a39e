"""The routed experts' grouped matmul on NVIDIA GPUs: a Pallas kernel lowered to Triton, forward and backward.

``gmm(lhs, rhs, tile_groups)`` multiplies each row tile of ``lhs`` by its
group's weights and nothing else, where XLA's CUDA compiler expands
``jax.lax.ragged_dot`` densely (every row times every group's weights under
a mask: G times the FLOPs). Layout contract:

- ``lhs`` [M, K]: rows sorted by group, every group's rows padded with zero
  rows to a multiple of ``tile_m`` (``M % tile_m == 0``), so each row tile
  belongs to one group;
- ``rhs`` [G, K, N], the dtype of ``lhs`` (bfloat16, float16 or float32);
- ``tile_groups`` [M // tile_m] int32: each row tile's group, ascending from
  the first tile, the tiles of a group contiguous; -1 for tiles past the last
  group (their output rows are zero, and they take no part in the gradients).
  Values are not checked (they are traced): a group ≥ G reads out of bounds.

The output [M, N] has ``lhs``'s dtype, accumulated in float32 (float32
operands multiply at full precision, not TF32). ``jax.custom_vjp`` makes the
gradients grouped too: d lhs is the same kernel over the output's cotangent
with each group's weights transposed in the kernel; d rhs[g] = Σ over g's
tiles of lhs[t]ᵀ · dout[t] is a second kernel, over (G, K blocks, N blocks),
that loops over the group's tiles (a group with no tiles gets zeros).
``tile_groups`` gets no gradient. K and N that are not multiples of the
blocks are zero-padded here and the result sliced.

``fp8_products`` runs the same kernels on float8 operands for ``model.fp8``
(``kernels/fp8.py`` scales around them), each product in float32.

Blocks (for an H100; untuned, no GPU to time them on): 128 × 128 output
tiles, K in steps of 64, 4 warps, 3 pipeline stages; the weight gradient's
tiles are 128 (K) × 128 (N) over steps of 64 rows. ``interpret=True`` runs the
kernels in Pallas' interpreter on any backend (the tests, on CPU).

Not for: TPU (megablox's grouped matmul, a Mosaic kernel), CPU (batched
tiles, ``grouped.py``), choosing or routing tokens and padding groups
(``experts.py``), FP8's scaling (``kernels/fp8.py``; ``Fp8Products`` are its grouped products here).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Blocks:
  """The kernels' static configuration (hashable: a ``custom_vjp`` non-differentiable argument)."""

  tile_m: int
  block_n: int
  block_k: int
  wgrad_block_k: int
  num_warps: int
  num_stages: int
  interpret: bool

  @property
  def pad_to(self) -> int:
    """K and N are padded to a multiple of every block that steps over them (powers of 2: the largest)."""
    return max(self.block_n, self.block_k, self.wgrad_block_k)

  def params(self) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _precision(dtype) -> lax.Precision:
  return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _common(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two tiles of one type for Triton's dot: FP8 tiles of two types (e5m2 × e4m3) as float16, which holds every
  value of both exactly, so the products are the FP8 ones."""
  return (a, b) if a.dtype == b.dtype else (a.astype(jnp.float16), b.astype(jnp.float16))


def _tiles_kernel(groups_ref, lhs_ref, rhs_ref, out_ref, *, blocks: _Blocks, k_steps: int, transpose: bool):
  """One [tile_m, block_n] output tile: ``lhs[tile] @ rhs[group]`` (``rhs[group]ᵀ`` when ``transpose``)."""
  tile_m, block_n, block_k = blocks.tile_m, blocks.block_n, blocks.block_k
  group = groups_ref[pl.program_id(0)]
  weights = lax.max(group, 0)
  rows = pl.ds(pl.multiple_of(pl.program_id(0) * tile_m, tile_m), tile_m)
  cols = pl.ds(pl.multiple_of(pl.program_id(1) * block_n, block_n), block_n)
  # rhs[g] is [K, N]; transposed, the kernel's output columns index its K and the contraction its N.
  contract = (((1,), (1,)), ((), ())) if transpose else (((1,), (0,)), ((), ()))

  def step(s, acc):
    inner = pl.ds(pl.multiple_of(s * block_k, block_k), block_k)
    a = lhs_ref[rows, inner]
    b = rhs_ref[weights, cols, inner] if transpose else rhs_ref[weights, inner, cols]
    a, b = _common(a, b)
    return acc + lax.dot_general(a, b, contract, precision=_precision(a.dtype), preferred_element_type=jnp.float32)

  # A tile past the last group (-1) takes no steps: its rows are zeros. (lax.select: jnp.where's loop bound
  # reached Triton as a boolean on jax 0.12, and the kernel failed to verify.)
  steps = lax.select(group >= 0, jnp.int32(k_steps), jnp.int32(0))
  acc = lax.fori_loop(0, steps, step, jnp.zeros((tile_m, block_n), jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def _grouped(
  lhs: jax.Array, rhs: jax.Array, tile_groups: jax.Array, blocks: _Blocks, transpose: bool, out_dtype=None
) -> jax.Array:
  """``out[tile t] = lhs[t] @ rhs[tile_groups[t]]`` (or ``rhs[..]ᵀ``); shapes already padded to the blocks; the
  output in ``out_dtype`` (default: ``lhs``'s)."""
  m, inner = lhs.shape
  n = rhs.shape[1] if transpose else rhs.shape[2]
  kernel = functools.partial(_tiles_kernel, blocks=blocks, k_steps=inner // blocks.block_k, transpose=transpose)
  return pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((m, n), out_dtype or lhs.dtype),
    grid=(m // blocks.tile_m, n // blocks.block_n),
    in_specs=[pl.no_block_spec] * 3,  # whole arrays: the kernel picks the group's weights itself
    out_specs=pl.BlockSpec((blocks.tile_m, blocks.block_n), lambda i, j: (i, j)),
    compiler_params=blocks.params(),
    interpret=blocks.interpret,
    name="gmm_transposed" if transpose else "gmm",
  )(tile_groups, lhs, rhs)


def _wgrad_kernel(first_ref, count_ref, lhs_ref, dout_ref, out_ref, *, blocks: _Blocks, chunk: int):
  """One [wgrad_block_k, block_n] tile of d rhs[g]: Σ over the group's rows, ``chunk`` rows a step."""
  group = pl.program_id(0)
  cols_k = pl.ds(pl.multiple_of(pl.program_id(1) * blocks.wgrad_block_k, blocks.wgrad_block_k), blocks.wgrad_block_k)
  cols_n = pl.ds(pl.multiple_of(pl.program_id(2) * blocks.block_n, blocks.block_n), blocks.block_n)
  per_tile = blocks.tile_m // chunk
  first, count = first_ref[group] * per_tile, count_ref[group] * per_tile

  def step(s, acc):
    rows = pl.ds(pl.multiple_of(s * chunk, chunk), chunk)
    a, d = _common(lhs_ref[rows, cols_k], dout_ref[rows, cols_n])
    return acc + lax.dot_general(
      a, d, (((0,), (0,)), ((), ())), precision=_precision(a.dtype), preferred_element_type=jnp.float32
    )

  acc = lax.fori_loop(first, first + count, step, jnp.zeros((blocks.wgrad_block_k, blocks.block_n), jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def _wgrad(
  lhs: jax.Array, dout: jax.Array, tile_groups: jax.Array, groups: int, blocks: _Blocks, out_dtype=None
) -> jax.Array:
  """d rhs [G, K, N]: ``Σ_{t in g} lhs[t]ᵀ @ dout[t]`` per group; shapes already padded to the blocks; the output
  in ``out_dtype`` (default: ``lhs``'s)."""
  (_, k), n = lhs.shape, dout.shape[1]
  count = jnp.sum(tile_groups[None, :] == jnp.arange(groups, dtype=tile_groups.dtype)[:, None], axis=1, dtype=jnp.int32)
  first = jnp.cumsum(count, dtype=jnp.int32) - count  # groups ascend from tile 0, contiguous
  kernel = functools.partial(_wgrad_kernel, blocks=blocks, chunk=min(blocks.block_k, blocks.tile_m))
  return pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((groups, k, n), out_dtype or lhs.dtype),
    grid=(groups, k // blocks.wgrad_block_k, n // blocks.block_n),
    in_specs=[pl.no_block_spec] * 4,
    out_specs=pl.BlockSpec((None, blocks.wgrad_block_k, blocks.block_n), lambda g, i, j: (g, i, j)),
    compiler_params=blocks.params(),
    interpret=blocks.interpret,
    name="gmm_wgrad",
  )(first, count, lhs, dout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs: jax.Array, rhs: jax.Array, tile_groups: jax.Array, blocks: _Blocks) -> jax.Array:
  return _grouped(lhs, rhs, tile_groups, blocks, transpose=False)


def _gmm_forward(lhs, rhs, tile_groups, blocks):
  return _grouped(lhs, rhs, tile_groups, blocks, transpose=False), (lhs, rhs, tile_groups)


def _gmm_backward(blocks, residuals, dout):
  lhs, rhs, tile_groups = residuals
  dout = dout.astype(lhs.dtype)
  return (
    _grouped(dout, rhs, tile_groups, blocks, transpose=True),
    _wgrad(lhs, dout, tile_groups, rhs.shape[0], blocks),
    None,
  )


_gmm.defvjp(_gmm_forward, _gmm_backward)


def _check(lhs: jax.Array, rhs: jax.Array, tile_groups: jax.Array, blocks: _Blocks, fp8: bool = False) -> None:
  """One ValueError naming the argument that breaks the layout contract (``fp8``: ``Fp8Products``' operands)."""
  smallest = 1 if blocks.interpret else 16  # Triton's matmul takes no dimension under 16
  for name in ("tile_m", "block_n", "block_k", "wgrad_block_k"):
    size = getattr(blocks, name)
    if size < smallest or size & (size - 1):
      raise ValueError(f"gmm: {name}={size} must be a power of 2 of at least {smallest} (Triton's block shapes).")
  if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
    raise ValueError(f"gmm: lhs [M, K] and rhs [G, K, N] expected; got lhs {lhs.shape} and rhs {rhs.shape}.")
  if fp8 and not all(jnp.issubdtype(a.dtype, jnp.floating) and jnp.finfo(a.dtype).bits == 8 for a in (lhs, rhs)):
    raise ValueError(f"gmm: FP8 products take float8 operands; got {lhs.dtype} and {rhs.dtype}.")
  if not fp8 and (lhs.dtype != rhs.dtype or not any(lhs.dtype == d for d in _DTYPES)):
    raise ValueError(f"gmm: lhs and rhs must share one of bfloat16, float16, float32; got {lhs.dtype}, {rhs.dtype}.")
  if lhs.shape[0] % blocks.tile_m:
    raise ValueError(f"gmm: lhs has {lhs.shape[0]} rows, not a multiple of tile_m={blocks.tile_m}.")
  if tile_groups.shape != (lhs.shape[0] // blocks.tile_m,) or not jnp.issubdtype(tile_groups.dtype, jnp.integer):
    raise ValueError(
      f"gmm: tile_groups must be integers [M // tile_m] = [{lhs.shape[0] // blocks.tile_m}];"
      f" got {tile_groups.dtype}{list(tile_groups.shape)}."
    )
  padded = lambda size: -(-size // blocks.pad_to) * blocks.pad_to
  (m, k), (g, _, n) = lhs.shape, rhs.shape
  for name, size in (("lhs", m * padded(k)), ("rhs", g * padded(k) * padded(n)), ("the output", m * padded(n))):
    if size >= 2**31:
      raise ValueError(
        f"gmm: {name} holds {size} elements (padded to the blocks); the kernels address with int32"
        " offsets, under 2**31: split the call."
      )


def _pad(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  extra = -x.shape[axis] % multiple
  return x if not extra else jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])


def gmm(
  lhs: jax.Array,
  rhs: jax.Array,
  tile_groups: jax.Array,
  *,
  tile_m: int = 128,
  block_n: int = 128,
  block_k: int = 64,
  wgrad_block_k: int = 128,
  num_warps: int = 4,
  num_stages: int = 3,
  interpret: bool = False,
) -> jax.Array:
  """The grouped matmul ``out[tile t] = lhs[tile t] @ rhs[tile_groups[t]]`` (zeros where the group is -1).

  Args:
    lhs: [M, K], rows sorted by group, each group padded with zero rows to a multiple of ``tile_m``.
    rhs: [G, K, N], ``lhs``'s dtype (bfloat16, float16 or float32).
    tile_groups: [M // tile_m] int32, each row tile's group: ascending from tile 0, contiguous, -1 past the last.
    tile_m: rows per tile (the padding unit of the groups); a power of 2.
    block_n: output columns per kernel instance (and N columns per weight-gradient tile); a power of 2.
    block_k: the contraction's step (rows per step of the weight gradient); a power of 2.
    wgrad_block_k: K rows per weight-gradient tile; a power of 2.
    num_warps: Triton warps per kernel instance.
    num_stages: Triton's software-pipelining stages of the contraction loops.
    interpret: run the kernels in Pallas' interpreter (any backend) instead of compiling them for a GPU.

  Returns:
    [M, N] in ``lhs``'s dtype, accumulated in float32; differentiable in ``lhs`` and ``rhs``.

  Raises:
    ValueError: shapes, dtypes or block sizes that break the layout contract (the culprit named).
  """
  blocks = _Blocks(tile_m, block_n, block_k, wgrad_block_k, num_warps, num_stages, bool(interpret))
  _check(lhs, rhs, tile_groups, blocks)
  n = rhs.shape[2]
  lhs_padded = _pad(lhs, 1, blocks.pad_to)
  rhs_padded = _pad(_pad(rhs, 1, blocks.pad_to), 2, blocks.pad_to)
  out = _gmm(lhs_padded, rhs_padded, tile_groups.astype(jnp.int32), blocks)
  return out if out.shape[1] == n else out[:, :n]


@dataclasses.dataclass(frozen=True)
class Fp8Products:
  """The three products of an FP8 grouped matmul as these kernels: ``kernels/fp8.py``'s custom VJP calls
  ``products(tile_groups)`` (``fp8.grouped_matmul``) and scales around them. Each takes float8 operands in the
  layout above and gives float32:

  - ``x · w``, e4m3 × e4m3: the weights are transposed to [G, N, K] first, so that both tiles hold the
    contraction contiguous, the only layout Hopper's FP8 tensor-core instructions take;
  - ``d x = g · wᵀ`` and the weights' gradient by group, e5m2 × e4m3: multiplied as float16 (``_common``;
    Triton's dot takes one operand type), the same products.

  Made by ``fp8_products``. Hashable: a ``custom_vjp`` non-differentiable argument.
  """

  groups: int  # G, the weights' groups
  blocks: _Blocks

  def _call(self, lhs: jax.Array, rhs: jax.Array, tile_groups: jax.Array) -> jax.Array:
    """``lhs [M, C] · rhs [G, X, C]ᵀ`` by tile → [M, X] float32, the contraction C and X padded to the blocks."""
    blocks, to = self.blocks, self.blocks.pad_to
    groups, columns, contraction = rhs.shape
    _check(lhs, jax.ShapeDtypeStruct((groups, contraction, columns), rhs.dtype), tile_groups, blocks, fp8=True)
    out = _grouped(
      _pad(lhs, 1, to), _pad(_pad(rhs, 1, to), 2, to), tile_groups.astype(jnp.int32), blocks, True, jnp.float32
    )
    return out[:, :columns]

  def forward(self, x: jax.Array, w: jax.Array, tile_groups: jax.Array) -> jax.Array:
    """[M, K] · [G, K, N] → [M, N]."""
    return self._call(x, jnp.swapaxes(w, 1, 2), tile_groups)

  def input_grad(self, g: jax.Array, w: jax.Array, tile_groups: jax.Array) -> jax.Array:
    """[M, N] · [G, K, N]ᵀ → [M, K]."""
    return self._call(g, w, tile_groups)

  def weight_grad(self, x: jax.Array, g: jax.Array, tile_groups: jax.Array) -> jax.Array:
    """Σ over each group's tiles of x[t]ᵀ · g[t] → [G, K, N]."""
    blocks, (k, n) = self.blocks, (x.shape[1], g.shape[1])
    out = _wgrad(
      _pad(x, 1, blocks.pad_to),
      _pad(g, 1, blocks.pad_to),
      tile_groups.astype(jnp.int32),
      self.groups,
      blocks,
      jnp.float32,
    )
    return out[:, :k, :n]

  def products(self, tile_groups: jax.Array):
    """``(x·w, g·wᵀ, xᵀ·g)`` as functions of their two operands, the order ``kernels/fp8.py`` takes."""
    return (
      lambda a, b: self.forward(a, b, tile_groups),
      lambda g, b: self.input_grad(g, b, tile_groups),
      lambda a, g: self.weight_grad(a, g, tile_groups),
    )


def fp8_products(
  groups: int,
  *,
  tile_m: int = 128,
  block_n: int = 128,
  block_k: int = 64,
  wgrad_block_k: int = 128,
  num_warps: int = 4,
  num_stages: int = 3,
  interpret: bool = False,
) -> Fp8Products:
  """``Fp8Products`` over ``groups`` weight groups, with ``gmm``'s blocks (the same arguments)."""
  return Fp8Products(groups, _Blocks(tile_m, block_n, block_k, wgrad_block_k, num_warps, num_stages, bool(interpret)))
