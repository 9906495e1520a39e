"""The shipped example runs as a new user would run it."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]


def test_sharded_mlp_example_trains_and_shards():
  out = subprocess.run(
      [sys.executable, str(ROOT / "examples" / "sharded_mlp.py")],
      capture_output=True, text=True, timeout=300, cwd=ROOT,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  losses = [float(m) for m in re.findall(r"^step +\d+  loss (\S+)$", out.stdout, re.MULTILINE)]
  assert len(losses) == 4 and losses[-1] < 0.2 * losses[0]
  assert "1/w (128, 128) is split over ('fsdp', 'tensor'); each device holds (64, 64)" in out.stdout
  assert "Plan on mesh data=2 × fsdp=2 × tensor=2 (8 devices)" in out.stdout
