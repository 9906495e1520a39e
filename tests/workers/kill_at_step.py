"""Worker: the ``distrib-train`` command line, SIGKILLed right after step ``DT_KILL_AT_STEP``.

The kill is a hook added after the trainer's own, so every hook of that step
(the goodput record included) has run: the furthest step reached is known
exactly, whatever the machine's speed. In a job of several processes they
all meet at a barrier first, then each creates ``DT_KILL_MARKERS/<process
index>`` and waits there for ever, and the test SIGKILLs them all once every
marker is there (``test_local_checkpoints._launch``): a process that killed
itself would be noticed by the others (the coordinator's socket closes, a
collective fails), which then exit 1 at a moment that depends on the
machine's load, maybe before their own kill. A single process kills itself.
"""

import os
import pathlib
import signal
import threading

import jax
from jax.experimental import multihost_utils

from distrib_train import cli
from distrib_train.train import trainer

KILL_AT_STEP = int(os.environ["DT_KILL_AT_STEP"])
_add_hooks = trainer.Trainer._add_hooks


def _kill(loop):
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"kill_at_step_{KILL_AT_STEP}")
    (pathlib.Path(os.environ["DT_KILL_MARKERS"]) / str(jax.process_index())).touch()
    threading.Event().wait()
  os.kill(os.getpid(), signal.SIGKILL)


def _add_hooks_then_the_kill(self, loop, plan, eval_step):
  _add_hooks(self, loop, plan, eval_step)
  loop.hooks.add_hook(_kill, when=lambda step: step == KILL_AT_STEP)


trainer.Trainer._add_hooks = _add_hooks_then_the_kill
cli.run()
