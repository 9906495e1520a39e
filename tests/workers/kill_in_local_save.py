"""Worker: the ``distrib-train`` command line; process ``DT_KILL_PROCESS`` SIGKILLs itself inside its local-tier
save of step ``DT_KILL_IN_LOCAL_SAVE``, after writing two shard files and before the commit.

Only this module's view of numpy is replaced (``checkpoint.local.np``), so nothing else in the process changes.
"""

import os
import signal

import jax

from distrib_train import cli
from distrib_train.checkpoint import local

STEP, PROCESS = int(os.environ["DT_KILL_IN_LOCAL_SAVE"]), int(os.environ["DT_KILL_PROCESS"])
_save = local.LocalCheckpoints.save
_numpy = local.np


class _DyingNumpy:
  """numpy, but the third ``save`` kills the process."""

  def __init__(self):
    self.saved = 0

  def __getattr__(self, name):
    return getattr(_numpy, name)

  def save(self, *args, **kwargs):
    self.saved += 1
    if self.saved > 2:
      os.kill(os.getpid(), signal.SIGKILL)
    return _numpy.save(*args, **kwargs)


def _save_then_die(self, step, state, data_iterator=None):
  if step == STEP and jax.process_index() == PROCESS:
    local.np = _DyingNumpy()
  return _save(self, step, state, data_iterator)


local.LocalCheckpoints.save = _save_then_die
cli.run()
