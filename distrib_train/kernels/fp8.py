"""FP8 matmuls for the reference models (``model.fp8``): float8 operands, per-tensor scales.

``model.fp8: current | delayed`` makes the Llama's projections (q, k, v,
attention output, the MLP's three matrices) and a mixture's expert matmuls
(shared experts; the routed experts' grouped matmuls) multiply float8
operands: activations and weights in e4m3 in the forward pass, the gradient
arriving at the matmul's output in e5m2 in the backward pass (times e4m3
operands), each with one scale for the whole tensor and float32
accumulation. The embedding, the head and attention's scores stay in the
model's dtype.

- ``current``: each scale is ``fp8 max / amax`` of the tensor itself at that
  step.
- ``delayed``: each scale comes from the largest amax of the tensor's last
  ``fp8_amax_history`` steps (a tensor that outgrows it saturates), kept per
  layer and matmul in ``AmaxHistory`` local state (newest first; an empty
  history, the first step, gives a scale of 1, as in flax's FP8 ops and
  Transformer Engine). No cast waits for its own tensor's amax, so XLA can
  fuse the cast into the kernel that makes the tensor, one read fewer than
  ``current`` where it does (``tests/test_podplan_gpu.py``). The gradient's amax is
  only known in the backward pass, so the histories are written there, as
  their "gradient" (``OverwriteWithGradient``): the step carries, shards and
  checkpoints them with the rest of the local state and the optimizer never
  sees them. The routed experts use current scaling under either mode (a
  history read inside their ``shard_map`` would have its written value summed
  over the shards), and a pipeline refuses ``delayed`` (it runs a layer once
  per microbatch).

Each matmul is one custom VJP whose three products (``y = x·w``, ``dx = g·wᵀ``,
``dw = xᵀ·g``) are ``dot_general`` / ``ragged_dot`` on float8 arrays, divided by
the two scales after (in float32). A dense product writes the model's dtype
where that is bf16 (float32's exponent range), not float32: the GEMM
accumulates in float32 either way, and a float32 result cost the kernel after
it a read and a write more (bench/NOTES.md, lever 20: 1.165 → 1.287 × bf16 for
the 1b on an H200). A float16 model's products write float32, whose range
holds them; ``ragged_dot`` writes float32. On GPUs
with FP8 the routed experts' are the grouped Triton kernels instead
(``grouped_matmul``): the forward product on FP8 operands, the two backward
ones (e5m2 × e4m3, which Triton's dot does not mix) as float16, at bf16's
rate. XLA's GPU
compiler keeps these as FP8 GEMMs for Hopper (checked with its CUDA compiler
on a host without a GPU: ``tests/test_podplan_gpu.py``); a quantize →
dequantize written around a bf16 matmul lost its rounding there, its f32 → f8
→ f32 converts simplified away. CPU and TPU compute the same numbers. The
backward pass keeps the float8 operands as residuals, half the bytes of bf16.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from distrib_train.models.nnx_model import OverwriteWithGradient

MODES = ("none", "current", "delayed")
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# The three tensors of one matmul that carry a history under ``delayed``: rows of its (3, history) array.
OPERAND_X, OPERAND_W, OUTPUT_GRAD = 0, 1, 2

_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("distrib_train_fp8", default="none")
_MIN_DIM: contextvars.ContextVar[int] = contextvars.ContextVar("distrib_train_fp8_min_dim", default=0)


def check_mode(mode: str) -> None:
  if mode not in MODES:
    raise ValueError(f"fp8 must be one of {', '.join(MODES)}, got {mode!r}.")


@contextlib.contextmanager
def active(mode: str, min_dim: int = 0) -> Iterator[None]:
  """Makes ``einsum`` round its operands to FP8 while a model is traced (``mode`` in ``MODES``).

  ``min_dim``: the per-matmul policy. A matmul whose weight has fewer than
  ``min_dim`` elements along the contraction or along the output stays in the
  model's dtype: its FP8 GEMM saves less than the scaling passes over its
  operands cost (on one H100, ``fp8=current`` everywhere made the 124m and
  350m presets 0.78 × and 0.84 × as fast as bf16, the 1b 1.06 ×).
  """
  check_mode(mode)
  token, min_token = _MODE.set(mode), _MIN_DIM.set(min_dim)
  try:
    yield
  finally:
    _MODE.reset(token)
    _MIN_DIM.reset(min_token)


def _pays(contraction: int, output: int) -> bool:
  """Whether the policy of ``active`` gives a matmul of this weight FP8 operands."""
  return min(contraction, output) >= _MIN_DIM.get()


def mode() -> str:
  """The FP8 mode of the model being traced (``"none"`` outside ``active``)."""
  return _MODE.get()


class AmaxHistory(OverwriteWithGradient):
  """A matmul's amax histories under ``delayed`` scaling: float32 [..., 3, history], rows ``OPERAND_X``,
  ``OPERAND_W``, ``OUTPUT_GRAD``, newest first. Local state written by the backward pass (the gradient's amax
  is only known there), checkpointed with the rest of the train state, never seen by the optimizer."""


def _largest(dtype) -> float:
  return float(jnp.finfo(dtype).max)


def _amax(x: jax.Array, axes: tuple[str, ...] = ()) -> jax.Array:
  """The largest magnitude in ``x``; inside ``shard_map``, over the shards of mesh ``axes`` too."""
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
  return jax.lax.stop_gradient(jax.lax.pmax(amax, axes) if axes else amax)


def _scale(amax: jax.Array, dtype) -> jax.Array:
  return jnp.where(amax > 0, _largest(dtype) / jnp.maximum(amax, 1e-30), 1.0)


def quantize_dequantize(x: jax.Array, dtype, axes: tuple[str, ...] = ()) -> jax.Array:
  """``x`` rounded to ``dtype`` (an FP8 type) with one scale for the whole tensor, saturating, and back.

  Inside ``shard_map`` ``axes`` names the mesh axes ``x`` is split over, so the scale is the whole tensor's.
  """
  scale = _scale(_amax(x, axes), dtype)
  return (_to_fp8(x, dtype, scale).astype(jnp.float32) / scale).astype(x.dtype)


def _to_fp8(x: jax.Array, dtype, scale: jax.Array) -> jax.Array:
  """``x`` times ``scale``, saturated to ``dtype``'s range and cast to it: the FP8 operand of a matmul."""
  largest = _largest(dtype)
  return jnp.clip(x.astype(jnp.float32) * scale, -largest, largest).astype(dtype)


