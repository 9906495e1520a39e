"""A Hugging Face ``config.json`` as a reference model's config, and back: one reader and one writer per family.

``checkpoint_fields(directory)`` reads a local model directory's
``config.json`` — its ``architectures`` and ``model_type`` pick the family,
dense (``LlamaConfig``) or mixture (``MoEConfig``) — into the config fields
the checkpoint fixes (its shape and its variants); the rest (dtype, remat,
attention kernel, …) stay the run's. ``llama_config(directory)`` builds the
whole config from them. The file is read once per directory and change
(``train.init_from: hf:<dir>`` reads it once per run).

Families: Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, Gemma 3 (text), Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, gpt-oss. ``hf_config(config)`` writes a
config's ``config.json`` for its family (``hf_model_type``) for
``distrib-train export``.

``num_nextn_predict_layers`` (multi-token prediction, ``mtp.py``) sets
``mtp_depth`` where the checkpoint holds those layers, and is written back.

Refused, naming the file and key: another architecture; a quantized
checkpoint (``quantization_config``: gpt-oss's MXFP4 experts, DeepSeek-V3's
block-scaled FP8 — convert them to bf16 first); an activation or RoPE
scaling the family's reader does not model; MLP biases.

Not for: the tensors (``hf_tables.py`` names them, ``checkpoint/hf.py``
reads and writes them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

from distrib_train.recipes import mtp
from distrib_train.recipes.llama import LlamaConfig
from distrib_train.recipes.moe import MoEConfig

FAMILIES = {
  "LlamaForCausalLM": "llama",
  "MistralForCausalLM": "mistral",
  "Qwen2ForCausalLM": "qwen2",
  "Qwen3ForCausalLM": "qwen3",
  "Gemma3ForCausalLM": "gemma3_text",
}
MOE_FAMILIES = {
  "MixtralForCausalLM": "mixtral",
  "Qwen2MoeForCausalLM": "qwen2_moe",
  "Qwen3MoeForCausalLM": "qwen3_moe",
  "DeepseekV3ForCausalLM": "deepseek_v3",
  "GptOssForCausalLM": "gpt_oss",
}
_ARCHITECTURES = {family: arch for arch, family in {**FAMILIES, **MOE_FAMILIES}.items()}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class HfCheckpointError(ValueError):
  """A Hugging Face directory this importer cannot read (the file and key named)."""


def read_json(path: str) -> dict[str, Any]:
  """A JSON object from ``path``.

  Raises:
    HfCheckpointError: the file is missing, unreadable, or not a JSON object.
  """
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except FileNotFoundError:
    raise HfCheckpointError(
      f"{path} does not exist: a Hugging Face model directory holds config.json and *.safetensors."
    ) from None
  except (OSError, ValueError) as e:
    raise HfCheckpointError(f"{path} is not readable JSON: {e}") from None
  if not isinstance(data, dict):
    raise HfCheckpointError(f"{path} is not a JSON object.")
  return data


def is_moe(config: Any) -> bool:
  """Whether ``config`` is a mixture of experts (``MoEConfig``), not a dense decoder."""
  return isinstance(config, MoEConfig)


def family_of(config: Any) -> str:
  """The Hugging Face ``model_type`` ``config`` is written as: its ``hf_model_type``, else the one its variants
  name (Qwen2 has attention biases, Qwen2-MoE shared experts; else Llama, Mixtral)."""
  if config.hf_model_type:
    return config.hf_model_type
  if is_moe(config):
    return "qwen2_moe" if config.num_shared_experts else "mixtral"
  return "qwen2" if config.attention_bias else "llama"


def _rope(given: dict[str, Any], path: str, where: str = "") -> dict[str, Any]:
  """The ``rope_*`` fields of a ``rope_parameters`` / ``rope_scaling`` dict (its ``rope_theta`` included)."""
  kind = given.get("rope_type") or given.get("type") or "default"

  class _Needed(dict):
    def __missing__(self, key):
      raise HfCheckpointError(f"{path}: {where}rope_parameters has no {key!r}, which {kind} scaling needs.")

  rope = _Needed(given)
  fields: dict[str, Any] = {}
  if "rope_theta" in rope:
    fields["rope_theta"] = float(rope["rope_theta"])
  if kind == "linear":
    fields.update(rope_scaling="linear", rope_factor=float(rope["factor"]))
  elif kind == "llama3":
    fields.update(
      rope_scaling="llama3",
      rope_factor=float(rope["factor"]),
      rope_low_freq_factor=float(rope["low_freq_factor"]),
      rope_high_freq_factor=float(rope["high_freq_factor"]),
      rope_original_max_len=int(rope["original_max_position_embeddings"]),
    )
  elif kind == "yarn":
    fields.update(
      rope_scaling="yarn",
      rope_factor=float(rope["factor"]),
      rope_original_max_len=int(rope["original_max_position_embeddings"]),
      rope_beta_fast=float(rope.get("beta_fast") or 32.0),
      rope_beta_slow=float(rope.get("beta_slow") or 1.0),
      rope_truncate=bool(rope.get("truncate", True)),
      rope_mscale=float(rope.get("mscale") or 0.0),
      rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
    )
    if rope.get("attention_factor") is not None:
      raise HfCheckpointError(
        f"{path}: {where}YaRN's attention_factor is given explicitly; this reader derives it from factor and mscale."
      )
  elif kind != "default":
    raise HfCheckpointError(
      f"{path}: {where}RoPE scaling {kind!r}; this importer reads default, linear, llama3 and yarn."
    )
  return fields


def _layer_types(hf: dict[str, Any], layers: int, pattern: int | None) -> tuple[str, ...]:
  types = hf.get("layer_types")
  if types:
    return tuple("sliding" if t == "sliding_attention" else "full" for t in types)
  if pattern:  # Gemma 3's older configs: every pattern-th layer global
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers))
  return ()


def _pad_token_id(hf: dict[str, Any], path: str) -> int:
  """``pad_token_id`` (transformers' embedding ``padding_idx``; Gemma 3's configs default it to 0), -1 if none."""
  pad = hf.get("pad_token_id", 0 if hf.get("model_type") == "gemma3_text" else None)
  if pad is None:
    return -1
  if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < int(hf["vocab_size"]):
    raise HfCheckpointError(f"{path}: pad_token_id {pad!r} is not a token id below vocab_size {hf['vocab_size']}.")
  return pad


def _dense_fields(hf: dict[str, Any], path: str, family: str) -> dict[str, Any]:
  heads = int(hf["num_attention_heads"])
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
  if act not in _ACTIVATIONS and not (family == "gpt_oss" and act == "silu"):
    raise HfCheckpointError(f"{path}: hidden_act {act!r}; the gated MLP runs silu or gelu_pytorch_tanh.")
  if hf.get("mlp_bias"):
    raise HfCheckpointError(f"{path}: mlp_bias is true; the reference MLP has no biases.")
  rope = hf.get("rope_parameters") or {}
  by_type = family == "gemma3_text" and "full_attention" in rope
  fields: dict[str, Any] = dict(
    vocab_size=int(hf["vocab_size"]),
    d_model=int(hf["hidden_size"]),
    num_layers=int(hf["num_hidden_layers"]),
    num_heads=heads,
    num_kv_heads=int(hf.get("num_key_value_heads") or heads),
    head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
    mlp_dim=int(hf.get("intermediate_size") or 0),
    max_seq_len=int(hf.get("max_position_embeddings", 4096)),
    rope_theta=float(hf.get("rope_theta", 10000.0)),
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    tie_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma3_text")),
    attention_bias=family in ("qwen2", "qwen2_moe")
    or (family not in ("mistral", "mixtral") and bool(hf.get("attention_bias", False))),
    mlp_activation=_ACTIVATIONS.get(act, "silu"),
    hf_model_type=family,
    pad_token_id=_pad_token_id(hf, path),
  )
  fields.update(
    _rope({**(hf.get("rope_scaling") or {}), **(rope.get("full_attention", {}) if by_type else rope)}, path)
  )
  window = hf.get("sliding_window")
  if family in ("gemma3_text", "gpt_oss") and window:
    types = _layer_types(hf, fields["num_layers"], hf.get("sliding_window_pattern"))
    fields.update(sliding_window=int(window), layer_types=types or ("sliding",) * fields["num_layers"])
  elif family in ("mistral", "mixtral") and window:
    fields.update(sliding_window=int(window))
  elif family in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") and hf.get("use_sliding_window"):
    raise HfCheckpointError(f"{path}: use_sliding_window is true; Qwen's sliding-window layers are not modelled.")
  if family in ("qwen3", "qwen3_moe", "gemma3_text"):
    fields["qk_norm"] = True
  if family in ("llama", "qwen3", "qwen3_moe"):  # their attention_bias is on o_proj too
    fields["attention_out_bias"] = fields["attention_bias"]
  if family == "deepseek_v3" and fields["attention_bias"]:
    raise HfCheckpointError(f"{path}: attention_bias is true; the MLA projections' biases are not modelled.")
  if family == "gemma3_text":
    local = rope.get("sliding_attention", {}) if by_type else {}
    fields.update(
      norm_weight_offset=1.0,
      sandwich_norms=True,
      scale_embeddings=True,
      query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or fields["head_dim"]),
      # (attn_logit_softcapping is Gemma 2's: transformers' Gemma 3 reads it and never applies it)
      final_logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
      local_rope_theta=float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 10000.0),
    )
  return fields


def _mixture_fields(hf: dict[str, Any], path: str, family: str, layers: int) -> dict[str, Any]:
  experts = int(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts"))
  fields: dict[str, Any] = dict(
    num_experts=experts,
    experts_per_token=int(hf["num_experts_per_tok"]),
    aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)),
    z_loss_weight=0.0,
  )
  if family == "mixtral":
    return {**fields, "expert_mlp_dim": int(hf["intermediate_size"]), "norm_topk_prob": True}
  if family == "gpt_oss":
    return {
      **fields,
      "expert_mlp_dim": int(hf["intermediate_size"]),
      "router": "softmax_topk",
      "router_logit_bias": True,
      "expert_bias": True,
      "attention_bias": True,
      "attention_out_bias": True,
      "attention_sinks": True,
      "mlp_activation": "swiglu_oss",
      "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
      "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
    }
  if family == "deepseek_v3":
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
      raise HfCheckpointError(
        f"{path}: scoring_func {hf.get('scoring_func')!r} / topk_method"
        f" {hf.get('topk_method')!r}; DeepSeek-V3's router is sigmoid, noaux_tc."
      )
    q_rank = hf.get("q_lora_rank")
    return {
      **fields,
      "expert_mlp_dim": int(hf["moe_intermediate_size"]),
      "router": "sigmoid",
      "router_groups": int(hf.get("n_group") or 1),
      "router_group_topk": int(hf.get("topk_group") or 1),
      "router_score_bias": True,
      "routed_scaling": float(hf.get("routed_scaling_factor", 1.0)),
      "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
      "num_shared_experts": int(hf.get("n_shared_experts") or 0),
      "dense_layers": tuple(range(int(hf.get("first_k_dense_replace") or 0))),
      "attention_kind": "mla",
      "q_lora_rank": int(q_rank or 0),
      "kv_lora_rank": int(hf["kv_lora_rank"]),
      "head_dim": int(hf["qk_nope_head_dim"]),
      "qk_rope_head_dim": int(hf["qk_rope_head_dim"]),
      "v_head_dim": int(hf["v_head_dim"]),
      "rope_interleave": bool(hf.get("rope_interleave", True)),
    }
  step = int(hf.get("decoder_sparse_step", 1) or 1)
  dense = tuple(i for i in range(layers) if i in (hf.get("mlp_only_layers") or []) or (i + 1) % step)
  fields.update(
    expert_mlp_dim=int(hf["moe_intermediate_size"]),
    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    dense_layers=dense,
  )
  shared = int(hf.get("shared_expert_intermediate_size") or 0)
  if family == "qwen2_moe" and shared:
    fields.update(num_shared_experts=1, shared_mlp_dim=shared, shared_expert_gate=True)
  return fields


@functools.lru_cache(maxsize=16)
def _fields(path: str, stamp: tuple[int, int]) -> tuple[type, tuple[tuple[str, Any], ...]]:
  del stamp  # part of the cache key: a rewritten config.json is read again
  hf = read_json(path)
  arch = (hf.get("architectures") or ["?"])[0]
  known = {**FAMILIES, **MOE_FAMILIES}
  if arch not in known:
    raise HfCheckpointError(f"{path}: architecture {arch!r} is not one this importer reads; known: {', '.join(known)}.")
  family = known[arch]
  if hf.get("model_type") not in (None, family):
    raise HfCheckpointError(
      f"{path}: model_type {hf['model_type']!r} does not go with architecture {arch!r} (expected {family!r})."
    )
  if hf.get("quantization_config"):
    method = hf["quantization_config"].get("quant_method", "?")
    raise HfCheckpointError(
      f"{path}: quantization_config {method!r}: quantized weights (gpt-oss's MXFP4 experts,"
      " DeepSeek-V3's FP8 blocks) are not read; convert the checkpoint to bf16 first."
    )
  fields = _dense_fields(hf, path, family)
  fields["mtp_depth"] = mtp.checkpoint_depth(hf, os.path.dirname(path), fields["num_layers"])
  cls = LlamaConfig
  if family in MOE_FAMILIES.values():
    fields.update(_mixture_fields(hf, path, family, fields["num_layers"]))
    cls = MoEConfig
  return cls, tuple(fields.items())


def checkpoint_fields(directory: str) -> tuple[type, dict[str, Any]]:
  """``(LlamaConfig or MoEConfig, the fields the checkpoint fixes)`` of ``directory``'s ``config.json``.

  Raises:
    HfCheckpointError: what the reference decoder cannot represent (file and key named).
  """
  path = os.path.join(directory, "config.json")
  try:
    stat = os.stat(path)
    stamp = (stat.st_mtime_ns, stat.st_size)
  except OSError:
    stamp = (0, 0)
  cls, fields = _fields(os.path.abspath(path), stamp)
  return cls, dict(fields)


def llama_config(directory: str, **overrides: Any) -> LlamaConfig | MoEConfig:
  """The config of a Hugging Face directory (its family's, dense or mixture), ``overrides`` on top.

  Raises:
    HfCheckpointError: what the reference decoder cannot represent (key named).
  """
  cls, fields = checkpoint_fields(directory)
  return cls(**{**fields, **overrides})


def shape_fields(config: Any) -> tuple[str, ...]:
  """The fields of ``config`` a Hugging Face checkpoint fixes: its shape and variants (a field the reader leaves
  unset takes its default); the run keeps the rest (dtype, remat, the attention kernel, fp8, …)."""
  return tuple(f.name for f in dataclasses.fields(config) if f.name in _SHAPE_FIELDS)


_SHAPE_FIELDS = frozenset(f.name for f in dataclasses.fields(MoEConfig)) - {
  "dtype",
  "param_dtype",
  "remat",
  "scan_layers",
  "attention",
  "max_segments",
  "loss_chunk_size",
  "loss_remat",
  "context_attention",
  "fp8",
  "fp8_amax_history",
  "fp8_min_dim",
  "capacity_factor",
  "aux_loss_weight",
  "z_loss_weight",
  "router_bias_update_rate",
  "lora_rank",
  "lora_alpha",
  "lora_dropout",
  "lora_targets",
  "mtp_loss_weight",
}


# --- config.json out ----------------------------------------------------------------------------


def _rope_json(config: Any) -> dict[str, Any]:
  """The scaling as ``rope_scaling`` (the key transformers 4 and 5 both read); empty for none."""
  rope: dict[str, Any] = {}
  if config.rope_scaling == "linear":
    rope.update(rope_type="linear", factor=config.rope_factor)
  elif config.rope_scaling == "llama3":
    rope.update(
      rope_type="llama3",
      factor=config.rope_factor,
      low_freq_factor=config.rope_low_freq_factor,
      high_freq_factor=config.rope_high_freq_factor,
      original_max_position_embeddings=config.rope_original_max_len,
    )
  elif config.rope_scaling == "yarn":
    rope.update(
      rope_type="yarn",
      factor=config.rope_factor,
      original_max_position_embeddings=config.rope_original_max_len,
      beta_fast=config.rope_beta_fast,
      beta_slow=config.rope_beta_slow,
      truncate=config.rope_truncate,
    )
    rope.update(
      {k: v for k, v in (("mscale", config.rope_mscale), ("mscale_all_dim", config.rope_mscale_all_dim)) if v}
    )
  return rope


def _check_writable(config: Any, family: str) -> None:
  """Refuses what ``family``'s ``config.json`` (and transformers' model of it) cannot say."""
  problems = []
  if is_moe(config) and config.router_bias_update_rate > 0 and family != "deepseek_v3":
    problems.append("router_bias_update_rate > 0 (a routing bias the family has not)")
  if family == "mixtral" and (
    config.attention_bias
    or not config.norm_topk_prob
    or config.router != "softmax"
    or config.routed_scaling != 1.0
    or config.num_shared_experts
  ):
    problems.append("Mixtral routes by softmax, renormalised, unscaled, without shared experts or attention biases")
  if family == "qwen2_moe" and (
    config.num_shared_experts != 1
    or not config.shared_expert_gate
    or not config.attention_bias
    or config.router != "softmax"
  ):
    problems.append("Qwen2-MoE has one gated shared expert, attention biases and a softmax router")
  if family in ("llama", "qwen2", "mistral") and (config.qk_norm or config.sandwich_norms or config.attention_sinks):
    problems.append(f"{family} has no q/k norms, sandwich norms or sinks")
  if config.attn_logit_softcap:
    problems.append("a soft cap on the attention scores (transformers applies none in these families)")
  mixture = is_moe(config)
  if mixture and config.dense_layers and family in ("mixtral", "gpt_oss"):
    problems.append(f"dense_layers {config.dense_layers} ({family} has experts in every layer)")
  if mixture and family == "deepseek_v3" and config.dense_layers != tuple(range(len(config.dense_layers))):
    problems.append(f"dense_layers {config.dense_layers} (DeepSeek-V3's are its first ones)")
  windows = {"full" if not kind.sliding else "sliding" for kind in config.layer_kinds()}
  if "sliding" in windows and family not in ("gemma3_text", "gpt_oss", "mistral", "mixtral"):
    problems.append("sliding-window layers (it has none)")
  if family in ("mistral", "mixtral") and windows == {"full", "sliding"}:
    problems.append("sliding and full layers (its window is on every layer)")
  activation = {"gemma3_text": "gelu_tanh", "gpt_oss": "swiglu_oss"}.get(family, "silu")
  if config.mlp_activation != activation:
    problems.append(f"mlp_activation {config.mlp_activation!r} (its MLP is {activation!r})")
  if problems:
    raise HfCheckpointError(f"this model cannot be written as {family}: " + "; ".join(problems) + ".")


def hf_config(config: Any) -> dict[str, Any]:
  """``config.json`` for ``config``, in its family's keys (``family_of``).

  Raises:
    HfCheckpointError: a model its family cannot express (named).
  """
  family = family_of(config)
  _check_writable(config, family)
  types = [("sliding" if kind.sliding else "full") + "_attention" for kind in config.layer_kinds()]
  out: dict[str, Any] = {
    "architectures": [_ARCHITECTURES[family]],
    "model_type": family,
    "vocab_size": config.vocab_size,
    "hidden_size": config.d_model,
    "intermediate_size": config.mlp_dim,
    "num_hidden_layers": config.num_layers,
    "num_attention_heads": config.num_heads,
    "num_key_value_heads": config.num_kv_heads,
    "head_dim": config.head_dim,
    "max_position_embeddings": config.max_seq_len,
    "rms_norm_eps": config.norm_eps,
    "rope_theta": config.rope_theta,
    "tie_word_embeddings": config.tie_embeddings,
    "hidden_act": "silu",
    "torch_dtype": "float32",
    "pad_token_id": config.pad_token_id if config.pad_token_id >= 0 else None,
  }
  if config.rope_scaling != "none":
    out["rope_scaling"] = _rope_json(config)
  if family in ("llama", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3"):
    out["attention_bias"] = config.attention_bias
  if family == "llama":
    out["mlp_bias"] = False
  if family == "gemma3_text":
    scalar = config.query_pre_attn_scalar
    out.update(
      hidden_activation="gelu_pytorch_tanh",
      query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,
      sliding_window=config.sliding_window,
      layer_types=types,
      final_logit_softcapping=config.final_logit_softcap or None,
      rope_local_base_freq=config.local_rope_theta or config.rope_theta,
    )
  if family == "gpt_oss":
    out.update(
      sliding_window=config.sliding_window,
      layer_types=types,
      swiglu_alpha=config.swiglu_alpha,
      swiglu_limit=config.swiglu_limit,
    )
  if family in ("mistral", "mixtral"):
    out["sliding_window"] = config.sliding_window or None
  out["num_nextn_predict_layers"] = config.mtp_depth  # multi-token-prediction layers, after the last
  if not is_moe(config):
    return out
  out.update(num_experts_per_tok=config.experts_per_token, router_aux_loss_coef=config.aux_loss_weight)
  if family in ("mixtral", "gpt_oss"):
    out.update(num_local_experts=config.num_experts, intermediate_size=config.expert_mlp_dim)
  elif family == "deepseek_v3":
    out.update(
      n_routed_experts=config.num_experts,
      moe_intermediate_size=config.expert_mlp_dim,
      n_shared_experts=config.num_shared_experts,
      n_group=config.router_groups,
      topk_group=config.router_group_topk,
      routed_scaling_factor=config.routed_scaling,
      norm_topk_prob=config.norm_topk_prob,
      first_k_dense_replace=len(config.dense_layers),
      q_lora_rank=config.q_lora_rank or None,
      kv_lora_rank=config.kv_lora_rank,
      qk_nope_head_dim=config.head_dim,
      qk_rope_head_dim=config.qk_rope_head_dim,
      v_head_dim=config.v_head_dim,
      rope_interleave=config.rope_interleave,
      scoring_func="sigmoid",
      topk_method="noaux_tc",
      head_dim=config.qk_rope_head_dim,
    )
  else:  # Qwen2-MoE, Qwen3-MoE
    out.update(
      num_experts=config.num_experts,
      moe_intermediate_size=config.expert_mlp_dim,
      norm_topk_prob=config.norm_topk_prob,
      decoder_sparse_step=1,
      mlp_only_layers=list(config.dense_layers),
    )
    if family == "qwen2_moe":  # intermediate_size is its dense layers' width (mlp_only_layers)
      out.update(shared_expert_intermediate_size=config.shared_width, intermediate_size=config.mlp_dim)
  return out
