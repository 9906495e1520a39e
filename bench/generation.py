"""Generation's figures: the decode step against its memory-bandwidth roofline, and tokens/s beside a reference.

Run from the repository root:

  python bench/generation.py tpu    # libtpu's compile for v5e-8, no TPU: Qwen3-8B at 64 × 4k, llama-7b-tpu at 16 × 4k
  python bench/generation.py prefill   # libtpu, no TPU: llama-7b-tpu's prefill beside its training step, the same tokens
  python bench/generation.py cpu    # CPU: tokens/s beside transformers' generate, the same model, threads and batch
  python bench/generation.py gpu    # a GPU: tokens/s at batch 64, beside vLLM on the same card when vllm is installed
  python bench/generation.py cpu --smoke   # a small run of the CPU rows (tests/test_bench.py)

**tpu.** The decode step (one token for every row over a cache of the
context's length: ``generation/cache.decode``) is compiled by libtpu for a
v5e-8 slice (``pip install 'jax[tpu]'``; nothing runs), tensor 8 (the kv
heads and the projections split over the chips), bf16 weights and cache.
At decode a step must read every weight and the whole cache once, so its
floor is (parameter bytes + cache bytes) per chip over the chip's HBM
bandwidth (v5e: 819 GB/s). Two of libtpu's own figures are set against
that floor (the target is ≥ 0.8): its cost analysis's bytes accessed
(which also counts what stays in VMEM, such as the scores, so it overstates
HBM's traffic), and the sum of the cycles its backend estimates for each
fusion, at the v5e's 1.5 GHz; both also less the copies that lay a weight
out anew for its product: in the engine's decode
``while`` loop they are loop-invariant, and libtpu hoists them out of the
loop (once a call, not once a step). The layers are
unrolled for the count (a loop's body is counted once). The shapes are the
issue's: ``qwen3-8b-gpu``'s model at batch 64 × 4,096 tokens and
``llama-7b-tpu``'s at 16 × 4,096. A third reading sets the cycles against
libtpu's own for a program that only reads the same arrays once (a layer's
slice at a time, summed): its cost model charges HBM reads below the
nominal bandwidth, so that floor is what any decode step's cycles could
reach.

**prefill.** ``--preset``'s training step as ``distrib-train plan``
compiles it with libtpu for its mesh config's topology (``llama-7b-tpu``:
v5e-256, fsdp 256, 256 × 4,096 tokens), and the prefill of the same rows
and tokens (``generation/cache.prefill`` into a cache of that length, bf16
weights, the same mesh and rules), each one's MFU by libtpu's own cycle
estimate (``podplan/hlo.estimated_cycles``: every instruction's, loop
bodies by their trips) at the chip's clock: model FLOPs (the plan's PaLM
count for the step; a third of it, the forward, for the prefill) over
that time at the chip's peak; and each program's own matmul FLOPs (the
step's remat recomputation included) over the same. The target: the
prefill within 10 % of the step's MFU.

**cpu.** A small random Llama (``--d_model``, ``--layers``, a 1,024-token
vocabulary) saved by transformers, read back by ``run_model`` as
``distrib-train generate --init_from hf:`` reads it: greedy, ``--batch``
prompts of ``--prompt`` tokens, ``--new`` new tokens, end ids off; both
sides on the same ``--threads`` (torch's intra-op threads; XLA's CPU
client's through its flags), the first call of each (compiles, warm-up)
not timed, then the median of ``--repeats``. It also checks that both
produce the same tokens.

**gpu.** The same timing on the GPU (bf16, the Qwen3-8B shape scaled by
``--layers``), and vLLM's ``LLM.generate`` on the same random weights when
vllm is installed (the row says so when it is not).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

V5E_BANDWIDTH = 819e9  # bytes/s per chip (cloud.google.com/tpu/docs/v5e)
V5E_CLOCK = 1.5e9  # Hz: 197 TFLOP/s bf16 over 4 MXUs of 128 × 128 multiply-adds
CLOCKS = {"v5e": V5E_CLOCK, "v5p": 1.75e9, "v4": 1.05e9}  # Hz, for libtpu's cycles (v5p, v4: their published clocks)


def _decode_step_bytes(preset: str, batch: int, context: int) -> dict:
  """libtpu's compile of one decode step for ``preset``'s model on v5e-8 (tensor 8): its bytes accessed and the
  roofline's bytes per chip."""
  import jax
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec

  from distrib_train.generation import cache as cache_lib
  from distrib_train.podplan import hlo, tpu
  from distrib_train.sharding.axis_rules import AxisRules, activation_sharding
  from distrib_train.sharding.mesh import MeshConfig
  from distrib_train.sharding.planner import MeshPlanner
  from distrib_train.sharding.topology import TpuTopology
  from distrib_train.train_state import TrainState
  from distrib_train.config import run as config_lib

  tpu.use_cpu_for_jax()
  model = config_lib.load(preset).model_recipe().config
  model = dataclasses.replace(model, dtype="bfloat16", param_dtype="bfloat16", remat="none", fp8="none")
  mesh = tpu.mesh(MeshConfig(("data", "fsdp", "tensor"), (1, 1, 8)), TpuTopology.parse("v5e:2x4"))
  rules = AxisRules("fsdp_tensor")
  make = lambda: TrainState.initial_state(model.build(0), optax.sgd(0.0), jax.random.key(0))
  state = MeshPlanner(mesh, rules).plan(jax.eval_shape(make)).abstract_train_state
  spec = cache_lib.cache_spec(model, batch, context)
  shardings = cache_lib.cache_shardings(model, batch, context, mesh, rules)
  cache = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), spec, shardings)
  replicated = NamedSharding(mesh, PartitionSpec())
  rows = jax.ShapeDtypeStruct((batch,), np.int32, sharding=replicated)
  index = jax.ShapeDtypeStruct((), np.int32, sharding=replicated)

  def step(state, cache, tokens, t, pads):
    with activation_sharding(mesh, rules):
      # unrolled: libtpu's cost analysis counts a loop's body once, not once per layer
      return cache_lib.decode(state.model, cache, tokens, t, pads, max_len=context, unroll=True)

  compiled = (
    jax.jit(step, donate_argnums=(1,), out_shardings=(None, shardings)).lower(state, cache, rows, index, rows).compile()
  )
  if os.environ.get("DT_BENCH_HLO"):  # the compiled program's text, to see where its bytes go
    with open(f"{os.environ['DT_BENCH_HLO']}.{preset}.hlo", "w") as f:
      f.write(compiled.as_text())
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  per_chip = lambda tree: sum(
    int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
  )
  params = per_chip(state.params) + per_chip(state.model_without_params)
  weight_shapes = {tuple(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(state.params)}
  computations, _ = hlo.parse_module(compiled.as_text())
  instructions = [i for c in computations.values() for i in c.instructions]
  # a weight laid out anew for its product (a copy of a parameter): loop-invariant in the engine's decode loop, which
  # the compiler hoists out of its ``while``: once a call, not once a step
  symbols = {i.name: i for i in instructions}
  relayouts = [
    i
    for i in instructions
    if i.op == "copy"
    and i.operands
    and getattr(symbols.get(i.operands[0]), "op", None) == "parameter"
    and _dims(i.shape) in weight_shapes
  ]
  hoisted = sum(_estimated_cycles(i) for i in relayouts)
  hoisted_bytes = sum(2 * hlo.array_bytes(i.shape) for i in relayouts)  # read and written
  return {
    "preset": preset,
    "batch": batch,
    "context": context,
    "param_bytes": params,
    "cache_bytes": per_chip(cache),
    "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
    "flops": float(cost.get("flops", 0.0)),
    "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
    "estimated_cycles": sum(_estimated_cycles(i) for i in instructions),
    "hoisted_cycles": hoisted,
    "hoisted_bytes": hoisted_bytes,
    "read_cycles": _read_floor((state.params, state.model_without_params, cache)),
    **_engine_decode(preset, state.model, mesh, rules, batch, context),
  }


def _read_floor(arrays) -> int:
  """libtpu's estimated cycles for a program that only reads ``arrays`` (each chip its shards) once: each stacked
  array a layer's slice at a time, as the decode step reads them, each slice summed. What libtpu's cost model
  charges for the bytes alone, whatever computes with them (module docstring)."""
  import jax
  import jax.numpy as jnp

  from distrib_train.podplan import hlo

  def read(tree):
    total = jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(tree):
      for part in [x[i] for i in range(x.shape[0])] if x.ndim >= 3 else [x]:
        total = total + part.astype(jnp.float32).sum()
    return total

  return hlo.estimated_cycles(jax.jit(read).lower(arrays).compile().as_text()) or float("nan")


def _dims(shape: str) -> tuple[int, ...]:
  from distrib_train.podplan import hlo

  return tuple(int(d) for d in hlo.ARRAY.search(shape).group(2).split(",") if d)


def _estimated_cycles(instruction) -> int:
  """libtpu's estimate of an instruction's cycles, in its backend config (0 where it gives none)."""
  found = re.search(r'"estimated_cycles":"(\d+)"', instruction.attrs)
  return int(found.group(1)) if found else 0


def _engine_decode(preset: str, model, mesh, rules, batch: int, context: int) -> dict:
  """The engine's own decode program (``Generator``: the ``while`` loop of steps over a scan of layers, the cache in
  the layout the compiler picks) for a cache of ``context`` tokens, half of them prompt: libtpu's estimated cycles a
  step (the step loop's body once, each nested loop's body by its trips) and a call (the rest: the entry's
  own work), and its temp bytes."""
  from distrib_train.generation.engine import Generator
  from distrib_train.generation.sampling import Sampling
  from distrib_train.podplan import hlo

  compiled = Generator(model, mesh=mesh, rules=rules)._decode_program(batch, context // 2, context, Sampling(), 1)
  if os.environ.get("DT_BENCH_HLO"):
    with open(f"{os.environ['DT_BENCH_HLO']}.{preset}.engine.hlo", "w") as f:
      f.write(compiled.as_text())
  computations, _ = hlo.parse_module(compiled.as_text())
  times = hlo.multiplicities(computations)  # the step loop's trips are dynamic: counted once, so one step
  own = {name: sum(_estimated_cycles(i) for i in c.instructions) for name, c in computations.items()}
  entry = next(name for name, c in computations.items() if c.is_entry)
  return {
    "engine_step_cycles": sum(times[name] * own[name] for name in computations if name != entry),
    "engine_call_cycles": own[entry],
    "engine_temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
  }


def tpu_rows(args) -> list[dict]:
  rows = []
  for preset, batch in (("qwen3-8b-gpu", 64), ("llama-7b-tpu", 16)):
    r = _decode_step_bytes(preset, batch, args.context)
    floor = r["param_bytes"] + r["cache_bytes"]
    r["roofline_ms"] = floor / V5E_BANDWIDTH * 1e3
    r["estimate_ms"] = r["bytes_accessed"] / V5E_BANDWIDTH * 1e3
    r["of_roofline"] = floor / r["bytes_accessed"]
    r["step_bytes_of_roofline"] = floor / (r["bytes_accessed"] - r["hoisted_bytes"])
    r["cycles_ms"] = r["estimated_cycles"] / V5E_CLOCK * 1e3
    r["cycles_of_roofline"] = r["roofline_ms"] / r["cycles_ms"]
    r["step_ms"] = (r["estimated_cycles"] - r["hoisted_cycles"]) / V5E_CLOCK * 1e3
    r["step_of_roofline"] = r["roofline_ms"] / r["step_ms"]
    r["engine_step_ms"] = r["engine_step_cycles"] / V5E_CLOCK * 1e3
    r["engine_of_roofline"] = r["roofline_ms"] / r["engine_step_ms"]
    r["read_ms"] = r["read_cycles"] / V5E_CLOCK * 1e3  # libtpu's time to only read the same bytes
    r["read_of_roofline"] = r["roofline_ms"] / r["read_ms"]
    r["step_of_read"], r["engine_of_read"] = r["read_ms"] / r["step_ms"], r["read_ms"] / r["engine_step_ms"]
    rows.append(r)
    print(
      f"{preset:14s} batch {batch:3d} × {args.context}: params {r['param_bytes'] / 2**30:.2f} GiB + cache"
      f" {r['cache_bytes'] / 2**30:.2f} GiB per chip → roofline {r['roofline_ms']:.2f} ms. libtpu: bytes"
      f" accessed {r['bytes_accessed'] / 2**30:.2f} GiB ({r['estimate_ms']:.2f} ms, {r['of_roofline']:.3f} ×), less the"
      f" weights' relayout the loop hoists {(r['bytes_accessed'] - r['hoisted_bytes']) / 2**30:.2f} GiB"
      f" ({r['step_bytes_of_roofline']:.3f} ×);"
      f" its fusions' estimated cycles {r['cycles_ms']:.2f} ms ({r['cycles_of_roofline']:.3f} ×), less the"
      f" weights' relayout the loop hoists {r['step_ms']:.2f} ms ({r['step_of_roofline']:.3f} ×); target ≥ 0.8;"
      f" temp {r['temp_bytes'] / 2**30:.2f} GiB. The engine's decode loop: {r['engine_step_ms']:.2f} ms a step"
      f" ({r['engine_of_roofline']:.3f} ×), {r['engine_call_cycles'] / V5E_CLOCK * 1e3:.2f} ms once a call, temp"
      f" {r['engine_temp_bytes'] / 2**30:.2f} GiB. Only reading the same bytes, by libtpu's cycles:"
      f" {r['read_ms']:.2f} ms ({r['read_of_roofline']:.3f} × the roofline); the step at {r['step_of_read']:.3f} ×"
      f" that, the engine's at {r['engine_of_read']:.3f} ×",
      flush=True,
    )
  return rows


def prefill_rows(args) -> list[dict]:
  import jax
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec

  from distrib_train.podplan import estimate
  from distrib_train.generation import cache as cache_lib
  from distrib_train.podplan import hlo, tpu
  from distrib_train.sharding.axis_rules import activation_sharding
  from distrib_train.sharding.mesh import MeshConfig, find_mesh_config
  from distrib_train.sharding.planner import MeshPlanner
  from distrib_train.train_state import TrainState
  from distrib_train.config import run as config_lib

  tpu.use_cpu_for_jax()
  config = config_lib.load(args.preset)
  mesh_config = MeshConfig.from_yaml(find_mesh_config(config.mesh_config))
  topology = mesh_config.topology
  kind = tpu.kind_of(topology)
  if kind.name not in CLOCKS:
    raise SystemExit(f"{args.preset}: no clock known for {kind.name} chips (bench/generation.py CLOCKS)")
  clock = CLOCKS[kind.name]
  pod = estimate.plan_pod(config, mesh_config, kind, topology.devices, config_name=args.preset, target=topology)
  if pod.estimated_cycles is None:
    raise SystemExit(f"{args.preset}: the plan's step was not compiled: {' '.join(pod.notes)[:300]}")
  step_s = pod.estimated_cycles / clock
  train_flops = pod.time.model_flops_per_device

  model = config.model_recipe().config
  model = dataclasses.replace(model, dtype="bfloat16", param_dtype="bfloat16", remat="none", fp8="none")
  batch, length = config.data.global_batch_size, config.data.seq_len
  mesh = tpu.mesh(mesh_config, topology)
  rules = estimate.rules_for(config, mesh_config)
  make = lambda: TrainState.initial_state(model.build(0), optax.sgd(0.0), jax.random.key(0))
  state = MeshPlanner(mesh, rules).plan(jax.eval_shape(make)).abstract_train_state
  spec = cache_lib.cache_spec(model, batch, length)
  shardings = cache_lib.cache_shardings(model, batch, length, mesh, rules)
  cache = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), spec, shardings)
  rows = NamedSharding(mesh, rules.spec(("batch", None), mesh=mesh))
  tokens = jax.ShapeDtypeStruct((batch, length), np.int32, sharding=rows)
  pads = jax.ShapeDtypeStruct((batch,), np.int32, sharding=NamedSharding(mesh, PartitionSpec()))

  def prefill(state, cache, tokens, pads):
    with activation_sharding(mesh, rules):
      return cache_lib.prefill(state.model, cache, tokens, pads, max_len=length)

  compiled = (
    jax.jit(prefill, donate_argnums=(1,), out_shardings=(None, shardings)).lower(state, cache, tokens, pads).compile()
  )
  prefill_s = (hlo.estimated_cycles(compiled.as_text()) or 0) / clock or float("nan")
  # the forward's third of the step's count, less the head at every position but each row's last (prefill's logits)
  head = 2 * model.vocab_size * model.d_model * (length - 1) * batch
  prefill_flops = (model.flops_per_token(length) / 3 * batch * length - head) / topology.devices
  peak = kind.peak_flops
  row = {
    "preset": args.preset,
    "topology": topology.name,
    "batch": batch,
    "length": length,
    "train_step_s": step_s,
    "train_mfu": train_flops / step_s / peak,
    "prefill_s": prefill_s,
    "prefill_mfu": prefill_flops / prefill_s / peak,
    # the programs' own matmul FLOPs (a remat's recomputed forward included): the share of peak they run at
    "train_hfu": pod.time.matmul_flops_per_device / step_s / peak,
    "prefill_hfu": sum(hlo.flops(compiled.as_text()).values()) / prefill_s / peak,
    "prefill_temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
  }
  row["ratio"] = row["prefill_mfu"] / row["train_mfu"]
  row["hfu_ratio"] = row["prefill_hfu"] / row["train_hfu"]
  print(
    f"{args.preset} on {topology.name} ({topology.devices} chips), {batch} × {length} tokens, by libtpu's"
    f" cycle estimate at {clock / 1e9:.2f} GHz: the training step {step_s * 1e3:.1f} ms, MFU"
    f" {row['train_mfu']:.3f}; the prefill {prefill_s * 1e3:.1f} ms, MFU {row['prefill_mfu']:.3f}:"
    f" {row['ratio']:.3f} × the step's (target 0.9-1.1 or above); of the programs' own matmul FLOPs (the"
    f" step's remat included) {row['train_hfu']:.3f} and {row['prefill_hfu']:.3f}: {row['hfu_ratio']:.3f} ×;"
    f" prefill temp {row['prefill_temp_bytes'] / 2**30:.2f} GiB",
    flush=True,
  )
  return [row]


