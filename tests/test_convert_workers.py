"""``convert --workers N``: the worker processes write the same shards, record for record, as one process."""

from __future__ import annotations

import gzip
import json

import pytest
from array_record.python import array_record_module

from distrib_train.data import convert_workers
from distrib_train.data import record_shards
from distrib_train.data import tokenizer as tokenizer_lib


def _shards(paths):
  """Each shard's records, read back."""
  found = []
  for path in paths:
    reader = array_record_module.ArrayRecordReader(path)
    found.append(reader.read_all() if reader.num_records() else [])
    reader.close()
  return found


def _corpus(tmp_path, bad_at=()):
  """A .jsonl file of 700 documents (blank lines among them, malformed lines at ``bad_at``), a .jsonl.gz
  (read whole) and a .txt (one document)."""
  lines = [json.dumps({"text": f"document {i} é " + "word " * (i % 41)}) for i in range(700)]
  for at in bad_at:
    lines[at] = "{not json"
  (tmp_path / "a.jsonl").write_text("\n".join(lines[:300]) + "\n\n  \n" + "\n".join(lines[300:]) + "\n")
  with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
    f.write("".join(json.dumps({"text": f"zipped {i} " + "x" * i}) + "\n" for i in range(120)))
  (tmp_path / "c.txt").write_text("one whole file")
  return [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz"), str(tmp_path / "c.txt")]


@pytest.fixture
def small_tasks(monkeypatch):
  monkeypatch.setattr(convert_workers, "_RANGE", 3000)  # the .jsonl in about 20 ranges, lines cut at their edges
  monkeypatch.setattr(convert_workers, "_CHUNK", 2000)  # and every task's records back in several chunks


def test_workers_write_each_shard_byte_for_byte_as_one_process(tmp_path, small_tasks):
  inputs = _corpus(tmp_path, bad_at=(450,))  # skipped (the default), in every process alike
  assert len(convert_workers.ranges(inputs)) > 15
  written = {w: record_shards.convert(inputs, str(tmp_path / f"w{w}" / "c"), num_shards=3, workers=w) for w in (0, 2)}
  one, two = _shards(written[0]), _shards(written[2])
  assert one == two and [len(s) for s in one] == [274, 273, 273]
  assert sorted(r.decode() for s in two for r in s)[:2] == ["document 0 é ", "document 1 é word "]
  bpe = tokenizer_lib.load("bytes")  # token ids, in 3 workers for 2 shards (one worker writes none)
  tokens = {
    w: record_shards.convert(inputs, str(tmp_path / f"t{w}" / "c"), num_shards=2, workers=w, tokenizer=bpe)
    for w in (0, 3)
  }
  assert [p.rsplit("/", 1)[1] for p in tokens[3]] == [
    "c-00000-of-00002.array_record",
    "c-00001-of-00002.array_record",
    "c.tokenizer.json",
  ]
  assert _shards(tokens[0][:2]) == _shards(tokens[3][:2]) and sum(map(len, _shards(tokens[3][:2]))) == 820


def test_a_failing_worker_names_the_first_bad_line_and_leaves_no_shards(tmp_path, small_tasks):
  inputs = _corpus(tmp_path, bad_at=(450, 620))
  with pytest.raises(ValueError, match=r"a.jsonl' line 453 is not JSON"):  # two blank lines before it
    record_shards.convert(inputs, str(tmp_path / "out" / "c"), num_shards=2, workers=2, bad_records="error")
  assert list((tmp_path / "out").iterdir()) == []
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(ValueError, match="No documents to write"):
    record_shards.convert([str(tmp_path / "empty.jsonl")], str(tmp_path / "none" / "c"), workers=2)
  assert list((tmp_path / "none").iterdir()) == []
