"""``distrib-train plan`` with XLA's CUDA compiler on this GPU-less host (compile-only GPU devices).

These tests need JAX's CUDA plugin (``cuda_plugin.py``: where ``.ci/run``
installs it, and why it is kept out of the test environment); they run
``distrib-train plan`` and small programs in processes that have it.
"""

import json
import os
import subprocess
import sys

import pytest

import cuda_plugin
from distrib_train.cluster import hardware
from distrib_train.cluster import device_memory
from distrib_train.config import run as config_lib
from xla_test_flags import FAST_COMPILE

ROOT = cuda_plugin.ROOT
cuda_plugin.require(module_level=True)


def _plan(*args, xla_flags=None):
  return subprocess.run(
    [sys.executable, "-m", "distrib_train", "plan", *args],
    cwd=ROOT,
    env=cuda_plugin.environment(xla_flags),
    capture_output=True,
    text=True,
    timeout=600,
  )


def test_gpu_target_is_compiled_by_the_cuda_compiler_on_two_hosts(tmp_path):
  mesh = tmp_path / "two-hosts.yaml"
  mesh.write_text(
    "devices: 16\ngranules: 2\naxes:\n  data: {ici: 1, dcn: 2}\n  fsdp: {ici: 8}\n  tensor: 1\nrules: fsdp_tensor\n"
  )
  out = _plan(
    "--config", "tiny", "--mesh_config", str(mesh), "--device_kind", "h100", "--json", str(tmp_path / "plan.json")
  )
  assert out.returncode == 0, out.stderr
  assert "compiler: CUDA (XLA's GPU compiler for NVIDIA H100 80GB HBM3" in out.stdout
  data = json.loads((tmp_path / "plan.json").read_text())
  assert data["compiler"] == "gpu" and data["device_kind"] == "NVIDIA H100 80GB HBM3" and not data["emulated"]
  assert data["memory"]["temporaries_scale"] == 1.0 and data["memory"]["temporaries"] > 0
  axes = {(c["axes"], c["dcn"]) for c in data["collectives"]}
  assert ("fsdp", False) in axes and ("data", True) in axes  # NVLink inside a host, the network between the two


def test_emulate_keeps_the_cpu_path_for_a_gpu_target(tmp_path):
  out = _plan("--config", "tiny", "--device_kind", "a100", "--emulate", "--json", str(tmp_path / "plan.json"))
  assert out.returncode == 0, out.stderr
  data = json.loads((tmp_path / "plan.json").read_text())
  assert data["compiler"] == "cpu-emulated" and data["kind"] == "a100"


# What each FP8 program below starts with: one emulated H100, XLA's CUDA compiler (deviceless).
_ONE_H100 = r"""
import json, re
import jax, jax.numpy as jnp
from distrib_train.podplan import gpu, hlo
from distrib_train.kernels import fp8

mesh = jax.sharding.Mesh(list(gpu._devices("h100", 1, 1)), ("x",))
replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
"""

_FP8_DOTS = (
  _ONE_H100
  + r"""

def dot_operand_types(mode, matmul, shapes):
  def loss(x, w, extra):
    with fp8.active(mode):
      return jnp.sum(matmul(x, w, extra).astype(jnp.float32) ** 2)
  args = [jax.ShapeDtypeStruct(s, t, sharding=replicated) for s, t in shapes]
  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
  types = dict(re.findall(r"%(\S+) = (\w+)\[", text))
  return [[types[name] for name in re.findall(r"%([\w.-]+)", operands)]
          for operands in re.findall(r"= \w+\[[^\]]*\]\S* dot\(([^)]*)\)", text)]


dense = [((256, 512), jnp.bfloat16), ((512, 384), jnp.bfloat16), ((3, 16), jnp.float32)]
out = {mode: dot_operand_types(mode, lambda x, w, h: fp8.einsum("bd,df->bf", x, w, h), dense)
       for mode in ("none", "current", "delayed")}
grouped = [((512, 256), jnp.bfloat16), ((4, 256, 128), jnp.bfloat16), ((4,), jnp.int32)]
out["ragged"] = dot_operand_types("current", fp8.ragged_dot, grouped)  # the routed experts' grouped matmul
print(json.dumps(out))
"""
)


