"""Worker: the ``distrib-train`` command line, stopped inside the local-tier save of step ``DT_KILL_IN_LOCAL_SAVE``
for the test to SIGKILL.

Process ``DT_KILL_PROCESS`` stops inside its save, after writing two shard files and before the commit; every
other process stops right after its own save of that step has committed. Each, at that point, creates
``DT_KILL_MARKERS/<process index>`` and then waits there for ever: nothing is in flight between the processes,
so none of them can notice another's death and exit on its own. The test SIGKILLs them all once every marker is
there (``test_local_checkpoints._launch``), so the kill lands at the same point of every process whatever the
machine's speed.

Only this module's view of numpy is replaced (``checkpoint.local.np``), so nothing else in the process changes.
"""

import itertools
import os
import pathlib
import threading

import jax

from distrib_train import cli
from distrib_train.checkpoint import local

STEP, PROCESS = int(os.environ["DT_KILL_IN_LOCAL_SAVE"]), int(os.environ["DT_KILL_PROCESS"])
MARKERS = pathlib.Path(os.environ["DT_KILL_MARKERS"])
_save = local.LocalCheckpoints.save
_numpy = local.np


def _stop_here() -> None:
  """Tells the test this process is at its kill point, then waits there for the SIGKILL."""
  (MARKERS / str(jax.process_index())).touch()
  threading.Event().wait()


class _StoppingNumpy:
  """numpy, but the third ``save`` (and any after it: the writes run on a thread pool) stops the process once
  the first two have been written."""

  def __init__(self):
    self.calls = itertools.count(1)  # next() is atomic: the writer threads count without a lock
    self.written = 0
    self.done = threading.Condition()

  def __getattr__(self, name):
    return getattr(_numpy, name)

  def save(self, *args, **kwargs):
    if next(self.calls) > 2:
      with self.done:
        self.done.wait_for(lambda: self.written == 2)
      _stop_here()
    _numpy.save(*args, **kwargs)
    with self.done:
      self.written += 1
      self.done.notify_all()


def _save_then_stop(self, step, state, data_iterator=None):
  if step != STEP:
    return _save(self, step, state, data_iterator)
  if jax.process_index() == PROCESS:
    local.np = _StoppingNumpy()
  _save(self, step, state, data_iterator)
  _stop_here()  # the other processes: the step is committed


local.LocalCheckpoints.save = _save_then_stop
cli.run()
