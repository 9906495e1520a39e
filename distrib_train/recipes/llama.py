"""A Llama-style decoder in flax nnx, annotated with logical axes.

RMSNorm, rotary position embeddings, a SwiGLU MLP, grouped-query attention
through ``jax.nn.dot_product_attention`` (cuDNN flash attention on
GPU where it runs, XLA elsewhere) or, on TPU, splash attention
(``attention.py``). Params are float32 and the compute dtype is
bfloat16 by default. The blocks' params are stacked along a leading
``layers`` axis, so the forward pass either scans over them (``scan_layers``,
one compiled block) or unrolls a Python loop; ``remat`` picks a
rematerialisation policy per block.

Logical axes: ``batch``, ``length``, ``embed``, ``heads``, ``kv_heads``,
``head_dim``, ``mlp``, ``vocab``, ``layers``. Activations are constrained
with ``axis_rules.constrain`` (a no-op outside ``activation_sharding``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import distrib_train.microbatches as microbatching
from distrib_train.parallel import context
from distrib_train.recipes import attention_kernels, fp8
from distrib_train.parallel.pipeline import layer_stack
from distrib_train.recipes.cross_entropy import chunked_cross_entropy
from distrib_train.recipes.family import Capabilities
from distrib_train.sharding.axis_rules import constrain

_REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape and numerics of a Llama-style decoder."""

  vocab_size: int = 32000
  d_model: int = 768
  num_layers: int = 12
  num_heads: int = 12
  num_kv_heads: int = 12
  head_dim: int = 64
  mlp_dim: int = 2048
  max_seq_len: int = 1024
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: str = "none"
  scan_layers: bool = True
  attention: str = "auto"  # "auto" (attention_kernels.choose), "xla", "cudnn" or "splash" (TPU)
  max_segments: int = 8  # runs a packed row may hold in cuDNN's packed attention (cudnn_attention.py); 0: a mask
  loss_chunk_size: int = 1024  # tokens per cross-entropy chunk (per sequence)
  loss_remat: bool = True  # recompute each chunk's logits in the backward pass (False: keep them, more memory)
  tie_embeddings: bool = False  # the output head is the embedding table (Llama 3.2 1B/3B, small Qwen2.5)
  attention_bias: bool = False  # biases on the q, k and v projections (Qwen2)
  rope_scaling: str = "none"  # "none", "linear" or "llama3" (Llama 3.1's frequency-dependent scaling)
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0  # llama3 scaling only
  rope_high_freq_factor: float = 4.0  # llama3 scaling only
  rope_original_max_len: int = 8192  # llama3 scaling only
  context_attention: str = "ring"  # with a context mesh axis: "ring" or "all_gather" (parallel/context.py)
  fp8: str = "none"  # "none", "current" or "delayed": the projections' operands rounded to FP8 (recipes/fp8.py)
  fp8_amax_history: int = 16  # steps of amax each delayed scale is taken from (fp8 "delayed" only)
  fp8_min_dim: int = 2048  # a matmul whose weight is smaller along its contraction or output stays bf16 (fp8.active)

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}).")
    if self.remat not in _REMAT_POLICIES:
      raise ValueError(f"remat must be one of {sorted(_REMAT_POLICIES)}, got {self.remat!r}.")
    if self.rope_scaling not in ("none", "linear", "llama3"):
      raise ValueError(f"rope_scaling must be 'none', 'linear' or 'llama3', got {self.rope_scaling!r}.")
    fp8.check_mode(self.fp8)
    if self.fp8_amax_history < 1:
      raise ValueError(f"fp8_amax_history must be at least 1, got {self.fp8_amax_history}.")
    if self.context_attention not in ("ring", "all_gather"):
      raise ValueError(f"context_attention must be 'ring' or 'all_gather', got {self.context_attention!r}.")
    if isinstance(self.max_segments, bool) or not isinstance(self.max_segments, int) or not (
        self.max_segments == 0 or self.max_segments >= 2):
      raise ValueError(f"max_segments must be 0 (a dense segment mask) or at least 2 (a document and the"
                       f" padding), got {self.max_segments!r}.")
    if self.attention not in attention_kernels.REQUESTS:
      raise ValueError(f"attention must be 'auto', 'xla', 'cudnn' or 'splash', got {self.attention!r}.")

  def num_params(self) -> int:
    """Every parameter, embeddings and output head included."""
    d, h, kv, hd, f = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, self.mlp_dim
    per_layer = d * h * hd * 2 + d * kv * hd * 2 + 3 * d * f + 2 * d
    if self.attention_bias:
      per_layer += (h + 2 * kv) * hd
    return self.num_layers * per_layer + (1 if self.tie_embeddings else 2) * self.vocab_size * d + d

  def flops_per_token(self, seq_len: int) -> int:
    """Training FLOPs per token, PaLM's count: 6·N + 12·L·(heads·head_dim)·S."""
    return 6 * self.num_params() + 12 * self.num_layers * self.num_heads * self.head_dim * seq_len

  def capabilities(self) -> Capabilities:
    """What the model runs (the family protocol, ``family.py``)."""
    return Capabilities(fp8=self.fp8, attention=self.attention, max_segments=self.max_segments, dtype=self.dtype,
                        remat=self.remat, num_layers=self.num_layers, d_model=self.d_model,
                        num_heads=self.num_heads, mlp_dim=self.mlp_dim)

  def build(self, rngs: nnx.Rngs | int = 0) -> Llama:
    """A freshly initialised model (annotations are logical: no eager sharding)."""
    rngs = nnx.Rngs(rngs) if isinstance(rngs, int) else rngs
    with nnx.use_eager_sharding(False):
      return Llama(self, rngs=rngs)


