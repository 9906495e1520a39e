"""Periodic work of the loop, registered with an interval.

The loop itself only steps; logging, checkpoints, evaluation, profiling and
the preemption check are hooks::

  hooks = Hooks(last_step=1000)
  hooks.add_hook(log_window, every=10)                  # and at the last step
  hooks.add_hook(save, every=100, between=check_save)   # ``between``: the other steps
  hooks.add_hook(check_preemption, before_step=True)    # every step, before it

A hook is called with the loop (``loop.TrainLoop``: its ``step``, ``state``,
``window``, ``result``, …); ``LoopView`` names the part of it this module and
``goodput.py`` rely on, so neither imports the loop. Hooks after a step run
in the order they were added, once the step's loss has been read and judged
— the loop waits for the devices only on steps where one is due. A hook
returns None, or a ``Verdict`` other than ``ok`` to end or roll back the run
(the preemption check does). A hook marked ``pauses_clock`` is not step
time: the metrics window's clock restarts after it.

New periodic work (goodput, a pipeline schedule's statistics) is a hook, not
a branch in the loop.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any, Protocol

import jax

from distrib_train.train.nonfinite import Verdict
from distrib_train.train.window import MetricsWindow


class LoopView(Protocol):
  """What hooks are handed: the loop they run in (``loop.TrainLoop`` is the one).

  Only what the hook machinery and the hooks written beside it read; a hook a
  trainer registers may read more of the loop it registered on (``ckpt``,
  ``loader``, ``guard``, ``phases``, ``result``). Declared here so that the
  loop depends on its hooks and never the other way round.

  Attributes:
    step: the last step trained.
    state: the train state after it.
    window: the metrics window (its clock restarts after a hook that
      ``pauses_clock``).
  """

  step: int
  state: Any
  window: MetricsWindow


HookFn = Callable[[LoopView], Verdict | None]


@dataclasses.dataclass(frozen=True, eq=False)
class Hook:
  """One piece of periodic work.

  Attributes:
    fn: ``fn(loop) -> Verdict | None``.
    due: ``due(step) -> bool``: whether it runs at ``step``.
    between: called (with the loop) at the steps it is not due, without
      waiting for the devices.
    before_step: runs before the step (``step`` is the last step done).
    pauses_clock: its time is not step time.
  """

  fn: HookFn
  due: Callable[[int], bool]
  between: Callable[[LoopView], None] | None = None
  before_step: bool = False
  pauses_clock: bool = False


class Hooks:
  """The hooks of one run, in the order they run.

  Args:
    last_step: the run's last step (``train.steps``); interval hooks run at
      it too unless added with ``at_last=False``.
  """

  def __init__(self, last_step: int):
    self.last_step = last_step
    self._hooks: list[Hook] = []
    self._at_finish: list[Callable[[LoopView], None]] = []

  def add_hook(
    self,
    fn: HookFn,
    every: int = 1,
    *,
    when: Callable[[int], bool] | None = None,
    at_last: bool = True,
    between: Callable[[LoopView], None] | None = None,
    before_step: bool = False,
    pauses_clock: bool = False,
  ) -> Hook:
    """Runs ``fn`` every ``every`` steps (0: only at the last step), or at the steps ``when(step)`` names.

    Raises:
      ValueError: a negative interval.
    """
    if every < 0:
      raise ValueError(f"A hook's interval (every) must be 0 or more, got {every}.")
    if when is None:
      last = self.last_step if at_last else None

      def when(step: int) -> bool:
        return step == last or bool(every and step % every == 0)

    hook = Hook(fn, when, between, before_step, pauses_clock)
    self._hooks.append(hook)
    return hook

  def add_finisher(self, fn: Callable[[LoopView], None]) -> None:
    """Runs ``fn(loop)`` once when the run has trained its last step."""
    self._at_finish.append(fn)

  def finish(self, loop: LoopView) -> None:
    for fn in self._at_finish:
      fn(loop)

  def due_before(self, next_step: int) -> list[Hook]:
    """The hooks to run before ``next_step`` is trained."""
    return [h for h in self._hooks if h.before_step and h.due(next_step)]

  def due_after(self, step: int) -> list[Hook]:
    """The hooks to run now that ``step`` is trained."""
    return [h for h in self._hooks if not h.before_step and h.due(step)]

  def run(self, loop: LoopView, due: list[Hook], *, before_step: bool = False) -> Verdict | None:
    """Runs the due hooks (and the others' ``between``) in order; the first
    verdict that is not ``ok`` ends the round and is returned."""
    for hook in self._hooks:
      if hook.before_step != before_step:
        continue
      if not any(hook is d for d in due):
        if hook.between is not None:
          hook.between(loop)
        continue
      verdict = hook.fn(loop)
      if verdict is not None and verdict.action != "ok":
        return verdict
      if hook.pauses_clock:
        loop.window.restart_clock()
    return None


class Profiler:
  """Traces steps ``first``–``last`` with the jax profiler, as two hooks.

  Args:
    steps: ``(first, last)``, both trained within the trace.
    directory: the run's ``profile/`` directory (a folder per process inside).
    log: where the "written to" line goes.
  """

  def __init__(self, steps: tuple[int, int], directory: pathlib.Path, log: Callable[[str], None]):
    self.first, self.last = steps
    self.directory = directory
    self._log = log
    self.tracing = False

  def register(self, hooks: Hooks) -> None:
    hooks.add_hook(self.start, when=lambda step: step == self.first and not self.tracing, before_step=True)
    hooks.add_hook(self.stop, when=lambda step: self.tracing and step == self.last)
    hooks.add_finisher(lambda loop: self.close())

  def start(self, loop: LoopView) -> None:
    jax.profiler.start_trace(str(self.directory / f"process_{jax.process_index()}"))
    self.tracing = True

  def stop(self, loop: LoopView) -> None:
    jax.profiler.stop_trace()
    self.tracing = False
    self._log(f"Profile of steps {self.first}–{loop.step} written to {self.directory}.")

  def close(self) -> None:
    """Stops a trace the run ended inside."""
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False
