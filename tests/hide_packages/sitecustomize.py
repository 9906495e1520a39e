"""Hides the packages named in ``DT_TEST_HIDE`` (comma-separated) from this interpreter, as if not installed.

On ``PYTHONPATH`` for the subprocesses of ``tests/test_bad_inputs.py``'s missing-package cases: Python imports
``sitecustomize`` at start-up, before any of distrib_train."""

import importlib.abc
import os
import sys

_HIDDEN = {name for name in os.environ.get("DT_TEST_HIDE", "").split(",") if name}


class _Hidden(importlib.abc.MetaPathFinder):
  def find_spec(self, fullname, path=None, target=None):
    if fullname.split(".")[0] in _HIDDEN:
      raise ModuleNotFoundError(f"No module named {fullname!r} (hidden by DT_TEST_HIDE)", name=fullname)
    return None


if _HIDDEN:
  sys.meta_path.insert(0, _Hidden())
