"""JSONL files as documents: a kept index of line offsets, lines parsed when read, and what a malformed one does.

``JsonlFile`` is random access (``len`` and ``[index]``), as grain's
``MapDataset.source`` wants: the byte offset of each non-blank line (8 bytes
a document) is found by a numpy newline scan (``scan_lines``; no JSON
parsed) and kept by ``index_cache.py``, so only the first open of a file
reads it whole; a line is read and parsed when the pipeline asks for it.

Malformed lines, plain or compressed (not UTF-8, not JSON, not an object, no
string ``data.text_field``) are found when they are read and handled by the
source's ``BadRecords`` (``data.bad_records``): ``skip`` logs the first 10 of
each file (file and line) and one line for the rest, counts them, and the
document reads as None (no tokens); ``error`` raises one ValueError. The
first non-blank line of each file is parsed strictly at open, so a wrong
``data.text_field`` or a file that is not JSONL fails at once.

Not for: other formats (``text_files.py``, ``compressed.py``,
``arrow_text.py``), choosing a source from the config (``sources.py``).
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from absl import logging

from distrib_train.data import index_cache

BAD_RECORDS = ("skip", "error")  # data.bad_records
_LOGGED_PER_FILE = 10
_SCAN_BYTES = 8 << 20  # the newline scan's chunk
_LAST_LINE_READ = 1 << 16  # bytes a file's last line is read in


class BadRecordError(ValueError):
  """A malformed JSONL line read under ``data.bad_records=error`` (the trainer stops with its one line)."""


class BadRecords:
  """What a source does with malformed JSONL lines (``data.bad_records``), and how many it has skipped.

  ``skip``: each is logged (absl, a warning: the first 10 of each file in
  this process, then one line saying more are skipped), counted in
  ``skipped`` and read as no document. ``error``: the first one raises.
  """

  def __init__(self, policy: str = "skip", key: str = "data.bad_records"):
    if policy not in BAD_RECORDS:
      raise ValueError(f"{key} must be one of {', '.join(BAD_RECORDS)}, got {policy!r}.")
    self.policy, self.key, self.skipped = policy, key, 0
    self._logged: dict[str, int] = {}
    self._lock = threading.Lock()

  # grain sends a finite pass's source to its worker processes (cloudpickle): a copy there counts and logs
  # on its own.
  def __getstate__(self) -> dict[str, Any]:
    return {k: v for k, v in self.__dict__.items() if k != "_lock"}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state, _lock=threading.Lock())

  def bad(self, path: str, message: Callable[[], str]) -> None:
    """One malformed line of ``path``; ``message()`` names it (called only when it is logged or raised)."""
    if self.policy == "error":
      raise BadRecordError(f"{message()}; {self.key}=skip would skip it.")
    with self._lock:
      self.skipped += 1
      logged = self._logged[path] = self._logged.get(path, 0) + 1
    if logged <= _LOGGED_PER_FILE:
      logging.warning("%s: skipped (%s=skip).", message(), self.key)
    elif logged == _LOGGED_PER_FILE + 1:
      logging.warning(
        "Data file %r: more malformed lines skipped; only the first %d are logged in this process.",
        path,
        _LOGGED_PER_FILE,
      )


class _Malformed(Exception):
  """What is wrong with a JSONL line (the message names it, the caller says which line)."""


def _json_text(raw: bytes, field: str) -> str:
  if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark, as some editors begin a file with
    raw = raw[3:]
  try:
    record = json.loads(raw.decode("utf-8"))
  except UnicodeDecodeError as e:
    raise _Malformed(f"is not UTF-8 text (byte {e.start})") from None
  except json.JSONDecodeError as e:
    raise _Malformed(f"is not JSON: {e.msg}") from None
  if field == "**":  # a prompt record (RL's prompts): the whole object, read by posttrain/rollouts.py
    if not isinstance(record, dict) or "prompt" not in record:
      raise _Malformed("is not a prompt record: an object with 'prompt' (text or messages) and any other columns")
    return raw.decode("utf-8")
  if field == "*":  # a conversation record (data.loss_on): the whole object, read by data/chat.py
    if not isinstance(record, dict) or not (
      "messages" in record or {"prompt", "completion"} <= record.keys() or {"chosen", "rejected"} <= record.keys()
    ):
      raise _Malformed(
        "is not a conversation record: an object with 'messages', 'prompt' and 'completion', or 'chosen' and 'rejected'"
      )
    return raw.decode("utf-8")
  if not isinstance(record, dict):
    raise _Malformed(
      f"holds a JSON {type(record).__name__}, not an object with a string field {field!r} (data.text_field)"
    )
  text = record.get(field)
  if not isinstance(text, str):
    raise _Malformed(f"has no string field {field!r} (data.text_field)")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:  # a lone surrogate escape ("\\ud83d"): valid JSON, no tokenizer takes it
    raise _Malformed(f"holds a lone surrogate in field {field!r} (character {e.start})") from None
  return text


def json_document(
  raw: bytes, path: str, number: int | Callable[[], int], field: str, bad_records: BadRecords
) -> str | None:
  """Line ``number`` of JSONL file ``path``: its string ``field``, or None where it is malformed and
  ``bad_records`` skips it (or raises). ``number`` may be a function, called only to name a malformed line."""
  try:
    return _json_text(raw, field)
  except _Malformed as e:
    what = str(e)  # (``e`` is unbound once the except clause ends)
    bad_records.bad(path, lambda: f"Data file {path!r} line {number() if callable(number) else number} {what}")
    return None


def strict_document(raw: bytes, path: str, number: int, field: str) -> str:
  """Line ``number`` of ``path`` parsed strictly, as each file's first non-blank line is at open: a wrong
  ``field``, or a file that is not JSONL, is a ValueError naming both, whatever ``data.bad_records`` says."""
  try:
    return _json_text(raw, field)
  except _Malformed as e:
    raise ValueError(f"Data file {path!r} line {number} {e}.") from None


def scan_lines(path: str) -> dict[str, np.ndarray]:
  """``{"offsets": int64}``: the byte offset of every non-blank line of ``path`` (one with a byte other than
  space, tab or CR), by a numpy scan of its memory map in 8 MiB chunks (the ``lines`` index).

  The kernel is asked to read the next chunks while one is scanned
  (``MADV_WILLNEED``): 10 GiB not in the page cache took 12 s, as long as
  ``dd`` took to read it, against 17 s without (2-core VM). Reading chunks
  into fresh buffers instead was slower still: their page faults cost more
  than the scan. Each chunk scanned is unmapped (``MADV_DONTNEED``: the
  pages stay cached), so the process's resident set does not grow by the
  file's size: by about three chunks at its peak. 8 MiB chunks scanned a
  cached 1.2 GB file in 0.87 s, with the peak 16 MiB above the process's
  before; 64 MiB chunks took 1.5-1.8 s and 127 MiB (2-core VM).
  """
  try:
    with open(path, "rb") as f:
      if not os.fstat(f.fileno()).st_size:
        return {"offsets": np.zeros(0, np.int64)}
      mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    size = len(mapped)  # the map's own length: a file that shrank before it was mapped cannot spin the scan
  except OSError as e:
    raise ValueError(f"Cannot read data file {path!r}: {e.strerror}.") from None
  data = np.frombuffer(mapped, np.uint8)
  found, begin, chunk = [], 0, _SCAN_BYTES
  while begin < size:
    _advise(mapped, "MADV_WILLNEED", begin + chunk, 2 * chunk)
    block = data[begin : begin + chunk]
    newlines = np.flatnonzero(block == 10)
    if begin + len(block) < size:
      if not len(newlines):  # a line longer than the chunk: look further
        chunk *= 2
        continue
      block = block[: newlines[-1] + 1]  # whole lines only; the rest starts the next chunk
    starts = np.concatenate([[0], newlines[newlines + 1 < len(block)] + 1])
    found.append(begin + starts[inked(block, starts)])
    _advise(mapped, "MADV_DONTNEED", begin, len(block))  # out of this process's memory; still cached
    begin, chunk = begin + len(block), _SCAN_BYTES
  del data, block
  mapped.close()
  return {"offsets": np.concatenate(found).astype(np.int64)}


def _advise(mapped: mmap.mmap, advice: str, start: int, length: int) -> None:
  """``madvise`` for ``length`` bytes of the map from ``start`` (moved down to its page), where the system has
  it."""
  start -= start % mmap.PAGESIZE
  if hasattr(mapped, "madvise") and hasattr(mmap, advice) and start < len(mapped):
    mapped.madvise(getattr(mmap, advice), start, min(length, len(mapped) - start))


def inked(block: np.ndarray, starts: np.ndarray) -> np.ndarray:
  """Which of the lines of ``block`` (whole lines, starting at ``starts``) hold a byte other than whitespace.

  A line that starts with another byte does (nearly all: a JSON line starts with ``{``); the few that start
  with whitespace are looked at whole, one by one, or, where they are many, by a mask of the block.
  """
  first = block[starts]
  maybe = (first == 32) | (first == 9) | (first == 13) | (first == 10)
  doubtful = np.flatnonzero(maybe)
  if len(doubtful) > len(starts) // 16 + 16:
    ink = (block != 32) & (block != 9) & (block != 13) & (block != 10)
    return np.logical_or.reduceat(ink, starts)
  ends = np.append(starts[1:], len(block))
  for line in doubtful:
    maybe[line] = not bytes(block[starts[line] : ends[line]]).strip(b" \t\r\n")
  return ~maybe


class JsonlFile:
  """A JSONL file's documents by number: the byte offset of each non-blank line (the ``lines`` index of
  ``index_cache.py``: built by the first open, mapped by every later one), each line read with one
  ``pread`` (from its offset to the next document's) and parsed when asked for.

  Lines are read, not sliced from a memory map of the file: the pages of a
  map that a shuffled read touches (with the kernel's read-ahead around
  each) count in the process's resident memory, which then grew with the
  corpus (a 400 MB corpus: +138 MiB after 20 batches); pages read stay in
  the page cache only.

  The first non-blank line is parsed at open, strictly, whatever the policy:
  a wrong ``field`` or a file that is not JSONL fails at once, named. Any
  other malformed line goes to ``bad_records`` when it is read (skipped and
  read as None, by default; or raised).
  """

  def __init__(self, path: str, field: str, bad_records: BadRecords | None = None, cache_dir: str = ""):
    self.path, self.field = path, field
    self.bad_records = bad_records or BadRecords()
    try:
      with open(path, "rb") as f:  # the first non-blank line, before any index is built
        for number, raw in enumerate(iter(lambda: f.readline(_SCAN_BYTES), b""), 1):
          if len(raw) == _SCAN_BYTES and not raw.endswith(b"\n"):
            break  # a longer line is checked when it is read
          if raw.strip():
            strict_document(raw, path, number, field)
            break
    except OSError as e:
      raise ValueError(f"Cannot read data file {path!r}: {e.strerror}.") from None
    self._open_index(cache_dir)

  def _open_index(self, cache_dir: str) -> None:
    self.cache_dir = cache_dir
    path = self.path
    arrays, self.built_now = index_cache.load_or_build(path, "lines", lambda: scan_lines(path), cache_dir)
    self.offsets = arrays["offsets"]
    self._fd: int | None = None
    self._fd_lock = threading.Lock()

  # A copy sent to a worker process (grain's, for a finite pass) maps the kept index and the file again.
  def __getstate__(self) -> dict[str, Any]:
    return {"path": self.path, "field": self.field, "bad_records": self.bad_records, "cache_dir": self.cache_dir}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.path, self.field, self.bad_records = state["path"], state["field"], state["bad_records"]
    self._open_index(state["cache_dir"])

  def __len__(self) -> int:
    return len(self.offsets)

  def _read(self, size: int, offset: int) -> bytes:
    try:
      if self._fd is None:
        with self._fd_lock:  # the lanes' threads make a file's first reads together: one descriptor
          if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
      return os.pread(self._fd, size, offset)
    except OSError as e:
      raise ValueError(f"Cannot read data file {self.path!r}: {e.strerror}.") from None

  def _line(self, index: int) -> bytes:
    start = int(self.offsets[index])
    # The next document's offset bounds this line (blank lines between them at most); the last runs to the end.
    end = int(self.offsets[index + 1]) if index + 1 < len(self.offsets) else start + _LAST_LINE_READ
    raw = self._read(end - start, start)
    if len(raw) < end - start and (index + 1 < len(self.offsets) or not raw):  # the file is shorter now
      raise ValueError(
        f"Data file {self.path!r} changed since it was indexed: it now ends at byte"
        f" {start + len(raw)}, before document {index} (of {len(self.offsets)}) ends; open it again"
        " once it is written."
      )
    while index + 1 == len(self.offsets) and len(raw) == end - start:  # the last line, longer than read so far
      more = self._read(_LAST_LINE_READ, start + len(raw))
      if not more:
        break
      raw, end = raw + more, end + len(more)
    cut = raw.find(b"\n")
    return raw if cut < 0 else raw[:cut]

  def line_number(self, index: int) -> int:
    """The line number (from 1) of document ``index`` (for messages)."""
    return lines_before(self.path, int(self.offsets[index])) + 1

  def __del__(self, _close=os.close):  # os.close held: at interpreter exit the module may be gone first
    if getattr(self, "_fd", None) is not None:
      _close(self._fd)

  def __getitem__(self, index: int) -> str | None:
    try:
      return _json_text(self._line(index), self.field)
    except _Malformed as e:
      what = str(e)  # (``e`` is unbound once the except clause ends)
      self.bad_records.bad(self.path, lambda: f"Data file {self.path!r} line {self.line_number(index)} {what}")
      return None


def lines_before(path: str, offset: int) -> int:
  """The newlines in the first ``offset`` bytes of ``path``, counted: a line's number, found only to name it."""
  count = 0
  with open(path, "rb") as f:
    while offset > 0 and (block := f.read(min(offset, _SCAN_BYTES))):
      count, offset = count + block.count(b"\n"), offset - len(block)
  return count


def allow_open_files(count: int) -> None:
  """Raises this process's soft limit of open files to hold ``count`` more (each JSONL file keeps its index
  mapped and its text open: two descriptors), up to the hard limit."""
  import resource

  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  want = count + 1024
  if soft != resource.RLIM_INFINITY and soft < want:
    resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
