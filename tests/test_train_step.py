"""build_train_step_fn: penzai behaviour, donation, shardings, one compile."""

import contextlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distrib_train as dt
import helpers

XOR_INPUTS = jnp.array([[-1, -1], [-1, 1], [1, -1], [1, 1]], dtype=jnp.float32)
XOR_LABELS = jnp.array([[0, 1], [1, 0], [1, 0], [0, 1]], dtype=jnp.float32)


def xor_loss(model, rng, state):
  # penzai's own XOR test: the loss scaled by 1 + uniform(rng); a counter state.
  scale = 1 + jax.random.uniform(rng, shape=(1,))
  log_probs = jax.nn.log_softmax(helpers.apply_mlp(model, XOR_INPUTS), axis=-1)
  loss = jnp.sum(-scale * log_probs * XOR_LABELS) / 4
  return loss, state + 1, {"loss": loss, "count": state}


def _train_xor(step_fn):
  state = dt.TrainState.initial_state(
    model=helpers.init_mlp(jax.random.key(10), [2, 32, 32, 2]),
    optimizer_def=optax.adam(0.1),
    root_rng=jax.random.key(42),
    loss_fn_state=100,
  )
  outputs = []
  for _ in range(20):
    state, out = step_fn(state)
    outputs.append(out)
  return state, outputs


@pytest.mark.parametrize(
  "make_step",
  [
    lambda: jax.jit(dt.build_train_step_fn(xor_loss)),  # as penzai's tests do
    lambda: dt.build_train_step_fn(xor_loss),
    lambda: dt.build_train_step_fn(xor_loss, jit=False),
    lambda: dt.build_train_step_fn(xor_loss, donate_params_and_state=True),
  ],
  ids=["wrapped-in-jit", "unwrapped", "jit-false", "donated"],
)
def test_penzai_xor_mlp_trains_and_counts(make_step):
  state, outputs = _train_xor(make_step())
  assert [int(o["count"]) for o in outputs] == list(range(100, 120))
  assert float(outputs[0]["loss"]) > 0.5
  assert float(outputs[-1]["loss"]) < 1e-4
  assert int(state.step) == 20


def test_step_key_is_fold_in_of_root_rng_and_step():
  def loss_fn(*, model, state, rng):
    return jnp.sum(model["w"] ** 2), state, jax.random.key_data(rng)

  state = dt.TrainState.initial_state({"w": jnp.ones(3)}, optax.sgd(0.1), jax.random.key(7))
  step_fn = dt.build_train_step_fn(loss_fn)
  for i in range(3):
    state, key_data = step_fn(state)
    expected = jax.random.key_data(jax.random.fold_in(jax.random.key(7), i))
    np.testing.assert_array_equal(key_data, expected)


def test_step_stays_a_python_int_when_it_starts_as_one():
  state, _ = _train_xor(dt.build_train_step_fn(xor_loss))
  assert state.step == 20 and isinstance(state.step, int)


def test_donation_deletes_params_opt_state_and_loss_fn_state_only():
  def loss_fn(*, model, state, rng, x):
    loss = jnp.sum((x @ model["w"]) ** 2) + jnp.sum(model["offsets"])
    return loss, state + 1, {"loss": loss}

  model = {"w": jnp.ones((4, 2)), "offsets": jnp.arange(2)}  # offsets: int, not a param
  state = dt.TrainState.initial_state(model, optax.adam(0.1), jax.random.key(0), loss_fn_state=jnp.zeros(()))
  x = jnp.ones((3, 4))
  step_fn = dt.build_train_step_fn(loss_fn, donate_params_and_state=True)
  new_state, _ = step_fn(state, x=x)
  assert state.params["w"].is_deleted()
  assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(state.opt_state))
  assert state.loss_fn_state.is_deleted()
  assert not state.model_without_params["offsets"].is_deleted()
  assert not state.root_rng.is_deleted()
  assert not x.is_deleted()
  new_state, _ = step_fn(new_state, x=x)  # the new state is usable
  assert int(new_state.step) == 2


def test_without_donation_nothing_is_deleted():
  state, _ = _train_xor(dt.build_train_step_fn(xor_loss))
  first = dt.TrainState.initial_state(
    helpers.init_mlp(jax.random.key(1), [2, 4, 2]), optax.adam(0.1), jax.random.key(0), loss_fn_state=0
  )
  dt.build_train_step_fn(xor_loss)(first)
  assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(first.params))


