"""Training batches whose content depends on the step alone, not on the job's shape.

Row ``r`` of every global batch is read from lane ``r`` of ``global_batch_size``
lanes. Lane ``r`` owns the documents at positions ``r, r + B, r + 2B, …`` of
the split's seeded, per-epoch shuffled, endlessly repeated order (grain's
index shuffle, or by blocks where files are read by blocks:
``block_order.py``; random access, no permutation held in memory) and packs them
into sequences on its own (or, without packing, takes the head of each
document long enough). So the global batch at step ``s`` is a function of
the seed, ``s`` and the data config, and a process feeds the rows its
devices hold by reading only those rows' lanes: a job restarted on another
number of processes or devices sees exactly the batches an uninterrupted run
would have.

A lane's position is two integers, the documents it has finished and the
tokens it has used of the next one; the checkpoint keeps every lane's
(gathered from all processes, a few bytes per row), so any process can take
over any row on restore.

Not for: making the rows a batch, placing and prefetching it (``endless.py``).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

POSITION_VERSION = 1


class Lanes:
  """Packed sequences for the global-batch rows ``rows`` (lane numbers), one lane per row.

  Args:
    stream: random access to the split's documents in the repeated, shuffled
      order (``stream[i]``, ``i`` ≥ 0 unbounded).
    tokenize: document → token ids (numpy).
    lanes: the number of lanes, the global batch size.
    rows: the lanes this process feeds, in batch order.
    length: tokens per sequence (``seq_len + 1``: inputs and targets share it).
    packing: concatenate a lane's documents (segment and position ids);
      otherwise each sequence is the head of the lane's next document of at
      least ``length`` tokens.
    threads: lanes read and tokenized in parallel.
    skipped: the malformed documents skipped so far (``skipped_documents``).
  """

  def __init__(self, stream: Any, tokenize: Callable[[Any], np.ndarray], *, lanes: int, rows: Sequence[int],
               length: int, packing: bool, threads: int, skipped: Callable[[], int] = lambda: 0):
    self._stream, self._tokenize = stream, tokenize
    self.lanes, self.rows, self.length, self.packing = lanes, list(rows), length, packing
    self.position = {r: (0, 0) for r in self.rows}  # lane → (documents finished, tokens used of the next)
    self._pool = concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="distrib_train-lanes")
    self._held: dict[int, tuple[int, np.ndarray]] = {}  # lane → its next document's tokens, once read
    self._skipped = skipped

  @property
  def skipped_documents(self) -> int:
    return self._skipped()

  def _document(self, lane: int, index: int) -> np.ndarray:
    held = self._held.get(lane)
    if held is not None and held[0] == index:
      return held[1]
    tokens = np.asarray(self._tokenize(self._stream[index * self.lanes + lane]))
    self._held[lane] = (index, tokens)
    return tokens

  def _sequence(self, lane: int) -> tuple[dict[str, np.ndarray], tuple[int, int]]:
    index, used = self.position[lane]
    if not self.packing:
      while len(tokens := self._document(lane, index)) < self.length:
        index += 1
      return {"tokens": tokens[:self.length]}, (index + 1, 0)
    # The names grain's packing gives, so that both paths share the shifting into inputs and targets.
    out = {name: np.zeros(self.length, np.int32) for name in ("tokens", "tokens_segment_ids", "tokens_positions")}
    filled = segment = 0
    while filled < self.length:
      tokens = self._document(lane, index)
      take = min(len(tokens) - used, self.length - filled)
      if take > 0:
        segment += 1
        out["tokens"][filled:filled + take] = tokens[used:used + take]
        out["tokens_segment_ids"][filled:filled + take] = segment
        out["tokens_positions"][filled:filled + take] = np.arange(take)
        filled, used = filled + take, used + take
      if used >= len(tokens):
        index, used = index + 1, 0
    return out, (index, used)

  def next_rows(self) -> tuple[list[dict[str, np.ndarray]], dict[int, tuple[int, int]]]:
    """The next sequence of every lane this process feeds, and the lanes' positions after them (a
    prefetching caller keeps the position that goes with the rows it has handed out)."""
    done = list(self._pool.map(self._sequence, self.rows))
    self.position = {r: after for r, (_, after) in zip(self.rows, done)}
    return [row for row, _ in done], dict(self.position)

  def restore(self, positions: Mapping[int, tuple[int, int]]) -> None:
    missing = [r for r in self.rows if r not in positions]
    if missing:
      raise ValueError(f"The saved data position has no lane {missing[0]} (of {len(positions)}); it was written"
                       " for another global batch size.")
    self.position = {r: tuple(positions[r]) for r in self.rows}
    self._held.clear()

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)

