"""The mixture's load-balancing bias (``model.router_bias_update_rate``): selection only, moved by the load."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ckpt_helpers
import distrib_train as dt
import pipeline_helpers as ph
from distrib_train.recipes import blocks, moe, routing
from distrib_train.config import run as config_lib

RATE = 0.02
BIAS = "layers/router_bias"


def _one_device():
  return ph.mesh_of({}, devices=jax.devices()[:1])


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_the_bias_chooses_the_experts_and_the_unbiased_scores_weight_them(router):
  config = ph.tiny_config(family="moe", router=router, routed_scaling=2.5, router_bias_update_rate=RATE)
  weights_in = np.asarray(config.build(0).layers["router"][...][0], np.float64)
  h = np.asarray(jax.random.normal(jax.random.key(1), (2, 8, config.d_model)), np.float64)
  bias = np.asarray(0.1 * jax.random.normal(jax.random.key(2), (config.num_experts,)), np.float32)
  indices, weights, aux = routing.route(
    config, jnp.asarray(h, jnp.float32), jnp.asarray(weights_in, jnp.float32), jnp.asarray(bias)
  )
  logits = h @ weights_in
  scores = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True) if router == "softmax" else 1 / (1 + np.exp(-logits))
  k = config.experts_per_token
  chosen = np.argsort(-(scores + bias), axis=-1, kind="stable")[..., :k]
  assert np.any(chosen != np.argsort(-scores, axis=-1, kind="stable")[..., :k])  # the bias changed some choices
  want = np.take_along_axis(scores, chosen, axis=-1)
  want = 2.5 * want / want.sum(-1, keepdims=True)
  np.testing.assert_array_equal(np.asarray(indices), chosen)
  np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-5)
  np.testing.assert_array_equal(
    np.asarray(aux["load"]), np.eye(config.num_experts)[chosen].sum(axis=(1, 2))
  )  # [batch, experts]


def test_an_overloaded_expert_falls_and_the_others_rise_by_the_rate_once_per_step():
  """Experts 0 and 1 start with a bias of 10, so every token picks them (2 per token): each step lowers their
  bias by the rate and raises the six others' by it, once, though the step runs two microbatches."""

  def overload(model):
    model.layers["router_bias"][...] = model.layers["router_bias"][...].at[:, :2].set(10.0)

  states = []
  ph.train(
    _one_device(),
    steps=3,
    microbatches=2,
    family="moe",
    router_bias_update_rate=RATE,
    edit=overload,
    local_states=states,
  )
  experts = np.arange(8)
  want = np.broadcast_to(np.where(experts < 2, 10.0, 0.0), (4, 8)).astype(np.float32)
  for state in states:
    want = want + np.float32(RATE) * np.where(experts < 2, -1.0, 1.0).astype(np.float32)
    np.testing.assert_array_equal(state[BIAS], want)
    assert not np.any(state["router_load"])  # the step's loads, spent at its last microbatch


def test_no_gradient_reaches_the_bias_and_the_optimizer_never_sees_it():
  config = ph.tiny_config(family="moe", router_bias_update_rate=RATE)
  model = config.build(0)
  model.layers["router_bias"][...] = 0.1 * jax.random.normal(jax.random.key(3), (4, 8))
  params, model_def, local = dt.models.split_model(model)
  assert "router_bias" not in dt.models.to_pure_dict(params)["layers"]
  assert set(dt.models.to_pure_dict(local)) == {"layers", "router_load"}
  batch = {k: jnp.asarray(v) for k, v in ph.batches(1)[0].items()}

  def loss(local_state):
    merged = dt.models.merge_model(model_def, params, local_state)
    return moe.loss_fn(model=merged, state=None, rng=None, **batch)[0]

  grads = jax.jit(jax.grad(loss))(local)
  for leaf in jax.tree_util.tree_leaves(grads):
    np.testing.assert_array_equal(np.asarray(leaf), 0.0)
  unbiased = jax.tree_util.tree_map(jnp.zeros_like, local)
  assert float(jax.jit(loss)(local)) != float(jax.jit(loss)(unbiased))  # the bias does change the routing


