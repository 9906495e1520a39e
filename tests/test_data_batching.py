"""Batched reading: lanes read and tokenize many documents per call and cut rows with numpy, yet give the rows and
positions of packing one document at a time; ``convert`` splits a ``.jsonl`` file over workers in byte ranges and
writes the same shards."""

from __future__ import annotations

import json

import grain
import numpy as np
import pytest

from distrib_train import data
from distrib_train.data import convert_workers
from distrib_train.data import lanes as lanes_lib
from distrib_train.data import record_shards
from distrib_train.data import splits


def _one_at_a_time(stream, tokenize, lane, lanes, length, packing, position):
  """The rows of one lane as packing reads them document by document (the reference), and the position after."""
  index, used = position
  doc = lambda i: np.asarray(tokenize(stream[i * lanes + lane]))
  if not packing:
    while len(tokens := doc(index)) < length:
      index += 1
    return tokens[:length].tolist(), None, None, (index + 1, 0)
  tokens, segments, positions, segment = [], [], [], 0
  while len(tokens) < length:
    ids = doc(index)
    take = min(len(ids) - used, length - len(tokens))
    if take > 0:
      segment += 1
      tokens += ids[used : used + take].tolist()
      segments += [segment] * take
      positions += list(range(take))
      used += take
    if used >= len(ids):
      index, used = index + 1, 0
  return tokens, segments, positions, (index, used)


class _Stream:
  """Documents of 0 to 90 tokens, some skipped (None), some text; counts the reads."""

  def __getitem__(self, i):
    rng = np.random.default_rng(i)
    if i % 11 == 5:
      return None
    if i % 7 == 3:
      return "text " * int(rng.integers(0, 12))
    return rng.integers(0, 500, size=int(rng.integers(0, 90)), dtype=np.int32)


@pytest.mark.parametrize("packing", [True, False])
def test_lanes_read_in_batches_give_the_rows_and_positions_of_one_document_at_a_time(packing):
  tokenize = splits.DocumentTokenizer(data.DataConfig())
  calls = []

  class Counting:
    __call__ = staticmethod(tokenize)
    batch = staticmethod(lambda docs: calls.append(len(docs)) or tokenize.batch(docs))

  counting = Counting()
  stream, rows, length = _Stream(), [1, 2, 3, 5], 33
  lanes = lanes_lib.Lanes(stream, counting, lanes=6, rows=rows, length=length, packing=packing, threads=2)
  position = {r: (0, 0) for r in rows}
  for step in range(12):
    if step == 7:  # a restore mid-document drops what was read ahead
      position = {r: (position[r][0] + 1, 3 if packing else 0) for r in rows}
      lanes.restore(position)
    got, after = lanes.next_rows()
    for lane, row in zip(rows, got):
      tokens, segments, positions, position[lane] = _one_at_a_time(
        stream, tokenize, lane, 6, length, packing, position[lane]
      )
      assert row["tokens"].tolist() == tokens and row["tokens"].dtype == np.int32
      if packing:
        assert row["tokens_segment_ids"].tolist() == segments and row["tokens_positions"].tolist() == positions
    assert after == position
  assert max(calls) > 1 and len(calls) < sum(calls)  # documents were tokenized several to a call
  lanes.close()


def test_the_document_tokenizer_batches_texts_passes_ids_through_and_gives_none_no_ids():
  for config in (data.DataConfig(), data.DataConfig(tokenizer=lambda text: [len(text), 7])):
    tokenize = splits.DocumentTokenizer(config)
    docs = ["héllo", np.arange(3, dtype=np.int32), None, "", "world"]
    got = tokenize.batch(docs)
    assert [g.tolist() for g in got] == [tokenize(d).tolist() for d in docs]
    assert got[2].dtype == np.int32 and len(got[2]) == 0 and got[1] is docs[1]


def test_convert_splits_a_jsonl_file_over_workers_in_byte_ranges_and_writes_the_same_shards(tmp_path, monkeypatch):
  corpus = tmp_path / "c.jsonl"
  lines = [json.dumps({"text": f"document {i} " + "word " * (i % 37)}) for i in range(600)]
  corpus.write_text("\n".join(lines[:300]) + "\n\n" + "\n".join(lines[300:]) + "\n")
  monkeypatch.setattr(convert_workers, "_RANGE", 2000)  # about ten ranges, lines cut across their edges
  assert len(convert_workers.ranges([str(corpus)])) > 5
  read = lambda prefix: [
    bytes(r)
    for r in grain.sources.ArrayRecordDataSource(sorted(str(p) for p in tmp_path.glob(f"{prefix}-*.array_record")))
  ]
  for workers in (0, 2):
    record_shards.convert([str(corpus)], str(tmp_path / f"w{workers}"), num_shards=3, workers=workers)
  assert read("w0") == read("w2") and len(read("w2")) == 600
  assert sorted(r.decode() for r in read("w2")) == sorted(json.loads(line)["text"] for line in lines)
  corpus.write_text("\n".join(lines[:450]) + "\n{not json\n" + "\n".join(lines[450:]) + "\n")
  with pytest.raises(ValueError, match=r"c.jsonl' line 451 is not JSON"):
    record_shards.convert([str(corpus)], str(tmp_path / "bad"), workers=2, bad_records="error")
  record_shards.convert([str(corpus)], str(tmp_path / "skipped"), num_shards=3, workers=2)  # the default: skip
  assert read("skipped") == read("w2")
