"""``train.objective: grpo``: the loss equal to TRL's formula for every loss type, importance-sampling level and
beta; a run on the tiny model that writes readable rollouts and figures and resumes exactly (mid-way through
``num_iterations`` too); a failing reward function stopping the run in one line; refusals before anything runs.

The equality with TRL's formula on transformers' log-probabilities of a logged batch, on 8 devices, one device
and 2 processes, is ``tests/test_grpo_hf.py`` (CI's compat job).
"""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import grpo_helpers
from distrib_train.common.yaml_loader import ConfigError
from distrib_train.objectives import grpo
from distrib_train.config import run as config_lib
from distrib_train.posttrain import rollouts

ROLLOUT_KEYS = {
  "step",
  "prompt_index",
  "prompt",
  "completion",
  "completion_ids",
  "rewards",
  "reward",
  "advantage",
  "length",
  "truncated",
}  # as docs/rl.md lists them


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.parametrize("level", grpo.LEVELS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_is_trls_formula(loss_type, level, beta):
  """Our loss on per-token figures (old log-probabilities apart from the policy's, so the clip bites) equals TRL's
  written out independently (``grpo_helpers.trl_loss``), to float32 precision."""
  rng = np.random.default_rng(0)
  rows, length = 8, 12
  logps = rng.normal(-2.0, 0.5, (rows, length))
  old = logps + rng.normal(0.0, 0.3, (rows, length))
  ref = logps + rng.normal(0.0, 0.2, (rows, length))
  lengths = rng.integers(0, length, rows)
  mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
  advantages = rng.normal(0.0, 1.0, rows)
  settings = grpo.GrpoConfig(
    loss_type=loss_type,
    importance_sampling_level=level,
    beta=beta,
    epsilon=0.2,
    epsilon_high=0.28,
    max_completion_length=length,
  )
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  loss, aux = grpo.figures(
    f32(logps),
    f32(np.zeros_like(logps)),
    f32(mask),
    f32(np.broadcast_to(advantages[:, None], logps.shape)),
    f32(old),
    f32(old),
    f32(ref) if beta else None,
    settings,
  )
  expected = grpo_helpers.trl_loss(
    logps,
    old,
    ref,
    advantages,
    mask,
    loss_type=loss_type,
    level=level,
    beta=beta,
    epsilon=0.2,
    epsilon_high=0.28,
    max_completion_length=length,
  )
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-6)
  assert float(aux["tokens"]) == mask.sum() and float(aux["sequences"]) == rows
  if level == "token":  # TRL's clip ratios: the share of completion tokens clipped below (A < 0) and above (A > 0)
    coef = np.exp(logps - old)
    low = ((coef < 0.8) & (advantages[:, None] < 0) & (mask > 0)).sum() / mask.sum()
    high = ((coef > 1.28) & (advantages[:, None] > 0) & (mask > 0)).sum() / mask.sum()
    np.testing.assert_allclose(
      [float(aux["clip_ratio/low_mean"]), float(aux["clip_ratio/high_mean"])], [low, high], atol=1e-6
    )
    assert 0 < low and 0 < high
  if beta:
    kl = np.exp(ref - logps) - (ref - logps) - 1
    np.testing.assert_allclose(float(aux["kl"]), (kl * mask).sum() / mask.sum(), rtol=1e-5)


def _config(*overrides, steps=4):
  return config_lib.load(
    "grpo-tiny",
    [f"train.steps={steps}", "train.log_every=1", "data.global_batch_size=32", "grpo.num_generations=4", *overrides],
  )


def _train(config, workdir):
  from distrib_train.train.trainer import Trainer

  return Trainer(config, workdir).run()


