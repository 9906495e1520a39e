"""Stopping a run on SIGTERM / SIGINT: at the same iteration in every process between steps, at once elsewhere.

``Preemption`` is the job's flag (JAX's preemption service across processes;
its own signal handlers in a single process); ``Terminated`` is what a signal
outside the step loop raises. ``distributed`` re-exports both.

Not for: starting JAX (``distributed.py``), the loop's save-and-stop (``train/loop.py``).
"""

from __future__ import annotations

import signal
import sys
import threading

import jax

# A signal whose Terminated Python dropped (a garbage-collector or weakref callback, a ``__del__``) is delivered
# again this much later: Python drops an exception raised there, and the run would go on.
REDELIVER_S = 0.05


class Terminated(BaseException):
  """SIGTERM or SIGINT outside the step loop (start-up, compile, restore, the
  final save): the run stops at once, keeping the committed checkpoints.

  A BaseException, like KeyboardInterrupt: code that turns any Exception into
  its own error (orbax, tensorstore, the checkpoint checks) must not swallow
  it."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum
    self.name = signal.Signals(signum).name


class Preemption:
  """Whether to stop at this iteration, agreed by every process (SIGTERM).

  A multi-process job uses JAX's preemption service: a SIGTERM to any
  process (or a TPU maintenance notice) makes all processes reach the sync
  point at the same iteration. A single process catches SIGTERM and SIGINT
  itself: between ``enter_steps()`` and ``leave_steps()`` the first one sets
  the flag the loop reads between steps (it then saves and stops); outside
  them, or a second time, the handler raises ``Terminated`` so that a run
  stuck in start-up, compiling, reading data or saving still ends promptly.
  Where Python would drop that exception (the signal landed in a
  garbage-collector callback, which jax registers, a ``__del__`` or a
  weakref callback: Python hands it to ``sys.unraisablehook``) it is not
  printed and the signal is delivered again ``REDELIVER_S`` later; and one
  that code still swallowed (an ``except BaseException``) is raised again
  when the steps are entered or polled.
  """

  _SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    from jax._src import distributed

    self._sync = jax.process_count() > 1 and distributed.global_state.preemption_sync_manager is not None
    self._flag = False
    self._in_steps = False
    self._raised: int | None = None  # the signal a Terminated was raised for
    self._previous = {}
    self._previous_hook = None
    if jax.process_count() == 1:
      for signum in self._SIGNALS:
        self._previous[signum] = signal.signal(signum, self._on_signal)
      self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._on_unraisable

  def _on_signal(self, signum, frame):
    if self._in_steps and not self._flag:
      self._flag = True
      return
    self._raised = signum
    raise Terminated(signum)

  def _on_unraisable(self, unraisable) -> None:
    if isinstance(unraisable.exc_value, Terminated):  # raised where Python drops it: not printed, sent again
      _deliver_again(unraisable.exc_value.signum)
    else:
      self._previous_hook(unraisable)

  def _raise_swallowed(self) -> None:
    if self._raised is not None:
      raise Terminated(self._raised)

  def enter_steps(self) -> None:
    """From here a first signal asks the loop to save and stop (a ``Terminated`` swallowed before: raised)."""
    self._raise_swallowed()
    self._in_steps = True

  def leave_steps(self) -> None:
    """From here a signal stops the run at once."""
    self._in_steps = False

  def reached(self, iteration: int) -> bool:
    self._raise_swallowed()
    if self._sync:
      from jax.experimental import multihost_utils

      return multihost_utils.reached_preemption_sync_point(iteration)
    return self._flag

  def close(self) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    self._previous = {}
    if self._previous_hook is not None and sys.unraisablehook == self._on_unraisable:  # else another wraps it
      sys.unraisablehook = self._previous_hook


def _deliver_again(signum: int) -> None:
  """``signum`` again ``REDELIVER_S`` from now, to the main thread, so that a call it waits in is interrupted too."""
  threading.Timer(REDELIVER_S, signal.pthread_kill, (threading.main_thread().ident, signum)).start()
