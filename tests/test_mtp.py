"""DeepSeek-V3's multi-token prediction (``model.mtp_depth``): the loss against a plain-numpy reference, on any mesh
and across two processes, DeepSeek-V3's layer-N weights in and out of Hugging Face, dropping the modules, FLOPs."""

import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mp_harness
import mtp_helpers
import pipeline_helpers as ph
from distrib_train.recipes import blocks, llama, moe, mtp

_WORKERS = pathlib.Path(__file__).resolve().parent / "workers"


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _cross_entropy(hidden, head, targets, weights):
  logits = hidden @ head
  top = logits.max(axis=-1, keepdims=True)
  lse = (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))[..., 0]
  nll = lse - np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return float((nll * weights).sum() / max(weights.sum(), 1.0))


def _reference(model, data, documents=True):
  """The main and each depth's cross-entropy, in float64 numpy: the decoder's final hidden state from the model,
  then per depth the shifted tokens, targets and weights position by position, the two norms, their
  concatenation (embedding first) and projection, the block (``blocks.layer``), the head's norm and the head
  (``documents=False``: predictions across a document's end counted too, wrongly)."""
  c = model.config
  tokens, targets = data["tokens"], data["targets"]
  segments, weights = data.get("segment_ids"), data.get("weights")
  if weights is None:
    weights = np.ones(tokens.shape, np.float32)
  positions = data.get("positions", np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape))
  hidden = np.asarray(
    model(jnp.asarray(tokens), jnp.asarray(positions), None if segments is None else jnp.asarray(segments)), np.float64
  )
  head, table = np.asarray(model.head_weight(), np.float64), np.asarray(model.embed[...], np.float64)
  main = _cross_entropy(hidden, head, targets, weights)
  rows, length = tokens.shape
  losses, counted, previous = [], [], hidden
  for k in range(1, c.mtp_depth + 1):
    layer = {name: np.asarray(v[...][k - 1]) for name, v in model.mtp.items()}
    shifted, target, weight = (
      np.zeros((rows, length), np.int32),
      np.zeros((rows, length), np.int32),
      np.zeros((rows, length), np.float64),
    )
    for b in range(rows):
      for i in range(length):
        if i + k - 1 < length:
          shifted[b, i] = targets[b, i + k - 1]  # t_{i+k}
        same = (
          segments is None
          or not documents
          or (segments[b, i] > 0 and segments[b, i] == segments[b, i + k + 1] if i + k + 1 < length else False)
        )
        if i + k + 1 < length and same:
          target[b, i], weight[b, i] = targets[b, i + k], weights[b, i + k]  # t_{i+k+1}, its own weight
    joined = np.concatenate(
      [_rms(table[shifted], layer["enorm"], c.norm_eps), _rms(previous, layer["hnorm"], c.norm_eps)], axis=-1
    )
    x = jnp.asarray(joined @ layer["eh_proj"], jnp.float32)
    out, _ = blocks.layer(
      c,
      c.layer_kinds()[-1],
      x,
      {n: jnp.asarray(v) for n, v in layer.items()},
      jnp.asarray(positions),
      None if segments is None else jnp.asarray(segments),
    )
    previous = np.asarray(out, np.float64)
    losses.append(_cross_entropy(_rms(previous, layer["head_norm"], c.norm_eps), head, target, weight))
    counted.append(weight)
  return main, losses, counted


