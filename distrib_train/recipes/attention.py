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

Each variant is one record (``Variant``; ``variant(config)`` picks it by
``attention_kind``): its params, projection, the keys and values it hands
the kernels, what a cache keeps of it and how a decode step attends over
that, its Hugging Face tensors, LoRA targets, FP8 matmuls and remat names.

Not for: the kernels (``kernels/attention/``), the MLPs and the whole layer
(``blocks.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from distrib_train.kernels.attention import dispatch as attention_kernels
from distrib_train.kernels.attention.xla import masked_attention
from distrib_train.recipes.parts import Kind, norm as _norm, param, project as _project, rms_norm
from distrib_train.recipes.rope import frequencies, rotary, yarn_mscale
from distrib_train.sharding.axis_rules import constrain


def attention_params(config, rngs: nnx.Rngs, n: int) -> dict[str, nnx.Param]:
  """``n`` layers' attention params (and their norms), stacked on a leading ``layers`` axis: the norm, the
  variant's own, then the output bias, sinks and the norm after, where the config has them."""
  c, pd = config, jnp.dtype(config.param_dtype)
  d = c.d_model
  out = {"attn_norm": _ones(c, rngs, (n, "layers"), (d, "embed")), **variant(c).params(c, rngs, n)}
  if c.attention_out_bias:
    out["bo"] = param(rngs, (n, d), ("layers", "embed"), pd, None, value=0.0)
  if c.attention_sinks:
    out["sinks"] = param(rngs, (n, c.num_heads), ("layers", "heads"), pd, None, value=0.0)
  if c.sandwich_norms:
    out["post_attn_norm"] = _ones(c, rngs, (n, "layers"), (d, "embed"))
  return out


def _ones(config, rngs, *shape_axes) -> nnx.Param:
  """A norm's scale (1, or 0 under Gemma's 1 + w), shaped and annotated by ``(size, axis)`` pairs."""
  return param(
    rngs,
    tuple(s for s, _ in shape_axes),
    tuple(a for _, a in shape_axes),
    jnp.dtype(config.param_dtype),
    None,
    value=1.0 - config.norm_weight_offset,
  )


def _gqa_params(config, rngs: nnx.Rngs, n: int) -> dict[str, nnx.Param]:
  c, pd = config, jnp.dtype(config.param_dtype)
  d, h, kv, hd = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
  zeros = lambda shape, axes: param(rngs, shape, axes, pd, None, value=0.0)
  out = dict(
    wq=param(rngs, (n, d, h, hd), ("layers", "embed", "heads", "head_dim"), pd, fan_in=d),
    wk=param(rngs, (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"), pd, fan_in=d),
    wv=param(rngs, (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"), pd, fan_in=d),
    wo=param(rngs, (n, h, hd, d), ("layers", "heads", "head_dim", "embed"), pd, fan_in=h * hd),
  )
  if c.attention_bias:
    out.update(
      bq=zeros((n, h, hd), ("layers", "heads", "head_dim")),
      bk=zeros((n, kv, hd), ("layers", "kv_heads", "head_dim")),
      bv=zeros((n, kv, hd), ("layers", "kv_heads", "head_dim")),
    )
  if c.qk_norm:
    out.update(
      q_norm=_ones(c, rngs, (n, "layers"), (hd, "head_dim")), k_norm=_ones(c, rngs, (n, "layers"), (hd, "head_dim"))
    )
  return out


def _mla_params(config, rngs: nnx.Rngs, n: int) -> dict[str, nnx.Param]:
  c, pd = config, jnp.dtype(config.param_dtype)
  d, h, hd = c.d_model, c.num_heads, c.head_dim
  r, qk, v_dim = c.kv_lora_rank, c.qk_dim, c.v_dim
  out = {}
  if c.q_lora_rank:
    out["wq_a"] = param(rngs, (n, d, c.q_lora_rank), ("layers", "embed", "latent"), pd, fan_in=d)
    out["q_a_norm"] = _ones(c, rngs, (n, "layers"), (c.q_lora_rank, None))
    out["wq_b"] = param(
      rngs, (n, c.q_lora_rank, h, qk), ("layers", "latent", "heads", "head_dim"), pd, fan_in=c.q_lora_rank
    )
  else:
    out["wq"] = param(rngs, (n, d, h, qk), ("layers", "embed", "heads", "head_dim"), pd, fan_in=d)
  out["wkv_a"] = param(rngs, (n, d, r + c.qk_rope_head_dim), ("layers", "embed", None), pd, fan_in=d)
  out["kv_a_norm"] = _ones(c, rngs, (n, "layers"), (r, None))
  out["wkv_b"] = param(rngs, (n, r, h, hd + v_dim), ("layers", "latent", "heads", "head_dim"), pd, fan_in=r)
  out["wo"] = param(rngs, (n, h, v_dim, d), ("layers", "heads", "head_dim", "embed"), pd, fan_in=h * v_dim)
  return out


def attention_matmuls(config) -> tuple[str, ...]:
  """The attention weights whose matmuls run in FP8 under ``model.fp8``."""
  return variant(config).matmuls(config)


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


def attention_output(config, attn: jax.Array, layer: dict) -> jax.Array:
  """The output projection of the heads' attention [batch, length, heads, v_dim] → [batch, length, embed]."""
  adapted = config if "o" in variant(config).lora_targets else None  # LoRA on wo: GQA's
  return _project("btnh,nhd->btd", attn, layer, "wo", adapted)


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
  v = variant(config)
  q, state = v.project(config, kind, h, layer, positions)
  keys, values = v.expand(config, state, layer)
  attn = attention_kernels.attention(
    q, keys, values, config.attention_for(kind), positions=positions, segment_ids=segment_ids, sinks=layer.get("sinks")
  )
  return attention_residual(config, x, attention_output(config, attn, layer), layer)


# --- the variants: each one record ------------------------------------------------------------


def _gqa_project(config, kind, h, layer, positions):
  q, k, v = gqa_projections(config, kind, h, layer, positions)
  return q, {"k": k, "v": v}


def _mla_project(config, kind, h, layer, positions):
  return mla_query(config, kind, h, layer, positions), {"latent": mla_latent(config, kind, h, layer, positions)}


def _gqa_decode(config, q, cached, state, visible, layer, **options):
  return masked_attention(
    q, cached["k"].astype(q.dtype), cached["v"].astype(q.dtype), visible, new=(state["k"], state["v"]), **options
  )


def _mla_decode(config, q, cached, state, visible, layer, **options):
  """MLA over cached latents, absorbed: the queries' own part moves into the latent's space (``q_nope · W_uk``)
  beside their rotary part, attends over every token's latent and rotary key as one key/value head (the latent
  its value), and the result leaves through ``W_uv``."""
  nope, r = config.head_dim, config.kv_lora_rank
  w_kv = layer["wkv_b"].astype(q.dtype)  # [kv_lora_rank, heads, head_dim + v_dim]
  queries = jnp.concatenate([jnp.einsum("bqhn,rhn->bqhr", q[..., :nope], w_kv[..., :nope]), q[..., nope:]], -1)
  stored, new = cached["latent"].astype(q.dtype)[:, :, None, :], state["latent"].astype(q.dtype)[:, :, None, :]
  out = masked_attention(queries, stored, stored[..., :r], visible, new=(new, new[..., :r]), **options)
  return jnp.einsum("bqhr,rhv->bqhv", out, w_kv[..., nope:])


def _gqa_tensors(config, a: str) -> list[tuple[str, str, str]]:
  out = [(ours, a + f"{theirs}_proj.weight", "heads_in") for ours, theirs in (("wq", "q"), ("wk", "k"), ("wv", "v"))]
  out.append(("wo", a + "o_proj.weight", "heads_out"))
  if config.attention_bias:
    out += [(f"b{x}", a + f"{x}_proj.bias", "heads_vector") for x in "qkv"]
  if config.qk_norm:
    out += [("q_norm", a + "q_norm.weight", "same"), ("k_norm", a + "k_norm.weight", "same")]
  return out


def _mla_tensors(config, a: str) -> list[tuple[str, str, str]]:
  out = [
    ("wkv_a", a + "kv_a_proj_with_mqa.weight", "transposed"),
    ("kv_a_norm", a + "kv_a_layernorm.weight", "same"),
    ("wkv_b", a + "kv_b_proj.weight", "heads_in"),
    ("wo", a + "o_proj.weight", "heads_out"),
  ]
  if config.q_lora_rank:
    out += [
      ("wq_a", a + "q_a_proj.weight", "transposed"),
      ("q_a_norm", a + "q_a_layernorm.weight", "same"),
      ("wq_b", a + "q_b_proj.weight", "heads_in"),
    ]
  else:
    out.append(("wq", a + "q_proj.weight", "heads_in"))
  return out


@dataclasses.dataclass(frozen=True)
class Variant:
  """Everything that differs between attention variants, in one record (``variant(config)`` picks it by
  ``attention_kind``): the rest of the package asks it rather than the flag.

  Attributes:
    name: ``attention_kind``.
    params: ``(config, rngs, n)`` → the variant's own projection params of ``n`` stacked layers.
    matmuls: ``(config)`` → its weights whose matmuls run in FP8.
    project: ``(config, kind, h, layer, positions)`` → the queries and each token's state, what a cache keeps
      (GQA: ``k`` and ``v``; MLA: ``latent``).
    expand: ``(config, state, layer)`` → the keys and values the kernels attend over.
    decode: ``(config, q, cached, state, visible, layer, scale=, softcap=, sinks=)`` → attention over a cache's
      ``visible`` slots and the new tokens' own ``state`` (``generation/``).
    cached: ``(config)`` → per cached name, its dims per token and their logical axes.
    hf_tensors: ``(config, prefix)`` → its params' Hugging Face tensors as ``(param, name, layout)``
      (``hf_tables.Tensor``'s fields).
    lora_targets: which of ``lora.targets`` q, k, v, o it takes.
    remat_names: the checkpoint names a layer keeps under remat.
    qk_dim, v_dim: ``(config)`` → a head's query/key and value sizes.
    softmax_scale: ``(config)`` → the scores' scale (None: 1/√qk_dim, the kernels' default).
  """

  name: str
  params: Callable[..., dict]
  matmuls: Callable[[Any], tuple[str, ...]]
  project: Callable[..., tuple]
  expand: Callable[..., tuple]
  decode: Callable[..., jax.Array]
  cached: Callable[[Any], dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]]
  hf_tensors: Callable[[Any, str], list[tuple[str, str, str]]]
  lora_targets: frozenset[str]
  remat_names: tuple[str, ...]
  qk_dim: Callable[[Any], int]
  v_dim: Callable[[Any], int]
  softmax_scale: Callable[[Any], float | None]


def _gqa_scale(c) -> float | None:
  return c.query_pre_attn_scalar**-0.5 if c.query_pre_attn_scalar else None


def _mla_scale(c) -> float:
  scale = (c.query_pre_attn_scalar or c.qk_dim) ** -0.5
  if c.rope_scaling == "yarn" and c.rope_mscale_all_dim:  # DeepSeek's YaRN scales MLA's softmax too
    scale *= yarn_mscale(c.rope_factor, c.rope_mscale_all_dim) ** 2
  return scale


GQA = Variant(
  "gqa",
  _gqa_params,
  lambda c: ("wq", "wk", "wv", "wo"),
  _gqa_project,
  lambda c, state, layer: (state["k"], state["v"]),
  _gqa_decode,
  lambda c: {name: ((c.num_kv_heads, c.head_dim), ("kv_heads", "head_dim")) for name in ("k", "v")},
  _gqa_tensors,
  frozenset("qkvo"),
  (),
  lambda c: c.head_dim,
  lambda c: c.head_dim,
  _gqa_scale,
)
MLA = Variant(
  "mla",
  _mla_params,
  lambda c: ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo") if c.q_lora_rank else ("wq", "wkv_a", "wkv_b", "wo"),
  _mla_project,
  lambda c, state, layer: mla_keys_values(c, state["latent"], layer),
  _mla_decode,
  lambda c: {"latent": ((c.kv_lora_rank + c.qk_rope_head_dim,), (None,))},
  _mla_tensors,
  frozenset(),
  (MLA_LATENT,),
  lambda c: c.head_dim + c.qk_rope_head_dim,
  lambda c: c.v_head_dim,
  _mla_scale,
)
VARIANTS = {v.name: v for v in (GQA, MLA)}


def variant(config) -> Variant:
  """The record of ``config.attention_kind``."""
  return VARIANTS[config.attention_kind]