def test_fp8_matmuls_compile_to_float8_gemms_for_an_h100():
  """XLA's GPU compiler keeps the FP8 operands: the forward matmul and both gradient matmuls multiply float8
  arrays (e4m3 × e4m3, e5m2 × e4m3), the routed experts' grouped matmul (``ragged``) too. A quantize → dequantize written around a bf16 matmul did not survive
  this compiler: it simplified the f32 → f8 → f32 converts away and multiplied bf16."""
  dots = cuda_plugin.run_program(_FP8_DOTS)
  assert dots["none"] and all(t == ["bf16", "bf16"] for t in dots["none"]), dots
  for mode in ("current", "delayed", "ragged"):
    assert len(dots[mode]) == 3, dots
    assert sorted(tuple(sorted(t)) for t in dots[mode]) == [
      ("f8e4m3fn", "f8e4m3fn"),
      ("f8e4m3fn", "f8e5m2"),
      ("f8e4m3fn", "f8e5m2"),
    ], dots


_FP8_CUBLAS = (
  _ONE_H100
  + r"""

def loss(x, w, history):
  return jnp.sum(fp8.einsum("bd,df->bf", x, w, history).astype(jnp.float32) ** 2)


args = [jax.ShapeDtypeStruct(s, t, sharding=replicated)
        for s, t in [((1024, 512), jnp.bfloat16), ((512, 768), jnp.bfloat16), ((3, 16), jnp.float32)]]
with fp8.active("delayed"):
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
fp8_gemm = r"= \((\w+)\[[\d,]+\][^=]*custom-call\([^\n]*custom_call_target=\"__cublas\$lt\$matmul\$f8\""
print(json.dumps(re.findall(fp8_gemm, text)))  # each FP8 GEMM's result type
"""
)


def test_fp8_gemms_on_cublas_write_the_models_dtype_not_float32_for_an_h100():
  """On an H200 the autotuner sent the 1b's FP8 products to cuBLASLt (the profile of bench/NOTES.md lever 18);
  ``--xla_gpu_enable_triton_gemm=false`` makes the deviceless compiler do the same. Each of the three GEMMs
  writes bf16: written as float32, their results cost a read and a write more in the kernel after each (the 1b at
  2 layers moved 70.05 against 57.60 GiB; on an H200 the 1b's step went from 430 to 390 ms, lever 20)."""
  outputs = cuda_plugin.run_program(_FP8_CUBLAS, xla_flags="--xla_gpu_enable_triton_gemm=false")
  assert outputs == ["bf16"] * 3, outputs


_FP8_PASSES = (
  _ONE_H100
  + r"""

def loss(a, s, w, history):  # an RMS norm makes the matmul's operand, as in the Llama
  x = a * jax.lax.rsqrt(jnp.mean(jnp.square(a.astype(jnp.float32)), -1, keepdims=True)).astype(a.dtype) * s
  return jnp.sum(fp8.einsum("bd,df->bf", x, w, history).astype(jnp.float32) ** 2)


shapes = [((4096, 1024), jnp.bfloat16), ((1024,), jnp.bfloat16), ((1024, 2048), jnp.bfloat16), ((3, 16), jnp.float32)]
args = [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in shapes]
out = {}
for mode in ("current", "delayed"):
  with fp8.active(mode):
    # the histories' written values too (the step keeps them: under ``current`` their "gradient" is zero)
    text = jax.jit(jax.grad(loss, argnums=(0, 2, 3))).lower(*args).compile().as_text()
  entry = next(c for c in hlo.parse_module(text)[0].values() if c.is_entry)
  shape_of = {i.name: i.shape for i in entry.instructions}
  kernels = [i for i in entry.instructions if i.op in ("fusion", "custom-call", "copy", "convert", "reduce")]
  out[mode] = {"kernels": len(kernels),
               "bytes": sum(hlo.array_bytes(i.shape) + sum(hlo.array_bytes(shape_of.get(o, "")) for o in i.operands)
                            for i in kernels)}
print(json.dumps(out))
"""
)


def test_delayed_scaling_casts_in_the_kernels_that_make_the_operands_for_an_h100():
  """``delayed`` takes its scales from the histories only (an empty one gives 1), so no cast waits for its own
  tensor's amax: XLA's CUDA compiler fuses the input's cast into the norm that makes it (measured: 18 kernels and
  166.1 MiB against ``current``'s 19 and 174.1; the amaxes stay kernels of their own. With a fallback to the
  current amax for an empty history, ``delayed`` compiled to 20 kernels and ``current``'s 174.1 MiB)."""
  found = cuda_plugin.run_program(_FP8_PASSES)
  assert found["delayed"]["bytes"] < 0.97 * found["current"]["bytes"], found
  assert found["delayed"]["kernels"] < found["current"]["kernels"], found