def test_jit_false_with_donation_is_a_value_error():
  with pytest.raises(ValueError, match="Cannot donate params and state unless jit=True"):
    dt.build_train_step_fn(xor_loss, jit=False, donate_params_and_state=True)


def _planned_step(mesh, aux_axes=None, **kwargs):
  planner = dt.MeshPlanner(mesh, dt.AxisRules("fsdp_tensor", param_axes=helpers.MLP_PARAM_AXES))
  x, y = helpers.batch(0)
  inputs = {"inputs": jnp.asarray(x), "targets": jnp.asarray(y)}
  state, plan = planner.init(helpers.make_state, inputs=inputs, loss_fn=helpers.classification_loss, aux_axes=aux_axes)
  step_fn = dt.build_train_step_fn(
    helpers.classification_loss,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
    **kwargs,
  )
  return state, plan, step_fn, inputs


def test_every_returned_array_has_the_requested_sharding():
  mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (2, 2, 2)))
  state, plan, step_fn, inputs = _planned_step(mesh, donate_params_and_state=True)
  # Inputs arrive unsharded here; the step moves them onto the input shardings.
  new_state, aux = step_fn(state, **inputs)
  expected = plan.train_state_shardings
  for part in ("params", "opt_state", "loss_fn_state"):
    got_leaves = jax.tree_util.tree_leaves(getattr(new_state, part))
    want_leaves = jax.tree_util.tree_leaves(getattr(expected, part))
    assert len(got_leaves) == len(want_leaves) > 0
    for got, want in zip(got_leaves, want_leaves):
      assert got.sharding == want, part
  for got, want in zip(jax.tree_util.tree_leaves(aux), jax.tree_util.tree_leaves(plan.aux_output_shardings)):
    assert got.sharding == want
  # And the params really are split: a (16, 64) weight on fsdp 2 × tensor 2.
  w0 = new_state.params["0/w"]
  assert {s.data.shape for s in w0.addressable_shards} == {(8, 32)}


def test_the_step_compiles_once_for_ten_calls():
  traces = []

  def loss_fn(**kwargs):
    traces.append(1)
    return helpers.classification_loss(**kwargs)

  compiles = []
  listener = lambda name, *_, **__: compiles.append(name) if name.endswith("backend_compile_duration") else None
  x, y = helpers.batch(0)
  state = helpers.make_state()
  step_fn = dt.build_train_step_fn(loss_fn, donate_params_and_state=True)
  state, _ = step_fn(state, inputs=x, targets=y)
  state, _ = step_fn(state, inputs=x, targets=y)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    for i in range(8):
      x, y = helpers.batch(i)
      state, _ = step_fn(state, inputs=x, targets=y)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert len(traces) == 1
  assert compiles == []


def test_inputs_must_match_the_input_shardings():
  mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (8, 1, 1)))
  state, _, step_fn, inputs = _planned_step(mesh)
  with pytest.raises(ValueError, match="missing targets; not in the shardings labels"):
    step_fn(state, inputs=inputs["inputs"], labels=inputs["targets"])


@pytest.mark.parametrize(
  "bad_loss, message",
  [
    (lambda **kw: jnp.sum(kw["model"]["w"]), "must return \\(loss, new_state, aux\\); it returned a"),
    (lambda **kw: (jnp.sum(kw["model"]["w"]), None), "it returned a tuple of length 2"),
    (lambda **kw: (kw["model"]["w"], None, None), "The loss must be a scalar"),
  ],
)
def test_loss_function_with_the_wrong_outputs_is_named(bad_loss, message):
  state = dt.TrainState.initial_state({"w": jnp.ones(3)}, optax.sgd(0.1), jax.random.key(0))
  with pytest.raises(TypeError, match=message):
    dt.build_train_step_fn(bad_loss, jit=False)(state)


def test_lower_compiles_on_abstract_inputs():
  mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (2, 2, 2)))
  state, plan, step_fn, inputs = _planned_step(mesh, donate_params_and_state=True)
  abstract_state = plan.abstract_train_state
  abstract_inputs = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=plan.input_kwarg_shardings[k]) for k, v in inputs.items()
  }
  compiled = step_fn.lower(abstract_state, **abstract_inputs).compile()
  assert compiled.memory_analysis() is not None


