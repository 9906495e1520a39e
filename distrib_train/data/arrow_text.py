"""Text columns of Arrow data: a Parquet row group's, or a Hugging Face ``datasets`` folder's, by row.

``Strings`` reads a string column straight from its Arrow buffers (the
offsets as a numpy view, the bytes decoded per row), not through Python
objects per row: a Parquet row group held in the block cache costs its text
and 4 or 8 bytes a row. ``DatasetFolder`` opens a folder written by
``datasets``' ``save_to_disk`` with ``load_from_disk`` (memory-mapped Arrow
files: opening costs O(files), a row is read from the page cache when asked
for) and reads the column ``data.text_field`` by row.

pyarrow and ``datasets`` are imported only here, when such data is read
(``pip install pyarrow`` / ``pip install datasets``).

Not for: choosing a reader (``sources.py``), Parquet files' row groups
(``text_files.ParquetFile``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from distrib_train.common import extras

_TEXT_TYPES = ("string", "large_string")
# ``data.text_field`` for conversation records (``data.loss_on`` set): a document is the whole record, as
# JSON text, its conversation columns (``RECORD_COLUMNS``) read.
RECORD = "*"
PROMPTS = "**"  # a prompt record (RL's prompts: ``posttrain/rollouts.py``): every column, ``prompt`` among them
RECORDS = (RECORD, PROMPTS)
RECORD_COLUMNS = ("messages", "prompt", "completion", "chosen", "rejected")


def record_columns(path: str, names: list[str], field: str = RECORD) -> list[str]:
  """The conversation columns of a table with columns ``names``: ``messages``, or ``prompt`` and
  ``completion`` (and a preference pair's ``chosen`` / ``rejected``); for prompt records (``field`` ``PROMPTS``)
  every column, ``prompt`` among them.

  Raises:
    ValueError: neither ``messages``, ``prompt`` and ``completion`` nor ``chosen`` and ``rejected`` (the columns
      listed).
  """
  if field == PROMPTS:
    if "prompt" not in names:
      raise ValueError(
        f"Data file {path!r} holds no prompt records: a 'prompt' column is needed; its columns: {', '.join(names)}."
      )
    return list(names)
  columns = [name for name in RECORD_COLUMNS if name in names]
  if (
    "messages" not in columns
    and not {"prompt", "completion"} <= set(columns)
    and not {"chosen", "rejected"} <= set(columns)
  ):
    raise ValueError(
      f"Data file {path!r} holds no conversations: a conversation record has a 'messages' column,"
      f" 'prompt' and 'completion', or a pair's 'chosen' and 'rejected'; its columns:"
      f" {', '.join(names)}."
    )
  return columns


class Records:
  """Rows of an Arrow table's conversation columns, each as the JSON text of its record, made when the
  table's first row is asked for (a ``datasets`` folder's chunks cost nothing until read)."""

  def __init__(self, table: Any):
    self._table, self._rows = table, None
    self._length = table.num_rows

  def _made(self) -> list[str]:
    if self._rows is None:
      self._rows = [json.dumps(row, ensure_ascii=False) for row in self._table.to_pylist()]
      self._table = None
    return self._rows

  @property
  def nbytes(self) -> int:
    return sum(map(len, self._made()))

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, row: int) -> str:
    return self._made()[row]

  def __iter__(self) -> Iterator[str]:
    return iter(self._made())


def check_text_type(path: str, field: str, names: list[str], arrow_type: Any) -> None:
  """Raises the ValueError of a missing ``field`` (the columns listed) or a column of another type than text."""
  if arrow_type is None:
    raise ValueError(f"Data file {path!r} has no column {field!r} (data.text_field); its columns: {', '.join(names)}.")
  if str(arrow_type) not in _TEXT_TYPES:
    raise ValueError(f"Data file {path!r}: column {field!r} holds {arrow_type}, not text.")


class Strings:
  """A string Arrow array's rows as ``str``, read from its buffers.

  Args:
    array: a pyarrow ``string`` or ``large_string`` array (or a chunked one, combined).
    path, field: named in errors.
    first_row: the array's first row's number in the file (for errors).

  Raises:
    ValueError: a null row (named by its number).
  """

  def __init__(self, array: Any, path: str, field: str, first_row: int = 0):
    if hasattr(array, "combine_chunks"):  # a row group's column; 32-bit offsets may not hold it whole
      array = (array.cast("large_string") if array.num_chunks > 1 else array).combine_chunks()
    if array.null_count:
      bad = int(np.flatnonzero(np.asarray(array.is_null()))[0])
      raise ValueError(f"Data file {path!r} row {first_row + bad}: column {field!r} holds NoneType, not text.")
    _, offsets, data = array.buffers()
    kind = np.int64 if str(array.type) == "large_string" else np.int32
    self.offsets = np.frombuffer(offsets, kind, count=len(array) + 1, offset=array.offset * np.dtype(kind).itemsize)
    self.data = memoryview(data) if data is not None else memoryview(b"")
    self.path, self._first_row = path, first_row

  def __len__(self) -> int:
    return len(self.offsets) - 1

  def __getitem__(self, row: int) -> str:
    raw = self.data[int(self.offsets[row]) : int(self.offsets[row + 1])]
    try:
      return str(raw, "utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(
        f"Data file {self.path!r} row {self._first_row + row} is not UTF-8 text (byte {e.start})."
      ) from None

  def __iter__(self) -> Iterator[str]:
    return (self[row] for row in range(len(self)))

  @property
  def nbytes(self) -> int:
    return self.data.nbytes + self.offsets.nbytes


def is_dataset_folder(path: str) -> bool:
  """Whether ``path`` is a folder ``datasets``' ``save_to_disk`` wrote (a Dataset or a DatasetDict)."""
  return os.path.isdir(path) and any(
    os.path.isfile(os.path.join(path, name)) for name in ("state.json", "dataset_dict.json")
  )


