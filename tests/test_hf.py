"""Hugging Face checkpoints in and out, against ``transformers`` (PyTorch, CPU) as the reference.

Each family's tiny model is created here with random weights (nothing is
downloaded), saved with ``save_pretrained``, imported onto an 8-device mesh
(data 2 × fsdp 2 × tensor 2: every device reads only its slices), and must give
transformers' logits (fp32, 1e-4); the export must load in transformers with
the same logits, and import → export must give the same tensors, bit for bit.
"""

import copy
import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

try:  # .ci/run installs them where PyTorch's CPU build is served (its Python 3.11 job, DT_REQUIRE_TORCH=1)
  import torch
  import transformers
except ImportError:
  if os.environ.get("DT_REQUIRE_TORCH") == "1":
    raise
  pytest.skip("transformers and torch are the reference here: pip install torch transformers", allow_module_level=True)

import distrib_train as dt
from distrib_train import recipes
from distrib_train.checkpoint import hf
from distrib_train.sharding.axis_rules import activation_sharding

COMMON = dict(
  vocab_size=128,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  max_position_embeddings=128,
  rms_norm_eps=1e-5,
)
_YARN = {
  "rope_type": "yarn",
  "factor": 4.0,
  "original_max_position_embeddings": 32,
  "beta_fast": 32.0,
  "beta_slow": 1.0,
}
FAMILIES = {
  "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0)),
  "llama3.1": (
    transformers.LlamaConfig,
    transformers.LlamaForCausalLM,
    dict(
      rope_theta=500000.0,
      tie_word_embeddings=True,
      rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
      },
    ),
  ),
  "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(rope_theta=1e6, sliding_window=None)),
  "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_theta=1e6, tie_word_embeddings=True)),
  "mixtral": (
    transformers.MixtralConfig,
    transformers.MixtralForCausalLM,
    dict(rope_theta=1e6, sliding_window=None, num_local_experts=4, num_experts_per_tok=2),
  ),
  "qwen2_moe": (
    transformers.Qwen2MoeConfig,
    transformers.Qwen2MoeForCausalLM,
    dict(
      rope_theta=1e6,
      num_experts=4,
      num_experts_per_tok=2,
      moe_intermediate_size=48,
      shared_expert_intermediate_size=80,
      norm_topk_prob=False,
    ),
  ),
  # q/k norms, no biases, an untied head
  "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(rope_theta=1e6)),
  # the router renormalised; layer 1 dense (mlp_only_layers): two segments
  "qwen3_moe": (
    transformers.Qwen3MoeConfig,
    transformers.Qwen3MoeForCausalLM,
    dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1]),
  ),
  # GeGLU, 1 + w sandwich norms, √d embeddings, q/k norms, local layers of a window of 8 (tokens are 64 long)
  # with their own RoPE base beside linearly scaled global ones, both soft caps, a tied head
  "gemma3": (
    transformers.Gemma3TextConfig,
    transformers.Gemma3ForCausalLM,
    dict(
      num_hidden_layers=4,
      layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
      sliding_window=8,
      query_pre_attn_scalar=24,
      attn_logit_softcapping=20.0,
      final_logit_softcapping=15.0,
      rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
      },
    ),
  ),
  # MLA (low-rank q, a kv latent, a decoupled interleaved RoPE part), YaRN with mscale, a dense first layer,
  # 8 experts in 4 groups (2 kept) with the score correction, a shared expert
  "deepseek_v3": (
    transformers.DeepseekV3Config,
    transformers.DeepseekV3ForCausalLM,
    dict(
      num_hidden_layers=3,
      num_key_value_heads=4,
      head_dim=None,
      q_lora_rank=32,
      kv_lora_rank=16,
      qk_rope_head_dim=8,
      qk_nope_head_dim=16,
      v_head_dim=16,
      n_routed_experts=8,
      num_experts_per_tok=2,
      n_group=4,
      topk_group=2,
      first_k_dense_replace=1,
      moe_intermediate_size=32,
      n_shared_experts=1,
      routed_scaling_factor=2.5,
      rope_parameters={**_YARN, "rope_theta": 1e4, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
  ),
  # sinks, sliding (8) and full layers, YaRN, q/k/v/o biases, router and expert biases, the clamped SwiGLU (a
  # low limit, so that the clamp bites)
  "gpt_oss": (
    transformers.GptOssConfig,
    transformers.GptOssForCausalLM,
    dict(
      num_local_experts=4,
      num_experts_per_tok=2,
      intermediate_size=48,
      sliding_window=8,
      swiglu_limit=0.5,
      rope_parameters={**_YARN, "rope_theta": 1.5e5, "truncate": False},
    ),
  ),
}
# What the import reads from each family's config.json, beside its shape.
EXPECTED = {
  "llama": {},
  "llama3.1": dict(tie_embeddings=True, rope_scaling="llama3"),
  "mistral": {},
  "qwen2": dict(attention_bias=True, tie_embeddings=True),
  "mixtral": {},
  "qwen2_moe": dict(attention_bias=True),
  "qwen3": dict(qk_norm=True),
  "qwen3_moe": dict(qk_norm=True, dense_layers=(1,)),
  "gemma3": dict(
    qk_norm=True,
    sandwich_norms=True,
    norm_weight_offset=1.0,
    scale_embeddings=True,
    mlp_activation="gelu_tanh",
    tie_embeddings=True,
    sliding_window=8,
    local_rope_theta=1e4,
    layer_types=("sliding", "sliding", "full", "sliding"),
    rope_scaling="linear",
  ),
  "deepseek_v3": dict(
    attention_kind="mla",
    router="sigmoid",
    router_groups=4,
    router_score_bias=True,
    dense_layers=(0,),
    rope_scaling="yarn",
    rope_interleave=True,
  ),
  "gpt_oss": dict(
    attention_bias=True,
    attention_sinks=True,
    router="softmax_topk",
    expert_bias=True,
    mlp_activation="swiglu_oss",
    layer_types=("sliding", "full"),
    rope_scaling="yarn",
  ),
}
MIXTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")


def _save(family, directory, dtype=torch.float32, shard="5GB", **changes):
  config_cls, model_cls, extra = FAMILIES[family]
  torch.manual_seed(0)
  fields = {k: v for k, v in {**COMMON, **extra, **changes}.items() if v is not None}
  model = model_cls(config_cls(**fields)).eval()
  with torch.no_grad():  # biases, norms, sinks and the score correction start at 0 / 1: make them count
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
      if any(word in name for word in ("bias", "norm", "sinks")) and p.is_floating_point():
        p.add_(torch.randn_like(p) * 0.1)
  model.to(dtype).save_pretrained(directory, max_shard_size=shard)
  return model


def _tokens():
  return np.random.default_rng(0).integers(0, COMMON["vocab_size"], size=(4, 64)).astype(np.int32)


def _rows_from_token_0():
  """Rows that each begin with token 0, as a BOS of id 0 begins them: Gemma 3's ``pad_token_id``, whose embedding
  row transformers zeroes. That token's hidden state then stays exactly zero through every layer, where each
  RMSNorm's derivative is 1/√eps: only an embedding that passes no gradient to the pad row (transformers'
  ``padding_idx``) keeps the gradient finite. The targets are the next tokens."""
  tokens = _tokens()
  tokens[:, 0] = 0
  return tokens, np.roll(tokens, -1, axis=1)


def _reference_logits(model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(np.array(tokens)).long()).logits.float().numpy()


def _reference_gradients(model, tokens, targets, directory):
  """transformers' mean cross-entropy over every position and its ``loss.backward()``: the gradient of each
  parameter, as ``save_pretrained`` names and lays out that parameter (experts fused in memory are written one
  by one; a tied head is the embedding's one parameter)."""
  model = copy.deepcopy(model)
  logits = model(torch.from_numpy(tokens).long()).logits.float()
  torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(targets).long().flatten()).backward()
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
  model.save_pretrained(directory)
  buffers = {name for name, _ in model.named_buffers()}  # DeepSeek-V3's score correction: state, not trained
  saved = hf.SafetensorsDirectory(str(directory))
  return {name: saved.read(name).astype(np.float32) for name in saved.tensors if name not in buffers}


