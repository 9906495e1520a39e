"""A mixture of experts' train step against the dense model's of equal active size, side by side in one process.

Run from the repository root (CPU, 8 emulated devices by default):

  python bench/moe_step.py
  python bench/moe_step.py --d_model 512 --expert_mlp_dim 1024 --seq_len 512 --batch 16 --steps 10
  python bench/moe_step.py --cpu_devices 0 --d_model 1024 --layers 12 --expert_mlp_dim 2816 --seq_len 2048 \\
      --batch 8 --dtype bfloat16 --heads 16 --vocab 32000
      # the shape bench/RESULTS.md compiles for an H100 (16 heads of 64, 32,000 tokens), on whatever
      # accelerator is there; with the default --heads and --vocab, 4 heads of 256 and 4,096 tokens
  (add --fp8 current: model.fp8 for both models; --profile DIR: then where each model's device time goes)

Each model is the trainer's own job (``Trainer._plan``: the preset with the
overrides below, the planner, ``build_train_step_fn`` with donation), stepped
on the trainer's first synthetic batch:

- dense: the ``tiny`` Llama with ``mlp_dim`` = ``experts_per_token ×
  expert_mlp_dim`` on ``cpu-8`` (data 8);
- moe: the ``tiny`` mixture (8 experts, top 2, dropless) with that
  ``expert_mlp_dim`` on ``cpu-8`` (no expert axis: grouped matmuls only) and
  on ``cpu-8-expert`` (expert 4 × data 2: the all-to-all too).

Rounds alternate the models (``--rounds``), so drift of a busy host falls on
all of them; each figure is the median step of its rounds. It prints tokens/s
and MoE / dense. The issue's target on one H100 is ≥ 0.75 × dense.

Not for: the compiled program's FLOPs and all-to-all bytes on a pod
(``distrib-train plan --config mixtral-8x7b-tpu``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _sets(args: argparse.Namespace, moe: bool, mesh: str) -> list[str]:
  model = [
    f"model.d_model={args.d_model}",
    f"model.num_layers={args.layers}",
    f"model.num_heads={args.heads}",
    f"model.num_kv_heads={args.kv_heads or args.heads}",
    f"model.head_dim={args.head_dim or args.d_model // args.heads}",
    f"model.max_seq_len={args.seq_len}",
    f"model.dtype={args.dtype}",
    f"model.vocab_size={args.vocab}",
    f"model.fp8={args.fp8}",
  ]
  if moe:
    model += [f"model.expert_mlp_dim={args.expert_mlp_dim}", "model.num_experts=8", "model.experts_per_token=2"]
  else:
    model.append(f"model.mlp_dim={2 * args.expert_mlp_dim}")
  data = [
    "data.source=synthetic",
    f"data.seq_len={args.seq_len}",
    f"data.global_batch_size={args.batch}",
    "data.num_workers=0",
  ]
  return model + data + ([f"mesh_config={mesh}"] if mesh else [])


def _stepper(name: str, sets: list[str]):
  """The trainer's compiled step for ``name`` with ``sets``, its state and first batch: ``(run(n) → seconds)``."""
  import jax

  from distrib_train.config import run as config_lib
  from trainer_loop import trainer_step

  step, state, batch = trainer_step(config_lib.load(name, config_lib.parse_overrides(sets)))
  holder = {"state": state}

  def run(steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
      holder["state"], aux = step(holder["state"], **batch)
    jax.block_until_ready((holder["state"], aux))
    return (time.perf_counter() - start) / steps

  run(1)  # warm-up
  return run


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cpu_devices", type=int, default=8, help="emulated CPU devices (0: the accelerator)")
  parser.add_argument("--d_model", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv_heads", type=int, default=0, help="0: --heads")
  parser.add_argument("--head_dim", type=int, default=0, help="0: d_model / heads")
  parser.add_argument("--vocab", type=int, default=4096)
  parser.add_argument("--expert_mlp_dim", type=int, default=512)
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--fp8", default="none", help="model.fp8 of both models: none, current or delayed")
  parser.add_argument("--steps", type=int, default=5, help="steps per round")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--json", help="write the figures here")
  parser.add_argument(
    "--profile",
    default="",
    help="then trace 2 steps of each model under this folder and print"
    " its device time by kernel and category (bench/profile_step.py's summary)",
  )
  args = parser.parse_args(argv)
  from distrib_train.cluster import distributed

  distributed.initialize(cpu_devices=args.cpu_devices or None)
  on_cpu = bool(args.cpu_devices)
  mesh = "cpu-8" if on_cpu else "gpu-1"
  models = {"dense": ("tiny", _sets(args, False, mesh)), "moe": ("moe-tiny", _sets(args, True, mesh))}
  if on_cpu:
    models["moe, expert 4 × data 2"] = ("moe-tiny", _sets(args, True, "cpu-8-expert"))
  steppers = {label: _stepper(*spec) for label, spec in models.items()}
  times: dict[str, list[float]] = {label: [] for label in steppers}
  for _ in range(args.rounds):
    for label, run in steppers.items():
      times[label].append(run(args.steps))
  tokens = args.batch * args.seq_len
  out = {
    label: {"step_ms": 1000 * statistics.median(t), "tokens_per_s": tokens / statistics.median(t)}
    for label, t in times.items()
  }
  print(
    f"d_model {args.d_model}, {args.layers} layers, 8 experts top 2 × {args.expert_mlp_dim} against a dense MLP"
    f" of {2 * args.expert_mlp_dim}; batch {args.batch} × {args.seq_len}, {args.dtype}, fp8 {args.fp8}"
  )
  for label, figures in out.items():
    ratio = figures["tokens_per_s"] / out["dense"]["tokens_per_s"]
    print(
      f"  {label:<24} {figures['step_ms']:9.1f} ms/step {figures['tokens_per_s']:>11,.0f} tokens/s  {ratio:.3f} × dense"
    )
  if args.profile:
    out["profiles"] = {
      label: _profile(run, pathlib.Path(args.profile) / f"model{i}", label)
      for i, (label, run) in enumerate(steppers.items())
    }
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({"args": vars(args), "results": out}, indent=1))


def _profile(run, folder: pathlib.Path, label: str, steps: int = 2) -> dict:
  """Traces ``steps`` steps of ``run`` into ``folder`` and prints, then returns, the trace's summary."""
  import profile_step

  summary = profile_step.trace(lambda: run(steps), str(folder), steps, top=30)
  print(f"--- {label}")
  profile_step.print_summary(summary)
  return summary


if __name__ == "__main__":
  for path in (str(ROOT), str(ROOT / "bench")):
    if path not in sys.path:
      sys.path.insert(0, path)
  main()
