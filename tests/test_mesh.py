"""MeshConfig and build_mesh: sizes, auto-fill, YAML files, errors."""

import pathlib

import jax
import pytest

import distrib_train as dt

CONFIGS = pathlib.Path(__file__).parents[1] / "mesh_configs"


def test_build_mesh_gives_auto_axes_in_config_order():
  mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (2, 2, 2)))
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_minus_one_fills_the_remaining_devices():
  mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp"), (2, -1)))
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4}


def test_build_mesh_on_a_subset_of_devices():
  mesh = dt.build_mesh(dt.MeshConfig(("data",), (-1,)), devices=jax.devices()[:1])
  assert mesh.size == 1


def test_resolve_fills_ici_and_dcn_separately():
  config = dt.MeshConfig(("data", "fsdp", "tensor"), (1, -1, 4), (-1, 1, 1))
  assert config.resolve(1024, num_granules=2) == ((1, 128, 4), (2, 1, 1))


def test_sizes_that_do_not_match_the_devices_name_the_numbers():
  config = dt.MeshConfig(("data", "fsdp"), (2, 2), source="my.yaml")
  with pytest.raises(ValueError, match=r"my.yaml: ici sizes data=2 × fsdp=2 = 4 do not match the 8 devices found"):
    dt.build_mesh(config)


def test_auto_fill_that_cannot_divide_names_the_numbers():
  with pytest.raises(ValueError, match=r"data=3 × fsdp=-1 must divide 8"):
    dt.build_mesh(dt.MeshConfig(("data", "fsdp"), (3, -1)))


def test_dcn_axes_need_as_many_granules_as_they_say():
  config = dt.MeshConfig(("data", "fsdp"), (1, 4), (2, 1))
  with pytest.raises(ValueError, match=r"dcn sizes data=2 × fsdp=1 = 2 do not match the 1 granules"):
    dt.build_mesh(config)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(axis_names=("a", "b"), ici=(-1, -1)), r"ici sizes of axes 'a', 'b' are all -1"),
    (dict(axis_names=("a", "b"), ici=(1, 1), dcn=(-1, -1)), r"dcn sizes of axes 'a', 'b' are all -1"),
    (dict(axis_names=("a",), ici=(0,)), r"ici size of axis 'a' is 0"),
    (dict(axis_names=("a",), ici=(-4,)), r"ici size of axis 'a' is -4"),
    (dict(axis_names=("a",), ici=(2.0,)), r"must be an integer"),
    (dict(axis_names=("a", "b"), ici=(2,)), r"2 axes .* but 1 ici sizes"),
    (dict(axis_names=("a", "a"), ici=(2, 2)), r"repeat a name"),
    (dict(axis_names=("a",), ici=(2,), rules=[("embed", "fsdpp")]), r"names mesh axis 'fsdpp'"),
  ],
)
def test_bad_mesh_configs_are_rejected(kwargs, message):
  with pytest.raises(ValueError, match=message):
    dt.MeshConfig(**kwargs)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_mesh_configs_load_and_fit_their_declared_job(path):
  import yaml

  config = dt.MeshConfig.from_yaml(path)
  declared = yaml.safe_load(path.read_text())
  ici, dcn = config.resolve(declared["devices"], declared.get("granules", 1))
  assert all(s > 0 for s in ici + dcn)
  assert config.rules is not None
  assert path.read_text().startswith("#"), "each file starts with a comment saying when to pick it"


def test_cpu8_config_builds_on_the_emulated_devices():
  mesh = dt.build_mesh(dt.MeshConfig.from_yaml(CONFIGS / "cpu-8.yaml"))
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}


def _write(tmp_path, text):
  path = tmp_path / "mesh.yaml"
  path.write_text(text)
  return path


@pytest.mark.parametrize(
  "text, message",
  [
    ("axes: {data: 2}\nrulez: fsdp_tensor\n", r"mesh.yaml: unknown key\(s\) 'rulez'"),
    ("axes: {data: {icy: 2}}\n", r"axis 'data' has unknown key\(s\) 'icy'"),
    ("axes: []\n", r"'axes' must map"),
    ("- 1\n", r"expected a mapping"),
    ("axes: {data: 2}\nrules: [[embed, fsdpp]]\n", r"names mesh axis 'fsdpp'.*mesh.yaml"),
    ("axes: {data: 2, fsdp: 2}\ndevices: 8\n", r"ici sizes data=2 × fsdp=2 = 4 do not match the 8"),
    ("axes: {data: 2}\ndevices: eight\n", r"'devices' must be a positive integer"),
    ("axes: {data: 2\n", r"not valid YAML"),
  ],
)
def test_bad_yaml_files_are_rejected_naming_the_file(tmp_path, text, message):
  with pytest.raises(ValueError, match=message):
    dt.MeshConfig.from_yaml(_write(tmp_path, text))