_PACKED_PROGRAM = r"""
import json, re
from distrib_train.cluster import hardware
from distrib_train.podplan import estimate, gpu
from distrib_train.sharding.mesh import MeshConfig, find_mesh_config
from distrib_train.config import run as config_lib

config = config_lib.load("tiny", {"model.dtype": "bfloat16", "model.attention": ATTENTION, "data.source": "synthetic",
                                   "data.seq_len": 320, "data.global_batch_size": 4, "mesh_config": "gpu-1",
                                   "data.packing": PACKED, "model.sliding_window": 64,
                                   "model.layer_types": "sliding,full"})
kind = hardware.device_kind("h100")
target = gpu.GpuTarget(kind, 1, 1)
mesh_config = MeshConfig.from_yaml(find_mesh_config("gpu-1"))
spec = estimate.step_spec(config, "gpu")
mesh = estimate.emulated_mesh(estimate.layout(mesh_config, 1, kind), gpu.devices(target))
rules = estimate.rules_for(config, mesh_config)
plan = estimate.plan_state(spec, mesh, rules)
text = estimate.compile_step(spec, plan, rules)[0].as_text()
calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
fmha = [line for line in text.splitlines() if "custom-call(" in line and "fmhaSoftmax" in line]
print(json.dumps({"calls": calls, "square": sorted(set(re.findall(r"\w+\[[\d,]*320,320\]", text))),
                  "kernel_flops": estimate.hlo_module.flops(text)["attention_kernels"],
                  "offsets": sorted(set(s for line in fmha for s in re.findall(r"s32\[4,\d+\]", line))),
                  "windows": [re.findall(r'"sliding_window_length": ?"?(\d+)', line) for line in fmha]}))
"""


