"""The grain input pipeline: determinism, sharding, global arrays, resume, errors."""

import json
import os
import pathlib
import time

import numpy as np
import optax
import pytest

import data_helpers
import distrib_train as dt
import mp_harness
from distrib_train import data

WORKERS = pathlib.Path(__file__).parent / "workers"


def _mesh(shape=(2, 2, 2)):
  return dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), shape))


def _batches(loader, n):
  return [{k: np.asarray(v) for k, v in loader.next_local().items()} for _ in range(n)]


def test_packed_batches_have_inputs_targets_segments_and_weights():
  loader = data.DataLoader(data.DataConfig(seq_len=64, global_batch_size=16), data_helpers.shardings(_mesh()))
  batch = next(loader)
  assert set(batch) == set(data_helpers.INPUTS)
  for name, array in batch.items():
    assert array.shape == (16, 64) and array.sharding == loader.input_shardings[name]
  local = loader.next_local()
  np.testing.assert_array_equal(local["tokens"][:, 1:], local["targets"][:, :-1])
  same_doc = local["segment_ids"][:, 1:] == local["segment_ids"][:, :-1]
  np.testing.assert_array_equal(local["weights"][:, :-1] > 0, same_doc & (local["segment_ids"][:, :-1] > 0))
  text = bytes(local["tokens"][0].astype(np.uint8)).decode("utf-8", errors="replace")
  assert sum(c.isalpha() or c.isspace() for c in text) > 0.7 * len(text)  # real English text


def test_global_array_content_matches_the_local_rows():
  loader = data.DataLoader(data.DataConfig(seq_len=32, global_batch_size=8), data_helpers.shardings(_mesh()))
  local = loader.next_local()
  batch = data.to_global(local, loader.input_shardings, 8)
  for name in local:
    np.testing.assert_array_equal(np.asarray(batch[name]), local[name])


def test_same_seed_same_batches_across_runs_and_worker_counts():
  """Training batches are read in lanes, eval passes by grain workers; neither depends on the worker count."""
  shardings = data_helpers.shardings(_mesh())
  runs = []
  for workers in (0, 0, 2):
    loader = data.DataLoader(data.DataConfig(seq_len=32, global_batch_size=8, num_workers=workers), shardings)
    runs.append(_batches(loader, 4))
    loader.close()
  for run in runs[1:]:
    for a, b in zip(run, runs[0]):
      for name in a:
        np.testing.assert_array_equal(a[name], b[name])
  other_seed = data.DataLoader(data.DataConfig(seq_len=32, global_batch_size=8, seed=1), shardings)
  assert not np.array_equal(_batches(other_seed, 1)[0]["tokens"], runs[0][0]["tokens"])


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_through_a_checkpoint_continues_at_the_next_batch(tmp_path, workers):
  config = data.DataConfig(seq_len=32, global_batch_size=8, num_workers=workers)
  shardings = data_helpers.shardings(_mesh())
  state = dt.TrainState.create(apply_fn=None, params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1))
  loader = data.DataLoader(config, shardings)
  _batches(loader, 3)
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.save(3, state, data_iterator=loader)
  expected = _batches(loader, 3)
  loader.close()
  fresh = data.DataLoader(config, shardings)
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.restore(state, data_iterator=fresh)
  for a, b in zip(_batches(fresh, 3), expected):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
  fresh.close()


def test_restoring_with_another_batch_size_says_what_changed(tmp_path):
  shardings = data_helpers.shardings(_mesh())
  state = dt.TrainState.create(apply_fn=None, params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1))
  loader = data.DataLoader(data.DataConfig(seq_len=32, global_batch_size=8), shardings)
  next(loader)
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.save(1, state, data_iterator=loader)
  other = data.DataLoader(data.DataConfig(seq_len=32, global_batch_size=16), shardings)
  with dt.CheckpointManager(tmp_path) as checkpoints:
    with pytest.raises(ValueError, match=r"another data layout \(data.global_batch_size: 8 → 16\)"):
      checkpoints.restore(state, data_iterator=other)
  other.close()


