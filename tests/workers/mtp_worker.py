"""Worker: the tiny Llama with two multi-token-prediction depths on packed, weighted rows, fsdp across the two
processes (× tensor 2 × context 2 in each): its aux figures and gradients."""

import mp_harness

mp_harness.worker_init()

import jax  # noqa: E402  (after jax.distributed.initialize)

import mtp_helpers  # noqa: E402
import pipeline_helpers as ph  # noqa: E402

assert jax.process_count() == 2 and len(jax.local_devices()) == 4, (jax.process_count(), jax.local_devices())
mesh = ph.mesh_of({"fsdp": 2, "tensor": 2, "context": 2}, devices=jax.devices(), dcn={"fsdp": 2})
aux, gradients = mtp_helpers.loss_and_gradients(mesh, mtp_depth=2)
mp_harness.write_result(
  {"aux": aux, "mesh": dict(mesh.shape), "gradients": {k: v.tolist() for k, v in gradients.items()}}
)
