"""The finite pass (evaluation, or a number of epochs): a split read in process shards by grain.

  documents (shuffled) → this process's shard → tokens → pack into
  sequences (or take each document's head) → per-process batches → placed
  on the devices, prefetched

Process ``i`` of ``n`` data shards reads every ``n``-th document of the
shuffled order from the ``i``-th, so the shards hold different numbers of
batches (``DataLoader`` agrees on the end across processes). An evaluation
pass counts every document: its last batch is padded with rows of weight 0.

Its position is grain's iterator state, kept per process through grain's
checkpoint handler (``get_state`` / ``set_state``: versioned JSON with the
layout it was written for), so it restores only onto the same process count
and ``num_workers``.

Not for: the endless training read (``lanes.py``, ``endless.py``), whose
batches do not depend on the job's shape and whose position any job restores.
"""

from __future__ import annotations

import functools

import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from distrib_train.data import sequences
from distrib_train.data.config import DataConfig

# 2: tuples in grain's state survive the JSON round trip (see _state_to_json).
STATE_VERSION = 2


def batches(
  ds: Any,
  *,
  config: DataConfig,
  tokenize: Callable[[Any], np.ndarray],
  shard_index: int,
  shard_count: int,
  num_epochs: int,
  local_batch_size: int,
  pad_last_batch: bool,
  place: Callable[[dict[str, np.ndarray]], Any],
) -> Any:
  """This process's batches of ``num_epochs`` passes over ``ds``, prefetched: a grain iterator.

  Args:
    ds: the split's documents in the global shuffled order (a grain ``MapDataset``).
    config: the data config (``seq_len``, ``packing``, threads and workers).
    tokenize: document → token ids; without packing, its ``heads`` (documents,
      n → each one's first n ids, ``splits.DocumentTokenizer``), if it has
      one, tokenizes only as much of each as a row takes.
    shard_index, shard_count: which share of the documents this process reads.
    num_epochs: passes over ``ds``.
    local_batch_size: rows per batch in this process.
    pad_last_batch: pad the last batch with rows of weight 0 (evaluation)
      instead of dropping it.
    place: this process's rows → the global batch on the devices.

  Returns:
    An iterator of ``{"local": rows as numpy, "global": place(rows)}``.
  """
  import grain

  seq = config.seq_len + 1  # inputs and targets are shifted by one
  ds = ds[shard_index::shard_count]  # … of which this process reads its share
  ds = ds.repeat(num_epochs)
  heads = getattr(tokenize, "heads", None)  # without packing a row is a document's head: only that is tokenized
  encode = (lambda doc: heads([doc], seq)[0]) if heads is not None and not config.packing else tokenize
  if config.conversations:  # each token's id and loss mask, packed whole (never split) or padded
    ds = ds.map(lambda doc: _scored(encode(doc)))
  else:
    ds = ds.map(lambda doc: {"tokens": encode(doc)})
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=config.num_threads, prefetch_buffer_size=64))
  if config.num_workers:
    # Workers read and tokenize, one document at a time in the global
    # order; packing and batching stay in this process, so the batches do
    # not depend on the worker count.
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.num_workers))
  if config.conversations:
    it = it.filter(lambda ex: len(ex["tokens"]) > 0)  # left out: data.long_conversations=drop
    if config.packing:  # a row takes conversations while the next fits, as the lanes pack them
      it = grain.experimental.FirstFitPackIterDataset(
        it,
        length_struct={"tokens": seq, "loss": seq, **({"ref": seq} if config.reference_logps else {})},
        num_packing_bins=1,
        shuffle_bins=False,
        max_sequences_per_bin=config.max_documents_per_row or None,
      ).map(
        lambda ex: sequences.shifted(
          {**ex, "tokens_loss": ex["loss"], **({"tokens_ref": ex["ref"]} if "ref" in ex else {})},
          config.max_segments_per_row,
        )
      )
    else:
      it = it.map(lambda ex: sequences.unpacked(_padded(ex["tokens"], seq), _padded(ex["loss"], seq)))
  elif config.packing:
    it = grain.experimental.ConcatThenSplitIterDataset(it, length_struct={"tokens": seq}).map(
      functools.partial(sequences.shifted, max_documents=config.max_documents_per_row)
    )
  else:
    it = it.filter(lambda ex: len(ex["tokens"]) >= seq).map(lambda ex: sequences.unpacked(ex["tokens"][:seq]))
  if pad_last_batch:
    # Every held-out document counts: the last batch is padded with rows
    # of weight 0 instead of being dropped.
    it = it.batch(local_batch_size, drop_remainder=False).map(lambda batch: _pad_rows(batch, local_batch_size))
  else:
    it = it.batch(local_batch_size, drop_remainder=True)
  # Pack, batch and place on the devices ahead, in a background thread
  # that overlaps the step (the device transfer alone is ~3 ms per batch on
  # 8 emulated devices). Items keep the local rows for next_local().
  it = it.map(lambda local: {"local": local, "global": place(local)})
  it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=2)
  return iter(it)


def _scored(tokens: np.ndarray) -> dict[str, np.ndarray]:
  """A conversation's tokens (``chat.SCORED_TOKENS``) as the features grain packs: ids and loss mask."""
  out = {"tokens": np.ascontiguousarray(tokens["ids"]), "loss": np.ascontiguousarray(tokens["loss"])}
  if "ref" in tokens.dtype.names:  # a precomputed DPO reference's figures
    out["ref"] = np.ascontiguousarray(tokens["ref"])
  return out


def _padded(values: np.ndarray, length: int) -> np.ndarray:
  return np.concatenate([values, np.zeros(length - len(values), values.dtype)])


def _pad_rows(batch: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  missing = rows - len(next(iter(batch.values())))
  if not missing:
    return dict(batch)
  return {k: np.concatenate([v, np.zeros((missing,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}


# grain's checkpoint handler stores get_state() per process and calls
# set_state() on restore; bytes keep our own checks beside grain's state.
def get_state(iterator: Any, *, num_workers: int, shard_index: int, shard_count: int, process_count: int) -> bytes:
  """``iterator``'s grain state with the layout it was written for, as JSON bytes."""
  return json.dumps(
    {
      "version": STATE_VERSION,
      "num_workers": num_workers,
      "shard_index": shard_index,
      "shard_count": shard_count,
      "process_count": process_count,
      "grain": _state_to_json(iterator.get_state()),
    }
  ).encode()


def set_state(
  iterator: Any, state: bytes, *, num_workers: int, shard_index: int, shard_count: int, process_count: int
) -> None:
  """Moves ``iterator`` to a ``get_state`` of the same layout.

  Raises:
    ValueError: the state was written by another layout (process count,
      shards or ``num_workers``), by a state version this code does not
      read, or by an endless loader.
  """
  saved = json.loads(state, object_hook=_tuple_from_json)
  mine = {
    "num_workers": num_workers,
    "shard_count": shard_count,
    "shard_index": shard_index,
    "process_count": process_count,
  }
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
  iterator.set_state(grain_state)


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
