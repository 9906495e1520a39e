"""The GPU throughput benchmark still runs (tiny shape, CPU): both paths,
same initial loss, a table row each."""

import json
import os
import pathlib
import subprocess
import sys

from xla_test_flags import FAST_COMPILE  # compile speed only, as every test's

ROOT = pathlib.Path(__file__).resolve().parents[1]
_ONE_CPU_DEVICE = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)  # the benches' own device count: 1


def test_train_throughput_smoke_on_cpu(tmp_path):
  out = subprocess.run(
    [
      sys.executable,
      "bench/train_throughput.py",
      "--shapes",
      "tiny",
      "--steps",
      "2",
      "--warmup",
      "1",
      "--check_same_init",
      "--json",
      str(tmp_path / "rows.json"),
    ],
    cwd=ROOT,
    env=_ONE_CPU_DEVICE,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert any(line.startswith("tiny   reference") for line in lines), out.stdout
  assert any(line.startswith("tiny   framework") for line in lines), out.stdout
  rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
  assert {r["path"] for r in rows} == {"reference", "framework"}
  assert all(not r.get("error") and r["tokens_per_s"] > 0 for r in rows), rows


def test_trainer_loop_bench_runs_the_trainer_beside_its_bare_step_on_cpu(tmp_path):
  """bench/trainer_loop.py on the tiny preset with real text and a worker process: both figures, their ratio
  and the data wait are written (the ratio itself is a benchmark's figure, not a test's)."""
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text(
    "".join(json.dumps({"text": f"document {i} " + "lorem ipsum dolor " * (5 + i % 40)}) + "\n" for i in range(400))
  )
  out = subprocess.run(
    [
      sys.executable,
      "bench/trainer_loop.py",
      "--config",
      "tiny",
      "--cpu_devices",
      "8",
      "--steps",
      "6",
      "--log_every",
      "2",
      "--text",
      str(corpus),
      "--set",
      "data.num_workers=1",
      "--set",
      "data.seq_len=64",
      "--json",
      str(tmp_path / "loop.json"),
    ],
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=400,
  )
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  assert "trainer / bare step:" in out.stdout
  found = json.loads((tmp_path / "loop.json").read_text())
  assert found["bare"]["tokens_per_s"] > 0 and found["trainer"]["tokens_per_s"] > 0
  assert found["trainer"]["windows"] == 2 and found["ratio"] > 0 and 0 <= found["data_wait_share"] < 1
  assert "data.num_workers=1" in found["sets"]


def test_data_bench_writes_every_format_and_times_what_this_checkout_reads(tmp_path):
  """bench/data_bench.py at 2 MB: every format written, each timed or skipped with its reason, and the formats read
  today (JSONL, Parquet, pre-tokenized ArrayRecord) timed: both opens and training tokens/s."""
  out = subprocess.run(
    [
      sys.executable,
      "bench/data_bench.py",
      "--sizes",
      "2MB",
      "--dir",
      str(tmp_path / "corpora"),
      "--seconds",
      "0.3",
      "--seq_len",
      "256",
      "--batch",
      "8",
      "--json",
      str(tmp_path / "rows.json"),
    ],
    cwd=ROOT,
    env=_ONE_CPU_DEVICE,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
  assert [r["format"] for r in rows] == ["jsonl", "parquet", "jsonl.zst", "jsonl.gz", "datasets", "array_record"]
  assert all(r["documents"] > 100 for r in rows)
  for row in rows:
    assert row.get("skipped") or (row["tokens_per_s"] > 0 and row["first_open_s"] > 0 and row["second_open_s"] > 0)
    assert f"{row['format']:<13} bytes" in out.stdout
  assert all("skipped" not in r for r in rows if r["format"] in ("jsonl", "parquet", "array_record")), rows
  assert (tmp_path / "corpora" / "2MB" / "corpus.parquet").exists()
  assert any((tmp_path / "corpora" / "2MB").glob("tokens-*/corpus-00000-of-00001.array_record"))
  timed = [r for r in rows if "skipped" not in r]
  assert all(r["main_cpu_ms_per_batch"] > 0 and r["workers_cpu_s_per_m_tokens"] is None for r in timed), timed


def test_data_bench_counts_the_worker_processes_cpu(tmp_path):
  """With ``--num_workers``, the CPU the worker processes spent per million tokens is read from /proc (the figure
  that tells workers that were slow from workers that were idle, on a host of many cores)."""
  out = subprocess.run(
    [
      sys.executable,
      "bench/data_bench.py",
      "--sizes",
      "1MB",
      "--formats",
      "jsonl",
      "--dir",
      str(tmp_path),
      "--seconds",
      "1",
      "--seq_len",
      "256",
      "--batch",
      "8",
      "--num_workers",
      "1",
      "--json",
      str(tmp_path / "rows.json"),
    ],
    cwd=ROOT,
    env=_ONE_CPU_DEVICE,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  (row,) = json.loads((tmp_path / "rows.json").read_text())["rows"]
  assert row["tokens_per_s"] > 0 and row["main_cpu_ms_per_batch"] > 0
  # A worker reads, tokenizes and packs every token the training process receives: it cannot cost nothing.
  assert 0 < row["workers_cpu_s_per_m_tokens"] < 1e3, row


def test_fp8_gemm_bench_times_the_same_products_in_each_layout_on_cpu(tmp_path):
  """bench/fp8_gemms.py (tiny shapes, CPU): every variant is timed, and its FP8 products are the same numbers
  in every layout (the layouts differ, the operands do not), within FP8's rounding of bf16's."""
  out = subprocess.run(
    [
      sys.executable,
      "bench/fp8_gemms.py",
      "--tokens",
      "128",
      "--shapes",
      "64x96",
      "--iters",
      "2",
      "--json",
      str(tmp_path / "rows.json"),
    ],
    cwd=ROOT,
    env=_ONE_CPU_DEVICE,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  rows = {r["variant"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
  assert set(rows) == {
    "bf16 product",
    "fp8 as built",
    "fp8 K-major",
    "fp8 e4m3 grads",
    "matmul fwd+bwd none",
    "matmul fwd+bwd current",
  }
  assert all(ms > 0 for r in rows.values() for ms in r["ms"])
  built, kmajor = rows["fp8 as built"]["error"], rows["fp8 K-major"]["error"]
  assert all(0 < e < 0.1 for e in built + rows["fp8 e4m3 grads"]["error"]), rows
  assert all(abs(a - b) < 1e-3 for a, b in zip(built, kmajor)), (built, kmajor)


def test_gpu_bench_reads_the_headline_table_it_prints_beside():
  """bench/gpu.sh's rows each have a figure in RESULTS.md's headline table to print beside (the bench itself
  needs a GPU; `bash bench/gpu.sh --smoke` runs it on CPU in about 3 minutes)."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "bench" / "gpu.py")
  gpu = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(gpu)
  table = gpu.headline()
  assert set(gpu.ROWS) | {"auto-7b"} <= set(table), table
  for key in ("bare", "fp8", "text", "moe"):
    assert gpu._number(table[key][0]) and table[key][1] != "—", table[key]
  out = subprocess.run(
    [sys.executable, "bench/gpu.py", "--only", "bare,nope"], cwd=ROOT, capture_output=True, text=True, timeout=60
  )
  assert out.returncode == 2 and "unknown rows ['nope']" in out.stderr, out.stderr
