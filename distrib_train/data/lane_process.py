"""The lanes read, tokenized and packed in worker processes, out of the training process's interpreter.

A training process that tokenizes and packs in its own threads shares one
interpreter lock with the loop that dispatches the steps. On one H200 the
124m preset on real text (a 16k BPE through ``data.tokenizer=hf:``) trained
at 343k tokens/s against its bare step's 518k, with a data wait of 0.09 ms:
the batches were ready, the dispatch was late (issue 32). With
``data.num_workers`` ≥ 1 the lanes this process feeds are split among that
many worker processes (``python -m distrib_train.data.lane_process``, not
a fork of this multithreaded process, and without importing the user's
``__main__`` again), each with its own ``lanes.Lanes`` and
``data.num_threads`` threads, each making its rows ahead into a bounded queue
(``DEPTH`` batches). The training process only receives finished rows:
frames of a JSON header and the arrays' raw bytes (``frames.py``), no pickle.

``ProcessLanes`` has the interface of ``lanes.Lanes`` (``rows``,
``position``, ``next_rows``, ``restore``, ``close``), so batches, positions
and checkpoints are the same as with the lanes in process: a restore sends
the positions to every worker, which drops what it made ahead (rows are
tagged with a generation number; older ones are skipped).

A worker opens the source and the tokenizer itself, from the data config
(a tokenizer given as a Python function stays in process). A worker that
cannot open them, or reads a malformed line under
``data.bad_records=error``, reports the error, raised here as the
``ValueError`` the in-process lanes raise; one that dies is named with its
exit code. Each rows frame's header also carries the documents the worker
has skipped (``ProcessLanes.skipped_documents``).

Not for: packing (``lanes.py``), batching and prefetching (``endless.py``).
"""

from __future__ import annotations

import os
import pathlib
import dataclasses
import queue
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from distrib_train.data import block_order
from distrib_train.data import frames as frames_lib
from distrib_train.data import lanes as lanes_lib
from distrib_train.data import splits
from distrib_train.data import tokenizer as tokenizer_lib
from distrib_train.data.config import DataConfig
from distrib_train.data.jsonl import BadRecordError

DEPTH = 4  # batches each worker makes ahead
_POLL_S = 0.2


def _positions(positions: Mapping[int, tuple[int, int]]) -> list[list[int]]:
  return [[int(lane), int(done), int(used)] for lane, (done, used) in positions.items()]


def _rows_frame(
  generation: int, rows: list[dict[str, np.ndarray]], after: Mapping[int, tuple[int, int]], skipped: int, long: int = 0
):
  names = [sorted(row) for row in rows]
  arrays = [row[name] for row, keys in zip(rows, names) for name in keys]
  return {
    "kind": "rows",
    "generation": generation,
    "names": names,
    "positions": _positions(after),
    "skipped": skipped,
    "long": long,
  }, arrays


def _rows_of(header: dict, arrays: list[np.ndarray]) -> tuple[int, list[dict[str, np.ndarray]], dict, tuple]:
  rows, it = [], iter(arrays)
  for keys in header["names"]:
    rows.append({name: next(it) for name in keys})
  return (
    header["generation"],
    rows,
    {lane: (done, used) for lane, done, used in header["positions"]},
    (header["skipped"], header.get("long", 0)),
  )


def _error(e: BaseException) -> dict:
  """An error frame: a ValueError's one line (raised as one in the training process, a malformed line as
  ``jsonl.BadRecordError``), else the traceback."""
  if isinstance(e, ValueError):
    name = "BadRecordError" if isinstance(e, BadRecordError) else "ValueError"
    return {"kind": "error", "message": f"{name}: {e}"}
  return {"kind": "error", "message": traceback.format_exc()}


def in_process(
  config: DataConfig, split: str, shard_count: int, vocab_size: int | None, rows: Sequence[int]
) -> lanes_lib.Lanes:
  """The split's lanes ``rows`` in this process: the seeded, shuffled, endlessly repeated documents
  (shuffled by blocks where the source has block-read files: ``block_order.py``)."""
  docs, indices, tokenize = splits.split_documents(config, split, shard_count, vocab_size)
  stream = block_order.shuffled(docs, indices, config.seed)  # every process's order
  if stream is None:
    import grain  # here only: block-read files need none of it, and its import costs a worker 0.8 s

    stream = grain.MapDataset.source(splits.Subset(docs, indices)).shuffle(seed=config.seed).repeat(None)
  checked = docs.skipped_documents  # by split_documents' sample, read again by the lanes
  return lanes_lib.Lanes(
    stream,
    tokenize,
    lanes=config.global_batch_size,
    length=config.seq_len + 1,
    packing=config.packing,
    threads=config.num_threads,
    rows=rows,
    skipped=lambda: docs.skipped_documents - checked,
    whole=config.conversations,
    max_documents=config.max_documents_per_row,
  )


