"""Worker: the tiny Llama on packed rows (their length the second argument), the context axis across the two processes (ring over DCN,
then all-gather through splash)."""

import sys

import mp_harness

mp_harness.worker_init()

import jax  # noqa: E402  (after jax.distributed.initialize)

import pipeline_helpers as ph  # noqa: E402

ph.LENGTH, ph.BATCH = int(sys.argv[2]), 8
mesh = ph.mesh_of({"context": 4, "fsdp": 2}, devices=jax.devices(), dcn={"context": 2})
losses, _ = ph.train(mesh, steps=int(sys.argv[1]), packed=True)
splash_losses, _ = ph.train(
  mesh, steps=int(sys.argv[1]), packed=True, context_attention="all_gather", attention="splash", remat="full"
)
mp_harness.write_result({"losses": losses, "splash_losses": splash_losses, "mesh": dict(mesh.shape)})