def test_a_state_made_by_create_trains_and_its_loss_gets_no_key():
  def loss_fn(*, model, state, rng, x):
    assert rng is None
    loss = jnp.mean((x @ model["w"]) ** 2)
    return loss, state, {"loss": loss}

  state = dt.TrainState.create(apply_fn=None, params={"w": jnp.ones((3, 2))}, tx=optax.sgd(0.1))
  state, aux = dt.build_train_step_fn(loss_fn, donate_params_and_state=True)(state, x=jnp.ones((4, 3)))
  state, aux2 = dt.build_train_step_fn(loss_fn)(state, x=jnp.ones((4, 3)))
  assert float(aux2["loss"]) < float(aux["loss"]) and int(state.step) == 2


def test_shardings_given_for_step_and_root_rng_are_ignored():
  mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (2, 2, 2)))
  state, plan, _, inputs = _planned_step(mesh)
  # A sharding on a one-device mesh elsewhere: jit would refuse it if used.
  elsewhere = jax.sharding.NamedSharding(
    jax.sharding.Mesh(np.array(jax.devices()[-1:]), ("x",)), jax.sharding.PartitionSpec()
  )
  shardings = plan.train_state_shardings.replace(step=elsewhere, root_rng=elsewhere)
  step_fn = dt.build_train_step_fn(
    helpers.classification_loss, train_state_shardings=shardings, input_kwarg_shardings=plan.input_kwarg_shardings
  )
  new_state, _ = step_fn(state, **inputs)
  assert new_state.root_rng.sharding == state.root_rng.sharding
  assert int(new_state.step) == 1


def test_donation_copes_with_params_sharing_one_buffer():
  zeros = jnp.zeros((4,))
  model = {"a": {"w": jnp.ones((4, 4)), "b": zeros}, "b": {"w": jnp.ones((4, 4)), "b": zeros}}

  def loss_fn(*, model, state, rng, x):
    y = x @ model["a"]["w"] + model["a"]["b"]
    loss = jnp.mean((y @ model["b"]["w"] + model["b"]["b"]) ** 2)
    return loss, state, {"loss": loss}

  state = dt.TrainState.initial_state(model, optax.adam(0.1), jax.random.key(0))
  step_fn = dt.build_train_step_fn(loss_fn, donate_params_and_state=True)
  for _ in range(2):
    state, aux = step_fn(state, x=jnp.ones((2, 4)))
  assert np.isfinite(float(aux["loss"]))


def test_the_step_runs_inside_jax_set_mesh_of_an_explicit_mesh():
  explicit = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 3)
  with jax.set_mesh(explicit):
    state, plan, step_fn, _ = _planned_step(explicit)
    x, y = helpers.batch(0)
    state, aux = step_fn(state, inputs=jnp.asarray(x), targets=jnp.asarray(y))
  assert np.isfinite(float(aux["loss"])) and int(state.step) == 1


def _sum_loss(*, model, state, rng, x):
  loss = jnp.sum(model["w"] * x)
  return loss, state, {"loss": loss}


def test_a_loss_function_missing_a_batch_key_is_named_with_the_keys_it_must_take():
  state = dt.TrainState.initial_state({"w": jnp.ones(3)}, optax.sgd(0.1), jax.random.key(0))
  with pytest.raises(
    ValueError,
    match=r"The loss function _sum_loss does not accept y; it is called as "
    r"loss_fn\(model=, state=, rng=, x=, y=\)",
  ):
    dt.build_train_step_fn(_sum_loss)(state, x=jnp.ones(3), y=jnp.ones(3))


def test_a_loss_function_needing_an_argument_the_step_does_not_pass_is_named():
  state = dt.TrainState.initial_state({"w": jnp.ones(3)}, optax.sgd(0.1), jax.random.key(0))
  with pytest.raises(ValueError, match="_sum_loss needs x, which the step does not pass"):
    dt.build_train_step_fn(_sum_loss)(state)