@pytest.mark.parametrize("attention, packed", [("auto", True), ("cudnn", False)])
def test_windowed_and_full_layers_compile_to_cudnn_attention_without_a_length_by_length_array(attention, packed):
  """The trainer's step on an H100, by XLA's CUDA compiler without a GPU, for a model of a sliding layer (a
  window of 64) and a full one: cuDNN's fused attention forward and backward in both, the window as cuDNN's
  own sliding window (64 in the sliding layer's calls, 0 in the full one's); packed rows (the synthetic source
  packs documents) fed as each row's segment lengths and offsets ([batch, max_segments] and [batch,
  max_segments + 1]); and no [.., length, length] array anywhere — neither the scores nor a mask."""
  program = _PACKED_PROGRAM.replace("ATTENTION", repr(attention)).replace("PACKED", repr(packed))
  found = cuda_plugin.run_program(program)
  assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= set(found["calls"]), found
  assert found["square"] == [], found
  assert sorted(w for call in found["windows"] for w in call) == ["0", "0", "64", "64"], found
  # max_segments 8: lengths and offsets
  assert found["offsets"] == (["s32[4,8]", "s32[4,9]"] if packed else []), found
  # the plan counts cuDNN's work (not in the program): 4 rows × 4 heads, causal pairs of a window of 64 and of
  # the full 320, head size 16, forward and one backward kernel
  pairs = 4 * 4 * ((64 * 65 // 2 + 256 * 64) + 320 * 321 // 2)
  assert found["kernel_flops"] == 2 * pairs * (16 + 16) + 2 * pairs * (3 * 16 + 2 * 16), found


# CI compiles qwen3-8b-gpu (a real-size dense model with cuDNN attention on 8 GPUs). The rest run with
# DT_LONG_TESTS=1: llama-124m-gpu (36 s; one GPU), llama-7b-gpu (155 s), qwen3-30b-a3b-gpu and gpt-oss-20b-gpu (45
# and 55 s; mixtures on an expert axis: the grouped-kernel test below compiles one small), llama-1b-gpu
# (llama-7b-gpu's model), and the post-training presets of qwen3-8b-gpu's model (SFT and DPO, full and LoRA; 18-20 s
# each here, bench/RESULTS.md has their memory).
LONG_GPU_PRESETS = (
  "llama-124m-gpu",
  "llama-7b-gpu",
  "qwen3-30b-a3b-gpu",
  "gpt-oss-20b-gpu",
  "llama-1b-gpu",
  "sft-qwen3-8b-gpu",
  "sft-qwen3-8b-lora-gpu",
  "dpo-qwen3-8b-gpu",
  "dpo-qwen3-8b-lora-gpu",
  "grpo-qwen3-8b-gpu",
  "grpo-qwen3-8b-lora-gpu",
)


@pytest.mark.parametrize(
  "preset",
  [
    pytest.param(
      n,
      marks=pytest.mark.skipif(
        n in LONG_GPU_PRESETS and os.environ.get("DT_LONG_TESTS") != "1",
        reason="a real-size compile of a kind CI compiles: DT_LONG_TESTS=1",
      ),
    )
    for n in sorted(config_lib.preset_names())
    if n.endswith("-gpu")
  ],
)
def test_every_shipped_gpu_preset_fits_its_gpus_as_the_trainer_checks_it(preset, tmp_path):
  """A user who runs a shipped GPU preset must not meet an out-of-memory: ``distrib-train plan`` compiles it with
  XLA's CUDA compiler for the GPUs of its mesh config (real cuDNN attention calls, no GPU needed), and the step
  fits the share of the card the trainer gives JAX (``XLA_PYTHON_CLIENT_MEM_FRACTION``,
  ``cluster/gpu_environment.py``) with the trainer's own allowance for cuDNN's workspace and autotuning
  (``train/checks.check_step_fits``, ``cluster/device_memory``)."""
  # cuBLAS's GEMMs rather than Triton's: on an H100 the 1b compiled to 54.19 GiB of temporaries, here 52.03 with
  # cuBLAS and 48.48 with Triton; and the 7b compiles in 40 s instead of 250 (bench/RESULTS.md).
  out = _plan(
    "--config",
    preset,
    "--json",
    str(tmp_path / "plan.json"),
    xla_flags=f"--xla_gpu_enable_triton_gemm=false {FAST_COMPILE}",
  )
  assert out.returncode == 0, out.stderr[-3000:]
  plan = json.loads((tmp_path / "plan.json").read_text())
  memory = plan["memory"]
  assert plan["compiler"] == "gpu" and memory["usable"] == int(memory["capacity"] * hardware.GPU_MEMORY_FRACTION)
  if not config_lib.load(preset).model_recipe().config.attention_sinks:  # gpt-oss's sinks: XLA tiles on GPU
    assert "__cudnn$fmhaSoftmaxBackward" in plan["custom_calls"], plan["custom_calls"]
    assert plan["flops"]["attention_kernels"] > 0, plan["flops"]  # counted from its causal pairs
  allowance = max(device_memory.CUDNN_ALLOWANCE_BYTES, int(device_memory.CUDNN_ALLOWANCE_FRACTION * memory["usable"]))
  assert memory["total"] + allowance <= memory["usable"], (memory, allowance)


def test_a_mixture_compiles_to_the_grouped_kernel_with_buffers_near_its_dense_twins(tmp_path):
  """The routed experts run in the Triton grouped GEMM on an H100 (XLA's ``ragged_dot`` would multiply every row
  by every expert), and the MoE step's temporaries stay within 1.3 × those of the dense model of equal active
  size (issue 34's shape with 2 of its 12 layers; with all 12: 1.29 × at B 8, 1.19 × at B 16)."""
  shape = [
    "--set",
    "data.source=synthetic",
    "--set",
    "data.seq_len=2048",
    "--set",
    "data.global_batch_size=8",
    "--set",
    "model.d_model=1024",
    "--set",
    "model.num_layers=2",
    "--set",
    "model.num_heads=16",
    "--set",
    "model.num_kv_heads=16",
    "--set",
    "model.head_dim=64",
    "--set",
    "model.max_seq_len=2048",
    "--set",
    "model.dtype=bfloat16",
    "--set",
    "model.vocab_size=32000",
    "--set",
    "model.fp8_min_dim=0",
    "--set",
    "model.loss_chunk_size=1024",
    "--mesh_config",
    "gpu-1",
    "--device_kind",
    "h100",
  ]
  figures = {}
  for name, config, width in (
    ("moe", "moe-tiny", ["--set", "model.expert_mlp_dim=2816"]),
    ("dense", "tiny", ["--set", "model.mlp_dim=5632"]),
  ):
    out = _plan("--config", config, *shape, *width, "--json", str(tmp_path / f"{name}.json"))
    assert out.returncode == 0, out.stderr
    figures[name] = json.loads((tmp_path / f"{name}.json").read_text())
  assert "__gpu$xla.gpu.triton" in figures["moe"]["custom_calls"], figures["moe"]["custom_calls"]
  assert figures["moe"]["memory"]["temporaries"] <= 1.3 * figures["dense"]["memory"]["temporaries"]
