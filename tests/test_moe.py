"""The mixture of experts and the expert axis, proven against a per-token reference and one device."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distrib_train as dt
import mp_harness
import pipeline_helpers as ph
from distrib_train.parallel.experts import dispatch
from distrib_train.recipes import blocks, moe, parts, routing

_WORKERS = pathlib.Path(__file__).resolve().parent / "workers"
RTOL = 1e-4


def _dense_reference(config, h, layer):
  """Each token through its top-k experts, one at a time, weighted: no sorting, no grouping."""
  indices, weights, _ = routing.route(config, h, layer["router"])
  out = np.zeros(h.shape, np.float64)
  for b in range(h.shape[0]):
    for t in range(h.shape[1]):
      for j in range(indices.shape[-1]):
        e, x = int(indices[b, t, j]), h[b, t]
        y = (jax.nn.silu(x @ layer["w_gate"][e]) * (x @ layer["w_up"][e])) @ layer["w_down"][e]
        out[b, t] += float(weights[b, t, j]) * np.asarray(y, np.float64)
  return indices, weights, out


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_dropless_experts_equal_a_per_token_dense_reference(router):
  config = ph.tiny_config(family="moe", router=router)
  model = config.build(0)
  layer = {k: v[...][1] for k, v in model.layers.items()}
  h = jax.random.normal(jax.random.key(1), (3, 8, config.d_model))
  indices, weights, want = _dense_reference(config, h, layer)
  got, dropped = dispatch(h, indices, weights, layer["w_gate"], layer["w_up"], layer["w_down"])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(dropped))


def test_shared_experts_behind_a_gate_add_to_the_routed_output():
  config = ph.tiny_config(family="moe", num_shared_experts=1, shared_expert_gate=True)
  model = config.build(0)
  layer = {k: v[...][0] for k, v in model.layers.items()}
  x = jax.random.normal(jax.random.key(2), (2, 8, config.d_model))
  got, _ = blocks.mlp_sublayer(config, blocks.Kind(mixture=True), x, layer)
  h = parts.rms_norm(x, layer["mlp_norm"], config.norm_eps)
  _, _, routed = _dense_reference(config, h, layer)
  shared = (jax.nn.silu(h @ layer["shared_gate"]) * (h @ layer["shared_up"])) @ layer["shared_down"]
  want = np.asarray(x) + routed + np.asarray(shared * jax.nn.sigmoid(h @ layer["shared_expert_gate"]))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_all_tokens_to_one_expert_still_runs_exactly_when_dropless_and_is_counted_with_a_capacity():
  config = ph.tiny_config(family="moe")
  model = config.build(0)
  layer = {k: v[...][0] for k, v in model.layers.items()}
  h = jax.random.normal(jax.random.key(3), (2, 16, config.d_model))
  indices = jnp.zeros((2, 16, 2), jnp.int32).at[..., 1].set(5)  # every token to experts 0 and 5
  weights = jnp.full((2, 16, 2), 0.5)
  want = sum(0.5 * (jax.nn.silu(h @ layer["w_gate"][e]) * (h @ layer["w_up"][e])) @ layer["w_down"][e] for e in (0, 5))
  got, dropped = dispatch(h, indices, weights, layer["w_gate"], layer["w_up"], layer["w_down"])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert float(jnp.sum(dropped)) == 0
  # Capacity 1.0: each expert takes ceil(64 / 8) = 8 of the 64 assignments; 2 experts hold 32 each.
  capped, dropped = dispatch(h, indices, weights, layer["w_gate"], layer["w_up"], layer["w_down"], capacity_factor=1.0)
  assert float(jnp.sum(dropped)) == 64 - 2 * 8
  np.testing.assert_allclose(np.asarray(capped[0, :4]), np.asarray(want[0, :4]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(capped[1]), 0.0)  # the second row came after the capacity


@pytest.fixture(scope="session")
def one_device():
  return ph.train(ph.mesh_of({}, devices=jax.devices()[:1]), family="moe")


@pytest.mark.parametrize(
  "axes",
  [{"expert": 4, "fsdp": 2}, {"expert": 2, "data": 2, "tensor": 2}],
  ids=["expert4-fsdp2", "expert2-data2-tensor2"],
)
def test_expert_parallel_training_matches_one_device(one_device, axes):
  losses, params = ph.train(ph.mesh_of(axes), family="moe")
  np.testing.assert_allclose(losses, one_device[0], rtol=RTOL)
  for name, want in one_device[1].items():
    np.testing.assert_allclose(params[name], want, rtol=RTOL, atol=2e-5, err_msg=name)


def test_router_and_expert_gradients_match_one_device():
  want = ph.gradients(ph.mesh_of({}, devices=jax.devices()[:1]), family="moe", packed=True)
  got = ph.gradients(ph.mesh_of({"expert": 4, "fsdp": 2}), family="moe", packed=True)
  for name in ("layers/router", "layers/w_gate", "layers/w_up", "layers/w_down", "embed", "layers/wq"):
    scale = np.max(np.abs(want[name]))
    np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=1e-5 * scale, err_msg=name)


def test_experts_compose_with_the_pipeline():
  """stage 2 × expert 2 × fsdp 2; without the balance loss, which a pipeline takes per microbatch."""
  reference = ph.train(ph.mesh_of({}, devices=jax.devices()[:1]), steps=4, family="moe", aux_loss_weight=0.0)
  losses, _ = ph.train(
    ph.mesh_of({"stage": 2, "expert": 2, "fsdp": 2}), steps=4, microbatches=4, family="moe", aux_loss_weight=0.0
  )
  np.testing.assert_allclose(losses, reference[0], rtol=RTOL)


def test_routing_metrics_are_reported():
  aux = []
  ph.train(ph.mesh_of({"expert": 4, "fsdp": 2}), steps=1, family="moe", aux=aux)
  step = aux[0]
  assert step["cross_entropy"] < step["loss"] and step["balance_loss"] >= 1.0 - 1e-6  # E·Σf·P ≥ 1
  assert step["expert_load_min"] <= 1.0 <= step["expert_load_max"] and step["dropped_tokens"] == 0
  assert step["z_loss"] > 0


def test_experts_that_do_not_split_over_the_expert_axis_are_refused():
  with pytest.raises(ValueError, match=r"6 experts do not split over the expert axis \(4\)"):
    ph.train(ph.mesh_of({"expert": 4, "fsdp": 2}), steps=1, family="moe", num_experts=6)


def test_expert_axis_across_two_processes(one_device):
  """expert 4 (2 over DCN) × fsdp 2 across two processes: the one-device losses, trained params and gradients."""
  results = mp_harness.run_workers(_WORKERS / "moe_worker.py", "10", timeout=300)
  want = ph.gradients(ph.mesh_of({}, devices=jax.devices()[:1]), family="moe", packed=True)
  for r in results:
    assert r.result["mesh"]["expert"] == 4
    np.testing.assert_allclose(r.result["losses"], one_device[0], rtol=RTOL)
    assert set(r.result["params"]) == set(one_device[1]) and set(r.result["gradients"]) == set(want)
    for name, value in one_device[1].items():
      np.testing.assert_allclose(r.result["params"][name], value, rtol=RTOL, atol=2e-5, err_msg=name)
    for name, value in want.items():
      scale = np.max(np.abs(value))
      np.testing.assert_allclose(r.result["gradients"][name], value, rtol=RTOL, atol=1e-5 * scale, err_msg=name)


def test_moe_presets_count_their_parameters():
  assert 46.0e9 < moe.PRESETS["mixtral-8x7b"].num_params() < 47.5e9  # Mixtral-8x7B: 46.7B
  assert 12.5e9 < moe.PRESETS["mixtral-8x7b"].active_params() < 13.2e9  # 12.9B active
  assert 668e9 < moe.PRESETS["deepseek-v3"].num_params() < 674e9  # DeepSeek-V3: 671B (MLA)
  assert 36.5e9 < moe.PRESETS["deepseek-v3"].active_params() < 38.5e9  # 37B active
  tiny = moe.PRESETS["tiny"]
  state_params = sum(x.size for x in jax.tree_util.tree_leaves(dt.models.split_model(tiny.build(0))[0]))
  assert state_params == tiny.num_params()


def test_a_checkpoint_restores_across_expert_axis_sizes(tmp_path, xla_cache):
  import io
  import json

  from distrib_train.config import run as config_lib
  from distrib_train.train.trainer import Trainer

  def run(mesh, steps, workdir):
    config = config_lib.load(
      "moe-tiny",
      [
        "data.seq_len=32",
        "data.global_batch_size=8",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.checkpoint_every=3",
        "train.async_checkpoint=false",
        f"train.compilation_cache_dir={xla_cache}",
        "optimizer.warmup_steps=0",
        "optimizer.schedule=constant",
        # SGD: linear in the gradients, so the meshes' float noise stays noise (Adam can turn it into whole
        # steps, and a routing choice near a tie can then flip).
        "optimizer.name=sgd",
        "optimizer.learning_rate=0.3",
        f"mesh_config={mesh}",
      ],
    )
    console = io.StringIO()
    result = Trainer(config, workdir, console=console).run()
    assert result.status == "finished", console.getvalue()
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines) if "loss" in m}

  straight = run("cpu-8", 6, tmp_path / "straight")
  first = run("cpu-8-expert", 3, tmp_path / "moved")
  then = run("cpu-8", 6, tmp_path / "moved")
  for step in range(1, 7):
    np.testing.assert_allclose(then.get(step, first.get(step)), straight[step], rtol=RTOL, err_msg=f"step {step}")


def test_a_mixture_no_hugging_face_family_expresses_is_refused_at_export():
  from distrib_train.checkpoint import hf

  import dataclasses

  with pytest.raises(hf.HfCheckpointError, match=r"cannot be written as mixtral: Mixtral routes by softmax"):
    hf.hf_config(dataclasses.replace(moe.PRESETS["mixtral-8x7b"], router="sigmoid"))
  assert hf.hf_config(moe.PRESETS["mixtral-8x7b"])["architectures"] == ["MixtralForCausalLM"]
  assert hf.hf_config(moe.PRESETS["deepseek-v3"])["architectures"] == ["DeepseekV3ForCausalLM"]


def test_a_mixture_trained_from_scratch_exports_with_its_familys_tensor_names():
  """A mixture never read from Hugging Face is written as the family its variants name (Mixtral here), with that
  family's tensor names, not another family's."""
  from distrib_train.checkpoint import hf
  from distrib_train.models import split_model

  config = moe.PRESETS["tiny"]
  params = split_model(config.build(0))[0]
  assert hf.hf_config(config)["architectures"] == ["MixtralForCausalLM"]
  names = hf.hf_tensors(params, config)
  assert "model.layers.0.block_sparse_moe.experts.7.w1.weight" in names
  assert "model.layers.0.block_sparse_moe.gate.weight" in names and not any(".mlp." in n for n in names)


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(dense_layers=(1,)), r"cannot be written as mixtral: dense_layers \(1,\)"),
    (dict(sliding_window=8, layer_types=("sliding", "full") * 2), r"sliding and full layers \(its window is on"),
    (dict(mlp_activation="gelu_tanh"), r"mlp_activation 'gelu_tanh' \(its MLP is 'silu'\)"),
  ],
)
def test_what_a_family_cannot_express_is_refused_at_export(change, message):
  import dataclasses

  from distrib_train.checkpoint import hf

  assert hf.hf_config(dataclasses.replace(moe.PRESETS["tiny"], sliding_window=8))["sliding_window"] == 8
  with pytest.raises(hf.HfCheckpointError, match=message):
    hf.hf_config(dataclasses.replace(moe.PRESETS["tiny"], **change))


def test_router_groups_too_small_for_the_experts_chosen_are_refused():
  with pytest.raises(ValueError, match="a group needs at least 2 experts"):
    ph.tiny_config(family="moe", router="sigmoid", router_groups=8)
  with pytest.raises(ValueError, match="the kept groups at least experts_per_token"):
    ph.tiny_config(family="moe", router="sigmoid", router_groups=4, router_group_topk=1, experts_per_token=3)


def test_each_stack_of_layers_reports_its_scan_length_and_sinks_cap_no_packed_row():
  from distrib_train.recipes import llama

  assert moe.PRESETS["deepseek-v3"].capabilities().scan_lengths == (3, 58)  # dense first layers, then experts
  assert moe.PRESETS["gpt-oss-20b"].capabilities().scan_lengths == (12,)  # 12 periods of (sliding, full)
  assert llama.PRESETS["gemma3-27b"].capabilities().scan_lengths == (10, 2)  # 10 periods of 6, then 2 local
  assert moe.PRESETS["gpt-oss-20b"].capabilities().max_segments == 0  # sinks: no cuDNN packed layout
  assert moe.PRESETS["deepseek-v3"].capabilities().max_segments == 0  # MLA's values of another size
  assert llama.PRESETS["qwen3-8b"].capabilities().max_segments == 8
