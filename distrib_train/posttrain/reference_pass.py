"""DPO's reference precomputed (``dpo.precompute_reference: true``): one pass over the data, kept beside it.

``path_for(config)`` names the file the reference's figures are kept in:
beside the first data file (``.<name>.dporef-<key>.bin``) where its folder is
writable and no ``data.index_cache_dir`` is given, else in that cache
directory (``data/index_cache.py``'s). ``<key>`` is a hash of everything the
figures depend on: the data files (path, size, times and edges), the record
reader, tokenizer, template, row length and cut policy, the model's config
and the reference's weights (``dpo.reference`` or ``train.init_from``: its
files' sizes and times, or the seed of a random start); files by their sizes
and times (data files also by their edges). A run whose key
matches an existing file reads it; a changed corpus or reference gets a new
one, never a stale one.

``ensure(config, job, plan, …)`` computes the file where it is missing,
before the run's loaders exist: a state of the plan's layout with the
reference's weights (LoRA's adapters off), every record of the corpus (both
splits) as two sequences — its chosen and its rejected one, tokenized and cut
as the loaders cut them — packed whole into rows as the trainer packs them,
and each sequence's summed log-probability of its scored targets. Process 0 decides whether the pass runs; every process runs it (its
steps are global) and writes the file (a temporary name, renamed). The file
holds a 64-bit hash of each record's text and its two sums; the pair tokenizer
(``data/preference.py``) puts them on the batch as ``reference_logps`` and
the objective reads them instead of running the reference
(``objectives/dpo.py``): no reference in memory, no reference forward.

Not for: the objective (``objectives/dpo.py``), the pairs' rows
(``data/preference.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from typing import Any

import numpy as np

KIND = "dporef"


def _stats(path: str) -> Any:
  """A file's or a folder's files' names, sizes and modification times (what a changed file changes)."""
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.isfile(path):
    stat = os.stat(path)
    return [path, stat.st_size, stat.st_mtime_ns]
  files = []
  for root, _, names in sorted(os.walk(path)):
    for name in sorted(names):
      stat = os.stat(os.path.join(root, name))
      files.append((os.path.relpath(os.path.join(root, name), path), stat.st_size, stat.st_mtime_ns))
  return [path, files]


def _source_key(source: str) -> Any:
  """``hf:<dir>`` or ``ckpt:<dir>``: the kind and its files' stats; empty: the seed's random start."""
  kind, _, path = source.partition(":")
  return [kind, _stats(path)] if path and os.path.exists(os.path.expanduser(path)) else source


def path_for(config: Any) -> str:
  """The file that keeps ``config``'s reference figures (the module docstring says where and keyed by what)."""
  from distrib_train.data import index_cache, text_files

  data = config.data
  files = text_files.expand(data.paths) if data.source == "text" else []
  tokenizer = str(data.tokenizer)
  key = {
    "version": 1,
    "source": data.source,
    "text_field": data.text_field,
    "tokenizer": data.tokenizer_name(),
    "files": [index_cache.file_key(p, KIND) if os.path.isfile(p) else _stats(p) for p in files],
    # the tokenizer's folder: its tokenizer_config.json or chat_template.jinja holds the template
    "tokenizer_files": _stats(os.path.dirname(os.path.expanduser(tokenizer[3:])))
    if tokenizer.startswith("hf:")
    else None,
    "chat_template": _stats(data.chat_template) if data.chat_template else "",
    "seq_len": data.seq_len,
    "long": data.long_conversations,
    "model": repr(config.model_recipe().config),
    "reference": _source_key(config.dpo.reference or config.train.init_from),
    "seed": config.train.seed,
  }
  digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
  first = os.path.abspath(files[0]) if files else ""
  if first and not data.index_cache_dir and os.access(os.path.dirname(first), os.W_OK):
    folder, name = os.path.split(first)
    return os.path.join(folder, f".{name}.{KIND}-{digest}.bin")
  return os.path.join(data.index_cache_dir or index_cache.default_cache_dir(), f"{data.source}.{KIND}-{digest}.bin")


def ensure(config: Any, job: Any, plan: Any, rules: Any, load: Any, data: Any, log=None) -> str:
  """The kept file of ``config``'s reference figures, computed first where it is missing (every process);
  ``load(config, abstract, state)`` puts ``config``'s ``train.init_from`` weights in a state
  (``init_from.load``); ``data`` is the run's data config (its rows' cap)."""
  import jax
  from jax.experimental import multihost_utils

  from distrib_train.data.preference import write_reference

  path = path_for(config)
  # Process 0 decides for all: a pass is collective, and a file another job writes meanwhile must not split them.
  if bool(multihost_utils.broadcast_one_to_all(np.int32(os.path.exists(path)))):
    return path
  started = time.perf_counter()
  hashes, sums = _pass(config, job, plan, rules, load, data)
  # Every process holds the figures and writes them (a temporary name of its own, renamed): the same file on a
  # shared file system, each host's own where the cache directory is local.
  os.makedirs(os.path.dirname(path), exist_ok=True)
  partial = f"{path}.{jax.process_index()}-{os.getpid()}-{os.urandom(4).hex()}.partial"
  write_reference(partial, hashes, sums[:, 0], sums[:, 1])
  os.replace(partial, path)
  (log or (lambda line: print(line, file=sys.stderr, flush=True)))(
    f"Precomputed the DPO reference for {len(hashes)} pairs in {time.perf_counter() - started:.1f} s: {path}"
  )
  return path


