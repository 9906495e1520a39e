"""The converter's records and ArrayRecord writers, and its worker processes (``convert --workers N``).

``encoded`` makes each document's record (UTF-8 text, or int32 token ids)
and ``open_writer`` opens a shard with the converter's options: one record
a chunk (``group_size:1``, for random access) compressed with zstd level 1,
which wrote 117 MB/s of text against level 3's 69 MB/s (the writer's
default) for files 2 % larger (2-core VM); the Python binding compresses in
the calling thread whatever ``max_parallelism`` says, so one process
writes at most that fast.

``write_in_workers`` spreads a conversion over ``python -c`` worker
processes. The inputs are cut into tasks (``ranges``: a ``.jsonl`` file in
8 MiB byte ranges, any other file whole); any worker reads and tokenizes
any task, and worker ``k`` of ``W`` writes shards ``k, k + W, …``, so
reading, tokenizing and compressing all spread over the workers (with
fewer shards than workers, only as many write). This
process hands out the tasks, puts the records back in input order, numbers
them (record ``i`` goes to shard ``i % num_shards``, as in one process) and
passes each worker the records of its shards. It holds about ``2 × workers
× 8 MiB`` of records at most, and each worker one 8 MiB chunk of a task's
records: a whole-file task comes back in chunks, one asked for at a time.
Commands and replies are ``frames.py`` frames, one reply per command, so
neither side blocks writing while the other does. A worker enters the
package as bare namespace packages and imports only the reading modules
(0.3 s, against 2.4 s for the whole library with jax). A Hugging Face
tokenizer's own threads get the host's cores divided by the workers
(``tokenizer.worker_thread_env``).

Not for: the shard names, the tokenizer sidecar and the command line
(``record_shards.py``), reading the text files (``text_files.py``).
"""

from __future__ import annotations

import collections
import itertools
import os
import subprocess
import sys
import traceback
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from distrib_train.data import frames
from distrib_train.data import tokenizer as tokenizer_lib
from distrib_train.data.jsonl import BadRecords, json_document, lines_before
from distrib_train.data.text_files import iter_text_file

WRITER_OPTIONS = "group_size:1,zstd:1"
_BATCH = 256  # documents tokenized in one call
_RANGE = 8 << 20  # bytes of a .jsonl file in one task
_CHUNK = 8 << 20  # bytes of records in one reply
_WRITING = -1
# A worker: the packages entered as bare namespaces (their __init__ would import the whole library), then serve().
_BOOT = """import sys, types
for name, path in (("distrib_train", sys.argv[1]), ("distrib_train.data", sys.argv[1] + "/data")):
  sys.modules[name] = types.ModuleType(name)
  sys.modules[name].__path__ = [path]
from distrib_train.data.convert_workers import serve
serve()
"""


def open_writer(path: str) -> Any:
  """An ArrayRecord writer of one shard, with ``WRITER_OPTIONS``."""
  from array_record.python import array_record_module

  return array_record_module.ArrayRecordWriter(path, WRITER_OPTIONS)


def encoded(documents: Iterable[str], tokenizer: Any) -> Iterator[bytes]:
  """Each document's record: its UTF-8 text, or its int32 token ids, tokenized ``_BATCH`` at a time."""
  if tokenizer is None:
    yield from (doc.encode("utf-8") for doc in documents)
    return
  batch_encode = getattr(tokenizer, "encode_batch", None) or (
    lambda texts: [np.asarray(tokenizer(t), np.int32) for t in texts]
  )
  iterator = iter(documents)
  while batch := list(itertools.islice(iterator, _BATCH)):
    yield from (np.asarray(ids, np.int32).tobytes() for ids in batch_encode(batch))


def ranges(files: Sequence[str]) -> list[tuple[str, int, int]]:
  """The tasks: ``(file, first byte, end byte)``; a ``.jsonl`` file in ``_RANGE`` byte ranges (a line belongs
  to the range it starts in), any other file whole (end -1)."""
  tasks = []
  for path in files:
    size = os.path.getsize(path) if path.endswith(".jsonl") else 0
    tasks.extend([(path, start, min(start + _RANGE, size)) for start in range(0, size, _RANGE)] or [(path, 0, -1)])
  return tasks


def _jsonl_range(path: str, start: int, end: int, field: str, bad_records: BadRecords) -> Iterator[str]:
  """The documents of the lines of a ``.jsonl`` file that start in ``[start, end)`` (a malformed one to
  ``bad_records``, named by its line number in the file, counted only then)."""
  with open(path, "rb") as f:
    if start:
      f.seek(start - 1)
      if f.read(1) != b"\n":
        f.readline()  # the line under way belongs to the range before
    position = f.tell()
    while position < end and (raw := f.readline()):
      at, position = position, position + len(raw)
      if (
        raw.strip()
        and (doc := json_document(raw, path, lambda: lines_before(path, at) + 1, field, bad_records)) is not None
      ):
        yield doc


