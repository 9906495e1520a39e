"""Hugging Face checkpoints in and out: Llama-family ``config.json`` + ``*.safetensors`` ↔ the reference Llama.

``llama_config(directory)`` reads a local Hugging Face model directory's
``config.json`` into a ``LlamaConfig`` (Llama 2/3/3.1, Mistral, Qwen2/2.5:
grouped-query attention, RoPE scaling ``linear`` and ``llama3``, tied or
untied heads, Qwen2's q/k/v biases). ``load_params(directory, abstract)``
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

Not for: distrib_train's own checkpoints (``manager.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from distrib_train.checkpoint import hf_moe

FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
# The LlamaConfig fields a checkpoint fixes; the rest (dtype, remat, attention, …) stay the run's.
SHAPE_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings", "attention_bias", "rope_scaling",
                "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


class HfCheckpointError(ValueError):
  """A Hugging Face directory this importer cannot read (the file and key named)."""


# --- config.json ------------------------------------------------------------------------


def _read_json(path: str) -> dict[str, Any]:
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


def llama_config(directory: str, **overrides: Any):
  """The ``LlamaConfig`` of a Hugging Face Llama / Mistral / Qwen2 directory, or the ``MoEConfig`` of a
  Mixtral / Qwen2-MoE one (``hf_moe.py``), ``overrides`` on top.

  Raises:
    HfCheckpointError: what the reference Llama cannot represent (key named).
  """
  from distrib_train.recipes.llama import LlamaConfig
  from distrib_train.recipes.moe import MoEConfig

  path = os.path.join(directory, "config.json")
  hf = _read_json(path)
  arch = (hf.get("architectures") or ["?"])[0]
  known = {**FAMILIES, **hf_moe.FAMILIES}
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
  if family in hf_moe.FAMILIES.values():
    fields.update(hf_moe.fields(hf, path, family))
    fields.update(overrides)
    return MoEConfig(**fields)
  fields.update(overrides)
  return LlamaConfig(**fields)


# --- safetensors, read lazily -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Tensor:
  file: str
  dtype: Any
  shape: tuple[int, ...]
  begin: int  # byte offset of the data in the file


class SafetensorsDirectory:
  """The tensors of a directory's ``*.safetensors`` files (with or without an index), memory-mapped."""

  def __init__(self, directory: str):
    self.directory = directory
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
      files = sorted(set(_read_json(index).get("weight_map", {}).values()))
    else:
      files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
      raise HfCheckpointError(f"{directory} holds no *.safetensors files (PyTorch .bin checkpoints are not read:"
                              " convert them with transformers' save_pretrained(safe_serialization=True)).")
    self.tensors: dict[str, _Tensor] = {}
    for name in files:
      self.tensors.update(self._header(os.path.join(directory, name)))
    self._maps: dict[str, np.memmap] = {}

  @staticmethod
  def _header(path: str) -> dict[str, _Tensor]:
    try:
      with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size < 100 << 20:
          raise ValueError(f"header size {size}")
        header = json.loads(f.read(size))
    except (OSError, ValueError) as e:
      raise HfCheckpointError(f"{path} is not a safetensors file: {e}") from None
    out = {}
    for name, info in header.items():
      if name == "__metadata__":
        continue
      if info.get("dtype") not in _DTYPES:
        raise HfCheckpointError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}; read are"
                                f" {', '.join(_DTYPES)}.")
      out[name] = _Tensor(path, _DTYPES[info["dtype"]], tuple(info["shape"]), 8 + size + info["data_offsets"][0])
    return out

  def has(self, name: str) -> bool:
    return name in self.tensors

  def shape(self, name: str) -> tuple[int, ...]:
    return self._get(name).shape

  def _get(self, name: str) -> _Tensor:
    if name not in self.tensors:
      raise HfCheckpointError(f"{self.directory}: no tensor {name!r} in its safetensors files.")
    return self.tensors[name]

  def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
    """``tensor[index]``, reading only the pages that slice touches."""
    t = self._get(name)
    if t.file not in self._maps:
      self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
    count = math.prod(t.shape)
    raw = self._maps[t.file][t.begin:t.begin + count * np.dtype(t.dtype).itemsize]
    return np.asarray(raw.view(t.dtype).reshape(t.shape)[index])


# --- the reference Llama's params -------------------------------------------------------------


def _range(index: slice, size: int) -> tuple[int, int]:
  start, stop, step = index.indices(size)
  if step != 1:
    raise HfCheckpointError("a strided shard index")  # jax shards are contiguous
  return start, stop


def _per_layer(reader, shape: Sequence[int], index: tuple[slice, ...], read_layer) -> np.ndarray:
  first, last = _range(index[0], shape[0])
  return np.stack([read_layer(reader, layer, index[1:]) for layer in range(first, last)])


def _projection_in(kind: str, heads: int, head_dim: int):
  """[embed, heads, head_dim] of layer ``l`` from ``{kind}.weight`` [heads·head_dim, embed]."""
  def read(reader, layer, index):
    d0, d1 = _range(index[0], reader.shape(_name(layer, kind))[1])
    h0, h1 = _range(index[1], heads)
    block = reader.read(_name(layer, kind), (slice(h0 * head_dim, h1 * head_dim), slice(d0, d1)))
    return block.reshape(h1 - h0, head_dim, d1 - d0).transpose(2, 0, 1)[:, :, index[2]]
  return read


