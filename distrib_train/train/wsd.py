"""A warmup-stable-decay run's last stable step: kept, and a finished run extended from it.

``optimizer.schedule: wsd`` holds the peak learning rate until its last stable step
(``optimizers.wsd_decay_start``) and decays over the steps after it. The trainer checkpoints that step and
keeps it past ``train.keep_checkpoints`` (``stable_step``). A run that finished (or was stopped in its decay)
and is started again in its workdir with more ``train.steps`` is an **extension** (``extend``): the decayed
steps leave for ``checkpoints/.decayed-<their newest step>/`` and the run restores its last stable step, holds
the peak to the new schedule's last stable step and decays at the new end. A run resumed before its decay, or
with the steps it had, resumes as any other.

Not for: the schedule itself (``optimizers.py``).
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from distrib_train.checkpoint.checks import CheckpointError, read_meta, step_dirs
from distrib_train.cluster import distributed
from distrib_train.config.run import Config
from distrib_train.optim.chain import OptimizerConfig, wsd_decay_start


def stable_step(config: Config) -> int | None:
  """The step a ``wsd`` run checkpoints and keeps (None: another schedule, or no stable step before the end)."""
  o, steps = config.optimizer, config.train.steps
  step = wsd_decay_start(o, steps) if o.schedule == "wsd" else 0
  return step if 0 < step < steps else None


def kept_steps(config: Config) -> tuple[int, ...]:
  """The steps the checkpoint manager keeps past ``train.keep_checkpoints``: the last stable step, if any."""
  step = stable_step(config)
  return () if step is None else (step,)


def _decide(directory: pathlib.Path, local: Any, config: Config) -> tuple[int, int, int]:
  """``(stable, newest, old steps)`` for an extension, ``stable`` -1 for none and -2 for one whose stable step has
  no checkpoint. The newest step is either tier's (a local step past the persistent tier's newest is decayed
  progress too)."""
  steps = step_dirs(directory)
  if config.optimizer.schedule != "wsd" or not steps:
    return -1, 0, 0
  saved = (read_meta(directory, steps[-1]).get("run") or {}).get("config") or {}
  known = {f.name for f in dataclasses.fields(OptimizerConfig)}
  try:
    old = OptimizerConfig(**{k: v for k, v in (saved.get("optimizer") or {}).items() if k in known})
    old_steps = int(saved["train"]["steps"])
  except (KeyError, TypeError, ValueError):
    return -1, 0, 0  # a checkpoint without its config: resumed as any other
  newest = max([steps[-1], *(local.steps() if local is not None else [])])
  stable = wsd_decay_start(old, old_steps)
  if (
    old.schedule != "wsd"
    or not 0 < stable < old_steps
    or newest <= stable
    or config.train.steps <= old_steps
    or wsd_decay_start(config.optimizer, config.train.steps) <= stable
  ):
    return -1, 0, 0  # not past the old run's stable step, or not given more steps: an ordinary resume
  return (stable if stable in steps else -2), newest, old_steps


def extend(directory: pathlib.Path, local: Any, config: Config, log: Callable[[str], None]) -> int | None:
  """Prepares an extension of a finished ``wsd`` run (module docstring): process 0 decides for every process,
  moves the persistent tier's steps after the last stable step aside, and each process removes its local tier's.

  Returns:
    The last stable step the run restores, or None when this start is no extension.

  Raises:
    CheckpointError: an extension whose last stable step has no checkpoint.
  """
  decision = np.asarray(_decide(directory, local, config) if jax.process_index() == 0 else (0, 0, 0), np.int64)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    decision = np.asarray(multihost_utils.broadcast_one_to_all(decision))
  stable, newest, old_steps = (int(x) for x in decision)
  if stable == -2:
    held = ", ".join(map(str, step_dirs(directory)))
    raise CheckpointError(
      f"Extending the run in {str(directory)!r} to {config.train.steps} steps needs its last"
      f" stable step, which has no checkpoint there (steps: {held}); a run of this release"
      " keeps it."
    )
  if stable < 0:
    return None
  aside = directory / f".decayed-{newest}"
  if jax.process_index() == 0:
    aside.mkdir(exist_ok=True)
    for step in (s for s in step_dirs(directory) if s > stable):
      shutil.move(str(directory / str(step)), str(aside / str(step)))
  for step in (s for s in (local.steps() if local is not None else []) if s > stable):
    shutil.rmtree(local.directory / str(step), ignore_errors=True)
  distributed.wait_for_every_process("decayed steps moved aside")
  log(
    f"Extending a finished wsd run from {old_steps} to {config.train.steps} steps: restoring its last stable step"
    f" {stable}; its decayed steps (to {newest}) are in {aside}."
  )
  return stable