@pytest.mark.parametrize("packed", [True, False], ids=["packed_weighted", "plain"])
def test_the_loss_equals_a_plain_numpy_reference(packed):
  config = ph.tiny_config(mtp_depth=2, mtp_loss_weight=0.3, attention="xla")
  model = config.build(0)
  data = mtp_helpers.batch(packed)
  loss, _, aux = jax.jit(lambda d: llama.loss_fn(model=model, state=None, rng=None, **d))(data)
  main, losses, counted = _reference(model, data)
  np.testing.assert_allclose(float(aux["cross_entropy"]), main, rtol=1e-5)
  np.testing.assert_allclose([float(aux["mtp_loss_1"]), float(aux["mtp_loss_2"])], losses, rtol=1e-5)
  np.testing.assert_allclose(float(loss), main + 0.3 * np.mean(losses), rtol=1e-5)
  assert float(aux["loss"]) == float(loss) and "mtp_loss_3" not in aux
  shifted = mtp.shifted(
    config, *(jnp.asarray(data[k]) if k in data else None for k in ("targets", "segment_ids", "weights"))
  )
  for k, weight in enumerate(counted, 1):  # which predictions count, and with what weight
    np.testing.assert_array_equal(np.asarray(shifted[f"mtp_weights_{k}"]), weight)
    assert not weight[:, -k - 1 :].any()  # none in the last k + 1 positions of a row
  if packed:  # the rows hold predictions across a document's end that the weights alone would count
    crossing = _reference(model, data, documents=False)[2]
    assert all((a > 0).sum() > (b > 0).sum() for a, b in zip(crossing, counted))


@pytest.fixture(scope="module")
def one_device():
  return mtp_helpers.loss_and_gradients(ph.mesh_of({}, devices=jax.devices()[:1]), mtp_depth=2)


def _assert_same(got, want):
  aux, gradients = want
  for name in ("loss", "cross_entropy", "mtp_loss_1", "mtp_loss_2", "tokens"):
    np.testing.assert_allclose(got[0][name], aux[name], rtol=1e-5, err_msg=name)
  assert set(got[1]) == set(gradients) and any(name.startswith("mtp/") for name in gradients)
  for name, value in gradients.items():
    np.testing.assert_allclose(got[1][name], value, rtol=1e-4, atol=1e-5 * np.max(np.abs(value)), err_msg=name)


def test_fsdp_tensor_and_context_axes_give_one_devices_loss_and_gradients(one_device):
  mesh = ph.mesh_of({"fsdp": 2, "tensor": 2, "context": 2})
  _assert_same(mtp_helpers.loss_and_gradients(mesh, mtp_depth=2), one_device)


