"""Worker: a GRPO run on a Hugging Face directory in 2 processes × 4 devices (the batch and fsdp span the
processes: prompts are split over them, rewards gathered).

argv: HF_DIRECTORY PROMPTS_JSONL MESH_YAML WORKDIR then ``key=value`` overrides. Process 0 writes the run's
records to WORKDIR (test_grpo_hf.py).
"""

import sys

import mp_harness

mp_harness.worker_init()

from distrib_train.config import run as config_lib  # noqa: E402
from distrib_train.train.trainer import Trainer  # noqa: E402

import grpo_helpers  # noqa: E402

config = config_lib.load(
  "grpo-tiny", grpo_helpers.hf_overrides(sys.argv[1], sys.argv[2]) + [f"mesh_config={sys.argv[3]}"] + sys.argv[5:]
)
result = Trainer(config, sys.argv[4]).run()
mp_harness.write_result({"status": result.status, "step": result.step})
