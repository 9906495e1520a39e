"""Sharded, async, atomic checkpoints (orbax) that restore onto any mesh.

- ``manager``: ``CheckpointManager`` (save, restore, retention).
- ``faults``: what a storage fault while saving raises
  (``CheckpointWriteError``) and keeps off the console.
- ``checks``: the on-disk layout and the read-only checks
  (``check_restorable``, ``CheckpointError``), run before anything is read.
- ``tree``: a ``TrainState``'s saved fields as nested dicts of arrays.

New tiers (local disk, peer memory) and Hugging Face conversion go here.
"""

from distrib_train.checkpoint.checks import CheckpointError, check_restorable
from distrib_train.checkpoint.faults import CheckpointWriteError
from distrib_train.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointWriteError", "check_restorable"]
