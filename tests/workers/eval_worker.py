"""Worker: lm-eval's local tasks of the three kinds on a Hugging Face directory, in 2 processes × 4 devices (fsdp
and the batch span the processes).

argv: HF_DIRECTORY TASKS_DIRECTORY MESH_YAML. Writes each task's metrics and per-sample answers
(test_eval_tasks_hf.py).
"""

import sys

import mp_harness

mp_harness.worker_init()

import eval_helpers  # noqa: E402

from distrib_train.evaluation import tasks as eval_tasks  # noqa: E402
from distrib_train.evaluation.harness import HarnessLM  # noqa: E402

eval_tasks.offline()
lm = HarnessLM.load(f"hf:{sys.argv[1]}", mesh_config=sys.argv[3], batch_size=4)
results = eval_tasks.evaluate(
  lm, list(eval_helpers.TASKS), include_path=[sys.argv[2]], log_samples=True, bootstrap_iters=0
)
mp_harness.write_result(
  {
    "metrics": eval_tasks.scores(results),
    "answers": {
      task: [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]
      for task in eval_helpers.TASKS
    },
  }
)
