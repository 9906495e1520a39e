"""The training loop through its API: the non-finite guard in each mode."""

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from distrib_train.config import run as config_lib
from distrib_train.data.pipeline import DataLoader
from distrib_train.train.trainer import Trainer

BAD_STEP = 5


@pytest.fixture(autouse=True)
def _cache(xla_cache):
  global CACHE
  CACHE = xla_cache


def small_config(*overrides):
  return config_lib.load(
    "tiny",
    [
      "data.seq_len=32",
      "data.global_batch_size=8",
      "train.steps=8",
      "train.log_every=1",
      "train.eval_every=0",
      "train.eval_batches=1",
      "train.checkpoint_every=0",
      "train.async_checkpoint=false",
      f"train.compilation_cache_dir={CACHE}",
      "optimizer.warmup_steps=0",
      *overrides,
    ],
  )


def fingerprint(tokens):
  flat = tokens.reshape(-1).astype(jnp.int32)
  return jnp.sum(flat * (jnp.arange(flat.size, dtype=jnp.int32) % 9973 + 1))


def poisoned_loss(config, bad_step=BAD_STEP):
  """The tiny Llama's loss, NaN (with NaN gradients) on the ``bad_step``-th
  training batch the pipeline yields — a stand-in for a bad batch."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  shardings = {k: NamedSharding(mesh, P("data", None)) for k in DataLoader.batch_schema(config.data_config())}
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
  """A LoRA run on a Hugging Face base: its checkpoints hold the adapters, and the rollback keeps the base."""
  from flax import nnx

  from distrib_train.checkpoint import checks, hf

  model = small_config().model_recipe().config
  hf.save(nnx.state(model.build(1), nnx.Param), model, str(tmp_path / "base"))
  config = small_config(
    "train.nonfinite=rollback",
    "train.checkpoint_every=2",
    "model.lora.rank=4",
    f"train.init_from=hf:{tmp_path / 'base'}",
  )
  result, console = run(config, tmp_path / "run", poisoned_loss(config))
  assert result.status == "finished" and result.step == 8
  assert f"at step {BAD_STEP}: rolled back to step 4" in console
  assert sorted(result.losses) == list(range(1, 9))  # steps 5… were trained again, on later batches
  assert all(np.isfinite(v) for v in result.losses.values())
  assert (tmp_path / "run" / "checkpoints" / "8").is_dir()
  assert "model_without_params" not in checks.held_fields(checks.read_meta(tmp_path / "run" / "checkpoints", 8))


def test_rollback_without_a_checkpoint_halts(tmp_path):
  config = small_config("train.nonfinite=rollback")
  result, console = run(config, tmp_path, poisoned_loss(config))
  assert result.status == "halted" and "no checkpoint to roll back to" in result.message


def _with_tokenizer(config, tokenizer):
  import dataclasses

  return dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer=tokenizer))


def _too_large_ids(text):
  return [300 + len(text) % 7] + [1] * (len(text) - 1)


def test_token_ids_beyond_the_vocabulary_are_refused_before_the_workdir_is_made(tmp_path):
  from distrib_train.train.trainer import TrainerSetupError

  config = _with_tokenizer(small_config(), _too_large_ids)
  with pytest.raises(
    TrainerSetupError,
    match=r"train data holds token id 30\d \(document \d+\), outside the"
    r" model's vocabulary of 256 ids \(0 to 255\)",
  ):
    run(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_the_first_batch_is_checked_against_the_vocabulary(tmp_path, monkeypatch):
  """Ids the pipeline's sample of documents missed are caught before the
  first step, naming the largest id and the vocabulary size."""
  from distrib_train.data import splits
  from distrib_train.train.trainer import TrainerSetupError

  monkeypatch.setattr(splits, "_check_token_ids", lambda *args: None)
  config = _with_tokenizer(small_config(), _too_large_ids)
  with pytest.raises(
    TrainerSetupError,
    match=r"first batch's tokens hold token id 30\d, outside the model's"
    r" vocabulary of 256 ids",
  ):
    run(config, tmp_path)
  assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_a_run_whose_every_step_is_non_finite_halts_rather_than_finishing(tmp_path):
  recipe = small_config().model_recipe()

  def nan_loss(**kwargs):
    loss, state, aux = recipe.loss_fn(**kwargs)
    return loss * jnp.nan, state, {**aux, "loss": loss * jnp.nan}

  config = small_config("train.steps=3", "train.nonfinite=skip", "train.max_nonfinite=10")
  result, console = run(config, tmp_path, nan_loss)
  assert result.status == "halted" and "every one of the 3 step(s)" in result.message
  assert not (tmp_path / "checkpoints" / "3").exists()


def test_scalars_in_aux_reach_the_console_the_jsonl_and_tensorboard_for_train_and_eval(tmp_path):
  recipe = small_config().model_recipe()

  def loss_with_extras(**kwargs):
    loss, state, aux = recipe.loss_fn(**kwargs)
    return loss, state, {**aux, "accuracy": jnp.float32(0.25), "perplexity": jnp.exp(loss), "per_row": jnp.zeros(4)}

  # A corpus with malformed lines: the loader's count of those it skipped is a scalar of the records too.
  corpus = tmp_path / "half_broken.jsonl"
  corpus.write_text(
    "".join(
      (json.dumps({"text": f"document {i} " + "words " * 12}) if i % 2 == 0 else "{broken") + "\n" for i in range(64)
    )
  )
  config = small_config(
    "train.steps=4",
    "train.log_every=2",
    "train.eval_every=4",
    "train.eval_batches=1",
    "data.source=text",
    f"data.paths={corpus}",
  )
  result, console = run(config, tmp_path, loss_with_extras)
  assert result.status == "finished"
  records = read_metrics(tmp_path)
  train = [r for r in records if "tokens_per_s" in r]
  assert 0 < train[0]["data/skipped_documents"] <= train[1]["data/skipped_documents"] <= 64
  assert "data/skipped_documents" in console
  evals = [r for r in records if "eval/loss" in r]
  assert [r["step"] for r in train] == [2, 4] and all(r["accuracy"] == 0.25 for r in train)
  expected = float(np.mean([np.exp(result.losses[3]), np.exp(result.losses[4])]))
  assert train[1]["perplexity"] == pytest.approx(expected, rel=1e-4)  # the window's mean, like the loss
  assert evals[0]["eval/accuracy"] == pytest.approx(0.25)
  assert evals[0]["eval/perplexity"] == pytest.approx(np.exp(evals[0]["eval/loss"]), rel=0.05)
  assert "per_row" not in json.dumps(records)  # only scalars
  assert "accuracy 0.25" in console and "eval/accuracy 0.25" in console
  events = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").rglob("*") if p.is_file())
  assert b"accuracy" in events and b"eval/perplexity" in events