def assert_gradients_equal(ours, reference, rtol=1e-4):
  """The same gradient: the global norm of the difference, and each tensor's, within ``rtol`` of the reference's
  norm."""
  assert set(reference) <= set(ours), sorted(set(reference) - set(ours))
  norm = lambda a: float(np.sqrt(np.sum(np.square(a, dtype=np.float64))))
  assert all(np.isfinite(ours[name]).all() for name in reference), [
    n for n in reference if not np.isfinite(ours[n]).all()
  ]
  total = math.sqrt(sum(norm(reference[n]) ** 2 for n in reference))
  difference = math.sqrt(sum(norm(ours[n] - reference[n]) ** 2 for n in reference))
  assert difference <= rtol * total, (difference, total)
  worst = {n: norm(ours[n] - reference[n]) / norm(reference[n]) for n in reference if norm(reference[n]) > 0}
  assert max(worst.values()) <= rtol, sorted(worst.items(), key=lambda item: -item[1])[:5]
  assert all(norm(ours[n]) == 0 for n in reference if norm(reference[n]) == 0)


def _recipe(config):
  return recipes.moe if isinstance(config, recipes.moe.MoEConfig) else recipes.llama


def _import(directory):
  config = hf.llama_config(directory, dtype="float32", attention="xla")
  if isinstance(config, recipes.moe.MoEConfig):  # the loss is the cross-entropy alone, as transformers' is here
    config = dataclasses.replace(config, aux_loss_weight=0.0, z_loss_weight=0.0)
  model = config.build(0)
  planner = dt.MeshPlanner(dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (2, 2, 2))), "fsdp_tensor")
  state, plan = planner.init(
    lambda: dt.TrainState.initial_state(model, optax.sgd(0.0), jax.random.key(0)),
    loss_fn=_recipe(config).loss_fn,
    inputs={"tokens": _tokens(), "targets": _tokens()},
    input_axes=recipes.llama.INPUT_AXES,
  )
  abstract = plan.abstract_train_state
  params = hf.load_params(directory, abstract.params, config)
  local_state = hf.load_params(directory, abstract.local_state, config, fresh=state.local_state)
  return config, state.replace(params=params, local_state=local_state), plan, planner.rules


