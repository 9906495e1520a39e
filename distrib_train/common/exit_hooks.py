"""Helpers that must stop before the interpreter does: an owner's close, run once, at exit at the latest.

At exit Python joins its non-daemon threads, then runs ``atexit`` hooks, then
tears down every daemon thread still running the next time that thread
takes the interpreter lock (``pthread_exit``). A thread torn down while
native code is on its stack (a tokenizer's batch encode, pyarrow's reader,
grain's prefetch into either) is unwound through C++ or Rust frames, and
the process aborts after its last line of output: ``FATAL: exception not
rethrown`` or ``terminate called without an active exception``, exit code
134. A job that trained and checkpointed is then recorded as failed.

``close_at_exit(close, *args)`` returns a ``Closer``: calling it runs
``close(*args)`` now, once (the owner's own ``close``); one never called runs
at interpreter exit, from threading's exit hooks, newest first. Those run
before Python joins non-daemon threads and before ``concurrent.futures``
shuts its pools down (a plain ``atexit`` hook runs after both), so a close
may still wait for a thread to finish what it is doing and join it. ``close``
and ``args`` must not refer to the owner, so that an owner nobody holds is
still collected: what it started is then closed at exit (never from a
garbage collection, which may run on one of the very threads a close joins).
A forked child runs none of its parent's closes.

Not for: what a checkpoint's pending write needs at exit
(``checkpoint/faults.finish_at_exit``, registered with ``register_early``).
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

_pending: dict[int, Closer] = {}  # registration number → its closer, until it has run
_numbers = itertools.count()
_lock = threading.RLock()  # re-entrant: a collection may run on a thread that holds it
_registered = False


def register_early(hook: Callable[..., Any], *args: Any) -> None:
  """``hook(*args)`` at interpreter exit, before non-daemon threads are joined and ``concurrent.futures``'
  pools shut down (threading's exit hooks; later registrations run first); ``atexit`` where Python has none.
  Only in the process that registered it: a forked child (a multiprocessing worker) runs none."""
  pid = os.getpid()

  def run() -> None:
    if os.getpid() == pid:
      hook(*args)

  getattr(threading, "_register_atexit", atexit.register)(run)


class Closer:
  """Runs ``close(*args)`` once: when called, or at interpreter exit (``close_all``)."""

  def __init__(self, number: int, close: Callable[..., Any], args: tuple[Any, ...]):
    self._number, self._close, self._args = number, close, args
    self._done = threading.Event()

  def __call__(self) -> None:
    with _lock:
      if self._done.is_set():
        return
      self._done.set()
      _pending.pop(self._number, None)
    close, args, self._close, self._args = self._close, self._args, None, ()
    close(*args)


def close_at_exit(close: Callable[..., Any], *args: Any) -> Closer:
  """A ``Closer`` of ``close(*args)``: call it to close now (later calls do nothing); one not called runs at
  interpreter exit. ``close`` and ``args`` must not refer to the owner they close for."""
  global _registered
  with _lock:
    closer = Closer(next(_numbers), close, args)
    _pending[closer._number] = closer
    if not _registered:
      register_early(close_all)
      os.register_at_fork(after_in_child=_forget)
      _registered = True
  return closer


def _forget() -> None:
  """In a forked child: its parent's helpers are not its to close."""
  _pending.clear()


def close_all() -> None:
  """Runs every pending close, newest first; one that fails is reported in one line and the rest still run.
  (A close waits for what its threads are doing: Python 3.12 starts no thread at shutdown to bound it.)"""
  with _lock:
    pending = _pending.copy()
  for number in sorted(pending, reverse=True):
    try:
      pending[number]()
    except Exception as e:  # noqa: BLE001 - at exit nobody is left to catch it
      print(f"distrib_train: closing at exit failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
