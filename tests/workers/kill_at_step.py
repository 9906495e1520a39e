"""Worker: the ``distrib-train`` command line, SIGKILLed by itself right after step ``DT_KILL_AT_STEP``.

The kill is a hook added after the trainer's own, so every hook of that step
(the goodput record included) has run: the furthest step reached is known
exactly, whatever the machine's speed.
"""

import os
import signal

from distrib_train import cli
from distrib_train.training import trainer

KILL_AT_STEP = int(os.environ["DT_KILL_AT_STEP"])
_add_hooks = trainer.Trainer._add_hooks


def _add_hooks_then_the_kill(self, loop, plan, eval_step):
  _add_hooks(self, loop, plan, eval_step)
  loop.hooks.add_hook(lambda loop: os.kill(os.getpid(), signal.SIGKILL), when=lambda step: step == KILL_AT_STEP)


trainer.Trainer._add_hooks = _add_hooks_then_the_kill
cli.run()