def _logits(state, plan, rules, tokens):
  @jax.jit
  def forward(state, tokens):
    model = state.model
    return model.logits(model(tokens))

  with activation_sharding(plan.mesh, rules):
    return np.asarray(forward(state, jnp.asarray(tokens)))


def _logits_and_gradients(config, state, plan, rules, tokens, batch):
  """The logits of ``tokens``, and the gradient of the run's loss function on ``batch`` (tokens, targets) as
  Hugging Face tensors: one program, on the plan's shardings."""
  model_without_params = state.model_without_params

  def loss(params, inputs):
    model = dt.models.merge_model(model_without_params, params, state.local_state)
    return _recipe(config).loss_fn(model=model, state=None, rng=None, **inputs)[0]

  def forward_and_backward(params, tokens, inputs):
    model = dt.models.merge_model(model_without_params, params, state.local_state)
    return model.logits(model(tokens)), jax.grad(loss)(params, inputs)

  place = lambda a, key: jax.device_put(a, plan.input_kwarg_shardings[key])
  inputs = {"tokens": place(batch[0], "tokens"), "targets": place(batch[1], "targets")}
  with activation_sharding(plan.mesh, rules):
    logits, grads = jax.jit(forward_and_backward)(state.params, jnp.asarray(tokens), inputs)
  return np.asarray(logits), hf.hf_tensors(grads, config, local_state=state.local_state)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_gives_transformers_logits_and_gradients_and_export_loads_back_bit_for_bit(family, tmp_path):
  """The logits, and the loss's gradient for every tensor on rows that begin with token 0 (``_rows_from_token_0``),
  are transformers' on 8 devices (fp32); the export loads back in transformers with the same tensors."""
  reference = _save(family, tmp_path / "hf")
  tokens = _tokens()
  config, state, plan, rules = _import(str(tmp_path / "hf"))
  assert isinstance(config, recipes.moe.MoEConfig) == (family in MIXTURES)
  defaults = recipes.moe.MoEConfig()
  for key in ("attention_bias", "tie_embeddings", "rope_scaling", *EXPECTED[family]):
    assert getattr(config, key) == EXPECTED[family].get(key, getattr(defaults, key)), key
  planned = jax.tree_util.tree_leaves(plan.train_state_shardings.params)
  for leaf, sharding in zip(jax.tree_util.tree_leaves(state.params), planned, strict=True):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)  # read onto the plan's shards
  batch = _rows_from_token_0()
  logits, gradients = _logits_and_gradients(config, state, plan, rules, tokens, batch)
  np.testing.assert_allclose(logits, _reference_logits(reference, tokens), rtol=1e-4, atol=1e-4)
  assert_gradients_equal(gradients, _reference_gradients(reference, *batch, tmp_path / "gradients"))

  hf.save(state.params, config, str(tmp_path / "out"), local_state=state.local_state, max_shard_bytes=64 << 10)
  exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  np.testing.assert_allclose(
    _reference_logits(exported, tokens), _reference_logits(reference, tokens), rtol=1e-5, atol=1e-5
  )
  original = hf.SafetensorsDirectory(str(tmp_path / "hf"))
  again = hf.SafetensorsDirectory(str(tmp_path / "out"))
  assert (tmp_path / "out" / "model.safetensors.index.json").exists()  # sharded at 64 KiB
  names = [n for n in original.tensors if not (config.tie_embeddings and n == "lm_head.weight")]
  assert sorted(names) == sorted(again.tensors)
  assert hf.tensors_equal({n: original.read(n) for n in names}, {n: again.read(n) for n in names})


def test_bfloat16_checkpoints_import_as_their_values(tmp_path):
  reference = _save("llama", tmp_path / "bf16", dtype=torch.bfloat16)
  _, state, _, _ = _import(str(tmp_path / "bf16"))
  embed = reference.model.embed_tokens.weight.float().detach().numpy()
  np.testing.assert_array_equal(np.asarray(state.params["embed"][...]), embed)


