"""Where a training step's device time goes: a profile of the framework step, summarised.

Run from the repository root:

  python bench/profile_step.py --shape 1b --settings 'scan=0,batch=16' --out /tmp/prof
  JAX_PLATFORMS=cpu python bench/profile_step.py --shape tiny --steps 2   # CPU smoke

Builds the framework step of ``bench/train_throughput.py`` for one shape and
setting, warms it up, traces ``--steps`` steps with ``jax.profiler`` (a
Perfetto JSON trace beside the usual TensorBoard files) and reads the trace
back without TensorBoard: device ops are summed per kernel name and per
category (matmul, attention, elementwise/reduction fusions, copies, other),
with the share of the device-busy time, and the step time is split into
device-busy time and idle gaps. The largest ops are listed with their HLO
names so a lever can be aimed at them.

Not for: timing comparisons (``train_throughput.py`` does those; tracing adds
a little overhead of its own).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import time
from typing import Any

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
  sys.path.insert(0, _REPO_ROOT)
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import train_throughput as tt  # noqa: E402

# Kernel-name patterns, first match wins. cuBLAS/cuBLASLt (nvjet, sm90_xmma,
# cutlass), Triton GEMM fusions, cuDNN flash attention, copies.
_CATEGORIES = (
  ("attention", re.compile(r"fmha|flash|cudnn|attention|sdpa", re.I)),
  ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|dot|matmul|convolution", re.I)),
  ("copy/transpose", re.compile(r"memcpy|memset|copy|transpose|dynamic.update.slice|dynamic.slice", re.I)),
  ("scatter/gather", re.compile(r"scatter|gather", re.I)),
  ("reduction fusion", re.compile(r"reduce", re.I)),
  ("elementwise fusion", re.compile(r"fusion|loop|convert|add|multiply", re.I)),
)


def category(name: str) -> str:
  for label, pattern in _CATEGORIES:
    if pattern.search(name):
      return label
  return "other"


def _device_pids(events: list[dict[str, Any]]) -> set[int]:
  """Trace processes that are devices (not the host's threads)."""
  pids = set()
  for event in events:
    if event.get("ph") == "M" and event.get("name") == "process_name":
      name = str(event.get("args", {}).get("name", ""))
      if "/device:" in name and "host" not in name.lower():
        pids.add(event["pid"])
  return pids


def _busy_us(intervals: list[tuple[float, float]]) -> float:
  """Length of the union of [start, end) intervals."""
  total, end = 0.0, None
  for start, stop in sorted(intervals):
    if end is None or start > end:
      total += stop - start
      end = stop
    elif stop > end:
      total += stop - end
      end = stop
  return total


def summarise(trace_path: str, steps: int, wall_s: float, top: int = 25) -> dict[str, Any]:
  """Per-kernel and per-category device time from a Perfetto JSON trace."""
  opener = gzip.open if trace_path.endswith(".gz") else open
  with opener(trace_path, "rt") as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  pids = _device_pids(events)
  thread_names = {
    (e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
    for e in events
    if e.get("ph") == "M" and e.get("name") == "thread_name"
  }
  if pids:
    ops = [e for e in events if e.get("ph") == "X" and e.get("pid") in pids and e.get("dur")]
  else:  # the CPU backend runs its ops on host threads: XLA's compute pool
    ops = [
      e
      for e in events
      if e.get("ph") == "X" and e.get("dur") and "XLAEigen" in thread_names.get((e["pid"], e.get("tid")), "")
    ]
  # A device has several lines (streams, "XLA Ops", "XLA Modules"): keep the kernel-level ones, i.e. drop
  # the module-level and op-level summaries when kernel lines exist.
  by_thread = collections.defaultdict(list)
  for event in ops:
    by_thread[thread_names.get((event["pid"], event.get("tid")), "")].append(event)
  stream_lines = [name for name in by_thread if "stream" in name.lower()]
  chosen = stream_lines or [name for name in by_thread if "module" not in name.lower()] or list(by_thread)
  kernels = [e for name in chosen for e in by_thread[name]]
  per_name = collections.Counter()
  per_name_count = collections.Counter()
  hlo_of = {}
  for event in kernels:
    name = event["name"]
    per_name[name] += event["dur"]
    per_name_count[name] += 1
    args = event.get("args", {})
    hlo_of.setdefault(name, args.get("hlo_op") or args.get("long_name") or args.get("hlo_module") or "")
  total = sum(per_name.values())
  per_cat = collections.Counter()
  for name, us in per_name.items():
    per_cat[category(f"{name} {hlo_of.get(name, '')}")] += us
  busy = _busy_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
  return {
    "trace": trace_path,
    "device_lines": sorted(chosen),
    "kernels": len(kernels),
    "step_ms_wall": wall_s / steps * 1e3,
    "busy_ms_per_step": busy / steps / 1e3,
    "kernel_ms_per_step": total / steps / 1e3,
    "categories": {
      k: {"ms_per_step": v / steps / 1e3, "share": v / total if total else 0.0} for k, v in per_cat.most_common()
    },
    "top": [
      {
        "name": n,
        "hlo": hlo_of.get(n, ""),
        "calls_per_step": per_name_count[n] / steps,
        "ms_per_step": us / steps / 1e3,
        "share": us / total if total else 0.0,
      }
      for n, us in per_name.most_common(top)
    ],
  }


def trace(run_steps, out: str, steps: int, top: int = 25) -> dict[str, Any]:
  """Runs ``run_steps()`` (``steps`` steps, blocked on) under ``jax.profiler`` into ``out`` and summarises the
  trace it wrote."""
  os.makedirs(out, exist_ok=True)
  with jax.profiler.trace(out, create_perfetto_trace=True):
    start = time.perf_counter()
    run_steps()
    wall = time.perf_counter() - start
  traces = sorted(glob.glob(os.path.join(out, "**", "perfetto_trace.json.gz"), recursive=True), key=os.path.getmtime)
  if not traces:
    raise SystemExit(f"no perfetto_trace.json.gz under {out}")
  return summarise(traces[-1], steps, wall, top)


def print_summary(summary: dict[str, Any]) -> None:
  print(f"trace {summary['trace']}  ({summary['kernels']} device ops on {', '.join(summary['device_lines'])})")
  print(
    f"step {summary['step_ms_wall']:.1f} ms wall (traced); device busy {summary['busy_ms_per_step']:.1f} ms;"
    f" kernel time {summary['kernel_ms_per_step']:.1f} ms"
  )
  print(f"{'category':<20} {'ms/step':>8} {'share':>6}")
  for name, row in summary["categories"].items():
    print(f"{name:<20} {row['ms_per_step']:8.2f} {row['share']:6.1%}")
  print(f"{'ms/step':>8} {'share':>6} {'calls':>5}  kernel  [hlo]")
  for row in summary["top"]:
    print(
      f"{row['ms_per_step']:8.2f} {row['share']:6.1%} {row['calls_per_step']:5.0f}  {row['name'][:90]}"
      f"  [{str(row['hlo'])[:60]}]"
    )


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="1b", choices=sorted(tt.SHAPES))
  parser.add_argument("--settings", default="", help="one train_throughput sweep entry, e.g. 'scan=0,batch=16'")
  parser.add_argument("--steps", type=int, default=3, help="traced steps")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--out", default="/tmp/distrib_train_profile", help="trace directory")
  parser.add_argument("--json", help="write the summary here")
  args = parser.parse_args(argv)
  shape = tt.SHAPES[args.shape]
  on_gpu = jax.devices()[0].platform == "gpu"
  preset = tt.dt.recipes.llama.PRESETS[shape.preset]
  base = tt.Setting(
    remat=preset.remat,
    scan=True,
    attention="cudnn" if on_gpu else "xla",
    loss_chunk=preset.loss_chunk_size,
    batch=shape.batch,
  )
  setting = tt.parse_setting(args.settings, base)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, preset.vocab_size, (setting.batch, shape.seq_len), dtype=np.int32)
  targets = rng.integers(0, preset.vocab_size, (setting.batch, shape.seq_len), dtype=np.int32)
  mesh = tt.dt.build_mesh(tt.dt.MeshConfig(("data", "fsdp", "tensor"), (-1, 1, 1)))
  run = tt.FrameworkRun(shape, setting, mesh, tokens, targets)
  print(
    f"{args.shape} {setting.label()}: compiled in {run.compile_s:.1f} s, temporaries {run.temp_gib} GiB", flush=True
  )
  for _ in range(args.warmup):
    run.step()
  run.block()

  def steps() -> None:
    for _ in range(args.steps):
      run.step()
    run.block()

  summary = trace(steps, args.out, args.steps, args.top)
  summary.update(shape=args.shape, setting=setting.label(), device=jax.devices()[0].device_kind, jax=jax.__version__)
  print_summary(summary)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(summary, f, indent=1)


if __name__ == "__main__":
  main()
