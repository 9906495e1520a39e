"""The endless (training) read as a grain dataset: the lanes' next rows, batched, placed and prefetched.

``LaneBatches`` is a grain ``IterDataset`` over ``lanes.Lanes``: each item is
one batch, made by ``make_batch`` from the next row of every lane this
process feeds, and its iterator's state is the lanes' position after that
batch. ``prefetched`` runs it ahead in grain's ``ThreadPrefetchIterDataset``,
which pairs every item it makes ahead with the state its parent had right
after making it and hands both over together: its ``get_state`` is the
position after the batch last handed out, not after those made ahead, so a
checkpoint keeps the position of the batches the trainer consumed; its
``set_state`` drops what was made ahead and moves the lanes.

Not for: reading and packing a lane (``lanes.py``), the finite pass over
process shards (``finite.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from distrib_train.data import lanes as lanes_lib

# The lanes' next rows (one per lane, in batch order) → the item a loader hands out.
MakeBatch = Callable[[list[dict[str, np.ndarray]]], Any]


class LaneBatches(grain.IterDataset):
  """Endless batches of ``lanes``' next rows, each made by ``make_batch``; its iterators share ``lanes``."""

  def __init__(self, lanes: lanes_lib.Lanes, make_batch: MakeBatch):
    super().__init__()
    self._lanes, self._make_batch = lanes, make_batch

  def __iter__(self) -> grain.DatasetIterator:
    return _LaneBatchIterator(self._lanes, self._make_batch)


class _LaneBatchIterator(grain.DatasetIterator):
  """State: ``{"lanes": {lane: (documents finished, tokens used of the next)}}`` after the last batch made."""

  def __init__(self, lanes: lanes_lib.Lanes, make_batch: MakeBatch):
    super().__init__()
    self._lanes, self._make_batch = lanes, make_batch
    self._position = dict(lanes.position)

  def __next__(self) -> Any:
    rows, self._position = self._lanes.next_rows()
    return self._make_batch(rows)

  def get_state(self) -> dict[str, Any]:
    return {"lanes": dict(self._position)}

  def set_state(self, state: dict[str, Any]) -> None:
    self._lanes.restore(state["lanes"])
    self._position = dict(self._lanes.position)


def prefetched(lanes: lanes_lib.Lanes, make_batch: MakeBatch, depth: int = 2) -> grain.DatasetIterator:
  """``LaneBatches(lanes, make_batch)`` made ``depth`` batches ahead in grain's background thread.

  The iterator's ``get_state()["lanes"]`` is every lane's position after the
  batches handed out; ``set_state({"lanes": ...})`` moves there, dropping
  the batches made ahead; ``close()`` stops the thread (the lanes stay open).
  """
  return iter(grain.experimental.ThreadPrefetchIterDataset(LaneBatches(lanes, make_batch), prefetch_buffer_size=depth))