@pytest.mark.parametrize(
  "edit, message",
  [
    ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not one this importer reads"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}}, "RoPE scaling 'longrope'"),
    (
      {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
      "rope_parameters has no 'original_max_position_embeddings', which yarn scaling needs",
    ),
    (
      {"intermediate_size": 100},
      r"tensor .model.layers.0.mlp.\w+_proj.weight. has shape \(\d+, \d+\), the config says",
    ),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config 'mxfp4': quantized weights"),
  ],
)
def test_what_the_importer_cannot_read_is_named(edit, message, tmp_path):
  _save("llama", tmp_path / "hf")
  path = tmp_path / "hf" / "config.json"
  path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
  with pytest.raises(hf.HfCheckpointError, match=message):
    _import(str(tmp_path / "hf"))


def test_a_tensor_the_importer_would_leave_unread_is_refused_naming_it(tmp_path):
  from safetensors.numpy import save_file

  _save("llama", tmp_path / "hf")
  save_file(
    {"model.layers.1.self_attn.o_proj.bias": np.zeros(64, np.float32)}, str(tmp_path / "hf" / "extra.safetensors")
  )
  with pytest.raises(
    hf.HfCheckpointError,
    match=r"tensor 'model.layers.1.self_attn.o_proj.bias' is not read by the"
    r" llama importer",
  ):
    _import(str(tmp_path / "hf"))


def test_fine_tuning_starts_from_the_imported_weights_whose_eval_loss_is_transformers_loss(tmp_path):
  # A Llama with the byte vocabulary, so the demo corpus (pydoc) feeds it as it is.
  config_cls, model_cls, extra = FAMILIES["llama"]
  torch.manual_seed(0)
  reference = model_cls(config_cls(**{**COMMON, "vocab_size": 256}, **extra)).eval()
  reference.save_pretrained(tmp_path / "hf")
  from distrib_train import data
  from distrib_train.config import run as config_lib
  from distrib_train.train.trainer import Trainer

  config = config_lib.load(
    "tiny",
    [
      "data.seq_len=64",
      "data.global_batch_size=8",
      "data.packing=false",
      "train.steps=1",
      "train.eval_batches=2",
      "train.async_checkpoint=false",
      "train.compilation_cache_dir=",
      "model.dtype=float32",
      "model.attention=xla",
      "optimizer.name=sgd",
      "optimizer.learning_rate=1e-30",
      f"train.init_from=hf:{tmp_path / 'hf'}",
    ],
  )
  recipe = config.model_recipe().config
  assert (recipe.d_model, recipe.mlp_dim, recipe.num_kv_heads) == (64, 96, 2)  # the checkpoint's shape
  result = Trainer(config, tmp_path / "run", console=False).run()
  assert result.status == "finished"
  # transformers' loss on the same held-out batches (lr 1e-30: the step leaves the weights as imported).
  mesh = dt.build_mesh(dt.MeshConfig(("data",), (8,)))
  shardings = {
    k: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    for k in data.DataLoader.batch_schema(config.data_config())
  }
  loader = data.DataLoader(config.data_config(), shardings, split="eval", num_epochs=1)
  total = count = 0.0
  for _, batch in zip(range(2), loader):
    logits = torch.from_numpy(_reference_logits(reference, np.asarray(batch["tokens"])))
    losses = torch.nn.functional.cross_entropy(
      logits.transpose(1, 2), torch.from_numpy(np.array(batch["targets"])).long(), reduction="none"
    ).numpy()
    weights = np.asarray(batch["weights"])
    total, count = total + float((losses * weights).sum()), count + float(weights.sum())
  loader.close()
  np.testing.assert_allclose(result.eval_loss, total / count, rtol=1e-5)
  metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  evals = [m for m in metrics if "eval/loss" in m]
  np.testing.assert_allclose(evals[-1]["eval/perplexity"], np.exp(evals[-1]["eval/loss"]), rtol=1e-6)

  # Back out through the CLI: the run's params (unchanged by the 1e-30 step) as the same tensors.
  import subprocess
  import sys

  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "distrib_train",
      "export",
      "--workdir",
      str(tmp_path / "run"),
      "--out",
      str(tmp_path / "exported"),
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  original, exported = (
    hf.SafetensorsDirectory(str(tmp_path / "hf")),
    hf.SafetensorsDirectory(str(tmp_path / "exported")),
  )
  assert hf.tensors_equal(
    {n: original.read(n) for n in original.tensors}, {n: exported.read(n) for n in exported.tensors}
  )
  again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
  tokens = np.random.default_rng(1).integers(0, 256, size=(2, 32)).astype(np.int32)
  np.testing.assert_allclose(
    _reference_logits(again, tokens), _reference_logits(reference, tokens), rtol=1e-5, atol=1e-5
  )
  bad = subprocess.run(
    [
      sys.executable,
      "-m",
      "distrib_train",
      "export",
      "--workdir",
      str(tmp_path / "nowhere"),
      "--out",
      str(tmp_path / "x"),
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert bad.returncode == 2 and "is not a distrib_train run (no config.yaml)" in bad.stderr
  assert not (tmp_path / "x").exists()


def test_two_processes_each_read_only_their_half_and_give_transformers_logits(tmp_path):
  import pathlib

  import mp_harness

  reference = _save("llama", tmp_path / "hf")
  results = mp_harness.run_workers(
    pathlib.Path(__file__).parent / "workers" / "hf_worker.py", str(tmp_path / "hf"), timeout=300
  )
  tokens = np.random.default_rng(0).integers(0, COMMON["vocab_size"], size=(4, 32)).astype(np.int32)
  want = _reference_logits(reference, tokens)
  for r in results:
    np.testing.assert_allclose(np.asarray(r.result["logits"]), want, rtol=1e-4, atol=1e-4)
    # fsdp spans the processes: each reads about half the model (norms and replicated pieces in full).
    assert r.result["read"] < 0.7 * r.result["total"], (r.result["read"], r.result["total"])


def _cli(*args):
  import subprocess
  import sys

  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
    [sys.executable, "-m", "distrib_train", *args], capture_output=True, text=True, timeout=600, env=env
  )


def _transformers_loss(model, data_config, batches=2):
  """transformers' mean cross-entropy over the first held-out batches the trainer evaluates on."""
  from distrib_train import data

  mesh = dt.build_mesh(dt.MeshConfig(("data",), (8,)))
  shardings = {
    k: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    for k in data.DataLoader.batch_schema(data_config)
  }
  total = count = 0.0
  with data.DataLoader(data_config, shardings, split="eval", num_epochs=1) as loader:
    for _, batch in zip(range(batches), loader):
      logits = torch.from_numpy(_reference_logits(model, np.asarray(batch["tokens"])))
      losses = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), torch.from_numpy(np.array(batch["targets"])).long(), reduction="none"
      ).numpy()
      weights = np.asarray(batch["weights"])
      total, count = total + float((losses * weights).sum()), count + float(weights.sum())
  return total / count


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gemma3", "deepseek_v3", "gpt_oss"])
def test_the_cli_starts_each_family_from_transformers_weights_with_its_loss_and_exports_them_back(family, tmp_path):
  """A tiny random model saved by transformers (bf16, sharded) through ``distrib-train --init_from hf:`` on 8
  emulated devices (the mixtures with an expert axis): the run's held-out loss is transformers' on the same
  batches (fp32 both sides), and ``distrib-train export`` writes a checkpoint transformers loads with the same
  logits and the same tensors."""
  from distrib_train.config import run as config_lib

  _save(family, tmp_path / "hf", dtype=torch.bfloat16, shard="60KB", vocab_size=256)
  assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
  reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
  overrides = [
    "data.seq_len=64",
    "data.global_batch_size=8",
    "data.packing=false",
    "train.steps=1",
    "train.eval_batches=2",
    "train.async_checkpoint=false",
    "train.compilation_cache_dir=",
    "model.dtype=float32",
    "model.attention=xla",
    "optimizer.name=sgd",
    "optimizer.learning_rate=1e-30",
  ]
  mesh = ["--mesh_config", "cpu-8-expert"] if family in MIXTURES else []
  run = _cli(
    "--config",
    "tiny",
    "--workdir",
    str(tmp_path / "run"),
    "--cpu_devices",
    "8",
    "--init_from",
    f"hf:{tmp_path / 'hf'}",
    *mesh,
    *[f"--set={o}" for o in overrides],
  )
  assert run.returncode == 0, run.stderr[-3000:]
  evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  key = "eval/cross_entropy" if family in MIXTURES else "eval/loss"  # a mixture's loss adds its routing losses
  loss = [m[key] for m in evals if key in m][-1]
  config = config_lib.load("tiny", [*overrides, f"train.init_from=hf:{tmp_path / 'hf'}"])
  np.testing.assert_allclose(loss, _transformers_loss(reference, config.data_config()), rtol=1e-4)

  out = _cli("export", "--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "exported"))
  assert out.returncode == 0, out.stderr[-2000:]
  exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
  tokens = np.random.default_rng(1).integers(0, 256, size=(2, 32)).astype(np.int32)
  np.testing.assert_allclose(
    _reference_logits(exported, tokens), _reference_logits(reference, tokens), rtol=1e-5, atol=1e-5
  )
  original = hf.SafetensorsDirectory(str(tmp_path / "hf"))
  again = hf.SafetensorsDirectory(str(tmp_path / "exported"))
  assert hf.tensors_equal(
    {n: original.read(n).astype(np.float32) for n in original.tensors}, {n: again.read(n) for n in original.tensors}
  )


def _first_training_batch(data_config):
  from distrib_train import data

  mesh = dt.build_mesh(dt.MeshConfig(("data",), (8,)))
  shardings = {
    k: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    for k in data.DataLoader.batch_schema(data_config)
  }
  with data.DataLoader(data_config, shardings, split="train") as loader:
    return {k: np.array(v) for k, v in next(iter(loader)).items()}  # writable: torch.from_numpy needs it


def test_gemma3_from_transformers_fine_tunes_with_transformers_gradient(tmp_path):
  """The Gemma 3 fine-tune a user runs: a BPE whose ``<s>`` is id 0, Gemma 3's ``pad_token_id`` (row zeroed by
  transformers), begins every row; ``--init_from hf:`` a bf16 sharded checkpoint on 8 devices with AdamW. Every
  step's gradient norm is finite, the first one is transformers' ``loss.backward()`` on the same batch, and the loss
  falls."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  from data_helpers import write_corpus
  from distrib_train.config import run as config_lib

  corpus = write_corpus(tmp_path)
  bpe = tokenizers.Tokenizer(models.BPE())
  bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
  bpe.train(
    [corpus],
    trainers.BpeTrainer(
      vocab_size=320, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    ),
  )
  assert bpe.token_to_id("<s>") == 0
  reference = _save("gemma3", tmp_path / "hf", dtype=torch.bfloat16, shard="60KB", vocab_size=bpe.get_vocab_size())
  assert reference.config.pad_token_id == 0 and not reference.model.embed_tokens.weight[0].any()
  bpe.save(str(tmp_path / "hf" / "tokenizer.json"))
  overrides = [
    "data.source=text",
    f"data.paths={corpus}",
    f"data.tokenizer=hf:{tmp_path / 'hf' / 'tokenizer.json'}",
    "data.bos_token=<s>",
    "data.seq_len=16",
    "data.global_batch_size=8",
    "data.packing=false",
    "train.steps=4",
    "train.log_every=1",
    "train.eval_every=0",
    "train.async_checkpoint=false",
    "train.compilation_cache_dir=",
    "model.dtype=float32",
    "model.attention=xla",
    "optimizer.name=adamw",
    "optimizer.learning_rate=3e-3",
    "optimizer.warmup_steps=0",
  ]
  run = _cli(
    "--config",
    "tiny",
    "--workdir",
    str(tmp_path / "run"),
    "--cpu_devices",
    "8",
    "--init_from",
    f"hf:{tmp_path / 'hf'}",
    *[f"--set={o}" for o in overrides],
  )
  assert run.returncode == 0, run.stderr[-3000:]
  steps = [
    m for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "grad_norm" in m
  ]
  assert [m["step"] for m in steps] == [1, 2, 3, 4] and all(math.isfinite(m["grad_norm"]) for m in steps), steps

  config = config_lib.load("tiny", [*overrides, f"train.init_from=hf:{tmp_path / 'hf'}"])
  batch = _first_training_batch(config.data_config())
  assert (batch["tokens"][:, 0] == 0).all()
  reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
  logits = reference(torch.from_numpy(batch["tokens"]).long()).logits.float()
  losses = torch.nn.functional.cross_entropy(
    logits.transpose(1, 2), torch.from_numpy(batch["targets"]).long(), reduction="none"
  )
  weights = torch.from_numpy(batch["weights"]).float()
  loss = (losses * weights).sum() / weights.sum()
  loss.backward()
  grad_norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in reference.parameters()))
  np.testing.assert_allclose([steps[0]["loss"], steps[0]["grad_norm"]], [loss.item(), grad_norm], rtol=1e-4)
  assert steps[-1]["loss"] < steps[0]["loss"]


def test_sft_eval_loss_of_an_imported_model_is_transformers_loss_on_the_assistant_tokens(tmp_path):
  """SFT from transformers' weights with the tokenizer's own chat template (Llama 3's style, no generation
  blocks: the turns found by rendering prefixes), conversations packed into rows on 8 emulated devices: the
  held-out loss is transformers' on each conversation alone with labels -100 off the assistant tokens (its
  own ``apply_chat_template`` mask, from the same template with the turns marked)."""
  from chat_helpers import LLAMA3, LLAMA3_MARKED, bpe_tokenizer, manual_conversations, texts_of, tokenizer_dir

  from distrib_train.data import splits
  from distrib_train.config import run as config_lib

  # A long system turn of one repeated token: its targets' losses differ from the answers', so a loss that also
  # read the prompts would differ from transformers' on the assistant tokens.
  system = {"role": "system", "content": "Rule: " + "=" * 160}
  records = [
    {**r, "messages": [system, *r["messages"][-2:]]}
    if "messages" in r
    else {**r, "prompt": [system, *r["prompt"][-1:]]}
    for r in manual_conversations()
  ]
  (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  directory = tokenizer_dir(tmp_path / "hf", bpe_tokenizer(texts_of(records), 512), "llama3", LLAMA3)
  size = transformers.AutoTokenizer.from_pretrained(str(directory)).__len__()
  reference = _save("llama", tmp_path / "hf", vocab_size=size, max_position_embeddings=512, initializer_range=0.3)
  overrides = [
    "data.source=text",
    f"data.paths={tmp_path / 'chat.jsonl'}",
    f"data.tokenizer=hf:{directory / 'tokenizer.json'}",
    "data.loss_on=assistant",
    "data.seq_len=512",
    "data.global_batch_size=8",
    "data.eval_fraction=0.25",
    "train.steps=1",
    "train.eval_batches=0",
    "train.async_checkpoint=false",
    "train.compilation_cache_dir=",
    "model.dtype=float32",
    "model.attention=xla",
    "optimizer.name=sgd",
    "optimizer.learning_rate=1e-30",
  ]
  run = _cli(
    "--config",
    "tiny",
    "--workdir",
    str(tmp_path / "run"),
    "--cpu_devices",
    "8",
    "--init_from",
    f"hf:{tmp_path / 'hf'}",
    *[f"--set={o}" for o in overrides],
  )
  assert run.returncode == 0, run.stderr[-3000:]
  evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  loss = [m["eval/loss"] for m in evals if "eval/loss" in m][-1]

  config = config_lib.load("tiny", [*overrides, f"train.init_from=hf:{tmp_path / 'hf'}"]).data_config()
  docs, held_out, _ = splits.split_documents(config, "eval", 1, None)
  tok = transformers.AutoTokenizer.from_pretrained(str(directory))
  total = count = 0.0
  for index in held_out:
    record = json.loads(docs[int(index)])
    messages = record.get("messages") or record["prompt"] + record["completion"]
    out = tok.apply_chat_template(
      messages, chat_template=LLAMA3_MARKED, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = np.asarray(out["input_ids"]), np.asarray(out["assistant_masks"])
    labels = torch.from_numpy(np.where(mask == 1, ids, -100)).long()[None]
    with torch.no_grad():
      logits = reference(torch.from_numpy(ids).long()[None]).logits.float()
    losses = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")
    total, count = total + float(losses), count + int((labels[0, 1:] != -100).sum())
  assert len(held_out) == 12 and count > 0
  # fp32 both sides: 1e-7 apart; the loss of every token (prompts too) is 2e-4 away.
  np.testing.assert_allclose(loss, total / count, rtol=2e-5)


def test_lora_from_transformers_weights_exports_a_merged_model_and_a_peft_adapter_with_the_runs_logits(tmp_path):
  """LoRA through the CLI from a model transformers saved (8 devices, attention and MLP targets): the base is
  imported frozen, three steps train the adapters, and ``distrib-train export`` writes the merged model:
  transformers' logits of it equal the run's adapted model's, and it differs from the original checkpoint by a
  rank-4 product in each adapted weight and not at all elsewhere; ``export --adapter`` writes a PEFT adapter that
  PEFT loads onto that model (``base_model_name_or_path``) with the run's logits; a run without LoRA is refused
  with one error line, nothing written."""
  try:  # .ci/run installs it beside torch
    import peft
  except ImportError:
    if os.environ.get("DT_REQUIRE_TORCH") == "1":
      raise
    pytest.skip("peft loads the adapter here: pip install peft")
  from distrib_train.checkpoint import checks
  from distrib_train.checkpoint.manager import CheckpointManager
  from distrib_train.config import run as config_lib
  from distrib_train.weights import init_from

  _save("llama", tmp_path / "hf", vocab_size=256)
  overrides = [
    "data.seq_len=64",
    "data.global_batch_size=8",
    "data.packing=false",
    "train.steps=3",
    "train.eval_every=0",
    "train.async_checkpoint=false",
    "train.compilation_cache_dir=",
    "model.dtype=float32",
    "model.attention=xla",
    "optimizer.name=adamw",
    "optimizer.learning_rate=3e-2",
    "model.lora.rank=4",
    "model.lora.alpha=8",
    "model.lora.targets=q,v,o,down",
    "model.lora.dropout=0.05",
  ]
  run = _cli(
    "--config",
    "tiny",
    "--workdir",
    str(tmp_path / "run"),
    "--cpu_devices",
    "8",
    "--init_from",
    f"hf:{tmp_path / 'hf'}",
    *[f"--set={o}" for o in overrides],
  )
  assert run.returncode == 0, run.stderr[-3000:]
  config = config_lib.load(str(tmp_path / "run" / "config.yaml"))
  model = config.model_recipe().config
  make = lambda: dt.TrainState.initial_state(
    model.build(0), optax.sgd(0.0), jax.random.key(0), is_param=model.trainable()
  )
  # The checkpoint holds the adapters, and names the base it read (its frozen weights are read from there).
  meta = checks.read_meta(tmp_path / "run" / "checkpoints", 3)
  assert "model_without_params" not in checks.held_fields(meta)
  assert meta["run"]["frozen_source"]["init_from"]["path"] == str(tmp_path / "hf")
  fresh = make()
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x, fresh
  )
  base_state = init_from.with_frozen(config, meta["run"]["frozen_source"], abstract, fresh)
  with CheckpointManager(tmp_path / "run" / "checkpoints", async_save=False) as manager:
    state = manager.restore(base_state, params_only=True)
  tokens = np.random.default_rng(1).integers(0, 256, size=(2, 32)).astype(np.int32)
  adapted = state.model
  ours = np.asarray(adapted.logits(adapted(jnp.asarray(tokens))))

  out = _cli("export", "--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "merged"))
  assert out.returncode == 0, out.stderr[-2000:]
  merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
  np.testing.assert_allclose(_reference_logits(merged, tokens), ours, rtol=1e-4, atol=1e-4)
  original, written = hf.SafetensorsDirectory(str(tmp_path / "hf")), hf.SafetensorsDirectory(str(tmp_path / "merged"))
  changed = []
  for name in original.tensors:
    difference = written.read(name).astype(np.float64) - original.read(name).astype(np.float64)
    if np.abs(difference).max() > 1e-6:
      changed.append(name)
      assert np.linalg.matrix_rank(difference, tol=1e-5) <= 4, name
  adapted_weights = ("q_proj.weight", "v_proj.weight", "o_proj.weight", "down_proj.weight")
  assert changed and all(n.endswith(adapted_weights) for n in changed), changed

  out = _cli("export", "--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "adapter"), "--adapter")
  assert out.returncode == 0, out.stderr[-2000:]
  assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
  written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert written["base_model_name_or_path"] == str(tmp_path / "hf")
  assert (written["r"], written["lora_alpha"], written["lora_dropout"]) == (4, 8, 0.05)
  assert written["peft_type"] == "LORA"
  assert sorted(written["target_modules"]) == ["down_proj", "o_proj", "q_proj", "v_proj"]
  base = transformers.AutoModelForCausalLM.from_pretrained(written["base_model_name_or_path"])
  loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
  np.testing.assert_allclose(_reference_logits(loaded, tokens), ours, rtol=1e-4, atol=1e-4)
  with loaded.disable_adapter():  # the adapters matter: the base alone gives other logits
    assert np.abs(_reference_logits(loaded, tokens) - ours).max() > 1e-3

  # The same run's config without LoRA: refused before its (LoRA) checkpoint is read.
  (tmp_path / "plain").mkdir()
  (tmp_path / "plain" / "config.yaml").write_text(
    (tmp_path / "run" / "config.yaml").read_text().replace("lora_rank: 4\n", "lora_rank: 0\n")
  )
  refused = _cli("export", "--workdir", str(tmp_path / "plain"), "--out", str(tmp_path / "none"), "--adapter")
  assert refused.returncode == 2 and refused.stderr.count("distrib-train: error:") == 1, refused.stderr[-2000:]
  assert "--adapter" in refused.stderr and not (tmp_path / "none").exists()


def _dpo_logps(model, ids, mask):
  """transformers' summed log-probabilities of a sequence's scored targets (the sequence alone)."""
  with torch.no_grad():
    logits = model(torch.from_numpy(ids[None].astype(np.int64))).logits.float()[0, :-1]
  per_target = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.from_numpy(ids[1:]).long()]
  return float(per_target[torch.from_numpy(mask[1:])].double().sum())


def test_dpo_eval_loss_from_hf_checkpoints_is_the_formula_on_transformers_logprobs(tmp_path):
  """DPO from one checkpoint transformers saved with another as ``dpo.reference``, pairs packed into rows on 8
  emulated devices: the held-out loss is the DPO formula on transformers' log-probabilities of each sequence of
  each pair, policy and reference."""
  pytest.importorskip("jinja2")
  from test_dpo import _records

  from distrib_train.data import splits
  from distrib_train.data.chat import CHATML, ChatEncoder, ChatTemplate, Utf8Bytes
  from distrib_train.data.preference import encode_pair
  from distrib_train.config import run as config_lib
  from distrib_train.train.trainer import Trainer

  policy = _save("llama", tmp_path / "policy", vocab_size=256, max_position_embeddings=512)
  reference = _save("llama", tmp_path / "reference", vocab_size=256, max_position_embeddings=512)
  with torch.no_grad():  # another model of the same shape
    generator = torch.Generator().manual_seed(1)
    for p in reference.parameters():
      p.add_(torch.randn(p.shape, generator=generator) * 0.02)
  reference.save_pretrained(tmp_path / "reference")
  (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
  overrides = [
    "train.objective=dpo",
    "dpo.beta=0.3",
    f"dpo.reference=hf:{tmp_path / 'reference'}",
    f"train.init_from=hf:{tmp_path / 'policy'}",
    "data.source=text",
    f"data.paths={tmp_path / 'prefs.jsonl'}",
    "data.text_field=*",
    "data.seq_len=512",
    "data.global_batch_size=8",
    "data.eval_fraction=0.25",
    "train.steps=1",
    "train.eval_batches=0",
    "train.async_checkpoint=false",
    "train.compilation_cache_dir=",
    "model.dtype=float32",
    "model.attention=xla",
    "optimizer.name=sgd",
    "optimizer.learning_rate=1e-30",
  ]
  config = config_lib.load("tiny", overrides)
  result = Trainer(config, tmp_path / "run", console=False).run()  # 8 emulated devices

  docs, held_out, _ = splits.split_documents(config.data_config(), "eval", 1, None)
  encoder = ChatEncoder(ChatTemplate(CHATML, "chatml"), Utf8Bytes(), "completion")
  losses = []
  for index in held_out:
    (c, cm), (r, rm) = encode_pair(encoder, json.loads(docs[int(index)]))
    h = 0.3 * (
      (_dpo_logps(policy, c, cm) - _dpo_logps(reference, c, cm))
      - (_dpo_logps(policy, r, rm) - _dpo_logps(reference, r, rm))
    )
    losses.append(-math.log(1 / (1 + math.exp(-h))))
  assert len(losses) == 12
  np.testing.assert_allclose(result.eval_loss, np.mean(losses), rtol=1e-4)