def test_two_processes_give_one_devices_loss_and_gradients(one_device):
  results = mp_harness.run_workers(_WORKERS / "mtp_worker.py", timeout=240)
  for r in results:
    assert r.result["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2, "context": 2}
    _assert_same((r.result["aux"], {k: np.asarray(v) for k, v in r.result["gradients"].items()}), one_device)


def test_a_mixture_with_mtp_trains():
  aux = []
  losses, params = ph.train(ph.mesh_of({}, devices=jax.devices()[:1]), steps=4, family="moe", mtp_depth=1, aux=aux)
  assert losses[-1] < losses[0] and all(np.isfinite(losses))
  assert aux[-1]["mtp_loss_1"] < aux[0]["mtp_loss_1"] and "balance_loss" in aux[-1]
  assert "mtp/router" in params and params["mtp/w_gate"].shape[:2] == (1, 8)  # a mixture block, like the last layer


def test_flops_and_params_count_the_modules():
  base = ph.tiny_config()
  deeper = dataclasses.replace(base, mtp_depth=2)
  d, v, s = base.d_model, base.vocab_size, 64
  block = (base.num_params() - 2 * d * v - d) // base.num_layers  # one layer's params (untied embed and head)
  per_depth = 2 * d * d + 3 * d + block  # eh_proj, enorm / hnorm / the head's norm, the block
  assert deeper.num_params() == base.num_params() + 2 * per_depth
  attention = 6 * base.num_heads * (base.qk_dim + base.v_dim) * s
  assert deeper.flops_per_token(s) - base.flops_per_token(s) == 2 * (6 * per_depth + 6 * d * v + attention)
  mixture = ph.tiny_config(family="moe")
  unused = (mixture.num_experts - mixture.experts_per_token) * 3 * d * mixture.expert_mlp_dim
  with_mtp = dataclasses.replace(mixture, mtp_depth=1)
  assert with_mtp.active_params() - mixture.active_params() == with_mtp.num_params() - mixture.num_params() - unused


def test_settings_are_checked_and_other_objectives_refused():
  with pytest.raises(ValueError, match="mtp_depth must be 0"):
    ph.tiny_config(mtp_depth=-1)
  with pytest.raises(ValueError, match="mtp_loss_weight must be 0 or more"):
    ph.tiny_config(mtp_loss_weight=-0.1)
  from distrib_train import objectives, recipes

  recipe = recipes.get("llama", "tiny", mtp_depth=1)
  with pytest.raises(ValueError, match=r"train.objective=dpo does not train multi-token prediction .*mtp_depth=0"):
    objectives.build("dpo", recipe, recipe.config, None)
  assert ph.tiny_config(family="moe").mtp_depth == 0 and not hasattr(ph.tiny_config().build(0), "mtp")


def test_drop_at_export_and_at_inference(tmp_path):
  from distrib_train.checkpoint import hf
  from distrib_train.checkpoint.manager import CheckpointManager
  from distrib_train.config import run as config_lib
  from distrib_train.weights import export, load as run_model
  from distrib_train.config import job as job_lib

  config = config_lib.load("tiny", ["model.mtp_depth=1", "model.dtype=float32"])
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "config.yaml").write_text(config.to_yaml())
  state = job_lib.job_spec(config).make_state()
  with CheckpointManager(tmp_path / "run" / "checkpoints", async_save=False) as manager:
    manager.save(3, state)
  layers = config.model_recipe().config.num_layers
  export.export(tmp_path / "run", str(tmp_path / "with"))
  export.main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "without"), "--drop_mtp"])
  written, dropped = (hf.SafetensorsDirectory(str(tmp_path / d)) for d in ("with", "without"))
  mtp_names = {n for n in written.tensors if n.startswith(f"model.layers.{layers}.")}
  assert {
    f"model.layers.{layers}.{n}"
    for n in (
      "enorm.weight",
      "hnorm.weight",
      "eh_proj.weight",
      "shared_head.norm.weight",
      "embed_tokens.weight",
      "shared_head.head.weight",
    )
  } <= mtp_names
  assert set(dropped.tensors) == set(written.tensors) - mtp_names
  assert hf.tensors_equal({n: dropped.read(n) for n in dropped.tensors}, {n: written.read(n) for n in dropped.tensors})
  for directory, depth in (("with", 1), ("without", 0)):
    assert json.loads((tmp_path / directory / "config.json").read_text())["num_nextn_predict_layers"] == depth

  loaded = run_model.load(
    f"ckpt:{tmp_path / 'run'}", devices=jax.devices()[:1], overrides={"model.mtp_depth": 0}
  )  # the modules left unread
  assert not hasattr(loaded.model, "mtp") and loaded.step == 3
  full = run_model.load(f"ckpt:{tmp_path / 'run'}", devices=jax.devices()[:1])
  np.testing.assert_array_equal(np.asarray(loaded.model.final_norm[...]), np.asarray(full.model.final_norm[...]))
  model = full.model
  for value in model.mtp.values():  # the forward pass (generation's) never reads the modules
    value[...] = jnp.full(value[...].shape, jnp.nan, value[...].dtype)
  tokens = jnp.asarray(mtp_helpers.batch(False)["tokens"])
  assert np.isfinite(np.asarray(model.logits(model(tokens)))).all()