def _random_llama(directory: str, d_model: int, layers: int, dtype: str = "float32"):
  import torch
  import transformers

  torch.manual_seed(0)
  config = transformers.LlamaConfig(
    vocab_size=1024,
    hidden_size=d_model,
    intermediate_size=d_model * 3,
    num_hidden_layers=layers,
    num_attention_heads=d_model // 64,
    num_key_value_heads=max(1, d_model // 256),
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    dtype=dtype,
  )
  model = transformers.LlamaForCausalLM(config).eval()
  model.save_pretrained(directory)
  return model


def _median_seconds(run, repeats: int) -> float:
  run()  # compiles and warms up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def cpu_rows(args) -> list[dict]:
  import numpy as np
  import torch

  from distrib_train.generation.engine import Generator
  from distrib_train.weights import load as run_model

  torch.set_num_threads(args.threads)
  directory = tempfile.mkdtemp(prefix="bench-generation-")
  reference = _random_llama(directory, args.d_model, args.layers)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 1024, size=args.prompt).tolist() for _ in range(args.batch)]
  loaded = run_model.load(f"hf:{directory}", mesh_config=None)
  generator = Generator(loaded.model, mesh=loaded.mesh, rules=loaded.rules)
  ours_out = {}

  def ours():
    ours_out["ids"] = [c.ids for c in generator.generate(prompts, max_new_tokens=args.new)]

  def theirs():
    with torch.no_grad():
      mask = torch.ones(args.batch, args.prompt, dtype=torch.long)
      out = reference.generate(
        torch.tensor(prompts),
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=args.new,
        min_new_tokens=args.new,
        eos_token_id=None,
        pad_token_id=0,
      )
    ours_out["theirs"] = out[:, args.prompt :].tolist()

  tokens = args.batch * args.new
  ours_s, theirs_s = _median_seconds(ours, args.repeats), _median_seconds(theirs, args.repeats)
  same = ours_out["ids"] == ours_out["theirs"]
  row = {
    "batch": args.batch,
    "prompt": args.prompt,
    "new": args.new,
    "d_model": args.d_model,
    "layers": args.layers,
    "threads": args.threads,
    "ours_tokens_per_s": tokens / ours_s,
    "transformers_tokens_per_s": tokens / theirs_s,
    "ratio": theirs_s / ours_s,
    "same_tokens": same,
  }
  print(
    f"CPU, {args.threads} threads, d {args.d_model} × {args.layers} layers, batch {args.batch}, prompt"
    f" {args.prompt}, {args.new} new: distrib_train {row['ours_tokens_per_s']:,.0f} tokens/s, transformers"
    f" {row['transformers_tokens_per_s']:,.0f} tokens/s: {row['ratio']:.2f} ×; the same tokens: {same}",
    flush=True,
  )
  return [row]