def open_lanes(
  config: DataConfig, split: str, shard_count: int, vocab_size: int | None, rows: Sequence[int]
) -> lanes_lib.Lanes | ProcessLanes:
  """Worker processes with ``config.num_workers`` (and a tokenizer named in the config), else in process."""
  rows = list(rows)
  workers = min(config.num_workers, len(rows))
  if workers and isinstance(config.tokenizer, str):
    return ProcessLanes(config, split, shard_count, vocab_size, rows, workers)
  return in_process(config, split, shard_count, vocab_size, rows)


def _serve() -> None:
  """A worker's main (``python -m distrib_train.data.lane_process``): its arguments come as the first frame
  on stdin, its rows go to stdout as frames; later frames on stdin restore (``generation``, ``positions``)
  or stop it."""
  commands, frames = frames_lib.worker_streams()
  try:
    args, _ = frames_lib.receive(commands)
    config = DataConfig(**{**args["config"], "paths": tuple(args["config"]["paths"])})
    lanes = in_process(config, args["split"], args["shard_count"], args["vocab_size"], args["rows"])
  except BaseException as e:  # noqa: BLE001 - reported to the training process, which raises it
    frames_lib.send(frames, _error(e))
    return
  lock, pending, stop = threading.Lock(), [], threading.Event()

  def listen() -> None:
    while True:
      try:
        command, _ = frames_lib.receive(commands)
      except (EOFError, OSError, ValueError):
        command = {"kind": "stop"}
      if command["kind"] == "stop":
        stop.set()
        return
      with lock:
        pending.append(command)

  threading.Thread(target=listen, daemon=True).start()
  frames_lib.send(frames, {"kind": "ready"})
  generation = 0
  try:
    while not stop.is_set():
      with lock:
        if pending:
          generation = pending[-1]["generation"]
          lanes.restore({lane: (done, used) for lane, done, used in pending[-1]["positions"]})
          pending.clear()
      frames_lib.send(
        frames, *_rows_frame(generation, *lanes.next_rows(), lanes.skipped_documents, lanes.long_conversations())
      )
  except (BrokenPipeError, OSError):  # the training process has gone
    pass
  except BaseException as e:  # noqa: BLE001 - a malformed line under data.bad_records=error is a ValueError
    frames_lib.send(frames, _error(e))
  finally:
    lanes.close()


