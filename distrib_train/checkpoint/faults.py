"""Storage faults while checkpointing: one error that names the step, and quiet.

A save fails for want of storage — a full disk, a read-only or unwritable
directory — rather than for a bug: ``CheckpointManager`` then raises one
``CheckpointWriteError`` (built by ``write_error``) that names the step, the
directory and the cause, and says which earlier step is intact; the writes
orbax abandons with it are kept off the console
(``quiet_echoes_of_failed_writes``); a save still pending at interpreter exit
is waited for (``finish_at_exit``). Not for: damaged or foreign checkpoints
on read (``checks.py``).
"""

from __future__ import annotations

import logging
import re
import sys
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
    r"|File too large|Input/output error|OS error", re.IGNORECASE)


def is_storage_failure(error: BaseException) -> bool:
  """Whether ``error``, or any error in its chain of causes, is one of storage."""
  while error is not None:
    if isinstance(error, OSError) or _STORAGE_CAUSES.search(str(error)):
      return True
    error = error.__cause__ or error.__context__
  return False


def write_error(step: int | None, directory: str, committed_steps: Iterable[int],
                error: BaseException) -> CheckpointWriteError:
  """The one-line error for a step that could not be written, and what is left intact."""
  earlier = [s for s in committed_steps if s != step]
  kept = f"step {max(earlier)} there is intact and a relaunch resumes from it" if earlier else \
      "no earlier checkpoint is there"
  return CheckpointWriteError(
      f"Checkpoint step {step} could not be written to {directory!r}: {first_line(error)} — {kept}."
  )


_echoes_quiet = False


def quiet_echoes_of_failed_writes() -> None:
  """Silences what a failed background write leaves behind (installed once).

  When one array's write fails, orbax closes its event loop while tensorstore
  is still finishing the other writes in flight; each then tries to wake the
  closed loop and prints a "RuntimeError: Event loop is closed" traceback
  (through ``sys.unraisablehook``), and asyncio logs the abandoned tasks. The
  failure itself is raised as one CheckpointWriteError. Reads of a damaged
  checkpoint echo the same way (each array's failed read is logged as "Task
  exception was never retrieved", or a coroutine collected with its error
  unretrieved): the trainer installs this before its first check of the
  checkpoint.
  """
  global _echoes_quiet
  if _echoes_quiet:
    return
  _echoes_quiet = True
  previous = sys.unraisablehook

  def hook(unraisable):
    loop_closed = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
    # A failed read's coroutine, garbage-collected with its error unretrieved
    # ("Exception ignored in: <coroutine object _read_array_index_and_device_put>"):
    # the same failure, already raised once as a CheckpointError.
    code = getattr(unraisable.object, "cr_code", None)
    orbax_coroutine = code is not None and any(name in code.co_filename for name in ("orbax", "tensorstore"))
    if not (loop_closed or orbax_coroutine):
      previous(unraisable)

  def abandoned_write(record: logging.LogRecord) -> bool:
    text = str(record.msg)
    echo = "Task was destroyed but it is pending" in text or "Task exception was never retrieved" in text
    return echo and ("orbax" in text or "tensorstore" in text)

  sys.unraisablehook = hook
  logging.getLogger("asyncio").addFilter(lambda record: not abandoned_write(record))


def finish_at_exit(manager: Any) -> None:
  """At interpreter exit, a ``CheckpointManager``'s pending async save is waited for, not lost, and the
  removal of old steps under way finishes (the interpreter would tear its thread down mid-file)."""
  if not manager._closed:
    try:
      manager.wait_until_finished()
    except CheckpointWriteError as e:  # nobody is left to catch it: say it in one line
      print(f"distrib_train: {e}", file=sys.stderr, flush=True)
  manager._deleted.join(timeout=60)  # a removal stuck on a dead file system is left to the next start
