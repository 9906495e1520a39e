"""GRPO's loss against TRL's formula on transformers' log-probabilities (PyTorch, CPU, fp32).

A tiny Llama with a BPE tokenizer saved by transformers (``eval_helpers``) is the starting policy. A run of two
steps on one batch of completions (``grpo.num_iterations: 2``, ``grpo_helpers.hf_overrides``) logs its rollouts
and its loss at each step. transformers then computes every completion token's log-probability (logits over the
temperature) under the starting model (the old policy and the reference) and under the run's step-1 checkpoint
exported to Hugging Face (the policy at step 2, so the importance weights and the clip bite), and TRL's formula
(``grpo_helpers.trl_loss``) on them must give the run's losses to 1e-4. Each loss type, both importance-sampling
levels and beta 0 and 0.04 appear among the runs (dapo and dr_grpo on 8 devices, bnpo on one device, grpo in 2
processes × 4 devices; token and sequence weights, beta 0 and 0.04 each twice).

A chat model whose tokenizer ends with ``<|im_end|>`` while its ``generation_config.json`` names another end id
(``grpo_helpers.save_chat_model``) stops its completions where TRL's rule does: at the first id of the union of
both, through the CLI.
"""

import importlib
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

try:
  for _name in ("torch", "transformers"):
    importlib.import_module(_name)
except ImportError:
  if os.environ.get("DT_REQUIRE_TORCH") == "1":
    raise
  pytest.skip("transformers (with torch) is the reference here", allow_module_level=True)

import eval_helpers
import grpo_helpers
from distrib_train.config import run as config_lib

pytestmark = pytest.mark.compat
ONE_DEVICE = "devices: 1\naxes:\n  data: 1\nrules: fsdp_tensor\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  root = tmp_path_factory.mktemp("grpo_hf")
  eval_helpers.save_model("llama", root / "hf")
  return root / "hf", grpo_helpers.write_prompts(root / "prompts.jsonl")


def _logps(directory, rows, prompts, temperature):
  """[completions, longest] each completion token's log-probability under the transformers model in ``directory``
  (fp32, logits over ``temperature``) after its prompt's ids, 0 past a completion's end."""
  import torch
  import transformers

  net = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  out = np.zeros((len(rows), max(len(r["completion_ids"]) for r in rows)))
  with torch.no_grad():
    for i, (r, prompt) in enumerate(zip(rows, prompts)):
      ids = torch.tensor([prompt + r["completion_ids"]])
      logps = torch.log_softmax(net(ids).logits[0, :-1].double() / temperature, dim=-1)
      picked = logps.gather(-1, ids[0, 1:, None])[:, 0].numpy()
      out[i, : len(r["completion_ids"])] = picked[len(prompt) - 1 :]
  return out


def _check_against_trl(workdir, hf_dir, config):
  from distrib_train.weights import export

  g = config.grpo
  rows = [r for r in grpo_helpers.read_jsonl(workdir / "rollouts.jsonl") if r["step"] == 1]
  assert len(rows) == config.data.global_batch_size
  rewards = [r["reward"] for r in rows]
  np.testing.assert_allclose(
    [r["advantage"] for r in rows], grpo_helpers.trl_advantages(rewards, g.num_generations, g.scale_rewards), atol=1e-6
  )
  lengths = np.asarray([len(r["completion_ids"]) for r in rows])
  mask = (np.arange(lengths.max())[None, :] < lengths[:, None]).astype(np.float64)
  if g.mask_truncated_completions:
    mask *= ~np.asarray([r["truncated"] for r in rows])[:, None]
  import transformers

  # The prompts as TRL tokenizes them: a text prompt with the tokenizer's special tokens (its BOS); a chat rendered
  # by transformers' chat template with the generation prompt (the rollouts must hold that text), then tokenized
  # without adding any.
  tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
  records = grpo_helpers.read_jsonl(config.data.paths[0])
  prompts = []
  for r in rows:
    prompt = records[r["prompt_index"]]["prompt"]
    if isinstance(prompt, str):
      assert r["prompt"] == prompt
      prompts.append(tok(prompt)["input_ids"])
    else:
      assert r["prompt"] == tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
      prompts.append(tok(r["prompt"], add_special_tokens=False)["input_ids"])
  assert any(isinstance(records[r["prompt_index"]]["prompt"], list) for r in rows)
  export.export(workdir, str(workdir / "step1_hf"), step=1)
  start = _logps(hf_dir, rows, prompts, g.temperature)
  after_one = _logps(workdir / "step1_hf", rows, prompts, g.temperature)
  options = dict(
    loss_type=g.loss_type,
    level=g.importance_sampling_level,
    beta=g.beta,
    epsilon=g.epsilon,
    epsilon_high=g.epsilon_high,
    max_completion_length=g.max_completion_length,
  )
  advantages = [r["advantage"] for r in rows]
  expected = {
    1: grpo_helpers.trl_loss(start, start, start, advantages, mask, **options),
    2: grpo_helpers.trl_loss(after_one, start, start, advantages, mask, **options),
  }
  ran = grpo_helpers.losses(workdir)
  assert abs(expected[2] - expected[1]) > 1e-3  # the policy moved: step 2's weights are not 1
  np.testing.assert_allclose([ran[1], ran[2]], [expected[1], expected[2]], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
  "settings",
  [
    ("grpo.loss_type=dapo", "grpo.importance_sampling_level=token"),
    (
      "grpo.loss_type=dr_grpo",
      "grpo.importance_sampling_level=token",
      "grpo.beta=0.04",
      "grpo.mask_truncated_completions=true",
      "grpo.epsilon_high=0.28",
    ),
  ],
)
def test_the_runs_loss_is_trls_formula_on_8_devices(model, settings, tmp_path):
  from distrib_train.train.trainer import Trainer

  hf_dir, prompts = model
  if "grpo.beta=0.04" in settings:  # the reference read from its own directory, as dpo.reference reads one
    settings = (*settings, f"grpo.reference=hf:{hf_dir}")
  config = config_lib.load("grpo-tiny", grpo_helpers.hf_overrides(hf_dir, prompts) + list(settings))
  assert Trainer(config, tmp_path / "run").run().status == "finished"
  _check_against_trl(tmp_path / "run", hf_dir, config)


