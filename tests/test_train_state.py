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
    "step",
    "root_rng",
    "params",
    "model_without_params",
    "opt_state",
    "loss_fn_state",
    "optimizer_def",
  ]
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
    _model(), optax.adam(0.1), jax.random.key(0), is_param=lambda path, leaf: path == "dense/w"
  )
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
  tx = optax.chain(
    optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), optax.inject_hyperparams(optax.sgd)(learning_rate=0.2)
  )
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


# flax TrainState habits: each works as with flax.training.train_state.TrainState.


def test_subclass_may_add_a_field_without_default():
  class BatchStatsState(dt.TrainState):
    batch_stats: dict

  state = BatchStatsState.create(
    apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1), batch_stats={"mean": jnp.zeros(2)}
  )
  assert state.batch_stats["mean"].shape == (2,)
  state = jax.jit(lambda s: s.apply_gradients(grads={"w": jnp.ones(2)}, batch_stats={"mean": jnp.ones(2)}))(state)
  assert int(state.step) == 1
  np.testing.assert_array_equal(state.batch_stats["mean"], [1.0, 1.0])
  np.testing.assert_allclose(state.params["w"], [0.9, 0.9])


def test_subclass_without_its_field_is_a_type_error_naming_it():
  class BatchStatsState(dt.TrainState):
    batch_stats: dict

  with pytest.raises(TypeError, match="batch_stats"):
    BatchStatsState(step=0, params={}, tx=optax.sgd(0.1), opt_state=())


def test_constructor_takes_flax_field_names():
  tx = optax.adam(1e-3)
  params = {"w": jnp.ones(3)}
  apply_fn = lambda p, x: p["w"] * x
  state = dt.TrainState(step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=tx.init(params))
  assert state.tx is tx and state.optimizer_def is tx and state.apply_fn is apply_fn
  assert state.root_rng is None and state.loss_fn_state is None and state.model is params
  state = state.apply_gradients(grads={"w": jnp.ones(3)})
  assert state.step == 1


def test_replace_takes_tx_also_in_subclasses():
  class EmaState(dt.TrainState):
    ema: dict

  state = EmaState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1), ema={"w": jnp.ones(2)})
  new_tx = optax.sgd(1.0)
  replaced = state.replace(tx=new_tx)
  assert replaced.tx is new_tx and replaced.optimizer_def is new_tx and state.tx is not new_tx
  assert type(replaced) is EmaState
  np.testing.assert_allclose(replaced.apply_gradients(grads={"w": jnp.ones(2)}).params["w"], [0.0, 0.0])
  with pytest.raises(TypeError, match="not both"):
    state.replace(tx=new_tx, optimizer_def=new_tx)


def test_overwrite_with_gradient_collection_is_overwritten_not_optimized():
  from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

  params = {
    "params": {"kernel": jnp.ones(2)},
    OVERWRITE_WITH_GRADIENT: {"scale": jnp.ones(()), "amax_history": jnp.zeros(4)},
  }
  state = dt.TrainState.create(apply_fn=None, params=params, tx=optax.adam(0.1))
  # No optimizer state for the fp8 bookkeeping: Adam sees only "params".
  assert jax.tree_util.tree_structure(state.opt_state) == jax.tree_util.tree_structure(
    optax.adam(0.1).init(params["params"])
  )
  grads = {
    "params": {"kernel": jnp.ones(2)},
    OVERWRITE_WITH_GRADIENT: {"scale": jnp.asarray(3.0), "amax_history": jnp.arange(4.0)},
  }
  state = state.apply_gradients(grads=grads)
  np.testing.assert_array_equal(state.params[OVERWRITE_WITH_GRADIENT]["scale"], 3.0)
  np.testing.assert_array_equal(state.params[OVERWRITE_WITH_GRADIENT]["amax_history"], [0.0, 1.0, 2.0, 3.0])
  np.testing.assert_allclose(state.params["params"]["kernel"], [0.9, 0.9], rtol=1e-6)


def test_fp8_dense_trains_like_flax_train_state():
  import flax.linen as nn
  from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
  from flax.training import train_state as flax_train_state

  dense = nn.DenseGeneral(features=8, dot_general_cls=nn.Fp8DotGeneral)
  x = jax.random.normal(jax.random.key(1), (4, 8))
  variables = dense.init(jax.random.key(0), x)

  def train(state_class):
    state = state_class.create(apply_fn=dense.apply, params=variables, tx=optax.adam(0.1))
    loss = lambda v: jnp.sum(state.apply_fn(v, x) ** 2)
    for _ in range(3):
      state = jax.jit(lambda s: s.apply_gradients(grads=jax.grad(loss)(s.params)))(state)
    return state.params

  ours, flax_params = train(dt.TrainState), train(flax_train_state.TrainState)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), ours, flax_params)
  (amax,) = [v["input_amax_history"] for v in ours[OVERWRITE_WITH_GRADIENT].values()]
  assert float(jnp.max(amax)) == pytest.approx(float(jnp.max(jnp.abs(x))))


def test_train_step_overwrites_the_fp8_collection_too():
  import flax.linen as nn
  from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

  dense = nn.DenseGeneral(features=8, dot_general_cls=nn.Fp8DotGeneral)
  x = jax.random.normal(jax.random.key(1), (4, 8))
  variables = dense.init(jax.random.key(0), x)
  state = dt.TrainState.create(apply_fn=dense.apply, params=variables, tx=optax.adam(0.1))

  def loss_fn(model, state, rng, x):
    del state, rng
    loss = jnp.sum(dense.apply(model, x) ** 2)
    return loss, None, loss

  step = dt.build_train_step_fn(loss_fn)
  expected = state.apply_gradients(grads=jax.grad(lambda v: loss_fn(v, None, None, x)[0])(state.params))
  state, _ = step(state, x=x)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), state.params, expected.params)
  (amax,) = [v["input_amax_history"] for v in state.params[OVERWRITE_WITH_GRADIENT].values()]
  assert float(jnp.max(amax)) == pytest.approx(float(jnp.max(jnp.abs(x))))


def test_flax_serialization_round_trips_a_state():
  from flax import serialization

  state = dt.TrainState.create(apply_fn=None, params={"w": jnp.arange(3.0)}, tx=optax.sgd(0.1, momentum=0.9))
  state = state.apply_gradients(grads={"w": jnp.ones(3)})
  restored = serialization.from_bytes(state.replace(params={"w": jnp.zeros(3)}), serialization.to_bytes(state))
  np.testing.assert_array_equal(restored.params["w"], state.params["w"])
  assert int(restored.step) == 1
