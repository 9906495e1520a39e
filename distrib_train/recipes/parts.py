"""The parts every layer variant is made of: a layer's ``Kind``, an annotated param, RMSNorm, a projection.

``project`` is one weight's einsum: in FP8 where ``model.fp8`` asks
(``kernels/fp8``), plus its LoRA adapter's delta where the config gives one
(``lora.py``).

Not for: the variants themselves (``attention.py``: GQA and MLA;
``blocks.py``: the MLPs and a whole layer).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from distrib_train.kernels import fp8
from distrib_train.recipes import lora


@dataclasses.dataclass(frozen=True)
class Kind:
  """What one layer composes: experts or a gated MLP, a sliding window or full attention."""

  mixture: bool = False
  sliding: bool = False


def param(
  rngs: nnx.Rngs,
  shape: tuple[int, ...],
  axes: tuple[str | None, ...],
  dtype: Any,
  fan_in: int | None,
  value: float | None = None,
) -> nnx.Param:
  """A param of ``shape`` annotated with its logical ``axes``: normal / √fan_in, or filled with ``value``."""
  if value is not None:
    data = jnp.full(shape, value, dtype)
  else:
    data = jax.random.normal(rngs.params(), shape, dtype) / math.sqrt(fan_in)
  return nnx.Param(data, out_sharding=axes)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
  """RMSNorm of ``x`` over its last axis, times ``offset + scale`` (Gemma's norms: 1 + w), in float32."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (normed * (offset + scale.astype(jnp.float32))).astype(x.dtype)


def norm(config, x, scale):
  """RMSNorm with the config's epsilon and weight offset."""
  return rms_norm(x, scale, config.norm_eps, config.norm_weight_offset)


def project(subscripts: str, x: jax.Array, layer: dict, name: str, config=None) -> jax.Array:
  """``x`` times the layer's weight ``name`` by ``subscripts`` (FP8 where asked), plus LoRA's delta with ``config``."""
  out = fp8.einsum(subscripts, x, layer[name].astype(x.dtype), layer.get(f"fp8_{name}"))
  adapted = lora.delta(subscripts, x, layer, name, config) if config is not None and config.lora_rank else None
  return out if adapted is None else out + adapted


def token_weights(targets: jax.Array, segment_ids: jax.Array | None, weights: jax.Array | None) -> jax.Array:
  """Each target's loss weight: ``weights`` where given, else 1 on a document's tokens (0 on a packed row's
  padding, segment 0)."""
  if weights is not None:
    return weights
  return jnp.ones(targets.shape, jnp.float32) if segment_ids is None else (segment_ids > 0).astype(jnp.float32)
