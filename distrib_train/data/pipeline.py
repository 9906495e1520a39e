"""Input pipelines on grain: documents → shuffled, process-sharded, packed batches.

A ``DataConfig`` names a source and the batch shape; ``DataLoader`` builds the
grain pipeline

  documents → global seeded shuffle → this process's shard → tokens →
  pack into fixed-length sequences → per-process batch → prefetch

and hands out global ``jax.Array`` batches on the planner's input shardings.
Its position is saved and restored through ``CheckpointManager``, so a
restarted job continues at exactly the next example.

Two reads: an endless (training) loader reads each batch row from its own
lane (``lanes.py``, as a grain dataset in ``endless.py``), so its batches and
its position do not depend on the job's shape; a finite pass (evaluation, or
``num_epochs``) reads process shards of the split (``finite.py``).

Sources: ``synthetic`` (random tokens), ``pydoc`` (the English documentation
shipped with every CPython, ``pydoc_data.topics``: a real corpus with no
download), ``text`` (files or globs: ``.txt`` files, ``.jsonl`` with a
``"text"`` field, or ``.array_record`` shards). Text is tokenized by
``data.tokenizer`` (``tokenizer.py``: byte-level, vocab 256, by default;
``hf:``, ``sentencepiece:`` or ``tiktoken:`` files; or, from code, any
``str -> list[int]`` function).

Which rows of the global batch a process feeds follows the input sharding:
processes whose devices hold the same rows (a mesh axis that replicates the
batch across processes) read the same shard and feed identical data.

grain is imported when a loader is built, not by ``distrib_train`` itself.

Not for: where documents come from (``sources.py``), a lane's reading and
packing (``lanes.py``), the grain pipelines of the two reads (``endless.py``,
``finite.py``), rows from sequences (``sequences.py``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from distrib_train.common.exit_hooks import close_at_exit
from distrib_train.data import block_order
from distrib_train.data import finite
from distrib_train.data import lanes as lanes_lib
from distrib_train.data import sequences
from distrib_train.data import sources
from distrib_train.data import splits
from distrib_train.data.config import DataConfig


def data_shard(sharding: jax.sharding.Sharding, global_batch_size: int) -> tuple[int, int]:
  """``(index, count)``: which block of batch rows this process feeds.

  Processes whose devices hold the same rows share an index (and must feed
  the same data); ``count`` is the number of distinct row blocks.

  Raises:
    ValueError: the batch does not split evenly over the mesh's batch axes.
  """
  if not isinstance(sharding, jax.sharding.NamedSharding):
    raise ValueError(f"Input shardings must be NamedShardings (from the planner), got {type(sharding).__name__}.")
  # Only the batch dimension decides which rows a process holds.
  batch_only = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[:1]))
  indices = batch_only.devices_indices_map((global_batch_size,))
  by_process: dict[int, set[tuple[int, int]]] = {}
  for device, index in indices.items():
    rows = index[0]
    start, stop, _ = rows.indices(global_batch_size)
    by_process.setdefault(device.process_index, set()).add((start, stop))
  blocks = {}
  for process, spans in by_process.items():
    start, stop = min(s for s, _ in spans), max(e for _, e in spans)
    if sum(e - s for s, e in spans) != stop - start:
      raise ValueError(f"Process {process} holds batch rows that are not one contiguous block: {sorted(spans)}.")
    blocks[process] = (start, stop)
  distinct = sorted(set(blocks.values()))
  sizes = {stop - start for start, stop in distinct}
  if len(sizes) != 1:
    raise ValueError(f"Batch rows split unevenly over processes: {distinct}.")
  return distinct.index(blocks[jax.process_index()]), len(distinct)


def _batch_divisor(sharding: jax.sharding.Sharding) -> int:
  """How many ways the mesh splits the batch dimension."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    raise ValueError(f"Input shardings must be NamedShardings (from the planner), got {type(sharding).__name__}.")
  spec = sharding.spec
  axes = spec[0] if len(spec) else None
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return int(np.prod([sharding.mesh.shape[a] for a in axes])) if axes else 1


