"""``distrib-train eval``'s answers against lm-evaluation-harness's own ``hf`` model (transformers, PyTorch, CPU).

A tiny Llama and a tiny Qwen3-MoE (``test_hf``'s, random weights, fp32,
64 positions) with a byte-level BPE whose tokenizer adds a BOS, saved by
transformers; three local tasks (``eval_helpers``: ``dataset_path: json``)
of lm-eval's three request kinds — multiple choice, rolling perplexity over
texts longer than the context, generate-until. Our model reads the
directory onto 8 emulated devices (fsdp 2 × tensor 2 × data 2, or fsdp 2 ×
expert 4) and, for the Llama, in 2 processes × 4 devices; lm-eval's ``hf``
model reads the same directory. Every metric (``acc``, ``acc_norm``,
``word_perplexity``, ``byte_perplexity``, ``bits_per_byte``,
``exact_match``) and every sample's answer must match: log-likelihoods to
1e-4, ``is_greedy`` and generated texts exactly — also with the chat template and few-shot turns.
(``bench/evaluation.py`` times both on the same requests and checks their answers equal.)
"""

import importlib
import os
import pathlib

import numpy as np
import pytest

try:
  import lm_eval

  for _name in ("torch", "transformers", "accelerate"):  # lm-eval's hf model: its [hf] extra
    importlib.import_module(_name)
except ImportError:
  if os.environ.get("DT_REQUIRE_TORCH") == "1":
    raise
  pytest.skip(
    "lm-eval's hf model (transformers, torch) is the reference here: pip install 'lm-eval[hf]'", allow_module_level=True
  )

import eval_helpers
from distrib_train.evaluation import tasks as eval_tasks
from distrib_train.evaluation.harness import HarnessLM

pytestmark = pytest.mark.compat


def _theirs(hf_dir, tasks_dir, tasks=eval_helpers.TASKS, **options):
  eval_tasks.offline()
  results = lm_eval.simple_evaluate(
    model="hf",
    model_args={"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"},
    tasks=list(tasks),
    task_manager=eval_tasks.task_manager([str(tasks_dir)]),
    log_samples=True,
    batch_size=4,
    bootstrap_iters=0,
    **options,
  )
  return eval_tasks.scores(results), _answers(results, tasks)


def _answers(results, tasks=eval_helpers.TASKS):
  return {task: [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])] for task in tasks}


def _assert_same(ours_metrics, ours_answers, their_metrics, their_answers, tasks=eval_helpers.TASKS):
  assert set(ours_metrics) == set(their_metrics)
  for key, value in their_metrics.items():
    np.testing.assert_allclose(ours_metrics[key], value, rtol=1e-5, err_msg=key)
  generated = 0
  for task in tasks:
    assert len(ours_answers[task]) == len(their_answers[task]) > 0
    for ours, theirs in zip(ours_answers[task], their_answers[task]):
      for (a,), (b,) in zip(ours, theirs, strict=True):  # each request's one answer
        if isinstance(b, str):  # generate_until: the text
          assert a == b
          generated += bool(b)
        elif isinstance(b, (tuple, list)):  # loglikelihood: (logprob, is_greedy)
          np.testing.assert_allclose(float(a[0]), float(b[0]), rtol=1e-4, atol=1e-4)
          assert bool(a[1]) == bool(b[1])
        else:  # loglikelihood_rolling: the logprob
          np.testing.assert_allclose(float(a), float(b), rtol=1e-4, atol=1e-4)
  assert generated  # some completions hold text before their stop string


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_every_metric_and_sample_is_lm_evals_hf_models_on_8_devices(family, tmp_path):
  """The three tasks; for the Llama also ``--apply_chat_template --fewshot_as_multiturn --num_fewshot 2`` on two of
  them: the same prompts (the model's chat template, two examples as turns), so the same answers."""
  eval_helpers.save_model(family, tmp_path / "hf")
  tasks = eval_helpers.write_tasks(tmp_path / "tasks")
  mesh = "cpu-8-expert" if family == "qwen3_moe" else "cpu-8"
  lm = HarnessLM.load(f"hf:{tmp_path / 'hf'}", mesh_config=mesh, batch_size=4)
  ours = eval_tasks.evaluate(
    lm, list(eval_helpers.TASKS), include_path=[str(tasks)], log_samples=True, bootstrap_iters=0
  )
  assert lm.max_length == eval_helpers.CONTEXT
  assert lm.scorer.compiles <= 2  # calls share programs (a row length per request kind: trees or not)
  _assert_same(eval_tasks.scores(ours), _answers(ours), *_theirs(tmp_path / "hf", tasks))
  if family != "llama":
    return
  chat_tasks = ("local_choice", "local_completion")
  options = dict(num_fewshot=2, apply_chat_template=True, fewshot_as_multiturn=True)
  ours = eval_tasks.evaluate(lm, chat_tasks, include_path=[str(tasks)], log_samples=True, bootstrap_iters=0, **options)
  prompt = sorted(ours["samples"]["local_choice"], key=lambda s: s["doc_id"])[0]["arguments"][0][0]
  assert prompt.startswith("<|begin_of_text|><user>\n") and prompt.count("<assistant>") == 3
  _assert_same(
    eval_tasks.scores(ours),
    _answers(ours, chat_tasks),
    *_theirs(tmp_path / "hf", tasks, chat_tasks, **options),
    chat_tasks,
  )


def test_two_processes_give_lm_evals_hf_answers(tmp_path):
  """2 processes × 4 devices (fsdp across them, tensor within: ``tests/workers/eval_worker.py``): each process
  holds every answer, and they are the ``hf`` model's."""
  import mp_harness

  eval_helpers.save_model("llama", tmp_path / "hf")
  tasks = eval_helpers.write_tasks(tmp_path / "tasks")
  (tmp_path / "mesh.yaml").write_text(
    "devices: 8\ngranules: 2\naxes:\n  data: 1\n  fsdp: {ici: 2, dcn: 2}\n  tensor: {ici: 2}\nrules: fsdp_tensor\n"
  )
  results = mp_harness.run_workers(
    pathlib.Path(__file__).parent / "workers" / "eval_worker.py",
    str(tmp_path / "hf"),
    str(tasks),
    str(tmp_path / "mesh.yaml"),
    timeout=400,
  )
  their_metrics, their_answers = _theirs(tmp_path / "hf", tasks)
  for r in results:
    answers = r.result["answers"]
    _assert_same(r.result["metrics"], answers, their_metrics, their_answers)
