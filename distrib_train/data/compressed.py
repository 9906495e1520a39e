"""Compressed JSONL files (``.jsonl.zst``, ``.jsonl.gz``): documents by number, read a block at a time.

A compressed stream can only be read forward. The first open of a file
decompresses it once, streaming, and keeps an index of it
(``index_cache.load_or_build``, kind ``zlines``): where each document (a
non-blank line) starts and ends in the decompressed stream and its line
number (24 bytes a document). Later opens, by any process, map that index:
O(1) (and cut the file into blocks — runs of whole lines of about
``BLOCK_BYTES`` decompressed bytes — with one binary search a block).

A document is read from its block, decoded whole into the source's
``block_order.BlockCache`` (raw bytes: memory is the cache's block count ×
``BLOCK_BYTES``). The file's decompressor continues forward to a block ahead
of it (keeping the blocks it passes, which the shuffle by blocks reads
next); a block behind it that is no longer cached restarts the file from its
start (after a resume that costs one decompression of the file). The
shuffle by blocks (``block_order.py``) reads each file's blocks in order, so
a file is decompressed about once an epoch.

zstandard is imported only for ``.zst`` files (``pip install zstandard``);
gzip is the standard library's.

Not for: uncompressed files (``text_files.py``), choosing the order
(``block_order.py``).
"""

from __future__ import annotations

import gzip
import os
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
from absl import logging

from distrib_train.common import extras
from distrib_train.data import block_order
from distrib_train.data import index_cache
from distrib_train.data import jsonl

BLOCK_BYTES = 16 << 20  # decompressed bytes a block holds, about
_CHUNK = 4 << 20  # decompressed bytes read at a time
_RAW = 256 << 10  # compressed bytes of a .zst decompressed at a time (4 MiB took 1.6 × as long: larger pieces)
SUFFIXES = (".jsonl.zst", ".jsonl.gz")


def is_compressed(path: str) -> bool:
  return path.endswith(SUFFIXES)


def _open(path: str) -> Any:
  """A binary reader of ``path``'s decompressed stream."""
  if os.path.getsize(path) == 0:
    raise ValueError(f"Data file {path!r} is empty: not a {'zstd' if path.endswith('.zst') else 'gzip'} stream.")
  if path.endswith(".gz"):
    return gzip.open(path, "rb")
  zstandard = extras.require("zstandard", f"zstd-compressed data ({path!r})")
  return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True, closefd=True)


def _read(stream: Any, size: int, path: str) -> bytes:
  """``size`` decompressed bytes, fewer only at the stream's end; a damaged stream is a ValueError naming
  the file."""
  try:
    parts, left = [], size
    while left > 0 and (part := stream.read(left)):
      parts.append(part)
      left -= len(part)
    return b"".join(parts)
  except (OSError, EOFError, zlib.error) as e:
    raise ValueError(f"Data file {path!r} is not a readable compressed stream: {e}") from None
  except Exception as e:  # zstandard.ZstdError
    if type(e).__name__ == "ZstdError":
      raise ValueError(f"Data file {path!r} is not a readable compressed stream: {e}") from None
    raise


def _pieces(path: str) -> Iterator[bytes]:
  """The decompressed stream of ``path``, in pieces of any size; a file cut short is a ValueError naming it."""
  if not path.endswith(".zst"):
    with _open(path) as stream:  # gzip raises on a stream that ends early
      while piece := _read(stream, _CHUNK, path):
        yield piece
    return
  _open(path).close()  # an empty file, or no zstandard: named
  import zstandard

  # Frame by frame: zstandard's stream reader ends quietly where a file cut short (an interrupted download)
  # ends, inside a frame, as if that were the stream's end.
  make = zstandard.ZstdDecompressor().decompressobj
  with open(path, "rb") as f:
    decompressor, inside = make(), False
    while raw := f.read(_RAW):
      while raw:
        inside = True
        try:
          piece = decompressor.decompress(raw)
        except zstandard.ZstdError as e:
          raise ValueError(f"Data file {path!r} is not a readable compressed stream: {e}") from None
        if piece:
          yield piece
        raw = b""
        if decompressor.eof:  # a frame ended: the bytes after it start the next
          raw, decompressor, inside = decompressor.unused_data, make(), False
  if inside:
    raise ValueError(
      f"Data file {path!r} is not a readable compressed stream: it ends inside a zstd frame"
      " (cut short? an interrupted download or copy)."
    )


