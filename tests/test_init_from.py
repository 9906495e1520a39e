"""``--init_from ckpt:<dir>``: a new run starts from another run's params with a fresh optimizer."""

import json

import numpy as np
import pytest

from distrib_train.config import run as config_lib
from distrib_train.train.checks import TrainerSetupError
from distrib_train.train.trainer import Trainer


def _config(cache, *overrides):
  return config_lib.load(
    "tiny",
    [
      "data.seq_len=32",
      "data.global_batch_size=8",
      "train.eval_batches=2",
      "train.async_checkpoint=false",
      f"train.compilation_cache_dir={cache}",
      *overrides,
    ],
  )


def test_a_run_starts_from_another_runs_params_with_a_fresh_optimizer(tmp_path, xla_cache):
  first = Trainer(_config(xla_cache, "train.steps=3"), tmp_path / "a", console=False).run()
  # lr 1e-30 with sgd: the one step leaves the params as loaded, so the eval matches the first run's last one.
  for where in (tmp_path / "a", tmp_path / "a" / "checkpoints", tmp_path / "a" / "checkpoints" / "3"):
    second = Trainer(
      _config(
        xla_cache,
        "train.steps=1",
        "optimizer.name=sgd",
        "optimizer.learning_rate=1e-30",
        f"train.init_from=ckpt:{where}",
      ),
      tmp_path / f"b{len(where.parts)}",
      console=False,
    ).run()
    np.testing.assert_allclose(second.eval_loss, first.eval_loss, rtol=1e-6)
    assert second.step == 1  # a new run: its own step count
  log = [json.loads(line) for line in (tmp_path / f"b{len(where.parts)}" / "metrics.jsonl").read_text().splitlines()]
  assert log  # metrics of the new run


def test_init_from_a_checkpoint_of_another_model_is_refused_before_the_workdir_exists(tmp_path, xla_cache):
  Trainer(_config(xla_cache, "train.steps=1"), tmp_path / "a", console=False).run()
  with pytest.raises(TrainerSetupError, match=r"does not fit the target state"):
    Trainer(
      _config(xla_cache, "train.steps=1", "model.d_model=32", f"train.init_from=ckpt:{tmp_path / 'a'}"),
      tmp_path / "b",
      console=False,
    ).run()
  assert not (tmp_path / "b").exists()
  with pytest.raises(config_lib.ConfigError, match=r"train.init_from must be hf:<Hugging Face dir> or ckpt:"):
    _config(xla_cache, "train.init_from=gs://bucket/run")


def test_a_checkpoints_fingerprint_sees_a_tensor_changed_and_not_a_copy(tmp_path):
  """``hf_common.fingerprint``, which names a LoRA base in its run's checkpoints: a copy elsewhere matches; the
  last bytes of one tensor changed (and nothing at the file's sampled slices) do not."""
  import json
  import shutil

  from flax import nnx

  from distrib_train.checkpoint import hf
  from distrib_train.checkpoint.hf_common import fingerprint

  model = config_lib.load("tiny", ["model.d_model=512", "model.mlp_dim=1536"]).model_recipe().config
  hf.save(nnx.state(model.build(0), nnx.Param), model, str(tmp_path / "a"))
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  assert fingerprint(str(tmp_path / "a")) == fingerprint(str(tmp_path / "b"))
  path = tmp_path / "b" / "model.safetensors"
  total = path.stat().st_size
  sampled = lambda at: any(total * i // 16 <= at < total * i // 16 + 65536 for i in range(16))
  with open(path, "r+b") as f:
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
    ends = [8 + size + v["data_offsets"][1] - 4 for k, v in header.items() if k != "__metadata__"]
    at = next(e for e in ends if not sampled(e) and not sampled(e + 3))
    f.seek(at)
    f.write(b"\x01\x02\x03\x04")
  assert fingerprint(str(tmp_path / "a")) != fingerprint(str(tmp_path / "b"))
