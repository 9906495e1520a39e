"""``distrib-train plan``: HLO collectives, memory prediction, the CLI and --recommend."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from distrib_train.config import run as config_lib
from distrib_train.podplan import collectives
from distrib_train.cluster import hardware
from distrib_train.podplan import hlo as hlo_module
from distrib_train.podplan import cli as plan_cli
from distrib_train.podplan import estimate as podplan
from distrib_train.sharding.mesh import MeshConfig, find_mesh_config
import xla_test_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
AXES = ("data", "fsdp", "tensor")

HLO = """HloModule jit_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_slice (param_0: f32[8,16], param_1: s32[]) -> f32[4,16] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[4,16]{1,0} dynamic-slice(%param_0, %param_1, %zero), dynamic_slice_sizes={4,16}
}

%body (p: (s32[], f32[4,16])) -> (s32[], f32[4,16]) {
  %p = (s32[], f32[4,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,16]{1,0} get-tuple-element(%p), index=1
  %ag = f32[8,16]{1,0} all-gather(%x), channel_id=1, replica_groups=[4,2]<=[8], dimensions={0}, use_global_device_ids=true
  %ar = f32[4,16]{1,0} all-reduce(%x), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %w = f32[16,8]{1,0} constant({...})
  %d = f32[4,8]{1,0} dot(%ar, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[4,16]{1,0}) tuple(%i, %ar)
}

%cond (q: (s32[], f32[4,16])) -> pred[] {
  %q = (s32[], f32[4,16]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (x: f32[4,16], y: f32[8,16], o: s32[]) -> f32[4,16] {
  %x = f32[4,16]{1,0} parameter(0)
  %y = f32[8,16]{1,0} parameter(1)
  %o = s32[] parameter(2)
  %rs = f32[2,16]{1,0} reduce-scatter(%x), channel_id=3, replica_groups=[2,4]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true, to_apply=%add
  %ags = (f32[4,16]{1,0}, f32[16,16]{1,0}) all-gather-start(%x), channel_id=4, replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}, use_global_device_ids=true
  %agd = f32[16,16]{1,0} all-gather-done(%ags)
  %cp = f32[4,16]{1,0} collective-permute(%x), channel_id=5, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %sub = f32[8,16]{1,0} all-reduce(%y), channel_id=6, replica_groups=mesh['x'=8] {'x':(2)2}, use_global_device_ids=true, to_apply=%add
  %perm = f32[8,16]{1,0} all-reduce(%y), channel_id=7, replica_groups=mesh['a'=2,'b'=4], device_ids=([2,2,2]T(1,0,2)) {'a'}, use_global_device_ids=true, to_apply=%add
  %rsar = f32[8,16]{1,0} all-reduce(%y), channel_id=8, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add
  %cut = f32[4,16]{1,0} fusion(%rsar, %o), kind=kLoop, calls=%fused_slice
  %i0 = s32[] constant(0)
  %init = (s32[], f32[4,16]{1,0}) tuple(%i0, %x)
  %loop = (s32[], f32[4,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  ROOT %out = f32[4,16]{1,0} get-tuple-element(%loop), index=1
}
"""


def _by_name(collectives):
  return {c.name: c for c in collectives}


def test_hlo_collectives_counts_groups_axes_and_bytes():
  found = _by_name(collectives.find_collectives(HLO, (2, 2, 2), AXES))
  assert set(found) == {"ag", "ar", "rs", "ags", "cp", "sub", "perm", "rsar"}
  ag, ar = found["ag"], found["ar"]
  assert (ag.kind, ag.count, ag.group_size, ag.axes, ag.payload_bytes, ag.wire_bytes) == (
    "all-gather",
    6,
    2,
    ("tensor",),
    512,
    256,
  )
  assert (ar.kind, ar.count, ar.axes, ar.payload_bytes, ar.wire_bytes) == ("all-reduce", 6, ("data",), 256, 256)
  assert (found["rs"].axes, found["rs"].group_size, found["rs"].wire_bytes) == (("data", "tensor"), 4, 192)
  assert (found["ags"].kind, found["ags"].axes, found["ags"].payload_bytes) == ("all-gather", ("fsdp", "tensor"), 1024)
  assert (found["cp"].kind, found["cp"].axes, found["cp"].wire_bytes) == ("collective-permute", ("tensor",), 256)


def test_mesh_axes_replica_groups_with_sub_axes_and_device_order():
  assert collectives.parse_replica_groups("replica_groups=mesh['x'=8] {'x':(2)2}", 8).tolist() == [
    [0, 2],
    [1, 3],
    [4, 6],
    [5, 7],
  ]
  assert collectives.parse_replica_groups(
    "replica_groups=mesh['a'=2,'b'=4], device_ids=([2,2,2]T(1,0,2)) {'a'}", 8
  ).tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
  assert collectives.parse_replica_groups("replica_groups=[2,4]<=[2,4]T(1,0), x", 8).tolist() == [
    [0, 4, 1, 5],
    [2, 6, 3, 7],
  ]
  assert collectives.parse_replica_groups("replica_groups={}, to_apply=%a", 4).tolist() == [[0, 1, 2, 3]]
  found = _by_name(collectives.find_collectives(HLO, (2, 2, 2), AXES))
  assert found["sub"].axes == ("fsdp",) and found["perm"].axes == ("fsdp",)


def test_all_reduce_only_used_sliced_counts_as_reduce_scatter():
  found = _by_name(collectives.find_collectives(HLO, (2, 2, 2), AXES))
  assert found["rsar"].sliced and found["rsar"].wire_bytes == 256  # (n-1)/n · 512, not 2(n-1)/n
  assert not found["sub"].sliced and not found["ar"].sliced
  kinds = {t.kind for t in collectives.summarize(found.values())}
  assert "reduce-scatter*" in kinds


def test_groups_spanning_granules_are_dcn():
  granule_of = [0, 0, 0, 0, 1, 1, 1, 1]  # the data axis crosses granules
  found = _by_name(collectives.find_collectives(HLO, (2, 2, 2), AXES, granule_of))
  assert found["ar"].dcn and not found["ag"].dcn
  links = collectives.wire_bytes_by_link(found.values())
  assert links["dcn"] == 6 * 256 + found["rs"].wire_bytes


def test_matmul_flops_multiply_loop_bodies():
  assert hlo_module.matmul_flops(HLO) == 6 * 2 * 4 * 8 * 16


def test_collective_axes_of_a_real_compile_follow_mesh_positions():
  devices = np.array(jax.devices()[:8])[[3, 1, 0, 2, 7, 5, 6, 4]]  # mesh positions, not device ids, count
  mesh = Mesh(devices.reshape(2, 2, 2), AXES, axis_types=(AxisType.Auto,) * 3)

  def body(x):
    a = jax.lax.psum(x, "fsdp")
    b = jax.lax.all_gather(x, "tensor", tiled=True)
    c = jax.lax.psum(x, ("data", "tensor"))
    return a, b, c

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=(P(AXES),) * 3))
  text = f.lower(jax.ShapeDtypeStruct((64, 4), jnp.float32)).compile().as_text()
  axes = {c.axes for c in collectives.find_collectives(text, (2, 2, 2), AXES) if c.payload_bytes > 4}
  assert {("fsdp",), ("tensor",), ("data", "tensor")} <= axes


def test_cpu_stand_in_for_cudnn_attention_matches_xla_attention_and_its_gradient():
  from distrib_train.podplan.cpu_attention import chunked_attention, emulating_cudnn

  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, 64, 4, 8))
  k, v = jax.random.normal(keys[1], (2, 64, 2, 8)), jax.random.normal(keys[2], (2, 64, 2, 8))  # 2 kv heads
  segments = jnp.array([[1] * 30 + [2] * 34, [1] * 64])
  mask = segments[:, None, :, None] == segments[:, None, None, :]
  want = lambda q: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
  got = lambda q: chunked_attention(q, k, v, mask=mask, is_causal=True, chunk=16)
  values_and_grads = lambda f: jax.jit(lambda q: (f(q), jax.grad(lambda q: f(q).sum())(q)))(q)
  for a, b in zip(values_and_grads(got), values_and_grads(want)):
    np.testing.assert_allclose(a, b, atol=1e-5)
  original = jax.nn.dot_product_attention
  with emulating_cudnn():
    out = jax.jit(lambda q: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="cudnn"))(q)
  np.testing.assert_allclose(out, jax.jit(want)(q), atol=1e-5)
  windowed = jax.jit(
    lambda q: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=(4, 0))
  )(q)
  np.testing.assert_allclose(
    chunked_attention(q, k, v, mask=mask, is_causal=True, window=5, chunk=16), windowed, atol=1e-5
  )
  with emulating_cudnn():
    out = jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=True, local_window_size=(4, 0), implementation="cudnn"
    )
    np.testing.assert_allclose(out, windowed, atol=1e-5)
    with pytest.raises(NotImplementedError, match="bias"):
      jax.nn.dot_product_attention(q, k, v, bias=jnp.zeros((2, 4, 64, 64)), implementation="cudnn")
  assert jax.nn.dot_product_attention is original


def test_layout_puts_dcn_major_and_gpu_hosts_in_blocks():
  two_slices = MeshConfig(AXES, (1, -1, 2), (2, 1, 1), devices=16)
  lay = podplan.layout(two_slices, 16, hardware.device_kind("v5p"))
  assert lay.shape == (2, 4, 2) and lay.granules == 2
  assert lay.granule_of == tuple([0] * 8 + [1] * 8)
  hosts = podplan.layout(MeshConfig(AXES, (1, 16, 1)), 16, hardware.device_kind("h100"))
  assert hosts.granule_of == tuple([0] * 8 + [1] * 8)


def test_recommended_mesh_yaml_round_trips_dcn_sizes_and_custom_rules(tmp_path):
  from distrib_train.podplan import search as mesh_search
  from distrib_train.sharding.axis_rules import AxisRules

  rules = AxisRules(
    [("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"), ("heads", None)],
    param_axes=[(r"head", ("embed", "vocab"))],
  )
  hybrid = MeshConfig(AXES, (1, 2, 2), (2, 1, 1), rules=rules, devices=8)
  pod = podplan.plan_pod(config_lib.load("tiny"), hybrid, hardware.device_kind("v5p"), 8, compile=False)
  path = tmp_path / "mesh.yaml"
  path.write_text(mesh_search.mesh_config_yaml(pod, rules, ["a header line"]))
  loaded = MeshConfig.from_yaml(path)
  assert (loaded.ici, loaded.dcn, loaded.devices) == ((1, 2, 2), (2, 1, 1), 8)
  assert loaded.rules.rules == rules.rules
  assert [(r.pattern, a) for r, a in loaded.rules.param_axes] == [("head", ("embed", "vocab"))]
  assert pod.layout.granule_of == (0, 0, 0, 0, 1, 1, 1, 1)


@pytest.fixture(scope="module")
def cache_env(xla_cache):
  """One persistent compilation cache for this module's compiles, here and in subprocesses: the
  same tiny step compiles once."""
  from jax.experimental.compilation_cache import compilation_cache

  from distrib_train.train.compilation import setup_compilation_cache

  names = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
  )
  before = {name: getattr(jax.config, name) for name in names}
  setup_compilation_cache(xla_cache)
  yield {
    "JAX_COMPILATION_CACHE_DIR": xla_cache,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }
  for name, value in before.items():  # later test modules get the cache they had
    jax.config.update(name, value)
  compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def tiny_pod(cache_env):
  del cache_env
  config = config_lib.load("tiny")
  mesh_config = MeshConfig.from_yaml(find_mesh_config("cpu-8"))
  pod = podplan.plan_pod(config, mesh_config, hardware.device_kind("h100"), 8, config_name="tiny")
  return config, mesh_config, pod


def test_predicted_memory_matches_sharded_init_and_the_real_compile(tiny_pod):
  config, mesh_config, pod = tiny_pod
  spec = podplan.step_spec(config)
  state = pod.plan.init(spec.make_state)
  first = jax.devices()[0]
  on_first = sum(
    s.data.nbytes
    for leaf in jax.tree_util.tree_leaves(state)
    if isinstance(leaf, jax.Array)
    for s in leaf.addressable_shards
    if s.device == first
  )
  assert on_first == pod.memory.state
  from distrib_train.train_step import build_train_step_fn

  rules = podplan.rules_for(config, mesh_config)
  step = build_train_step_fn(
    spec.loss_fn,
    donate_params_and_state=True,
    train_state_shardings=pod.plan.train_state_shardings,
    input_kwarg_shardings=pod.plan.input_kwarg_shardings,
    aux_output_shardings=pod.plan.aux_output_shardings,
  )
  batch = {
    n: jax.device_put(np.zeros(x.shape, x.dtype), pod.plan.input_kwarg_shardings[n]) for n, x in spec.inputs.items()
  }
  from distrib_train.sharding.axis_rules import activation_sharding

  with activation_sharding(pod.plan.mesh, rules):
    analysis = step.compile(state.replace(step=0), **batch).memory_analysis()
  actual = (
    analysis.argument_size_in_bytes
    + analysis.temp_size_in_bytes
    + max(0, analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
  )
  assert abs(pod.memory.total / actual - 1) < 0.10, (pod.memory, analysis)
  assert pod.memory.fits and pod.time.step_s > 0 and pod.time.mfu > 0


def test_tiny_plan_sees_fsdp_and_tensor_collectives(tiny_pod):
  _, _, pod = tiny_pod
  axes = {c.axes for c in pod.collectives if c.group_size > 1}
  assert ("fsdp",) in axes and ("tensor",) in axes
  assert pod.wire_bytes()["dcn"] == 0
  assert "Memory per device" in pod.report() and "FITS" in pod.report()


def _plan(*args, env=(), timeout=240):
  env = dict(os.environ, JAX_PLATFORMS="cpu", **dict(env))
  return subprocess.run(
    [sys.executable, "-m", "distrib_train", "plan", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def test_cli_plan_on_8_emulated_devices_prints_and_writes_json(tmp_path, cache_env):
  out = _plan(
    "--config", "tiny", "--devices", "8", "--device_kind", "v5e", "--json", str(tmp_path / "p.json"), env=cache_env
  )
  assert out.returncode == 0, out.stderr[-3000:]
  for heading in ("Memory per device", "Collectives per step", "step time", "FITS"):
    assert heading in out.stdout
  data = json.loads((tmp_path / "p.json").read_text())
  assert data["devices"] == 8 and data["device_kind"] == "v5e" and data["memory"]["fits"]
  assert data["memory"]["temporaries"] > 0 and data["time"]["step_s"] > 0
  assert any(row["axes"] == "fsdp" for row in data["collectives"])


@pytest.mark.parametrize("recommend", [["--recommend"], ["--mesh_config", "auto"]], ids=["recommend", "auto"])
def test_cli_recommend_writes_a_mesh_config_that_loads(tmp_path, cache_env, recommend):
  """--recommend over the config's mesh axes, or --mesh_config auto: the space a run's mesh_config: auto
  searches (data, fsdp, tensor), for the machine the flags describe."""
  out_yaml = tmp_path / "best.yaml"
  out = _plan(
    "--config",
    "tiny",
    "--devices",
    "4",
    "--device_kind",
    "a100",
    *recommend,
    "--max_compiles",
    "1",
    "--out",
    str(out_yaml),
    "--json",
    str(tmp_path / "r.json"),
    env=cache_env,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "Top 1 by estimated step time" in out.stdout and f"wrote {out_yaml}" in out.stdout
  loaded = MeshConfig.from_yaml(find_mesh_config(str(out_yaml)))
  assert loaded.devices == 4 and loaded.axis_names == AXES and loaded.rules is not None
  data = json.loads((tmp_path / "r.json").read_text())
  assert data["compiled"] == 1 and len(data["ranked"]) == 1
  # and the experiment config beside it, with the chosen settings and the mesh: the trainer loads it as is
  written = config_lib.load(str(tmp_path / plan_cli.DEFAULT_CONFIG_OUT))
  assert written.mesh_config == str(out_yaml) and written.model.preset == "tiny"
  assert written.train.microbatches == data["chosen"]["train.microbatches"]


@pytest.mark.parametrize(
  "args, message",
  [
    (["--config", "tiny", "--devices", "4"], "cpu-8.yaml is for 8 devices, not --devices 4"),
    (["--config", "tiny", "--device_kind", "tpu9"], "Unknown device kind 'tpu9'"),
    (["--config", "tiny", "--devices", "0"], "--devices must be at least 1"),
    (["--config", "tiny", "--set", "train.step=3"], "Unknown config key 'train.step'"),
    (["--config", "tiny", "--mesh_config", "nope"], "No mesh config named 'nope'"),
    (["--config", "tiny", "--efficiency", "2"], "--efficiency must be in (0, 1]"),
    (["--config", "tiny", "--recommend", "--out_config", "tiny"], "--out_config must name a .yaml file"),
    (["--config", "tiny", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--config", "tiny", "--kv_cache", "64"], "--kv_cache must be ROWSxTOKENS, e.g. 64x4096, got '64'"),
  ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    plan_cli.main(args)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and err.startswith("distrib-train: error:") and message in err, err


def test_plan_validate_runs_on_cpu(tmp_path, cache_env, tiny_pod):
  del tiny_pod
  # The tiny_pod fixture's step (cpu-8, 8 devices) again: both compiles come from the cache.
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_test_flags.with_device_count(8), **cache_env)
  out = subprocess.run(
    [
      sys.executable,
      "bench/plan_validate.py",
      "--config",
      "tiny",
      "--mesh_config",
      "cpu-8",
      "--steps",
      "1",
      "--json",
      str(tmp_path / "v.json"),
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  data = json.loads((tmp_path / "v.json").read_text())
  assert data["predicted_native"] > 0 and data["real_compile"] > 0
  assert abs(data["predicted_native"] / data["real_compile"] - 1) < 0.10
