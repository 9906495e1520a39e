"""Rotary position embeddings: the frequencies of every scaling the families use, and the rotation.

``frequencies(rope, dim)`` gives the ``dim // 2`` rotary frequencies of a
``Rope`` (a base ``theta`` and a scaling): ``none``; ``linear`` (every
frequency divided by the factor); ``llama3`` (Llama 3.1: the low
frequencies divided by the factor, the high ones kept, a blend between);
``yarn`` (YaRN, as Hugging Face computes it for gpt-oss, DeepSeek-V3 and
Qwen3's long-context configs: a ramp between interpolated and extrapolated
frequencies over the dimensions whose rotations ``beta_fast`` and
``beta_slow`` bound, and an attention factor that scales the rotated
vectors). ``rotary(x, positions, freqs, factor)`` rotates the last axis of
``x`` in halves (Llama's layout), or, ``interleaved``, in adjacent pairs
(DeepSeek's: its output is laid out in halves, as Hugging Face's is; queries
and keys alike, so their products are unchanged).

Not for: which layer uses which base (``blocks.py``: Gemma 3's local layers
have their own).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

SCALINGS = ("none", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class Rope:
  """A rotary embedding: its base and scaling (``LlamaConfig``'s ``rope_*`` fields)."""

  theta: float = 10000.0
  scaling: str = "none"
  factor: float = 1.0
  low_freq_factor: float = 1.0  # llama3
  high_freq_factor: float = 4.0  # llama3
  original_max_len: int = 8192  # llama3 and yarn
  beta_fast: float = 32.0  # yarn
  beta_slow: float = 1.0  # yarn
  truncate: bool = True  # yarn: the ramp's bounds rounded out to whole dimensions
  mscale: float = 0.0  # yarn: the attention factor's numerator scale (0: plain)
  mscale_all_dim: float = 0.0  # yarn: its denominator's

  def attention_factor(self) -> float:
    """What the rotated vectors are multiplied by (YaRN's attention scaling; 1 for the others)."""
    if self.scaling != "yarn":
      return 1.0
    if self.mscale and self.mscale_all_dim:
      return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
    return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def frequencies(rope: Rope, dim: int) -> jax.Array:
  """The ``dim // 2`` rotary frequencies of ``dim``-wide rotated heads (module docstring)."""
  half = dim // 2
  freqs = rope.theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if rope.scaling == "linear":
    return freqs / rope.factor
  if rope.scaling == "llama3":
    wavelength = 2 * math.pi / freqs
    low_wavelength = rope.original_max_len / rope.low_freq_factor
    high_wavelength = rope.original_max_len / rope.high_freq_factor
    smooth = (rope.original_max_len / wavelength - rope.low_freq_factor) / (
      rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * freqs / rope.factor + smooth * freqs
    return jnp.where(
      wavelength > low_wavelength, freqs / rope.factor, jnp.where(wavelength < high_wavelength, freqs, blended)
    )
  if rope.scaling == "yarn":

    def bound(rotations: float) -> float:  # the dimension whose wavelength fits ``rotations`` in the context
      return dim * math.log(rope.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = bound(rope.beta_fast), bound(rope.beta_slow)
    if rope.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001
    ramp = jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return freqs / rope.factor * ramp + freqs * (1 - ramp)
  return freqs


def rotary(
  x: jax.Array, positions: jax.Array, freqs: jax.Array, factor: float = 1.0, interleaved: bool = False
) -> jax.Array:
  """``x`` [batch, length, heads, dim] rotated by ``positions`` [batch, length] at ``freqs`` [dim // 2], times
  ``factor``; ``interleaved`` rotates adjacent pairs and lays the result out in halves."""
  angles = positions[..., None].astype(jnp.float32) * freqs  # [batch, length, half]
  sin, cos = jnp.sin(angles)[:, :, None, :] * factor, jnp.cos(angles)[:, :, None, :] * factor
  x32 = x.astype(jnp.float32)
  if interleaved:
    x1, x2 = x32[..., 0::2], x32[..., 1::2]
  else:
    x1, x2 = jnp.split(x32, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
