"""A script that ends without closing what it opened still exits 0, with nothing from native code on stderr.

Python tears down a daemon thread still running at exit when it next takes
the interpreter lock; one in native code (a tokenizer's batch encode,
pyarrow's reader) then aborts the process ("FATAL: exception not rethrown",
"terminate called without an active exception"). Before loaders were closed
at exit (``common/exit_hooks.py``) the script below aborted in about one run
in six (10 of 60 on these corpora).
"""

import json
import os
import pathlib
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from distrib_train import data
from distrib_train.common import exit_hooks

WORKERS = pathlib.Path(__file__).parent / "workers"
# Runs per corpus and worker setting: 36 in all. At the old code's one abort in six, all 36 pass by chance once in
# about 700 suites: the first CI run after such a regression fails with probability 0.9986. (12 a corpus, 72 in
# all, once in 500,000, cost 60 s more of CI.)
RUNS = 6


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
  """The same 400 documents as JSONL, Parquet (100-row groups) and ``.jsonl.zst``, and a BPE trained on them."""
  pyarrow = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq
  import zstandard
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  folder = tmp_path_factory.mktemp("exit")
  rng = np.random.default_rng(0)
  words = np.array("the of and model train data shard mesh token lorem ipsum dolor alpha beta".split())
  documents = [" ".join(rng.choice(words, size=rng.integers(20, 400))) for _ in range(400)]
  jsonl = folder / "docs.jsonl"
  jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
  pq.write_table(pyarrow.table({"text": documents}), folder / "docs.parquet", row_group_size=100)
  (folder / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl.read_bytes()))
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train(
    [str(jsonl)],
    trainers.BpeTrainer(
      vocab_size=600, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    ),
  )
  tokenizer.save(str(folder / "tokenizer.json"))
  return folder


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_script_that_reads_a_batch_and_ends_without_close_exits_cleanly(corpora, num_workers, tmp_path):
  paths = [str(corpora / name) for name in ("docs.parquet", "docs.jsonl", "docs.jsonl.zst")]
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
  done = subprocess.run(
    [
      sys.executable,
      str(WORKERS / "exit_worker.py"),
      str(tmp_path),
      str(RUNS),
      str(corpora / "tokenizer.json"),
      str(num_workers),
      *paths,
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  results = dict(line.rsplit(" ", 1) for line in done.stdout.splitlines())
  assert len(results) == 3 * RUNS, done.stdout
  failed = {
    name: code
    for name, code in results.items()
    if code != "0"
    or (tmp_path / f"{name}.err").read_text()
    or (tmp_path / f"{name}.out").read_text() != "read a batch\n"
  }
  example = next(iter(failed), None)
  assert not failed, (
    f"{len(failed)} of {len(results)} runs ended badly: {failed}; {example}'s stderr:\n"
    + (tmp_path / f"{example}.err").read_text()[-2000:]
  )


def _one_device_shardings():
  sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)), P("data", None))
  return {name: sharding for name in ("tokens", "targets", "weights", "segment_ids", "positions")}


def _prefetch_threads():
  return [t for t in threading.enumerate() if t.name.startswith("grain-thread-prefetch")]


def test_a_loader_is_a_context_manager_that_stops_its_threads_and_refuses_reads_after():
  before = len(_prefetch_threads())
  with data.DataLoader(
    data.DataConfig(seq_len=32, global_batch_size=4, num_threads=2), _one_device_shardings()
  ) as loader:
    next(loader)
    assert len(_prefetch_threads()) == before + 1
  assert len(_prefetch_threads()) == before
  with pytest.raises(ValueError, match="This DataLoader is closed"):
    next(loader)
  loader.close()  # a second close does nothing


def test_a_dropped_loader_is_collected_and_its_threads_stop_at_exit(monkeypatch):
  import gc
  import weakref

  monkeypatch.setattr(exit_hooks, "_pending", {})  # this test's loader alone, not those other tests hold
  before = len(_prefetch_threads())
  loader = data.DataLoader(data.DataConfig(seq_len=32, global_batch_size=4), _one_device_shardings())
  next(loader)
  dropped = weakref.ref(loader)
  del loader
  gc.collect()
  assert dropped() is None and len(_prefetch_threads()) == before + 1  # collected; its reads run on
  exit_hooks.close_all()  # what interpreter exit runs
  assert len(_prefetch_threads()) == before


def test_a_forked_child_closes_none_of_its_parents_helpers(tmp_path):
  """A forked child (a multiprocessing worker) that ends normally runs threading's exit hooks too: it must not
  close what its parent opened (a loader's close would stop the parent's data worker processes)."""
  closed = tmp_path / "closed"
  code = (
    f"import os, sys\n"
    f"from distrib_train.common import exit_hooks\n"
    f"exit_hooks.close_at_exit(lambda: open({str(closed)!r}, 'a').write(f'{{os.getpid()}}\\n'))\n"
    f"pid = os.fork()\n"
    f"if pid == 0:\n"
    f"  sys.exit(0)\n"
    f"os.waitpid(pid, 0)\n"
    f"print(os.getpid())\n"
  )
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert closed.read_text().split() == [done.stdout.strip()]  # once, in the parent


def test_closes_at_exit_run_newest_first_once_and_a_failing_one_is_one_line(capsys, monkeypatch):
  monkeypatch.setattr(exit_hooks, "_pending", {})  # this test's alone, not the loaders other tests hold
  calls = []

  def close(name):
    calls.append(name)
    if name == "b":
      raise OSError("disk gone")

  handles = [exit_hooks.close_at_exit(close, name) for name in "abc"]
  handles[0]()  # closed by its owner: not again at exit
  exit_hooks.close_all()
  exit_hooks.close_all()
  assert calls == ["a", "c", "b"]
  assert capsys.readouterr().err == "distrib_train: closing at exit failed: OSError: disk gone\n"
