"""Where a workdir's wall time goes, across restarts: the phase clock and ``goodput.json``.

Every process keeps a ``PhaseClock``: the trainer and the loop mark the phase
the process is in, and the clock adds up the seconds of each. The hang
watchdog (``watchdog.py``) reads the same clock to see how long the current
phase has lasted. Phases and the goodput category their time counts as::

  phase          category       what it is
  layout_search  layout_search  ``mesh_config: auto`` choosing the layout (``podplan/layout_choice.py``)
  startup        other          the trainer's start-up (before the clock, too)
  init           other          a new run's sharded init (or ``train.init_from``)
  restore        restore        reading the newest checkpoint (or a rollback's)
  compile        compile        compiling the step and waiting for every process
  data           data_wait      waiting for a batch
  step           productive     dispatching steps, reading their loss, logging
                 replayed       ... of a step trained before by a run that died
                                before checkpointing it
  checkpoint     checkpoint     the blocking part of a save
  eval           eval           evaluations
  eval_tasks     eval_tasks     lm-eval task scores (``train.eval_tasks``: ``eval_hook.py``)
  generate       generation     an RL objective's rollouts: sampling and scoring (``rollouts.py``)

``Goodput`` (written by process 0 only) keeps ``goodput.json`` in the workdir:
one record per run (its status, steps, seconds per category) and their
totals, plus the furthest step any run reached (``max_step``). A run that
restarts from checkpoint ``c`` after reaching step ``m`` trains steps
``c+1 … m`` again: those are ``steps_replayed``, their time ``replayed``.
goodput = productive / wall. The file is replaced atomically at every log
point and checkpoint and at the end; the running run's record is also
written in place to ``.goodput_run.json`` after every step (one small
write), so a run that is killed keeps its figures up to its last step, and
the next run folds them into ``goodput.json``. A run is recorded from the
end of its restore on (a run refused before that leaves the workdir as it
found it).

Not for: deciding anything about the run (this module only measures).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from distrib_train.train.hooks import Hooks, LoopView

CATEGORIES = (
  "productive",
  "compile",
  "checkpoint",
  "data_wait",
  "restore",
  "replayed",
  "eval",
  "eval_tasks",
  "generation",
  "layout_search",
  "other",
)
_CATEGORY_OF_PHASE = {
  "step": "productive",
  "compile": "compile",
  "checkpoint": "checkpoint",
  "data": "data_wait",
  "restore": "restore",
  "eval": "eval",
  "eval_tasks": "eval_tasks",
  "generate": "generation",
  "layout_search": "layout_search",
}  # else: "other"
FILE_NAME = "goodput.json"
RUN_FILE_NAME = ".goodput_run.json"


class Now(NamedTuple):
  """The phase a process is in, after which step, since when (the clock's seconds)."""

  phase: str
  step: int
  since: float


class PhaseClock:
  """The current phase and the seconds spent in each phase so far.

  One thread marks phases (the trainer's); others may read ``now`` (one
  tuple, replaced whole) and ``steps_done``. Entering a phase, the same one
  included, counts as progress for the watchdog.

  Args:
    clock: seconds, monotonic (a fake one in tests).
    layout_search: seconds ``mesh_config: auto``'s search took, before the clock was made.
  """

  def __init__(self, clock: Callable[[], float] = time.perf_counter, layout_search: float = 0.0):
    self.clock = clock
    self.now = Now("startup", 0, clock())
    self.steps_done = 0
    self._seconds: dict[str, float] = {"layout_search": layout_search} if layout_search else {}

  def enter(self, phase: str, step: int | None = None) -> None:
    """From now on the process is in ``phase`` (after ``step``: default, the same step as before)."""
    now, current = self.clock(), self.now
    self._seconds[current.phase] = self._seconds.get(current.phase, 0.0) + now - current.since
    self.now = Now(phase, current.step if step is None else step, now)

  @contextlib.contextmanager
  def phase(self, phase: str):
    """``phase`` while the block runs, then the phase before it."""
    outer = self.now.phase
    self.enter(phase)
    try:
      yield
    finally:
      self.enter(outer)

  def step_done(self, step: int) -> None:
    """``step`` is trained: progress."""
    self.steps_done += 1
    self.enter(self.now.phase, step)

  def seconds(self) -> dict[str, float]:
    """Seconds per phase, the current one up to now."""
    out = dict(self._seconds)
    out[self.now.phase] = out.get(self.now.phase, 0.0) + self.clock() - self.now.since
    return out


class Goodput:
  """The run's goodput record and the workdir's ``goodput.json``.

  Args:
    workdir: the run's workdir (it exists).
    phases: the process's phase clock.
    started: ``phases.clock()`` when the run started.
    log: where the summary line (and a warning about an unreadable file) goes.
    enabled: whether this process writes (default: process 0).
  """

  def __init__(
    self,
    workdir: str | os.PathLike,
    phases: PhaseClock,
    *,
    started: float,
    log: Callable[[str], None],
    enabled: bool | None = None,
  ):
    self.path = pathlib.Path(workdir) / FILE_NAME
    self._run_path = pathlib.Path(workdir) / RUN_FILE_NAME
    self.phases = phases
    self._started = started
    self._log = log
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.run: dict[str, Any] = {
      "id": uuid.uuid4().hex[:12],
      "started": datetime.datetime.now().isoformat(timespec="seconds"),
      "status": "running",
      "start_step": None,
      "last_step": None,
      "steps": 0,
      "steps_replayed": 0,
    }
    self._replayed = {"step": 0.0, "data": 0.0}  # seconds of the step and data phases spent on replayed steps
    self._counted = {"step": 0.0, "data": 0.0}  # step and data seconds already attributed to a step
    self._runs, self.max_step = self._read() if self.enabled else ([], 0)
    self._run_fd: int | None = None
    self._warned = False

  def _read(self) -> tuple[list[dict[str, Any]], int]:
    """The earlier runs (the last one's own record folded in) and the furthest step they reached."""
    runs, max_step = [], 0
    try:
      document = json.loads(self.path.read_text())
      runs, max_step = list(document["runs"]), int(document["max_step"])
    except FileNotFoundError:
      pass
    except (OSError, ValueError, KeyError, TypeError) as e:
      self._log(f"{self.path} cannot be read ({type(e).__name__}: {e}); goodput counts from this run on.")
    try:
      last = json.loads(self._run_path.read_text())
    except (OSError, ValueError):  # none, or cut by a crash of the machine
      return runs, max_step
    if last.get("status") == "running":
      last["status"] = "interrupted"  # killed, or died without a word
    ids = [run.get("id") for run in runs]
    if last.get("id") in ids:
      runs[ids.index(last.get("id"))] = last
    else:
      runs.append(last)
    return runs, max(max_step, int(last.get("max_step") or 0))

  def register(self, hooks: Hooks, *, every: int, checkpoint_every: int = 0) -> None:
    """Counts every step; writes ``goodput.json`` every ``every`` steps and at each checkpoint."""

    def write_file(loop: LoopView) -> None:
      self.on_step(loop)
      self.write()

    hooks.add_hook(
      write_file,
      when=lambda step: step % every == 0 or bool(checkpoint_every and step % checkpoint_every == 0),
      between=self.on_step,
    )

  def start(self, step: int) -> None:
    """The run restored (or initialised) ``step``: from here it is recorded."""
    self.run["start_step"] = self.run["last_step"] = step
    self.max_step = max(self.max_step, step)  # a workdir older than its goodput.json
    self.write()

  def on_step(self, loop: LoopView) -> None:
    """``loop.step`` is trained: a replayed step when an earlier run reached it already."""
    step = loop.step
    self.phases.step_done(step)
    seconds = self.phases.seconds()
    fresh = {phase: seconds.get(phase, 0.0) - self._counted[phase] for phase in self._counted}
    self._counted = {phase: seconds.get(phase, 0.0) for phase in self._counted}
    if step <= self.max_step:
      self.run["steps_replayed"] += 1
      self._replayed = {phase: self._replayed[phase] + fresh[phase] for phase in fresh}
    self.max_step = max(self.max_step, step)
    self.run["steps"] += 1
    self.run["last_step"] = step
    self._write_run()

  def record(self) -> dict[str, Any]:
    """This run's record: status, steps, wall seconds, seconds per category, goodput."""
    wall = max(self.phases.clock() - self._started, 1e-9)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for phase, spent in self.phases.seconds().items():
      seconds[_CATEGORY_OF_PHASE.get(phase, "other")] += spent
    seconds["productive"] -= self._replayed["step"]
    seconds["data_wait"] -= self._replayed["data"]
    seconds["replayed"] = sum(self._replayed.values())
    seconds["other"] += wall - sum(seconds.values())  # before the clock was made
    return {
      **self.run,
      "max_step": self.max_step,
      "wall_s": round(wall, 3),
      "seconds": {k: round(v, 3) for k, v in seconds.items()},
      "goodput": round(seconds["productive"] / wall, 4),
    }

  def document(self) -> dict[str, Any]:
    """What ``goodput.json`` holds: the furthest step, the totals over every run, the runs."""
    runs = self._runs + [self.record()]
    wall = sum(run.get("wall_s", 0.0) for run in runs)
    seconds = {k: round(sum(run.get("seconds", {}).get(k, 0.0) for run in runs), 3) for k in CATEGORIES}
    totals = {
      "runs": len(runs),
      "steps": sum(run.get("steps", 0) for run in runs),
      "steps_replayed": sum(run.get("steps_replayed", 0) for run in runs),
      "wall_s": round(wall, 3),
      "seconds": seconds,
      "goodput": round(seconds["productive"] / wall, 4) if wall else 0.0,
    }
    return {"max_step": self.max_step, "totals": totals, "runs": runs}

  def write(self) -> None:
    """Replaces ``goodput.json`` (atomically), with this run's record as it stands."""
    if not self.enabled or self.run["start_step"] is None:
      return
    self._write_run()
    temporary = self.path.with_name(f".{FILE_NAME}.tmp")
    try:
      temporary.write_text(json.dumps(self.document(), indent=1) + "\n")
      os.replace(temporary, self.path)
    except OSError as e:
      self._warn(e)

  def _write_run(self) -> None:
    """This run's record, in place: one write per step, whole or not at all even if the process is killed."""
    if not self.enabled or self.run["start_step"] is None:
      return
    text = json.dumps(self.record()).encode()
    try:
      if self._run_fd is None:
        self._run_fd = os.open(self._run_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
      size = os.fstat(self._run_fd).st_size
      os.pwrite(self._run_fd, text.ljust(max(size, len(text) + 256)), 0)  # spaces after the JSON: still JSON
    except OSError as e:
      self._warn(e)

  def _warn(self, error: OSError) -> None:
    if not self._warned:
      self._warned = True
      self._log(
        f"Goodput figures cannot be written to {self.path.parent} ({error.strerror or error}); the run"
        " goes on without them."
      )

  def finish(self, status: str) -> None:
    """The run ended (``finished``, ``preempted``, ``halted``, ``failed``): final records and the summary line."""
    if self.run["status"] != "running" or self.run["start_step"] is None:
      return
    self.run["status"] = status
    self.write()
    if self.enabled:
      self._log(summary(self.record(), self.document()["totals"]) + f" Written to {self.path}.")
    if self._run_fd is not None:
      os.close(self._run_fd)
      self._run_fd = None


def summary(run: dict[str, Any], totals: dict[str, Any]) -> str:
  """One line: this run's goodput and where the rest of its time went, then the workdir's."""
  seconds = run["seconds"]
  parts = ", ".join(
    f"{name.replace('_', ' ')} {seconds[name]:.1f} s"
    for name in CATEGORIES[1:]
    if name != "layout_search" or seconds[name]
  )  # mesh_config: auto's search, when it ran
  return (
    f"Goodput {run['goodput']:.1%} of {run['wall_s']:.1f} s ({seconds['productive']:.1f} s productive; {parts};"
    f" {run['steps_replayed']} of {run['steps']} steps replayed); over the workdir's {totals['runs']} run(s)"
    f" {totals['goodput']:.1%} of {totals['wall_s']:.1f} s, {totals['steps_replayed']} steps replayed."
  )