def gpu_rows(args) -> list[dict]:
  import numpy as np

  from distrib_train.generation.engine import Generator
  from distrib_train.weights import load as run_model

  directory = tempfile.mkdtemp(prefix="bench-generation-")
  _random_llama(directory, args.d_model, args.layers, dtype="bfloat16")
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 1024, size=args.prompt).tolist() for _ in range(args.batch)]
  loaded = run_model.load(f"hf:{directory}", dtype="bfloat16")
  generator = Generator(loaded.model, mesh=loaded.mesh, rules=loaded.rules)
  seconds = _median_seconds(lambda: generator.generate(prompts, max_new_tokens=args.new), args.repeats)
  row = {"batch": args.batch, "new": args.new, "ours_tokens_per_s": args.batch * args.new / seconds}
  print(f"GPU, batch {args.batch}: distrib_train {row['ours_tokens_per_s']:,.0f} tokens/s", flush=True)
  try:
    import vllm
  except ImportError:
    print("vLLM: not installed (pip install vllm): no side-by-side row", flush=True)
    return [row]
  llm = vllm.LLM(model=directory, dtype="bfloat16", skip_tokenizer_init=True)
  params = vllm.SamplingParams(temperature=0.0, max_tokens=args.new, min_tokens=args.new, ignore_eos=True)
  run = lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
  row["vllm_tokens_per_s"] = args.batch * args.new / _median_seconds(run, args.repeats)
  row["ratio"] = row["ours_tokens_per_s"] / row["vllm_tokens_per_s"]
  print(f"vLLM {row['vllm_tokens_per_s']:,.0f} tokens/s: distrib_train at {row['ratio']:.2f} × (target ≥ 0.8)")
  return [row]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("target", choices=("tpu", "prefill", "cpu", "gpu"))
  parser.add_argument("--preset", default="llama-7b-tpu", help="prefill: the TPU preset (its mesh config's topology)")
  parser.add_argument("--context", type=int, default=4096, help="tpu: the cache's tokens")
  parser.add_argument("--batch", type=int, default=None, help="cpu / gpu: prompts (default 8 / 64)")
  parser.add_argument("--prompt", type=int, default=32)
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--d_model", type=int, default=None, help="cpu / gpu: the random Llama's width (512 / 4096)")
  parser.add_argument("--layers", type=int, default=None, help="(4 / 8)")
  parser.add_argument(
    "--threads",
    type=int,
    default=os.cpu_count(),
    help="cpu: torch's threads (default: every core, which XLA's CPU client uses)",
  )
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--smoke", action="store_true", help="a small, quick run")
  parser.add_argument("--json", help="write the rows here")
  args = parser.parse_args(argv)
  gpu = args.target == "gpu"
  args.batch = args.batch or (64 if gpu else 8)
  args.d_model = args.d_model or (4096 if gpu else 512)
  args.layers = args.layers or (8 if gpu else 4)
  if args.smoke:
    args.batch, args.prompt, args.new, args.d_model, args.layers, args.repeats = 2, 8, 8, 128, 2, 1
  if args.target == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  rows = {"tpu": tpu_rows, "prefill": prefill_rows, "cpu": cpu_rows, "gpu": gpu_rows}[args.target](args)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
