"""Runs the trainer on damaged checkpoints many times: each run must exit 2 with the one error line and nothing else.

Not a test (pytest collects ``test_*.py`` only): the loop outside CI that issue 56 asks for, since an echo of a
failed read depends on when the garbage collector runs and one run proves little. It trains the 2-step tiny run
of ``test_bad_inputs.py`` once, then for each case copies it, damages the copy and runs the same command on it,
four at a time::

    python tests/damaged_checkpoint_loop.py --runs 30 [--cases ocdbt-index-deleted,truncated-arrays]

It prints, per case, the runs that did not end with exactly one ``distrib-train: error:`` line, exit 2 and no other
line (the trainer's own log lines, which start with a time, aside) and the stderr of the first of them.
"""

import argparse
import concurrent.futures
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAST = [
  "--config",
  "tiny",
  "--cpu_devices",
  "8",
  "--steps",
  "2",
  "--set",
  "data.seq_len=32",
  "--set",
  "data.global_batch_size=8",
  "--set",
  "data.source=synthetic",
  "--set",
  "data.synthetic_documents=64",
  "--set",
  "train.eval_every=0",
  "--set",
  "train.eval_batches=1",
  "--set",
  "train.log_every=1",
  "--set",
  "optimizer.warmup_steps=0",
  "--set",
  "optimizer.decay_steps=10",
]


sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_bad_inputs import _remove_all, _step, _truncate_arrays  # noqa: E402  (the damage the tests apply)


# The cases of test_bad_inputs.CHECKPOINT_CASES whose refusal comes from a failed read of orbax or tensorstore.
CASES = {
  "ocdbt-index-deleted": _remove_all("state/d/*"),
  "array-file-deleted": _remove_all("state/ocdbt.process_*/d/*"),
  "truncated-arrays": _truncate_arrays,
  "garbage-array-metadata": lambda workdir: (_step(workdir) / "state" / "_METADATA").write_text("garbage{"),
}


def _run(workdir, cache):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [
      sys.executable,
      "-m",
      "distrib_train",
      "--workdir",
      str(workdir),
      *FAST,
      "--set",
      f"train.compilation_cache_dir={cache}",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def _one(base, name, index, cache):
  directory = base / f"{name}-{index}"
  shutil.copytree(base / "trained", directory)
  CASES[name](directory)
  out = _run(directory, cache)
  shutil.rmtree(directory)
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  errors = [line for line in lines if line.startswith("distrib-train: error:")]
  others = [line for line in lines if not line.startswith(("distrib-train: error:", "[", "  the whole table"))]
  return out.returncode == 2 and len(errors) == 1 and not others, out.stderr


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=30)
  parser.add_argument("--cases", default=",".join(CASES))
  args = parser.parse_args()
  names = args.cases.split(",")
  with tempfile.TemporaryDirectory() as tmp:
    base, cache = pathlib.Path(tmp), str(pathlib.Path(tmp) / "xla")
    trained = _run(base / "trained", cache)
    assert trained.returncode == 0, trained.stderr[-3000:]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      futures = {(n, i): pool.submit(_one, base, n, i, cache) for n in names for i in range(args.runs)}
      outcomes = {key: future.result() for key, future in futures.items()}
  failed = 0
  for name in names:
    bad = [stderr for (n, _), (ok, stderr) in outcomes.items() if n == name and not ok]
    failed += len(bad)
    print(f"{name}: {args.runs} runs, {len(bad)} with more than the one error line")
    if bad:
      print(bad[0][-3000:])
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
