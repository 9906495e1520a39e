"""Muon against AdamW: the step's cost in the compilers' plans and on CPU, and the loss it reaches.

Run from the repository root (no accelerator needed):

  python bench/muon.py --plan llama-7b-tpu      # libtpu's plan, AdamW and Muon side by side (v5e-256)
  DISTRIB_TRAIN_CUDA_PLUGIN=.ci-venv/cuda-plugin python bench/muon.py --plan llama-1b-gpu   # XLA's CUDA compiler
  python bench/muon.py --cpu_step               # the tiny Llama's step on 8 CPU devices, timed, alternating
  python bench/muon.py --quality                # the demo corpus: a learning-rate sweep of each, steps to a loss

``--plan`` runs ``distrib-train plan`` for the preset twice, each a fresh process (``optimizer.name`` adamw,
then muon), and prints the plan's step-time estimate, its collectives' wire bytes per device (all of them, and
those of the optimizer's own scope: Muon's Newton–Schulz) and the memory per device, with the ratios.

``--cpu_step`` times the same step with each optimizer, in rounds of alternating blocks of steps (so a busy
machine slows both alike), and prints the median step time of each and their ratio.

``--quality`` trains the demo config (``tiny``: the byte-level Llama on the pydoc corpus, 200 steps) with
AdamW at each of ``--adamw_lrs`` and Muon at each of ``--muon_lrs``, evaluating every ``--eval_every`` steps,
takes each optimizer's best final held-out loss, and prints the first evaluated step where Muon's best run
reaches AdamW's best final loss, as a fraction of AdamW's steps (the issue's target: ≤ 0.8).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

_ROOT = pathlib.Path(__file__).resolve().parents[1]
GiB = 2**30


def _plan(preset: str, optimizer: str, extra: list[str]) -> dict:
  """``distrib-train plan --json`` of ``preset`` with ``optimizer`` and ``extra`` flags, in a fresh process."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "plan.json")
    command = [
      sys.executable,
      "-m",
      "distrib_train",
      "plan",
      "--config",
      preset,
      "--json",
      out,
      f"--set=optimizer.name={optimizer}",
      *extra,
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR="")
    env.pop("XLA_FLAGS", None)
    plugin = os.environ.get("DISTRIB_TRAIN_CUDA_PLUGIN")
    if plugin and preset.endswith("-gpu"):
      env["PYTHONPATH"] = os.pathsep.join([plugin, str(_ROOT)])
    done = subprocess.run(command, cwd=_ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
      print(done.stderr[-3000:], file=sys.stderr)
      raise SystemExit(f"{preset} with {optimizer}: plan failed with exit status {done.returncode}")
    return json.loads(pathlib.Path(out).read_text())


def plan(presets: list[str], extra: list[str]) -> None:
  print("| preset | optimizer | step (plan) | wire GB/device/step (optimizer's) | GiB/device | step vs AdamW |")
  print("|---|---|---|---|---|---|")
  for preset in presets:
    base = None
    for optimizer in ("adamw", "muon"):
      p = _plan(preset, optimizer, extra)
      step = p["time"]["step_s"] if p.get("time") else float("nan")
      base = step if base is None else base
      wire = p.get("wire_bytes", {})
      total = sum(wire.get(k, 0.0) for k in ("ici", "dcn"))
      print(
        f"| {preset} ({p['topology']['name'] if p.get('topology') else p['devices']}) | {optimizer} |"
        f" {step * 1e3:.1f} ms | {total / 1e9:.2f} ({p.get('optimizer_wire_bytes', 0.0) / 1e9:.2f}) |"
        f" {p['memory']['total'] / GiB:.2f} | {step / base:.3f} |",
        flush=True,
      )


def cpu_step(rounds: int, block: int) -> None:
  medians = time_steps({"adamw": ["optimizer.name=adamw"], "muon": ["optimizer.name=muon"]}, rounds, block)
  print(f"muon / adamw: {medians['muon'] / medians['adamw']:.3f}")


def time_steps(variants: dict[str, list[str]], rounds: int, block: int, preset: str = "tiny") -> dict[str, float]:
  """The median seconds per step of each variant (``preset`` + its overrides) on the preset's mesh, timed in
  rounds of alternating blocks of ``block`` steps (the first round compiles and warms up)."""
  import jax
  import numpy as np

  import distrib_train as dt
  from distrib_train import data
  from distrib_train.sharding.axis_rules import activation_sharding
  from distrib_train.sharding.mesh import MeshConfig, build_mesh, find_mesh_config
  from distrib_train.config import run as config_lib
  from distrib_train.config import job as job_lib

  runs = {}
  for name, overrides in variants.items():
    config = config_lib.load(preset, overrides)
    mesh_config = MeshConfig.from_yaml(find_mesh_config(config.mesh_config))
    mesh = build_mesh(mesh_config)
    job = job_lib.job_spec(config)
    planner = dt.MeshPlanner(mesh, job_lib.rules_for(config, mesh_config))
    plan_ = job_lib.plan_job(job, planner)
    step = dt.build_train_step_fn(
      job.loss_fn,
      donate_params_and_state=True,
      train_state_shardings=plan_.train_state_shardings,
      input_kwarg_shardings=plan_.input_kwarg_shardings,
      **job_lib.step_options(job, plan_, planner.rules),
    )
    loader = data.DataLoader(config.data_config(), plan_.input_kwarg_shardings)
    batch = next(loader)
    loader.close()
    runs[name] = [step, plan_.init(job.make_state), batch, (mesh, planner.rules), []]
  for r in range(rounds + 1):  # the first round compiles and warms up
    for name, run in runs.items():
      step, state, batch, rules, times = run
      with activation_sharding(*rules):
        start = time.perf_counter()
        for _ in range(block):
          state, aux = step(state, **batch)
        jax.block_until_ready(aux["loss"])
      run[1] = state
      if r:
        times.append((time.perf_counter() - start) / block)
  medians = {name: statistics.median(run[4]) for name, run in runs.items()}
  for name, seconds in medians.items():
    print(f"{name}: {seconds * 1e3:.2f} ms/step (median of {rounds} blocks of {block})")
  del np
  return medians


def _train(optimizer: str, lr: float, steps: int, eval_every: int, workdir: pathlib.Path) -> dict[int, float]:
  from distrib_train.config import run as config_lib
  from distrib_train.train.trainer import Trainer

  config = config_lib.load(
    "tiny",
    [
      f"optimizer.name={optimizer}",
      f"optimizer.learning_rate={lr}",
      f"train.steps={steps}",
      f"train.eval_every={eval_every}",
      "train.eval_batches=4",
      "train.checkpoint_every=0",
      f"train.log_every={eval_every}",
    ],
  )
  Trainer(config, workdir, console=io.StringIO()).run()
  lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {m["step"]: m["eval/loss"] for m in lines if "eval/loss" in m}


def quality(adamw_lrs: list[float], muon_lrs: list[float], steps: int, eval_every: int) -> None:
  curves = {}
  with tempfile.TemporaryDirectory() as tmp:
    for optimizer, lrs in (("adamw", adamw_lrs), ("muon", muon_lrs)):
      for lr in lrs:
        curve = _train(optimizer, lr, steps, eval_every, pathlib.Path(tmp) / f"{optimizer}-{lr}")
        curves[optimizer, lr] = curve
        print(f"{optimizer} lr {lr:g}: " + ", ".join(f"{s}: {v:.4f}" for s, v in sorted(curve.items())), flush=True)
  best = {
    name: min(((lr, c) for (o, lr), c in curves.items() if o == name), key=lambda x: x[1][steps])
    for name in ("adamw", "muon")
  }
  (a_lr, a_curve), (m_lr, m_curve) = best["adamw"], best["muon"]
  target = a_curve[steps]
  reached = next((s for s, v in sorted(m_curve.items()) if v <= target), None)
  print(f"best AdamW: lr {a_lr:g}, final eval loss {target:.4f}; best Muon: lr {m_lr:g}, final {m_curve[steps]:.4f}")
  if reached is None:
    print(f"Muon does not reach AdamW's final loss in {steps} steps")
  else:
    print(f"Muon reaches it at step {reached}: {reached / steps:.2f} × AdamW's steps (target ≤ 0.8)")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--plan", nargs="*", default=None, help="presets to plan (llama-7b-tpu, llama-1b-gpu)")
  parser.add_argument("--set", action="append", default=[], help="more config overrides for --plan")
  parser.add_argument("--cpu_step", action="store_true")
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--block", type=int, default=5)
  parser.add_argument("--quality", action="store_true")
  parser.add_argument("--adamw_lrs", type=float, nargs="*", default=[3e-3, 1e-2, 3e-2])
  parser.add_argument("--muon_lrs", type=float, nargs="*", default=[1e-2, 3e-2, 1e-1])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--eval_every", type=int, default=10)
  args = parser.parse_args(argv)
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax: cpu-8's devices
  import jax

  print(
    f"muon bench: {os.cpu_count()} CPU cores, python {platform.python_version()}, jax {jax.__version__}", flush=True
  )
  if args.plan is not None:
    plan(args.plan or ["llama-7b-tpu", "llama-1b-gpu"], [f"--set={s}" for s in args.set])
  if args.cpu_step:
    cpu_step(args.rounds, args.block)
  if args.quality:
    quality(args.adamw_lrs, args.muon_lrs, args.steps, args.eval_every)
  return 0


if __name__ == "__main__":
  sys.exit(main())
