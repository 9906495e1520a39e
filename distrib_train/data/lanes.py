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

Reading is batched: the next document of every lane this process feeds is
one stream position per lane (``index * lanes + lane``), so the documents of
all the lanes short of tokens are read together (``data.num_threads``
threads, each a contiguous share of them) and tokenized in one call
(``splits.DocumentTokenizer.batch``: a named tokenizer's own batch encode,
in parallel in its library). Each lane keeps a queue of its next documents'
tokens; the batch's rows are cut from them with numpy, a slice per document and a few calls per batch.

Not for: making the rows a batch, placing and prefetching it (``endless.py``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

POSITION_VERSION = 1
READ_AHEAD = 4  # sequences of tokens a lane reads ahead, once a read is due


def _fields(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A row with its tokens as int32 ids; a conversation's loss mask (``chat.SCORED_TOKENS``) as ``tokens_loss``."""
  tokens = row["tokens"]
  if tokens.dtype.names:
    extra = {"tokens_ref": tokens["ref"]} if "ref" in tokens.dtype.names else {}  # a precomputed DPO reference
    return {**row, "tokens": tokens["ids"], "tokens_loss": tokens["loss"], **extra}
  return {**row, "tokens": tokens.astype(np.int32, copy=False)}


class Lanes:
  """Packed sequences for the global-batch rows ``rows`` (lane numbers), one lane per row.

  Args:
    stream: random access to the split's documents in the repeated, shuffled
      order (``stream[i]``, ``i`` ≥ 0 unbounded).
    tokenize: document → token ids (numpy); its ``batch`` (documents → ids,
      ``splits.DocumentTokenizer``), if it has one, tokenizes many at once,
      and without packing its ``heads`` (documents, n → each one's first n
      ids), if it has one, only as much of each as a sequence takes.
    lanes: the number of lanes, the global batch size.
    rows: the lanes this process feeds, in batch order.
    length: tokens per sequence (``seq_len + 1``: inputs and targets share it).
    packing: concatenate a lane's documents (segment and position ids);
      otherwise each sequence is the head of the lane's next document of at
      least ``length`` tokens.
    threads: threads reading the documents of one batched read (each a
      contiguous share of them); tokenizing is one call, parallel in the
      tokenizer's library where it has a batch encode.
    skipped: the malformed documents skipped so far (``skipped_documents``).
    whole: documents are never split (conversations, each at most ``length``
      tokens): with packing a row takes whole documents while the next one
      fits and pads the rest (segment 0, weight 0); without, a row is one
      document, padded. Their tokens carry a loss mask (``chat.SCORED_TOKENS``),
      handed on as ``tokens_loss``.
    max_documents: with ``whole``, the documents a row takes at most (0: any
      number; ``data.max_documents_per_row``): a row never holds one that
      would weigh 0.
  """

  def __init__(
    self,
    stream: Any,
    tokenize: Callable[[Any], np.ndarray],
    *,
    lanes: int,
    rows: Sequence[int],
    length: int,
    packing: bool,
    threads: int,
    skipped: Callable[[], int] = lambda: 0,
    whole: bool = False,
    max_documents: int = 0,
  ):
    self._stream, self._tokenize = stream, tokenize
    self._batch = getattr(tokenize, "batch", None) or (lambda docs: [np.asarray(tokenize(d)) for d in docs])
    heads = getattr(tokenize, "heads", None)
    if not packing and heads is not None:  # a sequence is a document's head: only that much is tokenized
      self._batch = lambda docs: heads(docs, length)
    self.lanes, self.rows, self.length, self.packing, self.whole = lanes, list(rows), length, packing, whole
    self.max_documents = max_documents
    counted = getattr(tokenize, "long_conversations", 0)  # by the split's checks, before any row
    self.long_conversations = lambda: getattr(tokenize, "long_conversations", 0) - counted
    self.position = {r: (0, 0) for r in self.rows}  # lane → (documents finished, tokens used of the next)
    self._threads = max(1, threads)
    self._pool = (
      concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="distrib_train-lanes")
      if self._threads > 1
      else None
    )
    # lane → the tokens of its next documents, from its position's on, in order
    self._queues: dict[int, collections.deque[np.ndarray]] = {r: collections.deque() for r in self.rows}
    self._read_docs, self._read_tokens = 0, 0  # to guess how many documents a short lane needs
    self._skipped = skipped

  @property
  def skipped_documents(self) -> int:
    return self._skipped()

  def _documents(self, positions: list[int]) -> list[Any]:
    getitems = getattr(self._stream, "_getitems", None)  # grain's batched read, where the dataset has it
    read = (
      (lambda part: list(getitems(part))) if getitems is not None else (lambda part: [self._stream[p] for p in part])
    )
    if self._pool is None or len(positions) < 16 * self._threads:  # small reads: a thread hand-off costs more
      return read(positions)
    parts = [list(p) for p in np.array_split(np.asarray(positions, np.int64), self._threads) if len(p)]
    return [doc for part in self._pool.map(read, parts) for doc in part]

  def _shortfall(self, lane: int, tokens: int) -> int:
    """Documents to read for this lane to hold ``tokens`` past its position (0: it does), a guess from the
    mean length read so far; without packing, one until it holds a document of a sequence's length."""
    queue, (_, used) = self._queues[lane], self.position[lane]
    if not self.packing:
      return 0 if any(len(ids) >= (1 if self.whole else self.length) for ids in queue) else 1
    missing = tokens + used - sum(len(ids) for ids in queue)
    if missing <= 0:
      return 0
    mean = self._read_tokens / self._read_docs if self._read_tokens else self.length
    return min(64, max(1, math.ceil(missing / max(mean, 1.0))))

  def _fill(self) -> None:
    """Reads and tokenizes, in batches, until every lane's queue holds its next sequence. A read, once one
    lane needs it, also tops every other lane up to ``READ_AHEAD`` sequences: fewer, larger batches."""
    while any(self._shortfall(lane, self.length) for lane in self.rows):
      wanted = [(lane, self._shortfall(lane, READ_AHEAD * self.length)) for lane in self.rows]
      plan = [(lane, self.position[lane][0] + len(self._queues[lane]) + k) for lane, n in wanted for k in range(n)]
      tokens = self._batch(self._documents([index * self.lanes + lane for lane, index in plan]))
      for (lane, _), ids in zip(plan, tokens):
        self._queues[lane].append(np.asarray(ids))
      self._read_docs += len(plan)
      self._read_tokens += sum(len(ids) for ids in tokens)

  def _head(self, lane: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Without packing: the head of the lane's next document of a sequence's length (whole documents: its
    next document, padded); the position after it."""
    index, queue = self.position[lane][0], self._queues[lane]
    while len(tokens := queue.popleft()) < (1 if self.whole else self.length):
      index += 1
    if self.whole:
      tokens = np.concatenate([tokens, np.zeros(self.length - len(tokens), tokens.dtype)])
    return tokens[: self.length], (index + 1, 0)

  def _fit(self, lane: int, pieces: list[np.ndarray], takes: list[int]) -> tuple[int, int]:
    """With packing of whole documents: the lane's next documents while the next one fits the row, then the
    padding (a piece of its own, of length 0 when none is needed); the position after them."""
    index, queue, filled, taken = self.position[lane][0], self._queues[lane], 0, 0
    if queue and len(queue[0]) > self.length:
      raise ValueError(
        f"A document of {len(queue[0])} tokens does not fit a row of {self.length} whole: documents"
        " read whole (conversations) are cut to a row by their tokenizer."
      )
    while queue and filled + len(queue[0]) <= self.length and not (self.max_documents and taken == self.max_documents):
      tokens = queue.popleft()
      index += 1
      if len(tokens):
        pieces.append(tokens)
        takes.append(len(tokens))
        filled += len(tokens)
        taken += 1
    pieces.append(np.zeros(self.length - filled, pieces[-1].dtype if pieces else queue[0].dtype))
    takes.append(-(self.length - filled))  # negative: padding
    return index, 0

  def _cut(self, lane: int, pieces: list[np.ndarray], takes: list[int]) -> tuple[int, int]:
    """With packing: appends the pieces of the lane's next sequence (a run of tokens of each document it
    reaches into) and their lengths; the position after them."""
    (index, used), queue, filled = self.position[lane], self._queues[lane], 0
    while filled < self.length:
      tokens = queue[0]
      take = min(len(tokens) - used, self.length - filled)
      if take > 0:
        pieces.append(tokens[used : used + take])
        takes.append(take)
        filled, used = filled + take, used + take
      if used >= len(tokens):
        index, used = index + 1, 0
        queue.popleft()
    return index, used

  def next_rows(self) -> tuple[list[dict[str, np.ndarray]], dict[int, tuple[int, int]]]:
    """The next sequence of every lane this process feeds, and the lanes' positions after them (a
    prefetching caller keeps the position that goes with the rows it has handed out)."""
    self._fill()
    if not self.packing:
      done = [self._head(lane) for lane in self.rows]
      self.position = {r: after for r, (_, after) in zip(self.rows, done)}
      return [_fields({"tokens": tokens}) for tokens, _ in done], dict(self.position)
    pieces: list[np.ndarray] = []
    takes: list[int] = []
    counts = []  # pieces per row
    for lane in self.rows:
      before = len(takes)
      self.position[lane] = (self._fit if self.whole else self._cut)(lane, pieces, takes)
      counts.append(len(takes) - before)
    # The whole batch at once; each piece is a new segment (numbered from 1 in its row, padding 0), its
    # positions from 0.
    rows, signed, counts = len(self.rows), np.asarray(takes, np.int64), np.asarray(counts, np.int64)
    sizes = np.abs(signed)
    first = np.repeat(np.cumsum(counts) - counts, counts)  # each piece's row's first piece
    numbers = np.where(signed < 0, 0, np.arange(len(sizes)) - first + 1).astype(np.int32)
    tokens = np.concatenate(pieces).reshape(rows, self.length)
    segments = np.repeat(numbers, sizes).reshape(rows, self.length)
    positions = (np.arange(rows * self.length) - np.repeat(np.cumsum(sizes) - sizes, sizes)).astype(np.int32)
    # The names grain's packing gives, so that both paths share the shifting into inputs and targets.
    out = [
      _fields(
        {
          "tokens": tokens[i],
          "tokens_segment_ids": segments[i],
          "tokens_positions": positions[i * self.length : (i + 1) * self.length],
        }
      )
      for i in range(rows)
    ]
    return out, dict(self.position)

  def restore(self, positions: Mapping[int, tuple[int, int]]) -> None:
    missing = [r for r in self.rows if r not in positions]
    if missing:
      raise ValueError(
        f"The saved data position has no lane {missing[0]} (of {len(positions)}); it was written"
        " for another global batch size."
      )
    self.position = {r: tuple(positions[r]) for r in self.rows}
    for queue in self._queues.values():
      queue.clear()

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)
