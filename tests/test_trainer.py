"""The training loop through its API: the non-finite guard in each mode."""

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from distrib_train import config as config_lib
from distrib_train.data.pipeline import DataLoader
from distrib_train.trainer import Trainer, example_inputs

BAD_STEP = 5


@pytest.fixture(autouse=True)
def _cache(xla_cache):
  global CACHE
  CACHE = xla_cache


def small_config(*overrides):
  return config_lib.load("tiny", [
      "data.seq_len=32", "data.global_batch_size=8", "train.steps=8", "train.log_every=1",
      "train.eval_every=0", "train.eval_batches=1", "train.checkpoint_every=0", "train.async_checkpoint=false",
      f"train.compilation_cache_dir={CACHE}", "optimizer.warmup_steps=0", *overrides])


def fingerprint(tokens):
  flat = tokens.reshape(-1).astype(jnp.int32)
  return jnp.sum(flat * (jnp.arange(flat.size, dtype=jnp.int32) % 9973 + 1))


def poisoned_loss(config, bad_step=BAD_STEP):
  """The tiny Llama's loss, NaN (with NaN gradients) on the ``bad_step``-th
  training batch the pipeline yields — a stand-in for a bad batch."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  shardings = {k: NamedSharding(mesh, P("data", None)) for k in example_inputs(config)}
  loader = DataLoader(config.data_config(), shardings)
  prints = [int(fingerprint(jnp.asarray(loader.next_local()["tokens"]))) for _ in range(3 * config.train.steps)]
  loader.close()
  target = prints[bad_step - 1]
  assert prints.count(target) == 1  # only that batch is poisoned
  recipe = config.model_recipe()

  def loss_fn(*, model, state, rng, tokens, **inputs):
    loss, state, aux = recipe.loss_fn(model=model, state=state, rng=rng, tokens=tokens, **inputs)
    loss = loss * jnp.where(fingerprint(tokens) == target, jnp.nan, 1.0)
    return loss, state, {**aux, "loss": loss}

  return loss_fn


def run(config, workdir, loss_fn=None):
  console = io.StringIO()
  result = Trainer(config, workdir, loss_fn=loss_fn, console=console).run()
  return result, console.getvalue()


def read_metrics(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_skip_drops_the_update_and_counts_it(tmp_path):
  config = small_config("train.nonfinite=skip")
  result, console = run(config, tmp_path, poisoned_loss(config))
  assert result.status == "finished" and result.step == 8
  assert sorted(result.losses) == [s for s in range(1, 9) if s != BAD_STEP]
  assert all(np.isfinite(v) for v in result.losses.values())
  assert f"non-finite loss at step {BAD_STEP}" in console and "update skipped" in console
  skipped = {m["step"]: m["skipped"] for m in read_metrics(tmp_path) if "skipped" in m}
  assert skipped[BAD_STEP - 1] == 0 and skipped[8] == 1
  assert (tmp_path / "checkpoints" / "8").is_dir()


def test_skip_halts_after_too_many_in_a_row(tmp_path):
  config = small_config("train.nonfinite=skip", "train.max_nonfinite=2", "optimizer.learning_rate=1e30")
  result, console = run(config, tmp_path)
  assert result.status == "halted" and "2 steps in a row skipped" in result.message


def test_halt_stops_without_a_checkpoint(tmp_path):
  config = small_config("train.nonfinite=halt", "train.checkpoint_every=2")
  result, console = run(config, tmp_path, poisoned_loss(config))
  assert result.status == "halted"
  assert f"non-finite loss at step {BAD_STEP}" in result.message and "without a checkpoint" in result.message
  steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [2, 4]  # nothing after the bad step was saved
  assert max(result.losses) < BAD_STEP


def test_rollback_restores_the_last_checkpoint_and_moves_past_the_batch(tmp_path):
  config = small_config("train.nonfinite=rollback", "train.checkpoint_every=2")
  result, console = run(config, tmp_path, poisoned_loss(config))
  assert result.status == "finished" and result.step == 8
  assert f"at step {BAD_STEP}: rolled back to step 4" in console
  assert sorted(result.losses) == list(range(1, 9))  # steps 5… were trained again, on later batches
  assert all(np.isfinite(v) for v in result.losses.values())
  assert (tmp_path / "checkpoints" / "8").is_dir()


def test_rollback_without_a_checkpoint_halts(tmp_path):
  config = small_config("train.nonfinite=rollback")
  result, console = run(config, tmp_path, poisoned_loss(config))
  assert result.status == "halted" and "no checkpoint to roll back to" in result.message
