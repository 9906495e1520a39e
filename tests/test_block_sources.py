"""Block-read sources and the shuffle by blocks: Parquet, ``.jsonl.zst`` / ``.jsonl.gz``, ``datasets`` folders.

The order (``block_order.BlockOrder``) is a permutation of every epoch's
positions that visits each window once, keeping a compressed file's windows
in its order; every format gives the JSONL corpus's documents; loaders on
each format resume exactly, on the same or another number of data shards;
a Parquet corpus read shuffled reads each row group about once an epoch; a
compressed file's index is rebuilt when the file changes; bad inputs are one
named ValueError.
"""

from __future__ import annotations

import collections
import functools
import gzip
import json
import os
import pickle
import sys

import numpy as np
import pytest

import data_helpers
from distrib_train import data
from distrib_train.data import block_order
from distrib_train.data import compressed
from distrib_train.data import jsonl as jsonl_lib
from distrib_train.data import sources
from distrib_train.data import text_files

# A compressed reader's parse, as a source gives it (data.bad_records=error: a bad line raises).
_PARSE = functools.partial(jsonl_lib.json_document, bad_records=jsonl_lib.BadRecords("error"))

import test_data_resume as resume

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FORMATS = ("parquet", "zst", "gz", "datasets")


def _texts(jsonl):
  return [json.loads(line)["text"] for line in open(jsonl)]


def _as_format(jsonl, directory, kind, groups=3):
  """The documents of ``jsonl`` as another format (Parquet in ``groups`` row groups)."""
  texts = _texts(jsonl)
  lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
  if kind == "parquet":
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = directory / "documents.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=max(1, -(-len(texts) // groups)))
  elif kind == "zst":
    import zstandard

    path = directory / "documents.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(lines))
  elif kind == "gz":
    path = directory / "documents.jsonl.gz"
    path.write_bytes(gzip.compress(lines))
  else:
    import datasets

    path = directory / "documents_ds"
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))
  return str(path)


@pytest.fixture
def small_blocks(monkeypatch):
  """Compressed files of a few hundred bytes hold several blocks."""
  monkeypatch.setattr(compressed, "BLOCK_BYTES", 64)


# --- the order ---------------------------------------------------------------------


def _order(seed=0, sequential=(False, True, True, False, True), blocks_per_file=(3, 4, 1, 2, 5), share=0.75):
  starts, files, at = [0], [], 0
  rng = np.random.default_rng(7)
  for number, count in enumerate(blocks_per_file):
    for _ in range(count):
      at += int(rng.integers(1, 9))
      starts.append(at)
      files.append(number)
  indices = np.sort(rng.choice(at, size=int(at * share), replace=False))
  return block_order.BlockOrder(np.array(starts), np.array(files), np.array(sequential), indices, seed)


def test_the_block_order_is_a_permutation_of_each_epoch_that_visits_each_window_once():
  order = _order()
  window_of = np.repeat(np.arange(order.windows), order.sizes)
  for epoch in range(3):
    got = np.array([order.position(epoch * order.n + q) for q in range(order.n)])
    assert sorted(got) == list(range(order.n))
    visits = window_of[got]
    runs = visits[np.r_[True, visits[1:] != visits[:-1]]]  # each window is one run of the epoch
    assert sorted(runs) == list(range(order.windows))
    np.testing.assert_array_equal(runs, order.epoch_windows(epoch))
    for file in np.flatnonzero(order._file_sequential):
      own = runs[order.files[runs] == file]
      assert list(own) == sorted(own), "a sequential file's windows are read in its order"
  again = _order()
  assert [again.position(p) for p in range(0, 3 * order.n, 5)] == [order.position(p) for p in range(0, 3 * order.n, 5)]
  assert [order.position(p) for p in range(order.n)] != [order.position(order.n + p) for p in range(order.n)]
  assert [_order(seed=1).position(p) for p in range(order.n)] != [order.position(p) for p in range(order.n)]


def test_interleaved_sequential_files_are_read_a_few_at_a_time():
  order = _order(sequential=(True,) * 12, blocks_per_file=(3,) * 12, share=1.0)
  runs = order.epoch_windows(0)
  files = order.files[runs]
  groups = [set(files[i : i + 3 * block_order.INTERLEAVE]) for i in range(0, len(runs), 3 * block_order.INTERLEAVE)]
  assert all(len(g) <= block_order.INTERLEAVE for g in groups)