def iter_chunks(path: str) -> Iterator[bytes]:
  """The decompressed stream of ``path`` in chunks that end at a line's end (the last one may not)."""
  rest = b""
  for chunk in _pieces(path):
    cut = chunk.rfind(b"\n") + 1
    if cut:
      yield rest + chunk[:cut]
      rest = chunk[cut:]
    else:
      rest += chunk
  if rest:
    yield rest


def iter_lines(path: str) -> Iterator[tuple[int, bytes]]:
  """``(line number, line)`` of each non-blank line, streaming (the converter's input)."""
  number = 0
  for chunk in iter_chunks(path):
    lines = chunk.split(b"\n")
    if chunk.endswith(b"\n"):
      lines.pop()
    for line in lines:
      number += 1
      if line.strip():
        yield number, line


def _first_line(path: str) -> tuple[int, bytes] | None:
  """``(line number, line)`` of the first non-blank line, if it ends within the stream's first ``_CHUNK``
  bytes (a longer one is checked when it is read); only as much of the stream is decompressed."""
  head, pieces = b"", _pieces(path)
  try:
    for piece in pieces:
      head += piece
      lines = head.split(b"\n")[:-1]  # whole lines only
      for number, line in enumerate(lines, 1):
        if line.strip():
          return number, line
      if len(head) >= _CHUNK:
        return None
  finally:
    pieces.close()
  return next(((number, line) for number, line in enumerate(head.split(b"\n"), 1) if line.strip()), None)


def _scan(path: str) -> dict[str, np.ndarray]:
  """The index of ``path``: each document's start, end and line number in the decompressed stream, and its
  size."""
  starts, ends, lines, base, line_base = [], [], [], 0, 0
  for chunk in iter_chunks(path):
    data = np.frombuffer(chunk, np.uint8)
    newlines = np.flatnonzero(data == 10)
    line_end = np.append(newlines, len(data)) if not chunk.endswith(b"\n") else newlines
    line_start = np.concatenate([[0], newlines + 1])[: len(line_end)]
    filled = jsonl.inked(data, line_start)  # blank as in a plain JSONL file
    starts.append(line_start[filled] + base)
    ends.append(line_end[filled] + base)
    lines.append(np.flatnonzero(filled) + 1 + line_base)
    base, line_base = base + len(data), line_base + len(line_end)
  starts = np.concatenate(starts or [np.zeros(0, np.int64)]).astype(np.int64)
  ends = np.concatenate(ends or [np.zeros(0, np.int64)]).astype(np.int64)
  lines = np.concatenate(lines or [np.zeros(0, np.int64)]).astype(np.int64)
  return {"starts": starts, "ends": ends, "lines": lines, "size": np.array([base], np.int64)}


def _blocks(starts: np.ndarray, size: int) -> np.ndarray:
  """The first document of each block (and the document count last): the first line at or past every
  ``BLOCK_BYTES``-th decompressed byte (made at each open, O(blocks); not kept in the index)."""
  first = np.unique(np.searchsorted(starts, np.arange(0, max(size, 1), BLOCK_BYTES)))
  return np.append(first[first < len(starts)], len(starts)).astype(np.int64)


