"""The shipped example runs as a new user would run it."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]


def _run(example):
  out = subprocess.run(
    [sys.executable, str(ROOT / "examples" / example)], capture_output=True, text=True, timeout=300, cwd=ROOT
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return out


def test_sharded_mlp_example_trains_and_shards():
  out = _run("sharded_mlp.py")
  losses = [float(m) for m in re.findall(r"^step +\d+  loss (\S+)$", out.stdout, re.MULTILINE)]
  assert len(losses) == 4 and losses[-1] < 0.2 * losses[0]
  assert "1/w (128, 128) is split over ('fsdp', 'tensor'); each device holds (64, 64)" in out.stdout
  assert "Plan on mesh data=2 × fsdp=2 × tensor=2 (8 devices)" in out.stdout


def test_nnx_model_example_trains_with_its_own_annotations_and_batch_stats():
  out = _run("nnx_model.py")
  accuracies = [float(m) for m in re.findall(r"eval accuracy (\S+)$", out.stdout, re.MULTILINE)]
  assert len(accuracies) == 4 and accuracies[-1] > 0.9
  assert "hidden/kernel (32, 256) split over ('fsdp', 'tensor')" in out.stdout
  assert re.search(r"^local_state +norm/mean +\(256,\)", out.stdout, re.MULTILINE)
  assert re.search(r"BatchNorm running mean \(local state\) starts (?!0\.000, 0\.000, 0\.000)", out.stdout)