def test_a_run_writes_rollouts_and_resumes_exactly(tmp_path):
  """6 steps with ``num_iterations: 2`` in one go, and the same killed after step 5 before its checkpoint was
  committed, resumed from step 3's (mid-way through the batch of completions made at step 2, which the batch made
  at step 4 did not remove): the same rollouts and losses, the lines of the steps trained again not doubled. The
  rollouts file holds one line per completion with the documented keys, the rewards and advantages as TRL computes
  them; the metrics hold the rollout figures, the clip ratios and the sampler / trainer gap (tiny: the same
  weights, fp32)."""
  import shutil

  settings = ("grpo.num_iterations=2", "train.checkpoint_every=3", "grpo.loss_type=grpo", "grpo.beta=0.04")
  whole = _train(_config(*settings, steps=6), tmp_path / "whole")
  assert whole.status == "finished" and whole.step == 6
  assert _train(_config(*settings, steps=5), tmp_path / "resumed").step == 5
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "5")  # killed before step 5's checkpoint was committed
  assert sorted(p.name for p in (tmp_path / "resumed" / "rollouts_batch").iterdir()) == ["2", "4"]
  result = _train(_config(*settings, steps=6), tmp_path / "resumed")
  assert result.status == "finished" and result.step == 6
  rows = grpo_helpers.read_jsonl(tmp_path / "whole" / "rollouts.jsonl")
  assert rows == grpo_helpers.read_jsonl(tmp_path / "resumed" / "rollouts.jsonl")
  assert grpo_helpers.losses(tmp_path / "whole") == grpo_helpers.losses(tmp_path / "resumed")
  assert len(rows) == 3 * 32 and {r["step"] for r in rows} == {1, 3, 5}  # one batch of completions per 2 steps
  assert all(set(r) == ROLLOUT_KEYS for r in rows)
  first = [r for r in rows if r["step"] == 1]
  assert all(r["prompt"].endswith("=") and r["length"] == len(r["completion_ids"]) == 2 for r in first)
  reward = [r["rewards"]["accuracy"] + r["rewards"]["format"] for r in first]
  np.testing.assert_allclose([r["reward"] for r in first], reward)
  np.testing.assert_allclose(
    [r["advantage"] for r in first], grpo_helpers.trl_advantages(reward, 4, "group"), atol=1e-9
  )
  metrics = grpo_helpers.read_jsonl(tmp_path / "whole" / "metrics.jsonl")
  logged = {k for r in metrics for k in r}
  for key in (
    "rollout/reward/mean",
    "rollout/reward/std",
    "rollout/rewards/accuracy/mean",
    "rollout/rewards/format/std",
    "rollout/completions/mean_length",
    "rollout/completions/min_length",
    "rollout/completions/max_length",
    "rollout/frac_reward_zero_std",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "kl",
    "entropy",
    "sampler_gap/mean",
  ):
    assert key in logged, key
  assert max(r["sampler_gap/max"] for r in metrics if "sampler_gap/max" in r) < 1e-4
  goodput = json.loads((tmp_path / "whole" / "goodput.json").read_text())
  assert goodput["runs"][-1]["seconds"]["generation"] > 0


def test_lora_samples_with_its_adapters_and_its_reference_is_them_off(tmp_path):
  """With LoRA the state holds no reference copy (beta > 0: the reference is the adapters off); the sampler reads
  the adapters as they train: its log-probabilities stay the trainer's after the adapters have moved."""
  from distrib_train.common.naming import path_str
  from distrib_train.config import job as job_lib

  import jax

  config = _config("model.lora.rank=4", "optimizer.learning_rate=0.01", steps=3)
  state = job_lib.job_spec(config).abstract_state
  names = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.model_without_params)]
  assert names and not any("reference" in n or "policy" in n for n in names)
  assert all("lora" in path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params))
  assert _train(config, tmp_path / "run").status == "finished"
  metrics = grpo_helpers.read_jsonl(tmp_path / "run" / "metrics.jsonl")
  assert [r["step"] for r in metrics if "kl" in r] == [1, 2, 3]
  assert max(r["kl"] for r in metrics if "kl" in r) > 0  # the adapters moved away from the reference
  assert max(r["sampler_gap/max"] for r in metrics if "sampler_gap/max" in r) < 1e-4


