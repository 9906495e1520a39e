"""Text files as documents: ``.txt`` (one document), ``.jsonl`` (a field of each line), ``.parquet`` (a column).

Each reader is random access (``len`` and ``[index]``), as grain's
``MapDataset.source`` wants, and lazy: a ``.jsonl`` file is indexed by the
byte offset of each non-blank line (8 bytes a document; found by a numpy
newline scan, no JSON parsed, and kept by ``index_cache.py``, so only the
first open of a file reads it whole) and each line is sliced from one
memory map of the file and parsed when the pipeline asks for it; a
``.parquet`` file is read a row group at a time (its groups are its blocks:
``block_order.py`` shuffles by them, and the source's
``block_order.BlockCache`` keeps the last ones read); a ``.txt`` file is one
document, read when needed. ``.jsonl.zst`` / ``.jsonl.gz`` files
(``compressed.py``) and Hugging Face ``datasets`` folders
(``arrow_text.py``) are read by their own modules; ``expand`` and
``iter_text_file`` take them too. A process holds only the documents it is
tokenizing and the cached blocks, whatever the corpus size.
``iter_text_file`` streams one file's documents in order (the converter's
input).

JSONL files are read by ``jsonl.py`` (its index, and the policy for
malformed lines, ``data.bad_records``).

Not for: choosing a source from the config (``sources.py``), ArrayRecord
shards (``record_shards.py``).
"""

from __future__ import annotations

import glob as globlib
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from distrib_train.common import extras
from distrib_train.data import arrow_text
from distrib_train.data import block_order
from distrib_train.data import compressed
from distrib_train.data import jsonl


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
        raise ValueError(
          f"Cannot read data file {path!r}: Is a directory, and not one written by datasets'"
          " save_to_disk (no state.json or dataset_dict.json); give its files or a glob."
        )
    files.extend(matched)
  return files


def iter_text_file(path: str, field: str = "text", bad_records: jsonl.BadRecords | None = None) -> Iterator[str]:
  """The documents of one file, read as they are needed.

  A ``.jsonl`` file yields the ``field`` of each line, one line in memory at
  a time (a ``.jsonl.zst`` / ``.jsonl.gz`` one decompressed chunk at a
  time; a malformed line goes to ``bad_records``: skipped, by default, or
  raised); a ``.parquet`` file the ``field`` column, one row group at a
  time; a ``datasets`` folder its column ``field``; any other file is one
  document (blank ones yield none).

  Raises:
    ValueError: an unreadable file, text that is not UTF-8, or (with
      ``bad_records`` ``error``) a malformed JSONL line (file and line named).
  """
  if path.endswith(".parquet"):
    parquet = ParquetFile(path, field)
    for group in range(parquet.groups):
      yield from (doc for doc in parquet.group(group) if doc.strip())
    return
  bad_records = bad_records or jsonl.BadRecords()
  if arrow_text.is_dataset_folder(path):
    yield from (doc for doc in arrow_text.DatasetFolder(path, field) if doc.strip())
    return
  if compressed.is_compressed(path):
    for number, line in compressed.iter_lines(path):
      doc = jsonl.json_document(line, path, number, field, bad_records)
      if doc is not None:
        yield doc
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
        if raw.strip() and (doc := jsonl.json_document(raw, path, number, field, bad_records)) is not None:
          yield doc
  except OSError as e:
    raise ValueError(f"Cannot read data file {path!r}: {e.strerror}.") from None


class TextFile:
  """A ``.txt`` file: one document, read when asked for (none if blank)."""

  def __init__(self, path: str):
    self.path = path
    try:
      with open(path, "rb") as f:
        head = f.read(1 << 16)
      self.blank = not head.strip() and os.path.getsize(path) <= 1 << 16
      if not self.blank:  # not UTF-8 fails now, naming the file; the rest is checked when it is read
        _decode(head[: len(head) - (_cut_character(head) if len(head) == 1 << 16 else 0)], path, None)
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
    pq = extras.require("pyarrow.parquet", f"Parquet data ({path!r})")
    self.path, self.field = path, field
    self.cache = cache or block_order.BlockCache(1)
    try:
      self.file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid / OSError with its own text
      raise ValueError(f"Data file {path!r} is not a readable Parquet file: {e}") from None
    schema = self.file.schema_arrow
    if field in arrow_text.RECORDS:
      self._columns = arrow_text.record_columns(path, schema.names, field)
    else:
      self._columns = [field]
      arrow_text.check_text_type(path, field, schema.names, schema.field(field).type if field in schema.names else None)
    meta = self.file.metadata
    self.groups = meta.num_row_groups
    self.starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(self.groups)])
    self.block_starts = self.starts
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return int(self.starts[-1])

  def group(self, group: int) -> arrow_text.Strings:
    """Row group ``group``'s texts (from the cache, else read and kept)."""

    def read() -> arrow_text.Strings | arrow_text.Records:
      table = self.file.read_row_group(group, columns=self._columns)
      if self.field in arrow_text.RECORDS:
        return arrow_text.Records(table)
      return arrow_text.Strings(table.column(0), self.path, self.field, int(self.starts[group]))

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


def _cut_character(head: bytes) -> int:
  """How many bytes at the end of ``head`` begin a UTF-8 character that the cut left incomplete (0-3)."""
  for back in range(1, min(4, len(head)) + 1):
    byte = head[-back]
    if byte & 0xC0 != 0x80:  # not a continuation byte: the character's first
      width = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
      return back if width > back else 0
  return 0


def _decode(raw: bytes, path: str, line: int | None) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    where = f" line {line}" if line is not None else ""
    raise ValueError(f"Data file {path!r}{where} is not UTF-8 text (byte {e.start}).") from None
