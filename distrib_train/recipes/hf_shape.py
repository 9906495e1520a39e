"""A Hugging Face ``config.json`` as the reference models' shape: ``LlamaConfig`` or ``MoEConfig`` fields.

``llama_config(directory)`` reads a local Hugging Face model directory's
``config.json`` into a ``LlamaConfig`` (Llama 2/3/3.1, Mistral, Qwen2/2.5:
grouped-query attention, RoPE scaling ``linear`` and ``llama3``, tied or
untied heads, Qwen2's q/k/v biases) or, for Mixtral and Qwen2-MoE, a
``MoEConfig``. ``shape_fields(config)`` names the fields such a checkpoint
fixes; the rest (dtype, remat, attention, …) stay the run's. The run config
learns a checkpoint's model shape here (``train.init_from: hf:<dir>``).

Refused, naming the key: another architecture, ``hidden_act`` other than
silu, MLP biases, a RoPE scaling other than linear or llama3, a Qwen2-MoE
with dense layers.

Not for: the tensors (``checkpoint/hf.py`` reads and writes them, and writes
``config.json`` back).
"""

from __future__ import annotations

import json
import os
from typing import Any

from distrib_train.recipes.llama import LlamaConfig
from distrib_train.recipes.moe import MoEConfig

FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
MOE_FAMILIES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe"}
# The LlamaConfig fields a checkpoint fixes; the rest (dtype, remat, attention, …) stay the run's.
SHAPE_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings", "attention_bias", "rope_scaling",
                "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")
# The MoEConfig fields a checkpoint fixes, beyond the dense ones.
MOE_SHAPE_FIELDS = ("num_experts", "experts_per_token", "expert_mlp_dim", "num_shared_experts", "shared_mlp_dim",
                    "shared_expert_gate", "norm_topk_prob", "router")


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
    raise HfCheckpointError(f"{path} does not exist: a Hugging Face model directory holds config.json and"
                            " *.safetensors.") from None
  except (OSError, ValueError) as e:
    raise HfCheckpointError(f"{path} is not readable JSON: {e}") from None
  if not isinstance(data, dict):
    raise HfCheckpointError(f"{path} is not a JSON object.")
  return data


def is_moe(config: Any) -> bool:
  """Whether ``config`` is a mixture of experts (``MoEConfig``), not a dense Llama."""
  return hasattr(config, "num_experts")


def shape_fields(config: Any) -> tuple[str, ...]:
  """The fields of ``config`` (``LlamaConfig`` or ``MoEConfig``) that a Hugging Face checkpoint fixes."""
  return SHAPE_FIELDS + (MOE_SHAPE_FIELDS if is_moe(config) else ())


def llama_config(directory: str, **overrides: Any) -> LlamaConfig | MoEConfig:
  """The ``LlamaConfig`` of a Hugging Face Llama / Mistral / Qwen2 directory, or the ``MoEConfig`` of a
  Mixtral / Qwen2-MoE one, ``overrides`` on top.

  Args:
    directory: a local Hugging Face model directory (its ``config.json`` is read).
    **overrides: config fields to set over the checkpoint's (dtype, attention, …).

  Returns:
    The reference model's config with the checkpoint's shape.

  Raises:
    HfCheckpointError: what the reference Llama cannot represent (key named).
  """
  path = os.path.join(directory, "config.json")
  hf = read_json(path)
  arch = (hf.get("architectures") or ["?"])[0]
  known = {**FAMILIES, **MOE_FAMILIES}
  if arch not in known:
    raise HfCheckpointError(f"{path}: architecture {arch!r} is not one this importer reads; known:"
                            f" {', '.join(known)}.")
  family = known[arch]
  if hf.get("hidden_act", "silu") != "silu":
    raise HfCheckpointError(f"{path}: hidden_act {hf['hidden_act']!r}; the reference Llama's MLP is SwiGLU (silu).")
  if hf.get("mlp_bias"):
    raise HfCheckpointError(f"{path}: mlp_bias is true; the reference Llama's MLP has no biases.")
  heads = int(hf["num_attention_heads"])
  rope = dict(hf.get("rope_parameters") or {})
  legacy = hf.get("rope_scaling") or {}
  theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
  kind = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
  scaling = {**legacy, **rope}
  fields: dict[str, Any] = dict(
      vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
      num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
      mlp_dim=int(hf.get("intermediate_size") or 0),
      max_seq_len=int(hf.get("max_position_embeddings", 4096)), rope_theta=theta,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      attention_bias=family in ("qwen2", "qwen2_moe") or bool(hf.get("attention_bias", False)))
  if kind == "linear":
    fields.update(rope_scaling="linear", rope_factor=float(scaling["factor"]))
  elif kind == "llama3":
    fields.update(rope_scaling="llama3", rope_factor=float(scaling["factor"]),
                  rope_low_freq_factor=float(scaling["low_freq_factor"]),
                  rope_high_freq_factor=float(scaling["high_freq_factor"]),
                  rope_original_max_len=int(scaling["original_max_position_embeddings"]))
  elif kind != "default":
    raise HfCheckpointError(f"{path}: RoPE scaling {kind!r}; this importer reads default, linear and llama3.")
  if family in MOE_FAMILIES.values():
    fields.update(_moe_fields(hf, path, family))
    fields.update(overrides)
    return MoEConfig(**fields)
  fields.update(overrides)
  return LlamaConfig(**fields)


def _moe_fields(hf: dict[str, Any], path: str, family: str) -> dict[str, Any]:
  """The MoEConfig fields of a Mixtral or Qwen2-MoE ``config.json`` (``HfCheckpointError`` where the
  reference model differs)."""
  if family == "mixtral":
    return dict(num_experts=int(hf["num_local_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                expert_mlp_dim=int(hf["intermediate_size"]), router="softmax", norm_topk_prob=True,
                aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.02)), z_loss_weight=0.0)
  if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
    raise HfCheckpointError(f"{path}: decoder_sparse_step / mlp_only_layers give some layers a dense MLP; the"
                            " reference mixture has experts in every layer.")
  shared = int(hf.get("shared_expert_intermediate_size") or 0)
  return dict(num_experts=int(hf["num_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
              expert_mlp_dim=int(hf["moe_intermediate_size"]), num_shared_experts=1 if shared else 0,
              shared_mlp_dim=shared, shared_expert_gate=bool(shared), router="softmax",
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
              aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)), z_loss_weight=0.0)