def _scale_for(amax: jax.Array, history: jax.Array | None, dtype) -> jax.Array:
  """Current scaling (no history), or the history's largest finite amax (an empty history: 1; a NaN or inf
  written by a step that went non-finite is passed over). Never both: a fallback to the current amax would make
  the cast wait for it again (bench/NOTES.md lever 16)."""
  if history is None:
    return _scale(amax, dtype)
  return _scale(jnp.max(jnp.where(jnp.isfinite(history), history, 0.0)), dtype)


def _push(history: jax.Array, amax: jax.Array) -> jax.Array:
  return jnp.roll(history, 1).at[0].set(amax)


def delayed_quantize_dequantize(x: jax.Array, dtype, history: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``x`` rounded to ``dtype`` with the scale of the largest amax in ``history`` (saturating where ``x``
  outgrew it), and the history with ``x``'s own amax pushed in front. An empty history (all zeros: the first
  step) gives a scale of 1."""
  amax = _amax(x)
  scale = _scale_for(amax, history, dtype)
  return (_to_fp8(x, dtype, scale).astype(jnp.float32) / scale).astype(x.dtype), _push(history, amax)


# How each kind of matmul multiplies FP8 operands (float32 accumulation), and its two transposes.
_RAGGED_DW = jax.lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


def _product_dtype(dtype) -> jnp.dtype:
  """What a dense product writes for a model in ``dtype``: bf16 or float32 itself (float32's exponent range holds
  the unscaled product, up to about 8e11); float32 for any other, such as float16 (65,504 at most)."""
  dtype = jnp.dtype(dtype)
  return dtype if dtype in (jnp.bfloat16, jnp.float32) else jnp.dtype(jnp.float32)


def _products(kind: tuple, extra: jax.Array | None, dtype=jnp.float32):
  """The three products; a dense one writes ``_product_dtype(dtype)`` (float32 accumulation inside the GEMM, one
  rounding at its output, which is then divided by the scales in float32)."""
  f32 = jnp.float32
  dtype = _product_dtype(dtype)
  if kind[0] == "kernels":  # a grouped matmul's own kernels (grouped_matmul)
    return kind[1].products(extra)
  if kind[0] == "einsum":
    x_sub, w_sub, out_sub = kind[1:]
    return (
      lambda a, b: jnp.einsum(f"{x_sub},{w_sub}->{out_sub}", a, b, preferred_element_type=dtype),
      lambda g, b: jnp.einsum(f"{out_sub},{w_sub}->{x_sub}", g, b, preferred_element_type=dtype),
      lambda a, g: jnp.einsum(f"{x_sub},{out_sub}->{w_sub}", a, g, preferred_element_type=dtype),
    )
  return (
    lambda a, b: jax.lax.ragged_dot(a, b, extra, preferred_element_type=f32),
    lambda g, b: jax.lax.ragged_dot(g, jnp.swapaxes(b, 1, 2), extra, preferred_element_type=f32),
    lambda a, g: jax.lax.ragged_dot_general(a, g, extra, _RAGGED_DW, preferred_element_type=f32),
  )


def _matmul_fwd(kind, axes, x, w, history, extra):
  ax, aw = _amax(x, axes), _amax(w, axes)
  sx = _scale_for(ax, None if history is None else history[OPERAND_X], E4M3)
  sw = _scale_for(aw, None if history is None else history[OPERAND_W], E4M3)
  qx, qw = _to_fp8(x, E4M3, sx), _to_fp8(w, E4M3, sw)
  y = (_products(kind, extra, x.dtype)[0](qx, qw) / (sx * sw)).astype(x.dtype)
  return y, (qx, qw, sx, sw, ax, aw, history, extra)


def _matmul_bwd(kind, axes, residuals, g):
  qx, qw, sx, sw, ax, aw, history, extra = residuals
  ag = _amax(g, axes)
  sg = _scale_for(ag, None if history is None else history[OUTPUT_GRAD], E5M2)
  qg = _to_fp8(g, E5M2, sg)
  _, product_dx, product_dw = _products(kind, extra, g.dtype)
  dx = (product_dx(qg, qw) / (sg * sw)).astype(g.dtype)
  dw = (product_dw(qx, qg) / (sx * sg)).astype(g.dtype)
  written = None
  if history is not None:  # the next histories, as this "gradient" (AmaxHistory)
    written = jnp.stack([_push(history[OPERAND_X], ax), _push(history[OPERAND_W], aw), _push(history[OUTPUT_GRAD], ag)])
  return dx, dw, written, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul(kind, axes, x, w, history, extra):
  return _matmul_fwd(kind, axes, x, w, history, extra)[0]


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _einsum_kind(subscripts: str) -> tuple[str, str, str, str]:
  """``("einsum", x, w, out)`` index strings; each operand's indices must appear in the other or the output,
  so both transposes are einsums too."""
  inputs, _, out = subscripts.replace(" ", "").partition("->")
  x_sub, _, w_sub = inputs.partition(",")
  if (
    not out
    or not w_sub
    or any(len(set(s)) != len(s) for s in (x_sub, w_sub, out))
    or set(x_sub) - set(w_sub) - set(out)
    or set(w_sub) - set(x_sub) - set(out)
  ):
    raise ValueError(
      f"fp8.einsum takes two operands whose every index is in the other or in the output,"
      f" 'xy,yz->xz' style; got {subscripts!r}."
    )
  return ("einsum", x_sub, w_sub, out)


def einsum(subscripts: str, x: jax.Array, w: jax.Array, history: jax.Array | None = None) -> jax.Array:
  """``jnp.einsum(subscripts, x, w)``; inside ``active``, an FP8 matmul (module docstring).

  ``history`` is the matmul's ``AmaxHistory`` value (3, history length); ``delayed`` needs it.
  """
  current = _MODE.get()
  kind = _einsum_kind(subscripts)
  if current != "none":
    _, x_sub, w_sub, out = kind
    sizes = dict(zip(w_sub, w.shape))
    contraction = math.prod(n for c, n in sizes.items() if c in x_sub and c not in out)
    if not _pays(contraction, math.prod(n for c, n in sizes.items() if c in out)):
      current = "none"
  if current == "none":
    return jnp.einsum(subscripts, x, w)
  if current == "delayed" and history is None:
    raise ValueError("model.fp8=delayed: this matmul was given no amax history (fp8.AmaxHistory local state).")
  return _matmul(kind, (), x, w.astype(x.dtype), history if current == "delayed" else None, None)


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, axes: tuple[str, ...] = ()) -> jax.Array:
  """``jax.lax.ragged_dot`` (the routed experts' grouped matmul); inside ``active``, an FP8 grouped matmul with
  current scaling in either mode (an amax history read inside ``shard_map``, where the experts run, would
  have its written value summed over the shards). ``axes``: the mesh axes the operands are split over inside
  ``shard_map``, so each scale is the whole tensor's."""
  if _MODE.get() == "none":  # no per-matmul policy: inside shard_map ``w`` is a shard, its sizes not the weight's
    return jax.lax.ragged_dot(x, w, group_sizes)
  return _matmul(("ragged",), tuple(axes), x, w.astype(x.dtype), None, group_sizes)


def grouped_matmul(x: jax.Array, w: jax.Array, kernels, extra: jax.Array, axes: tuple[str, ...] = ()) -> jax.Array:
  """``ragged_dot``'s FP8 grouped matmul (current scaling, inside ``active``) with its three products run by
  ``kernels.products(extra)`` (``kernels.gmm_triton.Fp8Products``; ``extra``: its tiles' groups) instead of
  ``jax.lax.ragged_dot``, which XLA's CUDA compiler expands densely. ``kernels`` is hashable."""
  return _matmul(("kernels", kernels), tuple(axes), x, w.astype(x.dtype), None, extra)
