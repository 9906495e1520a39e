"""How long ``distrib-train plan`` takes for a large model on a pod-sized target.

Run from the repository root (CPU only; nothing is allocated on a device):

  python bench/plan_bench.py                                   # llama-7b-tpu on tpu-v5e-256: 256 devices
  python bench/plan_bench.py --config llama-7b-tpu --mesh_config tpu-v5p-1024-2slices
  python bench/plan_bench.py --recommend --max_compiles 6      # time --recommend instead

A TPU mesh config compiles with libtpu for its topology (``--emulate``: on
emulated CPU devices instead). Each repeat is a fresh ``distrib-train plan``
process (emulated devices are fixed when JAX starts), timed from launch to
exit; the phases come from its ``--json``. Targets: a 7B preset on 256
devices in under 5 minutes on a 2-core machine (emulated), a 70B on 1,024
chips in under 10 (libtpu).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_S = 300.0


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="llama-7b-tpu")
  parser.add_argument("--mesh_config", default="tpu-v5e-256")
  parser.add_argument("--devices", type=int, default=None, help="default: the mesh config's")
  parser.add_argument("--device_kind", default=None)
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--recommend", action="store_true")
  parser.add_argument("--emulate", action="store_true", help="emulated CPU devices, not libtpu")
  parser.add_argument("--max_compiles", type=int, default=6)
  parser.add_argument("--set", action="append", default=[])
  args = parser.parse_args(argv)
  import jax

  print(
    f"plan_bench: {args.config} on {args.mesh_config}{' --recommend' if args.recommend else ''}"
    f"{' --emulate' if args.emulate else ''};"
    f" {os.cpu_count()} CPU cores, python {platform.python_version()}, jax {jax.__version__}",
    flush=True,
  )
  rows = []
  for repeat in range(args.repeats):
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "plan.json")
      command = [
        sys.executable,
        "-m",
        "distrib_train",
        "plan",
        "--config",
        args.config,
        "--mesh_config",
        args.mesh_config,
        "--json",
        out,
      ]
      for flag in ("devices", "device_kind"):
        if getattr(args, flag):
          command += [f"--{flag}", str(getattr(args, flag))]
      if args.recommend:
        command += ["--recommend", "--max_compiles", str(args.max_compiles), "--out", os.path.join(tmp, "m.yaml")]
      for item in args.set:
        command += ["--set", item]
      if args.emulate:
        command.append("--emulate")
      env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR="")
      start = time.perf_counter()
      done = subprocess.run(command, cwd=_REPO_ROOT, env=env, capture_output=True, text=True)
      wall = time.perf_counter() - start
      if done.returncode not in (0, 1):
        print(done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"plan failed with exit status {done.returncode}")
      with open(out, encoding="utf-8") as f:
        data = json.load(f)
    plans = data["ranked"] if args.recommend else [data]
    row = {"repeat": repeat, "wall_s": wall, "within_target": wall < TARGET_S}
    if args.recommend:
      row.update(candidates=data["candidates"], compiled=data["compiled"])
    else:
      row.update(
        {k: round(v, 1) for k, v in data["timings"].items()},
        devices=data["devices"],
        total_gib=data["memory"]["total"] / 2**30,
        fits=data["memory"]["fits"],
      )
    rows.append(row)
    phases = ", ".join(f"{k} {v}" for k, v in row.items() if k.endswith("_s") and k != "wall_s")
    print(
      f"repeat {repeat}: {wall:.1f} s wall ({phases or f'{len(plans)} ranked'}); target < {TARGET_S:.0f} s:"
      f" {'met' if row['within_target'] else 'NOT met'}",
      flush=True,
    )
    if not args.recommend:
      print(
        f"  {data['devices']} × {data['device_kind']}: {row['total_gib']:.2f} GiB per device,"
        f" fits {row['fits']}, step {data['time']['step_s']:.3g} s, MFU {data['time']['mfu']:.1%}",
        flush=True,
      )
  return rows


if __name__ == "__main__":
  main()