@pytest.mark.parametrize("packing", [True, False])
def test_each_row_reads_its_own_lane_so_any_split_of_the_rows_gives_the_same_batches(packing):
  """The rows of a global batch do not depend on which process reads them: 8 rows read as one block, as two
  blocks of 4 and as four blocks of 2 are the same, step after step, and resume from any lane's position."""
  config = data.DataConfig(seq_len=48, global_batch_size=8, packing=packing, source="synthetic", synthetic_documents=64)
  loader = data.DataLoader(config, data_helpers.shardings(_mesh()))
  stream, tokenize = loader._lanes._stream, loader._lanes._tokenize
  loader.close()

  def read(blocks, steps, start=None):
    readers = [
      data.lanes.Lanes(
        stream,
        tokenize,
        lanes=8,
        rows=range(b * 8 // blocks, (b + 1) * 8 // blocks),
        length=49,
        packing=packing,
        threads=2,
      )
      for b in range(blocks)
    ]
    if start is not None:
      for reader in readers:
        reader.restore(start)
    out, position = [], {}
    for _ in range(steps):
      rows = []
      for reader in readers:
        block, after = reader.next_rows()
        rows += block
        position.update(after)
      out.append(np.stack([row["tokens"] for row in rows]))
    return out, position

  whole, after_3 = read(1, 3)
  for blocks in (2, 4):
    for got, want in zip(read(blocks, 3)[0], whole):
      np.testing.assert_array_equal(got, want)
  more, _ = read(1, 5)
  resumed, _ = read(4, 2, start=after_3)
  for got, want in zip(resumed, more[3:]):
    np.testing.assert_array_equal(got, want)
  assert len({a.tobytes() for a in more}) == 5


def test_the_position_is_after_the_batches_handed_out_not_those_prefetched_ahead():
  """The loader makes batches ahead in a background thread; its position is that of the batches it handed
  out, so a loader moved there hands out next exactly what this one does."""
  config = data.DataConfig(seq_len=48, global_batch_size=8, source="synthetic", synthetic_documents=64)
  shardings = data_helpers.shardings(_mesh())
  loader = data.DataLoader(config, shardings)
  _batches(loader, 3)
  handed_out = {lane: tuple(p) for lane, p in enumerate(loader.data_position()["lanes"])}
  deadline = time.monotonic() + 60
  while loader._lanes.position == handed_out:  # until the thread has read the next batch's rows
    assert time.monotonic() < deadline, "the loader never read ahead"
    time.sleep(0.01)
  position = loader.data_position()
  assert {lane: tuple(p) for lane, p in enumerate(position["lanes"])} == handed_out
  moved = data.DataLoader(config, shardings)
  moved.set_data_position(position)
  for got, want in zip(_batches(moved, 2), _batches(loader, 2)):
    for name in want:
      np.testing.assert_array_equal(got[name], want[name])
  moved.close()
  loader.close()


def test_train_and_eval_splits_never_overlap(tmp_path):
  corpus = data_helpers.write_corpus(tmp_path, documents=40)
  config = data.DataConfig(
    source="text", paths=(corpus,), seq_len=8, global_batch_size=2, packing=False, eval_fraction=0.1
  )
  shardings = data_helpers.shardings(_mesh((2, 1, 4)), batch_axes=("data",))
  seen = {}
  for split in ("train", "eval"):
    loader = data.DataLoader(config, shardings, split=split, num_epochs=1)
    seen[split] = _all_ids(loader)
  assert len(seen["eval"]) == 4 and len(seen["train"]) == 36
  assert not set(seen["eval"]) & set(seen["train"])
  assert set(seen["eval"]) | set(seen["train"]) == {f"doc {i:04d}" for i in range(40)}


def _all_ids(loader):
  ids = []
  while True:
    try:
      ids.extend(data_helpers.doc_ids(loader.next_local()["tokens"]))
    except StopIteration:
      return ids


def test_array_record_shards_read_like_the_jsonl_they_came_from(tmp_path):
  corpus = data_helpers.write_corpus(tmp_path, documents=20)
  shards = data.write_array_record(corpus, str(tmp_path / "corpus"), num_shards=2)
  assert [pathlib.Path(p).name for p in shards] == [
    "corpus-00000-of-00002.array_record",
    "corpus-00001-of-00002.array_record",
  ]
  common = dict(seq_len=8, global_batch_size=2, packing=False, eval_fraction=0.0)
  shardings = data_helpers.shardings(_mesh((2, 1, 4)), batch_axes=("data",))
  from_jsonl = _all_ids(
    data.DataLoader(data.DataConfig(source="text", paths=(corpus,), **common), shardings, num_epochs=1)
  )
  from_records = _all_ids(
    data.DataLoader(
      data.DataConfig(source="text", paths=(str(tmp_path / "corpus-*.array_record"),), **common),
      shardings,
      num_epochs=1,
    )
  )
  assert sorted(from_records) == sorted(from_jsonl) == [f"doc {i:04d}" for i in range(20)]


def test_eval_pads_its_last_batch_instead_of_dropping_documents(tmp_path):
  corpus = data_helpers.write_corpus(tmp_path, documents=120)
  config = data.DataConfig(
    source="text", paths=(corpus,), seq_len=8, global_batch_size=8, packing=False, eval_fraction=0.1
  )
  shardings = data_helpers.shardings(_mesh((8, 1, 1)), batch_axes=("data",))
  loader = data.DataLoader(config, shardings, split="eval", num_epochs=1)
  batches = [next(loader), next(loader)]
  with pytest.raises(StopIteration):
    next(loader)
  weights = np.asarray(batches[1]["weights"])
  assert weights[:4].all() and not weights[4:].any()  # 12 documents: 8 + 4 real rows
  with pytest.raises(ValueError, match="The eval split is empty: eval_fraction is 0"):
    data.DataLoader(data.DataConfig(eval_fraction=0.0), shardings, split="eval")


def test_inputs_also_sharded_along_the_sequence_are_fed():
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = _mesh()
  sharding = NamedSharding(mesh, P(("data", "fsdp"), "tensor"))
  loader = data.DataLoader(
    data.DataConfig(seq_len=32, global_batch_size=8), {name: sharding for name in data_helpers.INPUTS}
  )
  batch = next(loader)
  assert batch["tokens"].sharding == sharding and batch["tokens"].shape == (8, 32)


def test_the_convert_command_writes_array_record(tmp_path):
  import subprocess
  import sys

  corpus = data_helpers.write_corpus(tmp_path, documents=5)
  out = subprocess.run(
    [sys.executable, "-m", "distrib_train.data", "convert", corpus, str(tmp_path / "c")],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip().endswith("c-00000-of-00001.array_record")


def test_convert_takes_globs_and_several_inputs_and_creates_the_output_directory(tmp_path):
  import subprocess
  import sys

  for name, lines in (("a.jsonl", ["one", "two"]), ("b.jsonl", ["three"])):
    (tmp_path / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
  (tmp_path / "c.txt").write_text("four")
  output = tmp_path / "new" / "deeper" / "corpus"
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "distrib_train.data",
      "convert",
      str(tmp_path / "*.jsonl"),
      str(tmp_path / "c.txt"),
      str(output),
      "--shards",
      "2",
    ],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr
  shards = out.stdout.split()
  assert [pathlib.Path(p).name for p in shards] == [
    "corpus-00000-of-00002.array_record",
    "corpus-00001-of-00002.array_record",
  ]
  docs = data.Documents(data.DataConfig(source="text", paths=tuple(shards)))
  assert sorted(docs[i] for i in range(len(docs))) == ["four", "one", "three", "two"]


def test_convert_streams_a_corpus_in_memory_bounded_by_one_document(tmp_path):
  import tracemalloc

  corpus = tmp_path / "big.jsonl"
  with open(corpus, "w") as f:
    for i in range(22_000):
      f.write(json.dumps({"text": f"{i} " + "x" * 1000}) + "\n")  # ~22 MB
  tracemalloc.start()
  try:
    data.write_array_record(str(corpus), str(tmp_path / "out" / "big"), num_shards=3)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert corpus.stat().st_size > 20 * 2**20
  assert peak < 2 * 2**20, peak  # reading the file whole would take > 20 MB
  docs = data.Documents(data.DataConfig(source="text", paths=(str(tmp_path / "out" / "big-*.array_record"),)))
  assert len(docs) == 22_000


def test_convert_failing_part_way_leaves_no_shards(tmp_path):
  corpus = tmp_path / "bad.jsonl"
  corpus.write_text(json.dumps({"text": "fine"}) + "\nnot json\n")
  with pytest.raises(ValueError, match=r"bad.jsonl' line 2 is not JSON"):
    data.write_array_record(str(corpus), str(tmp_path / "out" / "c"), bad_records="error")
  assert list((tmp_path / "out").iterdir()) == []
  [shard] = data.write_array_record(str(corpus), str(tmp_path / "out" / "c"))  # skip (the default): left out
  docs = data.Documents(data.DataConfig(source="text", paths=(shard,)))
  assert [docs[i] for i in range(len(docs))] == ["fine"]
  with pytest.raises(ValueError, match="No documents to write"):
    data.write_array_record([], str(tmp_path / "none" / "c"))
  assert not (tmp_path / "none").exists()


def test_a_tokenizer_hook_is_used():
  tokenizer = lambda text: [1000 + len(word) for word in text.split()]  # a word-level "tokenizer"
  loader = data.DataLoader(
    data.DataConfig(seq_len=16, global_batch_size=8, tokenizer=tokenizer), data_helpers.shardings(_mesh())
  )
  batch = loader.next_local()
  real = batch["tokens"][batch["segment_ids"] > 0]
  assert real.min() > 1000 and real.max() < 1100


def test_two_processes_shard_documents_and_replicate_when_the_mesh_says_so(tmp_path):
  (tmp_path / "corpus").mkdir()
  results = mp_harness.run_workers(
    WORKERS / "data_worker.py", str(tmp_path / "corpus"), str(tmp_path / "ckpt"), timeout=300
  )
  first, second = (r.result for r in results)
  assert [first["split"]["shard"], second["split"]["shard"]] == [[0, 2], [1, 2]]
  assert first["split"]["global_ok"] and second["split"]["global_ok"]
  ids_a, ids_b = first["split"]["ids"], second["split"]["ids"]
  assert len(ids_a) == len(ids_b) == 32 and not set(ids_a) & set(ids_b)
  assert set(ids_a) | set(ids_b) == {f"doc {i:04d}" for i in range(64)}
  assert first["replicated"]["shard"] == second["replicated"]["shard"] == [0, 1]
  assert first["replicated"]["ids"] == second["replicated"]["ids"]
  assert first["replicated"]["global_ok"] and second["replicated"]["global_ok"]
  assert first["resume_equal"] and second["resume_equal"]
  assert first["exact_resume"] == second["exact_resume"] == {"0": True, "2": True}
  assert first["eval_batches"] == second["eval_batches"] > 0
  # The data position was written by 2 processes; one process resumes with the rows both would have fed.
  loader = data.DataLoader(data.DataConfig(seq_len=32, global_batch_size=8), data_helpers.shardings(_mesh()))
  state = dt.TrainState.create(apply_fn=None, params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1))
  with dt.CheckpointManager(tmp_path / "ckpt") as checkpoints:
    checkpoints.restore(state, data_iterator=loader)
  for i in range(2):
    assert loader.next_local()["tokens"].tolist() == first["after_save"][i] + second["after_save"][i]
  loader.close()


# --- bad input: one clear error at construction -------------------------------


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(global_batch_size=0), r"global_batch_size must be a positive integer, got 0"),
    (dict(seq_len=-3), r"seq_len must be a positive integer, got -3"),
    (dict(source="tfds"), r"unknown source 'tfds'"),
    (dict(source="text"), r"source 'text' needs paths"),
    (dict(num_workers=-1), r"num_workers must be 0 or more"),
    (dict(eval_fraction=1.0), r"eval_fraction must be in \[0, 1\)"),
  ],
)
def test_bad_data_configs_are_rejected(kwargs, message):
  with pytest.raises(ValueError, match=message):
    data.DataConfig(**kwargs)


