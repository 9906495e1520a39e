"""The examples in docstrings run: doctest on each module whose examples are runnable."""

import doctest
import importlib

import pytest

# Modules whose docstring examples are written as ``>>>`` sessions; add one
# here when its examples become runnable.
MODULES = ["distrib_train.train_state"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0, f"{name} has no >>> example"
  assert result.failed == 0, f"{result.failed} of {name}'s docstring examples failed (the report is above)"