class CompressedJsonl:
  """A ``.jsonl.zst`` / ``.jsonl.gz`` file's documents by number (the ``field`` of each non-blank line).

  Args:
    path: the file.
    field: the JSON field that holds the text.
    parse: (line bytes, path, line number, field) → the document, or None for a malformed line skipped
      (``jsonl.json_document`` with the source's ``BadRecords``).
    cache: the source's block cache.
    index_cache_dir: where the index is kept when not beside the file (``data.index_cache_dir``).
  """

  sequential = True

  def __init__(
    self, path: str, field: str, parse: Any, cache: block_order.BlockCache | None = None, index_cache_dir: str = ""
  ):
    self.path, self.field, self._parse = path, field, parse
    self.cache, self.index_cache_dir = cache or block_order.BlockCache(2), index_cache_dir
    _open(path).close()  # no zstandard, or an empty file: named now
    first = _first_line(path)  # parsed strictly, as a .jsonl file's: a wrong field fails now
    if first is not None:
      jsonl.strict_document(first[1], path, first[0], field)
    self._open_index()
    self.restarts = 0  # times the decompressor went back to the file's start for a block behind it

  def _open_index(self) -> None:
    path = self.path
    index, _ = index_cache.load_or_build(path, "zlines", lambda: _scan(path), self.index_cache_dir)
    self.starts, self.ends, self.lines = index["starts"], index["ends"], index["lines"]
    self._size = int(index["size"][0])
    self.block_starts = _blocks(self.starts, self._size)
    self._lock = threading.Lock()
    self._stream: Any = None
    self._at = 0  # the next block the decompressor reads

  def __len__(self) -> int:
    return len(self.starts)

  def _first_byte(self, block: int) -> int:
    return 0 if block == 0 else int(self.starts[self.block_starts[block]])

  def _block(self, block: int) -> bytes:
    key = (self.path, block)
    data = self.cache.get(key)
    if data is not None:
      return data
    with self._lock:  # one decompressor a file; another thread may have read the block meanwhile
      data = self.cache.get(key)
      if data is not None:
        return data
      if self._stream is None or block < self._at:  # behind the decompressor: start the file again
        if self._stream is not None:
          self._stream.close()
          self._restarted()
        self._stream, self._at = _open(self.path), 0
      keep_from = block - max(1, self.cache.capacity // 4)  # blocks passed on the way that are kept
      while self._at <= block:
        at = self._at
        end = self._first_byte(at + 1) if at + 1 < len(self.block_starts) - 1 else self._size
        data = _read(self._stream, end - self._first_byte(at), self.path)
        if len(data) != end - self._first_byte(at):
          raise ValueError(f"Data file {self.path!r} changed since it was indexed (it ended early); open it again.")
        if at >= keep_from:
          self.cache.put((self.path, at), data)
        self._at += 1
      if self._at == len(self.block_starts) - 1:  # the file's last block: its decompressor is done
        self._stream.close()
        self._stream = None
      return data

  def _restarted(self) -> None:
    """Logs a restart of the decompressor (the first, then at each power of two): the lanes' rows have
    drifted further apart than the block cache holds (``data.block_cache``)."""
    self.restarts += 1
    if self.restarts & (self.restarts - 1) == 0:
      logging.warning(
        "Data file %r: decompressed from its start again for a block behind the decompressor"
        " (%d time(s) in this process); the lanes are spread over more blocks than data.block_cache"
        " (%d) holds: raise it.",
        self.path,
        self.restarts,
        self.cache.capacity,
      )

  def __getitem__(self, index: int) -> Any:
    index = int(index)
    block = int(np.searchsorted(self.block_starts, index, side="right")) - 1
    first = self._first_byte(block)
    raw = self._block(block)[int(self.starts[index]) - first : int(self.ends[index]) - first]
    return self._parse(raw, self.path, int(self.lines[index]), self.field)

  def close(self) -> None:
    with self._lock:
      if self._stream is not None:
        self._stream.close()
        self._stream = None

  # A copy sent to another process maps the kept index again and opens its own decompressor (the index's
  # arrays are not copied: 24 bytes a document).
  def __getstate__(self) -> dict:
    return {
      "path": self.path,
      "field": self.field,
      "_parse": self._parse,
      "cache": self.cache,
      "index_cache_dir": self.index_cache_dir,
      "restarts": 0,
    }

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self._open_index()
