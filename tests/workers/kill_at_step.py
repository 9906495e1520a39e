"""Worker: the ``distrib-train`` command line, SIGKILLed by itself right after step ``DT_KILL_AT_STEP``.

The kill is a hook added after the trainer's own, so every hook of that step
(the goodput record included) has run: the furthest step reached is known
exactly, whatever the machine's speed. In a job of several processes they
all meet at a barrier first: a process killed while another was still in
that step's hooks would be noticed by it (the coordinator's socket closes,
a collective fails), and it would exit 1, maybe before its own save.
"""

import os
import signal

import jax
from jax.experimental import multihost_utils

from distrib_train import cli
from distrib_train.training import trainer

KILL_AT_STEP = int(os.environ["DT_KILL_AT_STEP"])
_add_hooks = trainer.Trainer._add_hooks


def _kill(loop):
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"kill_at_step_{KILL_AT_STEP}")
  os.kill(os.getpid(), signal.SIGKILL)


def _add_hooks_then_the_kill(self, loop, plan, eval_step):
  _add_hooks(self, loop, plan, eval_step)
  loop.hooks.add_hook(_kill, when=lambda step: step == KILL_AT_STEP)


trainer.Trainer._add_hooks = _add_hooks_then_the_kill
cli.run()