PRESETS: dict[str, LlamaConfig] = {
    # Trains in seconds on CPU; byte-level vocabulary.
    "tiny": LlamaConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        mlp_dim=192, max_seq_len=256, dtype="float32", loss_chunk_size=64, fp8_min_dim=0),
    "124m": LlamaConfig(d_model=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64, mlp_dim=2048),
    "350m": LlamaConfig(d_model=1024, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=64, mlp_dim=2816),
    "1b": LlamaConfig(d_model=2048, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=128, mlp_dim=5632,
                      max_seq_len=2048),
    "7b": LlamaConfig(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, mlp_dim=11008,
                      max_seq_len=4096, remat="full"),
    "70b": LlamaConfig(d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, mlp_dim=28672,
                       max_seq_len=4096, remat="full"),
}


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype: Any, fan_in: int | None,
           value: float | None = None) -> nnx.Param:
  if value is not None:
    data = jnp.full(shape, value, dtype)
  else:
    data = jax.random.normal(rngs.params(), shape, dtype) / math.sqrt(fan_in)
  return nnx.Param(data, out_sharding=axes)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(config: LlamaConfig, dim: int) -> jax.Array:
  """The rotary frequencies of ``dim``-wide heads, scaled as ``config.rope_scaling`` says.

  ``linear`` divides every frequency by ``rope_factor``; ``llama3`` (Llama
  3.1) divides the low frequencies (wavelengths above ``original / low``)
  by ``rope_factor``, keeps the high ones (wavelengths below ``original /
  high``) and blends in between.
  """
  half = dim // 2
  freqs = config.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if config.rope_scaling == "linear":
    return freqs / config.rope_factor
  if config.rope_scaling == "llama3":
    wavelength = 2 * math.pi / freqs
    low_wavelength = config.rope_original_max_len / config.rope_low_freq_factor
    high_wavelength = config.rope_original_max_len / config.rope_high_freq_factor
    smooth = (config.rope_original_max_len / wavelength - config.rope_low_freq_factor) / (
        config.rope_high_freq_factor - config.rope_low_freq_factor)
    blended = (1 - smooth) * freqs / config.rope_factor + smooth * freqs
    return jnp.where(wavelength > low_wavelength, freqs / config.rope_factor,
                     jnp.where(wavelength < high_wavelength, freqs, blended))
  return freqs


def rotary(x: jax.Array, positions: jax.Array, theta: float | jax.Array) -> jax.Array:
  """Rotary embedding on the last axis of ``x`` [batch, length, heads, dim]; ``theta`` is the base, or
  the frequencies themselves (``rope_frequencies``)."""
  half = x.shape[-1] // 2
  if isinstance(theta, (int, float)):
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  else:
    freqs = theta
  angles = positions[..., None].astype(jnp.float32) * freqs  # [batch, length, half]
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _attention(config: LlamaConfig, q, k, v, positions, segment_ids):
  """Causal attention of ``q``, ``k``, ``v`` [batch, length, heads, head_dim], each document to itself, by the
  kernel ``attention_kernels`` picks."""
  layer = attention_kernels.Attention(requested=config.attention, max_segments=config.max_segments,
                                      context=config.context_attention)
  return attention_kernels.attention(q, k, v, layer, positions=positions, segment_ids=segment_ids)


