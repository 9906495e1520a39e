"""Training throughput: the framework's step against a hand-written one.

Run from the repository root (nothing needs installing beyond jax, flax,
optax, orbax and numpy; the script puts the repository on ``sys.path``):

  python bench/train_throughput.py --shapes 124m,350m,1b --json /tmp/tp.json
  python bench/train_throughput.py --shapes 1b --sweep --time_budget 480
  JAX_PLATFORMS=cpu python bench/train_throughput.py --shapes tiny --steps 3 --warmup 1   # CPU smoke

For each shape, in one process and on the same batch of random tokens:
(a) the framework path — ``recipes.get("llama", preset)``, ``MeshPlanner`` on
a ``data`` × ``fsdp`` × ``tensor`` mesh over every device, sharded init,
``build_train_step_fn`` with donation, compiled ahead of time as the trainer
does; (b) the hand-written step of ``bench/reference_step.py`` (same model,
same ``optax.adamw``, one ``jax.jit`` with donation). Both are timed one step
at a time with ``block_until_ready`` (``--window K``: K steps per sample),
after ``--warmup`` steps, alternating (a) and (b) each round so that clock
and thermal drift hit both; the figure is the median. Each row gives tokens/s,
model TFLOP/s and MFU (PaLM's count, ``6·N + 12·L·heads·head_dim·S`` per
token, over ``distrib_train.train.metrics.peak_flops`` of the device) and the
ratio of the framework's tokens/s to the reference's.

The reference runs with fixed settings per shape (``--ref_attention``,
``--ref_layers``, the shape's batch); levers (``--remat``, ``--scan``,
``--attention``, ``--loss_chunk``, ``--batch``, ``--sweep`` entries) move the
framework only, so a sweep's ratios share one yardstick. Where both train
states do not fit in device memory together, the reference is freed and the
framework timed alone against the reference's earlier solo timing (the row
says "sequential"). A setting that fails (out of memory, cuDNN unsupported,
an unknown compiler option) prints a row with the error and the sweep goes
on. The ratio is like-for-like on one device only: the reference never
shards.

Not for: multi-host runs or the input pipeline (``bench/data_bench.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
  sys.path.insert(0, _REPO_ROOT)


def _flags_accepted(flags: str) -> tuple[bool, str]:
  """Starts a throwaway jax with ``XLA_FLAGS=flags``: an unknown flag aborts the process."""
  env = dict(os.environ, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  done = subprocess.run(
    [sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True, timeout=300
  )
  lines = [line for line in done.stderr.splitlines() if "flag" in line.lower()] or done.stderr.splitlines()
  return done.returncode == 0, (lines[-1] if lines else "")


def _prepare_environment(argv: list[str]) -> dict[str, Any]:
  """Sets the environment jax reads at import: validated XLA flags, memory fraction."""
  parser = argparse.ArgumentParser(add_help=False)
  parser.add_argument("--xla_flags", default="")
  known, _ = parser.parse_known_args(argv)
  # Both train states live on the device at once in the interleaved timing;
  # jax's default of 75 % of device memory is often too little for that.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
  report = {"requested": known.xla_flags, "rejected": []}
  if known.xla_flags:
    candidates = known.xla_flags.split()
    base = os.environ.get("XLA_FLAGS", "")
    ok, _ = _flags_accepted(" ".join([base, *candidates]))
    if not ok:
      for flag in candidates:
        flag_ok, why = _flags_accepted(" ".join([base, flag]))
        if not flag_ok:
          report["rejected"].append(flag)
          print(f"WARNING: this jaxlib rejects {flag} ({why.strip()[:160]}); running without it.", flush=True)
    accepted = [f for f in candidates if f not in report["rejected"]]
    os.environ["XLA_FLAGS"] = " ".join([base, *accepted]).strip()
  return report


_XLA_FLAG_REPORT = {"requested": "", "rejected": []}
if __name__ == "__main__":
  _XLA_FLAG_REPORT = _prepare_environment(sys.argv[1:])  # before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import distrib_train as dt  # noqa: E402
from distrib_train.train import metrics  # noqa: E402
from bench import reference_step  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
  """A benchmark shape: a Llama preset, its sequence length and batch."""

  preset: str
  seq_len: int
  batch: int
  overrides: tuple[tuple[str, Any], ...] = ()


SHAPES = {
  # The CPU smoke test: d 64, 2 layers, 4 heads (2 kv) × 16, byte vocabulary.
  "tiny": Shape("tiny", 64, 4, (("dtype", "bfloat16"), ("loss_chunk_size", 32))),
  "124m": Shape("124m", 1024, 16),
  "350m": Shape("350m", 1024, 16),
  "1b": Shape("1b", 2048, 8),  # d 2048, 24 layers, 16 heads × 128, SwiGLU 5632: 1.36 B params
}

# Default --sweep lists: one framework setting per entry, over the base flags.
SWEEPS = {
  # Every key once, in few compiles (CPU compiles are slow); cudnn fails on CPU, as a failing row should.
  "tiny": [
    "",
    "remat=dots_saveable,scan=0,loss_chunk=16,batch=8,mu_dtype=bfloat16",
    "remat=full,xla_gpu_enable_triton_gemm=false",
    "attention=cudnn",
  ],
  "124m": [
    "",
    "scan=0",
    "remat=dots_saveable",
    "loss_chunk=256",
    "attention=xla",
    "batch=32",
    "batch=64",
    "xla_gpu_enable_triton_gemm=false",
    "mu_dtype=bfloat16",
  ],
  "350m": ["", "scan=0", "remat=dots_saveable", "batch=32"],
  "1b": [
    "",
    "scan=0",
    "remat=dots_saveable,batch=16",
    "xla_gpu_enable_triton_gemm=false",
    "remat=dots_saveable",
    "loss_chunk=2048",
    "loss_chunk=512",
    "mu_dtype=bfloat16",
    "remat=full,batch=16",
    "scan=0,loss_remat=0,batch=16",
    "scan=0,loss_remat=0,batch=16,fp8=current",
    "scan=0,loss_remat=0,batch=16,fp8=delayed",
    "scan=0,loss_remat=0,batch=8,fp8=current",
  ],
}


@dataclasses.dataclass(frozen=True)
class Setting:
  """The framework-side levers for one timed configuration."""

  remat: str
  scan: bool
  attention: str
  loss_chunk: int
  batch: int
  mu_dtype: str = "float32"
  loss_remat: bool = True
  compiler_options: tuple[tuple[str, Any], ...] = ()
  fp8: str = "none"  # model.fp8 of the framework path (the reference stays in bf16)

  def label(self) -> str:
    extra = [f"mu={self.mu_dtype}"] if self.mu_dtype != "float32" else []
    extra += [f"fp8={self.fp8}"] if self.fp8 != "none" else []
    extra += [] if self.loss_remat else ["loss_remat=0"]
    extra += [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.compiler_options]
    return " ".join(
      [
        f"remat={self.remat}",
        f"scan={int(self.scan)}",
        f"attn={self.attention}",
        f"chunk={self.loss_chunk}",
        f"B={self.batch}",
        *extra,
      ]
    )


def _parse_value(text: str) -> Any:
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  try:
    return int(text)
  except ValueError:
    return text


def parse_setting(text: str, base: Setting) -> Setting:
  """``"remat=full,batch=16,xla_gpu_enable_triton_gemm=false"`` on top of ``base``."""
  fields, options = {}, dict(base.compiler_options)
  for item in filter(None, (part.strip() for part in text.split(","))):
    key, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"Sweep entry {item!r} is not key=value.")
    if key.startswith("xla_"):
      options[key] = _parse_value(value)
    elif key in ("remat", "attention", "mu_dtype", "fp8"):
      fields[key] = value
    elif key in ("loss_chunk", "batch"):
      fields[key] = int(value)
    elif key in ("scan", "loss_remat"):
      fields[key] = value.lower() in ("1", "true", "yes")
    else:
      raise ValueError(
        f"Unknown sweep key {key!r}; use remat, scan, attention, loss_chunk, loss_remat, batch,"
        " mu_dtype, fp8 or an XLA option (xla_...)."
      )
  return dataclasses.replace(base, **fields, compiler_options=tuple(sorted(options.items())))


def make_optimizer(mu_dtype: str = "float32") -> optax.GradientTransformation:
  """The optimizer both paths use (the llama-*-gpu configs' AdamW, no schedule or clipping)."""
  return optax.adamw(
    3e-4, b1=0.9, b2=0.95, weight_decay=0.1, mu_dtype=None if mu_dtype == "float32" else jnp.dtype(mu_dtype)
  )


def _temp_gib(compiled: Any) -> float | None:
  try:
    return compiled.memory_analysis().temp_size_in_bytes / 2**30
  except Exception:  # not every backend reports it
    return None


class FrameworkRun:
  """The framework path for one setting: plan → sharded init → donated, AOT-compiled step."""

  name = "framework"

  def __init__(self, shape: Shape, setting: Setting, mesh: Any, tokens: np.ndarray, targets: np.ndarray):
    overrides = {
      **dict(shape.overrides),
      "remat": setting.remat,
      "scan_layers": setting.scan,
      "attention": setting.attention,
      "loss_chunk_size": setting.loss_chunk,
      "loss_remat": setting.loss_remat,
      "fp8": setting.fp8,
      "max_seq_len": max(tokens.shape[1], dt.recipes.llama.PRESETS[shape.preset].max_seq_len),
    }
    recipe = dt.recipes.get("llama", shape.preset, **overrides)
    self.config = recipe.config
    optimizer = make_optimizer(setting.mu_dtype)
    inputs = {
      "tokens": jax.ShapeDtypeStruct(tokens.shape, jnp.int32),
      "targets": jax.ShapeDtypeStruct(targets.shape, jnp.int32),
    }
    make = lambda: dt.TrainState.initial_state(recipe.config.build(0), optimizer, jax.random.key(0))
    planner = dt.MeshPlanner(mesh, "fsdp_tensor")
    self.state, plan = planner.init(make, loss_fn=recipe.loss_fn, inputs=inputs, input_axes=recipe.input_axes)
    self.batch = {
      name: jax.device_put(value, plan.input_kwarg_shardings[name])
      for name, value in (("tokens", tokens), ("targets", targets))
    }
    self.step_fn = dt.build_train_step_fn(
      recipe.loss_fn,
      donate_params_and_state=True,
      train_state_shardings=plan.train_state_shardings,
      input_kwarg_shardings=plan.input_kwarg_shardings,
      aux_output_shardings=plan.aux_output_shardings,
    )
    start = time.perf_counter()
    compiled = self.step_fn.compile(self.state, compiler_options=setting.compiler_options or None, **self.batch)
    self.compile_s = time.perf_counter() - start
    self.temp_gib = _temp_gib(compiled)
    self.loss = None

  def step(self) -> None:
    self.state, aux = self.step_fn(self.state, **self.batch)
    self.loss = aux["loss"]

  def block(self) -> None:
    jax.block_until_ready((self.state.params, self.state.opt_state, self.loss))


class ReferenceRun:
  """The hand-written step; its state can be freed and rebuilt (compiled once)."""

  name = "reference"

  def __init__(self, config: reference_step.ReferenceConfig, tokens: np.ndarray, targets: np.ndarray):
    self.config = config
    optimizer = make_optimizer()

    # Stacked params under jit, split per layer outside it (see reference_step.unstack_layers).
    self._init_params = jax.jit(
      lambda key: reference_step.init_params(dataclasses.replace(config, scan_layers=True), key)
    )
    self._init_opt = jax.jit(optimizer.init)
    self.tokens, self.targets = jnp.asarray(tokens), jnp.asarray(targets)
    self.params = self.opt_state = self.loss = None
    self.ensure_state()
    self.num_params = reference_step.num_params(self.params)
    start = time.perf_counter()
    self._compiled = (
      reference_step.make_train_step(config, optimizer)
      .lower(self.params, self.opt_state, self.tokens, self.targets)
      .compile()
    )
    self.compile_s = time.perf_counter() - start
    self.temp_gib = _temp_gib(self._compiled)

  def ensure_state(self) -> None:
    if self.params is None:
      params = self._init_params(jax.random.key(1))
      if not self.config.scan_layers:
        params["layers"] = reference_step.unstack_layers(params["layers"])
      self.params, self.opt_state = params, self._init_opt(params)

  def release_state(self) -> None:
    self.params = self.opt_state = self.loss = None
    gc.collect()

  def step(self) -> None:
    self.params, self.opt_state, self.loss = self._compiled(self.params, self.opt_state, self.tokens, self.targets)

  def block(self) -> None:
    jax.block_until_ready((self.params, self.opt_state, self.loss))


def time_steps(runners: list[Any], warmup: int, steps: int, window: int) -> tuple[dict[str, list[float]], dict]:
  """Seconds per step for each runner, rounds alternating the order; and each first loss."""
  first_loss = {}
  for runner in runners:
    for i in range(warmup):
      runner.step()
      runner.block()
      if i == 0:
        first_loss[runner.name] = float(runner.loss)
  seconds = {runner.name: [] for runner in runners}
  for i in range(steps):
    for runner in runners if i % 2 == 0 else runners[::-1]:
      start = time.perf_counter()
      for _ in range(window):
        runner.step()
      runner.block()
      seconds[runner.name].append((time.perf_counter() - start) / window)
  return seconds, first_loss


def _is_oom(error: BaseException) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _describe(error: BaseException) -> str:
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  return f"{type(error).__name__}: {lines[0] if lines else ''}"[:240]


def _free_bytes() -> int | None:
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # backends without the call raise various errors
    return None
  if "bytes_limit" not in stats:
    return None
  return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


class Table:
  """Prints rows as they come and rewrites the JSON file after each."""

  COLUMNS = (
    ("shape", 5),
    ("path", 9),
    ("setting", 58),
    ("tokens/s", 10),
    ("TFLOP/s", 7),
    ("MFU", 6),
    ("step ms", 8),
    ("spread", 6),
    ("vs ref", 6),
    ("compile s", 9),
    ("temp GiB", 8),
    ("loss0", 6),
  )

  def __init__(self, json_path: str | None, meta: dict[str, Any]):
    self.json_path, self.meta, self.rows = json_path, meta, []

  def header(self) -> None:
    print(
      "  ".join(name.rjust(width) if i > 2 else name.ljust(width) for i, (name, width) in enumerate(self.COLUMNS)),
      flush=True,
    )

  def add(self, row: dict[str, Any]) -> None:
    self.rows.append(row)
    if row.get("error") and row.get("tokens_per_s") is None:
      print(f"{row['shape']:<5}  {row['path']:<9}  {row['setting']:<58}  {row['error']}", flush=True)
    else:
      fmt = lambda v, f: "-" if v is None else format(v, f)
      cells = [
        row["shape"],
        row["path"],
        row["setting"],
        fmt(row["tokens_per_s"], ",.0f"),
        fmt(row["tflops"], ".1f"),
        fmt(row["mfu"], ".1%"),
        fmt(row["step_ms"], ".2f"),
        fmt(row["spread"], ".1%"),
        fmt(row.get("ratio"), ".3f"),
        fmt(row["compile_s"], ".1f"),
        fmt(row["temp_gib"], ".2f"),
        fmt(row["loss_step0"], ".3f"),
      ]
      line = "  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, (_, w)) in enumerate(zip(cells, self.COLUMNS)))
      print(line + (f"  [{row['note']}]" if row.get("note") else ""), flush=True)
    if self.json_path:
      with open(self.json_path, "w") as f:
        json.dump({"meta": self.meta, "rows": self.rows}, f, indent=1)


def _summary(
  shape_name: str,
  path: str,
  label: str,
  seconds: list[float],
  batch: int,
  seq_len: int,
  flops_per_token: int,
  peak: float | None,
) -> dict[str, Any]:
  median = statistics.median(seconds)
  tokens_per_s = batch * seq_len / median
  return {
    "shape": shape_name,
    "path": path,
    "setting": label,
    "batch": batch,
    "seq_len": seq_len,
    "step_ms": median * 1e3,
    "step_ms_all": [s * 1e3 for s in seconds],
    "spread": (max(seconds) - min(seconds)) / median,
    "tokens_per_s": tokens_per_s,
    "tflops": tokens_per_s * flops_per_token / 1e12,
    "mfu": None if peak is None else tokens_per_s * flops_per_token / peak,
  }


def _same_init_loss(run: FrameworkRun, config: reference_step.ReferenceConfig) -> float:
  """The reference's loss on the framework's initial params: the two models must agree."""
  pure = dt.models.to_pure_dict(run.state.params)
  layers = dict(pure["layers"])
  if not config.scan_layers:
    layers = [{k: v[i] for k, v in layers.items()} for i in range(config.num_layers)]
  params = {"embed": pure["embed"], "layers": layers, "final_norm": pure["final_norm"], "head": pure["head"]}
  return float(
    jax.jit(reference_step.loss, static_argnums=3)(params, run.batch["tokens"], run.batch["targets"], config)
  )


def run_shape(
  shape_name: str, args: argparse.Namespace, table: Table, mesh: Any, peak: float | None, started: float
) -> None:
  shape = SHAPES[shape_name]
  preset = dataclasses.replace(dt.recipes.llama.PRESETS[shape.preset], **dict(shape.overrides))
  seq_len = args.seq_len or shape.seq_len
  base = Setting(
    remat=args.remat or preset.remat,
    scan=args.scan,
    attention=args.attention,
    loss_chunk=args.loss_chunk or preset.loss_chunk_size,
    batch=args.batch or shape.batch,
    fp8=args.fp8,
  )
  entries = (args.settings.split(";") if args.settings else SWEEPS[shape_name]) if args.sweep else [""]
  rng = np.random.default_rng(0)
  data = rng.integers(0, preset.vocab_size, (max(base.batch, 64), seq_len + 1), dtype=np.int32)
  batch_of = lambda b: (np.resize(data[:, :-1], (b, seq_len)), np.resize(data[:, 1:], (b, seq_len)))
  flops_per_token = preset.flops_per_token(seq_len)
  table.header()

  reference, ref_alone = None, None
  ref_config = reference_step.ReferenceConfig(
    vocab_size=preset.vocab_size,
    d_model=preset.d_model,
    num_layers=preset.num_layers,
    num_heads=preset.num_heads,
    num_kv_heads=preset.num_kv_heads,
    head_dim=preset.head_dim,
    mlp_dim=preset.mlp_dim,
    rope_theta=preset.rope_theta,
    norm_eps=preset.norm_eps,
    dtype=preset.dtype,
    param_dtype=preset.param_dtype,
    attention=args.ref_attention or base.attention,
    scan_layers=base.scan if args.ref_layers is None else args.ref_layers == "scan",
  )
  ref_label = f"attn={ref_config.attention} {'scan' if ref_config.scan_layers else 'unrolled'} B={base.batch}"
  if args.reference != "none":
    try:
      reference = ReferenceRun(ref_config, *batch_of(base.batch))
      if reference.num_params != preset.num_params():
        raise ValueError(
          f"reference has {reference.num_params} params, the framework's Llama"
          f" {preset.num_params()}: the models differ."
        )
      seconds, first = time_steps([reference], args.warmup, args.steps, args.window)
      ref_alone = statistics.median(seconds["reference"])
      table.add(
        {
          **_summary(
            shape_name, "reference", ref_label, seconds["reference"], base.batch, seq_len, flops_per_token, peak
          ),
          "compile_s": reference.compile_s,
          "temp_gib": reference.temp_gib,
          "loss_step0": first["reference"],
          "params": reference.num_params,
          "mode": "alone",
        }
      )
      if args.reference == "sequential":
        reference.release_state()
    except Exception as error:  # report and go on with the framework alone
      table.add({"shape": shape_name, "path": "reference", "setting": ref_label, "error": _describe(error)})
      reference = None

  for entry in entries:
    try:
      setting = parse_setting(entry, base)
    except ValueError as error:
      table.add({"shape": shape_name, "path": "framework", "setting": entry, "error": _describe(error)})
      continue
    label = setting.label()
    if args.time_budget and time.perf_counter() - started > args.time_budget:
      table.add(
        {
          "shape": shape_name,
          "path": "framework",
          "setting": label,
          "error": f"skipped: past the {args.time_budget:.0f} s time budget",
        }
      )
      continue
    interleave = reference is not None and args.reference == "interleave"
    row = _run_setting(
      shape_name,
      setting,
      args,
      mesh,
      batch_of(setting.batch),
      seq_len,
      flops_per_token,
      peak,
      reference if interleave else None,
      ref_config,
    )
    if row.get("oom") and interleave:
      reference.release_state()
      row = _run_setting(
        shape_name, setting, args, mesh, batch_of(setting.batch), seq_len, flops_per_token, peak, None, ref_config
      )
      row["note"] = "; ".join(filter(None, ["sequential: out of memory with both states", row.get("note")]))
    if row.get("tokens_per_s") and row.get("ratio") is None and ref_alone:
      row["ratio"] = row["tokens_per_s"] / (base.batch * seq_len / ref_alone)
      row["mode"] = "sequential"
      row["note"] = "; ".join(filter(None, [row.get("note"), "ratio to the reference's solo timing"]))
    if row.get("ratio") is not None and setting.batch != base.batch:
      row["note"] = "; ".join(filter(None, [row.get("note"), f"ratio of tokens/s, the reference at B={base.batch}"]))
    row.pop("oom", None)
    table.add(row)
  if reference is not None:
    reference.release_state()


def _run_setting(
  shape_name: str,
  setting: Setting,
  args: argparse.Namespace,
  mesh: Any,
  batch: tuple,
  seq_len: int,
  flops_per_token: int,
  peak: float | None,
  reference: ReferenceRun | None,
  ref_config: reference_step.ReferenceConfig,
) -> dict[str, Any]:
  """One framework setting, timed alone or interleaved with ``reference``; errors become the row."""
  label, notes, oom = setting.label(), [], False
  try:
    if reference is not None:
      reference.ensure_state()
    run = FrameworkRun(SHAPES[shape_name], setting, mesh, *batch)
    same_init = _same_init_loss(run, ref_config) if args.check_same_init or shape_name == "tiny" else None
    runners = [run]
    if reference is not None:
      free, need = _free_bytes(), max(run.temp_gib or 0, reference.temp_gib or 0) * 2**30
      if free is not None and need > 0.95 * free:
        reference.release_state()
        notes.append(f"sequential: the step needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free with both states")
      else:
        runners.append(reference)
    seconds, first = time_steps(runners, args.warmup, args.steps, args.window)
    row = {
      **_summary(shape_name, "framework", label, seconds["framework"], setting.batch, seq_len, flops_per_token, peak),
      "compile_s": run.compile_s,
      "temp_gib": run.temp_gib,
      "loss_step0": first["framework"],
      "loss_last": float(run.loss),
      "params": run.config.num_params(),
      "mode": "alone",
    }
    if "reference" in seconds:
      ref_median = statistics.median(seconds["reference"])
      row.update(
        mode="interleaved",
        ref_step_ms=ref_median * 1e3,
        ratio=row["tokens_per_s"] / (reference.tokens.size / ref_median),
      )
      notes.append(f"reference {ref_median * 1e3:.2f} ms in the same rounds")
    if same_init is not None:
      row["ref_loss_same_init"] = same_init
      notes.append(f"reference loss on these initial params {same_init:.4f}")
    row["note"] = "; ".join(notes)
  except Exception as error:  # one failing setting must not end the sweep
    row = {"shape": shape_name, "path": "framework", "setting": label, "error": _describe(error)}
    oom = _is_oom(error)
  run = runners = None  # free this setting's state before the next one
  gc.collect()
  row["oom"] = oom
  return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default="124m,350m,1b", help=f"comma list of {', '.join(SHAPES)}")
  parser.add_argument("--steps", type=int, default=10, help="timed samples per path (median taken)")
  parser.add_argument("--warmup", type=int, default=3, help="untimed steps per path first (at least 1)")
  parser.add_argument("--window", type=int, default=1, help="steps per timed sample (1: block every step)")
  parser.add_argument("--batch", type=int, help="batch size (default: the shape's)")
  parser.add_argument("--seq_len", type=int, help="sequence length (default: the shape's)")
  parser.add_argument("--remat", choices=("none", "dots_saveable", "full"), help="default: the preset's")
  parser.add_argument("--scan", dest="scan", action="store_true", default=True, help="scan over layers (default)")
  parser.add_argument("--no_scan", dest="scan", action="store_false", help="unroll the layers")
  parser.add_argument(
    "--attention",
    choices=("auto", "xla", "cudnn"),
    help="default: cudnn on GPU, else xla ('auto' is XLA in jax 0.10/0.11)",
  )
  parser.add_argument("--loss_chunk", type=int, help="cross-entropy chunk, tokens per sequence (default: preset's)")
  parser.add_argument(
    "--fp8",
    choices=("none", "current", "delayed"),
    default="none",
    help="model.fp8 of the framework path (sweep key fp8=); the reference stays bf16",
  )
  parser.add_argument("--sweep", action="store_true", help="run a list of framework settings per shape")
  parser.add_argument(
    "--settings",
    help="with --sweep: 'remat=full,batch=16;scan=0;xla_gpu_...=v' (';' between "
    "settings, ',' within; '' is the base); default: a list per shape",
  )
  parser.add_argument("--reference", choices=("interleave", "sequential", "none"), default="interleave")
  parser.add_argument("--ref_attention", choices=("auto", "xla", "cudnn"), help="default: as --attention")
  parser.add_argument("--ref_layers", choices=("scan", "unroll"), help="default: as --scan / --no_scan")
  parser.add_argument(
    "--check_same_init",
    action="store_true",
    help="also compute the reference's loss on the framework's initial params (always for tiny)",
  )
  parser.add_argument(
    "--xla_flags",
    default="",
    help="appended to XLA_FLAGS after a check in a subprocess; write --xla_flags='--xla_a=1 --xla_b=2' (with '=')",
  )
  parser.add_argument("--compilation_cache", help="persistent XLA cache dir ('' off; default /tmp/... off CPU)")
  parser.add_argument("--peak_tflops", type=float, default=0.0, help="peak for MFU where the device is unknown")
  parser.add_argument("--time_budget", type=float, default=0.0, help="seconds; later settings are skipped")
  parser.add_argument("--json", help="write every row here (rewritten after each row)")
  args = parser.parse_args(argv)
  args.shapes = [s for s in args.shapes.split(",") if s]
  unknown = [s for s in args.shapes if s not in SHAPES]
  if unknown:
    parser.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
  if args.warmup < 1 or args.steps < 1 or args.window < 1:
    parser.error("--warmup, --steps and --window must be at least 1 (the first warm-up step gives loss0)")
  return args


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  started = time.perf_counter()
  device = jax.devices()[0]
  on_cpu = device.platform == "cpu"
  args.attention = args.attention or ("cudnn" if device.platform == "gpu" else "xla")
  cache = (
    args.compilation_cache
    if args.compilation_cache is not None
    else ("" if on_cpu else "/tmp/distrib_train_bench_xla_cache")
  )
  if cache:
    jax.config.update("jax_compilation_cache_dir", cache)
  peak = metrics.peak_flops(device, args.peak_tflops)
  import jaxlib

  meta = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "device_kind": device.device_kind,
    "platform": device.platform,
    "device_count": jax.device_count(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "python": platform.python_version(),
    "optax": optax.__version__,
    "peak_tflops": None if peak is None else peak / 1e12,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "xla_flags_requested": _XLA_FLAG_REPORT["requested"],
    "xla_flags_rejected": _XLA_FLAG_REPORT["rejected"],
    "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
    "compilation_cache": cache,
    "argv": sys.argv[1:],
  }
  print(
    f"{meta['date']}  {meta['device_count']} × {meta['device_kind']} ({meta['platform']})  jax {meta['jax']}"
    f"  jaxlib {meta['jaxlib']}  python {meta['python']}  peak "
    f"{'unknown (MFU -)' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}",
    flush=True,
  )
  print(
    f"XLA_FLAGS={meta['xla_flags']!r}  mem fraction {meta['mem_fraction']}  cache {cache or 'off'}"
    f"  steps {args.steps} (median) after {args.warmup} warm-up, window {args.window}",
    flush=True,
  )
  if jax.device_count() > 1:
    print(
      "note: the framework shards over every device; the reference runs on one, so 'vs ref' is not like-for-like here.",
      flush=True,
    )
  mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (-1, 1, 1)))
  table = Table(args.json, meta)
  for shape_name in args.shapes:
    run_shape(shape_name, args, table, mesh, peak, started)
  print(f"done in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
  main()
