"""Where a run restores from: the fast local tier or the persistent orbax tier.

``CheckpointTiers(persistent, local, log)`` holds a run's
``CheckpointManager`` and, when the run asks for one, its
``LocalCheckpoints`` (``local_tier(workdir)`` ties them to the workdir's run
id, which process 0 keeps and broadcasts). ``restore`` takes the local
tier's newest step when every process holds it complete, written by this run
on this layout, and it is newer than the persistent tier's newest; else the
persistent tier's newest; else nothing, and the caller starts a new state.
It logs which tier restored and, when the local tier held a newer step it
could not use, why.

Example::

  tiers = CheckpointTiers(ckpt, local_tier(workdir) if local_every else None, log=print)
  state = tiers.restore(plan.abstract_train_state, loader)
  if state is None:
    state = plan.init(make_state)

Not for: when to save (the trainer's hooks) or either tier's files
(``manager.py``, ``local.py``).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from distrib_train.checkpoint.checks import CheckpointError, first_line
from distrib_train.checkpoint.local import LocalCheckpoints
from distrib_train.checkpoint.manager import CheckpointManager
from distrib_train.train_state import TrainState

# The checkpoint's run metadata (what was passed as ``CheckpointManager(metadata=…)``) → one line per setting
# that differs from this run's, ``section.key: old → new``; a ``data.`` line explains a data position that
# does not restore.
ConfigChanges = Callable[[Mapping[str, Any]], list[str]]


def local_tier(workdir: pathlib.Path, directory: str = "", fields: tuple[str, ...] | None = None) -> LocalCheckpoints:
  """This process's fast tier for the run in ``workdir``, tied to the workdir's run id.

  Process 0 keeps the run id in ``workdir/run_id`` (written at the first
  call) and broadcasts it: a local step of an earlier run in a wiped and
  recreated workdir of the same path is never restored. Every process must
  call it.

  Args:
    workdir: the run's workdir (it exists on process 0).
    directory: the tier's directory on this host's own disk
      (``train.local_checkpoint_dir``); each process writes under
      ``process_<i>`` in it. Empty: ``<temp dir>/distrib_train-local/<a hash
      of the workdir>``.
    fields: the fields it saves (default: every saved field).

  Returns:
    This process's ``LocalCheckpoints``.
  """
  run_id = np.zeros(32, np.uint8)
  if jax.process_index() == 0:
    path = workdir / "run_id"
    if not path.exists():
      path.write_text(uuid.uuid4().hex)
    run_id[:] = np.frombuffer(path.read_text().strip()[:32].encode().ljust(32), np.uint8)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    run_id = np.asarray(multihost_utils.broadcast_one_to_all(run_id))
  base = directory or os.path.join(
    tempfile.gettempdir(), "distrib_train-local", hashlib.sha1(str(workdir.resolve()).encode()).hexdigest()[:16]
  )
  return LocalCheckpoints(
    os.path.join(os.path.expanduser(base), f"process_{jax.process_index()}"),
    bytes(run_id).decode().strip(),
    *([fields] if fields else []),
  )


class CheckpointTiers:
  """A run's checkpoint tiers, and the choice of the one a restart restores from (module docstring).

  Args:
    persistent: the orbax tier every process shares.
    local: this process's fast tier, or None when the run keeps none.
    log: where the line saying which tier restored (and why) goes.
  """

  def __init__(self, persistent: CheckpointManager, local: LocalCheckpoints | None, log: Callable[[str], None]):
    self.persistent = persistent
    self.local = local
    self.log = log

  def restore(
    self, target: TrainState, data_iterator: Any = None, config_changes: ConfigChanges = lambda run: []
  ) -> TrainState | None:
    """The newest state either tier holds for ``target``, or None when neither holds a step.

    Every process must call it (the local step is agreed by all of them).

    Args:
      target: the abstract train state with its shardings
        (``plan.abstract_train_state``).
      data_iterator: a ``DataLoader`` whose position is restored with the
        state.
      config_changes: what differs between the persistent checkpoint's config
        and this run's (``ConfigChanges``); logged, and named when the data
        position does not restore.

    Returns:
      The restored state, its ``step`` a Python int, or None.

    Raises:
      CheckpointError: the persistent checkpoint cannot be restored (for a
        data position that does not fit, the changed data settings are
        named).
    """
    latest = self.persistent.latest_step()
    if self.local is not None:
      local_step = self.local.complete_step(target, latest)
      if local_step is not None:
        state = self.local.restore(target, local_step, data_iterator)
        self.log(
          f"Restored step {local_step} from the local tier ({self.local.directory.parent}); the"
          f" persistent tier's newest is {latest}."
        )
        return state.replace(step=int(local_step))
      newest = max(self.local.steps(), default=None)
      if newest is not None and (latest is None or newest > latest):
        self.log(
          f"The local tier's step {newest} is not complete on every process (or not of this run"
          f" and layout): restoring from the persistent tier ({latest})."
        )
    if latest is None:
      return None
    return self._restore_persistent(target, latest, data_iterator, config_changes)

  def _restore_persistent(
    self, target: TrainState, latest: int, data_iterator: Any, config_changes: ConfigChanges
  ) -> TrainState:
    ckpt = self.persistent
    meta = ckpt.metadata_of(latest)
    changed = config_changes(meta.get("run") or {})
    if changed:
      self.log("The config differs from the checkpoint's: " + "; ".join(changed))
    # The loader's lanes resume from the position every checkpoint of this release holds, on any process
    # count; a checkpoint of an earlier release holds grain's per-process state, which lanes cannot read.
    same_layout = "data_position" in meta
    try:
      state = ckpt.restore(target, latest, data_iterator=data_iterator if same_layout else None)
    except CheckpointError as e:
      data_changed = [c for c in changed if c.startswith("data.")]
      if not (same_layout and data_changed):
        raise
      # grain's own error ("'next_index'") would blame the checkpoint for a changed setting.
      raise CheckpointError(
        f"Checkpoint step {latest} in {str(ckpt.directory)!r} holds the data pipeline's position for another"
        f" data config ({'; '.join(data_changed)}); resume with the checkpoint's values, or train in a new"
        f" workdir. (Restoring said: {first_line(e)})"
      ) from None
    if not same_layout:
      self.log(
        f"Checkpoint step {latest} holds no data position this release reads (it was written by an"
        " earlier release): the data pipeline restarts from its beginning."
      )
    self.log(f"Restored step {latest} from {ckpt.directory}.")
    return state.replace(step=int(latest))
