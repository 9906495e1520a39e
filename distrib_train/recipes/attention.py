"""Attention, the first half of a decoder layer: GQA or MLA, projected apart from the kernel that attends.

- **GQA** (``wq``, ``wk``, ``wv``, ``wo``): optional q/k/v biases (Qwen2,
  gpt-oss) and output bias, an RMSNorm over each head of q and k before
  RoPE (``qk_norm``: Qwen3, Gemma 3), per-head sinks (gpt-oss), a softmax
  scale (``query_pre_attn_scalar``), a soft cap, a sliding window on the
  layer kinds that are ``sliding`` (with their own RoPE base:
  ``local_rope_theta``).
- **MLA** (DeepSeek-V3's multi-head latent attention): queries through a
  low-rank ``wq_a`` → RMSNorm → ``wq_b`` (or a plain ``wq``), keys and
  values from one latent per token (``wkv_a`` → RMSNorm → ``wkv_b``) plus a
  rotary part shared by all heads, decoupled from the heads' own.

Projection stands apart from attention, so that a cache can sit between
them: ``gqa_projections`` gives GQA's rotated queries, keys and values;
``mla_query`` MLA's queries and ``mla_latent`` each token's latent and
rotary key (the ``kv_lora_rank + qk_rope_head_dim`` values a cache keeps),
which ``mla_keys_values`` expands into the heads' keys and values;
``attention_output`` and ``attention_residual`` finish the sublayer.

Not for: the kernels (``kernels/attention/``), the MLPs and the whole layer
(``blocks.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from distrib_train.kernels.attention import dispatch as attention_kernels
from distrib_train.recipes.parts import Kind, norm as _norm, param, project as _project, rms_norm
from distrib_train.recipes.rope import frequencies, rotary
from distrib_train.sharding.axis_rules import constrain



def attention_params(config, rngs: nnx.Rngs, n: int) -> dict[str, nnx.Param]:
  """``n`` layers' attention params (and their norms), stacked on a leading ``layers`` axis."""
  c, pd = config, jnp.dtype(config.param_dtype)
  d, h, kv, hd = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
  ones = lambda *shape_axes: param(rngs, tuple(s for s, _ in shape_axes), tuple(a for _, a in shape_axes), pd,
                                   None, value=1.0 - c.norm_weight_offset)
  zeros = lambda shape, axes: param(rngs, shape, axes, pd, None, value=0.0)
  out = {"attn_norm": ones((n, "layers"), (d, "embed"))}
  if c.attention_kind == "mla":
    r, qk, v_dim = c.kv_lora_rank, c.qk_dim, c.v_dim
    if c.q_lora_rank:
      out["wq_a"] = param(rngs, (n, d, c.q_lora_rank), ("layers", "embed", "latent"), pd, fan_in=d)
      out["q_a_norm"] = ones((n, "layers"), (c.q_lora_rank, None))
      out["wq_b"] = param(rngs, (n, c.q_lora_rank, h, qk), ("layers", "latent", "heads", "head_dim"), pd,
                          fan_in=c.q_lora_rank)
    else:
      out["wq"] = param(rngs, (n, d, h, qk), ("layers", "embed", "heads", "head_dim"), pd, fan_in=d)
    out["wkv_a"] = param(rngs, (n, d, r + c.qk_rope_head_dim), ("layers", "embed", None), pd, fan_in=d)
    out["kv_a_norm"] = ones((n, "layers"), (r, None))
    out["wkv_b"] = param(rngs, (n, r, h, hd + v_dim), ("layers", "latent", "heads", "head_dim"), pd, fan_in=r)
    out["wo"] = param(rngs, (n, h, v_dim, d), ("layers", "heads", "head_dim", "embed"), pd, fan_in=h * v_dim)
  else:
    out.update(
        wq=param(rngs, (n, d, h, hd), ("layers", "embed", "heads", "head_dim"), pd, fan_in=d),
        wk=param(rngs, (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"), pd, fan_in=d),
        wv=param(rngs, (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"), pd, fan_in=d),
        wo=param(rngs, (n, h, hd, d), ("layers", "heads", "head_dim", "embed"), pd, fan_in=h * hd))
    if c.attention_bias:
      out.update(bq=zeros((n, h, hd), ("layers", "heads", "head_dim")),
                 bk=zeros((n, kv, hd), ("layers", "kv_heads", "head_dim")),
                 bv=zeros((n, kv, hd), ("layers", "kv_heads", "head_dim")))
    if c.qk_norm:
      out.update(q_norm=ones((n, "layers"), (hd, "head_dim")), k_norm=ones((n, "layers"), (hd, "head_dim")))
  if c.attention_out_bias:
    out["bo"] = zeros((n, d), ("layers", "embed"))
  if c.attention_sinks:
    out["sinks"] = zeros((n, h), ("layers", "heads"))
  if c.sandwich_norms:
    out["post_attn_norm"] = ones((n, "layers"), (d, "embed"))
  return out


def attention_matmuls(config) -> tuple[str, ...]:
  """The attention weights whose matmuls run in FP8 under ``model.fp8``."""
  if config.attention_kind == "mla":
    return ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo") if config.q_lora_rank else ("wq", "wkv_a", "wkv_b", "wo")
  return ("wq", "wk", "wv", "wo")


def gqa_projections(config, kind: Kind, h: jax.Array, layer: dict, positions) -> tuple[jax.Array, ...]:
  """GQA's queries [batch, length, heads, head_dim], keys and values [batch, length, kv_heads, head_dim] of ``h``:
  projected, biased, normed and rotated, ready for the attention (or a cache: ``generation/``)."""
  dtype = h.dtype
  q = _project("btd,dnh->btnh", h, layer, "wq", config)
  k = _project("btd,dkh->btkh", h, layer, "wk", config)
  v = _project("btd,dkh->btkh", h, layer, "wv", config)
  if config.attention_bias:
    q, k, v = (a + layer[b].astype(dtype) for a, b in ((q, "bq"), (k, "bk"), (v, "bv")))
  if config.qk_norm:
    q, k = _norm(config, q, layer["q_norm"]), _norm(config, k, layer["k_norm"])
  rope = config.rope(kind.sliding)
  freqs, factor = frequencies(rope, q.shape[-1]), rope.attention_factor()
  q = constrain(rotary(q, positions, freqs, factor), ("batch", "length", "heads", "head_dim"))
  k = constrain(rotary(k, positions, freqs, factor), ("batch", "length", "kv_heads", "head_dim"))
  return q, k, v


def _gqa(config, kind: Kind, h: jax.Array, layer: dict, positions, segment_ids) -> jax.Array:
  q, k, v = gqa_projections(config, kind, h, layer, positions)
  attn = attention_kernels.attention(q, k, v, config.attention_for(kind), positions=positions,
                                     segment_ids=segment_ids, sinks=layer.get("sinks"))
  return attention_output(config, attn, layer)


def attention_output(config, attn: jax.Array, layer: dict) -> jax.Array:
  """The output projection of the heads' attention [batch, length, heads, v_dim] → [batch, length, embed]."""
  return _project("btnh,nhd->btd", attn, layer, "wo", config if config.attention_kind != "mla" else None)


LATENT_NORM_EPS = 1e-6  # MLA's latent norms: DeepSeek's own epsilon, whatever the model's (transformers' too)
MLA_LATENT = "mla_kv_latent"  # each token's key/value latent and rotary key, kept under remat (decoder.py)


def mla_query(config, kind: Kind, h: jax.Array, layer: dict, positions) -> jax.Array:
  """MLA's queries [batch, length, heads, head_dim + qk_rope_head_dim]: their own part, then the rotated part."""
  c = config
  nope, rope_dim = c.head_dim, c.qk_rope_head_dim
  if c.q_lora_rank:
    q_latent = rms_norm(_project("btd,dr->btr", h, layer, "wq_a"), layer["q_a_norm"], LATENT_NORM_EPS)
    q = _project("btr,rnh->btnh", q_latent, layer, "wq_b")
  else:
    q = _project("btd,dnh->btnh", h, layer, "wq")
  rope = c.rope(kind.sliding)
  freqs, factor = frequencies(rope, rope_dim), rope.attention_factor()
  q_rope = rotary(q[..., nope:], positions, freqs, factor, interleaved=c.rope_interleave)
  return constrain(jnp.concatenate([q[..., :nope], q_rope], axis=-1), ("batch", "length", "heads", "head_dim"))


def mla_latent(config, kind: Kind, h: jax.Array, layer: dict, positions) -> jax.Array:
  """MLA's per-token key/value state [batch, length, kv_lora_rank + qk_rope_head_dim]: the normed latent, then
  the rotated key part all heads share. What a cache keeps of MLA (``generation/``): the heads' keys and values
  expand from it (``mla_keys_values``)."""
  c = config
  r = c.kv_lora_rank
  latent = checkpoint_name(_project("btd,dr->btr", h, layer, "wkv_a"), MLA_LATENT)  # [.., kv_lora_rank + rope]
  kv_latent, k_rope = rms_norm(latent[..., :r], layer["kv_a_norm"], LATENT_NORM_EPS), latent[..., r:]
  rope = c.rope(kind.sliding)
  freqs, factor = frequencies(rope, c.qk_rope_head_dim), rope.attention_factor()
  k_rope = rotary(k_rope[:, :, None, :], positions, freqs, factor, interleaved=c.rope_interleave)[:, :, 0]
  return jnp.concatenate([kv_latent, k_rope], axis=-1)


def mla_keys_values(config, latent: jax.Array, layer: dict) -> tuple[jax.Array, jax.Array]:
  """The heads' keys [batch, length, heads, head_dim + rope] and values [batch, length, heads, v_dim] expanded
  from ``mla_latent``'s state."""
  c = config
  nope, rope_dim, r = c.head_dim, c.qk_rope_head_dim, c.kv_lora_rank
  kv = _project("btr,rnh->btnh", latent[..., :r], layer, "wkv_b")
  k_nope, v = kv[..., :nope], kv[..., nope:]
  k_rope = latent[..., None, r:]
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], rope_dim))], axis=-1)
  return constrain(k, ("batch", "length", "heads", "head_dim")), v