def _pass(config: Any, job: Any, plan: Any, rules: Any, load: Any, data: Any) -> tuple[np.ndarray, np.ndarray]:
  """Each record's hash and its chosen and rejected sequences' summed reference log-probabilities."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  from distrib_train.data import sources
  from distrib_train.data.preference import PairTokenizer, record_hash
  from distrib_train.sharding.axis_rules import activation_sharding

  data = dataclasses.replace(data, reference_logps="")
  docs, tokenize = sources.Documents(data), PairTokenizer(data)
  state = plan.init(job.make_state)
  source = config.dpo.reference or config.train.init_from
  if source.startswith("ckpt:"):  # a run's model (a DPO run's policy), as the live reference reads it
    from distrib_train.weights import init_from

    state = init_from.read_run_weights(source[5:], plan.abstract_train_state, state)
  elif source:  # the reference's weights: dpo.reference, else the starting model's
    reference = dataclasses.replace(config, train=dataclasses.replace(config.train, init_from=source))
    state, _ = load(reference, plan.abstract_train_state, state)
  hashes, sequences = [], []
  for i in range(len(docs)):
    doc = docs[i]
    if doc is None:  # a malformed record, skipped as the loaders skip it
      continue
    tokens = tokenize(doc)
    if not len(tokens):  # left out (data.long_conversations: drop)
      continue
    rejected = (tokens["loss"] & 2) > 0
    hashes.append(record_hash(doc))
    sequences += [tokens[~rejected], tokens[rejected]]
  rows, length = data.global_batch_size, data.seq_len + 1
  # Rows packed as the trainer packs them: whole sequences while the next fits, each its own segment, at most as
  # many as the model's packed attention takes (data.max_documents_per_row, two a pair).
  cap = data.max_segments_per_row or length
  packed, where = _packed(sequences, length, cap)
  sharding = plan.input_kwarg_shardings["tokens"]
  step = jax.jit(
    functools.partial(_sums, count=cap + 1),
    in_shardings=(plan.train_state_shardings, sharding, sharding, sharding, sharding, sharding),
    out_shardings=NamedSharding(plan.mesh, PartitionSpec()),
  )
  place = lambda a: jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])
  per_row = np.zeros((len(packed["tokens"]), cap + 1), np.float64)
  with activation_sharding(plan.mesh, rules):
    for start in range(0, len(per_row), rows):
      part = {k: _rows(v[start : start + rows], rows) for k, v in packed.items()}
      found = step(state, *(place(part[k]) for k in ("tokens", "targets", "segment_ids", "positions", "weights")))
      per_row[start : start + rows] = np.asarray(found.addressable_data(0))[: len(per_row) - start]
  sums = per_row[where[:, 0], where[:, 1]]
  return np.asarray(hashes, np.uint64), sums.reshape(-1, 2).astype(np.float32)


def _packed(sequences: list[np.ndarray], length: int, cap: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """Rows of whole sequences (``sequences.shifted``'s layout: inputs, targets, segment ids from 1, positions, the
  scored targets' weights) and each sequence's (row, segment)."""
  from distrib_train.data import sequences as sequences_lib

  rows, where, current, used = [], [], [], 0
  for seq in sequences:
    if current and (used + len(seq) > length or len(current) == cap):
      rows.append(current)
      current, used = [], 0
    where.append((len(rows), len(current) + 1))
    current.append(seq)
    used += len(seq)
  if current:
    rows.append(current)
  out = []
  for row in rows:
    ids, loss = (np.zeros(length, np.int32) for _ in range(2))
    segments, positions = np.zeros(length, np.int32), np.zeros(length, np.int32)
    at = 0
    for k, seq in enumerate(row, start=1):
      n = len(seq)
      ids[at : at + n], loss[at : at + n] = seq["ids"], seq["loss"] & 1
      segments[at : at + n], positions[at : at + n] = k, np.arange(n)
      at += n
    out.append(
      sequences_lib.shifted(
        {"tokens": ids, "tokens_segment_ids": segments, "tokens_positions": positions, "tokens_loss": loss}
      )
    )
  return {k: np.stack([r[k] for r in out]) for k in out[0]}, np.asarray(where, np.int64)


def _rows(values: np.ndarray, rows: int) -> np.ndarray:
  """``values`` padded with empty rows to a batch of ``rows``."""
  return np.concatenate([values, np.zeros((rows - len(values), *values.shape[1:]), values.dtype)])


def _sums(state: Any, tokens: Any, targets: Any, segment_ids: Any, positions: Any, weights: Any, *, count: int) -> Any:
  """Each row's segments' summed log-probabilities of their scored targets under the reference (the model, LoRA's
  adapters off) [rows, count]; on a context mesh in its load-balanced order, as the objective takes them."""
  import jax
  import jax.numpy as jnp

  from distrib_train.sharding import context
  from distrib_train.objectives import dpo as objectives

  tokens, rest = context.reorder(tokens, targets=targets, segment_ids=segment_ids, positions=positions, weights=weights)
  logps, _ = objectives.token_logprobs(objectives.policy_of(state.model), tokens, rest, adapters=False)
  scored = jnp.where(rest["weights"] > 0, logps, 0.0)
  return jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=count))(scored, rest["segment_ids"])