@pytest.mark.parametrize("workers", [0, 1])
def test_bad_data_files_are_named(tmp_path, workers):
  """Named alike whether the lanes run in this process or in a worker process (``lane_process.py``)."""
  shardings = data_helpers.shardings(_mesh())
  cases = [
    (str(tmp_path / "missing-*.jsonl"), r"Data path '.*missing-\*.jsonl' matches no file"),
  ]
  binary = tmp_path / "binary.txt"
  binary.write_bytes(b"\xff\xfe\x00 not text")
  cases.append((str(binary), r"Data file '.*binary.txt' is not UTF-8 text"))
  broken = tmp_path / "broken.jsonl"  # a malformed line stops the run under data.bad_records=error
  broken.write_text('{"text": "fine"}\n{"text": oops}\n')
  cases.append((str(broken), r"Data file '.*broken.jsonl' line 2 is not JSON.*data.bad_records=skip would skip it"))
  no_text = tmp_path / "no_text.jsonl"
  no_text.write_text('{"body": "x"}\n')
  cases.append((str(no_text), r"line 1 has no string field 'text'"))
  corrupt = tmp_path / "corrupt.array_record"
  corrupt.write_bytes(b"this is not an array record file" * 10)
  cases.append((str(corrupt), r"Data file '.*corrupt.array_record' is not a readable ArrayRecord file"))
  for path, message in cases:
    with pytest.raises(ValueError, match=message):
      data.DataLoader(
        data.DataConfig(
          source="text",
          paths=(path,),
          seq_len=8,
          global_batch_size=8,
          eval_fraction=0,
          bad_records="error",
          num_workers=workers,
        ),
        shardings,
      )


