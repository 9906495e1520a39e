"""Hugging Face checkpoints in and out: ``config.json`` + ``*.safetensors`` ↔ the reference decoders.

Every family (Llama, Mistral, Qwen2/3, Gemma 3, Mixtral, Qwen2/3-MoE,
DeepSeek-V3, gpt-oss) goes through one table of its tensor names and
layouts (``recipes/hf_tables.py``), used three ways:

- ``load_params(directory, abstract, config)`` builds the params (or the
  local state: DeepSeek-V3's router score correction) as ``jax.Array``s on
  the shardings ``abstract`` carries. Each device's shard is read from the
  safetensors files by itself (memory-mapped: a process reads only the
  slices its devices hold, so no host holds the whole model), in any of
  F32, BF16 and F16, cast to the param dtype.
- ``check_params`` checks, from the files' headers alone, that every tensor
  is there in the shape the config gives it (the start-up checks).
- ``save(params, config, directory)`` writes them back (float32
  safetensors, shards of at most ``max_shard_bytes`` with an index file,
  and ``config.json``, ``recipes/hf_shape.py``); an import followed by an
  export gives the same tensors, bit for bit.

DeepSeek-V3's multi-token-prediction modules (``model.mtp_depth``) are
its layers after the last (``model.layers.61.*``), their copies of the
embedding and head written, not read.

Layers live in segments of equal layers (``recipes/decoder.py``): segment
``layers_3``'s layer ``i`` is Hugging Face's layer ``3 + i``. ``config.json``
is read in ``recipes/hf_shape.py``; the safetensors reader is
``hf_common.py``.

Not for: distrib_train's own checkpoints (``manager.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from distrib_train.checkpoint.hf_common import SafetensorsDirectory, shard_range
from distrib_train.recipes import decoder, hf_tables, mtp

# config.json ↔ the reference models' config is read and written in recipes/hf_shape.py; public here too.
from distrib_train.recipes.hf_shape import FAMILIES, MOE_FAMILIES, HfCheckpointError, hf_config  # noqa: F401
from distrib_train.recipes.hf_shape import is_moe, llama_config  # noqa: F401
from distrib_train.objectives.dpo import ROLES


def path_keys(path) -> tuple[str, ...]:
  """``("layers", "wq")`` for a param's pytree path (nnx's trailing ``value`` dropped, and the leading indices of
  a tuple of trees or of the frozen weights' adapter: a weight is named the same trained or frozen; and a
  preference model's ``policy`` or ``reference``, ``objectives/dpo.py``: both are the same model)."""
  path = list(path)
  while path and isinstance(path[0], (jax.tree_util.SequenceKey, jax.tree_util.FlattenedIndexKey)):
    path.pop(0)
  keys = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
  if keys and keys[0] in ROLES:
    keys = keys[1:]
  return keys[:-1] if keys and keys[-1] == "value" else keys


def is_reference(path) -> bool:
  """Whether a pytree path is in a preference model's frozen reference copy."""
  keys = [
    str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
    for k in path
    if not isinstance(k, (jax.tree_util.SequenceKey, jax.tree_util.FlattenedIndexKey))
  ]
  return bool(keys) and keys[0] == ROLES[1]


def _adapter(keys: tuple[str, ...]) -> bool:
  """A LoRA adapter (``recipes/lora.py``): no Hugging Face checkpoint holds one; it keeps its fresh value."""
  return bool(keys) and keys[-1].startswith("lora_")


def tensor_tables(config) -> dict[str, tuple[int, dict[str, hf_tables.Tensor]]]:
  """Each segment's name → (its first layer, its tensors by our param name); ``""`` → the top-level ones; the
  multi-token-prediction modules' (``mtp``) → the layers after the last."""
  out = {"": (0, {t.param: t for t in hf_tables.top_tensors(config)})}
  for segment in decoder.segments(config):
    tensors = hf_tables.tensors(config, segment.kinds[0].mixture)
    out[segment.name] = (segment.start, {t.param: t for t in tensors})
  if config.mtp_depth:
    out[mtp.NAME] = (config.num_layers, {t.param: t for t in hf_tables.mtp_tensors(config)})
  return out


