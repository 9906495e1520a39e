"""Context parallelism on emulated CPU devices: ring against all-gather attention, by sequence length.

Run from the repository root (it sets 8 emulated CPU devices itself):

  python bench/context.py                  # lengths 1024, 2048, 4096 on context 4 × fsdp 2
  python bench/context.py --lengths 2048 8192 --steps 3

For each length, side by side in one process: the median step time (after
the compile) of the tiny Llama on one device-group layout without a context
axis (fsdp 8), and on context 4 × fsdp 2 with ring and with all-gather
attention, at the same global batch, plus each compiled step's temporaries
per device. Emulated devices share this host's cores, so the ring's overlap
of transfer and compute cannot show here; the memory column and the
relative cost of the two attentions' extra work can.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import distrib_train as dt  # noqa: E402
from distrib_train.recipes import llama  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline import sharded_step  # noqa: E402  (bench/pipeline.py)


def measure(cfg: llama.LlamaConfig, axes: dict, batch: int, length: int, steps: int) -> tuple[float, int]:
  mesh, rules, plan, state, step, placed = sharded_step(cfg, axes, batch, length)
  inputs = placed
  with dt.activation_sharding(mesh, rules):
    abstract = {
      k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=plan.input_kwarg_shardings[k]) for k, v in inputs.items()
    }
    temporaries = step.compile(plan.abstract_train_state, **abstract).memory_analysis().temp_size_in_bytes
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      state, aux = step(state, **placed)
      jax.block_until_ready(aux["loss"])
      times.append(time.perf_counter() - start)
  return statistics.median(times), temporaries


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
  parser.add_argument("--batch", type=int, default=8, help="a multiple of 8 (the fsdp 8 layout splits it)")
  parser.add_argument("--steps", type=int, default=3)
  args = parser.parse_args()
  base = dataclasses.replace(llama.PRESETS["tiny"], max_seq_len=max(args.lengths))
  print(
    f"tiny Llama ({base.num_params():,} params), global batch {args.batch}; 8 emulated CPU devices on"
    f" {os.cpu_count()} cores; median of {args.steps} steps after the compile"
  )
  print(f"{'length':>7} {'layout':<26} {'step ms':>9} {'vs fsdp 8':>10} {'temporaries MiB':>16}")
  for length in args.lengths:
    plain, plain_temps = measure(base, {"fsdp": 8}, args.batch, length, args.steps)
    print(f"{length:>7} {'fsdp 8':<26} {plain * 1e3:>9.1f} {1.0:>10.2f} {plain_temps / 2**20:>16.1f}")
    for implementation in ("ring", "all_gather"):
      cfg = dataclasses.replace(base, context_attention=implementation)
      t, temps = measure(cfg, {"context": 4, "fsdp": 2}, args.batch, length, args.steps)
      print(
        f"{length:>7} {f'context 4 × fsdp 2, {implementation}':<26} {t * 1e3:>9.1f} {t / plain:>10.2f}"
        f" {temps / 2**20:>16.1f}"
      )


if __name__ == "__main__":
  main()