class ProcessLanes:
  """``lanes.Lanes``' interface over ``workers`` processes, each feeding a contiguous share of ``rows``."""

  def __init__(
    self, config: DataConfig, split: str, shard_count: int, vocab_size: int | None, rows: Sequence[int], workers: int
  ):
    self.rows = list(rows)
    self.lanes = config.global_batch_size
    self.position = {r: (0, 0) for r in self.rows}
    self._skipped = [0] * workers  # each worker's skipped documents, as of its last rows
    self._long = [0] * workers  # and its long conversations
    self._generation = 0
    self._closing = threading.Event()
    self._failure: BaseException | None = None  # a worker's error or end, raised again by every later read
    package_root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {
      **os.environ,
      **tokenizer_lib.worker_thread_env(workers),
      "JAX_PLATFORMS": "cpu",  # a worker never touches an accelerator
      "PYTHONPATH": os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    self._workers = []
    try:
      for share in np.array_split(np.array(self.rows), workers):
        process = subprocess.Popen(
          [sys.executable, "-m", "distrib_train.data.lane_process"],
          env=env,
          stdin=subprocess.PIPE,
          stdout=subprocess.PIPE,
        )
        received: queue.Queue = queue.Queue(maxsize=DEPTH)
        threading.Thread(
          target=self._read, args=(process, received), daemon=True, name="distrib_train-lanes-reader"
        ).start()
        self._workers.append((process, received))
        frames_lib.send(
          process.stdin,
          {
            "config": dataclasses.asdict(config),
            "split": split,
            "shard_count": shard_count,
            "vocab_size": vocab_size,
            "rows": [int(r) for r in share],
          },
        )
      for index in range(len(self._workers)):
        self._receive(index, "ready")
    except BaseException:
      self.close()
      raise

  def _read(self, process: subprocess.Popen, received: queue.Queue) -> None:
    """Reads the worker's frames into ``received`` (blocking while it is full) until the worker ends."""
    while True:
      try:
        header, arrays = frames_lib.receive(process.stdout)
        kind = header["kind"]
        frame = (kind, _rows_of(header, arrays) if kind == "rows" else header.get("message"))
      except (EOFError, OSError, ValueError, KeyError):
        frame = ("gone", None)
      while not self._closing.is_set():  # closing: frames are read and dropped, so a worker blocked writing
        try:  # one can finish it and see the stop
          received.put(frame, timeout=_POLL_S)
          break
        except queue.Full:
          continue
      if frame[0] in ("gone", "error"):
        return

  def _receive(self, index: int, kind: str) -> Any:
    if self._failure is not None:  # its reader has stopped: nothing more will come
      raise self._failure
    process, received = self._workers[index]
    while True:
      if self._closing.is_set():
        raise RuntimeError("the data worker processes were closed")
      try:
        got, payload = received.get(timeout=_POLL_S)
      except queue.Empty:
        continue
      if got == "gone":
        self._failure = self._ended(index)
        raise self._failure
      if got == "error":
        self._failure = RuntimeError(f"data worker process {index} failed:\n{payload}")
        for error in (ValueError, BadRecordError):
          if payload.startswith(f"{error.__name__}: "):
            self._failure = error(payload[len(error.__name__) + 2 :])
        raise self._failure
      if got == kind and (kind != "rows" or payload[0] == self._generation):
        return payload

  def _ended(self, index: int) -> RuntimeError:
    process, _ = self._workers[index]
    try:
      code: int | None = process.wait(timeout=10)
    except subprocess.TimeoutExpired:  # it closed its pipes and still runs
      code = None
    return RuntimeError(
      f"data worker process {index} (pid {process.pid}) ended with exit code {code}; its lanes"
      " cannot be read (its error is above)."
    )

  def next_rows(self) -> tuple[list[dict[str, np.ndarray]], dict[int, tuple[int, int]]]:
    """Every lane's next sequence, in ``rows`` order, and the positions after them (as ``Lanes.next_rows``)."""
    rows: list[dict[str, np.ndarray]] = []
    for index in range(len(self._workers)):
      _, made, after, (self._skipped[index], self._long[index]) = self._receive(index, "rows")
      rows.extend(made)
      self.position.update(after)
    return rows, dict(self.position)

  @property
  def skipped_documents(self) -> int:
    """The malformed documents the workers have skipped (as of the rows received; they read ahead)."""
    return sum(self._skipped)

  def long_conversations(self) -> int:
    """The conversations longer than a row the workers have cut or left out (as of the rows received)."""
    return sum(self._long)

  def restore(self, positions: Mapping[int, tuple[int, int]]) -> None:
    missing = [r for r in self.rows if r not in positions]
    if missing:
      raise ValueError(
        f"The saved data position has no lane {missing[0]} (of {len(positions)}); it was written"
        " for another global batch size."
      )
    self._generation += 1
    self.position = {r: tuple(positions[r]) for r in self.rows}
    if self._failure is not None:
      raise self._failure
    for index, (process, _) in enumerate(self._workers):
      try:
        frames_lib.send(
          process.stdin, {"kind": "restore", "generation": self._generation, "positions": _positions(self.position)}
        )
      except OSError:  # its end of the pipe is closed: it has ended
        self._failure = self._ended(index)
        raise self._failure from None

  def interrupt(self) -> None:
    """Makes a read waiting for a worker's rows (in another thread) raise at once; ``close`` follows."""
    self._closing.set()

  def close(self) -> None:
    self._closing.set()
    for process, _ in self._workers:
      try:
        frames_lib.send(process.stdin, {"kind": "stop"})
        process.stdin.close()
      except OSError:
        pass
    deadline = time.monotonic() + 10
    for process, _ in self._workers:
      try:
        process.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    self._workers = []


if __name__ == "__main__":
  _serve()
  # Everything was sent and flushed. The listening thread may still be blocked reading stdin, and the
  # interpreter's shutdown would then abort on that stream's lock ("Fatal Python error:
  # _enter_buffered_busy"), beside the error this worker already reported: leave without it.
  os._exit(0)
