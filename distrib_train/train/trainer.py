"""The training loop: plan → init or restore → compile → steps → eval → checkpoints, with metrics, preemption
and a non-finite guard.

``Trainer(config, workdir).run()`` trains the model a ``Config`` names (or one given as code: ``model_fn`` and
``loss_fn``) on the mesh its mesh config describes, resuming from the newest checkpoint in ``workdir/checkpoints``
(a finished ``wsd`` run given more steps: from its last stable step, ``wsd.py``).

What it leaves in ``workdir`` (process 0 writes the files, every process writes its checkpoint shards)::

  config.yaml, plan.txt   the effective config; the plan report (every array's layout, bytes per device)
  metrics.jsonl    one JSON object per log point and per evaluation; tensorboard/: event files
  checkpoints/     orbax checkpoints with the data-iterator state
  goodput.json     where the workdir's time went, run by run (``goodput.py``)
  auto_layout.json the layout ``mesh_config: auto`` chose, and its mesh in auto_mesh.yaml
  watchdog/        heartbeats and, after a hang, stacks (train.hang_timeout_s)
  profile/         a jax profiler trace, when asked for
  rollouts.jsonl   ``train.objective: grpo``'s completions, one per line (``rollouts.py``)

The step is compiled ahead of the loop with the real shardings, so its memory analysis is known (and a GPU
step that cannot fit refused) before the first step. The trainer then hands a ``TrainLoop`` (``loop.py``) the
state and the step, with its periodic work as hooks (``hooks.py``: profile, log, checkpoint, evaluation, task
scores: ``eval_hook.py``) and the non-finite guard (``nonfinite.py``).

Not for: parsing flags (``cli.py``), what a step computes (``train_step.py``), the step loop itself
(``loop.py``) or the start-up refusals (``checks.py``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from distrib_train.cluster import distributed
from distrib_train.train import metrics as metrics_lib
from distrib_train.config import job as job_lib
from distrib_train.train import window as window_lib
from distrib_train.checkpoint.checks import check_restorable, read_meta
from distrib_train.checkpoint.faults import finish_event_loops_before_closing
from distrib_train.checkpoint.manager import CheckpointManager
from distrib_train.checkpoint.tiers import CheckpointTiers, local_tier
from distrib_train.train.checks import (
  TrainerSetupError,
  check_same_tokenizer,
  check_path_components,
  check_step_fits,
  check_workdir,
  tokenizer_fingerprint,
)
from distrib_train.train.compilation import CacheEvents, cache_unsafe_reason, memory_line, setup_compilation_cache
from distrib_train.config.run import Config
from distrib_train.config.plan_checks import (
  check_batch_is_split,
  check_context,
  check_every_axis_is_used,
  check_fp8,
  check_microbatches,
)
from distrib_train.evaluation import hook as eval_hook
from distrib_train.podplan import layout_choice
from distrib_train.train import eval_pass as evaluation, wsd
from distrib_train.weights import init_from
from distrib_train.posttrain import reference_pass, rollouts
from distrib_train.train.goodput import Goodput, PhaseClock
from distrib_train.train.hooks import Profiler
from distrib_train.train.loop import RunResult, TrainLoop, aux_scalars
from distrib_train.train.nonfinite import NonFiniteGuard
from distrib_train.sharding.mesh import MeshConfig, build_mesh, find_mesh_config
from distrib_train.sharding.planner import MeshPlanner
from distrib_train.train_state import TrainState
from distrib_train.train_step import build_eval_step_fn, build_train_step_fn
from distrib_train.train.watchdog import Limits, Watchdog
from distrib_train.train.workdir_lock import acquire_for_job, check_free_for_job


@dataclasses.dataclass(frozen=True)
class SourceRun:
  """This run as its batch source sees it (``data/batch_source.RunContext``)."""

  workdir: pathlib.Path
  log: Callable[[str], None]
  phase: Callable[[str], Any]
  checkpoint_steps: Callable[[], list[int]]


# Importable from here as before: the run's result, the start-up error, the path check.
__all__ = ["EXIT_HALTED", "RunResult", "Trainer", "TrainerSetupError", "aux_scalars", "check_path_components"]

EXIT_HALTED = 3  # the process exit code of a run stopped by the non-finite guard


@dataclasses.dataclass(frozen=True)
class _SetUp:
  """What ``Trainer._set_up`` checked and opened: the plan, the training loader, the workdir's lock, the
  tokenizer's fingerprint, why there is no evaluation (None when there is) and the compilation cache's state."""

  plan: Any
  loader: Any
  lock: Any
  tokenizer: Any
  no_eval: str | None
  cache: str


class Trainer:
  """Runs one experiment in ``workdir``.

  Args:
    config: the checked experiment config.
    workdir: where the run's files go; created when the run starts.
    model_fn: ``model_fn(seed) -> model`` instead of the config's reference model (with ``loss_fn``;
      ``input_axes`` for the batch's logical axes).
    loss_fn: a penzai-style loss, ``loss_fn(*, model, state, rng, **batch) -> (loss, state, aux)``; aux may
      hold ``loss`` and ``tokens``.
    input_axes: logical axes per input name.
    profile_steps: ``(first, last)`` steps to trace with the jax profiler.
    console: where console lines go (default stderr).
    layout_search: for ``mesh_config: auto``, ``(config, workdir) -> layout_choice.Choice``; default
      ``distrib_train.podplan.auto.search`` (``distrib-train`` passes it with its console lines).
  """

  def __init__(
    self,
    config: Config,
    workdir: str | os.PathLike,
    *,
    model_fn: Callable[[int], Any] | None = None,
    loss_fn: Callable[..., Any] | None = None,
    input_axes: Mapping[str, Any] | None = None,
    profile_steps: tuple[int, int] | None = None,
    console=None,
    layout_search: Callable[..., Any] | None = None,
  ):
    self.config = config
    self.workdir = pathlib.Path(workdir).expanduser().absolute()
    # The model, loss and family, resolved once for the run and its job (``job.job_spec``).
    self.parts = job_lib.model_parts(config, model_fn=model_fn, loss_fn=loss_fn, input_axes=input_axes)
    self.loss_fn = self.parts.loss_fn
    family, per_token = self.parts.family, self.parts.family.flops_per_token(config.data.seq_len)
    self.flops_per_token = None if per_token is None else per_token * self.parts.flops_scale
    # Ids at or beyond it would be looked up as NaN: every step skipped.
    self.vocab_size = family.vocab_size
    self.fp8 = family.capabilities().fp8
    self.profile_steps, self.console = profile_steps, console
    # mesh_config: auto: ``layout_search`` chooses the mesh when the run starts (``podplan/layout_choice.py``)
    self._layout_search, self._model_args = (
      layout_search,
      dict(model_fn=model_fn, loss_fn=loss_fn, input_axes=input_axes),
    )
    self.mesh_config = self.layout = None
    self.tiers: CheckpointTiers | None = None  # the checkpoint tiers, once a run sets them up
    try:
      if config.mesh_config != layout_choice.AUTO:
        self.mesh_config = MeshConfig.from_yaml(find_mesh_config(config.mesh_config))
    except ValueError as e:
      raise TrainerSetupError(str(e)) from None

  def _choose_layout(self) -> None:
    """``mesh_config: auto``: the layout search's choice for these devices, its settings applied."""
    search = self._layout_search
    if search is None:
      from distrib_train.podplan.auto import search
    try:
      self.layout = layout_choice.choose(self.config, self.workdir, search, self._model_args["model_fn"] is not None)
    except ValueError as e:
      raise TrainerSetupError(str(e)) from None
    self.config, self.mesh_config = self.layout.apply(self.config), self.layout.mesh_config
    self.parts = job_lib.model_parts(self.config, **self._model_args)
    self.loss_fn = self.parts.loss_fn

  # --- setup -------------------------------------------------------------------

  def _plan(self):
    self.job = job_lib.job_spec(self.config, parts=self.parts)
    mesh = build_mesh(self.mesh_config)
    self.data_config = job_lib.data_config(self.config, self.job.family, mesh)
    planner = MeshPlanner(mesh, job_lib.rules_for(self.config, self.mesh_config))
    self.rules = planner.rules  # for activation_sharding while the steps are traced
    check_every_axis_is_used(mesh, planner.rules, job_lib.rule_set_name(self.config, self.mesh_config))
    plan = job_lib.plan_job(self.job, planner)
    if not self.config.data.allow_replicated_batch:
      check_batch_is_split(plan, planner.rules, self.config.data.global_batch_size)
    check_microbatches(
      plan, self.config.data.global_batch_size, self.config.train.microbatches, self.config.train.pipeline_repeats
    )
    check_context(plan, self.config.data.seq_len)
    check_fp8(plan, self.fp8)
    return plan

  def run(self) -> RunResult:
    """Trains to ``config.train.steps`` (or until preempted or halted).

    Set-up (``_set_up``: every check, before the workdir is touched), the run's records (``_open_records``), the
    steps (``_build_steps``, ``_compile``), then the loop.

    Raises:
      TrainerSetupError: the run cannot start (raised before the workdir is written to).
      CheckpointWriteError: a checkpoint could not be written (a full or read-only disk); the steps before it stay.
    """
    started = time.perf_counter()
    if self.mesh_config is None:
      self._choose_layout()
    t = self.config.train
    # From here SIGTERM / SIGINT end the run at once (``distributed.Terminated``), except between steps,
    # where the first one saves and stops.
    preemption = distributed.Preemption()
    setup = self._set_up(preemption)
    plan, loader = setup.plan, setup.loader
    writer, goodput, watchdog = self._open_records(setup, started)
    ckpt = None
    try:
      fields = init_from.saved_fields(self.frozen)
      local = local_tier(self.workdir, t.local_checkpoint_dir, fields) if t.local_checkpoint_every else None
      wsd.extend(self.workdir / "checkpoints", local, self.config, writer.log)  # a finished wsd run extended
      ckpt = CheckpointManager(
        self.workdir / "checkpoints",
        max_to_keep=t.keep_checkpoints,
        keep_steps=wsd.kept_steps(self.config),
        async_save=t.async_checkpoint,
        saved_fields=fields,
        metadata={"config": self.config.to_dict(), "tokenizer": setup.tokenizer, "frozen_source": self.frozen},
      )
      self.tiers = CheckpointTiers(ckpt, local, writer.log)
      state = self._init_or_restore(plan, loader)
      if jax.process_index() == 0:
        (self.workdir / "config.yaml").write_text(self.config.to_yaml())
        (self.workdir / "plan.txt").write_text(plan.report() + "\n")
      step = int(state.step)
      self.phases.enter("compile", step)
      if step >= t.steps:
        writer.log(f"Step {step} of {t.steps} is already done in {self.workdir}; nothing to train.")
        return RunResult("already_done", step)
      goodput.start(step)
      train_step, eval_step = self._build_steps(plan)
      self._compile(train_step, plan, step)
      if self.layout is not None:  # kept for a restart once its step has compiled and fits
        layout_choice.keep(self.workdir, self.layout)
      distributed.wait_for_every_process("train step compiled")
      preemption.enter_steps()
      # A rollback restores onto the frozen weights as they are (never updated; a checkpoint may not hold them).
      rollback = plan.abstract_train_state.replace(model_without_params=state.model_without_params)
      loop = TrainLoop(
        state=state,
        train_step=train_step,
        source=loader,
        ckpt=ckpt,
        abstract_train_state=rollback,
        writer=writer,
        guard=NonFiniteGuard(t.nonfinite, t.max_nonfinite, writer.log),
        preemption=preemption,
        last_step=t.steps,
        vocab_size=self.vocab_size,
        started=started,
        phases=self.phases,
      )
      self._add_hooks(loop, plan, eval_step)
      result = loop.run()
      goodput.finish(result.status)
      return result
    finally:
      try:
        preemption.close()
        if ckpt is not None:
          ckpt.close()
      finally:
        loader.close()
        goodput.finish("failed")  # when not finished above
        writer.close()
        setup.lock.release()
        watchdog.close(failed=sys.exc_info()[1] is not None)  # last: a cleanup that waits for a dead peer is a hang

  def _set_up(self, preemption: distributed.Preemption) -> _SetUp:
    """Everything that can fail on a bad setup, before the workdir is touched: the plan and its checks, the
    checkpoint and weights to start from, the loader, the eval split; then the workdir and its lock.

    Raises:
      TrainerSetupError: a bad config, checkpoint, corpus or mesh (``ValueError`` below, in one line).
    """
    from distrib_train.data.pipeline import DataLoader

    t = self.config.train
    loader = None
    try:
      finish_event_loops_before_closing()  # a damaged checkpoint's failed reads leave nothing behind either
      cache_off = cache_unsafe_reason() if t.compilation_cache_dir else None
      cache_dir = setup_compilation_cache(t.compilation_cache_dir, enable=not cache_off)
      check_workdir(self.workdir)
      check_free_for_job(self.workdir)  # a running job's checkpoints change under a reader: name the job instead
      plan = self._plan()
      latest = check_restorable(self.workdir / "checkpoints", plan.abstract_train_state)  # reads metadata only
      tokenizer = tokenizer_fingerprint(self.config.data_config())
      # The sources of the frozen weights this run's checkpoints leave out (None: they are saved): a resumed
      # run's are its checkpoint's (where their files are now), a new run's its config's.
      self.frozen = init_from.frozen_source(self.config)
      if latest is not None:
        meta, where = read_meta(self.workdir / "checkpoints", latest), f"Checkpoint step {latest} in {self.workdir}"
        check_same_tokenizer(meta, tokenizer, where)
        self.frozen = init_from.restore_source(meta, self.config, where)
      elif t.init_from:
        init_from.check(self.config, plan.abstract_train_state)
      if self.config.train.objective == "dpo" and self.config.dpo.precompute_reference:  # before any loader
        kept = reference_pass.ensure(self.config, self.job, plan, self.rules, init_from.load, self.data_config)
        self.data_config = dataclasses.replace(self.data_config, reference_logps=kept)
      if self.parts.objective.rollouts:  # the policy's own completions (train.objective: grpo), no held-out loss
        run = SourceRun(
          self.workdir, lambda line: self.writer.log(line), lambda name: self.phases.phase(name), self._checkpoint_steps
        )  # read when the source asks: the writer and tiers come later
        loader, no_eval = rollouts.RolloutSource(self.config, plan, self.rules, run), rollouts.NO_EVAL
      else:
        loader = DataLoader(self.data_config, plan.input_kwarg_shardings, vocab_size=self.vocab_size)
        no_eval = evaluation.missing_eval_split(
          self.data_config, plan.input_kwarg_shardings, self.vocab_size, t.eval_every
        )
      eval_hook.check(self.config)  # train.eval_tasks: lm-eval there, each task known and local
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
    return _SetUp(plan, loader, lock, tokenizer, no_eval, cache_dir or cache_off or "off")

  def _open_records(self, setup: _SetUp, started: float):
    """The run's metric writer, phase clock, goodput record and watchdog, and its first lines."""
    t, plan = self.config.train, setup.plan
    primary = jax.process_index() == 0
    writer = metrics_lib.MetricWriter(self.workdir if primary else None, t.steps, console=self.console)
    self.writer = writer
    # Phases for the goodput record (process 0 writes goodput.json) and the hang watchdog (off unless asked for).
    self.phases = PhaseClock(layout_search=self.layout.seconds if self.layout else 0.0)
    goodput = self.goodput = Goodput(self.workdir, self.phases, started=started, log=writer.log)
    if self.layout is not None:
      writer.log(self.layout.line)
    watchdog = Watchdog(Limits.from_config(t), self.phases, self.workdir).start()
    self._evaluations = setup.no_eval is None
    if setup.lock.warning:
      writer.log(setup.lock.warning)
    if setup.no_eval is not None:
      writer.log(f"No evaluation in this run: {setup.no_eval}")
    writer.log(
      f"{distributed.topology()}; mesh "
      + " × ".join(f"{k}={v}" for k, v in plan.mesh.shape.items())
      + f"; compilation cache: {setup.cache}"
    )
    writer.log(plan.summary() + ("\n  the whole table: " + str(self.workdir / "plan.txt") if primary else ""))
    return writer, goodput, watchdog

  def _build_steps(self, plan):
    """The donating train step and the eval step, on the plan's shardings with the job's microbatches, each
    traced in the plan's activation layout (its rules; without it XLA may keep every device's copy of the whole
    batch's activations on an FSDP mesh: llama-7b on 256 chips, 281 vs 10.8 GiB)."""
    train_step = build_train_step_fn(
      self.loss_fn,
      donate_params_and_state=True,
      train_state_shardings=plan.train_state_shardings,
      input_kwarg_shardings=plan.input_kwarg_shardings,
      aux_output_shardings=plan.aux_output_shardings,
      **job_lib.step_options(self.job, plan, self.rules),
    )
    eval_step = build_eval_step_fn(
      self.loss_fn,
      train_state_shardings=plan.train_state_shardings,
      input_kwarg_shardings=plan.input_kwarg_shardings,
      aux_output_shardings=plan.aux_output_shardings,
      **job_lib.eval_step_options(self.job, self.rules),
    )
    return train_step, eval_step

  def _compile(self, train_step, plan, step: int) -> None:
    """Compiles the train step ahead of the loop and says how: cache, memory, pipeline or accumulation; a GPU
    step too large is refused here (one line, exit 2)."""
    t, writer = self.config.train, self.writer
    compile_start = time.perf_counter()
    with CacheEvents() as cache:
      compiled = train_step.compile(plan.abstract_train_state.replace(step=step), **self.job.inputs)
    source = "from the persistent cache" if cache.hits and not cache.misses else "compiled"
    writer.log(f"Train step {source} in {time.perf_counter() - compile_start:.1f} s; " + memory_line(compiled))
    check_step_fits(compiled, plan.mesh.local_devices[0])
    if train_step.pipelining is not None:
      p = train_step.pipelining
      writer.log(
        f"Pipeline: {p.stages} stages, {p.microbatches} microbatches, "
        + ("GPipe" if p.repeats == 1 else f"circular with {p.repeats} repeats")
        + f"; bubble {p.bubble():.1%} of each stage's iterations."
      )
    elif t.microbatches > 1:
      writer.log(
        f"Gradient accumulation: {t.microbatches} microbatches of"
        f" {self.config.data.global_batch_size // t.microbatches} rows per step."
      )

  def _checkpoint_steps(self) -> list[int]:
    """The steps either checkpoint tier may restore now (none before the tiers are set up)."""
    if self.tiers is None:
      return []
    return self.tiers.persistent.all_steps() + (self.tiers.local.steps() if self.tiers.local is not None else [])

  def _init_or_restore(self, plan, loader) -> TrainState:
    """The newest state either checkpoint tier holds (``checkpoint/tiers.py``), else a new one."""
    self.phases.enter("init" if self.tiers.persistent.latest_step() is None else "restore")
    target, local, latest = plan.abstract_train_state, self.tiers.local, self.tiers.persistent.latest_step()
    # (the local tier's complete step is agreed by every process: they all read the frozen weights, or none)
    if self.frozen and (latest is not None or (local and local.complete_step(target, None) is not None)):
      # the frozen weights from their sources (the rest of that state dropped at once); the rest from the step
      frozen = init_from.with_frozen(self.config, self.frozen, target, plan.init(self.job.make_state))
      target = target.replace(model_without_params=frozen.model_without_params)
      del frozen
    state = self.tiers.restore(target, loader, self.config.changes_since)
    if state is not None:
      return state
    state = plan.init(self.job.make_state)
    self.writer.log("Initialised a new train state (sharded).")
    if self.config.train.init_from:
      state, line = init_from.load(self.config, plan.abstract_train_state, state)
      self.writer.log(line + " The optimizer starts fresh.")
    return state.replace(step=int(state.step))

  # --- the loop's periodic work --------------------------------------------------

  def _add_hooks(self, loop: TrainLoop, plan, eval_step) -> None:
    """Profile, log, checkpoint and evaluation hooks, in the order they run after a step."""
    t = self.config.train
    if self.profile_steps:
      Profiler(self.profile_steps, self.workdir / "profile", self.writer.log).register(loop.hooks)
    throughput = dict(
      tokens_per_step=self.config.data.global_batch_size * self.config.data.seq_len,
      num_devices=plan.mesh.size,
      peak_flops=metrics_lib.peak_flops(jax.devices()[0], t.peak_tflops),
      flops_per_token=self.flops_per_token,
    )

    def log_window(loop: TrainLoop) -> None:
      record = window_lib.figures(loop.window, **throughput)
      if record is not None:
        self.writer.write(loop.step, record)
        loop.window.reset()

    def save_checkpoint(loop: TrainLoop) -> None:
      with loop.phases.phase("checkpoint"):
        if loop.ckpt.latest_step() != loop.step:
          loop.ckpt.save(loop.step, loop.state, loop.source, force=True)
          loop.guard.checkpoint_saved()
        else:
          loop.ckpt.check_background_save()

    def save_local(loop: TrainLoop) -> None:
      with loop.phases.phase("checkpoint"):
        self.tiers.local.save(loop.step, loop.state, loop.source)

    def evaluate(loop: TrainLoop) -> None:
      if self._evaluations:
        with loop.phases.phase("eval"):
          loop.result.eval_loss = self._evaluate(loop.step, loop.state, plan, eval_step)

    loop.hooks.add_hook(log_window, every=t.log_every)
    # The checkpoint before the evaluation: an evaluation that fails must not lose the steps trained.
    stable = wsd.stable_step(self.config)  # wsd's last stable step too, kept to extend the run from
    loop.hooks.add_hook(
      save_checkpoint,
      when=lambda step: step in (stable, t.steps) or bool(t.checkpoint_every and step % t.checkpoint_every == 0),
      pauses_clock=True,
      between=lambda loop: loop.ckpt.check_background_save(),
    )  # a full disk stops the run now
    if self.tiers.local is not None:
      loop.hooks.add_hook(save_local, every=t.local_checkpoint_every, pauses_clock=True)
    loop.hooks.add_hook(evaluate, every=t.eval_every, pauses_clock=True)
    eval_hook.register(loop, self.config, plan, self.rules, self.writer, self.phases)  # train.eval_tasks
    self.goodput.register(loop.hooks, every=t.log_every, checkpoint_every=t.checkpoint_every)  # last: after the rest

  def _evaluate(self, step, state, plan, eval_step) -> float:
    return evaluation.evaluate(
      eval_step,
      state,
      step,
      self.data_config,
      plan.input_kwarg_shardings,
      writer=self.writer,
      batches=self.config.train.eval_batches,
      phases=self.phases,
      objective=self.parts.objective,
    )
