"""Helpers that must stop before the interpreter does: an owner's close, run once, at exit at the latest.

At exit Python joins its non-daemon threads, then runs ``atexit`` hooks, then
tears down every daemon thread still running the next time that thread
takes the interpreter lock (``pthread_exit``). A thread torn down while
native code is on its stack (a tokenizer's batch encode, pyarrow's reader,
grain's prefetch into either) is unwound through C++ or Rust frames, and
the process aborts after its last line of output: ``FATAL: exception not
rethrown`` or ``terminate called without an active exception``, exit code
134. A job that trained and checkpointed is then recorded as failed.

``close_at_exit(owner, close, *args)`` runs ``close(*args)`` exactly once:
when the owner's own ``close`` calls the returned handle, when ``owner`` is
garbage collected, or at interpreter exit, from threading's exit hooks,
newest first. Those run before Python joins non-daemon threads and before
``concurrent.futures`` shuts its pools down (a plain ``atexit`` hook runs
after both), so a close may still wait for a thread to finish what it is
doing and join it. ``close`` and ``args`` must not refer to ``owner``, or
it is never collected.

Not for: what a checkpoint's pending write needs at exit
(``checkpoint/faults.finish_at_exit``, registered the same way).
"""

from __future__ import annotations

import atexit
import itertools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

_pending: dict[int, weakref.finalize] = {}  # registration number → its handle, until it has run
_numbers = itertools.count()
_lock = threading.Lock()
_registered = False


def register_early(hook: Callable[..., Any], *args: Any) -> None:
  """``hook(*args)`` at interpreter exit, before non-daemon threads are joined and ``concurrent.futures``'
  pools shut down (threading's exit hooks; later registrations run first); ``atexit`` where Python has none."""
  getattr(threading, "_register_atexit", atexit.register)(hook, *args)


def close_at_exit(owner: Any, close: Callable[..., Any], *args: Any) -> weakref.finalize:
  """Runs ``close(*args)`` once: when the handle is called, when ``owner`` is collected, or at exit.

  Args:
    owner: the object whose helpers ``close`` stops (held weakly).
    close: stops them; it must not refer to ``owner``.
    *args: its arguments; they must not refer to ``owner`` either.

  Returns:
    The handle: call it to close now (later calls do nothing); ``handle.alive`` says whether it has run.
  """
  global _registered
  number = next(_numbers)

  def run() -> None:
    with _lock:
      _pending.pop(number, None)
    close(*args)

  handle = weakref.finalize(owner, run)
  handle.atexit = False  # run from close_all, earlier than weakref's own atexit hook
  with _lock:
    _pending[number] = handle
    if not _registered:
      register_early(close_all)
      _registered = True
  return handle


def close_all() -> None:
  """Runs every pending close, newest first; one that fails is reported in one line and the rest still run."""
  with _lock:
    handles = [_pending[number] for number in sorted(_pending, reverse=True)]
  for handle in handles:
    try:
      handle()
    except Exception as e:  # noqa: BLE001 - at exit nobody is left to catch it
      print(f"distrib_train: closing at exit failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
