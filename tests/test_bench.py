"""The GPU throughput benchmark still runs (tiny shape, CPU): both paths,
same initial loss, a table row each."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_train_throughput_smoke_on_cpu(tmp_path):
  out = subprocess.run(
      [sys.executable, "bench/train_throughput.py", "--shapes", "tiny", "--steps", "2", "--warmup", "1",
       "--check_same_init", "--json", str(tmp_path / "rows.json")],
      cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""), capture_output=True, text=True,
      timeout=240)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert any(line.startswith("tiny   reference") for line in lines), out.stdout
  assert any(line.startswith("tiny   framework") for line in lines), out.stdout
  rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
  assert {r["path"] for r in rows} == {"reference", "framework"}
  assert all(not r.get("error") and r["tokens_per_s"] > 0 for r in rows), rows
