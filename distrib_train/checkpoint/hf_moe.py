"""Hugging Face mixtures of experts in and out: Mixtral and Qwen2-MoE, beside ``hf.py``'s dense families.

The Hub layout, which ``transformers`` reads and writes: per expert ``j`` of
layer ``l``, Mixtral's ``block_sparse_moe.experts.{j}.w1`` (gate), ``w3``
(up) and ``w2`` (down) and its router ``block_sparse_moe.gate``; Qwen2-MoE's
``mlp.experts.{j}.{gate,up,down}_proj``, router ``mlp.gate``, one shared
expert ``mlp.shared_expert.*`` behind ``mlp.shared_expert_gate``. The
reference model (``recipes/moe.py``) stacks the experts: ``w_gate`` [layers,
experts, embed, expert_mlp]. A config with shared experts is Qwen2-MoE's,
else Mixtral's. A ``config.json``'s mixture fields are read with the dense
ones, in ``recipes/hf_shape.py``; the shared readers and names are in
``hf_common.py``. Neither family has a routing bias: a mixture trained with
one (``router_bias_update_rate``) is refused at export, and DeepSeek-V3's
``e_score_correction_bias`` is not read (its architecture is not).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from distrib_train.checkpoint.hf_common import shard_range, tensor_name, transposed
# Where config.json is read (recipes/hf_shape.py); SHAPE_FIELDS and is_moe are importable from here too.
from distrib_train.recipes.hf_shape import MOE_FAMILIES as FAMILIES
from distrib_train.recipes.hf_shape import MOE_SHAPE_FIELDS as SHAPE_FIELDS  # noqa: F401
from distrib_train.recipes.hf_shape import HfCheckpointError, is_moe  # noqa: F401


def family_of(config: Any) -> str:
  return "qwen2_moe" if config.num_shared_experts else "mixtral"


def _names(config: Any) -> dict[str, Any]:
  if family_of(config) == "mixtral":
    return {"router": "block_sparse_moe.gate", "w_gate": "block_sparse_moe.experts.{}.w1",
            "w_up": "block_sparse_moe.experts.{}.w3", "w_down": "block_sparse_moe.experts.{}.w2"}
  return {"router": "mlp.gate", "w_gate": "mlp.experts.{}.gate_proj", "w_up": "mlp.experts.{}.up_proj",
          "w_down": "mlp.experts.{}.down_proj", "shared_gate": "mlp.shared_expert.gate_proj",
          "shared_up": "mlp.shared_expert.up_proj", "shared_down": "mlp.shared_expert.down_proj",
          "shared_expert_gate": "mlp.shared_expert_gate"}


def layer_readers(config: Any) -> dict[str, Any]:
  """Readers of each layer's mixture params (``hf._layer_readers``'s contract: ``read(reader, layer, index)``)."""
  names = _names(config)

  def experts(kind: str):
    def read(reader, layer, index):  # [experts, in, out] from each expert's [out, in]
      e0, e1 = shard_range(index[0], config.num_experts)
      return np.stack([reader.read(tensor_name(layer, kind.format(j)), (index[2], index[1])).T
                       for j in range(e0, e1)])
    return read

  readers = {"router": transposed(names["router"])}
  readers.update({k: experts(names[k]) for k in ("w_gate", "w_up", "w_down")})
  if config.num_shared_experts:
    readers.update({k: transposed(names[k]) for k in ("shared_gate", "shared_up", "shared_down")})
    if config.shared_expert_gate:
      readers["shared_expert_gate"] = transposed(names["shared_expert_gate"])
  return readers


def expected_shapes(config: Any) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
  """Per param name, the layer-0 tensors it reads and their shapes."""
  names, d, e, f = _names(config), config.d_model, config.num_experts, config.expert_mlp_dim
  out = {"router": [(tensor_name(0, names["router"]), (e, d))],
         "w_gate": [(tensor_name(0, names["w_gate"].format(j)), (f, d)) for j in range(e)],
         "w_up": [(tensor_name(0, names["w_up"].format(j)), (f, d)) for j in range(e)],
         "w_down": [(tensor_name(0, names["w_down"].format(j)), (d, f)) for j in range(e)]}
  if config.num_shared_experts:
    fs = config.shared_width
    out.update(shared_gate=[(tensor_name(0, names["shared_gate"]), (fs, d))],
               shared_up=[(tensor_name(0, names["shared_up"]), (fs, d))],
               shared_down=[(tensor_name(0, names["shared_down"]), (d, fs))],
               shared_expert_gate=[(tensor_name(0, names["shared_expert_gate"]), (1, d))])
  return out


def layer_tensors(layer: dict[str, np.ndarray], config: Any, i: int) -> dict[str, np.ndarray]:
  """Layer ``i``'s mixture tensors, Hugging Face's names and ``[out, in]`` layout."""
  names = _names(config)
  out = {tensor_name(i, names["router"]): np.ascontiguousarray(layer["router"][i].T)}
  for key in ("w_gate", "w_up", "w_down"):
    for j in range(config.num_experts):
      out[tensor_name(i, names[key].format(j))] = np.ascontiguousarray(layer[key][i][j].T)
  if config.num_shared_experts:
    for key in ("shared_gate", "shared_up", "shared_down") + (("shared_expert_gate",) if config.shared_expert_gate
                                                               else ()):
      out[tensor_name(i, names[key])] = np.ascontiguousarray(layer[key][i].T)
  return out


def config_json(config: Any, out: dict[str, Any]) -> dict[str, Any]:
  """``hf.hf_config``'s dense ``config.json`` turned into Mixtral's or Qwen2-MoE's.

  Raises:
    HfCheckpointError: a mixture neither family can express (named).
  """
  family = family_of(config)
  problems = []
  if config.router != "softmax" or config.routed_scaling != 1.0:
    problems.append(f"router {config.router!r} with routed_scaling {config.routed_scaling} (both families: softmax,"
                    " 1.0)")
  if config.router_bias_update_rate > 0:
    problems.append("router_bias_update_rate > 0 (a load-balancing bias in the routing, which neither has)")
  if family == "mixtral" and (config.attention_bias or not config.norm_topk_prob):
    problems.append("Mixtral has no attention biases and renormalises the top-k weights")
  if family == "qwen2_moe" and (config.num_shared_experts != 1 or not config.shared_expert_gate
                                or not config.attention_bias):
    problems.append("Qwen2-MoE has one gated shared expert and attention biases")
  if problems:
    raise HfCheckpointError("this mixture cannot be written as Mixtral or Qwen2-MoE: " + "; ".join(problems) + ".")
  arch = {v: k for k, v in FAMILIES.items()}[family]
  out = {**out, "architectures": [arch], "model_type": family, "num_experts_per_tok": config.experts_per_token,
         "router_aux_loss_coef": config.aux_loss_weight}
  out.pop("mlp_bias", None)
  out.pop("attention_bias", None)
  if family == "mixtral":
    out.update(num_local_experts=config.num_experts, intermediate_size=config.expert_mlp_dim)
  else:
    out.update(num_experts=config.num_experts, moe_intermediate_size=config.expert_mlp_dim,
               shared_expert_intermediate_size=config.shared_width if config.num_shared_experts else 0,
               norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
               intermediate_size=config.shared_width or config.expert_mlp_dim)
  return out
