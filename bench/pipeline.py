"""Pipeline parallelism on emulated CPU devices: step time with and without it, and the bubble measured.

Run from the repository root (it sets 8 emulated CPU devices itself):

  python bench/pipeline.py                 # the default model: 8 layers, d_model 256, batch 32 × 128
  python bench/pipeline.py --steps 8 --layers 16

Everything runs in one process, side by side, on the same global batch:

1. Step time (median of ``--steps`` after a warm-up) of the plain mesh
   (fsdp 8), of gradient accumulation on it, of GPipe on stage 2 × fsdp 4
   and stage 4 × fsdp 2 for several microbatch counts M, and of the circular
   schedule (repeats 2).
2. The bubble, measured: at a fixed global batch, a pipeline step takes
   ``T(M) = T0 + W · (R·M + S − 1) / (R·M)``: ``T0`` outside the layer
   stack (embedding, head, optimizer), ``W`` the stage work of the whole
   batch, ``(R·M + S − 1)`` iterations of ``1/(R·M)`` of it each. ``T0`` and
   ``W`` are fitted to the measured ``T(M)`` (least squares), and the
   measured idle share of the loop is ``1 − W / (T(M) − T0)``, printed
   beside the formula ``(S − 1) / (R·M + S − 1)``. GPipe only: an
   iteration of the circular schedule also re-picks the stage's weights
   and runs its forward twice (``parallel/pipeline.py``), costs this
   two-term model does not have.

Emulated devices share this host's cores, so the bubble's iterations cost
time here as compute on dummy microbatches does on a pod (every stage runs
every iteration in the SPMD program); absolute times say nothing about a
pod's.
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
import numpy as np  # noqa: E402
import optax  # noqa: E402

import distrib_train as dt  # noqa: E402
from distrib_train.microbatches import bubble_fraction  # noqa: E402
from distrib_train.recipes import llama  # noqa: E402


def sharded_step(cfg: llama.LlamaConfig, axes: dict, batch: int, length: int, **options):
  """The tiny Llama's step on 8 devices laid out as ``axes`` (data, fsdp, tensor 1 unless given):
  ``(mesh, rules, plan, state, step, placed batch)``. ``options`` go to ``build_train_step_fn``."""
  sizes = {"data": 1, "fsdp": 1, "tensor": 1, **axes}
  mesh = dt.build_mesh(dt.MeshConfig.from_dict({"axes": sizes, "rules": "fsdp_tensor", "devices": 8}))
  rules = dt.AxisRules("fsdp_tensor")
  make = lambda: dt.TrainState.initial_state(cfg.build(0), optax.adam(1e-3), jax.random.key(0))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, length)).astype(np.int32)
  inputs = {"tokens": tokens, "targets": np.roll(tokens, -1, 1)}
  plan = dt.MeshPlanner(mesh, rules).plan(
    jax.eval_shape(make), loss_fn=llama.loss_fn, inputs=inputs, input_axes=llama.INPUT_AXES
  )
  step = dt.build_train_step_fn(
    llama.loss_fn,
    donate_params_and_state=True,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
    **options,
  )
  placed = {k: jax.device_put(v, plan.input_kwarg_shardings[k]) for k, v in inputs.items()}
  return mesh, rules, plan, plan.init(make), step, placed


def step_time(
  cfg: llama.LlamaConfig, axes: dict, batch: int, length: int, microbatches: int, repeats: int, steps: int
) -> float:
  mesh, rules, _, state, step, placed = sharded_step(
    cfg, axes, batch, length, microbatches=microbatches, pipeline_repeats=repeats, microbatch_weight="tokens"
  )
  times = []
  with dt.activation_sharding(mesh, rules):
    for i in range(steps + 1):
      start = time.perf_counter()
      state, aux = step(state, **placed)
      jax.block_until_ready(aux["loss"])
      if i:  # the first call compiles
        times.append(time.perf_counter() - start)
  return statistics.median(times)


def fit(rows: list[tuple[float, float]]) -> tuple[float, float]:
  """``T0, W`` of ``T = T0 + W · x`` by least squares over ``(x, T)`` rows."""
  x = np.array([r[0] for r in rows])
  y = np.array([r[1] for r in rows])
  w, t0 = np.polyfit(x, y, 1)
  return float(t0), float(w)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--d_model", type=int, default=256)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--length", type=int, default=128)
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()
  cfg = dataclasses.replace(
    llama.PRESETS["tiny"],
    num_layers=args.layers,
    d_model=args.d_model,
    num_heads=8,
    num_kv_heads=4,
    head_dim=args.d_model // 8,
    mlp_dim=3 * args.d_model,
    max_seq_len=args.length,
  )
  print(
    f"model: {cfg.num_params():,} params, {args.layers} layers, d_model {args.d_model}; global batch"
    f" {args.batch} × {args.length}; {jax.device_count()} emulated CPU devices on {os.cpu_count()} cores"
  )
  print(f"{'mesh':<22} {'schedule':<12} {'M':>3} {'step ms':>9} {'vs plain':>9} {'bubble (formula)':>17}")
  plain = step_time(cfg, {"fsdp": 8}, args.batch, args.length, 1, 1, args.steps)
  print(f"{'fsdp 8':<22} {'-':<12} {1:>3} {plain * 1e3:>9.1f} {1.0:>9.2f} {'-':>17}")
  accumulated = step_time(cfg, {"fsdp": 8}, args.batch, args.length, 4, 1, args.steps)
  print(f"{'fsdp 8':<22} {'accumulate':<12} {4:>3} {accumulated * 1e3:>9.1f} {accumulated / plain:>9.2f} {'-':>17}")
  for stages in (2, 4):
    for repeats in (1, 2):
      if args.layers % (stages * repeats):
        continue
      axes = {"stage": stages, "fsdp": 8 // stages}
      rows = []
      for m in (stages, 2 * stages, 4 * stages, 8 * stages):
        if args.batch % m or (args.batch // m) % (8 // stages):
          continue
        t = step_time(cfg, axes, args.batch, args.length, m, repeats, args.steps)
        rows.append((m, t))
        name = "gpipe" if repeats == 1 else f"circular R{repeats}"
        print(
          f"{f'stage {stages} × fsdp {8 // stages}':<22} {name:<12} {m:>3} {t * 1e3:>9.1f} {t / plain:>9.2f}"
          f" {bubble_fraction(stages, m, repeats):>17.1%}"
        )
      if repeats > 1:
        print(
          "  (no fit for the circular schedule: each of its iterations also re-picks the stage's weights and"
          " re-runs its forward for the backward pass, a per-iteration cost the two-term model lacks)"
        )
        continue
      if len(rows) < 3:
        continue
      t0, w = fit([((repeats * m + stages - 1) / (repeats * m), t) for m, t in rows])
      print(f"  fit: T0 {t0 * 1e3:.1f} ms outside the stages, W {w * 1e3:.1f} ms of stage work per step")
      for m, t in rows:
        measured = 1 - w / (t - t0)
        print(f"    M {m:>2}: measured bubble {measured:6.1%}, formula {bubble_fraction(stages, m, repeats):6.1%}")


if __name__ == "__main__":
  main()
