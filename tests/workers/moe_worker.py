"""Worker: the tiny mixture of experts with its expert axis across the two processes (all-to-all over DCN): its
losses and trained params, and one packed batch's gradients."""

import sys

import mp_harness

mp_harness.worker_init()

import jax  # noqa: E402  (after jax.distributed.initialize)

import pipeline_helpers as ph  # noqa: E402

assert jax.process_count() == 2 and len(jax.local_devices()) == 4, (jax.process_count(), jax.local_devices())
mesh = ph.mesh_of({"expert": 4, "fsdp": 2}, devices=jax.devices(), dcn={"expert": 2})
losses, params = ph.train(mesh, steps=int(sys.argv[1]), family="moe")
gradients = ph.gradients(mesh, family="moe", packed=True)
mp_harness.write_result(
  {
    "losses": losses,
    "mesh": dict(mesh.shape),
    "params": {k: v.tolist() for k, v in params.items()},
    "gradients": {k: v.tolist() for k, v in gradients.items()},
  }
)
