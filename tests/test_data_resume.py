"""Exact data resume: a restored loader continues bit for bit where it stopped.

A loader's ``get_state()`` is written as JSON text and handed back to
``set_state()`` (grain's handler; ``CheckpointManager`` keeps an endless
loader's every-lane ``data_position()`` instead, ``test_data.py``). Finite
passes read through grain, whose state the grain-state tests use. Whatever step it was taken at —
step 0, before any batch, or a step where a document ends exactly at a packed
row's end — the restored loader yields the same batches as one that never
stopped: with and without packing, for every data shard of a job.

Several data shards (the rows each process of a multi-process job feeds) are
played in this one process by fixing ``data_shard``'s answer.
"""

from __future__ import annotations

import contextlib
import json
from unittest import mock

import numpy as np
import optax
import pytest

import data_helpers
import distrib_train as dt
from distrib_train import data
from distrib_train.data import finite
from distrib_train.data import pipeline

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _mesh():
  return dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (2, 2, 2)))


def _config(corpus, **kwargs):
  return data.DataConfig(source="text", paths=(corpus,), eval_fraction=0.0, num_threads=1, **kwargs)


@contextlib.contextmanager
def _as_data_shard(index, count):
  """Loaders built inside read data shard ``index`` of ``count``, as process
  ``index`` of a ``count``-process job whose batch axis spans the processes."""
  with mock.patch.object(pipeline, "data_shard", lambda sharding, batch_size: (index, count)):
    yield


def _loader(config, shardings, shard=(0, 1), num_epochs=None):
  """An endless loader reads lanes; a finite pass (``num_epochs``) reads through grain, whose state it keeps."""
  with _as_data_shard(*shard):
    return data.DataLoader(config, shardings, num_epochs=num_epochs)


def _run(config, shardings, steps, shard=(0, 1), num_epochs=None):
  """The uninterrupted run: the state after each of 0..steps batches, and the batches."""
  loader = _loader(config, shardings, shard, num_epochs)
  states, batches = [loader.get_state()], []
  for _ in range(steps):
    batches.append(loader.next_local())
    states.append(loader.get_state())
  loader.close()
  return states, batches


def _through_the_checkpoint_file(state: bytes) -> bytes:
  # What grain's CheckpointHandler does with a loader's state: text out, text in.
  return state.decode().encode()


def _assert_resumes_exactly(config, shardings, states, batches, step, shard=(0, 1), num_epochs=None):
  restored = _loader(config, shardings, shard, num_epochs)
  restored.set_state(_through_the_checkpoint_file(states[step]))
  for expected in batches[step:]:
    got = restored.next_local()
    assert sorted(got) == sorted(expected)
    for name in expected:
      np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{name} after resuming at step {step}")
  restored.close()


def _last_row_starts_a_document(batch):
  """Whether the batch's last row starts with a document's first token (a
  capital, see ``write_documents``): a document ended exactly at the end of
  the row before. grain's state after a batch records its last row as of
  where that row began — here with no partial document pending, the state a
  plain JSON round trip used to break."""
  return chr(batch["tokens"][-1, 0]).isupper()


# --- the two reported cases ------------------------------------------------------


def test_the_state_at_step_zero_resumes_at_the_first_batch(tmp_path):
  corpus = data_helpers.write_documents(tmp_path, [5, 11, 8, 3, 17, 8, 2, 6] * 4)
  config, shardings = _config(corpus, seq_len=7, global_batch_size=8), data_helpers.shardings(_mesh())
  states, batches = _run(config, shardings, steps=4)
  _assert_resumes_exactly(config, shardings, states, batches, step=0)


def test_a_state_where_a_document_ends_at_a_row_end_resumes_at_the_next_document(tmp_path):
  # seq_len 7: rows of 8 tokens, and every document is one row.
  corpus = data_helpers.write_documents(tmp_path, [8] * 40)
  config, shardings = _config(corpus, seq_len=7, global_batch_size=8), data_helpers.shardings(_mesh())
  states, batches = _run(config, shardings, steps=5)
  assert all(_last_row_starts_a_document(b) for b in batches)
  for step in range(1, 5):
    _assert_resumes_exactly(config, shardings, states, batches, step)


