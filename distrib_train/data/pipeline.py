"""Input pipelines on grain: documents → shuffled, process-sharded, packed batches.

A ``DataConfig`` names a source and the batch shape; ``DataLoader`` builds the
grain pipeline

  documents → global seeded shuffle → this process's shard → tokens →
  pack into fixed-length sequences → per-process batch → prefetch

and hands out global ``jax.Array`` batches on the planner's input shardings.
Its position is saved and restored through ``CheckpointManager``'s ``data``
item, so a restarted job continues at exactly the next example.

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

grain is imported here, not by ``distrib_train`` itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from distrib_train.data import lanes as lanes_lib
from distrib_train.data import sources
from distrib_train.data import tokenizer as tokenizer_lib
from distrib_train.data.config import DataConfig, Tokenizer

# 2: tuples in grain's state survive the JSON round trip (see _state_to_json).
STATE_VERSION = 2


# --- the pipeline ----------------------------------------------------------------------


class _Subset:
  """The documents at ``indices`` of a source, as a source of their own."""

  def __init__(self, source: sources.Documents, indices: np.ndarray):
    self._source = source
    self._indices = indices

  def __len__(self) -> int:
    return len(self._indices)

  def __getitem__(self, index: int) -> str | np.ndarray:
    return self._source[int(self._indices[index])]


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
    seq_len]``.
    """
    shape = (config.global_batch_size, config.seq_len)
    names = ["tokens", "targets", "weights"] + (["segment_ids", "positions"] if config.packing else [])
    return {name: jax.ShapeDtypeStruct(shape, np.float32 if name == "weights" else np.int32) for name in names}

  def __init__(self, config: DataConfig, input_shardings: Mapping[str, Any], *, split: str = "train",
               num_epochs: int | None = None, vocab_size: int | None = None):
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
    self._lanes: lanes_lib.Lanes | None = None  # an endless (training) loader reads lanes
    self._iterator = self._build(split, num_epochs, vocab_size)
    self._position = None if self._lanes is None else dict(self._lanes.position)  # of the batches handed out

  def _documents(self, split: str, vocab_size: int | None) -> tuple[Any, np.ndarray, Callable[[Any], np.ndarray]]:
    """The split's documents (indices into the source) and the tokenizer, checked: enough documents, ids the
    model knows, some tokens, and documents long enough for unpacked sequences."""
    config = self.config
    docs = sources.Documents(config)
    order = np.random.default_rng(config.seed).permutation(len(docs))
    n_eval = int(round(len(docs) * config.eval_fraction))
    if config.eval_fraction > 0:
      n_eval = max(1, min(n_eval, len(docs) - 1))
    held_out = np.sort(order[:n_eval])
    if split == "eval" and not n_eval:
      raise ValueError("The eval split is empty: eval_fraction is 0.")
    indices = held_out if split == "eval" else np.sort(order[n_eval:])
    if len(indices) < self.shard_count:
      source = f"data source {config.source!r}" + (f" {list(config.paths)}" if config.paths else "")
      raise ValueError(
          f"The {split} split has {len(indices)} document(s) ({source} holds {len(docs)}, {n_eval} held out by"
          f" data.eval_fraction={config.eval_fraction}), fewer than the {self.shard_count} data shard(s) it is"
          " read in; give more documents or change data.eval_fraction."
      )
    tokenize = _tokenizer(config)
    if docs.pretokenized is not None:
      _check_pretokenized(docs.pretokenized, config)
    if vocab_size is not None and isinstance(config.tokenizer, str):
      ids = tokenizer_lib.load(config.tokenizer, config.bos_token, config.eos_token).vocab_size
      if ids > vocab_size:
        raise ValueError(f"data.tokenizer {config.tokenizer} has {ids} ids but the model's vocabulary holds"
                         f" {vocab_size}; set model.vocab_size={ids} (or more), or use the model's own tokenizer.")
    if vocab_size is not None:
      _check_token_ids(tokenize, docs, indices[:: max(1, len(indices) // 16)][:16], vocab_size, split)
    # A sample spread over the split: reading every document of a large
    # ArrayRecord corpus here would be too slow.
    sample = indices[:: max(1, len(indices) // 2000)]
    longest = max(len(tokenize(docs[int(i)])) for i in sample)
    if longest == 0:  # packing would look for tokens forever
      source = f"data source {config.source!r}" + (f" {list(config.paths)}" if config.paths else "")
      raise ValueError(f"The {split} split of {source} holds no tokens: all {len(sample)} document(s) checked are"
                       " empty; give documents with text.")
    if not config.packing and longest < config.seq_len + 1:
      raise ValueError(
          f"seq_len {config.seq_len} + 1 is longer than every {split} document (longest {longest} tokens of"
          f" {len(sample)} checked) and packing is off; lower seq_len or turn packing on."
      )
    return docs, indices, tokenize

  def _build(self, split: str, num_epochs: int | None, vocab_size: int | None = None) -> Any:
    import grain

    _allow_grain_workers_outside_absl()
    config = self.config
    docs, indices, tokenize = self._documents(split, vocab_size)
    seq = config.seq_len + 1  # inputs and targets are shifted by one
    ds = grain.MapDataset.source(_Subset(docs, indices))  # the split's documents
    ds = ds.shuffle(seed=config.seed)  # the same global order in every process
    if num_epochs is None:  # training: each row from its own lane (lanes.py), whatever the job's shape
      self._lanes = lanes_lib.Lanes(
          ds.repeat(None), tokenize, lanes=config.global_batch_size, length=seq, packing=config.packing,
          rows=range(self.shard_index * self.local_batch_size, (self.shard_index + 1) * self.local_batch_size),
          threads=config.num_threads)
      return lanes_lib.Prefetched(self._next_lane_batch)
    ds = ds[self.shard_index::self.shard_count]  # … of which this process reads its share
    ds = ds.repeat(num_epochs)
    ds = ds.map(lambda doc: {"tokens": tokenize(doc)})
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=config.num_threads, prefetch_buffer_size=64))
    if config.num_workers:
      # Workers read and tokenize, one document at a time in the global
      # order; packing and batching stay in this process, so the batches do
      # not depend on the worker count.
      it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.num_workers))
    if config.packing:
      it = grain.experimental.ConcatThenSplitIterDataset(it, length_struct={"tokens": seq}).map(_shifted)
    else:
      it = it.filter(lambda ex: len(ex["tokens"]) >= seq).map(lambda ex: _unpacked(ex["tokens"][:seq]))
    if split == "eval":
      # Every held-out document counts: the last batch is padded with rows
      # of weight 0 instead of being dropped.
      it = it.batch(self.local_batch_size, drop_remainder=False).map(
          lambda batch: _pad_rows(batch, self.local_batch_size))
    else:
      it = it.batch(self.local_batch_size, drop_remainder=True)
    # Pack, batch and place on the devices ahead, in a background thread
    # that overlaps the step (the device transfer alone is ~3 ms per batch on
    # 8 emulated devices). Items keep the local rows for next_local().
    shardings, global_batch = self.input_shardings, self.config.global_batch_size
    it = it.map(lambda local: {"local": local, "global": to_global(local, shardings, global_batch)})
    it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=2)
    return iter(it)

  @property
  def endless(self) -> bool:
    """Whether this loader repeats forever and reads lanes (training); a finite pass reads grain shards."""
    return self._lanes is not None

  def _next_lane_batch(self) -> dict[str, Any]:
    rows, position = self._lanes.next_rows()
    rows = [_shifted(row) if self.config.packing else _unpacked(row["tokens"]) for row in rows]
    local = {name: np.stack([row[name] for row in rows]) for name in rows[0]}
    return {"local": local, "global": to_global(local, self.input_shardings, self.config.global_batch_size),
            "position": position}

  def _next_item(self) -> dict[str, Any]:
    item = next(self._iterator)
    if self._lanes is not None:
      self._position = item["position"]
    return item

  def __iter__(self) -> Iterator[dict[str, jax.Array]]:
    return self

  def next_local(self) -> dict[str, np.ndarray]:
    """This process's rows of the next batch, as numpy (no cross-process
    agreement at the end of a finite pass: use ``next(loader)`` in jobs)."""
    return self._next_item()["local"]

  def __next__(self) -> dict[str, jax.Array]:
    if not (self._finite and jax.process_count() > 1):
      return self._next_item()["global"]
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
    mine = np.array([[lane, *self._position[lane]] for lane in self._lanes.rows], np.int64)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      mine = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 3)
    lanes = {int(lane): [int(done), int(used)] for lane, done, used in mine}
    return {"version": lanes_lib.POSITION_VERSION, **self._layout(),
            "lanes": [lanes[lane] for lane in range(self.config.global_batch_size)]}

  def set_data_position(self, position: Mapping[str, Any]) -> None:
    """Moves the loader to a ``data_position()`` saved by a job of any process count."""
    if self._lanes is None:
      raise ValueError("Only an endless (training) loader has a data position; a finite pass is read in shards.")
    changed = [f"data.{k}: {position.get(k)!r} → {v!r}" for k, v in self._layout().items() if position.get(k) != v]
    if position.get("version") != lanes_lib.POSITION_VERSION or changed:
      raise ValueError("The saved data position was written for another data layout ("
                       + "; ".join(changed or [f"position version {position.get('version')}"])
                       + "); resume with the checkpoint's data config, or train in a new workdir.")
    self._iterator.reset()
    self._lanes.restore(dict(enumerate(map(tuple, position["lanes"]))))
    self._position = dict(self._lanes.position)

  def _layout(self) -> dict[str, Any]:
    config = self.config
    return {"global_batch_size": config.global_batch_size, "seq_len": config.seq_len, "packing": config.packing,
            "seed": config.seed, "eval_fraction": config.eval_fraction}

  # grain's checkpoint handler stores get_state() per process and calls
  # set_state() on restore; bytes keep our own checks beside grain's state.
  # An endless loader's state is its own rows' lanes (CheckpointManager keeps data_position() instead).
  def get_state(self) -> bytes:
    if self._lanes is not None:
      return json.dumps({"version": lanes_lib.POSITION_VERSION, **self._layout(),
                         "rows": {str(lane): list(self._position[lane]) for lane in self._lanes.rows}}).encode()
    return json.dumps({
        "version": STATE_VERSION,
        "num_workers": self.config.num_workers,
        "shard_index": self.shard_index,
        "shard_count": self.shard_count,
        "process_count": jax.process_count(),
        "grain": _state_to_json(self._iterator.get_state()),
    }).encode()

  def set_state(self, state: bytes) -> None:
    saved = json.loads(state, object_hook=_tuple_from_json)
    if self._lanes is not None:
      if "rows" not in saved:
        raise ValueError("The data-iterator state was written by a sharded (pre-lanes, or finite) pipeline; an"
                         " endless loader reads lanes: restore without the data item.")
      lanes = {int(lane): tuple(p) for lane, p in saved["rows"].items()}
      if any(lane not in lanes for lane in self._lanes.rows):
        raise ValueError("The data-iterator state holds other rows than this process feeds; restore through"
                         " CheckpointManager, which keeps every row's position.")
      self.set_data_position({**{k: saved.get(k) for k in ("version", *self._layout())},
                              "lanes": [lanes.get(lane, (0, 0)) for lane in range(self.config.global_batch_size)]})
      return
    mine = {"num_workers": self.config.num_workers, "shard_count": self.shard_count,
            "shard_index": self.shard_index, "process_count": jax.process_count()}
    changed = [f"{k} {saved.get(k)} → {v}" for k, v in mine.items() if saved.get(k) != v]
    if saved.get("version") not in (1, STATE_VERSION) or changed:
      raise ValueError(
          "The data-iterator state in the checkpoint was written by a different data layout ("
          + ", ".join(changed or [f"state version {saved.get('version')}"])
          + "); restore with the same process count and num_workers, or restore without the data item."
      )
    grain_state = saved["grain"]
    if saved["version"] == 1:
      grain_state = _grain_state_from_version_1(grain_state)
    self._iterator.set_state(grain_state)

  def start_prefetch(self) -> None:
    """Called by grain's checkpoint handler after a restore."""
    if self._lanes is not None:
      return
    start = getattr(self._iterator, "start_prefetch", None)
    if start is not None:
      start()

  def close(self) -> None:
    """Stops grain worker processes, if any (and the lanes' threads)."""
    if self._lanes is not None:
      self._iterator.reset()
      self._lanes.close()
      return
    close = getattr(self._iterator, "close", None)
    if close is not None:
      close()


