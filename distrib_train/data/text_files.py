"""Text files as documents: ``.txt`` (one document), ``.jsonl`` (a field of each line), ``.parquet`` (a column).

Each reader is random access (``len`` and ``[index]``), as grain's
``MapDataset.source`` wants, and lazy: a ``.jsonl`` file is indexed by the
byte offset of each document (8 bytes a document) and each line read when
the pipeline asks for it; a ``.parquet`` file is read a row group at a time
(its groups are its blocks: ``block_order.py`` shuffles by them, and the
source's ``block_order.BlockCache`` keeps the last ones read); a ``.txt``
file is one document, read when needed. ``.jsonl.zst`` / ``.jsonl.gz``
files (``compressed.py``) and Hugging Face ``datasets`` folders
(``arrow_text.py``) are read by their own modules; ``expand`` and
``iter_text_file`` take them too. A process holds only the documents it is
tokenizing and the cached blocks, whatever the corpus size.
``iter_text_file`` streams one file's documents in order (the converter's
input).

Not for: choosing a source from the config (``sources.py``), ArrayRecord
shards (``record_shards.py``).
"""

from __future__ import annotations

import glob as globlib
import json
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from distrib_train.data import arrow_text
from distrib_train.data import block_order
from distrib_train.data import compressed


def expand(paths: Sequence[str]) -> list[str]:
  """The files that ``paths`` (files, globs, or ``datasets`` folders) name, each glob's matches sorted.

  Raises:
    ValueError: a path or glob that matches no file, or a folder that is not a ``datasets`` folder.
  """
  files = []
  for pattern in paths:
    matched = sorted(globlib.glob(os.path.expanduser(pattern)))
    if not matched:
      raise ValueError(f"Data path {pattern!r} matches no file.")
    for path in matched:
      if os.path.isdir(path) and not arrow_text.is_dataset_folder(path):
        raise ValueError(f"Cannot read data file {path!r}: Is a directory, and not one written by datasets'"
                         " save_to_disk (no state.json or dataset_dict.json); give its files or a glob.")
    files.extend(matched)
  return files


def iter_text_file(path: str, field: str = "text") -> Iterator[str]:
  """The documents of one file, read as they are needed.

  A ``.jsonl`` file yields the ``field`` of each line, one line in memory at
  a time (a ``.jsonl.zst`` / ``.jsonl.gz`` one decompressed chunk at a
  time); a ``.parquet`` file the ``field`` column, one row group at a time;
  a ``datasets`` folder its column ``field``; any other file is one
  document (blank ones yield none).

  Raises:
    ValueError: an unreadable file, text that is not UTF-8, a line that is
      not JSON or has no string ``field`` (file and line named).
  """
  if path.endswith(".parquet"):
    parquet = ParquetFile(path, field)
    for group in range(parquet.groups):
      yield from (doc for doc in parquet.group(group) if doc.strip())
    return
  if arrow_text.is_dataset_folder(path):
    yield from (doc for doc in arrow_text.DatasetFolder(path, field) if doc.strip())
    return
  if compressed.is_compressed(path):
    yield from (_json_text(line, path, number, field) for number, line in compressed.iter_lines(path))
    return
  try:
    if not path.endswith(".jsonl"):
      with open(path, "rb") as f:
        text = _decode(f.read(), path, None)
      if text.strip():
        yield text
      return
    with open(path, "rb") as f:
      for number, raw in enumerate(f, 1):
        if raw.strip():
          yield _json_text(raw, path, number, field)
  except OSError as e:
    raise ValueError(f"Cannot read data file {path!r}: {e.strerror}.") from None


def _json_text(raw: bytes, path: str, number: int, field: str) -> str:
  line = _decode(raw, path, number)
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"Data file {path!r} line {number} is not JSON: {e.msg}.") from None
  if not isinstance(record, dict) or not isinstance(record.get(field), str):
    raise ValueError(f"Data file {path!r} line {number} has no string field {field!r} (data.text_field).")
  return record[field]


class JsonlFile:
  """A JSONL file's documents by number: the byte offset of each non-blank line (8 bytes a document),
  each line read from disk when asked for.

  Every line is checked once, streaming, when the file is opened (JSON with
  a string ``field``): a bad line fails the loader's construction, naming
  the file and line, not a step hours later.
  """

  def __init__(self, path: str, field: str):
    self.path, self.field = path, field
    offsets, position = [], 0
    try:
      with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
          if raw.strip():
            _json_text(raw, path, number, field)
            offsets.append(position)
          position += len(raw)
    except OSError as e:
      raise ValueError(f"Cannot read data file {path!r}: {e.strerror}.") from None
    self.offsets = np.asarray(offsets, np.int64)

  def __len__(self) -> int:
    return len(self.offsets)

  def __getitem__(self, index: int) -> str:
    with open(self.path, "rb") as f:
      f.seek(int(self.offsets[index]))
      return _json_text(f.readline(), self.path, 0, self.field)