def test_deepseek_v3_mtp_layer_imports_and_exports_bit_for_bit(tmp_path):
  """A tiny DeepSeek-V3 saved by transformers, its layer N (the MTP module) added to its safetensors as the
  released checkpoint carries it (its embedding and head copies too): import → export gives every tensor back."""
  try:
    import torch
    import transformers
  except ImportError:
    if os.environ.get("DT_REQUIRE_TORCH") == "1":
      raise
    pytest.skip("transformers and torch write the checkpoint here")
  from safetensors.numpy import load_file, save_file

  from distrib_train.checkpoint import hf
  from distrib_train.weights import export, load as run_model

  torch.manual_seed(0)
  hf_config = transformers.DeepseekV3Config(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
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
  )
  directory = tmp_path / "deepseek"
  transformers.DeepseekV3ForCausalLM(hf_config).save_pretrained(directory)
  files = sorted(directory.glob("*.safetensors"))
  tensors = {k: v for f in files for k, v in load_file(f).items()}
  for f in files:
    f.unlink()
  (directory / "model.safetensors.index.json").unlink(missing_ok=True)
  rng, last, n = np.random.default_rng(0), "model.layers.1.", "model.layers.2."
  for name in [k for k in tensors if k.startswith(last)]:  # the block: a mixture layer, as the last one
    tensors[n + name[len(last) :]] = rng.normal(size=tensors[name].shape).astype(np.float32)
  d = hf_config.hidden_size
  tensors.update(
    {
      n + "enorm.weight": rng.normal(size=d).astype(np.float32),
      n + "hnorm.weight": rng.normal(size=d).astype(np.float32),
      n + "shared_head.norm.weight": rng.normal(size=d).astype(np.float32),
      n + "eh_proj.weight": rng.normal(size=(d, 2 * d)).astype(np.float32),
      n + "embed_tokens.weight": tensors["model.embed_tokens.weight"],
      n + "shared_head.head.weight": tensors["lm_head.weight"],
    }
  )
  save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
  saved = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**saved, "num_nextn_predict_layers": 1}))

  loaded = run_model.load(f"hf:{directory}", devices=jax.devices()[:1], dtype="float32")
  config = loaded.model_config
  assert config.mtp_depth == 1 and isinstance(config, moe.MoEConfig)
  assert "router_bias" in loaded.state.local_state["mtp"]  # the block's score correction, local state
  hf.save(export._weights(loaded.state, config), config, str(tmp_path / "out"), local_state=loaded.state.local_state)
  exported = hf.SafetensorsDirectory(str(tmp_path / "out"))
  assert hf.tensors_equal(tensors, {k: exported.read(k) for k in exported.tensors})
  assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
  np.testing.assert_array_equal(np.asarray(loaded.model.mtp["eh_proj"][...][0]), tensors[n + "eh_proj.weight"].T)

  # A run from the checkpoint may drop its MTP module (model.mtp_depth=0) or, on a checkpoint without one, add a
  # fresh one (the rest read as ever).
  from distrib_train.sharding.planner import MeshPlanner
  from distrib_train.config import run as config_lib
  from distrib_train.weights import init_from
  from distrib_train.config import job as job_lib

  without = tmp_path / "without"
  without.mkdir()
  save_file(
    {k: v for k, v in tensors.items() if not k.startswith(n)},
    str(without / "model.safetensors"),
    metadata={"format": "pt"},
  )
  (without / "config.json").write_text(json.dumps({**saved, "num_nextn_predict_layers": 0}))
  mesh = jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
  for where, depth in ((directory, 0), (without, 1)):
    run = config_lib.load(
      "tiny", [f"train.init_from=hf:{where}", f"model.mtp_depth={depth}", "model.dtype=float32"], training=False
    )  # (its vocabulary is smaller than the bytes the data would hold)
    assert run.model_recipe().config.mtp_depth == depth
    job = job_lib.job_spec(run)
    plan = job_lib.plan_job(job, MeshPlanner(mesh, run.train.rules))
    fresh = plan.init(job.make_state)
    state, _ = init_from.load(run, plan.abstract_train_state, fresh)
    np.testing.assert_array_equal(np.asarray(state.params["embed"]), tensors["model.embed_tokens.weight"])
    assert ("mtp" in state.params) == bool(depth)
    if depth:  # kept as initialised
      np.testing.assert_array_equal(
        np.asarray(state.params["mtp"]["eh_proj"]), np.asarray(fresh.params["mtp"]["eh_proj"])
      )