def to_global(batch: Mapping[str, np.ndarray], input_shardings: Mapping[str, Any],
              global_batch_size: int) -> dict[str, jax.Array]:
  """Per-process numpy rows → global ``jax.Array``s on the input shardings."""
  names = [name for name in batch if name in input_shardings]
  if jax.process_count() == 1:
    # One process holds every row: a single batched device_put is several
    # times faster than assembling each array from process-local data.
    return jax.device_put({n: batch[n] for n in names}, {n: input_shardings[n] for n in names})
  return {
      name: jax.make_array_from_process_local_data(
          input_shardings[name], batch[name], (global_batch_size,) + batch[name].shape[1:])
      for name in names
  }


def _tokenizer(config: DataConfig) -> Callable[[Any], np.ndarray]:
  tokenizer: Tokenizer | None = config.tokenizer
  if isinstance(tokenizer, str):
    loaded = tokenizer_lib.load(tokenizer, config.bos_token, config.eos_token)
    plain_bytes = tokenizer == "bytes" and loaded.bos_id is None and loaded.eos_id is None
    tokenizer = None if plain_bytes else loaded

  def tokenize(doc: Any) -> np.ndarray:
    if isinstance(doc, np.ndarray):  # synthetic documents are tokens already
      return doc
    if tokenizer is None:
      return np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    return np.asarray(tokenizer(doc), dtype=np.int32)

  return tokenize


