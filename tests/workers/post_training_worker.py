"""Worker: SFT (LoRA, dropout) and DPO steps in 2 processes × 4 devices (mesh_configs/cpu-2proc.yaml: data
across the processes), each process feeding its own rows.

argv: PREFERENCE_JSONL. Writes each objective's per-step figures (``helpers.post_training_losses``).
"""

import pathlib
import sys

import mp_harness

mp_harness.worker_init()

import distrib_train as dt  # noqa: E402  (after jax.distributed.initialize)
import helpers  # noqa: E402

config_path = pathlib.Path(__file__).resolve().parents[2] / "mesh_configs" / "cpu-2proc.yaml"
mesh = dt.build_mesh(dt.MeshConfig.from_yaml(config_path))
mp_harness.write_result(
  {
    name: helpers.post_training_losses(sets, mesh)
    for name, sets in (
      (
        "sft",
        [
          "data.source=pydoc",
          "data.loss_on=assistant",
          "model.lora.rank=4",
          "model.lora.dropout=0.1",
          "data.seq_len=512",
          "data.global_batch_size=8",
        ],
      ),
      (
        "dpo",
        [
          "train.objective=dpo",
          "data.source=text",
          f"data.paths={sys.argv[1]}",
          "data.text_field=*",
          "data.seq_len=512",
          "data.global_batch_size=8",
        ],
      ),
    )
  }
)
