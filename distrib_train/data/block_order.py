"""The shuffle by blocks: a split's documents in an order that reads each block of a file about once an epoch.

grain's index shuffle visits documents in a uniformly random order, which is
right for files read document by document (JSONL, ``.txt``, ArrayRecord,
``datasets`` folders) but costs a whole block for nearly every document of a
file read by blocks: a Parquet row group, a block of a ``.jsonl.zst`` /
``.jsonl.gz`` file's decompressed stream (``compressed.py``). For a split
whose source has such files, the stream is ordered by blocks instead:

- a *window* is the split's positions (its ``indices`` are sorted document
  numbers) whose documents fall in one block;
- each epoch (stream position ``p`` → epoch ``p // n``) the windows' order
  is shuffled (seeded by the seed and the epoch). Where some files are
  ``sequential`` (compressed: cheap only in order), the files are shuffled
  and the windows of ``INTERLEAVE`` files at a time are interleaved at
  random, each sequential file's windows kept in their file order: a
  compressed file is decompressed about once an epoch, with at most about
  ``INTERLEAVE`` decompressors open;
- the documents of each window are permuted (seeded by the seed, the epoch
  and the window).

Position ``p``'s document depends on the seed, ``p`` and the files alone, so
lanes (``lanes.py``) resume exactly on any process count. Per epoch only
O(windows) arrays are made (the last few epochs kept), and one permutation
per window read (the last ``_WINDOW_PERMUTATIONS`` kept).

Readers keep their decoded blocks in one ``BlockCache`` per source, an LRU of
``data.block_cache`` blocks: memory is bounded by that many blocks times the
block's size (a Parquet row group's text, or ``compressed.BLOCK_BYTES``).
The lanes read positions spread over a few windows at once (rows advance at
different rates), so it holds several.

Not for: reading blocks (``text_files.py``, ``compressed.py``), the index
shuffle of random-access corpora (grain's, in ``lane_process.py`` and
``pipeline.py``).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

INTERLEAVE = 4  # sequential files whose windows are interleaved at a time
RANDOM_ACCESS_BLOCK = 4096  # documents per window of a random-access file in a corpus that also has block files
_EPOCHS = 4  # epochs' window orders kept
_WINDOW_PERMUTATIONS = 256  # windows' document permutations kept
_TAG = 0x626C6B73  # separates these seeds from others drawn from data.seed


class BlockCache:
  """A thread-safe LRU of decoded blocks, at most ``capacity`` of them (shared by a source's readers)."""

  def __init__(self, capacity: int):
    self.capacity = capacity
    self._blocks: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
    self._lock = threading.Lock()

  def get(self, key: Hashable) -> Any:
    with self._lock:
      block = self._blocks.get(key)
      if block is not None:
        self._blocks.move_to_end(key)
      return block

  def put(self, key: Hashable, block: Any) -> None:
    with self._lock:
      self._blocks[key] = block
      self._blocks.move_to_end(key)
      while len(self._blocks) > self.capacity:
        self._blocks.popitem(last=False)

  def get_or_make(self, key: Hashable, make: Callable[[], Any], lock: threading.Lock) -> Any:
    """The block at ``key``, else ``make()``'s, kept; ``lock`` (the reader's) lets one thread make it while
    the others that want it wait."""
    block = self.get(key)
    if block is None:
      with lock:
        block = self.get(key)
        if block is None:
          block = make()
          self.put(key, block)
    return block

  def __getstate__(self) -> dict:  # a copy sent to another process starts empty
    return {"capacity": self.capacity}

  def __setstate__(self, state: dict) -> None:
    self.__init__(state["capacity"])


class _Kept:
  """Values made by ``make(key)``, the last ``size`` kept (epochs' orders, windows' permutations)."""

  def __init__(self, size: int, make: Callable[[Any], Any]):
    self._values, self._make = BlockCache(size), make

  def __call__(self, key: Any) -> Any:
    value = self._values.get(key)
    if value is None:  # two threads may both make it, alike
      value = self._make(key)
      self._values.put(key, value)
    return value


class BlockOrder:
  """Stream position → split position, the shuffle by blocks (see the module docstring).

  Args:
    block_starts: the source's block boundaries in document numbers (first 0, last the document count).
    block_files: the file of each block (files numbered in the source's order).
    sequential: per file, whether its blocks are cheap only in order.
    indices: the split's document numbers, sorted.
    seed: the shuffle seed.
  """

  def __init__(
    self, block_starts: np.ndarray, block_files: np.ndarray, sequential: np.ndarray, indices: np.ndarray, seed: int
  ):
    bounds = np.searchsorted(indices, np.asarray(block_starts, np.int64))
    keep = np.flatnonzero(np.diff(bounds) > 0)  # blocks holding documents of the split
    self.starts = bounds[keep].astype(np.int64)  # each window's first split position
    self.sizes = (bounds[keep + 1] - bounds[keep]).astype(np.int64)
    self.files = np.asarray(block_files)[keep]
    self.n, self.seed = int(len(indices)), int(seed)
    self.sequential = bool(np.any(np.asarray(sequential, bool)[np.unique(self.files)]))
    self._file_sequential = np.asarray(sequential, bool)
    file_ids, first = np.unique(self.files, return_index=True)  # windows are grouped by file, in order
    ends = np.append(first[1:], len(self.files))
    self._file_windows = [(int(f), int(a), int(b)) for f, a, b in zip(file_ids, first, ends)]
    self._epochs = _Kept(_EPOCHS, self._epoch_order)
    self._permutations = _Kept(_WINDOW_PERMUTATIONS, self._window_permutation)

  @property
  def windows(self) -> int:
    return len(self.starts)

  def epoch_windows(self, epoch: int) -> np.ndarray:
    """The windows in the order epoch ``epoch`` visits them."""
    return self._epochs(int(epoch))[0]

  def _epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([self.seed, epoch, _TAG])
    if not self.sequential:
      order = rng.permutation(self.windows)
    else:
      pieces = []
      files = [self._file_windows[i] for i in rng.permutation(len(self._file_windows))]
      for group in range(0, len(files), INTERLEAVE):
        members = files[group : group + INTERLEAVE]
        windows = [np.arange(a, b) if self._file_sequential[f] else a + rng.permutation(b - a) for f, a, b in members]
        turns = rng.permutation(np.repeat(np.arange(len(members)), [len(w) for w in windows]))
        piece = np.empty(len(turns), np.int64)
        for member, own in enumerate(windows):
          piece[turns == member] = own  # the member's windows, in its order, at its turns
        pieces.append(piece)
      order = np.concatenate(pieces)
    first = np.concatenate([[0], np.cumsum(self.sizes[order])[:-1]])
    return order, first

  def _window_permutation(self, key: tuple[int, int]) -> np.ndarray:
    epoch, window = key
    rng = np.random.default_rng([self.seed, epoch, window, _TAG])
    return rng.permutation(int(self.sizes[window])).astype(np.int32)

  def position(self, stream_position: int) -> int:
    """The split position that stream position ``stream_position`` (≥ 0, any epoch) reads."""
    epoch, offset = divmod(int(stream_position), self.n)
    order, first = self._epochs(epoch)
    slot = int(np.searchsorted(first, offset, side="right")) - 1
    window = int(order[slot])
    return int(self.starts[window]) + int(self._permutations((epoch, window))[offset - int(first[slot])])

  def __getstate__(self) -> dict:
    state = dict(self.__dict__)
    del state["_epochs"], state["_permutations"]
    return state

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self._epochs = _Kept(_EPOCHS, self._epoch_order)
    self._permutations = _Kept(_WINDOW_PERMUTATIONS, self._window_permutation)


class Shuffled:
  """The split's documents in the block order, by stream position (any ``index`` ≥ 0: epochs repeat)."""

  def __init__(self, docs: Any, indices: np.ndarray, order: BlockOrder):
    self._docs, self._indices, self.order = docs, indices, order

  def __len__(self) -> int:
    return self.order.n

  def __getitem__(self, index: int) -> Any:
    return self._docs[int(self._indices[self.order.position(index)])]


def shuffled(docs: Any, indices: np.ndarray, seed: int) -> Shuffled | None:
  """The split in the block order where the source has block-read files (``docs.blocks()``), else None
  (grain's index shuffle keeps the order)."""
  blocks = getattr(docs, "blocks", lambda: None)()
  if blocks is None:
    return None
  return Shuffled(docs, indices, BlockOrder(*blocks, indices=indices, seed=seed))


def dataset(stream: Shuffled) -> Any:
  """``stream`` as a grain ``MapDataset`` of one epoch's length whose indices past it read the later
  epochs (as grain's shuffle does), for the finite passes."""
  import grain

  return grain.MapDataset.range(len(stream)).map_with_index(lambda index, _: stream[index])