def serve() -> None:
  """A worker's main: the settings come as the first frame on stdin, then one command a frame, each answered
  with one frame on stdout: ``read`` a task / ``more`` of it (its next chunk of records), ``write`` records
  to this worker's shards, ``close`` them."""
  commands, replies = frames.worker_streams()
  try:
    settings, _ = frames.receive(commands)
    tokenizer = None
    if settings["tokenizer"]:
      tokenizer = tokenizer_lib.load(*settings["tokenizer"])
    bad_records = BadRecords(settings["bad_records"], "bad_records")
    writers = {int(shard): open_writer(path) for shard, path in settings["shards"].items()}
    frames.send(replies, {"kind": "ready"})
    records: Iterator[bytes] = iter(())
    while True:
      command, arrays = frames.receive(commands)
      if command["kind"] in ("read", "more"):
        if command["kind"] == "read":
          path, start, end = command["task"]
          records = encoded(
            iter_text_file(path, settings["text_field"], bad_records)
            if end < 0
            else _jsonl_range(path, start, end, settings["text_field"], bad_records),
            tokenizer,
          )
        _reply_records(replies, records, bad_records, settings["chunk"])
      elif command["kind"] == "write":
        shards, lengths, blob = arrays
        for shard, end, length in zip(shards.tolist(), np.cumsum(lengths).tolist(), lengths.tolist()):
          writers[shard].write(blob[end - length : end].tobytes())
        frames.send(replies, {"kind": "wrote"})
      else:
        for writer in writers.values():
          writer.close()
        frames.send(replies, {"kind": "closed"})
        return
  except EOFError:  # the converting process has gone
    return
  except BaseException:  # noqa: BLE001 - reported to the converting process, which raises it
    try:
      frames.send(replies, {"kind": "error", "message": traceback.format_exc()})
    except OSError:  # the converting process has gone
      pass


def _reply_records(replies: Any, records: Iterator[bytes], bad_records: BadRecords, most: int) -> None:
  """The task's next chunk of records (``last`` when they end), or the ValueError that reading it raised (a
  malformed line, an unreadable file: the converting process raises it when the task's turn comes)."""
  chunk, size, skipped = [], 0, bad_records.skipped
  try:
    for record in records:
      chunk.append(record)
      size += len(record)
      if size >= most:
        break
  except ValueError as e:
    frames.send(replies, {"kind": "records", "error": str(e)})
    return
  lengths = np.array([len(r) for r in chunk], np.int64)
  frames.send(
    replies,
    {"kind": "records", "last": size < most, "skipped": bad_records.skipped - skipped},
    [lengths, np.frombuffer(b"".join(chunk), np.uint8)],
  )


def _by_owner(
  first: int, lengths: np.ndarray, blob: np.ndarray, num_shards: int, workers: int
) -> Iterator[tuple[int, list[np.ndarray]]]:
  """``(worker, [shards, lengths, blob])``: the records numbered from ``first`` that each worker writes."""
  shards = ((first + np.arange(len(lengths))) % num_shards).astype(np.int32)
  owners = shards % workers
  found = np.unique(owners)
  if len(found) == 1:
    yield int(found[0]), [shards, lengths, blob]
    return
  ends = np.cumsum(lengths)
  view = memoryview(blob)
  for owner in found:
    mine = owners == owner
    data = b"".join([view[end - length : end] for end, length in zip(ends[mine].tolist(), lengths[mine].tolist())])
    yield int(owner), [shards[mine], lengths[mine], np.frombuffer(data, np.uint8)]


def _widen(pipe: Any) -> None:
  """Lets a pipe hold 1 MiB (Linux; 64 KiB by default): an 8 MiB chunk crosses in 8 writes, not 128."""
  try:
    import fcntl

    fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)
  except (ImportError, AttributeError, OSError):  # another system, or a lower pipe-max-size
    pass