def _load(path: str) -> Any:
  datasets = extras.require("datasets", f"a Hugging Face datasets folder as data ({path!r})")
  split_file = os.path.join(path, "dataset_dict.json")
  if os.path.isfile(split_file):
    try:
      with open(split_file) as f:
        splits = list(json.load(f)["splits"])
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ValueError(f"Data path {path!r}: dataset_dict.json is not readable: {e}") from None
    if "train" not in splits:
      raise ValueError(
        f"Data path {path!r} is a datasets DatasetDict without a 'train' split; its splits:"
        f" {', '.join(splits)}; give the folder of one split (…/{splits[0]})."
      )
    path = os.path.join(path, "train")
  try:
    return datasets.load_from_disk(path)
  except Exception as e:  # datasets' and pyarrow's own errors, with their text
    raise ValueError(f"Data path {path!r} is not a readable datasets folder: {e}") from None


class DatasetFolder:
  """A ``save_to_disk`` folder's column ``field`` by row (a DatasetDict's ``train`` split)."""

  def __init__(self, path: str, field: str):
    self.path, self.field = path, field
    dataset = _load(path)
    table = dataset.data.table if hasattr(dataset.data, "table") else dataset.data
    if getattr(dataset, "_indices", None) is not None:  # a selection not yet written out
      table = dataset.flatten_indices().data.table
    schema = table.schema
    if field in RECORDS:
      self._chunks = [
        Records(batch)
        for batch in table.select(record_columns(path, schema.names, field)).to_batches()
        if batch.num_rows
      ]
    else:
      check_text_type(path, field, schema.names, schema.field(field).type if field in schema.names else None)
      column = table.column(field)
      self._chunks, first = [], 0
      for chunk in column.chunks:
        if len(chunk):
          self._chunks.append(Strings(chunk, path, field, first))
          first += len(chunk)
    self.starts = np.cumsum([0] + [len(c) for c in self._chunks])

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getitem__(self, index: int) -> str:
    chunk = int(np.searchsorted(self.starts, index, side="right")) - 1
    return self._chunks[chunk][int(index) - int(self.starts[chunk])]

  def __iter__(self) -> Iterator[str]:
    for chunk in self._chunks:
      yield from chunk

  def __getstate__(self) -> dict:  # a copy sent to another process maps the folder again
    return {"path": self.path, "field": self.field}

  def __setstate__(self, state: dict) -> None:
    self.__init__(state["path"], state["field"])
