"""``--init_from ckpt:<dir>``: a new run starts from another run's params with a fresh optimizer."""

import json

import numpy as np
import pytest

from distrib_train.training import config as config_lib
from distrib_train.training.checks import TrainerSetupError
from distrib_train.training.trainer import Trainer


def _config(cache, *overrides):
  return config_lib.load("tiny", [
      "data.seq_len=32", "data.global_batch_size=8", "train.eval_batches=2", "train.async_checkpoint=false",
      f"train.compilation_cache_dir={cache}", *overrides])


def test_a_run_starts_from_another_runs_params_with_a_fresh_optimizer(tmp_path, xla_cache):
  first = Trainer(_config(xla_cache, "train.steps=3"), tmp_path / "a", console=False).run()
  # lr 1e-30 with sgd: the one step leaves the params as loaded, so the eval matches the first run's last one.
  for where in (tmp_path / "a", tmp_path / "a" / "checkpoints", tmp_path / "a" / "checkpoints" / "3"):
    second = Trainer(_config(xla_cache, "train.steps=1", "optimizer.name=sgd", "optimizer.learning_rate=1e-30",
                             f"train.init_from=ckpt:{where}"), tmp_path / f"b{len(where.parts)}", console=False).run()
    np.testing.assert_allclose(second.eval_loss, first.eval_loss, rtol=1e-6)
    assert second.step == 1  # a new run: its own step count
  log = [json.loads(line) for line in (tmp_path / f"b{len(where.parts)}" / "metrics.jsonl").read_text().splitlines()]
  assert log  # metrics of the new run


def test_init_from_a_checkpoint_of_another_model_is_refused_before_the_workdir_exists(tmp_path, xla_cache):
  Trainer(_config(xla_cache, "train.steps=1"), tmp_path / "a", console=False).run()
  with pytest.raises(TrainerSetupError, match=r"does not fit the target state"):
    Trainer(_config(xla_cache, "train.steps=1", "model.d_model=32", f"train.init_from=ckpt:{tmp_path / 'a'}"),
            tmp_path / "b", console=False).run()
  assert not (tmp_path / "b").exists()
  with pytest.raises(config_lib.ConfigError, match=r"train.init_from must be hf:<Hugging Face dir> or ckpt:"):
    _config(xla_cache, "train.init_from=gs://bucket/run")
