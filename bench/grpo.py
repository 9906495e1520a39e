"""GRPO: what the CPU demo learns, where a step's time goes, and the colocated sampler beside the sampler alone.

Run from the repository root:

  python bench/grpo.py                     # the rows of bench/RESULTS.md (CPU, 8 emulated devices)
  python bench/grpo.py --smoke             # a small, quick run
  python bench/grpo.py --device cuda --hf_dir /models/Qwen3-0.6B   # on a GPU; beside vLLM where it is installed

1. **Learning.** ``distrib-train --config grpo-tiny`` as shipped (the CLI, its own environment) for ``--steps``
   steps; the curve of the mean reward, the accuracy and the format reward, the policy's entropy, every
   ``--every`` steps, from its ``metrics.jsonl``.
2. **A step's time**, from the same run's ``goodput.json``: generation (sampling and rewards) against training
   (the steps), and the share of each.
3. **The colocated sampler.** A second run with longer completions (``--completion`` new tokens, no end token
   on the byte model) logs each rollout's tokens per second; then the same model, loaded from that run's
   checkpoint onto the same mesh, samples the same prompts at the same batch, ``n`` and settings through the
   sampler alone (``distrib-train generate``'s ``Generator``), first call not timed, median of ``--repeats``. The
   ratio colocated / alone is the row (target ≥ 0.9).

With ``--device cuda`` and vLLM installed, part 3 also samples the same prompts with vLLM (``--hf_dir``, a
Hugging Face model both read) and prints our tokens/s over vLLM's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]


def _run(workdir: pathlib.Path, devices: int, *settings: str) -> float:
  started = time.perf_counter()
  command = [
    sys.executable,
    "-m",
    "distrib_train",
    "--config",
    "grpo-tiny",
    "--workdir",
    str(workdir),
    "--cpu_devices",
    str(devices),
  ] + [a for s in settings for a in ("--set", s)]
  subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  return time.perf_counter() - started


def _records(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def learning(root: pathlib.Path, steps: int, every: int, devices: int) -> None:
  seconds = _run(root / "learn", devices, f"train.steps={steps}", f"train.log_every={every}")
  print(f"grpo-tiny through the CLI, {steps} steps, {seconds:.0f} s in all:")
  print(f"{'step':>6} {'reward':>8} {'accuracy':>9} {'format':>7} {'entropy':>8} {'zero spread':>12}")
  for r in _records(root / "learn" / "metrics.jsonl"):
    if "rollout/reward/mean" in r:
      print(
        f"{r['step']:>6} {r['rollout/reward/mean']:>8.3f} {r['rollout/rewards/accuracy/mean']:>9.3f}"
        f" {r['rollout/rewards/format/mean']:>7.3f} {r['entropy']:>8.3f} {r['rollout/frac_reward_zero_std']:>12.2f}"
      )
  goodput = json.loads((root / "learn" / "goodput.json").read_text())["runs"][-1]["seconds"]
  generation, training = goodput["generation"], goodput["productive"]
  print(
    f"a step's time: generation {generation / steps * 1e3:.1f} ms ({generation / (generation + training):.0%}),"
    f" training {training / steps * 1e3:.1f} ms ({training / (generation + training):.0%})"
  )


def sampler(root: pathlib.Path, completion: int, steps: int, repeats: int, devices: int) -> None:
  workdir = root / "sampler"
  _run(
    workdir,
    devices,
    f"train.steps={steps}",
    "train.log_every=1",
    f"grpo.max_completion_length={completion}",
    "data.seq_len=64",
    "grpo.format_pattern=.*",
    f"train.checkpoint_every={steps}",
  )
  rates = [
    r["rollout/generation_tokens_per_s"]
    for r in _records(workdir / "metrics.jsonl")
    if "rollout/generation_tokens_per_s" in r
  ][1:]  # the first compiled the sampler
  colocated = statistics.median(rates)

  from distrib_train.data.sources import arithmetic_records
  from distrib_train.generation.engine import Generator
  from distrib_train.generation.sampling import Sampling
  from distrib_train.posttrain import rollouts
  from distrib_train.weights import load as run_model

  loaded = run_model.load(f"ckpt:{workdir}", mesh_config="cpu-8")
  config = loaded.config
  g = config.grpo
  records = [json.loads(text) for text in arithmetic_records()]
  per_step = config.data.global_batch_size // g.num_generations
  prompts = [
    list(records[i]["prompt"].encode()) for i in rollouts.prompt_order(len(records), per_step, config.data.seed, 0)
  ]
  generator = Generator(loaded.model, mesh=loaded.mesh, rules=loaded.rules)
  sampling = Sampling(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, min_p=g.min_p, scaled_logprobs=True)
  times, tokens = [], 0
  for i in range(repeats + 1):
    started = time.perf_counter()
    out = generator.generate(
      prompts,
      max_new_tokens=completion,
      sampling=sampling,
      n=g.num_generations,
      seed=i,
      batch_size=config.data.global_batch_size,
    )
    tokens = sum(len(c.ids) for c in out)
    if i:
      times.append(time.perf_counter() - started)
  alone = tokens / statistics.median(times)
  print(
    f"sampler, {len(prompts)} prompts × {g.num_generations} completions of {completion} tokens on {devices}"
    f" devices: colocated in the run {colocated:,.0f} tokens/s (median of {len(rates)} rollouts), alone"
    f" {alone:,.0f} tokens/s (median of {repeats}); colocated / alone {colocated / alone:.2f}"
  )


def vllm_row(hf_dir: str, completion: int, rows: int, n: int, repeats: int) -> None:
  """Our sampler and vLLM's on the same GPU, prompts, ``n`` and new tokens (temperature 1, no end token)."""
  try:
    import vllm
  except ImportError:
    print("vLLM is not installed: the vLLM row is not measured (pip install vllm on a GPU machine).")
    return
  from distrib_train.generation.engine import Generator
  from distrib_train.generation.sampling import Sampling
  from distrib_train.weights import load as run_model

  loaded = run_model.load(f"hf:{hf_dir}")
  prompts = [[1 + (7 * i + j) % 1000 for j in range(32)] for i in range(rows)]
  generator = Generator(loaded.model, mesh=loaded.mesh, rules=loaded.rules)
  ours = []
  for i in range(repeats + 1):
    started = time.perf_counter()
    out = generator.generate(
      prompts, max_new_tokens=completion, sampling=Sampling(temperature=1.0), n=n, seed=i, batch_size=rows * n
    )
    if i:
      ours.append(sum(len(c.ids) for c in out) / (time.perf_counter() - started))
  llm = vllm.LLM(model=hf_dir, dtype=loaded.config.model_recipe().config.dtype)
  params = vllm.SamplingParams(n=n, max_tokens=completion, min_tokens=completion, temperature=1.0)
  theirs = []
  for i in range(repeats + 1):
    started = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    if i:
      theirs.append(sum(len(c.token_ids) for o in out for c in o.outputs) / (time.perf_counter() - started))
  print(
    f"GPU, {rows} prompts × {n} of {completion} tokens: ours {statistics.median(ours):,.0f} tokens/s, vLLM"
    f" {statistics.median(theirs):,.0f}; ours / vLLM {statistics.median(ours) / statistics.median(theirs):.2f}"
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--every", type=int, default=50)
  parser.add_argument("--completion", type=int, default=32)
  parser.add_argument("--sampler_steps", type=int, default=12)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
  parser.add_argument("--hf_dir", default="")
  parser.add_argument("--smoke", action="store_true", help="a few steps of each part")
  args = parser.parse_args()
  if args.smoke:
    args.steps, args.every, args.completion, args.sampler_steps, args.repeats = 20, 10, 8, 4, 2
  with tempfile.TemporaryDirectory(prefix="grpo_bench_") as tmp:
    root = pathlib.Path(tmp)
    if args.device == "cuda":
      if not args.hf_dir:
        parser.error("--device cuda samples a Hugging Face model: give --hf_dir")
      vllm_row(args.hf_dir, args.completion, 64, 8, args.repeats)
      return
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    learning(root, args.steps, args.every, args.devices)
    sampler(root, args.completion, args.sampler_steps, args.repeats, args.devices)


if __name__ == "__main__":
  main()