# --- every format: the same documents, exact resume -------------------------------


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_gives_the_jsonl_documents_each_epoch(tmp_path, kind, small_blocks):
  jsonl = data_helpers.write_documents(tmp_path, [5, 9, 14, 3, 27, 8, 8, 16, 40, 9, 11, 6, 18, 9, 9, 30] * 2)
  path = _as_format(jsonl, tmp_path, kind)
  docs = sources.Documents(data.DataConfig(source="text", paths=(path,), block_cache=2))
  indices = np.arange(len(docs))
  stream = block_order.shuffled(docs, indices, seed=4)
  if kind == "datasets":  # random access: grain's index shuffle, as JSONL
    assert stream is None
    return
  n, want = len(docs), collections.Counter(_texts(jsonl))
  for epoch in range(2):
    assert collections.Counter(stream[epoch * n + q] for q in range(n)) == want
  assert [stream[q] for q in range(n)] != _texts(jsonl)


@st.composite
def _layouts(draw):
  seq_len = draw(st.sampled_from([3, 7]))
  lengths = draw(st.lists(st.integers(1, 3 * (seq_len + 1)), min_size=12, max_size=30))
  lengths += [seq_len + 1] * (4 + sum(n <= seq_len for n in lengths))  # enough long ones without packing
  return dict(
    lengths=lengths,
    seq_len=seq_len,
    packing=draw(st.booleans()),
    seed=draw(st.integers(0, 2**16)),
    groups=draw(st.integers(1, 5)),
    block_cache=draw(st.integers(1, 3)),
  )


def _resumes_on_another_shard_count(config, shardings, batches, position):
  """Two data shards restored at a one-shard loader's ``position`` give the rows it gave."""
  for index in range(2):
    loader = resume._loader(config, shardings, (index, 2))
    loader.set_data_position(position)
    half = config.global_batch_size // 2
    for expected in batches:
      got = loader.next_local()
      for name in expected:
        np.testing.assert_array_equal(got[name], expected[name][index * half : (index + 1) * half], err_msg=name)
    loader.close()


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_resumes_exactly_on_any_shard_count(kind, tmp_path_factory, monkeypatch):
  monkeypatch.setattr(compressed, "BLOCK_BYTES", 96)
  shardings = resume._replicated_shardings()

  @settings(max_examples=4, deadline=None, database=None)
  @given(layout=_layouts())
  def check(layout):
    directory = tmp_path_factory.mktemp("corpus")
    jsonl = data_helpers.write_documents(directory, layout["lengths"], layout["seed"])
    path = _as_format(jsonl, directory, kind, layout["groups"])
    config = resume._config(
      path,
      seq_len=layout["seq_len"],
      global_batch_size=4,
      packing=layout["packing"],
      seed=layout["seed"],
      block_cache=layout["block_cache"],
    )
    states, batches = resume._run(config, shardings, steps=6)
    for step in (0, 2, 5):
      resume._assert_resumes_exactly(config, shardings, states, batches, step)
    loader = resume._loader(config, shardings)
    for _ in range(3):
      loader.next_local()
    position = loader.data_position()
    loader.close()
    _resumes_on_another_shard_count(config, shardings, batches[3:], position)

  check()


def test_a_finite_pass_reads_the_block_order_and_resumes(tmp_path):
  jsonl = data_helpers.write_documents(tmp_path, [5, 9, 14, 3, 27, 8, 8, 16, 40, 9, 11, 6] * 3)
  path = _as_format(jsonl, tmp_path, "parquet", groups=4)
  config, shardings = resume._config(path, seq_len=7, global_batch_size=4), resume._replicated_shardings()
  states, batches = resume._run(config, shardings, steps=5, num_epochs=2)
  for step in (0, 3):
    resume._assert_resumes_exactly(config, shardings, states, batches, step, num_epochs=2)
  docs = sources.Documents(config)
  stream = block_order.shuffled(docs, np.arange(len(docs)), config.seed)
  packed = "".join(stream[q] for q in range(len(docs))).encode()  # the first epoch, concatenated
  first_rows = bytes(
    np.concatenate([batches[0]["tokens"][:, :1], batches[0]["targets"]], axis=1).ravel().astype(np.uint8)
  )
  assert first_rows == packed[: len(first_rows)]


# --- reads ---------------------------------------------------------------------


