"""A LoRA run's adapters as a PEFT adapter: ``adapter_config.json`` + ``adapter_model.safetensors``.

``save(adapters, config, directory, base=…)`` writes the adapters
(``recipes/lora.py``: ``lora_a_<w>`` ``[layers, inputs…, r]`` and
``lora_b_<w>`` ``[layers, r, outputs…]`` in each segment) so that
``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
directory)`` computes the run's model: each adapted weight's Hugging Face
``Linear`` (``[out, in]``) gets ``lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]``, named after it under PEFT's
``base_model.model.`` prefix, with ``ΔW = (alpha / r)·B·A``, PEFT's default
scaling and ours.

The names and layouts are the weights' own (``recipes/hf_tables.py`` through
``checkpoint/hf.py``): A is turned like its weight's input side and B like its
output side (``heads_in``: B's ``[r, heads, head]`` becomes
``[heads·head, r]``; ``heads_out``: A's ``[heads, head, r]`` becomes
``[r, heads·head]``; ``transposed``: both transposed), and segment
``layers_3``'s layer ``i`` is Hugging Face's layer ``3 + i``.

``target_modules`` names the modules (``q_proj``, ``down_proj``, …), each
adapted in every layer. A mixture model's MLP adapters (in its dense layers
only) are refused: PEFT under transformers 5 takes a mixture-of-experts
model's ``gate_proj`` / ``up_proj`` / ``down_proj`` targets for its fused
experts, so they would be dropped on load; its attention adapters are written.

Not for: the merged model (``hf.save`` of ``recipes/lora.merged``'s weights).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import numpy as np

from distrib_train.checkpoint import hf

_PREFIX = "base_model.model."  # PeftModel → LoraModel → the transformers model
_LAYOUTS = ("heads_in", "heads_out", "transposed")  # every weight LoRA adapts (q, k, v, o, gate, up, down)


def _hf_pair(tensor, a: np.ndarray, b: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
  """One layer's A (``[inputs…, r]``) and B (``[r, outputs…]``) as PEFT's ``[r, in]`` and ``[out, r]``: the weight's
  own layout applied to each, A's rank standing for the weight's outputs and B's for its inputs."""
  if tensor.layout not in _LAYOUTS:
    raise hf.HfCheckpointError(f"no PEFT layout for {tensor.name.format(layer=layer)} ({tensor.layout}).")
  out: dict[str, np.ndarray] = {}
  hf.write_param(tensor, a, out, layer)
  lora_a = out.popitem()[1]
  hf.write_param(tensor, b, out, layer)
  return lora_a, out.popitem()[1]


def adapter_tensors(adapters: Any, config) -> dict[str, np.ndarray]:
  """PEFT's tensors (float32) of a LoRA model's adapters (the params of a LoRA run), by PEFT's names.

  Raises:
    HfCheckpointError: an adapter whose weight has no Hugging Face tensor, or an A without its B (named).
  """
  given = {hf.path_keys(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(adapters)[0]}
  tables = hf.tensor_tables(config)
  out: dict[str, np.ndarray] = {}
  for keys in sorted(given):
    if len(keys) != 2 or not keys[1].startswith("lora_a_"):
      continue
    segment, weight = keys[0], keys[1].removeprefix("lora_a_")
    start, tensors = tables.get(segment, (0, {}))
    tensor, b_keys = tensors.get(weight), (segment, f"lora_b_{weight}")
    if tensor is None or b_keys not in given:
      raise hf.HfCheckpointError(
        f"{'/'.join(keys)}: no Hugging Face weight {weight!r} or no lora_b_{weight} to write it as a PEFT adapter."
      )
    a, b = (hf.host_array(given[k]).astype(np.float32) for k in (keys, b_keys))
    for i in range(a.shape[0]):
      lora_a, lora_b = _hf_pair(tensor, a[i], b[i], start + i)
      module = _PREFIX + tensor.name.format(layer=start + i).removesuffix(".weight")
      out[f"{module}.lora_A.weight"] = np.ascontiguousarray(lora_a)
      out[f"{module}.lora_B.weight"] = np.ascontiguousarray(lora_b)
  if not out:
    raise hf.HfCheckpointError("the model has no LoRA adapters to write (lora.rank is 0).")
  return out


def target_modules(names: list[str], num_layers: int) -> list[str]:
  """PEFT's ``target_modules`` for the adapted modules ``names`` (``base_model.model.model.layers.0.mlp.up_proj``):
  their short names, each adapted in every layer.

  Raises:
    HfCheckpointError: a module adapted in some layers only: a mixture model's MLP adapters, in its dense layers
      (PEFT under transformers 5 takes a mixture-of-experts model's ``gate_proj``, ``up_proj`` and ``down_proj``
      targets, however spelled, for its fused experts, and would drop them).
  """
  by_module: dict[str, set[int]] = {}
  for name in names:
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name.removeprefix(_PREFIX))
    if match is None:
      raise hf.HfCheckpointError(f"{name}: not a layer's module; PEFT's target_modules cannot name it.")
    by_module.setdefault(match.group(2), set()).add(int(match.group(1)))
  for module, layers in sorted(by_module.items()):
    if layers != set(range(num_layers)):
      raise hf.HfCheckpointError(
        f"{module} carries adapters in layers {sorted(layers)} only (a mixture model's dense layers): PEFT takes"
        " a mixture-of-experts model's gate_proj / up_proj / down_proj targets for its experts and would drop"
        " them. Adapt attention alone (lora.targets among q, k, v, o), or export the merged model."
      )
  short = sorted({m.rsplit(".", 1)[-1] for m in by_module})
  if len(short) != len(by_module):
    raise hf.HfCheckpointError(
      f"adapted modules {sorted(by_module)} share a short name; PEFT's target_modules would match them all."
    )
  return short


def adapter_config(config, modules: list[str], base: str | None) -> dict[str, Any]:
  """``adapter_config.json``: PEFT's LoRA fields for ``config``'s adapters on ``modules``."""
  alpha = config.lora_alpha
  return {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": base,
    "revision": None,
    "inference_mode": True,
    "r": config.lora_rank,
    "lora_alpha": int(alpha) if alpha == int(alpha) else alpha,
    "lora_dropout": config.lora_dropout,
    "target_modules": modules,
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "init_lora_weights": True,
    "modules_to_save": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
  }


def save(adapters: Any, config, directory: str, *, base: str | None = None) -> list[str]:
  """Writes ``adapters`` (a LoRA run's params) into ``directory`` as a PEFT adapter on the Hugging Face model
  ``base`` (``base_model_name_or_path``), from process 0; returns the files written.

  Every process must call it (multi-host adapters are gathered tensor by tensor).

  Raises:
    HfCheckpointError: no adapters, or one PEFT cannot express (named); nothing is written then.
  """
  from safetensors.numpy import save_file

  tensors = adapter_tensors(adapters, config)
  modules = sorted({n.removesuffix(".lora_A.weight") for n in tensors if n.endswith(".lora_A.weight")})
  config_json = adapter_config(config, target_modules(modules, config.num_layers), base)
  if jax.process_index() != 0:
    return []
  os.makedirs(directory, exist_ok=True)
  save_file(tensors, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(directory, "adapter_config.json"), "w", encoding="utf-8") as f:
    json.dump(config_json, f, indent=1)
  return ["adapter_model.safetensors", "adapter_config.json"]