def _worker_corpus(tmp_path, bad_line=None):
  path = tmp_path / "c.jsonl"
  # 5000 documents: the split's check at open reads every other one, so it misses line 2502 (index 2501)
  path.write_text(
    "".join("{not json\n" if i == bad_line else json.dumps({"text": f"document {i} " * 2}) + "\n" for i in range(5000))
  )
  return data.DataConfig(
    source="text",
    paths=(str(path),),
    seq_len=16,
    global_batch_size=8,
    eval_fraction=0,
    bad_records="error",
    num_workers=2,
    index_cache_dir=str(tmp_path / "cache"),
  )


def _within(seconds, call):
  """``call()``'s result or exception, or a failure if it has not returned within ``seconds`` (no hang)."""
  import threading

  out = {}

  def run():
    try:
      out["value"] = call()
    except BaseException as e:  # noqa: BLE001 - handed to the test
      out["error"] = e

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(seconds)
  assert not thread.is_alive(), f"{call} did not return within {seconds} s"
  if "error" in out:
    raise out["error"]
  return out.get("value")


def test_a_worker_processes_error_is_raised_again_on_every_read_and_close_returns(tmp_path):
  """A malformed line under ``data.bad_records=error`` read in a worker process: the named error, then the same
  error on the next read and on a restore (before, both waited forever), and ``close()`` ends every worker,
  which exits 0 (before, one aborted at exit: "Fatal Python error")."""
  loader = data.DataLoader(_worker_corpus(tmp_path, bad_line=2501), data_helpers.shardings(_mesh()))
  position = loader.data_position()
  processes = [process for process, _ in loader._lanes._workers]
  with pytest.raises(ValueError, match=r"c.jsonl' line 2502 is not JSON"):
    _within(120, lambda: [loader.next_local() for _ in range(20_000)])  # an epoch is ~1,000 batches
  with pytest.raises(ValueError, match=r"c.jsonl' line 2502 is not JSON"):
    _within(10, loader.next_local)
  with pytest.raises(ValueError, match=r"c.jsonl' line 2502 is not JSON"):
    _within(10, lambda: loader.set_data_position(position))
  _within(30, loader.close)
  assert [p.returncode for p in processes] == [0, 0]


