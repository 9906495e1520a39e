"""The trainer's own loop against its bare step, at the same shapes: what the user's path costs.

Run from the repository root:

  python bench/trainer_loop.py --config llama-124m-gpu --steps 100                      # GPU, synthetic tokens
  python bench/trainer_loop.py --config llama-124m-gpu --text corpus.jsonl --tokenizer hf:tokenizer.json
  python bench/trainer_loop.py --config tiny --cpu_devices 8 --steps 60 --set data.seq_len=256   # CPU

Two processes, one after the other, on the same config:
(a) bare: the trainer's job (``config/job.py``: model, optimizer, plan,
``build_train_step_fn`` with donation, compiled ahead of time as the trainer
compiles it), stepped ``--steps`` times back to back on one batch that
stays on the device — the first batch the trainer's own loader gives, so
packed rows and segment ids are the trainer's; no host work between steps;
(b) the trainer: ``python -m distrib_train`` on the same config and steps
(no evaluation; stopped after its last step's metrics, before the closing
checkpoint), its tokens/s read from ``metrics.jsonl``:
the loader's lanes reading, tokenizing and packing, the batch transfer, the
previous-step check, the metrics windows and the hooks.

The figure is (b) / (a) tokens/s over the steps after the first log window
(compilation and warm-up excluded; ``--bracket`` times (a) before and after
(b) and takes their mean), with (b)'s data wait as a share of its
step time. ``--text`` and ``--tokenizer`` train (b) on a real corpus
(``data.source=text``); (a) then steps on that corpus's first batch.
Target (issue 32): ≥ 0.98 on synthetic tokens, ≥ 0.95 on real text.

Not for: the framework's step against a hand-written one
(``train_throughput.py``), the input pipeline alone (``data_bench.py``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _overrides(args: argparse.Namespace) -> list[str]:
  sets = list(args.set or [])
  if args.text:
    sets += ["data.source=text", f"data.paths={args.text}"]
  if args.tokenizer:
    sets.append(f"data.tokenizer={args.tokenizer}")
  return sets


def trainer_step(config) -> tuple:
  """The trainer's job for ``config`` (its planning and checks, ``build_train_step_fn`` with donation), compiled
  as the trainer compiles it: ``(step, initial state, the trainer's loader's first batch)``."""
  from distrib_train.data.pipeline import DataLoader
  from distrib_train.sharding.axis_rules import activation_sharding
  from distrib_train.train_step import build_train_step_fn
  from distrib_train.config import job as job_lib
  from distrib_train.train.trainer import Trainer

  trainer = Trainer(config, tempfile.mkdtemp(prefix="bare-"))
  plan = trainer._plan()  # the trainer's own planning and checks
  loader = DataLoader(trainer.data_config, plan.input_kwarg_shardings, vocab_size=trainer.vocab_size)
  batch = next(loader)
  loader.close()
  step = build_train_step_fn(
    trainer.loss_fn,
    donate_params_and_state=True,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
    **job_lib.step_options(trainer.job, plan, trainer.rules),
  )
  state = plan.init(trainer.job.make_state)
  with activation_sharding(plan.mesh, trainer.rules):
    step.compile(plan.abstract_train_state.replace(step=0), **trainer.job.inputs)  # the step object keeps it
  return step, state, batch


def bare(args: argparse.Namespace) -> dict:
  """(a), in this process: the compiled step on the loader's first batch, ``--steps`` times."""
  from distrib_train.cluster import distributed

  distributed.initialize(cpu_devices=args.cpu_devices)
  import jax

  from distrib_train.config import run as config_lib

  config = config_lib.load(args.config, config_lib.parse_overrides(_overrides(args)))
  step, state, batch = trainer_step(config)
  warm = max(1, args.log_every)
  for _ in range(warm):
    state, aux = step(state, **batch)
  jax.block_until_ready(aux)
  start = time.perf_counter()
  for _ in range(args.steps - warm):
    state, aux = step(state, **batch)
  jax.block_until_ready((state, aux))
  seconds = time.perf_counter() - start
  tokens = config.data.global_batch_size * config.data.seq_len * (args.steps - warm)
  return {"tokens_per_s": tokens / seconds, "step_ms": 1000 * seconds / (args.steps - warm)}


