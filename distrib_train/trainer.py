"""The training loop: plan → init or restore → compile → steps → eval →
checkpoints, with metrics, preemption and a non-finite guard.

``Trainer(config, workdir).run()`` trains the model a ``Config`` names (or
one given as code: ``model_fn`` and ``loss_fn``) on the mesh its mesh config
describes, resuming from the newest checkpoint in ``workdir/checkpoints``.

What it leaves in ``workdir`` (process 0 writes the files, every process
writes its checkpoint shards)::

  config.yaml      the effective config
  plan.txt         the plan report (every array's layout, bytes per device)
  metrics.jsonl    one JSON object per log point and per evaluation
  tensorboard/     event files
  checkpoints/     orbax checkpoints with the data-iterator state
  profile/         a jax profiler trace, when asked for

The step is compiled ahead of the loop with the real shardings, so its
memory analysis is known before the first step. Steps are dispatched
asynchronously: the host reads a step's loss while the next one runs, and
waits for the devices only at log, eval and checkpoint points.

Not for: parsing flags (``train.py``) or what a step computes
(``train_step.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import pathlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distrib_train import distributed
from distrib_train import metrics as metrics_lib
from distrib_train import optimizers
from distrib_train.axis_rules import activation_sharding
from distrib_train.checkpoint import CheckpointManager, check_restorable
from distrib_train.compilation import CacheEvents, memory_line, setup_compilation_cache
from distrib_train.config import Config
from distrib_train.mesh import MeshConfig, build_mesh, find_mesh_config
from distrib_train.planner import MeshPlanner
from distrib_train.train_state import TrainState
from distrib_train.train_step import build_eval_step_fn, build_train_step_fn

EXIT_HALTED = 3  # the process exit code of a run stopped by the non-finite guard


@dataclasses.dataclass
class RunResult:
  """How a run ended.

  Attributes:
    status: ``finished``, ``already_done`` (the workdir held the last step),
      ``preempted`` (checkpointed on SIGTERM) or ``halted`` (non-finite).
    step: the last step trained (or restored).
    eval_loss: the last evaluation's loss, if any.
    losses: every step's training loss this run, by step.
    message: why it halted.
  """

  status: str
  step: int
  eval_loss: float | None = None
  losses: dict[int, float] = dataclasses.field(default_factory=dict)
  message: str = ""


class TrainerSetupError(ValueError):
  """The run cannot start (mesh, data or plan problem); raised before the
  workdir is written to."""


class _Halt(Exception):
  pass


class _Rollback(Exception):
  def __init__(self, step: int):
    super().__init__(step)
    self.step = step


def example_inputs(config: Config) -> dict[str, jax.ShapeDtypeStruct]:
  """The abstract batch the data pipeline produces for this config."""
  shape = (config.data.global_batch_size, config.data.seq_len)
  names = ["tokens", "targets", "weights"] + (["segment_ids", "positions"] if config.data.packing else [])
  return {n: jax.ShapeDtypeStruct(shape, np.float32 if n == "weights" else np.int32) for n in names}


def _check_workdir(workdir: pathlib.Path) -> None:
  """Fails, creating nothing, when ``workdir`` cannot be a writable directory."""
  existing = workdir
  while not existing.exists() and existing != existing.parent:
    existing = existing.parent
  if not existing.is_dir():
    where = "is a file" if existing == workdir else f"cannot be created: {str(existing)!r} is a file"
    raise ValueError(f"Workdir {str(workdir)!r} {where}; give a directory.")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"Workdir {str(workdir)!r} cannot be written: no write permission on {str(existing)!r}.")


_barrier_ids = itertools.count()


def _wait_for_every_process(what: str, timeout_s: int = 1800) -> None:
  """A barrier on JAX's coordination service, which waits as long as it takes.

  Process 0 loads the step from the persistent compilation cache while the
  others may compile it (JAX writes the cache from process 0 only; on CPU the
  other processes' keys differ), and the first step's collectives wait only
  30 s for a late process (gloo's rendezvous) before failing the job.
  """
  if jax.process_count() == 1:
    return
  import orbax.checkpoint as ocp

  ocp.multihost.sync_global_processes(f"distrib_train: {what} #{next(_barrier_ids)}", timeout=timeout_s,
                                      processes=set(range(jax.process_count())))


def _local_value(x: jax.Array) -> np.ndarray:
  """A replicated array's value from this process's first shard."""
  return np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x)


class Trainer:
  """Runs one experiment in ``workdir``.

  Args:
    config: the checked experiment config.
    workdir: where the run's files go; created when the run starts.
    model_fn: ``model_fn(seed) -> model`` instead of the config's reference
      model (with ``loss_fn``; ``input_axes`` for the batch's logical axes).
    loss_fn: a penzai-style loss, ``loss_fn(*, model, state, rng, **batch)
      -> (loss, state, aux)``; aux may hold ``loss`` and ``tokens``.
    input_axes: logical axes per input name.
    profile_steps: ``(first, last)`` steps to trace with the jax profiler.
    console: where console lines go (default stderr).
  """

  def __init__(self, config: Config, workdir: str | os.PathLike, *, model_fn: Callable[[int], Any] | None = None,
               loss_fn: Callable[..., Any] | None = None, input_axes: Mapping[str, Any] | None = None,
               profile_steps: tuple[int, int] | None = None, console=None):
    self.config = config
    self.workdir = pathlib.Path(workdir).expanduser().absolute()
    recipe = config.model_recipe() if model_fn is None or loss_fn is None or input_axes is None else None
    self.model_fn = model_fn or recipe.config.build
    self.loss_fn = loss_fn or recipe.loss_fn
    self.input_axes = input_axes if input_axes is not None else recipe.input_axes
    self.flops_per_token = None
    model_config = recipe.config if recipe is not None and model_fn is None else None
    if hasattr(model_config, "flops_per_token"):
      self.flops_per_token = model_config.flops_per_token(config.data.seq_len)
    self.profile_steps = profile_steps
    self.console = console
    try:
      self.mesh_config = MeshConfig.from_yaml(find_mesh_config(config.mesh_config))
    except ValueError as e:
      raise TrainerSetupError(str(e)) from None

  # --- setup -------------------------------------------------------------------

  def _plan(self):
    t = self.config.train
    mesh = build_mesh(self.mesh_config)
    rules = self.mesh_config.rules if self.mesh_config.rules is not None else t.rules
    self.optimizer = optimizers.build(self.config.optimizer, t.steps, t.nonfinite)
    seed = t.seed

    def make_state() -> TrainState:
      return TrainState.initial_state(self.model_fn(seed), self.optimizer, jax.random.key(seed))

    self.make_state = make_state
    from distrib_train.plan import logical_annotations_only

    with logical_annotations_only():
      abstract = jax.eval_shape(make_state)
    self.inputs = example_inputs(self.config)
    planner = MeshPlanner(mesh, rules)
    self.rules = planner.rules  # for activation_sharding while the steps are traced
    return planner.plan(abstract, loss_fn=self.loss_fn, inputs=self.inputs, input_axes=self.input_axes)

  def run(self) -> RunResult:
    """Trains to ``config.train.steps`` (or until preempted or halted).

    Raises:
      TrainerSetupError: the run cannot start (raised before the workdir is
        written to).
      CheckpointWriteError: a checkpoint could not be written (a full or
        read-only disk); the steps committed before it are intact.
    """
    started = time.perf_counter()
    config, t = self.config, self.config.train
    from distrib_train.data.pipeline import DataLoader

    try:  # everything that can fail on a bad setup, before the workdir is touched
      cache_dir = setup_compilation_cache(t.compilation_cache_dir)
      _check_workdir(self.workdir)
      plan = self._plan()
      check_restorable(self.workdir / "checkpoints", plan.abstract_train_state)  # reads metadata only
      loader = DataLoader(self.config.data_config(), plan.input_kwarg_shardings)
    except ValueError as e:
      raise TrainerSetupError(str(e)) from None

    primary = jax.process_index() == 0
    if primary:
      self.workdir.mkdir(parents=True, exist_ok=True)
    writer = metrics_lib.MetricWriter(self.workdir if primary else None, t.steps, console=self.console)
    self.writer = writer
    writer.log(f"{distributed.topology()}; mesh " + " × ".join(f"{k}={v}" for k, v in plan.mesh.shape.items())
               + f"; compilation cache: {cache_dir or 'off'}")
    writer.log(plan.summary() + ("\n  the whole table: " + str(self.workdir / "plan.txt") if primary else ""))
    ckpt = CheckpointManager(self.workdir / "checkpoints", max_to_keep=t.keep_checkpoints,
                             async_save=t.async_checkpoint, metadata={"config": config.to_dict()})
    preemption = distributed.Preemption()
    try:
      state = self._init_or_restore(ckpt, plan, loader)
      if primary:
        (self.workdir / "config.yaml").write_text(config.to_yaml())
        (self.workdir / "plan.txt").write_text(plan.report() + "\n")
      step = int(state.step)
      if step >= t.steps:
        writer.log(f"Step {step} of {t.steps} is already done in {self.workdir}; nothing to train.")
        return RunResult("already_done", step)
      train_step = build_train_step_fn(
          self.loss_fn, donate_params_and_state=True, train_state_shardings=plan.train_state_shardings,
          input_kwarg_shardings=plan.input_kwarg_shardings, aux_output_shardings=plan.aux_output_shardings)
      eval_step = build_eval_step_fn(
          self.loss_fn, train_state_shardings=plan.train_state_shardings,
          input_kwarg_shardings=plan.input_kwarg_shardings, aux_output_shardings=plan.aux_output_shardings)
      compile_start = time.perf_counter()
      # The model's activation constraints (``axis_rules.constrain``) apply while a step is traced: here
      # for the train step, in the loop for the eval step. Without them XLA may keep every device's copy
      # of the whole batch's activations on an FSDP mesh (llama-7b on 256 chips: 281 vs 10.8 GiB).
      with activation_sharding(plan.mesh, self.rules):
        with CacheEvents() as cache:
          compiled = train_step.compile(plan.abstract_train_state.replace(step=step), **self.inputs)
        source = "from the persistent cache" if cache.hits and not cache.misses else "compiled"
        writer.log(f"Train step {source} in {time.perf_counter() - compile_start:.1f} s; "
                   + memory_line(compiled))
        _wait_for_every_process("train step compiled")
        return self._loop(state, step, plan, loader, ckpt, train_step, eval_step, preemption, started)
    finally:
      preemption.close()
      ckpt.close()
      loader.close()
      writer.close()

  def _init_or_restore(self, ckpt: CheckpointManager, plan, loader) -> TrainState:
    latest = ckpt.latest_step()
    if latest is None:
      state = plan.init(self.make_state)
      self.writer.log("Initialised a new train state (sharded).")
      return state.replace(step=int(state.step))
    meta = ckpt.metadata_of(latest)
    saved = (meta.get("run") or {}).get("config") or {}
    now = self.config.to_dict()
    changed = [f"{section}.{key}: {saved[section].get(key)!r} → {value!r}"
               for section in ("model", "optimizer", "data") if isinstance(saved.get(section), dict)
               for key, value in now[section].items() if saved[section].get(key) != value]
    if changed:
      self.writer.log("The config differs from the checkpoint's: " + "; ".join(changed))
    same_layout = meta.get("process_count") == jax.process_count()
    state = ckpt.restore(plan.abstract_train_state, latest, data_iterator=loader if same_layout else None)
    if not same_layout:
      self.writer.log(f"The checkpoint was written by {meta.get('process_count')} process(es), this job has "
                      f"{jax.process_count()}: the data pipeline restarts from its beginning.")
    self.writer.log(f"Restored step {latest} from {ckpt.directory}.")
    return state.replace(step=int(latest))

  # --- the loop ----------------------------------------------------------------

  def _loop(self, state, step, plan, loader, ckpt, train_step, eval_step, preemption, started) -> RunResult:
    t = self.config.train
    writer = self.writer
    snapshot = jax.jit(lambda loss, m: jnp.stack(
        [jnp.asarray(loss, jnp.float32)] + [jnp.asarray(m[k], jnp.float32) for k in sorted(m)]))
    metric_names = sorted(optimizers.metrics_of(state.opt_state))
    tokens_per_step = self.config.data.global_batch_size * self.config.data.seq_len
    num_devices = plan.mesh.size
    peak = metrics_lib.peak_flops(jax.devices()[0], t.peak_tflops)
    result = RunResult("finished", step)
    window = {"start": time.perf_counter(), "steps": 0, "wait": 0.0, "losses": [], "grad_norms": []}
    self._consecutive_bad = 0
    rollbacks_since_checkpoint = 0
    pending = None
    iteration = 0
    first_step_logged = False
    profiling = False
    writer.start_progress(step)

    def resolve(item):
      """Host-side checks of one finished step (blocks until it is done)."""
      done_step, snap = item
      values = dict(zip(["loss"] + metric_names, _local_value(snap).tolist()))
      loss, grad_norm = values["loss"], values.get("grad_norm", 0.0)
      if math.isfinite(loss) and math.isfinite(grad_norm):
        self._consecutive_bad = 0
        result.losses[done_step] = loss
        window["losses"].append(loss)
        window["grad_norms"].append(grad_norm)
        window["last"] = values
        return
      what = f"non-finite {'loss' if not math.isfinite(loss) else 'gradients'} at step {done_step}" \
             f" (loss {loss}, grad norm {grad_norm})"
      self._consecutive_bad += 1
      if t.nonfinite == "skip":
        writer.log(f"{what}: update skipped ({int(values.get('skipped', 0))} skipped in this run's state).")
        window["last"] = values
        if self._consecutive_bad >= t.max_nonfinite:
          raise _Halt(f"{what}: {self._consecutive_bad} steps in a row skipped (train.max_nonfinite); stopping.")
        return
      if t.nonfinite == "halt":
        raise _Halt(f"{what}; stopping without a checkpoint (train.nonfinite=halt).")
      raise _Rollback(done_step)

    while step < t.steps:
      try:
        if preemption.reached(iteration):
          if pending is not None:
            resolve(pending)
            pending = None
          writer.log(f"Preemption: saving step {step} and stopping.")
          if ckpt.latest_step() != step:
            ckpt.save(step, state, loader, force=True)
          ckpt.wait_until_finished()
          result.status, result.step = "preempted", step
          return result
        iteration += 1
        if self.profile_steps and step + 1 == self.profile_steps[0] and not profiling:
          profile_dir = self.workdir / "profile" / f"process_{jax.process_index()}"
          jax.profiler.start_trace(str(profile_dir))
          profiling = True
        wait_start = time.perf_counter()
        batch = next(loader)
        window["wait"] += time.perf_counter() - wait_start
        state, aux = train_step(state, **batch)
        step += 1
        state = state.replace(step=step)
        loss = aux["loss"] if isinstance(aux, Mapping) and "loss" in aux else aux
        item = (step, snapshot(loss, optimizers.metrics_of(state.opt_state)))
        if pending is not None:
          resolve(pending)
        pending = item
        window["steps"] += 1
        is_last = step == t.steps
        due_eval = is_last or (t.eval_every and step % t.eval_every == 0)
        due_ckpt = is_last or (t.checkpoint_every and step % t.checkpoint_every == 0)
        due_log = is_last or step % t.log_every == 0
        if due_eval or due_ckpt or due_log or not first_step_logged or (
            profiling and step == self.profile_steps[1]):
          resolve(pending)
          pending = None
        if not first_step_logged:
          first_step_logged = True
          writer.log(f"First step done {time.perf_counter() - started:.1f} s after start.")
        if profiling and step == self.profile_steps[1]:
          jax.profiler.stop_trace()
          profiling = False
          writer.log(f"Profile of steps {self.profile_steps[0]}–{step} written to {self.workdir / 'profile'}.")
        if due_log:
          self._log_window(step, window, tokens_per_step, num_devices, peak)
        if due_eval:
          result.eval_loss = self._evaluate(step, state, plan, eval_step)
        if due_ckpt and ckpt.latest_step() != step:
          ckpt.save(step, state, loader, force=True)
          rollbacks_since_checkpoint = 0
        else:
          ckpt.check_background_save()  # a full disk stops the run now, not at the next checkpoint
        if due_eval or due_ckpt:
          window.update(start=time.perf_counter(), steps=0, wait=0.0)
        writer.advance(step)
      except _Halt as e:
        writer.log(str(e))
        result.status, result.step, result.message = "halted", step, str(e)
        return result
      except _Rollback as e:
        pending = None
        latest = ckpt.latest_step()
        rollbacks_since_checkpoint += 1
        if latest is None or rollbacks_since_checkpoint > t.max_nonfinite:
          why = "no checkpoint to roll back to" if latest is None else \
              f"{rollbacks_since_checkpoint} rollbacks without a clean checkpoint (train.max_nonfinite)"
          message = f"non-finite loss or gradients at step {e.step}; {why}; stopping."
          writer.log(message)
          result.status, result.step, result.message = "halted", step, message
          return result
        ckpt.wait_until_finished()
        state = ckpt.restore(plan.abstract_train_state, latest).replace(step=latest)
        writer.log(f"Non-finite loss or gradients at step {e.step}: rolled back to step {latest}; the data moves"
                   f" on past the batches since then.")
        step = latest
        window.update(start=time.perf_counter(), steps=0, wait=0.0, losses=[], grad_norms=[])
    result.step = step
    if profiling:
      jax.profiler.stop_trace()
    ckpt.wait_until_finished()
    writer.log(f"Done: step {step}" + (f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else "")
               + f", {time.perf_counter() - started:.1f} s in all.")
    return result

  def _log_window(self, step, window, tokens_per_step, num_devices, peak) -> None:
    steps = window["steps"]
    if not steps:
      return
    elapsed = time.perf_counter() - window["start"]
    step_time = elapsed / steps
    tokens_per_s = tokens_per_step / step_time
    last = window.get("last", {})
    out: dict[str, Any] = {}
    if window["losses"]:
      out["loss"] = float(np.mean(window["losses"]))
      out["grad_norm"] = float(np.mean(window["grad_norms"]))
    if "learning_rate" in last:
      out["learning_rate"] = last["learning_rate"]
    if "skipped" in last:
      out["skipped"] = int(last["skipped"])
    out.update(step_time_ms=step_time * 1e3, tokens_per_s=tokens_per_s, tokens_per_s_per_device=tokens_per_s / num_devices,
               data_wait_ms=window["wait"] / steps * 1e3)
    if peak and self.flops_per_token:
      out["mfu"] = self.flops_per_token * tokens_per_s / (peak * num_devices)
    memory = metrics_lib.memory_in_use(jax.local_devices()[0])
    if memory is not None:
      out["memory_bytes"] = float(memory)
    self.writer.write(step, out)
    window.update(start=time.perf_counter(), steps=0, wait=0.0, losses=[], grad_norms=[])

  def _evaluate(self, step, state, plan, eval_step) -> float:
    from distrib_train.data.pipeline import DataLoader

    t = self.config.train
    start = time.perf_counter()
    loader = DataLoader(self.config.data_config(), plan.input_kwarg_shardings, split="eval", num_epochs=1)
    total = count = 0.0
    batches = 0
    try:
      for batch in loader:
        aux = eval_step(state, **batch)
        tokens = float(_local_value(aux["tokens"])) if isinstance(aux, Mapping) and "tokens" in aux else 1.0
        loss = aux["loss"] if isinstance(aux, Mapping) else aux
        total += float(_local_value(loss)) * tokens
        count += tokens
        batches += 1
        if t.eval_batches and batches >= t.eval_batches:
          break
    finally:
      loader.close()
    eval_loss = total / max(count, 1.0)
    self.writer.write(step, {"loss": eval_loss, "tokens": count, "batches": batches,
                             "seconds": time.perf_counter() - start}, prefix="eval/")
    return eval_loss
