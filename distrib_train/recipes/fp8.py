"""FP8 matmuls for the reference models (``model.fp8``), by quantize-dequantize with current scaling.

``model.fp8: current`` makes the Llama's projections (q, k, v, attention
output, the MLP's three matrices; a mixture's shared experts) run with their
operands rounded to float8: activations and weights to e4m3 in the forward
pass, the gradient arriving at the matmul's output to e5m2 in the backward
pass, each with one scale per tensor computed from the tensor itself at
that step (``current`` scaling: ``scale = fp8 max / amax``). The embedding,
the head, attention's scores and the routed experts' grouped matmuls stay in
the model's dtype.

The rounding is written as quantize → dequantize around an ordinary
``jnp.einsum`` — the pattern XLA's GPU compiler rewrites into cuBLASLt FP8
GEMMs on Hopper (and flax's ``fp8_ops`` emit) — so on CPU and TPU the step
computes exactly the numbers an FP8 GEMM with float32 accumulation would
(products of FP8 values are exact in float32), at the speed of the model's
dtype. The gradients pass the operand rounding straight through.

``delayed`` scaling (scales from an amax history kept in local state) is not
built; ``model.fp8`` refuses it by name.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

MODES = ("none", "current")
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("distrib_train_fp8", default="none")


@contextlib.contextmanager
def active(mode: str) -> Iterator[None]:
  """Makes ``einsum`` round its operands to FP8 while a model is traced (``mode`` in ``MODES``)."""
  if mode not in MODES:
    raise ValueError(f"model.fp8 must be one of {', '.join(MODES)}, got {mode!r}"
                     + (" (delayed scaling is not built; use current)" if mode == "delayed" else "") + ".")
  token = _MODE.set(mode)
  try:
    yield
  finally:
    _MODE.reset(token)


def quantize_dequantize(x: jax.Array, dtype) -> jax.Array:
  """``x`` rounded to ``dtype`` (an FP8 type) with one scale for the whole tensor, saturating, and back."""
  wide = x.astype(jnp.float32)
  amax = jax.lax.stop_gradient(jnp.max(jnp.abs(wide)))
  largest = float(jnp.finfo(dtype).max)
  scale = jnp.where(amax > 0, largest / jnp.maximum(amax, 1e-30), 1.0)
  rounded = jnp.clip(wide * scale, -largest, largest).astype(dtype).astype(jnp.float32)
  return (rounded / scale).astype(x.dtype)


@jax.custom_vjp
def _operand(x: jax.Array) -> jax.Array:
  return quantize_dequantize(x, E4M3)


_operand.defvjp(lambda x: (quantize_dequantize(x, E4M3), None), lambda _, g: (g,))


@jax.custom_vjp
def _output(y: jax.Array) -> jax.Array:
  return y


_output.defvjp(lambda y: (y, None), lambda _, g: (quantize_dequantize(g, E5M2),))


def einsum(subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """``jnp.einsum(subscripts, x, w)``, with FP8 operands and output gradient inside ``active("current")``."""
  if _MODE.get() == "none":
    return jnp.einsum(subscripts, x, w)
  return _output(jnp.einsum(subscripts, _operand(x), _operand(w)))
