"""Every shipped TPU preset on its mesh config: libtpu's figures against the CPU-emulated estimate.

Run from the repository root on any host with libtpu (``pip install
'jax[tpu]'``; no TPU needed):

  python bench/tpu_presets.py                       # every llama-*-tpu preset on its own mesh config
  python bench/tpu_presets.py --presets llama-7b-tpu --no_emulate

For each preset it runs ``distrib-train plan`` twice, each a fresh process:
once with libtpu's compiler for the mesh config's topology, once with
``--emulate`` (CPU devices, the figures corrected as ``estimate.py`` says),
and prints one row: the topology, the memory per chip by libtpu and by
emulation (and their ratio), whether it fits, the compile and wall times,
and libtpu's estimated step time. Exit status 1 if a preset does not fit
its chips by libtpu's figures.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


def _presets() -> list[str]:
  paths = glob.glob(os.path.join(_REPO_ROOT, "distrib_train", "configs", "*-tpu.yaml"))
  return sorted((os.path.basename(p)[:-5] for p in paths), key=lambda n: (len(n), n))


def _plan(preset: str, emulate: bool, extra: list[str]) -> tuple[dict, float]:
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "plan.json")
    command = [sys.executable, "-m", "distrib_train", "plan", "--config", preset, "--json", out, *extra]
    if emulate:
      command.append("--emulate")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR="")
    start = time.perf_counter()
    done = subprocess.run(command, cwd=_REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
      print(done.stderr[-3000:], file=sys.stderr)
      raise SystemExit(f"{preset}{' --emulate' if emulate else ''}: plan failed with exit status {done.returncode}")
    with open(out, encoding="utf-8") as f:
      return json.load(f), wall


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--presets", nargs="*", default=None, help="default: every llama-*-tpu preset")
  parser.add_argument("--no_emulate", action="store_true", help="libtpu only (skip the CPU-emulated plan)")
  parser.add_argument("--set", action="append", default=[])
  args = parser.parse_args(argv)
  import jax

  extra = [f"--set={item}" for item in args.set]
  print(
    f"tpu_presets: {os.cpu_count()} CPU cores, python {platform.python_version()}, jax {jax.__version__}", flush=True
  )
  header = (
    "| preset | mesh config | topology | chips | libtpu GiB/chip (temporaries) | CPU-emulated GiB/chip"
    " | libtpu / emulated | fits | libtpu compile / wall | emulated wall | libtpu step, MFU |"
  )
  rows, misfits = [header, "|" + "---|" * (header.count("|") - 1)], []
  for preset in args.presets or _presets():
    tpu, tpu_wall = _plan(preset, False, extra)
    emulated, emulated_wall = (None, None) if args.no_emulate else _plan(preset, True, extra)
    memory = tpu["memory"]
    total = memory["total"] / GiB
    row = [
      preset,
      tpu["mesh_config"],
      tpu["topology"]["name"] + (f" × {tpu['topology']['slices']}" if tpu["topology"]["slices"] > 1 else ""),
      str(tpu["devices"]),
      f"{total:.2f} ({memory['temporaries'] / GiB:.2f})",
    ]
    if emulated is not None:
      other = emulated["memory"]["total"] / GiB
      row += [f"{other:.2f}", f"{total / other:.2f}"]
    else:
      row += ["-", "-"]
    compile_s = tpu["timings"].get("compile_s")  # absent where libtpu refused the step for memory
    row += [
      "yes" if memory["fits"] else f"NO ({memory['usable'] / GiB:.2f} usable)",
      f"{'refused' if compile_s is None else f'{compile_s:.0f} s'} / {tpu_wall:.0f} s",
      "-" if emulated_wall is None else f"{emulated_wall:.0f} s",
      f"{tpu['time']['step_s']:.3g} s, {tpu['time']['mfu']:.1%}" if tpu.get("time") else "-",
    ]
    rows.append("| " + " | ".join(row) + " |")
    print(rows[-1], flush=True)
    if not memory["fits"]:
      misfits.append(preset)
  print("\n".join(["", *rows]))
  if misfits:
    print(f"does not fit its chips: {', '.join(misfits)}")
  return 1 if misfits else 0


if __name__ == "__main__":
  sys.exit(main())
