"""The warmup-stable-decay schedule (``optimizer.schedule: wsd``) and a finished run extended from its last
stable step."""

import io
import json
import math

import numpy as np
import pytest

from distrib_train.common.yaml_loader import ConfigError
from distrib_train.config import run as config_lib
from distrib_train.optim import chain as optimizers
from distrib_train.train.trainer import Trainer


def test_wsd_holds_the_peak_then_decays_linearly_or_as_one_minus_sqrt():
  for shape, fall in (("linear", lambda p: p), ("1-sqrt", lambda p: math.sqrt(p))):
    c = config_lib.load(
      "tiny",
      [
        "optimizer.schedule=wsd",
        "optimizer.learning_rate=1.0",
        "optimizer.warmup_steps=4",
        "optimizer.min_lr_ratio=0.1",
        "optimizer.decay_fraction=0.25",
        f"optimizer.decay_shape={shape}",
        "train.steps=40",
      ],
    )
    lr = optimizers.schedule(c.optimizer, 40)
    assert optimizers.wsd_decay_start(c.optimizer, 40) == 30
    np.testing.assert_allclose([float(lr(s)) for s in (0, 2, 4, 20, 30)], [0, 0.5, 1, 1, 1], atol=1e-7)
    for step in (31, 35, 38, 40, 45):
      progress = min(1.0, (step - 30) / 10)
      np.testing.assert_allclose(float(lr(step)), 1 - 0.9 * fall(progress), rtol=1e-6, err_msg=f"{shape} {step}")


@pytest.mark.parametrize(
  "setting,named",
  [
    ("optimizer.decay_fraction=0", "optimizer.decay_fraction"),
    ("optimizer.decay_shape=cosine", "optimizer.decay_shape"),
    ("optimizer.schedule=wsdd", "optimizer.schedule"),
    ("optimizer.muon.ns_steps=0", "optimizer.muon.ns_steps"),
    ("optimizer.muon.beta=1", "optimizer.muon.beta"),
  ],
)
def test_bad_schedule_and_muon_values_are_named(setting, named):
  with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
    config_lib.load("tiny", [setting])


def _run(workdir, steps, cache):
  config = config_lib.load(
    "tiny",
    [
      "data.seq_len=32",
      "data.global_batch_size=8",
      f"train.steps={steps}",
      "train.log_every=1",
      "train.checkpoint_every=0",
      "train.keep_checkpoints=1",
      "train.async_checkpoint=false",
      f"train.compilation_cache_dir={cache}",
      "optimizer.warmup_steps=2",
      "optimizer.schedule=wsd",
      "optimizer.decay_fraction=0.25",
      "optimizer.learning_rate=3e-3",
      "mesh_config=cpu-8",
    ],
  )
  console = io.StringIO()
  result = Trainer(config, workdir, console=console).run()
  metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return result, console.getvalue(), {m["step"]: m for m in metrics if "loss" in m}


def test_a_finished_run_extends_from_its_last_stable_step(tmp_path, xla_cache):
  short, extended = tmp_path / "short", tmp_path / "long"
  result, _, first = _run(short, 8, xla_cache)
  assert result.status == "finished"
  steps = sorted(int(p.name) for p in (short / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [6, 8]  # the last stable step kept beside the newest (keep_checkpoints=1)
  assert first[8]["learning_rate"] < first[7]["learning_rate"] == first[6]["learning_rate"]  # update 8 decays
  result, console, _ = _run(short, 8, xla_cache)  # the steps it had: no extension
  assert result.status == "already_done" and "Extending" not in console
  result, console, again = _run(short, 12, xla_cache)
  assert result.status == "finished" and "restoring its last stable step 6" in console
  assert (short / "checkpoints" / ".decayed-8" / "8").is_dir()
  assert sorted(int(p.name) for p in (short / "checkpoints").iterdir() if p.name.isdigit()) == [
    9,
    12,
  ]  # the new stable step
  _, _, straight = _run(extended, 12, xla_cache)  # planned for 12 steps from the start
  for step in (7, 8, 10, 12):
    np.testing.assert_allclose(again[step]["loss"], straight[step]["loss"], rtol=1e-6)
    np.testing.assert_allclose(again[step]["learning_rate"], straight[step]["learning_rate"], rtol=1e-6)
  assert again[8]["learning_rate"] == pytest.approx(3e-3)  # stable again where the short run decayed


def test_the_manager_keeps_the_stable_step_and_no_multiple_of_it(tmp_path):
  import jax
  import jax.numpy as jnp
  import optax

  import distrib_train as dt

  state = dt.TrainState.initial_state({"w": jnp.ones(4)}, optax.sgd(0.1), jax.random.key(0))
  with dt.CheckpointManager(tmp_path, max_to_keep=1, keep_steps=(2,), async_save=False) as checkpoints:
    for step in range(1, 6):
      checkpoints.save(step, state.replace(step=step))
    assert checkpoints.all_steps() == [2, 5]  # 4, a multiple of 2, leaves


def test_a_checkpoint_of_an_earlier_release_shows_no_change_for_the_keys_it_lacked():
  config = config_lib.load("tiny")
  old = config.to_dict()
  for key in ("decay_fraction", "decay_shape", "muon_ns_steps", "muon_adam_lr"):
    del old["optimizer"][key]
  assert config.changes_since({"config": old}) == []
  old["optimizer"]["learning_rate"] = 1.0
  assert config.changes_since({"config": old}) == ["optimizer.learning_rate: 1.0 → 0.003"]
