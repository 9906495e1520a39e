"""Saves step 1, starts an async save of step 2, then SIGKILLs itself.

argv: DIRECTORY. Run as a plain subprocess (one process, 8 devices).
"""

import os
import signal
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import distrib_train as dt  # noqa: E402

directory = sys.argv[1]
mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (1, 8, 1)))
# ~100 MB of params + Adam: the background write takes long enough to be cut.
make = lambda: dt.TrainState.initial_state({"w": jnp.ones((4096, 6144))}, optax.adam(1e-3), jax.random.key(0))
state, plan = dt.MeshPlanner(mesh, "fsdp_tensor").init(make, param_logical_axes={"w": ("embed", "mlp")})
checkpoints = dt.CheckpointManager(directory, max_to_keep=5)
checkpoints.save(1, state)
checkpoints.wait_until_finished()
state = state.replace(step=2, params={"w": state.params["w"] * 2})
checkpoints.save(2, state)  # returns after the device→host copy
print("save of step 2 started", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