def test_the_state_text_gives_back_grains_state_exactly(tmp_path):
  # Tuples stay tuples and lists stay lists: grain compares some of its
  # tuples ((-1, -1): "no partial document") and assigns into its lists.
  corpus = data_helpers.write_documents(tmp_path, [8, 16, 5, 3, 8] * 4)
  loader = _loader(_config(corpus, seq_len=7, global_batch_size=8), data_helpers.shardings(_mesh()), num_epochs=50)
  for _ in range(4):
    grain_state = loader._iterator.get_state()
    restored = json.loads(loader.get_state(), object_hook=finite._tuple_from_json)["grain"]
    assert _typed(restored) == _typed(grain_state)
    loader.next_local()
  loader.close()
  nested = {"a": (1, [2, (3, "x")], {"b": ()}), "c": [[], (None,)]}
  assert _typed(json.loads(json.dumps(finite._state_to_json(nested)), object_hook=finite._tuple_from_json)) == _typed(
    nested
  )


def _typed(value):
  """A value's structure with its container types spelled out (``(1,) != [1]``)."""
  if isinstance(value, (list, tuple)):
    return (type(value).__name__, [_typed(v) for v in value])
  if isinstance(value, dict):
    return ("dict", {k: _typed(v) for k, v in value.items()})
  return value


def _as_version_1(state: bytes) -> bytes:
  """A state as version 1 wrote it: grain's state through plain JSON."""

  def untag(value):
    if isinstance(value, dict):
      if set(value) == {"__tuple__"}:
        return [untag(v) for v in value["__tuple__"]]
      return {k: untag(v) for k, v in value.items()}
    if isinstance(value, list):
      return [untag(v) for v in value]
    return value

  saved = untag(json.loads(state))
  saved["version"] = 1
  return json.dumps(saved).encode()


def test_states_written_by_version_1_resume_exactly(tmp_path):
  corpus = data_helpers.write_documents(tmp_path, [8, 16, 8, 5, 11, 8] * 6)
  config, shardings = _config(corpus, seq_len=7, global_batch_size=8), data_helpers.shardings(_mesh())
  states, batches = _run(config, shardings, steps=4, num_epochs=50)
  old = [_as_version_1(s) for s in states]
  assert b"__tuple__" not in old[0] and json.loads(old[0])["version"] == 1
  for step in range(4):
    _assert_resumes_exactly(config, shardings, old, batches, step, num_epochs=50)


# --- the property: every step, every shard, packed or not -----------------------


@st.composite
def _layouts(draw):
  """A corpus and batch shape where documents often end exactly at row ends."""
  seq_len = draw(st.sampled_from([3, 4, 7, 8]))
  row = seq_len + 1
  whole_rows = st.integers(1, 3).map(lambda k: k * row)  # ends at a row end when it starts at one
  any_length = st.integers(1, 3 * row)
  lengths = draw(st.lists(st.one_of(whole_rows, whole_rows, any_length), min_size=6, max_size=24))
  # Unpacked sequences skip documents shorter than a row: with more long
  # documents than short ones, each of two shards holds some.
  lengths += [row, 2 * row] + [row] * sum(n < row for n in lengths)
  shard_count = draw(st.sampled_from([1, 2]))
  local_batch_size = draw(st.integers(1, 3))
  return dict(
    lengths=lengths,
    seq_len=seq_len,
    global_batch_size=local_batch_size * shard_count,
    shard_count=shard_count,
    packing=draw(st.booleans()),
    seed=draw(st.integers(0, 2**16)),
  )


# Batch axes of size 1: every global and per-shard batch size places.
def _replicated_shardings():
  return data_helpers.shardings(dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (1, 1, 8))))


@settings(max_examples=25, deadline=None, database=None)
@given(layout=_layouts())
def test_every_saved_state_resumes_bit_for_bit(layout, tmp_path_factory):
  corpus = data_helpers.write_documents(tmp_path_factory.mktemp("corpus"), layout["lengths"], layout["seed"])
  config = _config(
    corpus,
    seq_len=layout["seq_len"],
    global_batch_size=layout["global_batch_size"],
    packing=layout["packing"],
    seed=layout["seed"],
  )
  shardings = _replicated_shardings()
  steps = 8
  for index in range(layout["shard_count"]):
    shard = (index, layout["shard_count"])
    states, batches = _run(config, shardings, steps, shard)
    for step in range(steps):
      _assert_resumes_exactly(config, shardings, states, batches[: step + 3], step, shard)


