"""Worker: save or restore a checkpoint in 2 processes × 4 devices.

argv: save|restore DIRECTORY
"""

import pathlib
import sys

import mp_harness

mp_harness.worker_init()

import jax  # noqa: E402

import ckpt_helpers  # noqa: E402
import distrib_train as dt  # noqa: E402

mode, directory = sys.argv[1], sys.argv[2]
config = pathlib.Path(__file__).resolve().parents[2] / "mesh_configs" / "cpu-2proc.yaml"
mesh = dt.build_mesh(dt.MeshConfig.from_yaml(config))
plan, make, step_fn = ckpt_helpers.planned(mesh)
with dt.CheckpointManager(directory) as checkpoints:
  if mode == "save":
    state = ckpt_helpers.train(plan.init(make), step_fn, 0, 3, plan)
    checkpoints.save(3, state)
  else:
    state = checkpoints.restore(plan.abstract_train_state)
arrays = ckpt_helpers.saved_arrays(state)
mp_harness.write_result(
  {
    "arrays": {k: v.tolist() for k, v in arrays.items()},
    "shardings_ok": all(
      a.sharding == s
      for a, s in zip(
        jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(plan.train_state_shardings.params)
      )
    ),
    "steps": checkpoints.all_steps() if mode == "save" else None,
  }
)