class DataLoader:
  """Global batches from a grain pipeline; its position survives checkpoints.

  ``next(loader)`` returns a dict of ``jax.Array`` — ``tokens``, ``targets``,
  ``weights`` and, with packing, ``segment_ids`` and ``positions`` — each of
  shape ``[global_batch_size, seq_len]`` on ``input_shardings``
  (``DataLoader.batch_schema(config)`` describes them before a loader
  exists). Pass the loader as ``data_iterator`` to
  ``CheckpointManager.save`` / ``restore``.

  Close it when done (``close()``, or ``with DataLoader(...) as loader:``):
  that stops its prefetch thread, its lanes' threads and its worker
  processes. One that is not closed is closed at interpreter exit
  (``common/exit_hooks.py``), so no thread of it is left running native code
  when the interpreter goes.

  Args:
    config: the data config.
    input_shardings: input name → sharding (``plan.input_kwarg_shardings``);
      ``tokens`` decides which rows this process feeds.
    split: ``train`` or ``eval`` (disjoint document sets).
    num_epochs: passes over the data; None repeats forever.
    vocab_size: the model's vocabulary; a sample of the split's documents is
      tokenized at once and an id outside ``[0, vocab_size)`` refused.

  Raises:
    ValueError: a batch that does not split over processes or over the
      mesh's batch axes, or a source problem (named).
  """

  @staticmethod
  def batch_schema(config: DataConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch a loader of ``config`` yields, abstractly: name → shape and
    dtype (the planner's example inputs; nothing is read).

    ``tokens``, ``targets`` (int32) and ``weights`` (float32, 0 where a
    target is padding or crosses a document boundary), then with packing
    ``segment_ids`` and ``positions`` (int32); each ``[global_batch_size,
    seq_len]``. (An objective's own fields, a precomputed DPO reference's
    ``reference_logps``, are its record's: ``objectives.Objective``.)
    """
    shape = (config.global_batch_size, config.seq_len)
    names = ["tokens", "targets", "weights"] + (["segment_ids", "positions"] if config.packing else [])
    return {name: jax.ShapeDtypeStruct(shape, np.float32 if name == "weights" else np.int32) for name in names}

  def __init__(
    self,
    config: DataConfig,
    input_shardings: Mapping[str, Any],
    *,
    split: str = "train",
    num_epochs: int | None = None,
    vocab_size: int | None = None,
  ):
    if split not in ("train", "eval"):
      raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
    if "tokens" not in input_shardings:
      raise ValueError(f"input_shardings needs 'tokens'; it has {sorted(input_shardings)}.")
    self.config = config
    self.input_shardings = dict(input_shardings)
    tokens_sharding = self.input_shardings["tokens"]
    divisor = _batch_divisor(tokens_sharding)
    if config.global_batch_size % divisor:
      raise ValueError(
        f"global_batch_size {config.global_batch_size} does not split over the mesh's batch axes"
        f" ({tokens_sharding.spec[0]}, {divisor} ways)."
      )
    self.shard_index, self.shard_count = data_shard(tokens_sharding, config.global_batch_size)
    self.local_batch_size = config.global_batch_size // self.shard_count
    self._finite = num_epochs is not None
    self._by_blocks = sources.read_by_blocks(config)  # its positions name other documents: a layout of its own
    self._lanes: lanes_lib.Lanes | None = None  # an endless (training) loader reads lanes
    self._skipped = lambda: 0  # a finite pass's skipped documents (its lanes count an endless loader's)
    self._long = lambda: 0  # and its conversations longer than a row
    self._reads = _Reads(self._build(split, num_epochs, vocab_size), self._lanes)
    self._close = close_at_exit(self._reads.close)

  def _build(self, split: str, num_epochs: int | None, vocab_size: int | None = None) -> Any:
    import grain

    _allow_grain_workers_outside_absl()
    config = self.config
    shardings, global_batch = self.input_shardings, config.global_batch_size
    if num_epochs is None:  # training: each row from its own lane (lanes.py), whatever the job's shape
      from distrib_train.data import endless, lane_process

      self._lanes = lane_process.open_lanes(
        config,
        split,
        self.shard_count,
        vocab_size,
        rows=range(self.shard_index * self.local_batch_size, (self.shard_index + 1) * self.local_batch_size),
      )
      # (the batch maker refers to no loader: a loader nobody holds is collected, and its reads closed)
      return endless.prefetched(self._lanes, functools.partial(_lane_batch, config, shardings))
    docs, indices, tokenize = splits.split_documents(config, split, self.shard_count, vocab_size)
    checked = docs.skipped_documents
    self._skipped = lambda: docs.skipped_documents - checked
    counted = tokenize.long_conversations  # by the split's checks, before any row
    self._long = lambda: tokenize.long_conversations - counted
    stream = block_order.shuffled(docs, indices, config.seed)  # block-read files: the shuffle by blocks
    if stream is not None:
      ds = block_order.dataset(stream)
    else:
      ds = grain.MapDataset.source(splits.Subset(docs, indices))  # the split's documents
      ds = ds.shuffle(seed=config.seed)  # the same global order in every process
    return finite.batches(
      ds,
      config=config,
      tokenize=tokenize,
      shard_index=self.shard_index,
      shard_count=self.shard_count,
      num_epochs=num_epochs,
      local_batch_size=self.local_batch_size,
      pad_last_batch=split == "eval",
      place=lambda local: to_global(local, shardings, global_batch),
    )

  @property
  def _iterator(self) -> Any:
    if self._reads.iterator is None:
      raise ValueError("This DataLoader is closed.")
    return self._reads.iterator

  @property
  def skipped_documents(self) -> int:
    """Malformed JSONL lines this loader has read (``data.bad_records=skip``: read as no document), read
    ahead included, in this process and its lane workers (not in a finite pass's grain workers)."""
    return self._skipped() if self._lanes is None else self._lanes.skipped_documents

  @property
  def long_conversations(self) -> int:
    """Conversations longer than a row this loader has cut or left out (``data.long_conversations``), read
    ahead included, in this process and its lane workers (not in a finite pass's grain workers)."""
    return self._long() if self._lanes is None else self._lanes.long_conversations()

  def counts(self) -> dict[str, int]:
    """``data/skipped_documents`` and, for conversations, ``data/long_conversations`` (``BatchSource``)."""
    counts = {"skipped_documents": self.skipped_documents}
    if self.config.conversations:
      counts["long_conversations"] = self.long_conversations
    return counts

  def take_figures(self) -> dict[str, float]:
    """None: the loader's counts are all it logs (``BatchSource``)."""
    return {}

  @property
  def endless(self) -> bool:
    """Whether this loader repeats forever and reads lanes (training); a finite pass reads grain shards."""
    return self._lanes is not None

  def __iter__(self) -> Iterator[dict[str, jax.Array]]:
    return self

  def next_batch(self, state: Any = None) -> dict[str, jax.Array]:
    """The next batch, as ``next(loader)``: a training loop's batch source (``train/loop.py``), which may read
    the train state; a loader does not."""
    del state
    return next(self)

  def next_local(self) -> dict[str, np.ndarray]:
    """This process's rows of the next batch, as numpy (no cross-process
    agreement at the end of a finite pass: use ``next(loader)`` in jobs)."""
    return next(self._iterator)["local"]

  def __next__(self) -> dict[str, jax.Array]:
    if not (self._finite and jax.process_count() > 1):
      return next(self._iterator)["global"]
    # Shards of a finite pass hold different numbers of batches; every
    # process must stop at the same step or the others wait in the next
    # step's collectives forever. One tiny all-gather per batch decides.
    from jax.experimental import multihost_utils

    try:
      item = next(self._iterator)
    except StopIteration:
      item = None
    have = multihost_utils.process_allgather(np.array([item is not None], np.int32))
    if not np.all(have):
      raise StopIteration
    return item["global"]

  # An endless loader's position is every lane's: the same in every process, kept in the checkpoint's
  # metadata by CheckpointManager, restorable by any number of processes.
  def data_position(self) -> dict[str, Any] | None:
    """Every lane's position after the batches handed out (a collective in a multi-process job: every
    process calls it at the same batch); None for a finite pass, which is read in shards."""
    if self._lanes is None:
      return None
    position = self._lane_position()
    mine = np.array([[lane, *position[lane]] for lane in self._lanes.rows], np.int64)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      mine = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 3)
    lanes = {int(lane): [int(done), int(used)] for lane, done, used in mine}
    return {
      "version": lanes_lib.POSITION_VERSION,
      **self._layout(),
      "lanes": [lanes[lane] for lane in range(self.config.global_batch_size)],
    }

  def set_data_position(self, position: Mapping[str, Any]) -> None:
    """Moves the loader to a ``data_position()`` saved by a job of any process count."""
    if self._lanes is None:
      raise ValueError("Only an endless (training) loader has a data position; a finite pass is read in shards.")
    changed = [f"data.{k}: {position.get(k)!r} → {v!r}" for k, v in self._layout().items() if position.get(k) != v]
    if position.get("version") != lanes_lib.POSITION_VERSION or changed:
      raise ValueError(
        "The saved data position was written for another data layout ("
        + "; ".join(changed or [f"position version {position.get('version')}"])
        + "); resume with the checkpoint's data config, or train in a new workdir."
      )
    self._iterator.set_state({"lanes": dict(enumerate(map(tuple, position["lanes"])))})

  def _lane_position(self) -> dict[int, tuple[int, int]]:
    """Every lane's position after the batches handed out (not after those prefetched: endless.py)."""
    return self._iterator.get_state()["lanes"]

  def _layout(self) -> dict[str, Any]:
    config = self.config
    layout = {
      "global_batch_size": config.global_batch_size,
      "seq_len": config.seq_len,
      "packing": config.packing,
      "seed": config.seed,
      "eval_fraction": config.eval_fraction,
    }
    if config.conversations:  # whole conversations name other documents and rows than a stream of text
      layout["loss_on"] = config.loss_on
      layout.update({"pairs": True} if config.pairs else {})
    # A position in the shuffle by blocks names other documents than the same position in grain's shuffle (a
    # Parquet corpus's before this release): a position saved in the one order is refused in the other.
    return {**layout, "order": "blocks"} if self._by_blocks else layout

  # grain's checkpoint handler stores get_state() per process and calls set_state() on restore (a finite
  # pass's state: finite.py). An endless loader's state is its own rows' lanes (CheckpointManager keeps
  # data_position() instead).
  def get_state(self) -> bytes:
    if self._lanes is None:
      return finite.get_state(self._iterator, **self._shards())
    position = self._lane_position()
    return json.dumps(
      {
        "version": lanes_lib.POSITION_VERSION,
        **self._layout(),
        "rows": {str(lane): list(position[lane]) for lane in self._lanes.rows},
      }
    ).encode()

  def set_state(self, state: bytes) -> None:
    if self._lanes is None:
      finite.set_state(self._iterator, state, **self._shards())
      return
    saved = json.loads(state)
    if "rows" not in saved:
      raise ValueError(
        "The data-iterator state was written by a sharded (pre-lanes, or finite) pipeline; an"
        " endless loader reads lanes: restore without the data item."
      )
    lanes = {int(lane): tuple(p) for lane, p in saved["rows"].items()}
    if any(lane not in lanes for lane in self._lanes.rows):
      raise ValueError(
        "The data-iterator state holds other rows than this process feeds; restore through"
        " CheckpointManager, which keeps every row's position."
      )
    self.set_data_position(
      {
        **{k: saved.get(k) for k in ("version", *self._layout())},
        "lanes": [lanes.get(lane, (0, 0)) for lane in range(self.config.global_batch_size)],
      }
    )

  def _shards(self) -> dict[str, int]:
    """The layout a finite pass's state holds and is restored onto."""
    return {
      "num_workers": self.config.num_workers,
      "shard_index": self.shard_index,
      "shard_count": self.shard_count,
      "process_count": jax.process_count(),
    }

  def start_prefetch(self) -> None:
    """Called by grain's checkpoint handler after a restore."""
    if self._lanes is not None:
      return
    start = getattr(self._iterator, "start_prefetch", None)
    if start is not None:
      start()

  def close(self) -> None:
    """Stops the prefetch thread, the lanes' threads and the worker processes, if any; later calls do nothing."""
    self._close()

  def __enter__(self) -> DataLoader:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()


def _lane_batch(
  config: DataConfig, input_shardings: Mapping[str, Any], rows: list[dict[str, np.ndarray]]
) -> dict[str, Any]:
  """The lanes' next rows (endless.py) → this process's rows and the global batch."""
  cap = config.max_segments_per_row
  rows = [
    sequences.shifted(row, cap) if config.packing else sequences.unpacked(row["tokens"], row.get("tokens_loss"))
    for row in rows
  ]
  local = {name: np.stack([row[name] for row in rows]) for name in rows[0]}
  return {"local": local, "global": to_global(local, input_shardings, config.global_batch_size)}


class _Reads:
  """A loader's grain iterator and lanes, closed once by ``close``, which also lets go of them: grain's
  iterators close themselves again when collected, and a loader collected at interpreter teardown would
  find grain's modules already gone (``Exception ignored in … DatasetIterator.__del__``)."""

  def __init__(self, iterator: Any, lanes: Any):
    self.iterator, self.lanes = iterator, lanes

  def close(self) -> None:
    """Stops the prefetch thread (joined), then the lanes' threads or worker processes."""
    iterator, lanes, self.iterator, self.lanes = self.iterator, self.lanes, None, None
    if lanes is not None:
      interrupt = getattr(lanes, "interrupt", None)
      if interrupt is not None:  # worker processes: the prefetch thread may be waiting on a stuck one's rows
        interrupt()
      try:
        iterator.close()
      finally:  # the workers stop even if the prefetch thread's close failed
        lanes.close()
    elif iterator is not None and hasattr(iterator, "close"):
      iterator.close()


def to_global(
  batch: Mapping[str, np.ndarray], input_shardings: Mapping[str, Any], global_batch_size: int
) -> dict[str, jax.Array]:
  """Per-process numpy rows → global ``jax.Array``s on the input shardings."""
  names = [name for name in batch if name in input_shardings]
  if jax.process_count() == 1:
    # One process holds every row: a single batched device_put is several
    # times faster than assembling each array from process-local data.
    return jax.device_put({n: batch[n] for n in names}, {n: input_shardings[n] for n in names})
  return {
    name: jax.make_array_from_process_local_data(
      input_shardings[name], batch[name], (global_batch_size,) + batch[name].shape[1:]
    )
    for name in names
  }


def _allow_grain_workers_outside_absl() -> None:
  """grain ≤ 0.2.18 reads absl flags in its workers; outside absl.app they
  are unparsed and ``mp_prefetch`` fails (fixed in later grain)."""
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