def test_off_adds_no_state_and_a_zero_bias_routes_as_without_one():
  off = ph.tiny_config(family="moe")
  on = dataclasses.replace(off, router_bias_update_rate=RATE)
  off_params, _, off_local = dt.models.split_model(off.build(0))
  assert jax.tree_util.tree_leaves(off_local) == []
  batch = {k: jnp.asarray(v) for k, v in ph.batches(1)[0].items()}
  run = jax.jit(lambda model: moe.loss_fn(model=model, state=None, rng=None, **batch))
  (loss_off, _, aux_off), (loss_on, _, aux_on) = run(off.build(0)), run(on.build(0))
  assert loss_on.tobytes() == loss_off.tobytes() and aux_on.keys() == aux_off.keys()
  on_params = dt.models.split_model(on.build(0))[0]
  for a, b in zip(jax.tree_util.tree_leaves(off_params), jax.tree_util.tree_leaves(on_params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_negative_rate_is_refused_naming_the_key():
  with pytest.raises(ValueError, match=r"router_bias_update_rate must be 0 \(off\) or positive.*got -0.001"):
    config_lib.load("moe-tiny", ["model.router_bias_update_rate=-0.001"]).model_recipe()


@pytest.fixture(scope="session")
def one_device():
  states, final = [], []
  losses, _ = ph.train(
    _one_device(), steps=3, family="moe", router_bias_update_rate=RATE, local_states=states, final=final
  )
  return losses, states, final[0]


def test_each_layer_moves_by_its_own_first_step_loads(one_device):
  """Step 1 (zero bias) against each layer's loads measured layer by layer, outside the layer stack."""
  config = ph.tiny_config(family="moe", router_bias_update_rate=RATE)
  model = config.build(0)
  tokens = jnp.asarray(ph.batches(1)[0]["tokens"])
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

  @jax.jit
  def loads(layers, x):
    out = []
    for i in range(config.num_layers):
      layer = {k: v[i] for k, v in layers.items()}
      x, aux = blocks.layer(config, blocks.Kind(mixture=True), x, layer, positions, None)
      out.append(aux["load"].sum(axis=0))
    return jnp.stack(out)

  load = np.asarray(loads({k: v[...] for k, v in model.layers.items()}, model.embed[...][tokens]))
  assert len({tuple(row) for row in load}) == config.num_layers  # the layers' loads differ
  want = np.float32(RATE) * np.sign(load.mean(axis=1, keepdims=True) - load).astype(np.float32)
  np.testing.assert_array_equal(one_device[1][0][BIAS], want)


def test_an_expert_axis_mesh_moves_the_bias_as_one_device_does(one_device):
  losses, states, _ = one_device
  assert np.any(states[-1][BIAS] > 0) and np.any(states[-1][BIAS] < 0)
  got_states = []
  got, _ = ph.train(
    ph.mesh_of({"expert": 4, "fsdp": 2}), steps=3, family="moe", router_bias_update_rate=RATE, local_states=got_states
  )
  np.testing.assert_allclose(got, losses, rtol=1e-4)
  for step, (a, b) in enumerate(zip(got_states, states, strict=True)):
    np.testing.assert_array_equal(a[BIAS], b[BIAS], err_msg=f"step {step + 1}")


def test_the_bias_survives_a_checkpoint(tmp_path, one_device):
  _, states, trained = one_device
  config = ph.tiny_config(family="moe", router_bias_update_rate=RATE)
  fresh = ph._plan(config, _one_device(), ph.batches(1)[0])[2]
  assert not np.any(np.asarray(fresh.local_state["layers"]["router_bias"][...]))
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.save(3, trained)
    checkpoints.wait_until_finished()
    restored = checkpoints.restore(fresh)
  np.testing.assert_array_equal(np.asarray(restored.local_state["layers"]["router_bias"][...]), states[-1][BIAS])
  saved, back = ckpt_helpers.saved_arrays(trained), ckpt_helpers.saved_arrays(restored)
  assert saved.keys() == back.keys()
  for key in saved:
    np.testing.assert_array_equal(back[key], saved[key], err_msg=key)


def test_export_refuses_a_bias_no_hugging_face_mixture_has(tmp_path):
  from distrib_train.checkpoint import hf

  config = ph.tiny_config(family="moe", router_bias_update_rate=RATE)
  with pytest.raises(hf.HfCheckpointError, match=r"router_bias_update_rate > 0"):
    hf.save(dt.models.split_model(config.build(0))[0], config, str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()  # refused before anything was written
