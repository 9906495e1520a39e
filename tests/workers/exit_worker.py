"""A user's short script, run many times: open a DataLoader, read a batch, end without ``close()``.

    python exit_worker.py OUT_DIR RUNS TOKENIZER NUM_WORKERS CORPUS [CORPUS ...]

Each run is a forked child of this process, which has imported jax,
distrib_train, grain, the tokenizer library and pyarrow once (jax's backend
is not started before the fork), so a run costs what the script itself does
after its imports: a mesh, a loader over the corpus with the tokenizer, a
batch, then the interpreter's own shutdown (``sys.exit``: every exit hook,
thread shutdown and module teardown of a script that ends, unlike
``os._exit``). A run's stdout and stderr go to ``OUT_DIR/<run>.out`` and
``.err``; this process prints one line per run: the corpus, the run, and its
exit status (or the signal that ended it).
"""

import os
import pathlib
import sys
import threading
import warnings

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import grain  # noqa: E402,F401  (imported before the fork, as a script's imports are)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow.parquet  # noqa: E402,F401
import tokenizers  # noqa: E402,F401
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from distrib_train import data  # noqa: E402
import distrib_train.data.endless  # noqa: E402,F401
import distrib_train.data.lane_process  # noqa: E402,F401


def script(corpus: str, tokenizer: str, num_workers: int) -> None:
  """The issue's script: a 1-device mesh, a loader, one batch, no close()."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  sharding = NamedSharding(mesh, P("data", None))
  shardings = {name: sharding for name in ("tokens", "targets", "weights", "segment_ids", "positions")}
  loader = data.DataLoader(
    data.DataConfig(
      source="text",
      paths=(corpus,),
      seq_len=1024,
      global_batch_size=32,
      tokenizer=f"hf:{tokenizer}",
      eos_token="</s>",
      num_workers=num_workers,
    ),
    shardings,
  )
  next(loader)
  print("read a batch", flush=True)


def _start(name: str, out_dir: str, corpus: str, tokenizer: str, num_workers: int) -> int:
  """Forks a run of the script; returns its pid."""
  pid = os.fork()
  if pid == 0:  # the child: the script, then the interpreter's normal exit
    for fd, suffix in ((1, "out"), (2, "err")):
      target = os.open(os.path.join(out_dir, f"{name}.{suffix}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
      os.dup2(target, fd)
      os.close(target)
    script(corpus, tokenizer, num_workers)
    sys.exit(0)
  return pid


def main(out_dir: str, runs: int, tokenizer: str, num_workers: int, corpora: list[str], at_once: int = 2) -> None:
  assert threading.active_count() == 1, "no Python thread may exist at the fork"
  # The process's other threads are OpenBLAS's pool (numpy) and jemalloc's background thread (pyarrow), both
  # made again in a forked child by their own fork handlers.
  warnings.filterwarnings("ignore", r".*use of fork\(\) may lead to deadlocks", DeprecationWarning)
  waiting = [(f"{pathlib.Path(corpus).name}-{num_workers}-{run}", corpus) for corpus in corpora for run in range(runs)]
  running: dict[int, str] = {}
  while waiting or running:
    while waiting and len(running) < at_once:  # a few at a time: a run waits on its worker process a while
      name, corpus = waiting.pop(0)
      running[_start(name, out_dir, corpus, tokenizer, num_workers)] = name
    pid, status = os.wait()
    print(running.pop(pid), os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5:])