class TextFile:
  """A ``.txt`` file: one document, read when asked for (none if blank)."""

  def __init__(self, path: str):
    self.path = path
    try:
      with open(path, "rb") as f:
        head = f.read(1 << 16)
      self.blank = not head.strip() and os.path.getsize(path) <= 1 << 16
      if not self.blank:
        self[0]  # not UTF-8 fails now, naming the file
    except OSError as e:
      raise ValueError(f"Cannot read data file {path!r}: {e.strerror}.") from None

  def __len__(self) -> int:
    return 0 if self.blank else 1

  def __getitem__(self, index: int) -> str:
    with open(self.path, "rb") as f:
      return _decode(f.read(), self.path, None)


class ParquetFile:
  """A Parquet file's ``field`` column by row, read one row group (its block) at a time into ``cache``."""

  sequential = False  # any row group reads alone

  def __init__(self, path: str, field: str, cache: block_order.BlockCache | None = None):
    try:
      import pyarrow.parquet as pq
    except ImportError:
      raise ValueError("Parquet data needs pyarrow: pip install pyarrow (or 'distrib_train[text]').") from None
    self.path, self.field = path, field
    self.cache = cache or block_order.BlockCache(1)
    try:
      self.file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid / OSError with its own text
      raise ValueError(f"Data file {path!r} is not a readable Parquet file: {e}") from None
    schema = self.file.schema_arrow
    arrow_text.check_text_type(path, field, schema.names,
                               schema.field(field).type if field in schema.names else None)
    meta = self.file.metadata
    self.groups = meta.num_row_groups
    self.starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(self.groups)])
    self.block_starts = self.starts
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return int(self.starts[-1])

  def group(self, group: int) -> arrow_text.Strings:
    """Row group ``group``'s texts (from the cache, else read and kept)."""
    def read() -> arrow_text.Strings:
      column = self.file.read_row_group(group, columns=[self.field]).column(0)
      return arrow_text.Strings(column, self.path, self.field, int(self.starts[group]))

    return self.cache.get_or_make((self.path, group), read, self._lock)

  def __getitem__(self, index: int) -> str:
    group = int(np.searchsorted(self.starts, index, side="right")) - 1
    return self.group(group)[index - int(self.starts[group])]

  def __getstate__(self) -> dict:  # a copy sent to another process opens the file again
    return {"path": self.path, "field": self.field, "cache": self.cache}

  def __setstate__(self, state: dict) -> None:
    self.__init__(state["path"], state["field"], state["cache"])


class Concatenated:
  """Several files' documents as one numbered sequence."""

  def __init__(self, parts: Sequence[Any]):
    self.parts = [p for p in parts if len(p)]
    self.starts = np.cumsum([0] + [len(p) for p in self.parts])

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getitem__(self, index: int) -> Any:
    part = int(np.searchsorted(self.starts, index, side="right")) - 1
    return self.parts[part][index - int(self.starts[part])]

  def blocks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The blocks of the files read by blocks (``block_starts``), for the shuffle by blocks
    (``block_order.BlockOrder``): every block's first document number (and the count last), the part
    of each block, and per part whether it is ``sequential``. A random-access part counts as blocks of
    ``block_order.RANDOM_ACCESS_BLOCK`` documents. None where no part is read by blocks."""
    if not any(hasattr(p, "block_starts") for p in self.parts):
      return None
    starts, files = [np.zeros(1, np.int64)], []
    for number, (part, first) in enumerate(zip(self.parts, self.starts)):
      own = getattr(part, "block_starts", None)
      if own is None:
        own = np.append(np.arange(0, len(part), block_order.RANDOM_ACCESS_BLOCK), len(part))
      own = np.asarray(own, np.int64)
      starts.append(own[1:] + first)
      files.append(np.full(len(own) - 1, number, np.int32))
    sequential = np.array([bool(getattr(p, "sequential", False)) for p in self.parts])
    return np.concatenate(starts), np.concatenate(files), sequential


def _decode(raw: bytes, path: str, line: int | None) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    where = f" line {line}" if line is not None else ""
    raise ValueError(f"Data file {path!r}{where} is not UTF-8 text (byte {e.start}).") from None