def test_missing_yaml_file_is_named(tmp_path):
  with pytest.raises(ValueError, match=r"Cannot read mesh config '.*nope.yaml'"):
    dt.MeshConfig.from_yaml(tmp_path / "nope.yaml")


def test_yaml_never_evaluates_code(tmp_path):
  text = "axes: !!python/object/apply:os.system ['echo pwned']\n"
  with pytest.raises(ValueError, match="not valid YAML"):
    dt.MeshConfig.from_yaml(_write(tmp_path, text))


def test_as_auto_mesh_converts_explicit_axes():
  explicit = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  auto = dt.as_auto_mesh(explicit)
  assert all(t == jax.sharding.AxisType.Auto for t in auto.axis_types)
  assert (auto.devices == explicit.devices).all() and auto.axis_names == explicit.axis_names


@pytest.mark.parametrize(
  "text, message",
  [
    ("axes: {data: 2}\nrules: fsdp_tensr\n", r"mesh.yaml: Unknown axis rule set 'fsdp_tensr'"),
    ("axes: {data: 2}\nparam_axes: [[w, [embed]]]\n", r"mesh.yaml: 'param_axes' needs 'rules'"),
    ("axes: {data: 2}\ngranules: 2\n", r"mesh.yaml: 'granules' is checked against 'devices'"),
  ],
)
def test_more_bad_yaml_files_are_rejected_naming_the_file(tmp_path, text, message):
  with pytest.raises(ValueError, match=message):
    dt.MeshConfig.from_yaml(_write(tmp_path, text))


def test_sizes_that_are_not_a_sequence_are_a_value_error():
  with pytest.raises(ValueError, match=r"ici must be a sequence of sizes"):
    dt.MeshConfig(("a",), 8)


def test_a_config_declaring_its_device_count_refuses_another(tmp_path):
  path = tmp_path / "pod.yaml"
  path.write_text("devices: 16\naxes: {data: 1, fsdp: -1}\n")
  config = dt.MeshConfig.from_yaml(path)
  with pytest.raises(ValueError, match=r"pod.yaml is for 16 devices; this job has 8 \(1 process\(es\), cpu\)"):
    dt.build_mesh(config)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_to_yaml_loads_back_as_the_same_config(tmp_path, path):
  config = dt.MeshConfig.from_yaml(path)
  written = tmp_path / path.name
  written.write_text(config.to_yaml(["a header line"]))
  loaded = dt.MeshConfig.from_yaml(written)
  assert written.read_text().startswith("# a header line\n")
  assert (loaded.axis_names, loaded.ici, loaded.dcn, loaded.devices) == (
    config.axis_names,
    config.ici,
    config.dcn,
    config.devices,
  )
  assert (loaded.rules is None) == (config.rules is None)
  if config.rules is not None:
    assert loaded.rules.rules == config.rules.rules
    assert [(r.pattern, a) for r, a in loaded.rules.param_axes] == [(r.pattern, a) for r, a in config.rules.param_axes]


def test_a_data_by_fsdp_mesh_config_trains_the_tiny_llama_with_tensor_as_size_1(tmp_path, xla_cache):
  # The fsdp_tensor rules name tensor, stage, expert and context; a mesh config may leave any of them out.
  import io
  import re

  from distrib_train.config import run as config_lib
  from distrib_train.train.trainer import Trainer

  mesh_file = tmp_path / "data-fsdp.yaml"
  mesh_file.write_text("devices: 8\naxes: {data: 2, fsdp: 4}\nrules: fsdp_tensor\n")
  config = config_lib.load(
    "tiny",
    [
      "data.seq_len=32",
      "data.global_batch_size=8",
      "train.steps=2",
      "train.log_every=1",
      "train.eval_every=0",
      "train.checkpoint_every=0",
      "train.async_checkpoint=false",
      f"train.compilation_cache_dir={xla_cache}",
      "optimizer.warmup_steps=0",
      f"mesh_config={mesh_file}",
    ],
  )
  console = io.StringIO()
  result = Trainer(config, tmp_path / "run", console=console).run()
  assert result.status == "finished" and sorted(result.losses) == [1, 2], console.getvalue()[-3000:]
  assert "mesh data=2 × fsdp=4;" in console.getvalue()
  plan = (tmp_path / "run" / "plan.txt").read_text()
  # ("heads", "tensor") and ("mlp", "tensor"): whole, as on a tensor axis of size 1; embed still on fsdp.
  assert re.search(r"params +layers/wq .* P\(None, 'fsdp', None, None\)", plan)
  assert re.search(r"params +layers/w_gate .* P\(None, 'fsdp', None\)", plan)
  assert re.search(r"inputs +tokens .* P\(\('data', 'fsdp'\), None\)", plan)