def trainer_run(args: argparse.Namespace) -> dict:
  """(b): the trainer CLI in a subprocess; tokens/s and data wait from its metrics after the first window.

  The run is stopped once its last step's metrics are written: its closing checkpoint is not timed.
  """
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="trainer-loop-"))
  command = [
    sys.executable,
    "-m",
    "distrib_train",
    "--config",
    args.config,
    "--workdir",
    str(workdir),
    "--steps",
    str(args.steps),
    "--set",
    f"train.log_every={args.log_every}",
    "--set",
    "data.eval_fraction=0",
    "--set",
    "train.eval_every=0",
  ]
  if args.cpu_devices:
    command += ["--cpu_devices", str(args.cpu_devices)]
  for item in _overrides(args):
    command += ["--set", item]
  metrics = workdir / "metrics.jsonl"

  def rows() -> list[dict]:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [json.loads(line) for line in lines if line.strip().endswith("}")]

  with tempfile.TemporaryFile("w+") as log:
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + args.timeout
    while proc.poll() is None and time.monotonic() < deadline:
      if any(r.get("step", 0) >= args.steps and "tokens_per_s" in r for r in rows()):
        proc.kill()
        break
      time.sleep(0.5)
    else:
      if proc.poll() is None:
        proc.kill()
    proc.wait()
    log.seek(0)
    output = log.read()
  timed = [r for r in rows() if "tokens_per_s" in r][1:]  # the first window holds the warm-up
  if not timed:
    raise SystemExit(f"the trainer logged no window after the first (exit {proc.returncode}):\n{output[-3000:]}")
  tokens = statistics.median(r["tokens_per_s"] for r in timed)
  step_ms = statistics.median(r["step_time_ms"] for r in timed)
  wait_ms = statistics.median(r.get("data_wait_ms", 0.0) for r in timed)
  return {"tokens_per_s": tokens, "step_ms": step_ms, "data_wait_ms": wait_ms, "windows": len(timed)}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="tiny", help="a preset name or a YAML file")
  parser.add_argument("--set", action="append", help="section.key=value, as the trainer's --set (repeatable)")
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--log_every", type=int, default=10, help="the trainer's metrics window, in steps")
  parser.add_argument("--text", help="a corpus file (.jsonl, .txt, .parquet) for data.source=text")
  parser.add_argument("--tokenizer", help="data.tokenizer, e.g. hf:tokenizer.json")
  parser.add_argument("--cpu_devices", type=int, help="emulated CPU devices (as the trainer's flag)")
  parser.add_argument("--timeout", type=float, default=1800)
  parser.add_argument(
    "--bracket",
    action="store_true",
    help="time the bare step before and after the trainer (their mean; their spread is the host's drift)",
  )
  parser.add_argument("--json", help="write the figures here")
  parser.add_argument("--role", choices=("both", "bare"), default="both", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.steps < 3 * args.log_every:
    parser.error("--steps must be at least 3 × --log_every (one warm-up window, two timed).")
  if args.role == "bare":
    print(json.dumps(bare(args)))
    return
  command = [sys.executable, __file__, "--role", "bare", *(argv if argv is not None else sys.argv[1:])]

  def bare_run() -> dict:
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if run.returncode:
      raise SystemExit(f"the bare step failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])

  before = bare_run()
  loop = trainer_run(args)
  after = bare_run() if args.bracket else before  # drift of the host between the runs shows as their spread
  base = {key: (before[key] + after[key]) / 2 for key in before}
  base["spread"] = abs(before["tokens_per_s"] - after["tokens_per_s"]) / base["tokens_per_s"]
  out = {
    "config": args.config,
    "sets": _overrides(args),
    "bare": base,
    "trainer": loop,
    "ratio": loop["tokens_per_s"] / base["tokens_per_s"],
    "data_wait_share": loop["data_wait_ms"] / loop["step_ms"] if loop["step_ms"] else 0.0,
  }
  print(f"{args.config} {' '.join(out['sets'])}".strip())
  print(
    f"  bare step   {base['tokens_per_s']:>12,.0f} tokens/s  {base['step_ms']:8.2f} ms/step"
    + (f"  (before and after the trainer, {base['spread']:.1%} apart)" if args.bracket else "")
  )
  print(
    f"  trainer     {loop['tokens_per_s']:>12,.0f} tokens/s  {loop['step_ms']:8.2f} ms/step"
    f"  data wait {loop['data_wait_ms']:.2f} ms ({out['data_wait_share']:.1%})"
  )
  print(f"  trainer / bare step: {out['ratio']:.3f}")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
  if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
  main()
