"""The run config: presets, YAML, typed --set overrides and their errors."""

import pytest

from distrib_train.config import run as config_lib
from distrib_train.train import metrics
from distrib_train.optim import chain as optimizers
from distrib_train.config.run import ConfigError


def test_presets_load_and_name_real_models_and_meshes():
  from distrib_train.sharding.mesh import MeshConfig, find_mesh_config

  names = config_lib.preset_names()
  for expected in (
    "tiny",
    "llama-124m-gpu",
    "llama-1b-gpu",
    "llama-7b-gpu",
    "llama-124m-tpu",
    "llama-1b-tpu",
    "llama-7b-tpu",
  ):
    assert expected in names
  for name in names:
    config = config_lib.load(name)
    MeshConfig.from_yaml(find_mesh_config(config.mesh_config))
    assert config.model_recipe().config.max_seq_len >= config.data.seq_len, name


def test_set_overrides_are_typed():
  config = config_lib.load(
    "tiny",
    [
      "train.steps=5",
      "optimizer.learning_rate=1e-3",
      "data.packing=false",
      "data.paths=a.txt,b.txt",
      "data.source=text",
      "model.remat=full",
      "model.scan_layers=no",
      "mesh_config=cpu-2proc",
      "train.compilation_cache_dir=",
    ],
  )
  assert config.train.steps == 5 and isinstance(config.train.steps, int)
  assert config.optimizer.learning_rate == 1e-3
  assert config.data.packing is False and config.data.paths == ("a.txt", "b.txt")
  assert config.model.overrides == {"remat": "full", "scan_layers": False}
  assert config.model_recipe().config.remat == "full"
  assert config.mesh_config == "cpu-2proc" and config.train.compilation_cache_dir == ""
  # The preset's other values stay.
  assert config.data.global_batch_size == config_lib.load("tiny").data.global_batch_size


def test_round_trip_through_yaml(tmp_path):
  config = config_lib.load("tiny", ["model.remat=full", "data.paths=x.txt"])
  path = tmp_path / "c.yaml"
  path.write_text(config.to_yaml())
  assert config_lib.load(str(path)) == config


