"""Each family's Hugging Face tensor names: one table, read by the importer, the checks and the exporter.

``tensors(config, mixture)`` lists the ``Tensor``s of one layer (a dense
layer, or a mixture layer with ``mixture``) of the config's family
(``hf_shape.family_of``: the one it was read from, else by its variants), and ``top_tensors(config)`` the embedding,
final norm and head: each names a param of ours (a key of a layer segment,
or a top-level one), Hugging Face's tensor (``{layer}`` and ``{expert}``
filled in) and the ``layout`` that turns one into the other:

- ``same``: the same array (norm weights, vectors, gpt-oss's ``[E, in, out]``
  down projection);
- ``transposed``: Hugging Face's ``[out, in]`` is our ``[in, out]``;
- ``heads_in``: ``[heads·head, in]`` is our ``[in, heads, head]`` (q, k, v,
  MLA's up-projections);
- ``heads_out``: ``[out, heads·head]`` is our ``[heads, head, out]`` (o);
- ``heads_vector``: ``[heads·head]`` is our ``[heads, head]`` (q, k, v biases);
- ``experts``: one ``[out, in]`` tensor per expert is our ``[E, in, out]``;
- ``even`` / ``odd``: the even or odd columns of gpt-oss's interleaved
  ``gate_up`` (``[E, in, 2F]`` or ``[E, 2F]``) are our gate or up.

DeepSeek-V3's multi-token-prediction modules (``mtp.py``) are layers
``num_layers`` … ``num_layers + mtp_depth − 1`` (``mtp_tensors``): a
layer's tensors for the block, ``enorm``, ``hnorm``, ``eh_proj`` and
``shared_head.norm`` of their own, and ``embed_tokens`` and
``shared_head.head``, copies of the main model's (``MTP_COPIES``: written,
never read).

A param may be local state, not trained: ``router_bias`` (DeepSeek-V3's
``e_score_correction_bias``).

Not for: reading or writing the files (``checkpoint/hf.py``), ``config.json``
(``hf_shape.py``).
"""

from __future__ import annotations

import dataclasses

LAYOUTS = ("same", "transposed", "heads_in", "heads_out", "heads_vector", "experts", "even", "odd")


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One of our params and the Hugging Face tensor(s) it is read from and written to."""

  param: str
  name: str
  layout: str


_LAYER = "model.layers.{layer}."


def _attention(config) -> list[Tensor]:
  from distrib_train.recipes.attention import variant  # the variant's own tensors

  a = _LAYER + "self_attn."
  out = [Tensor(*fields) for fields in variant(config).hf_tensors(config, a)]
  if config.attention_out_bias:
    out.append(Tensor("bo", a + "o_proj.bias", "same"))
  if config.attention_sinks:
    out.append(Tensor("sinks", a + "sinks", "same"))
  return out


def _norms(config) -> list[Tensor]:
  if config.sandwich_norms:  # Gemma: post_attention_layernorm is the norm after attention
    names = (
      ("attn_norm", "input_layernorm"),
      ("post_attn_norm", "post_attention_layernorm"),
      ("mlp_norm", "pre_feedforward_layernorm"),
      ("post_mlp_norm", "post_feedforward_layernorm"),
    )
  else:
    names = (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))
  return [Tensor(ours, _LAYER + f"{theirs}.weight", "same") for ours, theirs in names]


def _gated(prefix: str, ours: tuple[str, str, str] = ("w_gate", "w_up", "w_down")) -> list[Tensor]:
  return [
    Tensor(param, prefix + f"{theirs}.weight", "transposed")
    for param, theirs in zip(ours, ("gate_proj", "up_proj", "down_proj"))
  ]


_SHARED = ("shared_gate", "shared_up", "shared_down")


def _mixture(config) -> list[Tensor]:
  from distrib_train.recipes.hf_shape import family_of  # the family a model is written as, imported or not

  m = _LAYER + "mlp."
  family = family_of(config)
  if family == "mixtral":
    b = _LAYER + "block_sparse_moe."
    return [Tensor("router", b + "gate.weight", "transposed")] + [
      Tensor(param, b + f"experts.{{expert}}.{w}.weight", "experts")
      for param, w in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2"))
    ]
  if family == "gpt_oss":
    e = m + "experts."
    return [
      Tensor("router", m + "router.weight", "transposed"),
      Tensor("router_logit_bias", m + "router.bias", "same"),
      Tensor("w_gate", e + "gate_up_proj", "even"),
      Tensor("w_up", e + "gate_up_proj", "odd"),
      Tensor("b_gate", e + "gate_up_proj_bias", "even"),
      Tensor("b_up", e + "gate_up_proj_bias", "odd"),
      Tensor("w_down", e + "down_proj", "same"),
      Tensor("b_down", e + "down_proj_bias", "same"),
    ]
  out = [Tensor("router", m + "gate.weight", "transposed")] + [
    Tensor(param, m + f"experts.{{expert}}.{w}_proj.weight", "experts")
    for param, w in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down"))
  ]
  if family == "deepseek_v3":
    out.append(Tensor("router_bias", m + "gate.e_score_correction_bias", "same"))
    out += _gated(m + "shared_experts.", _SHARED)
  elif config.num_shared_experts:  # Qwen2-MoE
    out += _gated(m + "shared_expert.", _SHARED)
    if config.shared_expert_gate:
      out.append(Tensor("shared_expert_gate", m + "shared_expert_gate.weight", "transposed"))
  return out


def tensors(config, mixture: bool) -> list[Tensor]:
  """The tensors of one layer of ``config``'s family: a mixture layer's with ``mixture``, else a dense one's."""
  mlp = _mixture(config) if mixture else _gated(_LAYER + "mlp.")
  return _attention(config) + _norms(config) + mlp


def top_tensors(config) -> list[Tensor]:
  """The embedding, the final norm and (untied) the head."""
  out = [Tensor("embed", "model.embed_tokens.weight", "same"), Tensor("final_norm", "model.norm.weight", "same")]
  if not config.tie_embeddings:
    out.append(Tensor("head", "lm_head.weight", "transposed"))
  return out


# The copies of the main model's embedding and head each MTP layer of a DeepSeek-V3 checkpoint carries, by the
# top-level tensor each copies (a tied model's head is its embedding).
MTP_COPIES = (("embed_tokens.weight", "model.embed_tokens.weight"), ("shared_head.head.weight", "lm_head.weight"))


def mtp_tensors(config) -> list[Tensor]:
  """The tensors of one multi-token-prediction layer (``{layer}`` = ``num_layers`` + its depth − 1): its block's,
  a layer of the model's last layer's kind, and its own norms and projection."""
  from distrib_train.recipes import mtp

  own = [
    Tensor("enorm", _LAYER + "enorm.weight", "same"),
    Tensor("hnorm", _LAYER + "hnorm.weight", "same"),
    Tensor("eh_proj", _LAYER + "eh_proj.weight", "transposed"),
    Tensor("head_norm", _LAYER + "shared_head.norm.weight", "same"),
  ]
  return tensors(config, mtp.kind(config).mixture) + own
