"""Sharded, async, atomic checkpoints (orbax) that restore onto any mesh.

- ``manager``: ``CheckpointManager`` (save, restore, retention).
- ``faults``: what a storage fault while saving raises
  (``CheckpointWriteError``) and keeps off the console.
- ``checks``: the on-disk layout and the read-only checks
  (``check_restorable``, ``CheckpointError``), run before anything is read.
- ``tree``: a ``TrainState``'s saved fields as nested dicts of arrays.
- ``data_state``: a data iterator's state in a checkpoint (the lanes'
  position, or grain's per-process item).
- ``local``: the fast tier, each process's shards on its own disk;
  ``tiers``: which tier a restart restores from (``CheckpointTiers``).
- ``hf``, ``hf_common``: Hugging Face checkpoints in and out, every family
  through its table of tensor names (``recipes/hf_tables.py``), and the
  safetensors reader; ``peft_adapter``: a LoRA run's adapters as a PEFT
  adapter.

New tiers (local disk, peer memory) and Hugging Face conversion go here.
"""

from distrib_train.checkpoint.checks import CheckpointError, check_restorable
from distrib_train.checkpoint.faults import CheckpointWriteError
from distrib_train.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointWriteError", "check_restorable"]
