"""Worker: training batches read by any number of processes, resuming the previous job's data position.

argv: CHECKPOINT_DIR PHASE STEPS. Phase 0 starts the data; a later phase
restores the latest position in CHECKPOINT_DIR. Reads STEPS batches, saves
the position, writes this process's rows.
"""

import sys

import mp_harness

mp_harness.worker_init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import data_helpers  # noqa: E402
import distrib_train as dt  # noqa: E402
from distrib_train import data  # noqa: E402

checkpoint_dir, phase, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
processes = jax.process_count()
mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (1, 8 // processes, 1), (processes, 1, 1)))
config = data.DataConfig(seq_len=32, global_batch_size=8)
loader = data.DataLoader(config, data_helpers.shardings(mesh))
state = dt.TrainState.create(apply_fn=None, params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1))
with dt.CheckpointManager(checkpoint_dir) as checkpoints:
  if phase:
    checkpoints.restore(state, data_iterator=loader)
  tokens = [loader.next_local()["tokens"].tolist() for _ in range(steps)]
  checkpoints.save((phase + 1) * steps, state, data_iterator=loader)
loader.close()
mp_harness.write_result({"process": jax.process_index(), "shard": loader.shard_index, "tokens": tokens})