def test_a_dead_or_stuck_worker_process_is_named_and_close_returns(tmp_path):
  """A worker killed (the OOM killer's SIGKILL) is named with its exit code, by a read or by a restore; a worker
  that stopped answering (SIGSTOP) does not keep ``close()`` from returning: it is killed after 10 s."""
  import signal

  shardings = data_helpers.shardings(_mesh())
  loader = data.DataLoader(_worker_corpus(tmp_path), shardings)
  position = loader.data_position()
  dead = loader._lanes._workers[1][0]
  dead.kill()
  dead.wait()
  with pytest.raises(RuntimeError, match=rf"data worker process 1 \(pid {dead.pid}\) ended with exit code -9"):
    _within(10, lambda: loader.set_data_position(position))
  with pytest.raises(RuntimeError, match=r"data worker process 1 .* ended with exit code -9"):
    _within(60, lambda: [loader.next_local() for _ in range(10_000)])
  _within(30, loader.close)

  loader = data.DataLoader(_worker_corpus(tmp_path), shardings)
  loader.next_local()
  stuck = loader._lanes._workers[1][0]
  os.kill(stuck.pid, signal.SIGSTOP)
  reading = []

  def read_on():  # as the trainer's loop would, until the loader is closed under it
    try:
      while True:
        loader.next_local()
        reading.append(1)
    except RuntimeError as e:
      reading.append(e)

  import threading

  threading.Thread(target=read_on, daemon=True).start()
  time.sleep(2)  # the reader drains what the stuck worker made ahead, then waits on it
  _within(40, loader.close)
  assert stuck.returncode is not None


