"""TrainState: penzai fields and initial_state, flax-style conveniences."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distrib_train as dt
from distrib_train.models import ParamSlot, StaticValue


def _model():
  return {
      "dense": {"w": jnp.ones((2, 3)), "b": jnp.zeros((3,))},
      "positions": jnp.arange(4),  # an integer array: not a parameter
      "activation": "relu",  # a non-array leaf: kept static
      "num_heads": 4,
  }


def test_initial_state_has_penzai_fields():
  state = dt.TrainState.initial_state(_model(), optax.sgd(0.1), jax.random.key(0), loss_fn_state=7)
  assert [f for f in state.__dataclass_fields__][:7] == [
      "step", "root_rng", "params", "model_without_params", "opt_state", "loss_fn_state", "optimizer_def"]
  assert state.step == 0 and isinstance(state.step, int)
  assert state.loss_fn_state == 7


def test_params_are_the_inexact_leaves_keyed_by_path():
  state = dt.TrainState.initial_state(_model(), optax.adam(0.1), jax.random.key(0))
  assert sorted(state.params) == ["dense/b", "dense/w"]
  rest = state.model_without_params
  assert rest["dense"] == {"w": ParamSlot("dense/w"), "b": ParamSlot("dense/b")}
  assert rest["activation"] == StaticValue("relu")
  np.testing.assert_array_equal(rest["positions"], np.arange(4))


def test_model_property_rebuilds_the_full_model():
  model = _model()
  state = dt.TrainState.initial_state(model, optax.adam(0.1), jax.random.key(0))
  rebuilt = state.model
  assert jax.tree_util.tree_structure(rebuilt) == jax.tree_util.tree_structure(model)
  assert rebuilt["activation"] == "relu" and rebuilt["num_heads"] == 4
  for a, b in zip(jax.tree_util.tree_leaves(rebuilt), jax.tree_util.tree_leaves(model)):
    np.testing.assert_array_equal(a, b)


def test_is_param_filter_chooses_the_params():
  state = dt.TrainState.initial_state(
      _model(), optax.adam(0.1), jax.random.key(0), is_param=lambda path, leaf: path == "dense/w")
  assert list(state.params) == ["dense/w"]
  np.testing.assert_array_equal(state.model["dense"]["b"], np.zeros(3))


def test_is_param_selecting_a_non_array_is_an_error():
  with pytest.raises(ValueError, match="'activation', which is a str"):
    dt.TrainState.initial_state(_model(), optax.adam(0.1), jax.random.key(0), is_param=lambda p, x: p == "activation")


def test_train_state_crosses_jit_unchanged():
  state = dt.TrainState.initial_state(_model(), optax.adam(0.1), jax.random.key(0), loss_fn_state=1)
  out = jax.jit(lambda s: s)(state)
  assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(state)
  assert int(out.step) == 0 and out.model["activation"] == "relu"


def test_create_and_apply_gradients_flax_style():
  params = {"w": jnp.array([1.0, 2.0])}
  apply_fn = lambda p, x: p["w"] * x
  state = dt.TrainState.create(apply_fn=apply_fn, params=params, tx=optax.sgd(0.5))
  assert state.step == 0 and state.tx is state.optimizer_def and state.apply_fn is apply_fn
  assert state.model is state.params
  state = state.apply_gradients(grads={"w": jnp.array([1.0, -1.0])}, loss_fn_state=3)
  assert state.step == 1 and state.loss_fn_state == 3
  np.testing.assert_allclose(state.params["w"], [0.5, 2.5])
  state = state.replace(step=10)
  assert state.step == 10


def test_create_rejects_unknown_fields():
  with pytest.raises(TypeError, match="unknown field\\(s\\) colour"):
    dt.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1), colour="red")


def test_hyperparams_inside_chain_follow_the_schedule():
  schedule = optax.linear_schedule(1.0, 0.0, transition_steps=10)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=schedule))
  state = dt.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
  seen = []
  for _ in range(4):
    state = state.apply_gradients(grads={"w": jnp.ones(2)})
    seen.append(float(state.hyperparams["learning_rate"]))
  np.testing.assert_allclose(seen, [1.0, 0.9, 0.8, 0.7], rtol=1e-6)
  assert set(state.hyperparams) >= {"learning_rate", "b1", "b2", "eps"}


def test_missing_hyperparam_raises_keyerror_listing_the_names():
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  state = dt.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
  with pytest.raises(KeyError, match="'lr'.*'learning_rate'"):
    state.hyperparams["lr"]
  plain = dt.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
  with pytest.raises(KeyError, match="injected: none"):
    plain.hyperparams["learning_rate"]


def test_hyperparam_injected_twice_is_ambiguous():
  tx = optax.chain(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
                   optax.inject_hyperparams(optax.sgd)(learning_rate=0.2))
  state = dt.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
  with pytest.raises(KeyError, match="several places"):
    state.hyperparams["learning_rate"]
  assert "learning_rate" not in state.hyperparams and "learning_rate" not in dict(state.hyperparams)


def test_step_survives_as_python_int_and_as_jax_scalar():
  state = dt.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
  grads = {"w": jnp.ones(2)}
  assert state.apply_gradients(grads=grads).step == 1
  jitted = jax.jit(lambda s: s.apply_gradients(grads=grads))(state)
  assert isinstance(jitted.step, jax.Array) and int(jitted.step) == 1
  assert int(jax.jit(lambda s: s.apply_gradients(grads=grads))(jitted).step) == 2