def test_a_failing_reward_function_stops_the_run_in_one_line(tmp_path):
  """A reward function that raises stops ``distrib-train`` with one line naming it and the prompt's index; no
  checkpoint is written past the last good step."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
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
      "--set",
      "grpo.reward_funcs=accuracy,grpo_helpers:fails_on_seven",
      "--set",
      "train.checkpoint_every=1",
      "--set",
      "train.steps=20",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert proc.returncode == 1, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if "error" in line]
  assert len(errors) == 1 and "reward function 'grpo_helpers:fails_on_seven' failed on prompt" in errors[0], (
    proc.stderr[-2000:]
  )
  index = int(errors[0].split("failed on prompt ")[1].split(":")[0])
  assert json.loads(_arithmetic_record(index))["prompt"].startswith("7+")
  steps = [int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()]
  failed = max(steps) + 1 if steps else 1
  preset = config_lib.load("grpo-tiny")
  per_step = preset.data.global_batch_size // preset.grpo.num_generations
  # the prompt named is one of the failing step's: the first step after the last one saved
  assert index in rollouts.prompt_order(100, per_step, preset.data.seed, failed - 1)


def _arithmetic_record(index):
  from distrib_train.data.sources import arithmetic_records

  return arithmetic_records()[index]


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["data.global_batch_size=30"], "not a multiple of grpo.num_generations"),
    (["grpo.reward_funcs="], "grpo.reward_funcs is empty"),
    (["grpo.reward_funcs=no_such_function"], "unknown reward function 'no_such_function'"),
    (["grpo.reward_funcs=no_such_module:f"], "no module named 'no_such_module'"),
    (["train.eval_every=10"], "train.eval_every"),
    (["data.seq_len=2"], "data.seq_len=2 holds no prompt"),
    (["data.source=pydoc"], "data.source=pydoc: train.objective=grpo reads prompt records"),
    (["model.lora.rank=4", "model.lora.dropout=0.1"], "model.lora.dropout"),
  ],
)
def test_a_run_that_cannot_work_is_refused_in_one_line(overrides, message):
  config = config_lib.load("grpo-tiny", overrides)
  with pytest.raises(ValueError, match=message) as e:
    rollouts.check(config)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["grpo.loss_type=ppo"], "grpo.loss_type='ppo'; choose grpo, dr_grpo, dapo, bnpo"),
    (["grpo.importance_sampling_level=sample"], "grpo.importance_sampling_level"),
    (["grpo.scale_rewards=true"], "grpo.scale_rewards"),
    (["grpo.num_generations=1"], "grpo.num_generations must be at least 2"),
    (["grpo.reward_weights=1,2,3"], "3 weights for 2"),
    (["grpo.reference=hf:/nowhere", "grpo.beta=0"], "is read with grpo.beta > 0"),
    (["grpo.reference=hf:/nowhere"], "grpo.reference hf:/nowhere: .*is not a directory"),
    (["train.objective=lm"], "The grpo section is read with train.objective: grpo"),
  ],
)
def test_bad_grpo_settings_are_refused_by_the_config(overrides, message):
  with pytest.raises(ConfigError, match=message):
    config_lib.load("grpo-tiny", overrides)


def test_prompt_records_come_from_any_corpus_format_with_every_column(tmp_path):
  """Parquet rows and JSONL lines alike: each record whole (its other columns for the reward functions); a line
  without ``prompt`` is named."""
  pq = pytest.importorskip("pyarrow.parquet")
  import pyarrow as pa

  rows = [{"prompt": f"{i}+1=", "solution": str(i + 1), "level": i % 3} for i in range(5)]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "prompts.parquet")
  config = config_lib.load("grpo-tiny", ["data.source=text", f"data.paths={tmp_path / 'prompts.parquet'}"])
  documents = rollouts.prompt_records(config)
  assert [json.loads(documents[i]) for i in range(len(documents))] == rows
  (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "1+1="}) + "\n")
  config = config_lib.load(
    "grpo-tiny", ["data.source=text", f"data.paths={tmp_path / 'bad.jsonl'}", "data.bad_records=error"]
  )
  with pytest.raises(ValueError, match="bad.jsonl.* line 1 is not a prompt record"):
    rollouts.prompt_records(config)