def _projection_out(heads: int, head_dim: int):
  """[heads, head_dim, embed] of layer ``l`` from ``o_proj.weight`` [embed, heads·head_dim]."""
  def read(reader, layer, index):
    h0, h1 = _range(index[0], heads)
    d0, d1 = _range(index[2], reader.shape(_name(layer, "self_attn.o_proj"))[0])
    block = reader.read(_name(layer, "self_attn.o_proj"), (slice(d0, d1), slice(h0 * head_dim, h1 * head_dim)))
    return block.reshape(d1 - d0, h1 - h0, head_dim).transpose(1, 2, 0)[:, index[1], :]
  return read


def _bias(kind: str, heads: int, head_dim: int):
  def read(reader, layer, index):
    h0, h1 = _range(index[0], heads)
    block = reader.read(_name(layer, kind, "bias"), (slice(h0 * head_dim, h1 * head_dim),))
    return block.reshape(h1 - h0, head_dim)[:, index[1]]
  return read


def _transposed(kind: str):
  """[in, out] of layer ``l`` from ``{kind}.weight`` [out, in]."""
  return lambda reader, layer, index: reader.read(_name(layer, kind), (index[1], index[0])).T


def _vector(kind: str):
  return lambda reader, layer, index: reader.read(_name(layer, kind), index)


def _name(layer: int, kind: str, what: str = "weight") -> str:
  return f"model.layers.{layer}.{kind}.{what}"


def _layer_readers(config) -> dict[str, Any]:
  h, kv, hd = config.num_heads, config.num_kv_heads, config.head_dim
  readers = {
      "attn_norm": _vector("input_layernorm"), "mlp_norm": _vector("post_attention_layernorm"),
      "wq": _projection_in("self_attn.q_proj", h, hd), "wk": _projection_in("self_attn.k_proj", kv, hd),
      "wv": _projection_in("self_attn.v_proj", kv, hd), "wo": _projection_out(h, hd),
      "w_gate": _transposed("mlp.gate_proj"), "w_up": _transposed("mlp.up_proj"),
      "w_down": _transposed("mlp.down_proj"),
  }
  if config.attention_bias:
    readers.update(bq=_bias("self_attn.q_proj", h, hd), bk=_bias("self_attn.k_proj", kv, hd),
                   bv=_bias("self_attn.v_proj", kv, hd))
  if hf_moe.is_moe(config):
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
      "head": ("lm_head.weight", (v, d)), "attn_norm": (_name(0, "input_layernorm"), (d,)),
      "mlp_norm": (_name(0, "post_attention_layernorm"), (d,)), "wq": (_name(0, "self_attn.q_proj"), (h * hd, d)),
      "wk": (_name(0, "self_attn.k_proj"), (kv * hd, d)), "wv": (_name(0, "self_attn.v_proj"), (kv * hd, d)),
      "wo": (_name(0, "self_attn.o_proj"), (d, h * hd)), "w_gate": (_name(0, "mlp.gate_proj"), (f, d)),
      "w_up": (_name(0, "mlp.up_proj"), (f, d)), "w_down": (_name(0, "mlp.down_proj"), (d, f)),
      "bq": (_name(0, "self_attn.q_proj", "bias"), (h * hd,)), "bk": (_name(0, "self_attn.k_proj", "bias"), (kv * hd,)),
      "bv": (_name(0, "self_attn.v_proj", "bias"), (kv * hd,)),
  }
  wanted = [expected[keys[-1]]] if keys[-1] in expected else []
  if hf_moe.is_moe(config) and keys[0] == "layers":
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
    out[_name(i, "input_layernorm")] = layer["attn_norm"][i]
    out[_name(i, "post_attention_layernorm")] = layer["mlp_norm"][i]
    for kind, key, n in (("q_proj", "wq", h), ("k_proj", "wk", kv), ("v_proj", "wv", kv)):
      out[_name(i, f"self_attn.{kind}")] = np.ascontiguousarray(layer[key][i].reshape(d, n * hd).T)
    out[_name(i, "self_attn.o_proj")] = np.ascontiguousarray(layer["wo"][i].reshape(h * hd, d).T)
    if hf_moe.is_moe(config):
      out.update(hf_moe.layer_tensors(layer, config, i))
    else:
      for kind, key in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
        out[_name(i, f"mlp.{kind}")] = np.ascontiguousarray(layer[key][i].T)
    if config.attention_bias:
      for kind, key in (("q_proj", "bq"), ("k_proj", "bk"), ("v_proj", "bv")):
        out[_name(i, f"self_attn.{kind}", "bias")] = layer[key][i].reshape(-1)
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
  if hf_moe.is_moe(config):
    return hf_moe.config_json(config, out)
  return out


def save(params: Any, config, directory: str, *, family: str = "", max_shard_bytes: int = 5 << 30) -> list[str]:
  """Writes ``params`` as a Hugging Face checkpoint (``config.json``, float32 safetensors, an index when
  sharded) into ``directory``, from process 0; returns the files written.

  Every process must call it (multi-host params are gathered tensor by tensor).
  """
  from safetensors.numpy import save_file

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
    json.dump(hf_config(config, family), f, indent=1)
  written.append("config.json")
  return written


def tensors_equal(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
  """Whether two tensor maps hold the same names, shapes and bits."""
  return set(a) == set(b) and all(a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a)
