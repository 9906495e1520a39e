"""Multi-token prediction's cost: the step with ``model.mtp_depth: 1`` against without, beside its FLOP share.

Run from the repository root (no accelerator needed):

  python bench/mtp.py --plan llama-7b-tpu     # libtpu's plan (v5e-256): the step-time estimate of each
  python bench/mtp.py --cpu_step              # the tiny Llama on 8 CPU devices, timed in alternating blocks

The issue's target: depth 1 costs at most 1 + its FLOP share, the share being the model's own count
(``flops_per_token``: the MTP module's projection, its decoder layer and the shared head again, per token).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import muon as muon_bench  # bench/muon.py: the plan runner and the alternating step timer


def flop_share(preset: str) -> float:
  """``flops_per_token`` with MTP depth 1 over without, less 1, for ``preset`` at its sequence length."""
  from distrib_train.recipes.family import family_of
  from distrib_train.config import run as config_lib

  counts = []
  for depth in (0, 1):
    config = config_lib.load(preset, [f"model.mtp_depth={depth}"], training=False)
    counts.append(family_of(config.model_recipe().config).flops_per_token(config.data.seq_len))
  return counts[1] / counts[0] - 1


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--plan", nargs="*", default=None, help="presets to plan (default llama-7b-tpu)")
  parser.add_argument("--cpu_step", action="store_true")
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--block", type=int, default=5)
  args = parser.parse_args(argv)
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import jax

  print(f"mtp bench: {os.cpu_count()} CPU cores, python {platform.python_version()}, jax {jax.__version__}", flush=True)
  print("| preset | where | step, depth 0 | step, depth 1 | ratio | 1 + FLOP share | within |")
  print("|---|---|---|---|---|---|---|")
  rows = []
  for preset in (args.plan or ["llama-7b-tpu"]) if args.plan is not None else []:
    steps = [muon_bench._plan(preset, "adamw", [f"--set=model.mtp_depth={d}"])["time"]["step_s"] for d in (0, 1)]
    rows.append((preset, "plan", *steps, flop_share(preset)))
  if args.cpu_step:
    medians = muon_bench.time_steps({"0": ["model.mtp_depth=0"], "1": ["model.mtp_depth=1"]}, args.rounds, args.block)
    rows.append(("tiny", "CPU, 8 devices", medians["0"], medians["1"], flop_share("tiny")))
  for preset, where, base, mtp, share in rows:
    print(
      f"| {preset} | {where} | {base * 1e3:.1f} ms | {mtp * 1e3:.1f} ms | {mtp / base:.3f} | {1 + share:.3f} |"
      f" {'yes' if mtp / base <= 1 + share else 'no'} |",
      flush=True,
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
