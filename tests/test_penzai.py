"""penzai v1 models: params as penzai names them, frozen weights untouched, planning, checkpoints.

Each test sets its expectation from penzai's own ``basic_training`` where it
can, so "as penzai does" is checked against penzai itself.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import distrib_train as dt

penzai = pytest.importorskip("penzai", reason="penzai is an optional dependency: pip install .[penzai]")
from penzai.deprecated.v1 import pz  # noqa: E402
from penzai.deprecated.v1.example_models import simple_mlp  # noqa: E402
from penzai.deprecated.v1.toolshed import basic_training, lora  # noqa: E402

XOR_INPUTS = np.array([[-1, -1], [-1, 1], [1, -1], [1, 1]], dtype=np.float32)
XOR_LABELS = np.array([[0, 1], [1, 0], [1, 0], [0, 1]], dtype=np.float32)


def _mlp(sizes=(2, 32, 32, 2), seed=10):
  return pz.nn.initialize_parameters(simple_mlp.MLP.from_config(feature_sizes=list(sizes)), jax.random.key(seed))


def _lora_mlp():
  frozen = (
    pz.select(_mlp())
    .at_instances_of(pz.nn.Parameter)
    .apply(lambda param: pz.nn.FrozenParameter(param.value, param.name))
  )
  return pz.nn.initialize_parameters(lora.loraify_linears_in_selection(pz.select(frozen), rank=4), jax.random.key(20))


def _frozen_values(model):
  return {
    p.name: np.asarray(p.value.data_array)
    for p in pz.select(model).at_instances_of(pz.nn.FrozenParameter).get_sequence()
  }


def xor_loss(*, model, state, rng, inputs, labels):
  scale = 1 + jax.random.uniform(rng, shape=(1,))
  logits = model(pz.nx.wrap(inputs, "batch", "features")).unwrap("batch", "features")
  loss = jnp.sum(-scale * jax.nn.log_softmax(logits, axis=-1) * labels) / 4
  return loss, state + 1, {"loss": loss, "count": state}


def test_params_are_the_penzai_parameters_keyed_by_their_names():
  model = _mlp()
  ours = dt.TrainState.initial_state(model, optax.adam(0.1), jax.random.key(0))
  theirs = basic_training.TrainState.initial_state(
    model=model, optimizer_def=optax.adam(0.1), root_rng=jax.random.key(0)
  )
  assert list(ours.params) == list(theirs.params)
  assert "Affine_0.Linear.weights" in ours.params
  for name, value in theirs.params.items():
    assert ours.params[name] is value
  assert jax.tree_util.tree_structure(ours.model_without_params) == jax.tree_util.tree_structure(
    theirs.model_without_params
  )


def test_lora_model_trains_only_its_parameters_not_the_frozen_ones():
  model = _lora_mlp()
  theirs = basic_training.TrainState.initial_state(
    model=model, optimizer_def=optax.adam(0.1), root_rng=jax.random.key(42)
  )
  state = dt.TrainState.initial_state(model, optax.adam(0.1), jax.random.key(42), loss_fn_state=100)
  assert sorted(state.params) == sorted(theirs.params) and len(state.params) == 6
  assert all("lowrank" in param.named_shape for param in state.params.values())
  before_frozen = _frozen_values(model)
  assert len(before_frozen) == 6
  before_params = {name: np.asarray(v.data_array) for name, v in state.params.items()}
  step = dt.build_train_step_fn(xor_loss)
  for _ in range(20):
    state, aux = step(state, inputs=XOR_INPUTS, labels=XOR_LABELS)
  after_frozen = _frozen_values(state.model)
  assert after_frozen.keys() == before_frozen.keys()
  for name in before_frozen:
    np.testing.assert_array_equal(after_frozen[name], before_frozen[name], err_msg=name)
  assert all(not np.array_equal(state.params[name].data_array, before_params[name]) for name in before_params)
  assert int(aux["count"]) == 119 and float(aux["loss"]) < 1e-4


def test_training_matches_penzai_basic_training_step_for_step():
  model = _mlp()
  ours = dt.TrainState.initial_state(model, optax.adam(0.1), jax.random.key(42), loss_fn_state=100)
  theirs = basic_training.TrainState.initial_state(
    model=model, optimizer_def=optax.adam(0.1), root_rng=jax.random.key(42), loss_fn_state=100
  )
  our_step = dt.build_train_step_fn(xor_loss)
  their_step = jax.jit(basic_training.build_train_step_fn(xor_loss))
  for _ in range(5):
    ours, our_aux = our_step(ours, inputs=XOR_INPUTS, labels=XOR_LABELS)
    theirs, their_aux = their_step(theirs, inputs=XOR_INPUTS, labels=XOR_LABELS)
    np.testing.assert_allclose(our_aux["loss"], their_aux["loss"], rtol=1e-6)
    assert int(our_aux["count"]) == int(their_aux["count"])
  for name in theirs.params:
    np.testing.assert_allclose(ours.params[name].data_array, theirs.params[name].data_array, rtol=1e-5, atol=1e-7)


def test_model_property_rebinds_the_current_params():
  model = _mlp()
  state = dt.TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))
  rebuilt = state.model
  assert jax.tree_util.tree_structure(rebuilt) == jax.tree_util.tree_structure(model)
  x = pz.nx.wrap(XOR_INPUTS, "batch", "features")
  np.testing.assert_array_equal(rebuilt(x).unwrap("batch", "features"), model(x).unwrap("batch", "features"))
  doubled = state.replace(params=jax.tree_util.tree_map(lambda v: 2 * v, state.params))
  weights = pz.select(doubled.model).at_instances_of(pz.nn.Parameter).get_sequence()[0]
  np.testing.assert_array_equal(weights.value.data_array, 2 * state.params[weights.name].data_array)


def test_penzai_v2_model_is_refused_naming_the_variable():
  from penzai.models import simple_mlp as simple_mlp_v2

  model = simple_mlp_v2.MLP.from_config(init_base_rng=jax.random.key(0), feature_sizes=[2, 4, 2])
  with pytest.raises(TypeError, match=r"penzai v2 model \(Parameter at model\.sublayers.*4 variable\(s\)"):
    dt.TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))


def test_uninitialized_penzai_model_is_refused_with_the_fix():
  model = simple_mlp.MLP.from_config(feature_sizes=[2, 4, 2])
  with pytest.raises(ValueError, match="4 UninitializedParameter.*initialize_parameters"):
    dt.TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))


def test_is_param_is_refused_for_penzai_models():
  with pytest.raises(ValueError, match="is_param does not apply to penzai"):
    dt.TrainState.initial_state(_mlp(), optax.sgd(0.1), jax.random.key(0), is_param=lambda path, leaf: True)


def _planner(**rule_kwargs):
  mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (2, 2, 2)))
  rules = dt.AxisRules([("batch", ("data", "fsdp")), ("features", "fsdp"), ("features_out", "tensor")], **rule_kwargs)
  return dt.MeshPlanner(mesh, rules)


def _xor_state(model):
  return dt.TrainState.initial_state(model, optax.adam(0.1), jax.random.key(42), loss_fn_state=jnp.asarray(100))


def test_planner_shards_penzai_params_by_their_named_axes():
  plan = _planner().plan(jax.eval_shape(lambda: _xor_state(_mlp())))
  params = plan.train_state_shardings.params
  assert params["Affine_1.Linear.weights"].data_array.spec == P("fsdp", "tensor")
  assert params["Affine_1.AddBias.bias"].data_array.spec == P("fsdp")
  adam = plan.train_state_shardings.opt_state[0]
  assert adam.mu["Affine_1.Linear.weights"].data_array.spec == P("fsdp", "tensor")
  row = next(e for e in plan.entries if e.group == "params" and e.path == "Affine_1.Linear.weights")
  assert row.logical_axes == ("features", "features_out")


def test_planner_falls_back_to_param_axes_regexes_on_penzai_names():
  model = _mlp()
  # A parameter whose value is a plain array carries no named axes.
  model = (
    pz.select(model)
    .at_instances_of(pz.nn.Parameter)
    .where(lambda p: p.name == "Affine_1.Linear.weights")
    .apply(lambda p: dataclasses.replace(p, value=p.value.unwrap("features", "features_out")))
  )
  planner = _planner(param_axes=[(r"Affine_\d\.Linear\.weights", ("features_out", "features"))])
  plan = planner.plan(jax.eval_shape(lambda: _xor_state(model)))
  assert plan.train_state_shardings.params["Affine_1.Linear.weights"].spec == P("tensor", "fsdp")
  # Named axes win over the regex where penzai gives them.
  assert plan.train_state_shardings.params["Affine_0.Linear.weights"].data_array.spec == P("fsdp", "tensor")


def test_sharded_penzai_training_matches_one_device():
  model = _mlp(sizes=(2, 32, 32, 2))
  single = _xor_state(model)
  step = dt.build_train_step_fn(xor_loss)
  planner = _planner()
  sharded, plan = planner.init(lambda: _xor_state(model))
  sharded_step = dt.build_train_step_fn(
    xor_loss, donate_params_and_state=True, train_state_shardings=plan.train_state_shardings
  )
  for _ in range(5):
    single, single_aux = step(single, inputs=XOR_INPUTS, labels=XOR_LABELS)
    sharded, sharded_aux = sharded_step(sharded, inputs=XOR_INPUTS, labels=XOR_LABELS)
    np.testing.assert_allclose(sharded_aux["loss"], single_aux["loss"], rtol=1e-5)
  weights = sharded.params["Affine_1.Linear.weights"].data_array
  assert weights.sharding.spec == P("fsdp", "tensor")
  for name in single.params:
    # Adam divides by the gradient's size: a last-place difference in a
    # sharded reduction can reach 1e-5 relative after five steps (jax 0.12).
    np.testing.assert_allclose(sharded.params[name].data_array, single.params[name].data_array, rtol=1e-4, atol=1e-5)


def test_penzai_state_checkpoint_round_trip_restores_params_and_frozen_weights(tmp_path):
  model = _lora_mlp()
  state, plan = _planner().init(lambda: _xor_state(model))
  step = dt.build_train_step_fn(xor_loss, train_state_shardings=plan.train_state_shardings)
  for _ in range(3):
    state, _ = step(state, inputs=XOR_INPUTS, labels=XOR_LABELS)
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.save(3, state)
    checkpoints.wait_until_finished()
    restored = checkpoints.restore(plan.abstract_train_state)
  assert sorted(restored.params) == sorted(state.params)
  for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state)):
    np.testing.assert_array_equal(
      jax.random.key_data(got) if jnp.issubdtype(got.dtype, jax.dtypes.prng_key) else got,
      jax.random.key_data(want) if jnp.issubdtype(want.dtype, jax.dtypes.prng_key) else want,
    )
  assert _frozen_values(restored.model).keys() == _frozen_values(model).keys()
