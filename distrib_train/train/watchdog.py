"""The hang watchdog: a job whose steps stop progressing ends, saying where and who.

With ``train.hang_timeout_s`` > 0 every process runs a ``Watchdog`` thread
that reads the process's ``PhaseClock`` (``goodput.py``) once a second. When
the current phase has made no progress (no step done, no phase entered) for
longer than its limit, the process

1. writes every thread's Python stack (``faulthandler``) and its phase to
   stderr and to ``workdir/watchdog/stacks_<process>.txt``;
2. prints one line, the last of its log::

     distrib-train: error: Hang: no progress for 21 s in phase 'step' after step 6
     (train.hang_timeout_s=20); process 1 is silent (last heartbeat 21 s ago, phase 'step' after step 6).

   (one line in the log; wrapped here);
3. exits with status 4 (``EXIT_HUNG``) at once (``os._exit``: a normal exit
   could wait forever in a collective or barrier).

A run that fails in a phase already past its limit (a collective whose peer
has died raises) ends the same way: the trainer closes the watchdog with
``failed=True``.

Limits per phase: ``data`` and ``step``: ``train.hang_timeout_s``;
``compile``, ``eval`` and a run's first step: ``train.hang_compile_timeout_s``;
``startup``, ``init``, ``restore`` and ``checkpoint``:
``train.hang_checkpoint_timeout_s`` (both default to 10 × hang_timeout_s, at
least 600 s).

Who is silent: each process's watchdog thread also writes a heartbeat
(``workdir/watchdog/heartbeat_<process>.json``: time, phase, step) every
tick, so a process that cannot run (stopped, frozen, dead) is the one whose
heartbeat is stale; failing that, a process behind the others in steps is
named. A process that was itself stopped for longer than its limit reports
the hang as soon as it runs again, naming itself (its own ticks stopped);
if it first completes the step its peers had already sent their part of,
it hangs in the next one, and its line says it was silent just before,
then names the peers that have exited meanwhile — unless JAX's
coordination client ends it first: a process other than 0 that runs again
after process 0 (which hosts the coordination service) has exited may be
aborted by it within a fraction of a second. One that never runs
again is ended by the launcher when the others exit (SLURM ends a job step
when a task fails) or by JAX's coordination service after
``--heartbeat_timeout`` — keep that longer than these limits.

Not for: what a process does between steps (``loop.py``), how long phases
take overall (``goodput.py``).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import pathlib
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax

from distrib_train.common.exit_hooks import close_at_exit
from distrib_train.train.goodput import PhaseClock

EXIT_HUNG = 4  # the process exit code of a run ended by the watchdog
_CHECKPOINT_PHASES = ("startup", "init", "restore", "checkpoint")


@dataclasses.dataclass(frozen=True)
class Limits:
  """Seconds without progress before the watchdog fires, per kind of phase (``step_s`` 0: off)."""

  step_s: float = 0.0
  compile_s: float = 0.0
  checkpoint_s: float = 0.0

  @classmethod
  def from_config(cls, train: Any) -> Limits:
    """From the ``train`` section; a compile or checkpoint limit of 0 is 10 × ``hang_timeout_s``, at least 600 s."""
    step = train.hang_timeout_s
    default = max(10 * step, 600.0)
    return cls(step, train.hang_compile_timeout_s or default, train.hang_checkpoint_timeout_s or default)

  def of(self, phase: str, first_step: bool) -> tuple[float, str]:
    """The limit of ``phase`` and the config key that sets it."""
    if phase in _CHECKPOINT_PHASES:
      return self.checkpoint_s, "train.hang_checkpoint_timeout_s"
    if phase in ("compile", "eval") or first_step:
      return self.compile_s, "train.hang_compile_timeout_s"
    return self.step_s, "train.hang_timeout_s"


class Watchdog:
  """One process's watchdog thread (nothing runs unless ``limits.step_s`` > 0).

  Args:
    limits: the limits per phase.
    phases: the process's phase clock.
    workdir: the run's workdir (every process sees it): heartbeats and stacks.
    process_index, process_count: this process and the job's size (default: JAX's).
    stream: where the stacks and the line go (default ``sys.stderr``).
    exit_process: ends the process with a status (a fake one in tests).
  """

  def __init__(
    self,
    limits: Limits,
    phases: PhaseClock,
    workdir: str | os.PathLike,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    stream: TextIO | None = None,
    exit_process: Callable[[int], Any] = os._exit,
  ):
    self.limits = limits
    self.phases = phases
    self.directory = pathlib.Path(workdir) / "watchdog"
    self.process = jax.process_index() if process_index is None else process_index
    self.process_count = jax.process_count() if process_count is None else process_count
    self._stream = stream
    self._exit = exit_process
    self.interval_s = max(0.05, min(1.0, limits.step_s / 20))
    self.stale_s = max(3 * self.interval_s, min(10.0, limits.step_s / 2))  # a heartbeat older than this: silent
    self._last_tick = phases.clock()
    self._silent = (0.0, float("-inf"))  # this process's own longest gap between ticks, and when it ended
    self._stop = threading.Event()
    self._fire_lock = threading.Lock()
    self._thread: threading.Thread | None = None

  def start(self) -> Watchdog:
    if self.limits.step_s > 0:
      try:
        self.directory.mkdir(parents=True, exist_ok=True)
      except OSError:
        pass  # it still fires; it cannot name a silent process
      self._beat()
      self._thread = threading.Thread(target=self._run, name="distrib_train-watchdog", daemon=True)
      self._thread.start()
      # One not closed stops at exit, before the interpreter tears its thread down mid-tick.
      self._at_exit = close_at_exit(_stop_thread, self._stop, self._thread)
    return self

  def _run(self) -> None:
    while not self._stop.wait(self.interval_s):
      self.tick()

  def tick(self) -> None:
    """Notes a gap in this process's own ticks, writes the heartbeat, fires when the phase is overdue."""
    if self._stop.is_set():
      return
    now = self.phases.clock()
    if now - self._last_tick > self.stale_s:
      self._silent = (now - self._last_tick, now)
    self._last_tick = now
    self._beat()
    line = self.overdue(now)  # the same instant: a stop after it reads as a gap at the next tick, not as idle time
    if line is not None:
      self.fire(line)

  def close(self, failed: bool = False) -> None:
    """Stops the thread; a run failing in an overdue phase (a peer died in it) ends as a hang."""
    if self._thread is None:
      return
    if failed:
      now = self.phases.clock()
      if now - self._last_tick > self.stale_s:
        self._silent = (now - self._last_tick, now)
      line = self.overdue()
      if line is not None:
        self.fire(line)
    self._at_exit()
    self._thread = None
    self._beat(exited="done")

  def overdue(self, at: float | None = None) -> str | None:
    """The hang's line when the current phase has gone without progress past its limit at ``at`` (default: now)."""
    now = self.phases.now
    idle = (self.phases.clock() if at is None else at) - now.since
    limit, key = self.limits.of(now.phase, first_step=self.phases.steps_done == 0)
    if idle <= limit:
      return None
    return (
      f"Hang: no progress for {idle:.0f} s in phase {now.phase!r} after step {now.step} ({key}={limit:g});"
      f" {self._who_is_silent(now.since, limit)}."
    )

  def _who_is_silent(self, since: float, limit: float) -> str:
    gap, ended = self._silent
    if ended >= since:  # this process did not run while the phase went without progress
      return f"process {self.process} (this process) is silent: it did not run for {gap:.0f} s (stopped or starved)"
    others = self._others_silent()
    if ended >= since - limit:  # it ran again, made a last step, then waited on peers that gave up on it meanwhile
      return (
        f"process {self.process} (this process) was silent just before: it did not run for {gap:.0f} s"
        f" (stopped or starved); {others}"
      )
    return others

  def _others_silent(self) -> str:
    beats = self._heartbeats()
    now = time.time()
    silent, behind, gone = [], [], []
    top = max([self.phases.now.step] + [beat.get("step", 0) for beat in beats.values()])
    for process in range(self.process_count):
      beat = beats.get(process)
      if process == self.process:
        continue
      if beat is None:
        silent.append(f"process {process} is silent (no heartbeat)")
      elif beat.get("exited"):
        gone.append(f"process {process} has exited ({beat['exited']})")
      elif now - beat.get("time", 0) > self.stale_s:
        silent.append(
          f"process {process} is silent (last heartbeat {now - beat.get('time', 0):.0f} s ago,"
          f" phase {beat.get('phase')!r} after step {beat.get('step')})"
        )
      elif beat.get("step", 0) < top:
        behind.append(f"process {process} is behind (phase {beat.get('phase')!r} after step {beat.get('step')})")
    if self.process_count == 1:
      return "the job's only process is stuck here (stacks above)"
    return "; ".join(silent or behind or gone) or "no process is silent: every heartbeat is fresh (stacks above)"

  def _heartbeats(self) -> dict[int, dict[str, Any]]:
    out = {}
    for process in range(self.process_count):
      try:
        out[process] = json.loads((self.directory / f"heartbeat_{process}.json").read_text())
      except (OSError, ValueError):
        pass
    return out

  def _beat(self, exited: str | None = None) -> None:
    now = self.phases.now
    beat = {
      "process": self.process,
      "pid": os.getpid(),
      "host": socket.gethostname(),
      "time": time.time(),
      "phase": now.phase,
      "step": now.step,
      **({"exited": exited} if exited else {}),
    }
    path = self.directory / f"heartbeat_{self.process}.json"
    try:
      path.with_suffix(".tmp").write_text(json.dumps(beat))
      os.replace(path.with_suffix(".tmp"), path)
    except OSError:
      pass

  def fire(self, line: str) -> None:
    """Stacks and phase to the log and the workdir, the line, then the exit (once, whichever thread comes first)."""
    if not self._fire_lock.acquire(blocking=False):
      return
    with tempfile.TemporaryFile("w+") as scratch:  # faulthandler writes to a file descriptor only
      faulthandler.dump_traceback(scratch, all_threads=True)
      scratch.seek(0)
      stacks = scratch.read()
    now = self.phases.now
    report = (
      f"Watchdog, process {self.process} of {self.process_count}: phase {now.phase!r} after step {now.step},"
      f" no progress for {self.phases.clock() - now.since:.0f} s. Python stacks:\n{stacks}"
    )
    try:
      (self.directory / f"stacks_{self.process}.txt").write_text(report + line + "\n")
    except OSError:
      pass
    self._beat(exited="hang")
    stream = self._stream or sys.stderr
    stream.write(report)
    stream.write(f"distrib-train: error: {line}\n")
    stream.flush()
    self._stop.set()
    self._exit(EXIT_HUNG)


def _stop_thread(stop: threading.Event, thread: threading.Thread) -> None:
  stop.set()
  thread.join(timeout=5)
