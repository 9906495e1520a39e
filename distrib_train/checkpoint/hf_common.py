"""The Hugging Face importer's files: safetensors read lazily, a slice at a time.

``SafetensorsDirectory(directory)`` reads a directory's ``*.safetensors``
files (with or without an index) lazily: only their headers at first, then
each slice asked for, memory-mapped, so a process reads only what its devices
hold; ``shard_range`` turns a shard's index into its contiguous range;
``fingerprint`` tells a directory's weights apart without reading them all.
``hf.py`` reads every family's tensors through them.

Not for: which tensor goes where (``recipes/hf_tables.py``) or
``config.json`` (``recipes/hf_shape.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any

import ml_dtypes
import numpy as np

from distrib_train.recipes.hf_shape import HfCheckpointError, read_json

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


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
      files = sorted(set(read_json(index).get("weight_map", {}).values()))
    else:
      files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
      raise HfCheckpointError(
        f"{directory} holds no *.safetensors files (PyTorch .bin checkpoints are not read:"
        " convert them with transformers' save_pretrained(safe_serialization=True))."
      )
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
        raise HfCheckpointError(
          f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}; read are {', '.join(_DTYPES)}."
        )
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
    raw = self._maps[t.file][t.begin : t.begin + count * np.dtype(t.dtype).itemsize]
    return np.asarray(raw.view(t.dtype).reshape(t.shape)[index])


def shard_range(index: slice, size: int) -> tuple[int, int]:
  """``(start, stop)`` of a shard's slice along an axis of ``size``.

  Raises:
    HfCheckpointError: a strided slice (jax shards are contiguous).
  """
  start, stop, step = index.indices(size)
  if step != 1:
    raise HfCheckpointError("a strided shard index")  # jax shards are contiguous
  return start, stop


_SAMPLE_BYTES = 4096


def fingerprint(directory: str) -> dict[str, str]:
  """Per ``*.safetensors`` file, the sha256 of its size, its header, each tensor's first and last 4 KiB (a
  tensor changed throughout, as a merged adapter's, changes both) and 16 slices of 64 KiB spread over the file;
  ``config.json``'s whole. A copy elsewhere (new modification times) matches. Reads 8 KiB a tensor and 1 MiB a
  file."""
  out = {}
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if name == "config.json":
      with open(path, "rb") as f:
        out[name] = hashlib.sha256(f.read()).hexdigest()[:32]
    elif name.endswith(".safetensors"):
      digest = hashlib.sha256(str(os.path.getsize(path)).encode())
      with open(path, "rb") as f:
        head = f.read(8)
        header = f.read(min(int.from_bytes(head, "little"), 100 << 20))
        digest.update(head + header)
        try:
          spans = sorted(v["data_offsets"] for k, v in json.loads(header).items() if k != "__metadata__")
        except (ValueError, AttributeError, KeyError, TypeError):  # not a safetensors header: its bytes only
          spans = []
        for begin, end in spans:
          for at in (begin, max(begin, end - _SAMPLE_BYTES)):
            f.seek(8 + len(header) + at)
            digest.update(f.read(min(_SAMPLE_BYTES, end - at)))
        for i in range(16):  # and 16 slices spread over the file
          f.seek(os.path.getsize(path) * i // 16)
          digest.update(f.read(16 * _SAMPLE_BYTES))
      out[name] = digest.hexdigest()[:32]
  return out
