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

from distrib_train.cluster import distributed
from distrib_train.training import metrics as metrics_lib
from distrib_train.training import optimizers
from distrib_train.sharding.axis_rules import activation_sharding
from distrib_train.checkpoint.checks import check_restorable
from distrib_train.checkpoint.manager import CheckpointManager, _quiet_echoes_of_failed_writes
from distrib_train.checkpoint.checks import CheckpointError, first_line
from distrib_train.training.compilation import CacheEvents, memory_line, setup_compilation_cache
from distrib_train.training.config import Config
from distrib_train.sharding.mesh import MeshConfig, build_mesh, find_mesh_config
from distrib_train.sharding.planner import MeshPlanner
from distrib_train.train_state import TrainState
from distrib_train.train_step import build_eval_step_fn, build_train_step_fn
from distrib_train.training.workdir_lock import acquire_for_job

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
  workdir is written to, but for token ids outside the vocabulary found in
  the first batch (before any step; ``config.yaml`` and ``plan.txt`` exist)."""


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


NAME_MAX = 255  # bytes in one path component on Linux, macOS and GCS-fuse alike


def check_path_components(path: pathlib.Path, what: str) -> None:
  """Refuses a path with a component longer than file systems allow (else
  ``exists()`` itself raises ``File name too long`` deep in the setup)."""
  for component in path.parts:
    size = len(os.fsencode(component))
    if size > NAME_MAX:
      raise ValueError(f"{what} {str(path)[:60]!r}…: the path component {component[:40]!r}… is {size} bytes;"
                       f" a file or directory name may have at most {NAME_MAX}.")


def _check_workdir(workdir: pathlib.Path) -> None:
  """Fails, creating nothing, when ``workdir`` cannot be a writable directory."""
  check_path_components(workdir, "Workdir")
  existing = workdir
  while not existing.exists() and existing != existing.parent:
    existing = existing.parent
  if not existing.is_dir():
    where = "is a file" if existing == workdir else f"cannot be created: {str(existing)!r} is a file"
    raise ValueError(f"Workdir {str(workdir)!r} {where}; give a directory.")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"Workdir {str(workdir)!r} cannot be written: no write permission on {str(existing)!r}.")


def _check_every_axis_is_used(mesh: jax.sharding.Mesh, rules, rule_set: str) -> None:
  """Refuses a mesh axis of size > 1 that no rule maps anything onto (a typo
  such as ``contxt``): the job would run replicated along it."""
  unused = [f"{name} (size {size})" for name, size in mesh.shape.items()
            if size > 1 and name not in rules.mesh_axis_names]
  if unused:
    raise ValueError(
        f"Mesh axis {', '.join(unused)} is used by no axis rule in {rule_set}, so every array would be replicated"
        f" along it; rules map onto {', '.join(sorted(rules.mesh_axis_names)) or 'no axis'}. Fix the axis name,"
        " add a rule for it, or give it size 1.")


def _check_batch_is_split(plan, rules, global_batch_size: int) -> None:
  """Refuses a global batch the batch rule's mesh axes do not divide (the
  planner would replicate the batch, each device computing all of it)."""
  sizes = plan.mesh.shape
  wanted = next((axes for logical, axes in rules.rules if logical == "batch"), None) or ()
  wanted = [a for a in wanted if a in sizes]
  ways = math.prod(sizes[a] for a in wanted)
  spec = plan.input_kwarg_shardings["tokens"].spec
  got = spec[0] if len(spec) else None
  got_ways = math.prod(sizes[a] for a in ((got,) if isinstance(got, str) else tuple(got or ())))
  if got_ways < ways and global_batch_size % ways:
    split = " × ".join(f"{a}={sizes[a]}" for a in wanted)
    raise ValueError(
        f"data.global_batch_size {global_batch_size} does not divide over the mesh's batch axes {split} = {ways};"
        f" the batch would be {'replicated' if got_ways == 1 else f'split only {got_ways} ways'}, every device"
        f" computing {'all' if got_ways == 1 else 'more'} of it. Use a multiple of {ways}, or set"
        " data.allow_replicated_batch=true.")


_barrier_ids = itertools.count()
_extremes = jax.jit(lambda x: jnp.stack([jnp.min(x), jnp.max(x)]))


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


def aux_scalars(aux: Any) -> dict[str, Any]:
  """The scalars a loss returns in ``aux`` besides ``loss`` and ``tokens``
  (accuracy, perplexity, …): logged like the loss, window-means in training
  and token-weighted means in evaluation."""
  if not isinstance(aux, Mapping):
    return {}
  return {str(name): value for name, value in aux.items()
          if name not in ("loss", "tokens") and np.ndim(value) == 0
          and jnp.issubdtype(getattr(value, "dtype", np.asarray(value).dtype), jnp.number)}


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
    # Ids at or beyond it would be looked up as NaN: every step skipped.
    self.vocab_size = getattr(model_config, "vocab_size", None)
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
    from distrib_train.sharding.plan import logical_annotations_only

    with logical_annotations_only():
      abstract = jax.eval_shape(make_state)
    self.inputs = example_inputs(self.config)
    planner = MeshPlanner(mesh, rules)
    self.rules = planner.rules  # for activation_sharding while the steps are traced
    rule_set = f"the rules of {self.mesh_config.source}" if self.mesh_config.rules is not None else \
        f"rule set {t.rules!r} (train.rules)"
    _check_every_axis_is_used(mesh, planner.rules, rule_set)
    plan = planner.plan(abstract, loss_fn=self.loss_fn, inputs=self.inputs, input_axes=self.input_axes)
    if not self.config.data.allow_replicated_batch:
      _check_batch_is_split(plan, planner.rules, self.config.data.global_batch_size)
    return plan

  def _missing_eval_split(self, plan) -> str | None:
    """Why the run cannot evaluate (no held-out split), or None when it can.

    Checked at start-up: without it a run trained every step and then failed
    in its final evaluation.

    Raises:
      ValueError: evaluations were asked for (``train.eval_every``) but
        there is nothing to evaluate on.
    """
    from distrib_train.data.pipeline import DataLoader

    try:
      DataLoader(self.config.data_config(), plan.input_kwarg_shardings, split="eval", num_epochs=1,
                 vocab_size=self.vocab_size).close()
      return None
    except ValueError as e:
      why = str(e)
    every = self.config.train.eval_every
    if every:
      raise ValueError(f"train.eval_every={every} asks for evaluations, but there is no eval split: {why} Set"
                       " train.eval_every=0 to train without them, or hold documents out with data.eval_fraction.")
    return why

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

    # From here SIGTERM / SIGINT end the run at once (``distributed.Terminated``), except between steps,
    # where the first one saves and stops.
    preemption = distributed.Preemption()
    loader = lock = None
    try:  # everything that can fail on a bad setup, before the workdir is touched
      _quiet_echoes_of_failed_writes()  # a damaged checkpoint's failed reads echo too, from the first check on
      cache_dir = setup_compilation_cache(t.compilation_cache_dir)
      _check_workdir(self.workdir)
      plan = self._plan()
      check_restorable(self.workdir / "checkpoints", plan.abstract_train_state)  # reads metadata only
      loader = DataLoader(self.config.data_config(), plan.input_kwarg_shardings, vocab_size=self.vocab_size)
      no_eval = self._missing_eval_split(plan)
      if jax.process_index() == 0:
        self.workdir.mkdir(parents=True, exist_ok=True)
      # Before anything else is written: a second job would delete the first's in-progress checkpoint.
      lock = acquire_for_job(self.workdir)
    except BaseException as e:
      preemption.close()
      if loader is not None:
        loader.close()
      if isinstance(e, ValueError):
        raise TrainerSetupError(str(e)) from None
      raise

    primary = jax.process_index() == 0
    writer = metrics_lib.MetricWriter(self.workdir if primary else None, t.steps, console=self.console)
    self.writer = writer
    self._evaluations = no_eval is None
    if lock.warning:
      writer.log(lock.warning)
    if no_eval is not None:
      writer.log(f"No evaluation in this run: {no_eval}")
    writer.log(f"{distributed.topology()}; mesh " + " × ".join(f"{k}={v}" for k, v in plan.mesh.shape.items())
               + f"; compilation cache: {cache_dir or 'off'}")
    writer.log(plan.summary() + ("\n  the whole table: " + str(self.workdir / "plan.txt") if primary else ""))
    ckpt = None
    try:
      ckpt = CheckpointManager(self.workdir / "checkpoints", max_to_keep=t.keep_checkpoints,
                               async_save=t.async_checkpoint, metadata={"config": config.to_dict()})
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
        preemption.enter_steps()
        return self._loop(state, step, plan, loader, ckpt, train_step, eval_step, preemption, started)
    finally:
      try:
        preemption.close()
        if ckpt is not None:
          ckpt.close()
      finally:
        loader.close()
        writer.close()
        lock.release()

  def _init_or_restore(self, ckpt: CheckpointManager, plan, loader) -> TrainState:
    latest = ckpt.latest_step()
    if latest is None:
      state = plan.init(self.make_state)
      self.writer.log("Initialised a new train state (sharded).")
      return state.replace(step=int(state.step))
    meta = ckpt.metadata_of(latest)
    saved = (meta.get("run") or {}).get("config") or {}
    now = self.config.to_dict()
    # Of the train section only the seed shapes what a checkpoint holds; steps and intervals may change.
    compared = {"model": None, "optimizer": None, "data": None, "train": ("seed",)}
    changed = [f"{section}.{key}: {saved[section].get(key)!r} → {value!r}"
               + (" (ignored: the weights and keys continue from the checkpoint)" if section == "train" else "")
               for section, keys in compared.items() if isinstance(saved.get(section), dict)
               for key, value in now[section].items()
               if (keys is None or key in keys) and saved[section].get(key) != value]
    if changed:
      self.writer.log("The config differs from the checkpoint's: " + "; ".join(changed))
    same_layout = meta.get("process_count") == jax.process_count()
    try:
      state = ckpt.restore(plan.abstract_train_state, latest, data_iterator=loader if same_layout else None)
    except CheckpointError as e:
      data_changed = [c for c in changed if c.startswith("data.")]
      if not (same_layout and data_changed):
        raise
      # grain's own error ("'next_index'") would blame the checkpoint for a changed setting.
      raise CheckpointError(
          f"Checkpoint step {latest} in {str(ckpt.directory)!r} holds the data pipeline's position for another"
          f" data config ({'; '.join(data_changed)}); resume with the checkpoint's values, or train in a new"
          f" workdir. (Restoring said: {first_line(e)})") from None
    if not same_layout:
      self.writer.log(f"The checkpoint was written by {meta.get('process_count')} process(es), this job has "
                      f"{jax.process_count()}: the data pipeline restarts from its beginning.")
    self.writer.log(f"Restored step {latest} from {ckpt.directory}.")
    return state.replace(step=int(latest))

  # --- the loop ----------------------------------------------------------------

  def _check_token_ids(self, batch: Mapping[str, jax.Array]) -> None:
    """Refuses a first batch whose ids fall outside the model's vocabulary
    (every process computes the same global extremes)."""
    if self.vocab_size is None:
      return
    for name in ("tokens", "targets"):
      if name not in batch:
        continue
      low, high = (int(v) for v in _local_value(_extremes(batch[name])).tolist())
      if high >= self.vocab_size or low < 0:
        bad = high if high >= self.vocab_size else low
        raise TrainerSetupError(
            f"The first batch's {name} hold token id {bad}, outside the model's vocabulary of {self.vocab_size}"
            f" ids (0 to {self.vocab_size - 1}); use a tokenizer that matches the model or a larger"
            " model.vocab_size.")

  def _loop(self, state, step, plan, loader, ckpt, train_step, eval_step, preemption, started) -> RunResult:
    t = self.config.train
    writer = self.writer
    snapshot = jax.jit(lambda loss, m, extra: jnp.stack(
        [jnp.asarray(loss, jnp.float32)] + [jnp.asarray(m[k], jnp.float32) for k in sorted(m)]
        + [jnp.asarray(extra[k], jnp.float32) for k in sorted(extra)]))
    metric_names = sorted(optimizers.metrics_of(state.opt_state))
    tokens_per_step = self.config.data.global_batch_size * self.config.data.seq_len
    num_devices = plan.mesh.size
    peak = metrics_lib.peak_flops(jax.devices()[0], t.peak_tflops)
    result = RunResult("finished", step)
    window = {"start": time.perf_counter(), "steps": 0, "wait": 0.0, "losses": [], "grad_norms": [], "aux": {}}
    steps_this_run = 0
    self._consecutive_bad = 0
    rollbacks_since_checkpoint = 0
    pending = None
    iteration = 0
    first_step_logged = False
    profiling = False
    writer.start_progress(step)

    def resolve(item):
      """Host-side checks of one finished step (blocks until it is done)."""
      done_step, snap, aux_names = item
      values = dict(zip(["loss"] + metric_names + [f"aux:{k}" for k in aux_names], _local_value(snap).tolist()))
      loss, grad_norm = values["loss"], values.get("grad_norm", 0.0)
      if math.isfinite(loss) and math.isfinite(grad_norm):
        self._consecutive_bad = 0
        result.losses[done_step] = loss
        window["losses"].append(loss)
        window["grad_norms"].append(grad_norm)
        for name in aux_names:
          window["aux"].setdefault(name, []).append(values[f"aux:{name}"])
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
        if not steps_this_run:
          self._check_token_ids(batch)
        state, aux = train_step(state, **batch)
        step += 1
        steps_this_run += 1
        state = state.replace(step=step)
        loss = aux["loss"] if isinstance(aux, Mapping) and "loss" in aux else aux
        extra = aux_scalars(aux)
        item = (step, snapshot(loss, optimizers.metrics_of(state.opt_state), extra), sorted(extra))
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
        if is_last and not result.losses:
          raise _Halt(f"every one of the {steps_this_run} step(s) of this run had a non-finite loss or gradients"
                      " (all updates skipped); stopping without a checkpoint. Check the data (token ids within"
                      " the vocabulary?) and the learning rate.")
        if not first_step_logged:
          first_step_logged = True
          writer.log(f"First step done {time.perf_counter() - started:.1f} s after start.")
        if profiling and step == self.profile_steps[1]:
          jax.profiler.stop_trace()
          profiling = False
          writer.log(f"Profile of steps {self.profile_steps[0]}–{step} written to {self.workdir / 'profile'}.")
        if due_log:
          self._log_window(step, window, tokens_per_step, num_devices, peak)
        # The checkpoint first: an evaluation that fails must not lose the steps trained.
        if due_ckpt and ckpt.latest_step() != step:
          ckpt.save(step, state, loader, force=True)
          rollbacks_since_checkpoint = 0
        else:
          ckpt.check_background_save()  # a full disk stops the run now, not at the next checkpoint
        if due_eval and self._evaluations:
          result.eval_loss = self._evaluate(step, state, plan, eval_step)
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
        window.update(start=time.perf_counter(), steps=0, wait=0.0, losses=[], grad_norms=[], aux={})
    preemption.leave_steps()  # a signal from here stops at once: the last save is only being finished
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
    for name, values in window["aux"].items():
      out.setdefault(name, float(np.mean(values)))
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
    window.update(start=time.perf_counter(), steps=0, wait=0.0, losses=[], grad_norms=[], aux={})

  def _evaluate(self, step, state, plan, eval_step) -> float:
    from distrib_train.data.pipeline import DataLoader

    t = self.config.train
    start = time.perf_counter()
    loader = DataLoader(self.config.data_config(), plan.input_kwarg_shardings, split="eval", num_epochs=1)
    total = count = 0.0
    batches = 0
    aux_totals: dict[str, float] = {}
    try:
      for batch in loader:
        aux = eval_step(state, **batch)
        tokens = float(_local_value(aux["tokens"])) if isinstance(aux, Mapping) and "tokens" in aux else 1.0
        loss = aux["loss"] if isinstance(aux, Mapping) else aux
        total += float(_local_value(loss)) * tokens
        for name, value in aux_scalars(aux).items():  # token-weighted, like the loss
          aux_totals[name] = aux_totals.get(name, 0.0) + float(_local_value(value)) * tokens
        count += tokens
        batches += 1
        if t.eval_batches and batches >= t.eval_batches:
          break
    finally:
      loader.close()
    eval_loss = total / max(count, 1.0)
    aux_means = {name: value / max(count, 1.0) for name, value in aux_totals.items()}
    self.writer.write(step, {**aux_means, "loss": eval_loss, "tokens": count, "batches": batches,
                             "seconds": time.perf_counter() - start}, prefix="eval/")
    return eval_loss
