"""Hugging Face checkpoints in and out: Llama-family ``config.json`` + ``*.safetensors`` ↔ the reference Llama.

``llama_config(directory)`` reads a local Hugging Face model directory's
``config.json`` into a ``LlamaConfig`` (Llama 2/3/3.1, Mistral, Qwen2/2.5:
grouped-query attention, RoPE scaling ``linear`` and ``llama3``, tied or
untied heads, Qwen2's q/k/v biases; ``recipes/hf_shape.py``, where the run
config reads it too). ``load_params(directory, abstract)``
builds the params as ``jax.Array``s on the shardings ``abstract`` carries
(``plan.abstract_train_state.params``): each device's shard is read from the
safetensors files by itself (memory-mapped; a process reads only the slices
its devices hold, so no host holds the whole model), in any of F32, BF16
and F16 (cast to the param dtype). ``save(params, config, directory)``
writes them back (float32 safetensors, shards of at most
``max_shard_bytes`` with an index file, and ``config.json``); an import
followed by an export gives the same tensors, bit for bit.

Layout: Hugging Face stores a projection as ``[out, in]`` per layer; the
reference model stacks layers on a leading axis and keeps ``[in, out]``
split by head: ``wq`` is ``[layers, embed, heads, head_dim]`` from
``q_proj.weight`` ``[heads·head_dim, embed]``, ``wo`` ``[layers, heads,
head_dim, embed]`` from ``o_proj.weight`` ``[embed, heads·head_dim]``. The
rotary embedding splits each head in halves, as Hugging Face's Llama does,
so no permutation is needed.

Refused, naming the key: another architecture, ``hidden_act`` other than
silu, MLP biases, a RoPE scaling other than linear or llama3, files or
tensors missing, a shape that does not match the config. Mistral's sliding
window is not modelled: equal for sequences up to the window (noted).

The safetensors reader and the tensor names this shares with the mixtures
(``hf_moe.py``) are in ``hf_common.py``.

Not for: distrib_train's own checkpoints (``manager.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from distrib_train.checkpoint import hf_moe
from distrib_train.checkpoint.hf_common import SafetensorsDirectory, shard_range, tensor_name, transposed
# config.json ↔ the reference models' shape is read in recipes/hf_shape.py; these names are public here too.
from distrib_train.recipes.hf_shape import FAMILIES, SHAPE_FIELDS  # noqa: F401
from distrib_train.recipes.hf_shape import HfCheckpointError, is_moe, llama_config  # noqa: F401


# --- the reference Llama's params -------------------------------------------------------------


def _per_layer(reader, shape: Sequence[int], index: tuple[slice, ...], read_layer) -> np.ndarray:
  first, last = shard_range(index[0], shape[0])
  return np.stack([read_layer(reader, layer, index[1:]) for layer in range(first, last)])


def _projection_in(kind: str, heads: int, head_dim: int):
  """[embed, heads, head_dim] of layer ``l`` from ``{kind}.weight`` [heads·head_dim, embed]."""
  def read(reader, layer, index):
    d0, d1 = shard_range(index[0], reader.shape(tensor_name(layer, kind))[1])
    h0, h1 = shard_range(index[1], heads)
    block = reader.read(tensor_name(layer, kind), (slice(h0 * head_dim, h1 * head_dim), slice(d0, d1)))
    return block.reshape(h1 - h0, head_dim, d1 - d0).transpose(2, 0, 1)[:, :, index[2]]
  return read


def _projection_out(heads: int, head_dim: int):
  """[heads, head_dim, embed] of layer ``l`` from ``o_proj.weight`` [embed, heads·head_dim]."""
  def read(reader, layer, index):
    h0, h1 = shard_range(index[0], heads)
    d0, d1 = shard_range(index[2], reader.shape(tensor_name(layer, "self_attn.o_proj"))[0])
    block = reader.read(tensor_name(layer, "self_attn.o_proj"), (slice(d0, d1), slice(h0 * head_dim, h1 * head_dim)))
    return block.reshape(d1 - d0, h1 - h0, head_dim).transpose(1, 2, 0)[:, index[1], :]
  return read


def _bias(kind: str, heads: int, head_dim: int):
  def read(reader, layer, index):
    h0, h1 = shard_range(index[0], heads)
    block = reader.read(tensor_name(layer, kind, "bias"), (slice(h0 * head_dim, h1 * head_dim),))
    return block.reshape(h1 - h0, head_dim)[:, index[1]]
  return read


def _vector(kind: str):
  return lambda reader, layer, index: reader.read(tensor_name(layer, kind), index)


def _layer_readers(config) -> dict[str, Any]:
  h, kv, hd = config.num_heads, config.num_kv_heads, config.head_dim
  readers = {
      "attn_norm": _vector("input_layernorm"), "mlp_norm": _vector("post_attention_layernorm"),
      "wq": _projection_in("self_attn.q_proj", h, hd), "wk": _projection_in("self_attn.k_proj", kv, hd),
      "wv": _projection_in("self_attn.v_proj", kv, hd), "wo": _projection_out(h, hd),
      "w_gate": transposed("mlp.gate_proj"), "w_up": transposed("mlp.up_proj"),
      "w_down": transposed("mlp.down_proj"),
  }
  if config.attention_bias:
    readers.update(bq=_bias("self_attn.q_proj", h, hd), bk=_bias("self_attn.k_proj", kv, hd),
                   bv=_bias("self_attn.v_proj", kv, hd))
  if is_moe(config):
    for key in ("w_gate", "w_up", "w_down"):
      del readers[key]
    readers.update(hf_moe.layer_readers(config))
  return readers


def _top_readers() -> dict[str, Any]:
  return {"embed": lambda r, index: r.read("model.embed_tokens.weight", index),
          "final_norm": lambda r, index: r.read("model.norm.weight", index),
          "head": lambda r, index: r.read("lm_head.weight", (index[1], index[0])).T}


def _path_keys(path) -> tuple[str, ...]:
  """``("layers", "wq")`` for a param's pytree path (nnx's trailing ``value`` dropped)."""
  keys = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
  return keys[:-1] if keys and keys[-1] == "value" else keys


def check_params(directory: str, abstract_params: Any, config) -> None:
  """Checks, from the files' headers alone, that ``directory`` holds every tensor of ``abstract_params``
  in the shape ``config`` gives it.

  Raises:
    HfCheckpointError: a tensor missing or of another shape (named).
  """
  reader = SafetensorsDirectory(directory)
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
    keys = _path_keys(path)
    if keys[-1] not in {**_layer_readers(config), **_top_readers()}:
      raise HfCheckpointError(f"no Hugging Face tensor for the reference Llama's {'/'.join(keys)}.")
    _check_shape(reader, keys, leaf.shape, config)


def load_params(directory: str, abstract_params: Any, config) -> Any:
  """The params of ``directory``'s checkpoint on the shardings of ``abstract_params``.

  Args:
    directory: a local Hugging Face model directory.
    abstract_params: the reference Llama's params as ``jax.ShapeDtypeStruct``s
      with shardings (``plan.abstract_train_state.params``).
    config: the ``LlamaConfig`` (``llama_config(directory)``).

  Raises:
    HfCheckpointError: a tensor missing or of another shape (named).
  """
  reader = SafetensorsDirectory(directory)
  layers, top = _layer_readers(config), _top_readers()
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
  out = []
  for path, leaf in leaves:
    keys = _path_keys(path)
    name = keys[-1]
    if keys[0] == "layers":
      if name not in layers:
        raise HfCheckpointError(f"no Hugging Face tensor for the reference Llama's {'/'.join(keys)}.")
      read = (lambda fn, shape: lambda index: _per_layer(reader, shape, index, fn))(layers[name], leaf.shape)
    elif name in top:
      read = (lambda fn: lambda index: fn(reader, index))(top[name])
    else:
      raise HfCheckpointError(f"no Hugging Face tensor for the reference Llama's {'/'.join(keys)}.")
    _check_shape(reader, keys, leaf.shape, config)
    dtype = leaf.dtype
    out.append(jax.make_array_from_callback(leaf.shape, leaf.sharding,
                                            (lambda read, dtype: lambda index: read(index).astype(dtype))(read, dtype)))
  return jax.tree_util.tree_unflatten(treedef, out)


def _check_shape(reader: SafetensorsDirectory, keys: tuple[str, ...], shape: tuple[int, ...], config) -> None:
  """The safetensors' shapes against the config's, before any array is read."""
  d, h, kv, hd, f, v = (config.d_model, config.num_heads, config.num_kv_heads, config.head_dim, config.mlp_dim,
                        config.vocab_size)
  expected = {
      "embed": ("model.embed_tokens.weight", (v, d)), "final_norm": ("model.norm.weight", (d,)),
      "head": ("lm_head.weight", (v, d)), "attn_norm": (tensor_name(0, "input_layernorm"), (d,)),
      "mlp_norm": (tensor_name(0, "post_attention_layernorm"), (d,)),
      "wq": (tensor_name(0, "self_attn.q_proj"), (h * hd, d)), "wk": (tensor_name(0, "self_attn.k_proj"), (kv * hd, d)),
      "wv": (tensor_name(0, "self_attn.v_proj"), (kv * hd, d)), "wo": (tensor_name(0, "self_attn.o_proj"), (d, h * hd)),
      "w_gate": (tensor_name(0, "mlp.gate_proj"), (f, d)), "w_up": (tensor_name(0, "mlp.up_proj"), (f, d)),
      "w_down": (tensor_name(0, "mlp.down_proj"), (d, f)),
      "bq": (tensor_name(0, "self_attn.q_proj", "bias"), (h * hd,)),
      "bk": (tensor_name(0, "self_attn.k_proj", "bias"), (kv * hd,)),
      "bv": (tensor_name(0, "self_attn.v_proj", "bias"), (kv * hd,)),
  }
  wanted = [expected[keys[-1]]] if keys[-1] in expected else []
  if is_moe(config) and keys[0] == "layers":
    wanted = hf_moe.expected_shapes(config).get(keys[-1], wanted)
  layers = range(shape[0]) if keys[0] == "layers" else [None]
  for name, want in wanted:
    for layer in layers:
      tensor = name if layer is None else name.replace("layers.0.", f"layers.{layer}.")
      found = reader.shape(tensor)
      if found != want:
        raise HfCheckpointError(f"{reader.directory}: tensor {tensor!r} has shape {found}, the config says"
                                f" {want}.")


# --- export -----------------------------------------------------------------------------------


def _host(x: jax.Array) -> np.ndarray:
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def hf_tensors(params: Any, config) -> dict[str, np.ndarray]:
  """The Hugging Face tensors (float32, ``[out, in]``) of the reference Llama's ``params``."""
  flat = {_path_keys(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  get = lambda *keys: _host(flat[keys]).astype(np.float32)
  h, kv, hd, d = config.num_heads, config.num_kv_heads, config.head_dim, config.d_model
  out = {"model.embed_tokens.weight": get("embed"), "model.norm.weight": get("final_norm")}
  if not config.tie_embeddings:
    out["lm_head.weight"] = np.ascontiguousarray(get("head").T)
  layer = {k: get("layers", k) for k in _layer_readers(config)}
  for i in range(config.num_layers):
    out[tensor_name(i, "input_layernorm")] = layer["attn_norm"][i]
    out[tensor_name(i, "post_attention_layernorm")] = layer["mlp_norm"][i]
    for kind, key, n in (("q_proj", "wq", h), ("k_proj", "wk", kv), ("v_proj", "wv", kv)):
      out[tensor_name(i, f"self_attn.{kind}")] = np.ascontiguousarray(layer[key][i].reshape(d, n * hd).T)
    out[tensor_name(i, "self_attn.o_proj")] = np.ascontiguousarray(layer["wo"][i].reshape(h * hd, d).T)
    if is_moe(config):
      out.update(hf_moe.layer_tensors(layer, config, i))
    else:
      for kind, key in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
        out[tensor_name(i, f"mlp.{kind}")] = np.ascontiguousarray(layer[key][i].T)
    if config.attention_bias:
      for kind, key in (("q_proj", "bq"), ("k_proj", "bk"), ("v_proj", "bv")):
        out[tensor_name(i, f"self_attn.{kind}", "bias")] = layer[key][i].reshape(-1)
  return out


def hf_config(config, family: str = "") -> dict[str, Any]:
  """``config.json`` for ``config``: Qwen2 when it has attention biases, else Llama (or ``family``)."""
  family = family or ("qwen2" if config.attention_bias else "llama")
  arch = {v: k for k, v in FAMILIES.items()}.get(family, "LlamaForCausalLM")
  out: dict[str, Any] = {
      "architectures": [arch], "model_type": family, "vocab_size": config.vocab_size,
      "hidden_size": config.d_model, "intermediate_size": config.mlp_dim, "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim, "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
      "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu",
      "torch_dtype": "float32", "mlp_bias": False,
  }
  if family == "llama":
    out["attention_bias"] = config.attention_bias
  if config.rope_scaling == "linear":
    out["rope_scaling"] = {"rope_type": "linear", "factor": config.rope_factor}
  elif config.rope_scaling == "llama3":
    out["rope_scaling"] = {"rope_type": "llama3", "factor": config.rope_factor,
                           "low_freq_factor": config.rope_low_freq_factor,
                           "high_freq_factor": config.rope_high_freq_factor,
                           "original_max_position_embeddings": config.rope_original_max_len}
  if is_moe(config):
    return hf_moe.config_json(config, out)
  return out


def save(params: Any, config, directory: str, *, family: str = "", max_shard_bytes: int = 5 << 30) -> list[str]:
  """Writes ``params`` as a Hugging Face checkpoint (``config.json``, float32 safetensors, an index when
  sharded) into ``directory``, from process 0; returns the files written.

  Every process must call it (multi-host params are gathered tensor by tensor).
  """
  from safetensors.numpy import save_file

  config_json = hf_config(config, family)  # refuses what no Hugging Face family expresses before anything is written
  tensors = hf_tensors(params, config)
  if jax.process_index() != 0:
    return []
  os.makedirs(directory, exist_ok=True)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, tensor in tensors.items():
    if shards[-1] and size + tensor.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = tensor
    size += tensor.nbytes
  written = []
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  for name, shard in zip(names, shards):
    save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
    written.append(name)
  if len(shards) > 1:
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": {t: n for n, shard in zip(names, shards) for t in shard}}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
      json.dump(index, f, indent=1)
    written.append("model.safetensors.index.json")
  with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config_json, f, indent=1)
  written.append("config.json")
  return written


def tensors_equal(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
  """Whether two tensor maps hold the same names, shapes and bits."""
  return set(a) == set(b) and all(a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a)