def _mla(config, kind: Kind, h: jax.Array, layer: dict, positions, segment_ids) -> jax.Array:
  q = mla_query(config, kind, h, layer, positions)
  k, v = mla_keys_values(config, mla_latent(config, kind, h, layer, positions), layer)
  attn = attention_kernels.attention(q, k, v, config.attention_for(kind), positions=positions,
                                     segment_ids=segment_ids, sinks=layer.get("sinks"))
  return attention_output(config, attn, layer)


def attention_input(config, x: jax.Array, layer: dict) -> jax.Array:
  """The attention's input: ``x`` normed (pre-norm)."""
  return _norm(config, x, layer["attn_norm"])


def attention_residual(config, x: jax.Array, out: jax.Array, layer: dict) -> jax.Array:
  """``x`` plus the attention's projected output ``out`` (its bias, and the norm after it under sandwich norms)."""
  if config.attention_out_bias:
    out = out + layer["bo"].astype(out.dtype)
  if config.sandwich_norms:
    out = _norm(config, out, layer["post_attn_norm"])
  return x + constrain(out, ("batch", "length", "embed"))


def attention_sublayer(config, kind: Kind, x: jax.Array, layer: dict, positions, segment_ids) -> jax.Array:
  """``x`` plus the attention of one layer (pre-norm): the first half of a decoder layer."""
  h = attention_input(config, x, layer)
  out = (_mla if config.attention_kind == "mla" else _gqa)(config, kind, h, layer, positions, segment_ids)
  return attention_residual(config, x, out, layer)