def test_the_runs_loss_is_trls_formula_on_one_device(model, tmp_path):
  """One process with one device (``tests/workers/grpo_worker.py``)."""
  import mp_harness

  hf_dir, prompts = model
  (tmp_path / "one.yaml").write_text(ONE_DEVICE)
  settings = ["grpo.loss_type=bnpo", "grpo.importance_sampling_level=sequence", "grpo.scale_rewards=batch"]
  results = mp_harness.run_workers(
    pathlib.Path(__file__).parent / "workers" / "grpo_worker.py",
    str(hf_dir),
    str(prompts),
    str(tmp_path / "one.yaml"),
    str(tmp_path / "run"),
    *settings,
    num_processes=1,
    devices_per_process=1,
    timeout=400,
  )
  assert results[0].result == {"status": "finished", "step": 2}
  config = config_lib.load("grpo-tiny", grpo_helpers.hf_overrides(hf_dir, prompts) + settings)
  _check_against_trl(tmp_path / "run", hf_dir, config)


def test_the_runs_loss_is_trls_formula_in_two_processes(model, tmp_path):
  """2 processes × 4 devices: the prompts' rewards scored where their groups are, gathered; the loss TRL's."""
  import mp_harness

  hf_dir, prompts = model
  (tmp_path / "mesh.yaml").write_text(
    "devices: 8\ngranules: 2\naxes:\n  data: 1\n  fsdp: {ici: 2, dcn: 2}\n  tensor: {ici: 2}\nrules: fsdp_tensor\n"
  )
  settings = ["grpo.loss_type=grpo", "grpo.importance_sampling_level=sequence", "grpo.beta=0.04"]
  results = mp_harness.run_workers(
    pathlib.Path(__file__).parent / "workers" / "grpo_worker.py",
    str(hf_dir),
    str(prompts),
    str(tmp_path / "mesh.yaml"),
    str(tmp_path / "run"),
    *settings,
    timeout=400,
  )
  assert all(r.result == {"status": "finished", "step": 2} for r in results)
  config = config_lib.load("grpo-tiny", grpo_helpers.hf_overrides(hf_dir, prompts) + settings)
  _check_against_trl(tmp_path / "run", hf_dir, config)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
  root = tmp_path_factory.mktemp("grpo_chat")
  prompts = grpo_helpers.write_prompts(root / "prompts.jsonl")
  grpo_helpers.save_chat_model(root / "hf", prompts)
  return root / "hf", prompts


def _end_ids(hf_dir):
  """``(TRL's end ids, transformers' generate's)`` of a Hugging Face directory, as transformers reads them: the
  union of the tokenizer's end token and the generation config's ids, and the generation config's alone."""
  import transformers

  configured = transformers.GenerationConfig.from_pretrained(hf_dir).eos_token_id
  configured = sorted(configured if isinstance(configured, list) else [configured])
  return sorted({transformers.AutoTokenizer.from_pretrained(hf_dir).eos_token_id, *configured}), configured


def test_rollouts_end_at_trls_union_of_end_ids_and_generate_at_the_generation_configs(chat_model):
  from distrib_train.inference import text as generate_text
  from distrib_train.posttrain import rollouts
  from distrib_train.weights import load as run_model

  hf_dir, prompts = chat_model
  trl, configured = _end_ids(hf_dir)
  assert len(trl) == len(configured) + 1  # the tokenizer's <|im_end|> is none of the generation config's
  config = config_lib.load("grpo-tiny", grpo_helpers.hf_overrides(hf_dir, prompts))
  assert rollouts.RolloutSource(config, None, None, None).end_ids == trl
  found = run_model.source(f"hf:{hf_dir}")
  assert generate_text.end_ids(found, generate_text.codec_for(found)) == configured


def test_a_cli_run_ends_each_completion_at_its_first_end_id_as_trl_does(chat_model, tmp_path):
  """``distrib-train`` on the chat model: every completion in ``rollouts.jsonl`` is TRL's — the sampled ids up to
  and including the first of TRL's end ids, nothing after it — and so not truncated; its reward text is
  transformers' decoding without special tokens, no ``<|im_end|>`` in it."""
  import transformers

  hf_dir, prompts = chat_model
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
  sets = [word for setting in grpo_helpers.hf_overrides(hf_dir, prompts) for word in ("--set", setting)]
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "distrib_train",
      "--config",
      "grpo-tiny",
      "--workdir",
      str(tmp_path / "run"),
      "--cpu_devices",
      "8",
      *sets,
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  trl, _ = _end_ids(hf_dir)
  tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
  rows = grpo_helpers.read_jsonl(tmp_path / "run" / "rollouts.jsonl")
  assert len(rows) == 16
  for r in rows:
    ids = r["completion_ids"]
    first_end = next((i for i, t in enumerate(ids) if t in trl), None)  # TRL keeps ids[:first_end + 1]
    assert first_end == len(ids) - 1 and len(ids) < 12 and not r["truncated"], r
    assert r["completion"] == tok.decode(ids, skip_special_tokens=True) and "<|im_end|>" not in r["completion"]
  assert tok.eos_token_id in {r["completion_ids"][-1] for r in rows}
  assert max(r["length"] for r in rows) > 1  # some stop after a few tokens, not only at once