class _Workers:
  """The worker processes, each told which shards it writes."""

  def __init__(self, count: int, shard_paths: Sequence[str], settings: dict[str, Any]):
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **tokenizer_lib.worker_thread_env(count)}
    self.processes: list[subprocess.Popen] = []
    try:
      for _ in range(count):
        self.processes.append(
          subprocess.Popen(
            [sys.executable, "-c", _BOOT, package], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
          )
        )
        for stream in (self.processes[-1].stdin, self.processes[-1].stdout):
          _widen(stream)
      for k, process in enumerate(self.processes):
        self.send(k, {**settings, "shards": {str(s): p for s, p in enumerate(shard_paths) if s % count == k}})
      for k in range(count):
        self.reply(k)
    except BaseException:
      self.stop(kill=True)
      raise

  def send(self, k: int, header: dict, arrays: Sequence[np.ndarray] = ()) -> None:
    try:
      frames.send(self.processes[k].stdin, header, arrays)
    except OSError:  # it has gone: its reply says how
      self.reply(k)
      raise

  def reply(self, k: int) -> tuple[dict, list[np.ndarray]]:
    """Worker ``k``'s reply to its command.

    Raises:
      RuntimeError: the worker failed (its traceback), or ended (its exit code).
    """
    process = self.processes[k]
    try:
      header, arrays = frames.receive(process.stdout)
    except (EOFError, OSError):
      raise RuntimeError(
        f"convert worker process {k} (pid {process.pid}) ended with exit code {process.wait()} (its error is above)."
      ) from None
    if header["kind"] == "error":
      raise RuntimeError(f"convert worker process {k} failed:\n{header['message']}")
    return header, arrays

  def stop(self, kill: bool = False) -> None:
    """Ends the workers: after ``close`` they exit on their own; ``kill``: at once, whatever they are doing."""
    for process in self.processes:
      if kill:
        process.kill()
      for stream in (process.stdin, process.stdout):
        try:
          stream.close()
        except OSError:
          pass
      try:
        process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def write_in_workers(
  tasks: Sequence[tuple[str, int, int]], shard_paths: Sequence[str], workers: int, settings: dict[str, Any]
) -> tuple[int, int]:
  """Writes the records of ``tasks`` (``ranges``) to ``shard_paths`` (opened by the workers), record ``i`` to
  shard ``i % len(shard_paths)``, in ``workers`` processes.

  Args:
    settings: ``tokenizer`` (``[spec, bos, eos]`` or None), ``text_field``, ``bad_records``.

  Returns:
    How many records were written, and how many malformed lines were skipped.

  Raises:
    ValueError: what reading the first failing task raised (a malformed line under ``bad_records=error``).
    RuntimeError: a worker failed or ended.
  """
  import multiprocessing.connection

  pool = _Workers(workers, shard_paths, {**settings, "chunk": _CHUNK})
  try:
    queued: list[collections.deque] = [collections.deque() for _ in range(workers)]  # writes, in order
    doing: list[int | None] = [None] * workers  # the task a worker reads, _WRITING, or None: idle
    paused: list[int | None] = [None] * workers  # the task a worker has more chunks of
    done: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # a task's chunks, in order
    sent = routed = count = skipped = held = 0  # held: bytes of records received, not yet sent to a writer
    while routed < len(tasks) or any(queued) or any(d is not None for d in doing):
      for k in range(workers):
        room = held < 2 * workers * _CHUNK
        if doing[k] is not None:
          continue
        if queued[k]:  # writing first: it frees memory
          arrays = queued[k].popleft()
          pool.send(k, {"kind": "write"}, arrays)
          doing[k], held = _WRITING, held - arrays[2].nbytes
        elif paused[k] is not None and (room or paused[k] == routed):  # the next task to route always goes on
          pool.send(k, {"kind": "more"})
          doing[k] = paused[k]
        elif paused[k] is None and room and sent < len(tasks):
          pool.send(k, {"kind": "read", "task": tasks[sent]})
          doing[k], sent = sent, sent + 1
      busy = {pool.processes[k].stdout: k for k in range(workers) if doing[k] is not None}
      for stream in multiprocessing.connection.wait(list(busy)):
        k = busy[stream]
        header, arrays = pool.reply(k)
        if doing[k] != _WRITING:
          done[doing[k]].append((header, arrays))
          held += arrays[1].nbytes if arrays else 0
          paused[k] = None if "error" in header or header["last"] else doing[k]
        doing[k] = None
      while done[routed]:
        header, arrays = done[routed].popleft()
        if "error" in header:
          raise ValueError(header["error"])
        for owner, records in _by_owner(count, *arrays, len(shard_paths), workers):
          queued[owner].append(records)
        count, skipped = count + len(arrays[0]), skipped + header["skipped"]
        if header["last"]:
          del done[routed]
          routed += 1
    for k in range(workers):
      pool.send(k, {"kind": "close"})
    for k in range(workers):
      pool.reply(k)
  except BaseException:
    pool.stop(kill=True)
    raise
  pool.stop()
  return count, skipped
