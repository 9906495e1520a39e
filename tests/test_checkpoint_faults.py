"""What failed checkpoint reads and writes echo after the one error line, and what is kept quiet."""

import sys
import types

from distrib_train.checkpoint import faults


def _coroutine_from(filename):
  namespace = {}
  exec(compile("async def read():\n  return 1\n", filename, "exec"), namespace)
  return namespace["read"]()


def test_unretrieved_orbax_coroutines_and_closed_loops_are_quiet_other_errors_are_not(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  monkeypatch.setattr(faults, "_echoes_quiet", False)
  faults.quiet_echoes_of_failed_writes()
  hook = sys.unraisablehook
  orbax_read = _coroutine_from("/site-packages/orbax/checkpoint/_src/serialization/serialization.py")
  own = _coroutine_from("/home/user/my_code.py")
  try:
    echo = types.SimpleNamespace(exc_type=Exception, exc_value=Exception("Encountered error while reading array"),
                                 exc_traceback=None, err_msg=None, object=orbax_read)
    closed = types.SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError("Event loop is closed"),
                                   exc_traceback=None, err_msg=None, object=None)
    real = types.SimpleNamespace(exc_type=ValueError, exc_value=ValueError("mine"), exc_traceback=None,
                                 err_msg=None, object=own)
    for unraisable in (echo, closed, real):
      hook(unraisable)
  finally:
    orbax_read.close()
    own.close()
  assert seen == [real]