def _check_pretokenized(fingerprint: Mapping[str, Any], config: DataConfig) -> None:
  """Refuses pre-tokenized shards of another tokenizer than the run's ``data.tokenizer``."""
  run = (tokenizer_lib.load(config.tokenizer, config.bos_token, config.eos_token).fingerprint
         if isinstance(config.tokenizer, str) else {"spec": config.tokenizer_name()})
  keys = ("spec", "sha256", "bos_id", "eos_id")
  if any(fingerprint.get(k) != run.get(k) for k in keys):
    raise ValueError(f"The data paths' shards hold token ids of tokenizer {fingerprint.get('spec')} (BOS"
                     f" {fingerprint.get('bos_id')}, EOS {fingerprint.get('eos_id')}); data.tokenizer says"
                     f" {run.get('spec')} (BOS {run.get('bos_id')}, EOS {run.get('eos_id')}). Set data.tokenizer,"
                     " bos_token and eos_token as the shards were converted, or convert them again.")


def _check_token_ids(tokenize, docs, sample: np.ndarray, vocab_size: int, split: str) -> None:
  """Refuses ids outside the model's vocabulary in a sample of documents
  (the model would look them up as NaN and every step would be skipped)."""
  for index in sample:
    ids = tokenize(docs[int(index)])
    if len(ids) and (ids.max() >= vocab_size or ids.min() < 0):
      bad = int(ids.max()) if ids.max() >= vocab_size else int(ids.min())
      raise ValueError(
          f"The {split} data holds token id {bad} (document {int(index)}), outside the model's vocabulary of"
          f" {vocab_size} ids (0 to {vocab_size - 1}); use a tokenizer that matches the model or a model with a"
          " larger vocab_size.")


