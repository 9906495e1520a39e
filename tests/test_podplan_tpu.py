"""``distrib-train plan`` with libtpu's own compiler: single-host, multi-host and multi-slice TPU topologies.

Nothing runs on a TPU: libtpu (``pip install 'jax[tpu]'``, installed by
``.ci/run``) makes compile-only devices for a topology and compiles the
tiny preset's real step for them.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from distrib_train.cluster import hardware
from distrib_train.podplan import cli as plan_cli
from distrib_train.podplan import collectives
from distrib_train.podplan import estimate as podplan
from distrib_train.podplan import hlo as hlo_module
from distrib_train.podplan import tpu
from distrib_train.sharding.mesh import MeshConfig, find_mesh_config
from distrib_train.sharding.topology import TpuTopology
from distrib_train.config import run as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]

if not tpu.available():
  if os.environ.get("CI"):
    pytest.fail("libtpu is not installed; .ci/run installs jax[tpu] for these tests", pytrace=False)
  pytest.skip("libtpu is not installed (pip install 'jax[tpu]')", allow_module_level=True)


def _mesh_config(tmp_path, name, text):
  path = tmp_path / f"{name}.yaml"
  path.write_text(text)
  return MeshConfig.from_yaml(path)


def _plan(mesh_config, topology, **kwargs):
  config = config_lib.load("tiny")
  return podplan.plan_pod(
    config, mesh_config, tpu.kind_of(topology), topology.devices, config_name="tiny", target=topology, **kwargs
  )


def _axes(pod):
  return {(c.kind, c.axes, c.dcn) for c in pod.collectives if c.group_size > 1}


# --- topology names -------------------------------------------------------------------


def test_topology_names_parse_to_libtpu_spellings_and_counts():
  v5p = TpuTopology.parse("v5p:4x4x4", 2)
  assert (v5p.libtpu_name, v5p.chip_config, v5p.devices, v5p.accelerator_type) == (
    "v5:4x4x4",
    "megacore",
    128,
    "v5p-128",
  )
  assert v5p.wraparound == (True, True, True) and str(v5p) == "v5p:4x4x4 × 2 slices"
  v5e = TpuTopology.parse("v5litepod:16x16")
  assert (v5e.name, v5e.devices, v5e.hosts_per_slice, v5e.wraparound) == ("v5e:16x16", 256, 64, (True, True, False))
  assert TpuTopology.parse("v5e:2x2").hosts_per_slice == 1
  assert TpuTopology.parse("v4:2x2x2").hosts_per_slice == 2
  assert TpuTopology.parse("v5e:2x4").chips_per_host_bounds == (2, 4, 1)  # v5litepod-8: one host


@pytest.mark.parametrize(
  "name, chips, hosts", [("v5e:1x1", 1, 1), ("v5e:2x4", 8, 1), ("v4:1x1x1", 1, 1), ("v5e:4x4", 16, 4)]
)
def test_libtpu_makes_one_device_per_chip_on_the_right_hosts(name, chips, hosts):
  found = tpu.devices(TpuTopology.parse(name))
  assert len(found) == chips and len({d.process_index for d in found}) == hosts


@pytest.mark.parametrize(
  "text, message",
  [
    ("v5e-256", "is not a TPU topology"),
    ("v9:2x2", "unknown TPU generation 'v9'"),
    ("v5p:4x4x4x4", "3-D grid"),
    ("v5e:0x2", "2-D grid"),
  ],
)
def test_bad_topology_names_are_named(text, message):
  with pytest.raises(ValueError, match=message):
    TpuTopology.parse(text)


def test_every_shipped_tpu_mesh_config_names_a_topology_that_matches_its_devices():
  names = sorted(p.stem for p in (ROOT / "mesh_configs").glob("tpu-*.yaml"))
  assert names
  for name in names:
    mesh_config = MeshConfig.from_yaml(find_mesh_config(name))
    assert mesh_config.topology is not None, name
    assert mesh_config.topology.devices == mesh_config.devices, name
    assert mesh_config.topology.generation in name, name
    slices = mesh_config.topology.num_slices
    axes = {"data": {"ici": 1, "dcn": slices}, "fsdp": -1} if slices > 1 else {"fsdp": -1}
    assert (
      MeshConfig.from_dict({"topology": mesh_config.topology.name, "granules": slices, "axes": axes}).devices
      == mesh_config.devices
    )


def test_a_mesh_config_whose_axes_do_not_fit_its_topology_is_refused_at_load(tmp_path):
  with pytest.raises(ValueError, match=r"bad\.yaml.*= 8 do not match the 4 devices.*topology v5e:2x2"):
    _mesh_config(tmp_path, "bad", "topology: v5e:2x2\naxes:\n  fsdp: 2\n  tensor: 4\n")
  with pytest.raises(ValueError, match=r"'devices' is 8 but topology v5e:2x2 has 4 chips"):
    _mesh_config(tmp_path, "bad2", "topology: v5e:2x2\ndevices: 8\naxes:\n  fsdp: -1\n")
  with pytest.raises(ValueError, match=r"has 2 slices \(granules\) but no axis spans them; give one axis a DCN size"):
    _mesh_config(tmp_path, "bad3", "topology: v5e:2x2\ngranules: 2\naxes:\n  fsdp: -1\n")


# --- compiling with libtpu --------------------------------------------------------------


def test_single_host_v5e_is_compiled_by_libtpu_with_no_correction(tmp_path):
  topology = TpuTopology.parse("v5e:2x2")
  mesh_config = _mesh_config(
    tmp_path, "v5e4", "topology: v5e:2x2\naxes:\n  data: 1\n  fsdp: -1\n  tensor: 1\nrules: fsdp_tensor\n"
  )
  pod = _plan(mesh_config, topology)
  assert (pod.compiler, pod.device_kind, pod.emulated) == ("tpu", "TPU v5 lite", False)
  assert pod.kind is hardware.DEVICE_KINDS["v5e"]
  assert pod.memory.temporaries_scale == 1.0 and pod.memory.temporaries == pod.memory.compiled_temporaries > 0
  assert ("all-gather", ("fsdp",), False) in _axes(pod)
  assert not any(c.sliced for c in pod.collectives)  # libtpu's all-reduces are what runs
  # libtpu states no loop trip counts: the scanned layers' collectives still count once per layer.
  assert any(c.count == 2 for c in pod.collectives)  # the tiny preset has 2 layers
  assert pod.time.matmul_flops_per_device > 0
  data = pod.to_dict()
  assert data["compiler"] == "tpu" and data["device_kind"] == "TPU v5 lite" and data["kind"] == "v5e"
  assert data["topology"] == {"name": "v5e:2x2", "slices": 1, "chips": 4}
  assert "libtpu" in pod.report()
  assert pod.estimated_cycles > 0 and data["estimated_cycles"] == pod.estimated_cycles  # libtpu's own estimate


def test_the_tpu_plan_compiles_the_attention_a_tpu_run_uses_splash(tmp_path):
  topology = TpuTopology.parse("v5e:2x2")
  mesh_config = _mesh_config(
    tmp_path, "v5e4", "topology: v5e:2x2\naxes:\n  data: 1\n  fsdp: -1\n  tensor: 1\nrules: fsdp_tensor\n"
  )
  config = config_lib.load("tiny")  # attention: auto, length 128
  spec = podplan.step_spec(config, "tpu")
  rules = podplan.rules_for(config, mesh_config)
  plan = podplan.plan_state(spec, tpu.mesh(mesh_config, topology), rules)
  compiled, _ = podplan.compile_step(spec, plan, rules)
  # Pallas kernels: splash attention's forward, dq and dkv, compiled by libtpu's Mosaic.
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 3
  with pytest.raises(ValueError, match="model.attention is cudnn, a GPU kernel, and the target is a TPU"):
    podplan.step_spec(config_lib.load("tiny", ["model.attention=cudnn"]), "tpu")


def test_a_step_libtpu_refuses_for_memory_is_a_does_not_fit_verdict_with_its_figure(tmp_path):
  topology = TpuTopology.parse("v5e:2x2")
  mesh_config = _mesh_config(
    tmp_path, "v5e4", "topology: v5e:2x2\naxes:\n  data: 1\n  fsdp: -1\n  tensor: 1\nrules: fsdp_tensor\n"
  )
  config = config_lib.load("tiny", ["data.global_batch_size=262144"])
  pod = podplan.plan_pod(config, mesh_config, tpu.kind_of(topology), 4, target=topology)
  assert not pod.memory.fits and pod.memory.temporaries > 100 * 2**30 and pod.collectives is None
  assert "the compiler refused the step" in pod.notes[0] and "exceeds available HBM" in pod.notes[0]
  assert "DOES NOT FIT" in pod.report()


def test_out_of_memory_messages_are_read_in_both_spellings():
  gib = 2**30
  assert podplan.out_of_memory(
    RuntimeError(
      "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (26.12G)"
      " exceeds available HBM (15.75G)."
    )
  ) == (int(26.12 * gib), int(15.75 * gib))
  assert podplan.out_of_memory(
    RuntimeError(
      "RESOURCE_EXHAUSTED: Compilation failure: Aborting compilation early because it's unlikely to have enough"
      " device memory. Requires 40.50G, has 15.75G available."
    )
  ) == (int(40.5 * gib), int(15.75 * gib))
  assert podplan.out_of_memory(RuntimeError("INTERNAL: something else")) is None


def test_multi_host_v4_devices_span_hosts_and_both_mesh_axes_communicate(tmp_path):
  topology = TpuTopology.parse("v4:2x2x2")
  found = tpu.devices(topology)
  assert len(found) == 8 and len({d.process_index for d in found}) == topology.hosts_per_slice == 2
  mesh_config = _mesh_config(
    tmp_path, "v4-16", "topology: v4:2x2x2\naxes:\n  data: 1\n  fsdp: 4\n  tensor: 2\nrules: fsdp_tensor\n"
  )
  pod = _plan(mesh_config, topology)
  assert pod.device_kind == "TPU v4" and pod.layout.granules == 1
  kinds = _axes(pod)
  assert ("all-gather", ("fsdp",), False) in kinds and ("all-reduce", ("tensor",), False) in kinds


def test_two_slices_send_the_data_axis_over_dcn_and_the_rest_over_ici(tmp_path):
  topology = TpuTopology.parse("v4:2x2x2", num_slices=2)
  mesh_config = _mesh_config(
    tmp_path,
    "two",
    "topology: v4:2x2x2\ngranules: 2\naxes:\n  data: {ici: 1, dcn: 2}\n"
    "  fsdp: {ici: 4}\n  tensor: {ici: 2}\nrules: fsdp_tensor\n",
  )
  assert mesh_config.devices == 16
  pod = _plan(mesh_config, topology)
  assert pod.layout.granules == 2 and pod.layout.describe() == "data=2 (2 over DCN) × fsdp=4 × tensor=2"
  kinds = _axes(pod)
  assert ("all-reduce", ("data",), True) in kinds  # the gradients, between slices
  assert ("all-gather", ("fsdp",), False) in kinds and ("all-reduce", ("tensor",), False) in kinds
  assert not any(c.dcn for c in pod.collectives if c.axes != ("data",))
  assert pod.wire_bytes()["dcn"] > 0 and pod.time.dcn_s > 0


# CI compiles one shipped preset at real size: llama-70b-tpu-pipeline (stages across slices: the only compile of a
# pipeline over DCN; its fit proves the matrix's property). The rest run with DT_LONG_TESTS=1: llama-124m-tpu (86 s
# on a 2-core VM; a single-slice compile is test_single_host_v5e_is_compiled_by_libtpu_with_no_correction's),
# mixtral-8x7b-tpu (149 to 365 s on 2-core VMs; the expert axis's all-to-all compiles small in
# test_libtpu_compiles_the_context_and_expert_axes), llama-7b-tpu (71 s), gemma3-27b-tpu (140 s; its windows and
# sinks compile small in test_attention_kernels and the splash test here), llama-70b-tpu and llama-1b-tpu (llama-7b-tpu's
# model). llama-7b-tpu-128k (90 s: the splash masks of 131,072 tokens take most of it) is compiled small in
# test_libtpu_compiles_all_gather_context_attention_as_splash_and_counts_its_work. deepseek-v3-tpu compiles for 4.5
# minutes on 2 cores: bench/tpu_presets.py checks it (bench/RESULTS.md).
LONG_TPU_PRESETS = (
  "llama-124m-tpu",
  "mixtral-8x7b-tpu",
  "llama-7b-tpu",
  "gemma3-27b-tpu",
  "llama-70b-tpu",
  "llama-1b-tpu",
  "llama-7b-tpu-128k",
)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
  "preset",
  [
    pytest.param(
      n,
      marks=pytest.mark.skipif(
        n in LONG_TPU_PRESETS and os.environ.get("DT_LONG_TESTS") != "1",
        reason="a real-size compile of a kind CI compiles: DT_LONG_TESTS=1",
      ),
    )
    for n in sorted(config_lib.preset_names())
    if n.endswith(("-tpu", "-tpu-pipeline", "-tpu-128k")) and n != "deepseek-v3-tpu"
  ],
)
def test_every_shipped_tpu_preset_fits_the_chips_of_its_mesh_configs_topology(preset):
  """A user who runs a shipped TPU preset on its pod must not meet an out-of-memory (libtpu's own figures)."""
  import jax

  config = config_lib.load(preset)
  mesh_config = MeshConfig.from_yaml(find_mesh_config(config.mesh_config))
  topology = mesh_config.topology
  pod = podplan.plan_pod(
    config, mesh_config, tpu.kind_of(topology), topology.devices, config_name=preset, target=topology
  )
  jax.clear_caches()
  assert pod.compiler == "tpu" and pod.compiled, pod.notes
  assert pod.memory.fits, pod.report()
  assert not pod.plan.skips or all(not s.path.startswith("inputs") for s in pod.plan.skips), pod.plan.skips
  if preset.endswith("-pipeline"):  # stages across the slices: activations cross DCN by collective-permute
    pipeline = pod.pipeline()
    assert pipeline["stages"] > 1 and 0 < pipeline["bubble_fraction"] < 0.2, pipeline
    assert any(c.kind == "collective-permute" and c.dcn and "stage" in c.axes for c in pod.collectives)
    assert pipeline["stage_permute_bytes"] > 0 and "Pipeline: 4 stages, 16 microbatches" in pod.report()
  if preset.startswith("mixtral"):  # tokens to their experts and back: ragged all-to-all over the expert axis
    from distrib_train.recipes import moe

    model = moe.PRESETS["mixtral-8x7b"]  # the batch splits over every chip (tensor 1): a chip's rows routed, bf16
    routed = pod.tokens_per_step // pod.devices * model.experts_per_token * model.d_model * 2
    moved = [c for c in pod.collectives if c.kind == "all-to-all" and c.axes == ("expert",) and c.payload_bytes > 1e6]
    assert moved and all(c.payload_bytes <= 1.2 * routed for c in moved), ([c.payload_bytes for c in moved], routed)
    # issue 34: grouped kernels sized by the routed rows, not the worst-case buffer (was 2.3 × with ragged_dot);
    # splash's work, counted since issue 49, on top (1.21 × in all)
    flops = pod.flops
    assert flops["dots"] + flops["grouped_kernels"] <= 1.15 * pod.time.model_flops_per_device, pod.report()
    assert 0 < flops["attention_kernels"] < 0.1 * pod.time.model_flops_per_device, flops
  if preset == "llama-7b-tpu-128k":  # issue 49: all-gather context attention through splash, every layer
    (decision,) = pod.attention
    assert decision.kernel == "all_gather_splash" and decision.work < 1.01, pod.attention
    assert not any(c.kind == "collective-permute" and "context" in c.axes for c in pod.collectives)
    assert 1.0 < pod.time.matmul_flops_per_device / pod.flops["attention_kernels"] < 1.6, pod.flops
    assert pod.time.step_s < 5.77 / 1.5, pod.report()  # the ring's XLA tiles: 5.77 s (bench/RESULTS.md)


def test_a_mesh_needing_slices_on_one_slice_is_a_clear_error(tmp_path):
  mesh_config = _mesh_config(tmp_path, "two", "devices: 4\ngranules: 2\naxes:\n  data: {dcn: 2}\n  fsdp: 2\n")
  with pytest.raises(ValueError, match="span slices .* is one slice; pass --num_slices"):
    tpu.mesh(mesh_config, TpuTopology.parse("v5e:2x2"))


def test_loop_trip_counts_come_from_the_condition_when_the_compiler_states_none():
  text = """HloModule m, num_partitions=2

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %ar = f32[4]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %ar)
}

%cond (q: (s32[], f32[4])) -> pred[] {
  %q = (s32[], f32[4]{0}) parameter(0)
  %n = s32[]{:T(128)} constant(7)
  %j = s32[] get-tuple-element(%q), index=0
  ROOT %lt = pred[]{:T(512)} compare(%j, %n), direction=LT
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %x)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[4]{0} get-tuple-element(%w), index=1
}
"""
  assert hlo_module.multiplicities(hlo_module.parse_module(text)[0])["body"] == 7
  (found,) = collectives.find_collectives(text, (2,), ("fsdp",))
  assert found.count == 7 and found.axes == ("fsdp",)
  assert hlo_module.estimated_cycles(text) is None  # no compiler's estimate in it
  estimated = text.replace(
    "replica_groups={{0,1}}, to_apply=%add",
    'replica_groups={{0,1}}, to_apply=%add, backend_config={"estimated_cycles":"100"}',
  )
  estimated = estimated.replace("tuple(%zero, %x)", 'tuple(%zero, %x), backend_config={"estimated_cycles":"3"}')
  assert hlo_module.estimated_cycles(estimated) == 7 * 100 + 3  # the loop's body by its trips


def test_a_custom_calls_config_spanning_lines_does_not_end_its_computation():
  # libtpu writes a Pallas kernel's backend config over several lines; one starts with "}}".
  text = """HloModule m, num_partitions=2

ENTRY %main (x: f32[4,8], w: f32[8,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %k = f32[4,8]{1,0} custom-call(%x), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "x",
"xprof_metadata":"{\\"block_q\\": 512}"
}}, metadata={op_name="splash"}
  %ag = f32[8,8]{1,0} all-gather(%k), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  ROOT %c = f32[4,8]{1,0} convolution(%k, %w), dim_labels=bf_io->bf
}
"""
  assert hlo_module.matmul_flops(text) == 2 * 4 * 8 * 8
  assert [c.kind for c in collectives.find_collectives(text, (2,), ("fsdp",))] == ["all-gather"]
  # the op name on the continuation line carries a splash call's work: its fused backward kernel's, here
  scope = "jit(step)/attention_kernel(pairs=100,bwd=120,qk=16,v=8,fused=1)/splash_mha_dkv_no_residuals/pallas_call"
  text = text.replace("%k = f32", "%splash_mha_dkv_no_residuals.3 = f32").replace(
    "(%k", "(%splash_mha_dkv_no_residuals.3"
  )
  text = text.replace('op_name="splash"', f'op_name="{scope}"')
  assert hlo_module.flops(text) == {
    "dots": 2 * 4 * 8 * 8,
    "attention_kernels": 2 * 120 * (3 * 16 + 2 * 8),
    "grouped_kernels": 0.0,
  }


def test_megascale_transfers_count_as_their_collectives_over_the_dcn_axes():
  text = """HloModule m, num_partitions=4

ENTRY %main (x: f32[8,128], y: f32[2,128]) -> f32[8,128] {
  %x = f32[8,128]{1,0} parameter(0)
  %y = f32[2,128]{1,0} parameter(1)
  %t = token[] after-all()
  %s1 = (f32[8,128]{1,0}, u32[], token[]) send(%x, %t), channel_id=1, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_transfer_type="ALL_REDUCE"}
  %s2 = (f32[2,128]{1,0}, u32[], token[]) send(%y, %t), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_transfer_type="ALL_GATHER"}
  %s3 = (f32[2,128]{1,0}, u32[], token[]) send(%y, %t), channel_id=3, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_transfer_type="ONE_TO_ONE"}
  ROOT %r = f32[8,128]{1,0} copy(%x)
}
"""
  found = {c.kind: c for c in collectives.find_collectives(text, (4,), ("fsdp",), dcn_axes=("data",), dcn_group_size=4)}
  assert set(found) == {"all-reduce", "all-gather", "collective-permute"}
  assert all(c.dcn and c.axes == ("data",) and c.group_size == 4 for c in found.values())
  assert found["all-reduce"].wire_bytes == 2 * 3 / 4 * 4096  # ring all-reduce of 4 KiB among 4 slices
  assert found["all-gather"].payload_bytes == 4 * 1024 and found["all-gather"].wire_bytes == 3 / 4 * 4096
  assert found["collective-permute"].wire_bytes == 1024


def test_batched_matmuls_written_as_dilated_convolutions_count_their_real_taps():
  # libtpu's bthd,bshd->bhts for 8 × 12 (batch × heads): the batch as a window over a dilated input, one
  # real element per output; the 64-wide contraction is the input feature dimension.
  text = """HloModule m

ENTRY %main (q: bf16[8,12,64,1024], k: bf16[8,12,1024,1024]) -> bf16[8,12,64,1024] {
  %q = bf16[8,12,64,1024]{3,2,1,0} parameter(0)
  %k = bf16[8,12,1024,1024]{3,2,1,0} parameter(1)
  ROOT %c = bf16[8,12,64,1024]{3,2,1,0} convolution(%q, %k), window={size=8x12 stride=7x11 lhs_dilate=8x12}, dim_labels=01bf_01io->01bf
}
"""
  assert hlo_module.matmul_flops(text) == 2 * (8 * 12 * 64 * 1024) * 1024


# --- the CLI --------------------------------------------------------------------------


def _cli(*args, timeout=600):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)  # the TPU path needs no emulated CPU devices
  return subprocess.run(
    [sys.executable, "-m", "distrib_train", "plan", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def test_cli_compiles_for_tpu_topology_with_slices_and_writes_json(tmp_path):
  mesh = tmp_path / "two.yaml"
  mesh.write_text("axes:\n  data: {ici: 1, dcn: 2}\n  fsdp: {ici: -1}\n  tensor: {ici: 1}\nrules: fsdp_tensor\n")
  out = _cli(
    "--config",
    "tiny",
    "--mesh_config",
    str(mesh),
    "--tpu_topology",
    "v5e:2x2",
    "--num_slices",
    "2",
    "--json",
    str(tmp_path / "plan.json"),
  )
  assert out.returncode == 0, out.stderr
  assert "compiler: TPU (libtpu, for TPU v5 lite, topology v5e:2x2 × 2 slices" in out.stdout
  assert "TPU_ACCELERATOR_TYPE" not in out.stdout + out.stderr  # libtpu's warnings are kept quiet
  data = json.loads((tmp_path / "plan.json").read_text())
  assert data["compiler"] == "tpu" and data["device_kind"] == "TPU v5 lite" and data["devices"] == 8
  assert any(c["axes"] == "data" and c["dcn"] for c in data["collectives"])
  assert data["memory"]["temporaries_scale"] == 1.0 and data["memory"]["fits"]


def test_cli_emulate_keeps_the_cpu_path_for_a_tpu_mesh_config(tmp_path):
  mesh = tmp_path / "v5e4.yaml"
  mesh.write_text("topology: v5e:2x2\naxes:\n  data: 1\n  fsdp: -1\n  tensor: 1\nrules: fsdp_tensor\n")
  out = _cli("--config", "tiny", "--mesh_config", str(mesh), "--emulate", "--json", str(tmp_path / "plan.json"))
  assert out.returncode == 0, out.stderr
  data = json.loads((tmp_path / "plan.json").read_text())
  assert data["compiler"] == "cpu-emulated" and data["devices"] == 4 and data["kind"] == "v5e"


def test_cli_recommend_compiles_its_finalists_with_libtpu(tmp_path):
  mesh = tmp_path / "v4.yaml"
  mesh.write_text("topology: v4:2x2x2\naxes:\n  data: 1\n  fsdp: -1\n  tensor: 1\nrules: fsdp_tensor\n")
  out_yaml = tmp_path / "best.yaml"
  out = _cli(
    "--config",
    "tiny",
    "--mesh_config",
    str(mesh),
    "--recommend",
    "--max_compiles",
    "2",
    "--out",
    str(out_yaml),
    "--json",
    str(tmp_path / "rec.json"),
    "--set",
    "model.remat=full",
  )
  assert out.returncode == 0, out.stderr
  data = json.loads((tmp_path / "rec.json").read_text())
  # one mesh, then one setting on it (remat none: lighter than the config's full), both by libtpu
  assert data["compiled"] == 2 and all(p["compiler"] == "tpu" for p in data["ranked"])
  assert {"model.remat": "none", "train.microbatches": 1} in [s["settings"] for s in data["settings"]], data
  best = MeshConfig.from_yaml(out_yaml)
  assert best.topology.name == "v4:2x2x2" and best.devices == 8


@pytest.mark.parametrize(
  "args, message",
  [
    (["--tpu_topology", "v5e:2x2", "--devices", "8"], "--devices 8 but TPU topology v5e:2x2 has 4 chips"),
    (["--tpu_topology", "v5e-4"], "is not a TPU topology"),
    (["--num_slices", "2"], "--num_slices needs a TPU topology"),
    (["--tpu_topology", "v5e:2x2", "--device_kind", "h100"], "--device_kind h100 but TPU topology v5e:2x2 is v5e"),
    (["--tpu_topology", "v5e:2x2"], "cpu-8.yaml is for 8 devices; TPU topology v5e:2x2 has 4 chips"),
  ],
)
def test_bad_tpu_flags_are_one_line_and_exit_2(args, message, capsys):
  with pytest.raises(SystemExit) as e:
    plan_cli.main(["--config", "tiny", *args])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and message in err, err


def test_libtpu_compiles_all_gather_context_attention_as_splash_and_counts_its_work(tmp_path):
  """model.context_attention: all_gather on a TPU: keys gathered over the context axis, splash per query shard
  (forward and one backward kernel a layer), its FLOPs counted from the blocks its mask runs; the report says so."""
  topology = TpuTopology.parse("v5e:2x2")
  mesh_config = _mesh_config(
    tmp_path, "ctx", "topology: v5e:2x2\naxes:\n  data: 1\n  context: 2\n  fsdp: 2\n  tensor: 1\n"
  )
  config = config_lib.load(
    "tiny",
    [
      "model.context_attention=all_gather",
      "model.remat=full",
      "data.seq_len=1024",
      "data.global_batch_size=2",
      "model.max_seq_len=1024",
    ],
  )
  pod = podplan.plan_pod(config, mesh_config, tpu.kind_of(topology), 4, config_name="tiny", target=topology)
  (decision,) = pod.attention
  assert decision.kernel == "all_gather_splash" and decision.length == 1024, pod.attention
  # chunks of 256 in blocks of 256: each device runs 5 of its 8 blocks (chunks 0 and 3, or 1 and 2)
  assert decision.work == pytest.approx(5 * 256 * 256 / (1024 * 1025 / 4))
  assert any(c.kind == "all-gather" and c.axes == ("context",) for c in pod.collectives)
  assert not any(c.kind == "collective-permute" and "context" in c.axes for c in pod.collectives)  # no ring
  assert "tpu_custom_call" in pod.custom_calls
  # 2 layers × (forward + one backward kernel), remat keeping the forward's output: per device one sequence
  # of 512 queries × 4 heads × head size 16 over 5 blocks of 256 × 256
  pairs = 4 * 5 * 256 * 256
  assert pod.flops["attention_kernels"] == 2 * (2 * pairs * 32 + 2 * pairs * (3 * 16 + 2 * 16))
  assert "all_gather_splash (1,024 tokens): all-gather of keys and values, splash per query shard" in pod.report()
  assert "of which fused attention kernels" in pod.report()


def test_libtpu_compiles_the_context_and_expert_axes(tmp_path):
  """Ring attention passes key/value blocks over the context axis; a mixture sends tokens over the expert axis."""
  topology = TpuTopology.parse("v5e:2x2")
  mesh_config = _mesh_config(
    tmp_path, "ctx", "topology: v5e:2x2\naxes:\n  data: 1\n  context: 2\n  fsdp: 2\n  tensor: 1\n"
  )
  pod = _plan(mesh_config, topology)
  assert pod.compiler == "tpu" and pod.memory.fits
  assert any(c.kind == "collective-permute" and c.axes == ("context",) for c in pod.collectives)
  config = config_lib.load("moe-tiny")
  mesh_config = _mesh_config(
    tmp_path, "exp", "topology: v5e:2x2\naxes:\n  data: 1\n  expert: 4\n  fsdp: 1\n  tensor: 1\n"
  )
  pod = podplan.plan_pod(config, mesh_config, tpu.kind_of(topology), 4, config_name="moe-tiny", target=topology)
  assert any(c.kind == "all-to-all" and c.axes == ("expert",) for c in pod.collectives)


def test_the_engine_compiles_its_decode_loop_for_tpu_with_no_copy_of_the_cache():
  """libtpu lays a loop's carried cache out otherwise than a program argument's default: with that default the
  engine's decode copied the whole cache into and out of its loop at every call (llama-7b on v5e-8: 2 × 12.9 ms and
  2.4 GiB of temp; bench/generation.py tpu). The engine lets the compiler choose the cache's layout and writes the
  prefill's cache in it; the layer scan pins its carry to an argument's layout (``cache._in_argument_layout``)."""
  import jax
  import optax

  from distrib_train import recipes
  from distrib_train.generation import cache as cache_lib
  from distrib_train.generation.engine import Generator
  from distrib_train.generation.sampling import Sampling
  from distrib_train.sharding.axis_rules import AxisRules
  from distrib_train.sharding.planner import MeshPlanner
  from distrib_train.train_state import TrainState

  config = recipes.get(
    "llama",
    "1b",
    num_layers=2,
    num_kv_heads=16,
    vocab_size=1024,
    dtype="bfloat16",
    param_dtype="bfloat16",
    remat="none",
  ).config
  mesh = tpu.mesh(MeshConfig(("data", "fsdp", "tensor"), (1, 1, 4)), TpuTopology.parse("v5e:2x2"))
  rules = AxisRules("fsdp_tensor")
  make = lambda: TrainState.initial_state(config.build(0), optax.sgd(0.0), jax.random.key(0))
  model = MeshPlanner(mesh, rules).plan(jax.eval_shape(make)).abstract_train_state.model
  rows, context = 16, 1024
  compiled = Generator(model, mesh=mesh, rules=rules)._decode_program(rows, context // 2, context, Sampling(), 1)
  computations, _ = hlo_module.parse_module(compiled.as_text())
  (entry,) = (c for c in computations.values() if c.is_entry)
  chip_cache = {
    f"bf16[{','.join(map(str, s.sharding.shard_shape(s.shape)))}]"
    for s in jax.tree.leaves(
      jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        cache_lib.cache_spec(config, rows, context),
        cache_lib.cache_shardings(config, rows, context, mesh, rules),
      )
    )
  }
  copies = [i.shape for i in entry.instructions if i.op == "copy" and i.shape.split("{")[0] in chip_cache]
  assert chip_cache and not copies, copies
  # inside the loops the cache keeps an argument's layout (heads before slots): libtpu's own choice for the carry
  # made it relay each layer's slice out for the products (the 7B: 10 of 20.9 ms a step)
  carried = {
    i.shape.split(":")[0]
    for c in computations.values()
    if not c.is_entry
    for i in c.instructions
    if i.shape.split("{")[0] in chip_cache
  }
  assert carried == {f"{shape}{{4,3,2,1,0" for shape in chip_cache}, carried
  from distrib_train.kernels.attention import xla
  from distrib_train.sharding.axis_rules import activation_sharding

  with activation_sharding(mesh, rules):  # a TPU's decode pads each kv head's query rows to its sublanes
    assert xla._min_rows() == 8
  assert xla._min_rows() == 2  # this host's CPU
  assert compiled.memory_analysis().temp_size_in_bytes < cache_lib.cache_bytes(config, rows, context) / 4 / 2