def attention_sublayer(config: LlamaConfig, x, layer, positions, segment_ids):
  """``x`` plus the attention of one layer (pre-norm): the first half of a decoder block."""
  dtype = jnp.dtype(config.dtype)
  w = {k: layer[k].astype(dtype) for k in ("wq", "wk", "wv", "wo", "bq", "bk", "bv") if k in layer}
  h = rms_norm(x, layer["attn_norm"], config.norm_eps)
  q = fp8.einsum("btd,dnh->btnh", h, w["wq"], layer.get("fp8_wq"))
  k = fp8.einsum("btd,dkh->btkh", h, w["wk"], layer.get("fp8_wk"))
  v = fp8.einsum("btd,dkh->btkh", h, w["wv"], layer.get("fp8_wv"))
  if config.attention_bias:
    q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
  freqs = rope_frequencies(config, q.shape[-1])
  q = constrain(rotary(q, positions, freqs), ("batch", "length", "heads", "head_dim"))
  k = constrain(rotary(k, positions, freqs), ("batch", "length", "kv_heads", "head_dim"))
  attn = _attention(config, q, k, v, positions, segment_ids)
  out = fp8.einsum("btnh,nhd->btd", attn, w["wo"], layer.get("fp8_wo"))
  return x + constrain(out, ("batch", "length", "embed"))


def swiglu(h: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
           histories: tuple[jax.Array | None, ...] = (None, None, None)) -> jax.Array:
  """The SwiGLU MLP on ``h`` [batch, length, embed]; ``histories``: the three matmuls' FP8 amax histories."""
  gate = fp8.einsum("btd,df->btf", h, w_gate.astype(h.dtype), histories[0])
  up = fp8.einsum("btd,df->btf", h, w_up.astype(h.dtype), histories[1])
  hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
  out = fp8.einsum("btf,fd->btd", hidden, w_down.astype(h.dtype), histories[2])
  return constrain(out, ("batch", "length", "embed"))


def _block(config: LlamaConfig, x, layer, positions, segment_ids):
  """One decoder block on ``x`` [batch, length, embed] with one layer's params."""
  x = attention_sublayer(config, x, layer, positions, segment_ids)
  h = rms_norm(x, layer["mlp_norm"], config.norm_eps)
  return x + swiglu(h, layer["w_gate"], layer["w_up"], layer["w_down"],
                    tuple(layer.get(f"fp8_{k}") for k in ("w_gate", "w_up", "w_down")))