# --- through a real checkpoint ---------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_a_checkpoint_at_step_zero_or_at_a_document_end_resumes_exactly(tmp_path, workers):
  corpus = data_helpers.write_documents(tmp_path, [8, 16, 5, 11, 8, 24, 3, 13] * 4)
  shardings = data_helpers.shardings(_mesh())
  # The batches are the same for every worker count.
  _, expected = _run(_config(corpus, seq_len=7, global_batch_size=8), shardings, steps=9)
  boundaries = [step for step in range(1, 7) if _last_row_starts_a_document(expected[step - 1])]
  assert boundaries, "the corpus must end a document exactly at a row's end within the first batches"
  boundary = boundaries[0]
  config = _config(corpus, seq_len=7, global_batch_size=8, num_workers=workers)
  train_state = dt.TrainState.create(apply_fn=None, params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1))
  loader = data.DataLoader(config, shardings)
  with dt.CheckpointManager(tmp_path / "ckpt", max_to_keep=None) as checkpoints:
    checkpoints.save(0, train_state, data_iterator=loader)
    for _ in range(boundary):
      loader.next_local()
    checkpoints.save(boundary, train_state, data_iterator=loader)
  loader.close()
  for step in (0, boundary):
    fresh = data.DataLoader(config, shardings)
    with dt.CheckpointManager(tmp_path / "ckpt") as checkpoints:
      checkpoints.restore(train_state, step=step, data_iterator=fresh)
    for want in expected[step : step + 3]:
      got = fresh.next_local()
      for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} after restoring step {step}")
    fresh.close()


# --- every source: JSONL under another field, Parquet ---------------------------------


def _as_other_sources(jsonl, directory):
  """The same documents as JSONL under the field "body", and as Parquet (3 row groups) column "body"."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  texts = [json.loads(line)["text"] for line in open(jsonl)]
  other = directory / "body.jsonl"
  other.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts)))
  parquet = directory / "documents.parquet"
  pq.write_table(
    pa.table({"id": list(range(len(texts))), "body": texts}), parquet, row_group_size=max(1, len(texts) // 3)
  )
  return str(other), str(parquet)


@pytest.mark.parametrize("packing", [True, False])
def test_jsonl_under_another_field_gives_the_same_batches_and_both_resume_exactly(tmp_path, packing):
  lengths = [5, 9, 14, 3, 27, 8, 8, 16, 40, 9, 11, 6, 18, 9, 9, 30, 12, 7]
  jsonl = data_helpers.write_documents(tmp_path, lengths, seed=3)
  other, parquet = _as_other_sources(jsonl, tmp_path)
  shardings = _replicated_shardings()
  kwargs = dict(seq_len=8, global_batch_size=2, packing=packing, seed=3)
  _, want = _run(_config(jsonl, **kwargs), shardings, 6)
  for path in (other, parquet):
    config = _config(path, text_field="body", **kwargs)
    states, batches = _run(config, shardings, 6)
    # Parquet is shuffled by its row groups instead (block_order.py; tests/test_block_sources.py).
    for got, expected in zip(batches if path == other else [], want):
      for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{path}: {name}")
    for step in (0, 2, 5):
      _assert_resumes_exactly(config, shardings, states, batches, step)


def test_a_missing_field_or_column_is_named(tmp_path):
  jsonl = data_helpers.write_documents(tmp_path, [5, 6, 7])
  other, parquet = _as_other_sources(jsonl, tmp_path)
  shardings = _replicated_shardings()
  with pytest.raises(ValueError, match=r"body.jsonl' line 1 has no string field 'text' \(data.text_field\)"):
    data.DataLoader(_config(other, seq_len=4, global_batch_size=1), shardings)
  with pytest.raises(ValueError, match=r"documents.parquet' has no column 'text' \(data.text_field\); its columns: id"):
    data.DataLoader(_config(parquet, seq_len=4, global_batch_size=1), shardings)


def test_txt_files_and_pretokenized_shards_resume_exactly(tmp_path):
  lengths = [5, 9, 14, 3, 27, 8, 8, 16, 40, 9, 11, 6, 18, 9, 9, 30, 12, 7]
  jsonl = data_helpers.write_documents(tmp_path, lengths, seed=5)
  texts = [json.loads(line)["text"] for line in open(jsonl)]
  (tmp_path / "txt").mkdir()
  for i, text in enumerate(texts):  # one document per .txt file
    (tmp_path / "txt" / f"{i:03d}.txt").write_text(text)
  from distrib_train.data import record_shards
  from distrib_train.data import tokenizer as tokenizer_lib

  shards = record_shards.convert(
    [jsonl], str(tmp_path / "tok" / "c"), num_shards=2, tokenizer=tokenizer_lib.load("bytes")
  )
  shardings = _replicated_shardings()
  for paths in (str(tmp_path / "txt" / "*.txt"), str(tmp_path / "tok" / "c-*.array_record")):
    config = _config(paths, seq_len=8, global_batch_size=2, seed=5)
    states, batches = _run(config, shardings, 6)
    assert len(shards) == 3 and batches[0]["tokens"].max() < 256
    for step in (0, 3, 5):
      _assert_resumes_exactly(config, shardings, states, batches, step)
