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

from distrib_train.checkpoint.checks import CheckpointError, read_meta
from distrib_train.cluster import distributed
from distrib_train.training.config import Config, OptimizerConfig
from distrib_train.training.optimizers import wsd_decay_start


def stable_step(config: Config) -> int | None:
  """The step a ``wsd`` run checkpoints and keeps (None: another schedule, or no stable step before the end)."""
  o, steps = config.optimizer, config.train.steps
  step = wsd_decay_start(o, steps) if o.schedule == "wsd" else 0
  return step if 0 < step < steps else None


def _steps(directory: pathlib.Path) -> list[int]:
  """The committed steps in a checkpoints directory (orbax's step folders with their metadata)."""
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and (p / "meta").is_dir())


def extend(directory: pathlib.Path, local: Any, config: Config, log: Callable[[str], None]) -> int | None:
  """Prepares an extension of a finished ``wsd`` run (module docstring): the steps after its last stable step
  moved aside (the persistent tier's by process 0, each process's local tier's by itself).

  Returns:
    The last stable step the run restores, or None when this start is no extension.

  Raises:
    CheckpointError: an extension whose last stable step has no checkpoint.
  """
  steps = _steps(directory)
  if config.optimizer.schedule != "wsd" or not steps:
    return None
  latest = steps[-1]
  saved = (read_meta(directory, latest).get("run") or {}).get("config") or {}
  known = {f.name for f in dataclasses.fields(OptimizerConfig)}
  try:
    old = OptimizerConfig(**{k: v for k, v in (saved.get("optimizer") or {}).items() if k in known})
    old_steps = int(saved["train"]["steps"])
  except (KeyError, TypeError, ValueError):
    return None  # a checkpoint without its config: resumed as any other
  stable = wsd_decay_start(old, old_steps)
  if old.schedule != "wsd" or latest <= stable or wsd_decay_start(config.optimizer, config.train.steps) <= stable:
    return None
  if stable not in steps:
    raise CheckpointError(f"Extending the run in {str(directory)!r} to {config.train.steps} steps needs its last"
                          f" stable step, {stable}, which has no checkpoint there (steps: {', '.join(map(str, steps))})"
                          "; a run of this release keeps it.")
  aside = directory / f".decayed-{latest}"
  if jax.process_index() == 0:
    aside.mkdir(exist_ok=True)
    for step in (s for s in steps if s > stable):
      shutil.move(str(directory / str(step)), str(aside / str(step)))
  for step in (s for s in (local.steps() if local is not None else []) if s > stable):
    shutil.rmtree(local.directory / str(step), ignore_errors=True)
  distributed.wait_for_every_process("decayed steps moved aside")
  log(f"Extending a finished wsd run from {old_steps} to {config.train.steps} steps: restoring its last stable step"
      f" {stable}; its decayed steps (to {latest}) are in {aside}.")
  return stable
