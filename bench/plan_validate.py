"""Does ``distrib-train plan`` predict the memory a real run uses?

Run from the repository root on the machine to check (nothing beyond jax,
flax, optax, orbax and numpy is needed; grain is not):

  python bench/plan_validate.py --config llama-1b-gpu                # one GPU: the gpu-1 mesh
  JAX_PLATFORMS=cpu python bench/plan_validate.py --config tiny --steps 2 --no_cpu_prediction   # CPU smoke

Four figures, bytes per device:

1. **predicted, native**: the plan path (``podplan.plan_pod``) on this
   machine's own backend: the planner's state bytes + the batch + the
   temporaries and undonated outputs of the step compiled on abstract,
   sharded inputs. Nothing is allocated.
2. **predicted, CPU emulation**: the same through ``distrib-train plan`` in a
   CPU-only subprocess — what a laptop would have said (the CPU compiler's
   program: f32 for bf16 work, XLA attention for cuDNN). Skipped with
   ``--no_cpu_prediction`` or on CPU.
3. **real compile**: the trainer's way — sharded init of the real state,
   the step compiled ahead of time — its ``memory_analysis()``: arguments +
   temporaries + undonated outputs.
4. **real peak**: ``jax.devices()[0].memory_stats()['peak_bytes_in_use']``
   after ``--steps`` real steps on random tokens (backends that report it:
   GPU, TPU).

It prints the figures, their ratios to the real peak, and whether the native
prediction is within ``--tolerance`` (10 %) of it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
  sys.path.insert(0, _REPO_ROOT)
# As launch/slurm_gpu.sbatch and bench/train_throughput.py: jax's 75 % default is too little for large states.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="llama-1b-gpu", help="preset or YAML (default llama-1b-gpu)")
  parser.add_argument("--mesh_config", default="gpu-1", help="mesh config for this machine's devices (default gpu-1)")
  parser.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
  parser.add_argument("--steps", type=int, default=3, help="real steps before reading the peak (default 3)")
  parser.add_argument("--device_kind", default=None, help="figures for the verdict (default: this device's kind)")
  parser.add_argument("--no_cpu_prediction", action="store_true", help="skip the CPU-emulation subprocess")
  parser.add_argument("--tolerance", type=float, default=0.10, help="allowed |predicted/peak - 1| (default 0.10)")
  parser.add_argument("--json", help="write the figures here")
  return parser.parse_args(argv)


def _gib(n) -> str:
  return "-" if n is None else f"{n / 2**30:.3f} GiB"


def _cpu_prediction(args, devices: int, kind: str) -> dict:
  """``distrib-train plan`` for the same job in a CPU-only subprocess."""
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
      "--devices",
      str(devices),
      "--device_kind",
      kind,
      "--json",
      out,
    ]
    for item in args.set:
      command += ["--set", item]
    env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS="",
      CUDA_VISIBLE_DEVICES="",
      PYTHONPATH=os.pathsep.join([_REPO_ROOT, os.environ.get("PYTHONPATH", "")]),
    )
    start = time.perf_counter()
    done = subprocess.run(command, cwd=_REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
      return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    with open(out, encoding="utf-8") as f:
      data = json.load(f)
    return {
      "total": data["memory"]["total"],
      "temporaries": data["memory"]["temporaries"],
      "compiled_temporaries": data["memory"]["compiled_temporaries"],
      "seconds": time.perf_counter() - start,
      "notes": data["notes"],
    }


def _random_batch(spec, plan, vocab: int, seed: int = 0) -> dict:
  import jax
  import jax.numpy as jnp

  out = {}
  for i, (name, example) in enumerate(sorted(spec.inputs.items())):
    sharding = plan.input_kwarg_shardings[name]
    shape, dtype = example.shape, example.dtype
    if name in ("tokens", "targets"):
      make = lambda key, s=shape: jax.random.randint(key, s, 0, vocab, jnp.int32)
    elif name == "positions":
      make = lambda key, s=shape: jnp.broadcast_to(jnp.arange(s[1], dtype=jnp.int32), s)
    else:  # weights, segment_ids: one document per row, every token counted
      make = lambda key, s=shape, d=dtype: jnp.ones(s, d)
    out[name] = jax.jit(make, out_shardings=sharding)(jax.random.key(seed + i))
  return out


def main(argv=None) -> dict:
  args = parse_args(argv)
  import jax

  from distrib_train.config import run as config_lib
  from distrib_train.cluster import hardware
  from distrib_train.podplan import estimate as podplan
  from distrib_train.sharding.axis_rules import activation_sharding
  from distrib_train.sharding.mesh import MeshConfig, find_mesh_config
  from distrib_train.train_step import build_train_step_fn

  overrides = config_lib.parse_overrides(args.set)
  overrides["mesh_config"] = args.mesh_config
  config = config_lib.load(args.config, overrides)
  mesh_config = MeshConfig.from_yaml(find_mesh_config(config.mesh_config))
  device = jax.devices()[0]
  devices = len(jax.devices())
  kind = (
    hardware.device_kind(args.device_kind)
    if args.device_kind
    else (hardware.guess_device_kind(device.device_kind) or hardware.DEVICE_KINDS["h100"])
  )
  print(
    f"plan_validate: {args.config} on {devices} × {device.device_kind} ({device.platform}); jax {jax.__version__};"
    f" verdict figures: {kind.name}",
    flush=True,
  )

  # 1. The plan path on this backend: abstract inputs, nothing allocated.
  spec = podplan.step_spec(config, device.platform)
  pod = podplan.plan_pod(config, mesh_config, kind, devices, config_name=args.config, spec=spec)
  predicted = pod.memory
  print(
    f"predicted, native:  {_gib(predicted.total)} = state {_gib(predicted.state)} + batch {_gib(predicted.inputs)}"
    f" + temporaries {_gib(predicted.temporaries)} + undonated outputs {_gib(predicted.outputs_not_donated)}"
    f" (compiled in {pod.timings['compile_s']:.1f} s)",
    flush=True,
  )
  jax.clear_caches()

  # 2. What a laptop would have predicted.
  cpu = None
  if not args.no_cpu_prediction and device.platform != "cpu":
    cpu = _cpu_prediction(args, devices, kind.name)
    if "error" in cpu:
      print(f"predicted, CPU emulation: failed: {cpu['error']}", flush=True)
    else:
      print(
        f"predicted, CPU emulation: {_gib(cpu['total'])} (temporaries {_gib(cpu['temporaries'])}, CPU-compiled"
        f" {_gib(cpu['compiled_temporaries'])};"
        f" {cpu['seconds']:.0f} s)",
        flush=True,
      )

  # 3. The trainer's way: sharded init, then the step compiled ahead of time.
  plan = pod.plan
  rules = podplan.rules_for(config, mesh_config)
  start = time.perf_counter()
  state = plan.init(spec.make_state)
  state = state.replace(step=0)
  jax.block_until_ready(state)
  init_s = time.perf_counter() - start
  stats = device.memory_stats() or {}
  after_init = stats.get("bytes_in_use")
  step = build_train_step_fn(
    spec.loss_fn,
    donate_params_and_state=True,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
  )
  abstract_inputs = {
    n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=plan.input_kwarg_shardings[n]) for n, x in spec.inputs.items()
  }
  start = time.perf_counter()
  with activation_sharding(plan.mesh, rules):
    compiled = step.compile(plan.abstract_train_state.replace(step=0), **abstract_inputs)
  compile_s = time.perf_counter() - start
  analysis = compiled.memory_analysis()
  real_compile = None
  if analysis is not None:
    real_compile = (
      analysis.argument_size_in_bytes
      + analysis.temp_size_in_bytes
      + max(0, analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
      + getattr(analysis, "generated_code_size_in_bytes", 0)
    )
  print(
    f"real compile:       {_gib(real_compile)} (memory_analysis: arguments"
    f" {_gib(getattr(analysis, 'argument_size_in_bytes', None))}, temporaries"
    f" {_gib(getattr(analysis, 'temp_size_in_bytes', None))}; init {init_s:.1f} s, compile {compile_s:.1f} s);"
    f" in use after init {_gib(after_init)}",
    flush=True,
  )

  # 4. Real steps, then the allocator's peak.
  vocab = spec.family.vocab_size or 256
  batch = _random_batch(spec, plan, vocab)
  losses = []
  start = time.perf_counter()
  for _ in range(args.steps):
    state, aux = step(state, **batch)
    losses.append(float(aux["loss"]) if isinstance(aux, dict) and "loss" in aux else float("nan"))
  seconds = (time.perf_counter() - start) / max(1, args.steps)
  stats = device.memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  print(
    f"real peak:          {_gib(peak)} after {args.steps} steps (losses {', '.join(f'{x:.3f}' for x in losses)};"
    f" {seconds:.2f} s/step incl. the first); bytes_limit {_gib(stats.get('bytes_limit'))}",
    flush=True,
  )

  ratios = {}
  for name, value in (
    ("predicted_native", predicted.total),
    ("real_compile", real_compile),
    ("predicted_cpu", None if not cpu or "error" in cpu else cpu["total"]),
  ):
    if value is not None and peak:
      ratios[name] = value / peak
  if ratios:
    print("ratios to the real peak: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
  if real_compile:
    print(f"predicted, native / real compile: {predicted.total / real_compile:.3f}")
  within = None if "predicted_native" not in ratios else abs(ratios["predicted_native"] - 1) <= args.tolerance
  if within is not None:
    print(f"native prediction within {args.tolerance:.0%} of the real peak: {'yes' if within else 'NO'}")
  result = {
    "config": args.config,
    "mesh_config": args.mesh_config,
    "device": device.device_kind,
    "platform": device.platform,
    "devices": devices,
    "jax": jax.__version__,
    "predicted_native": predicted.total,
    "predicted_native_parts": {
      "state": predicted.state,
      "batch": predicted.inputs,
      "temporaries": predicted.temporaries,
      "outputs_not_donated": predicted.outputs_not_donated,
    },
    "predicted_cpu": cpu,
    "real_compile": real_compile,
    "state_after_init": after_init,
    "real_peak": peak,
    "bytes_limit": stats.get("bytes_limit"),
    "ratios": ratios,
    "within_tolerance": within,
    "losses": losses,
  }
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1, default=str)
  return result


if __name__ == "__main__":
  main()