class Llama(nnx.Module):
  """The decoder; ``model(tokens)`` returns the final hidden states.

  Use ``logits(hidden)`` or, for training, ``loss_fn`` (chunked
  cross-entropy that never materialises float32 [batch, length, vocab]).
  """

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.config = config
    c, pd = config, jnp.dtype(config.param_dtype)
    L, d, h, kv, hd, f = c.num_layers, c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim
    self.embed = _param(rngs, (c.vocab_size, d), ("vocab", "embed"), pd, fan_in=1)
    self.layers = nnx.Dict({
        "attn_norm": _param(rngs, (L, d), ("layers", "embed"), pd, None, value=1.0),
        "wq": _param(rngs, (L, d, h, hd), ("layers", "embed", "heads", "head_dim"), pd, fan_in=d),
        "wk": _param(rngs, (L, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"), pd, fan_in=d),
        "wv": _param(rngs, (L, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"), pd, fan_in=d),
        "wo": _param(rngs, (L, h, hd, d), ("layers", "heads", "head_dim", "embed"), pd, fan_in=h * hd),
        "mlp_norm": _param(rngs, (L, d), ("layers", "embed"), pd, None, value=1.0),
        **self._mlp_params(rngs),
    })
    if c.attention_bias:
      self.layers["bq"] = _param(rngs, (L, h, hd), ("layers", "heads", "head_dim"), pd, None, value=0.0)
      self.layers["bk"] = _param(rngs, (L, kv, hd), ("layers", "kv_heads", "head_dim"), pd, None, value=0.0)
      self.layers["bv"] = _param(rngs, (L, kv, hd), ("layers", "kv_heads", "head_dim"), pd, None, value=0.0)
    if c.fp8 == "delayed":  # one (3, history) amax history per layer and matmul, in local state
      for name in self._fp8_matmuls():
        self.layers[f"fp8_{name}"] = fp8.AmaxHistory(jnp.zeros((L, 3, c.fp8_amax_history), jnp.float32),
                                                     out_sharding=("layers", None, None))
    self.final_norm = _param(rngs, (d,), ("embed",), pd, None, value=1.0)
    if not c.tie_embeddings:
      self.head = _param(rngs, (d, c.vocab_size), ("embed", "vocab"), pd, fan_in=d)

  def _mlp_params(self, rngs: nnx.Rngs) -> dict[str, nnx.Param]:
    """Each layer's feed-forward params (a subclass's mixture of experts replaces them)."""
    c, pd = self.config, jnp.dtype(self.config.param_dtype)
    L, d, f = c.num_layers, c.d_model, c.mlp_dim
    return {"w_gate": _param(rngs, (L, d, f), ("layers", "embed", "mlp"), pd, fan_in=d),
            "w_up": _param(rngs, (L, d, f), ("layers", "embed", "mlp"), pd, fan_in=d),
            "w_down": _param(rngs, (L, f, d), ("layers", "mlp", "embed"), pd, fan_in=f)}

  def _remat_policy(self) -> Any:  # what the backward pass keeps of a block under remat
    return _REMAT_POLICIES[self.config.remat]

  def _fp8_matmuls(self) -> tuple[str, ...]:
    """The weights whose matmuls run in FP8 (each gets an amax history under ``delayed``)."""
    return ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

  def _block(self, carry, layer, positions, segment_ids):
    """One layer on the layer stack's carry (here the hidden states)."""
    return _block(self.config, carry, layer, positions, segment_ids)

  def _carry(self, x: jax.Array) -> Any:
    """The layer stack's carry for hidden states ``x``, and ``_hidden_and_aux`` to read it back."""
    return x

  def _hidden_and_aux(self, carry: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    return carry, {}

  def head_weight(self) -> jax.Array:
    """The output projection [embed, vocab]: the head, or the embedding table's transpose when tied."""
    return self.embed[...].T if self.config.tie_embeddings else self.head[...]

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    return self.hidden_and_aux(tokens, positions, segment_ids)[0]

  def hidden_and_aux(self, tokens: jax.Array, positions: jax.Array | None = None,
                     segment_ids: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The final hidden states and what the layers report besides (a mixture of experts' losses)."""
    c = self.config
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    # The table is gathered over its embedding side (fsdp) before the lookup: a lookup into the fsdp-sharded table
    # made XLA rematerialize it whole ("Involuntary full rematerialization") and moved about 40 % more bytes per
    # step (124m-like shape, 8 devices).
    table = constrain(self.embed[...], ("vocab", None))
    x = jnp.take(table, tokens, axis=0).astype(c.dtype)
    x = constrain(x, ("batch", "length", "embed"))
    layers = {k: v[...] for k, v in self.layers.items()}

    block = self._block
    if c.remat != "none":
      block = jax.checkpoint(block, policy=self._remat_policy())
    # A scan (or an unrolled loop) over the stacked layers; the stages of a pipeline when the step's mesh
    # has a stage axis (parallel/pipeline.py).
    if c.fp8 == "delayed" and (use := microbatching.active_pipelining()) is not None and use.request.stages > 1:
      raise ValueError("model.fp8=delayed does not run with a stage axis: the pipeline runs every layer once per"
                       " microbatch, and each run would write the layer's amax history. Use fp8=current.")
    with fp8.active(c.fp8, c.fp8_min_dim):
      carry = layer_stack(block, self._carry(x), layers,
                          per_example={"positions": positions, "segment_ids": segment_ids}, scan=c.scan_layers,
                          layer_axes={k: tuple(v.out_sharding) for k, v in self.layers.items()})
    x, aux = self._hidden_and_aux(carry)
    return rms_norm(x, self.final_norm[...], c.norm_eps), aux

  def logits(self, hidden: jax.Array) -> jax.Array:
    return jnp.einsum("btd,dv->btv", hidden, self.head_weight().astype(hidden.dtype))


def loss_fn(*, model: Llama, state: Any, rng: jax.Array, tokens: jax.Array, targets: jax.Array,
            segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
            weights: jax.Array | None = None) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
  """Mean next-token cross-entropy (penzai contract); aux has loss and tokens.

  On a mesh with a context axis the tokens are taken in its load-balanced order (``parallel/context.py``);
  the loss, a sum over tokens, is the same.
  """
  del rng
  tokens, rest = context.reorder(tokens, targets=targets, positions=positions, segment_ids=segment_ids,
                                 weights=weights)
  targets, positions, segment_ids, weights = (rest[k] for k in ("targets", "positions", "segment_ids", "weights"))
  hidden = model(tokens, positions=positions, segment_ids=segment_ids)
  if weights is None:
    weights = jnp.ones(targets.shape, jnp.float32) if segment_ids is None else (segment_ids > 0).astype(jnp.float32)
  total, count = chunked_cross_entropy(hidden, model.head_weight(), targets, weights, model.config.loss_chunk_size,
                                       model.config.loss_remat)
  loss = total / jnp.maximum(count, 1.0)
  return loss, state, {"loss": loss, "tokens": count}


INPUT_AXES = {
    "tokens": ("batch", "length"),
    "targets": ("batch", "length"),
    "segment_ids": ("batch", "length"),
    "positions": ("batch", "length"),
    "weights": ("batch", "length"),
}