def test_unpacked_sequences_longer_than_every_document_are_refused(tmp_path):
  corpus = data_helpers.write_corpus(tmp_path, documents=8)
  config = data.DataConfig(source="text", paths=(corpus,), seq_len=4096, global_batch_size=8, packing=False)
  with pytest.raises(ValueError, match=r"seq_len 4096 \+ 1 is longer than every train document \(longest \d+"):
    data.DataLoader(config, data_helpers.shardings(_mesh()))


def test_a_batch_that_does_not_split_over_the_batch_axes_is_refused():
  with pytest.raises(ValueError, match=r"global_batch_size 6 does not split over the mesh's batch axes"):
    data.DataLoader(data.DataConfig(global_batch_size=6), data_helpers.shardings(_mesh()))


def test_a_corpus_far_larger_than_the_memory_growth_allowed_streams(tmp_path):
  """Documents are read when the pipeline needs them: a ~400 MB JSONL corpus costs the process no more
  than 64 MiB beyond what a 1 MB one does (the documents held in memory would be > 380 MiB)."""
  import subprocess
  import sys

  def corpus(path, mib):
    line = json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 90}) + "\n"  # ~4 KiB
    with open(path, "w") as f:
      for _ in range(mib):
        f.write(line * 256)
    return path

  def peak_mib(path):
    out = subprocess.run(
      [sys.executable, str(WORKERS / "data_memory_worker.py"), str(path)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])

  small, large = peak_mib(corpus(tmp_path / "small.jsonl", 1)), peak_mib(corpus(tmp_path / "large.jsonl", 400))
  assert (tmp_path / "large.jsonl").stat().st_size > 380 * 2**20
  print("peak RSS MiB, 1 MB corpus vs 400 MB:", small, large)
  assert large - small < 64, (small, large)


def test_an_endless_loader_refuses_grain_state_of_an_earlier_release_with_the_way_out(tmp_path):
  """A checkpoint whose data item is grain's per-process state (what every checkpoint held before lanes, and
  what a finite pass still saves) cannot position lanes: one clear error, before any array is read."""
  shardings = data_helpers.shardings(_mesh())
  state = dt.TrainState.create(apply_fn=None, params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1))
  finite = data.DataLoader(data.DataConfig(seq_len=32, global_batch_size=8), shardings, num_epochs=3)
  assert not finite.endless and finite.data_position() is None
  next(finite)
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.save(1, state, data_iterator=finite)
  assert (tmp_path / "1" / "data").is_dir()
  endless = data.DataLoader(data.DataConfig(seq_len=32, global_batch_size=8), shardings)
  with dt.CheckpointManager(tmp_path) as checkpoints:
    with pytest.raises(
      dt.CheckpointError,
      match=r"holds grain's per-process data state .* Restore without"
      r" data_iterator",
    ):
      checkpoints.restore(state, data_iterator=endless)
    assert int(checkpoints.restore(state).step) == 0  # without the data item it restores
  endless.close()
  finite.close()
