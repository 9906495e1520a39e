"""Storage faults while checkpointing: one error that names the step, and quiet.

A save fails for want of storage — a full disk, a read-only or unwritable
directory — rather than for a bug: ``CheckpointManager`` then raises one
``CheckpointWriteError`` (built by ``write_error``) that names the step, the
directory and the cause, and says which earlier step is intact; the reads
and writes in flight beside a failed one are finished and their outcomes
retrieved, so that nothing echoes after the error
(``finish_event_loops_before_closing``); a save still pending at interpreter
exit is waited for (``finish_at_exit``). Not for: damaged or foreign checkpoints
on read (``checks.py``).
"""

from __future__ import annotations

import asyncio
import re
import sys
import weakref
from collections.abc import Iterable
from typing import Any

from distrib_train.checkpoint.checks import first_line


class CheckpointWriteError(OSError):
  """A checkpoint could not be written: a full disk, a read-only or
  unwritable directory. The message names the step, the directory and the
  cause; the steps committed before it are untouched (a partial step is
  never committed)."""


# The causes that make a save fail for want of storage rather than a bug, as
# OSError gives them or as tensorstore quotes them in its messages.
_STORAGE_CAUSES = re.compile(
  r"No space left on device|Disk quota exceeded|Read-only file system|Permission denied|Operation not permitted"
  r"|File too large|Input/output error|OS error",
  re.IGNORECASE,
)


def is_storage_failure(error: BaseException) -> bool:
  """Whether ``error``, or any error in its chain of causes, is one of storage."""
  while error is not None:
    if isinstance(error, OSError) or _STORAGE_CAUSES.search(str(error)):
      return True
    error = error.__cause__ or error.__context__
  return False


def write_error(
  step: int | None, directory: str, committed_steps: Iterable[int], error: BaseException
) -> CheckpointWriteError:
  """The one-line error for a step that could not be written, and what is left intact."""
  earlier = [s for s in committed_steps if s != step]
  kept = (
    f"step {max(earlier)} there is intact and a relaunch resumes from it"
    if earlier
    else "no earlier checkpoint is there"
  )
  return CheckpointWriteError(
    f"Checkpoint step {step} could not be written to {directory!r}: {first_line(error)} — {kept}."
  )


# How long a closing loop waits for the reads and writes still in flight on it (local files answer in
# milliseconds; a stalled network mount is cancelled after this).
_FINISH_SECONDS = 30.0


class _FinishingEventLoop(asyncio.SelectorEventLoop):
  """An event loop that finishes the tasks it holds before it closes.

  orbax runs each read or write in a loop of its own (``asyncio_utils.run_sync``) and closes it the moment its
  coroutine returns or raises. When one array's read or write fails, that coroutine raises at once, while the
  other arrays gathered with it are still in flight in tensorstore or hold their own failures. Closed then, the
  loop leaves them behind: tensorstore later tries to wake the closed loop ("RuntimeError: Event loop is
  closed"), and each failure nobody retrieved is printed whenever the garbage collector reaches it ("Future
  exception was never retrieved", "Task was destroyed but it is pending"). Here ``close`` first runs every
  pending task to its end and retrieves each outcome (``return_exceptions``), so the one error raised is the
  only thing a failed read or write leaves.

  tensorstore hands each operation's outcome to a plain future made with ``create_future``, which a task then
  awaits. A future whose awaiting task is gone by the time tensorstore settles it holds an error nobody reads, and
  no task list names it; ``close`` therefore also reads the outcome of every future made here that has settled.
  """

  def __init__(self, *args: Any, **kwargs: Any) -> None:
    super().__init__(*args, **kwargs)
    self._futures: weakref.WeakSet[asyncio.Future] = weakref.WeakSet()

  def create_future(self) -> asyncio.Future:
    future = super().create_future()
    self._futures.add(future)
    return future

  def call_soon_threadsafe(self, callback, *args, context=None):
    # After close has run every task to its end, a wake-up can only come from a tensorstore operation whose awaiting
    # task orbax had already cancelled or dropped: nothing can retrieve its outcome, so it is dropped here rather
    # than raised in tensorstore's thread (which prints "RuntimeError: Event loop is closed").
    if self.is_closed():
      return None
    return super().call_soon_threadsafe(callback, *args, context=context)

  def close(self) -> None:
    # (Not from inside another loop running in this thread: that one cannot be paused to run this one.)
    if not self.is_closed() and not self.is_running() and asyncio._get_running_loop() is None:
      self.run_until_complete(self._finish())
      for future in list(self._futures):
        if future.done() and not future.cancelled():
          future.exception()  # read: its error was the one raised, or belongs to an abandoned operation
    super().close()

  async def _finish(self) -> None:
    pending = asyncio.all_tasks() - {asyncio.current_task()}
    if pending:
      everything = asyncio.gather(*pending, return_exceptions=True)
      try:
        await asyncio.wait_for(everything, _FINISH_SECONDS)
      except asyncio.TimeoutError:  # wait_for cancelled them: let that finish
        await asyncio.gather(*pending, return_exceptions=True)
    # The callbacks queued behind them, and those they queue: a gather's, which retrieve its children's failures
    # (a task finished with its error while the loop stopped has only those to retrieve it).
    for _ in range(100):
      if not self._ready:
        break
      await asyncio.sleep(0)


class _FinishingLoopPolicy(asyncio.DefaultEventLoopPolicy):
  _loop_factory = _FinishingEventLoop


def finish_event_loops_before_closing() -> None:
  """Every asyncio loop made from now on (orbax makes one per read or write) finishes its tasks before closing.

  Installed where checkpoints are first read or written (the trainer's start-up checks, ``CheckpointManager``).
  It is installed only while asyncio's default policy is in use, as it is unless a program chose another (uvloop,
  say), which is then left as it is.
  """
  if type(asyncio.get_event_loop_policy()) is asyncio.DefaultEventLoopPolicy:
    asyncio.set_event_loop_policy(_FinishingLoopPolicy())


def finish_at_exit(manager: Any) -> None:
  """At interpreter exit, a ``CheckpointManager``'s pending async save is waited for, not lost, and the
  removal of old steps under way finishes (the interpreter would tear its thread down mid-file)."""
  if not manager._closed:
    try:
      manager.wait_until_finished()
    except CheckpointWriteError as e:  # nobody is left to catch it: say it in one line
      print(f"distrib_train: {e}", file=sys.stderr, flush=True)
  manager._deleted.join(timeout=60)  # a removal stuck on a dead file system is left to the next start