@pytest.mark.parametrize(
  "override, message",
  [
    ("train.step=5", "did you mean train.steps"),
    ("optimizer.lr=1", "optimizer.learning_rate"),
    ("model.d_modle=8", "model.d_model"),
    ("nonsense=1", "valid keys"),
    ("train.steps=abc", "train.steps must be an integer, got 'abc'"),
    ("train.steps=2.5", "train.steps must be an integer"),
    ("data.packing=maybe", "data.packing must be true or false"),
    ("optimizer.learning_rate=fast", "optimizer.learning_rate must be a number"),
    ("model.num_layers=two", "model.num_layers must be an integer"),
    ("train.nonfinite=ignore", "train.nonfinite must be one of skip, halt, rollback"),
    ("train.steps=0", "train.steps must be at least 1"),
    ("optimizer.schedule=exp", "optimizer.schedule must be constant, cosine, linear or wsd"),
    ("data.source=web", "unknown source 'web'"),
    ("model.vocab_size=100", "vocab_size 100 is below 256"),
    ("model.preset=huge", "Unknown preset 'huge'"),
    ("steps", "expected key=value"),
  ],
)
def test_bad_overrides_name_the_key(override, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    config_lib.load("tiny", [override])


def test_bad_files(tmp_path):
  with pytest.raises(ConfigError, match="No config preset 'tinny'; presets: .*tiny"):
    config_lib.load("tinny")
  with pytest.raises(ConfigError, match="does not exist"):
    config_lib.load(str(tmp_path / "missing.yaml"))
  bad = tmp_path / "bad.yaml"
  bad.write_text("train: [1, 2\n")
  with pytest.raises(ConfigError, match="not valid YAML"):
    config_lib.load(str(bad))
  bad.write_text("train:\n  stpes: 3\n")
  with pytest.raises(ConfigError, match=r"Unknown config key 'train.stpes' \(config '.*bad.yaml'\); did you mean"):
    config_lib.load(str(bad))
  bad.write_text("train: 3\n")
  with pytest.raises(ConfigError, match="section 'train' must be a mapping"):
    config_lib.load(str(bad))


def test_schedule_warmup_then_cosine_to_the_floor():
  config = config_lib.load(
    "tiny",
    ["optimizer.warmup_steps=10", "optimizer.learning_rate=1.0", "optimizer.min_lr_ratio=0.1", "train.steps=110"],
  )
  lr = optimizers.schedule(config.optimizer, config.train.steps)
  assert float(lr(0)) == 0.0
  assert float(lr(5)) == pytest.approx(0.5)
  assert float(lr(10)) == pytest.approx(1.0)
  assert float(lr(110)) == pytest.approx(0.1)
  assert float(lr(60)) == pytest.approx(0.55, abs=1e-6)  # half way down the cosine


def test_optimizer_state_exposes_grad_norm_lr_and_skips():
  import jax.numpy as jnp

  config = config_lib.load(
    "tiny", ["optimizer.learning_rate=0.5", "optimizer.schedule=constant", "optimizer.warmup_steps=0"]
  )
  opt = optimizers.build(config.optimizer, 10, "skip")
  params = {"w": jnp.ones(2)}
  state = opt.init(params)
  updates, state = opt.update({"w": jnp.array([3.0, 4.0])}, state, params)
  m = optimizers.metrics_of(state)
  assert float(m["grad_norm"]) == pytest.approx(5.0) and float(m["learning_rate"]) == 0.5
  assert int(m["skipped"]) == 0
  updates, state = opt.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
  assert int(optimizers.metrics_of(state)["skipped"]) == 1
  assert jnp.all(updates["w"] == 0)
  assert "skipped" not in optimizers.metrics_of(optimizers.build(config.optimizer, 10, "halt").init(params))


def test_peak_flops_table():
  class Device:
    def __init__(self, kind):
      self.device_kind = kind

  assert metrics.peak_flops(Device("NVIDIA H100 80GB HBM3")) == 989e12
  assert metrics.peak_flops(Device("NVIDIA H100 PCIe")) == 756e12
  assert metrics.peak_flops(Device("NVIDIA A100-SXM4-80GB")) == 312e12
  assert metrics.peak_flops(Device("NVIDIA H200")) == 989e12
  assert metrics.peak_flops(Device("TPU v4")) == 275e12
  assert metrics.peak_flops(Device("TPU v5 lite")) == 197e12
  assert metrics.peak_flops(Device("TPU v5p")) == 459e12
  assert metrics.peak_flops(Device("TPU v6 lite")) == 918e12
  assert metrics.peak_flops(Device("cpu")) is None
  assert metrics.peak_flops(Device("cpu"), configured_tflops=2.0) == 2e12


def _hf_config_json(directory, **fields):
  import json

  directory.mkdir()
  (directory / "config.json").write_text(
    json.dumps(
      {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        **fields,
      }
    )
  )
  return directory


def test_an_hf_init_from_gives_the_model_the_checkpoints_shape_from_its_config_json(tmp_path):
  directory = _hf_config_json(tmp_path / "hf")
  config = config_lib.load("tiny", [f"train.init_from=hf:{directory}", "model.dtype=float32"])
  model = config.model_recipe().config
  assert (model.d_model, model.mlp_dim, model.num_layers, model.num_kv_heads, model.head_dim) == (64, 96, 2, 2, 16)
  assert model.dtype == "float32"  # what is not shape stays the run's
  with pytest.raises(ConfigError, match=r"model.d_model=128 \(the checkpoint has 64\); leave the model's shape"):
    config_lib.load("tiny", [f"train.init_from=hf:{directory}", "model.d_model=128"])


def test_the_checkpoint_picks_the_dense_or_mixture_recipe_from_any_preset(tmp_path):
  from distrib_train.recipes.moe import MoEConfig

  mixtral = _hf_config_json(
    tmp_path / "mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=2
  )
  for preset in ("tiny", "moe-tiny"):
    model = config_lib.load(preset, [f"train.init_from=hf:{mixtral}"]).model_recipe().config
    assert isinstance(model, MoEConfig) and model.hf_model_type == "mixtral"
    assert (model.num_experts, model.experts_per_token, model.expert_mlp_dim, model.d_model) == (4, 2, 96, 64)
    assert model.dtype == "float32"  # the preset's numerics stay the run's
  model = (
    config_lib.load(
      "moe-tiny", [f"train.init_from=hf:{mixtral}", "model.z_loss_weight=0.01", "model.aux_loss_weight=0.05"]
    )
    .model_recipe()
    .config
  )
  assert (model.z_loss_weight, model.aux_loss_weight) == (0.01, 0.05)  # the run's own loss weights stay
  llama = _hf_config_json(tmp_path / "llama")
  model = config_lib.load("moe-tiny", [f"train.init_from=hf:{llama}"]).model_recipe().config
  assert not isinstance(model, MoEConfig) and model.hf_model_type == "llama" and model.d_model == 64


def test_reading_the_config_does_not_import_the_checkpoint_package():
  # A checkpoint's model shape is read in recipes/hf_shape.py, a layer below checkpoint/.
  import ast
  import pathlib

  from distrib_train.config import values as config_values

  imported = set()
  for module in (config_lib, config_values):
    for node in ast.walk(ast.parse(pathlib.Path(module.__file__).read_text())):
      if isinstance(node, ast.ImportFrom):
        imported |= {node.module or ""} | {f"{node.module}.{alias.name}" for alias in node.names}
      elif isinstance(node, ast.Import):
        imported |= {alias.name for alias in node.names}
  assert not {name for name in imported if name.startswith("distrib_train.checkpoint")}