def _layers(config, name: str) -> int:
  """How many layers the table ``name`` (a segment, or ``mtp``) stacks."""
  if name == mtp.NAME:
    return config.mtp_depth
  return next(s.count for s in decoder.segments(config) if s.name == name)


def _find(config, keys: tuple[str, ...]) -> tuple[hf_tables.Tensor | None, int | None]:
  """The table entry of a param at ``keys`` and its segment's first layer (None at the top level)."""
  tables = tensor_tables(config)
  if len(keys) == 1:
    return tables[""][1].get(keys[0]), None
  start, tensors = tables.get(keys[0], (0, {}))
  return tensors.get(keys[-1]), start


def _hf_shapes(tensor: hf_tables.Tensor, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
  """Hugging Face's tensors (``{expert}`` filled in) and shapes for one layer's ``shape`` of ours."""
  layout = tensor.layout
  if layout == "experts":
    return [(tensor.name.replace("{expert}", str(e)), (shape[2], shape[1])) for e in range(shape[0])]
  if layout == "heads_in":
    return [(tensor.name, (shape[1] * shape[2], shape[0]))]
  if layout == "heads_out":
    return [(tensor.name, (shape[2], shape[0] * shape[1]))]
  if layout == "heads_vector":
    return [(tensor.name, (shape[0] * shape[1],))]
  if layout in ("even", "odd"):
    return [(tensor.name, (*shape[:-1], 2 * shape[-1]))]
  return [(tensor.name, shape[::-1] if layout == "transposed" else shape)]


def _read(
  reader: SafetensorsDirectory,
  tensor: hf_tables.Tensor,
  layer: int | None,
  shape: tuple[int, ...],
  index: tuple[slice, ...],
) -> np.ndarray:
  """``index`` of one layer's param (our layout, ``shape``) from Hugging Face's tensor, reading only that slice."""
  name = tensor.name.format(layer=layer, expert="{expert}")
  layout = tensor.layout
  if layout == "same":
    return reader.read(name, index)
  if layout == "transposed":
    return reader.read(name, (index[1], index[0])).T
  if layout == "heads_in":  # [in, heads, head] from [heads·head, in]
    (h0, h1), hd = shard_range(index[1], shape[1]), shape[2]
    block = reader.read(name, (slice(h0 * hd, h1 * hd), index[0]))
    return block.reshape(h1 - h0, hd, -1).transpose(2, 0, 1)[:, :, index[2]]
  if layout == "heads_out":  # [heads, head, out] from [out, heads·head]
    (h0, h1), hd = shard_range(index[0], shape[0]), shape[1]
    block = reader.read(name, (index[2], slice(h0 * hd, h1 * hd)))
    return block.reshape(-1, h1 - h0, hd).transpose(1, 2, 0)[:, index[1], :]
  if layout == "heads_vector":  # [heads, head] from [heads·head]
    (h0, h1), hd = shard_range(index[0], shape[0]), shape[1]
    return reader.read(name, (slice(h0 * hd, h1 * hd),)).reshape(h1 - h0, hd)[:, index[1]]
  if layout == "experts":  # [experts, in, out] from each expert's [out, in]
    e0, e1 = shard_range(index[0], shape[0])
    return np.stack([reader.read(name.replace("{expert}", str(e)), (index[2], index[1])).T for e in range(e0, e1)])
  f0, f1 = shard_range(index[-1], shape[-1])  # even / odd: interleaved columns of gpt-oss's gate_up
  offset = 0 if layout == "even" else 1
  return reader.read(name, (*index[:-1], slice(2 * f0 + offset, 2 * f1, 2)))


def _reader_of(reader, config, keys, shape, dtype, what: str):
  tensor, start = _find(config, keys)
  if tensor is None:
    raise HfCheckpointError(f"no Hugging Face tensor for the reference decoder's {what} {'/'.join(keys)}.")
  if start is None:
    read = lambda index: _read(reader, tensor, None, shape, index)
  else:

    def read(index):
      first, last = shard_range(index[0], shape[0])
      return np.stack([_read(reader, tensor, start + layer, shape[1:], index[1:]) for layer in range(first, last)])

  return lambda index: read(index).astype(dtype)


def _read_names(config) -> set[str]:
  """Every Hugging Face tensor the family's tables read for ``config``."""
  names = set()
  for segment, (start, tensors) in tensor_tables(config).items():
    count = _layers(config, segment) if segment else 1
    for tensor in tensors.values():
      for layer in range(start, start + count) if segment else [None]:
        name = tensor.name.format(layer=layer, expert="{expert}")
        experts = range(config.num_experts) if "{expert}" in name else [None]
        names.update(name.replace("{expert}", str(e)) for e in experts)
  return names


def _unread(reader: SafetensorsDirectory, config) -> list[str]:
  """The checkpoint's tensors the importer would leave unread (a variant it does not model), less those
  transformers leaves too: a tied checkpoint's ``lm_head``, rotary frequency buffers, the layers past
  ``num_layers`` (DeepSeek-V3's multi-token-prediction layer)."""
  read = _read_names(config)
  past = tuple(f"model.layers.{i}." for i in range(config.num_layers, config.num_layers + 8))
  return sorted(
    n
    for n in reader.tensors
    if n not in read
    and not n.startswith(past)
    and not n.endswith("rotary_emb.inv_freq")
    and not (config.tie_embeddings and n == "lm_head.weight")
  )


def check_params(directory: str, abstract_params: Any, config, abstract_local: Any = None, skip: Any = None) -> None:
  """Checks, from the files' headers alone, that ``directory`` holds every tensor of ``abstract_params`` (and of
  the local state the checkpoint sets, ``abstract_local``) in the shape ``config`` gives it, and nothing the
  importer would leave unread.

  Raises:
    HfCheckpointError: a tensor missing, of another shape, or not read (named).
  """
  reader = SafetensorsDirectory(directory)
  if abstract_params is not None and (unread := _unread(reader, config)):
    raise HfCheckpointError(
      f"{directory}: tensor {unread[0]!r}"
      f"{f' (and {len(unread) - 1} more)' if len(unread) > 1 else ''} is not read by the"
      f" {config.hf_model_type or 'reference'} importer: a variant it does not model."
    )
  for tree, required in ((abstract_params, True), (abstract_local, False)):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if tree is not None else []:
      if skip is not None and skip(path):  # a leaf the loader keeps fresh
        continue
      keys = path_keys(path)
      tensor, start = _find(config, keys)
      if tensor is None:
        if required and not _adapter(keys):
          raise HfCheckpointError(f"no Hugging Face tensor for the reference decoder's {'/'.join(keys)}.")
        continue
      layers = range(start, start + leaf.shape[0]) if start is not None else [None]
      per_layer = leaf.shape[1:] if start is not None else leaf.shape
      for layer in layers:
        for name, want in _hf_shapes(tensor, tuple(per_layer)):
          name = name.format(layer=layer)
          found = reader.shape(name)
          if found != want:
            raise HfCheckpointError(f"{reader.directory}: tensor {name!r} has shape {found}, the config says {want}.")


def load_params(directory: str, abstract: Any, config, fresh: Any = None, skip: Any = None) -> Any:
  """The params (or local state) of ``directory``'s checkpoint on the shardings of ``abstract``.

  Args:
    directory: a local Hugging Face model directory.
    abstract: the params as ``jax.ShapeDtypeStruct``s with shardings (``plan.abstract_train_state.params``), the
      frozen weights (``…model_without_params``, LoRA's base) or the local state (``…local_state``).
    config: the model's config (``llama_config(directory)``).
    fresh: for the local state, its freshly initialised values: a leaf the checkpoint does not hold (FP8
      histories, a step's router loads) keeps its value there. None: every leaf must be in the checkpoint.
    skip: with ``fresh``, the paths (a predicate) that keep their value there too.

  Raises:
    HfCheckpointError: a tensor missing or of another shape (named).
  """
  check_params(directory, abstract if fresh is None else None, config, None if fresh is None else abstract, skip)
  reader = SafetensorsDirectory(directory)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  kept = jax.tree_util.tree_leaves(fresh) if fresh is not None else [None] * len(leaves)
  out = []
  for (path, leaf), value in zip(leaves, kept):
    keys = path_keys(path)
    if fresh is not None and (_find(config, keys)[0] is None or (skip is not None and skip(path))):
      out.append(value)
      continue
    read = _reader_of(reader, config, keys, leaf.shape, leaf.dtype, "param")
    out.append(jax.make_array_from_callback(leaf.shape, leaf.sharding, read))
  return jax.tree_util.tree_unflatten(treedef, out)


# --- export -----------------------------------------------------------------------------------


def host_array(x: jax.Array) -> np.ndarray:
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def write_param(tensor: hf_tables.Tensor, a: np.ndarray, out: dict[str, np.ndarray], layer: int | None) -> None:
  """One layer's param ``a`` (our layout) into ``out`` as Hugging Face's tensor(s)."""
  name = tensor.name.format(layer=layer, expert="{expert}")
  layout = tensor.layout
  if layout == "experts":
    for e in range(a.shape[0]):
      out[name.replace("{expert}", str(e))] = np.ascontiguousarray(a[e].T)
  elif layout in ("even", "odd"):
    merged = out.setdefault(name, np.zeros((*a.shape[:-1], 2 * a.shape[-1]), np.float32))
    merged[..., (0 if layout == "even" else 1) :: 2] = a
  else:
    if layout == "heads_in":
      a = a.reshape(a.shape[0], -1).T
    elif layout == "heads_out":
      a = a.reshape(-1, a.shape[-1]).T
    elif layout == "heads_vector":
      a = a.reshape(-1)
    elif layout == "transposed":
      a = a.T
    out[name] = np.ascontiguousarray(a)


def hf_tensors(params: Any, config, local_state: Any = None) -> dict[str, np.ndarray]:
  """The Hugging Face tensors (float32) of the reference decoder's ``params`` (and the local state the family
  stores, DeepSeek-V3's router score correction).

  Raises:
    HfCheckpointError: a tensor the family needs whose value is not given (named).
  """
  out: dict[str, np.ndarray] = {}
  given = {}
  for tree in (params, local_state):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if tree is not None else []:
      if not is_reference(path):  # a preference model's frozen reference: the policy is the model written
        given[path_keys(path)] = leaf
  for segment, (start, tensors) in tensor_tables(config).items():
    for tensor in tensors.values():
      keys = (tensor.param,) if not segment else (segment, tensor.param)
      if keys not in given:
        raise HfCheckpointError(
          f"{'/'.join(keys)} is needed for {tensor.name} and was not given (the model's local"
          " state holds it: pass it too)."
        )
      a = host_array(given[keys]).astype(np.float32)
      if not segment:
        write_param(tensor, a, out, None)
      else:
        for i in range(a.shape[0]):
          write_param(tensor, a[i], out, start + i)
  for depth in range(config.mtp_depth):  # DeepSeek-V3's MTP layers carry copies of the embedding and head
    for name, copied in hf_tables.MTP_COPIES:
      source = out.get(copied, out["model.embed_tokens.weight"])  # a tied head is the embedding
      out[f"model.layers.{config.num_layers + depth}.{name}"] = source
  return out


def save(params: Any, config, directory: str, *, local_state: Any = None, max_shard_bytes: int = 5 << 30) -> list[str]:
  """Writes ``params`` (and the local state its family stores) as a Hugging Face checkpoint (``config.json``,
  float32 safetensors, an index when sharded) into ``directory``, from process 0; returns the files written.

  Every process must call it (multi-host params are gathered tensor by tensor).
  """
  from safetensors.numpy import save_file

  config_json = hf_config(config)  # refuses what the family cannot express before anything is written
  tensors = hf_tensors(params, config, local_state)
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
  names = (
    ["model.safetensors"]
    if len(shards) == 1
    else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  )
  for name, shard in zip(names, shards):
    save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
    written.append(name)
  if len(shards) > 1:
    index = {
      "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
      "weight_map": {t: n for n, shard in zip(names, shards) for t in shard},
    }
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
