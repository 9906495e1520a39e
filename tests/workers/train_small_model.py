"""Worker: trains the small MLP on mesh_configs/cpu-2proc.yaml (2 × 4 devices)."""

import pathlib
import sys

import mp_harness

mp_harness.worker_init()

import jax  # noqa: E402  (after jax.distributed.initialize)

import distrib_train as dt  # noqa: E402
import helpers  # noqa: E402

config_path = pathlib.Path(__file__).resolve().parents[2] / "mesh_configs" / "cpu-2proc.yaml"
mesh = dt.build_mesh(dt.MeshConfig.from_yaml(config_path))
assert jax.process_count() == 2 and len(jax.local_devices()) == 4, (jax.process_count(), jax.local_devices())
losses, params = helpers.train_small_model(mesh, steps=int(sys.argv[1]))
mp_harness.write_result(
  {
    "losses": losses,
    "params": {k: v.tolist() for k, v in params.items()},
    "mesh_shape": dict(mesh.shape),
    "process_index": jax.process_index(),
  }
)