def test_a_shuffled_parquet_corpus_reads_each_row_group_about_once_an_epoch(tmp_path, monkeypatch):
  # Row groups of 80 documents, 20 a lane: the lanes' spread (a few documents) stays within two windows.
  jsonl = data_helpers.write_documents(tmp_path, list(np.random.default_rng(0).integers(10, 30, size=400)))
  path = _as_format(jsonl, tmp_path, "parquet", groups=5)
  reads = collections.Counter()

  def counted(self, group, columns):
    reads[group] += 1
    return read_row_group(self, group, columns=columns)

  import pyarrow.parquet as pq

  read_row_group = pq.ParquetFile.read_row_group
  monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
  config = resume._config(path, seq_len=15, global_batch_size=4, block_cache=3)
  docs = sources.Documents(config)
  stream = block_order.shuffled(docs, np.arange(len(docs)), config.seed)
  from distrib_train.data import lanes as lanes_lib

  lanes = lanes_lib.Lanes(
    stream,
    lambda doc: np.frombuffer(doc.encode(), np.uint8),
    lanes=4,
    rows=range(4),
    length=16,
    packing=True,
    threads=2,
  )
  tokens = sum(len(t) for t in _texts(jsonl))
  for _ in range(tokens // (4 * 16) * 9 // 10):  # most of an epoch
    lanes.next_rows()
  lanes.close()
  assert len(reads) >= 4 and sum(reads.values()) <= 6, reads  # grain's index shuffle: a read a document


def test_a_compressed_file_reads_blocks_behind_its_decompressor_again(tmp_path, small_blocks):
  jsonl = data_helpers.write_documents(tmp_path, [30] * 40)
  for kind in ("zst", "gz"):
    reader = compressed.CompressedJsonl(_as_format(jsonl, tmp_path, kind), "text", _PARSE, block_order.BlockCache(1))
    assert len(reader.block_starts) > 5
    assert [reader[i] for i in range(40)] == _texts(jsonl)
    assert reader._stream is None and reader.restarts == 0  # its last block read: the decompressor closed
    order = [0, 39, 3, 2, 1]
    assert [reader[i] for i in order] == [_texts(jsonl)[i] for i in order]
    assert reader.restarts == 2  # block 2 after 3 and block 1 after 2, each from the file's start
    copy = pickle.loads(pickle.dumps(reader))  # as grain sends a finite pass's source to its workers
    assert len(pickle.dumps(reader)) < 1000 and [copy[i] for i in order] == [_texts(jsonl)[i] for i in order]
    reader.close()


def test_a_position_saved_in_grains_order_is_refused_for_a_corpus_shuffled_by_blocks(tmp_path):
  jsonl = data_helpers.write_documents(tmp_path, [5, 9, 14, 3, 27, 8, 8, 16] * 3)
  config = resume._config(_as_format(jsonl, tmp_path, "parquet"), seq_len=7, global_batch_size=4)
  loader = data.DataLoader(config, resume._replicated_shardings())
  position = loader.data_position()
  assert position["order"] == "blocks"
  loader.set_data_position(position)
  with pytest.raises(ValueError, match=r"another data layout \(data.order: None → 'blocks'\)"):
    loader.set_data_position({k: v for k, v in position.items() if k != "order"})  # the previous release's
  loader.close()


def test_a_stale_compressed_index_is_rebuilt(tmp_path):
  path = tmp_path / "docs.jsonl.gz"
  path.write_bytes(gzip.compress(b'{"text": "one"}\n\n{"text": "two"}\n'))
  first = compressed.CompressedJsonl(str(path), "text", _PARSE)
  assert [first[0], first[1]] == ["one", "two"] and list(first.lines) == [1, 3]
  path.write_bytes(gzip.compress(b'{"text": "three"}\n{"text": "four"}\n{"text": "five"}\n'))
  os.utime(path, ns=(os.stat(path).st_mtime_ns + 10**9,) * 2)
  again = compressed.CompressedJsonl(str(path), "text", _PARSE)
  assert len(again) == 3 and [again[i] for i in range(3)] == ["three", "four", "five"]


def test_compressed_files_and_datasets_folders_stream_to_the_converter(tmp_path):
  jsonl = data_helpers.write_documents(tmp_path, [5, 9, 14, 3])
  for kind in ("zst", "gz", "datasets"):
    assert list(text_files.iter_text_file(_as_format(jsonl, tmp_path, kind))) == _texts(jsonl)


# --- errors ------------------------------------------------------------------------


def test_missing_zstandard_is_one_clear_error(tmp_path, monkeypatch):
  jsonl = data_helpers.write_documents(tmp_path, [5, 9])
  path = _as_format(jsonl, tmp_path, "zst")
  monkeypatch.setitem(sys.modules, "zstandard", None)
  with pytest.raises(
    ValueError,
    match=r"zstd-compressed data \('.*documents.jsonl.zst'\) needs zstandard: pip install 'distrib_train\[text\]'",
  ):
    sources.Documents(data.DataConfig(source="text", paths=(path,)))


def _zstd(raw: bytes) -> bytes:
  import zstandard

  return zstandard.ZstdCompressor().compress(raw)


def test_bad_compressed_files_and_datasets_folders_are_named(tmp_path):
  for name, body in (
    ("bad.jsonl.zst", b"not zstd at all"),
    ("bad.jsonl.gz", b"not gzip at all"),
    ("empty.jsonl.zst", b""),
    ("cut.jsonl.gz", gzip.compress(b'{"text": "x"}\n' * 100)[:30]),
    # cut short inside its second frame (zstandard's stream reader took that for the end)
    ("cut.jsonl.zst", _zstd(b'{"text": "x"}\n' * 100) + _zstd(b'{"text": "y"}\n' * 5000)[:-20]),
  ):
    (tmp_path / name).write_bytes(body)
    with pytest.raises(ValueError, match=rf"Data file '.*{name}' is (empty|not a readable compressed stream)"):
      sources.Documents(data.DataConfig(source="text", paths=(str(tmp_path / name),)))
  for name, compress in (("body.jsonl.gz", gzip.compress), ("body.jsonl.zst", _zstd)):  # strict, as .jsonl is
    (tmp_path / name).write_bytes(compress(b'\n{"body": "x"}\n' * 50))
    with pytest.raises(ValueError, match=rf"Data file '.*{name}' line 2 has no string field 'text'"):
      sources.Documents(data.DataConfig(source="text", paths=(str(tmp_path / name),)))
  whole = tmp_path / "two_frames.jsonl.zst"  # the same two frames, whole: every document of both
  whole.write_bytes(_zstd(b'{"text": "x"}\n' * 100) + _zstd(b'{"text": "y"}\n' * 5000))
  docs = sources.Documents(data.DataConfig(source="text", paths=(str(whole),)))
  assert len(docs) == 5100 and docs[99] == "x" and docs[100] == docs[5099] == "y"
  jsonl = data_helpers.write_documents(tmp_path, [5, 9])
  folder = _as_format(jsonl, tmp_path, "datasets")
  with pytest.raises(ValueError, match=r"documents_ds' has no column 'body' \(data.text_field\); its columns: text"):
    sources.Documents(data.DataConfig(source="text", paths=(folder,), text_field="body"))
  import datasets

  numbers = str(tmp_path / "numbers")
  datasets.Dataset.from_dict({"text": [1, 2]}).save_to_disk(numbers)
  with pytest.raises(ValueError, match=r"numbers': column 'text' holds int64, not text"):
    sources.Documents(data.DataConfig(source="text", paths=(numbers,)))
  splits = str(tmp_path / "splits")
  datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(splits)
  with pytest.raises(ValueError, match=r"splits' is a datasets DatasetDict without a 'train' split; its splits: valid"):
    sources.Documents(data.DataConfig(source="text", paths=(splits,)))
  (tmp_path / "plain").mkdir()
  with pytest.raises(ValueError, match=r"plain': Is a directory, and not one written by datasets' save_to_disk"):
    sources.Documents(data.DataConfig(source="text", paths=(str(tmp_path / "plain"),)))
  with pytest.raises(ValueError, match="block_cache must be a positive integer"):
    data.DataConfig(block_cache=0)


def test_a_datasetdict_folder_reads_its_train_split(tmp_path):
  import datasets

  folder = str(tmp_path / "dict")
  datasets.DatasetDict(
    {
      "train": datasets.Dataset.from_dict({"text": ["a", "b", "c"]}),
      "test": datasets.Dataset.from_dict({"text": ["z"]}),
    }
  ).save_to_disk(folder)
  docs = sources.Documents(data.DataConfig(source="text", paths=(folder,)))
  assert [docs[i] for i in range(len(docs))] == ["a", "b", "c"] and docs.blocks() is None