def test_a_loss_function_with_var_keywords_takes_every_batch_key():
  def loss_fn(*, model, state, rng, x, **unused):
    return _sum_loss(model=model, state=state, rng=rng, x=x)

  state = dt.TrainState.initial_state({"w": jnp.ones(3)}, optax.sgd(0.1), jax.random.key(0))
  _, aux = dt.build_train_step_fn(loss_fn)(state, x=jnp.ones(3), y=jnp.ones(3))
  assert float(aux["loss"]) == 3.0


def test_the_planner_checks_the_loss_signature_before_tracing():
  mesh = dt.build_mesh(dt.MeshConfig(("data",), (-1,)), devices=jax.devices()[:1])
  state = dt.TrainState.initial_state({"w": jnp.ones(3)}, optax.sgd(0.1), jax.random.key(0))
  with pytest.raises(ValueError, match="_sum_loss does not accept y"):
    dt.MeshPlanner(mesh, dt.AxisRules([])).plan(
      jax.eval_shape(lambda: state),
      loss_fn=_sum_loss,
      inputs={"x": jax.ShapeDtypeStruct((3,), jnp.float32), "y": jax.ShapeDtypeStruct((3,), jnp.float32)},
    )


def test_the_step_cores_take_the_named_arguments_in_their_order():
  # jax.jit shards positional arguments only, so the cores are called as core(*arrays, statics).
  from distrib_train import train_step

  for core in (train_step.updated_params_and_states, train_step.eval_outputs):
    assert tuple(inspect.signature(core).parameters) == train_step.StepArrays._fields + ("statics",), core.__name__
  assert set(train_step.DONATED) < set(train_step.StepArrays._fields)


def test_the_eval_step_donates_nothing():
  def loss_fn(*, model, state, rng, x):
    loss = jnp.sum((x @ model["w"]) ** 2)
    return loss, state + 1, {"loss": loss}

  state = dt.TrainState.initial_state(
    {"w": jnp.ones((4, 2))}, optax.adam(0.1), jax.random.key(0), loss_fn_state=jnp.zeros(())
  )
  aux = dt.build_eval_step_fn(loss_fn)(state, x=jnp.ones((3, 4)))
  assert float(aux["loss"]) == 96.0  # six entries of 4², from ones
  kept = (state.params, state.opt_state, state.loss_fn_state)
  assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(kept))


def test_a_step_built_with_the_plans_rules_lays_out_activations_wherever_it_is_traced():
  """``activation_rules``: the step carries its activation layout (a static argument, in jit's cache key), so
  traced outside any ``activation_sharding`` it holds the constraints a step traced inside one holds; a step
  without the rules, traced outside, holds none. Likewise for the eval step."""
  from distrib_train.sharding.axis_rules import activation_sharding
  from distrib_train.config import run as config_lib
  from distrib_train.config import job as job_lib

  config = config_lib.load("tiny", ["train.compilation_cache_dir="])
  job = job_lib.job_spec(config)
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), devices=jax.devices()[:8])
  planner = dt.MeshPlanner(mesh, job_lib.rules_for(config, dt.MeshConfig(("data",), (8,))))
  plan = job_lib.plan_job(job, planner)
  tokens = jax.ShapeDtypeStruct((8, 32), jnp.int32)
  batch = {"tokens": tokens, "targets": tokens, "weights": jax.ShapeDtypeStruct((8, 32), jnp.float32)}
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=plan.input_kwarg_shardings[k]) for k, v in batch.items()}
  shardings = {k: plan.input_kwarg_shardings[k] for k in batch}

  def constraints(build, rules, inside):
    step = build(
      job.loss_fn,
      train_state_shardings=plan.train_state_shardings,
      input_kwarg_shardings=shardings,
      activation_rules=rules,
    )
    jax.clear_caches()  # a step without the rules would reuse another trace's layout (jit's key lacks it)
    with activation_sharding(plan.mesh, planner.rules) if inside else contextlib.nullcontext():
      return step.lower(plan.abstract_train_state, **batch).as_text().count("sharding_constraint")

  for build in (dt.build_train_step_fn, dt.build_eval_step_fn):
    carried, traced_inside = constraints(build, planner.rules, False), constraints(build, None, True)
    assert carried == traced_inside > constraints(build, None, False), build.__name__
  with pytest.raises(ValueError, match="activation_rules lays the activations out on the shardings' mesh"):
    dt.build_train_step_fn(job.loss_fn, activation_rules=planner.rules)
