"""Worker: the tiny Llama through a 2-stage pipeline whose stage axis spans the two processes (DCN)."""

import sys

import mp_harness

mp_harness.worker_init()

import jax  # noqa: E402  (after jax.distributed.initialize)

import pipeline_helpers as ph  # noqa: E402

assert jax.process_count() == 2 and len(jax.local_devices()) == 4, (jax.process_count(), jax.local_devices())
mesh = ph.mesh_of({"stage": 2, "fsdp": 2, "tensor": 2}, devices=jax.devices(), dcn={"stage": 2})
losses, _ = ph.train(mesh, steps=int(sys.argv[1]), microbatches=4)
mp_harness.write_result({"losses": losses, "mesh": dict(mesh.shape)})