def _shifted(packed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  tokens, segments, positions = packed["tokens"], packed["tokens_segment_ids"], packed["tokens_positions"]
  same_document = (segments[1:] == segments[:-1]) & (segments[:-1] > 0)
  return {
      "tokens": tokens[:-1].astype(np.int32),
      "targets": tokens[1:].astype(np.int32),
      "segment_ids": segments[:-1].astype(np.int32),
      "positions": positions[:-1].astype(np.int32),
      "weights": same_document.astype(np.float32),
  }


def _pad_rows(batch: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  missing = rows - len(next(iter(batch.values())))
  if not missing:
    return dict(batch)
  return {k: np.concatenate([v, np.zeros((missing,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}


def _unpacked(tokens: np.ndarray) -> dict[str, np.ndarray]:
  return {
      "tokens": tokens[:-1].astype(np.int32),
      "targets": tokens[1:].astype(np.int32),
      "weights": np.ones(len(tokens) - 1, np.float32),
  }


# JSON has no tuples: a plain round trip hands grain lists where it wrote
# tuples, and grain compares some of them with tuples. Packing's "no partial
# document" slice (-1, -1) is one: restored as [-1, -1] (!= (-1, -1)) it
# reads as a partial document, so the document due next is taken as the
# empty slice [-1:-1] and skipped. grain's state has that slice at step 0 and
# after every row that began where a document ended exactly at the previous
# row's end. Tuples are therefore written tagged and read back as tuples;
# lists stay lists (grain's interleave state holds lists it assigns into).
_TUPLE_TAG = "__tuple__"


def _state_to_json(value: Any) -> Any:
  """grain's state with every tuple tagged, ready for ``json.dumps``."""
  if isinstance(value, tuple):
    return {_TUPLE_TAG: [_state_to_json(item) for item in value]}
  if isinstance(value, list):
    return [_state_to_json(item) for item in value]
  if isinstance(value, dict):
    return {key: _state_to_json(item) for key, item in value.items()}
  return value


def _tuple_from_json(obj: dict[str, Any]) -> Any:
  """``json.loads`` object hook: the inverse of ``_state_to_json``'s tags."""
  if len(obj) == 1 and _TUPLE_TAG in obj:
    return tuple(obj[_TUPLE_TAG])
  return obj


def _grain_state_from_version_1(state: Any) -> Any:
  """Version 1 wrote grain's state through plain JSON. Its only tuples were
  packing's remainder slices (at the top: batching, mapping and prefetching
  pass their parent's state through); they are made tuples again."""
  if isinstance(state, dict) and isinstance(state.get("remainder_slices"), dict):
    slices = {name: tuple(bounds) for name, bounds in state["remainder_slices"].items()}
    state = {**state, "remainder_slices": slices}
  return state


def _allow_grain_workers_outside_absl() -> None:
  """grain ≤ 0.2.18 reads absl flags in its workers; outside absl.app they
  are unparsed and ``mp_prefetch`` fails (fixed in later grain)."""
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
