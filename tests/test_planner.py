"""MeshPlanner and Plan: shardings from rules, report, sharded init."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import distrib_train as dt
import helpers

AXES3 = ("data", "fsdp", "tensor")


def _mesh(shape=(2, 2, 2)):
  return dt.build_mesh(dt.MeshConfig(AXES3, shape))


def _planner(mesh=None, **rule_kwargs):
  rule_kwargs.setdefault("param_axes", helpers.MLP_PARAM_AXES)
  return dt.MeshPlanner(mesh or _mesh(), dt.AxisRules("fsdp_tensor", **rule_kwargs))


def _example_inputs():
  x, y = helpers.batch(0)
  return {"inputs": jax.ShapeDtypeStruct(x.shape, x.dtype), "targets": jax.ShapeDtypeStruct(y.shape, y.dtype)}


def test_params_get_the_rules_specs():
  plan = _planner().plan(jax.eval_shape(helpers.make_state))
  shardings = plan.train_state_shardings.params
  assert shardings["0/w"].spec == P("fsdp", "tensor")
  assert shardings["0/b"].spec == P("tensor")
  assert all(isinstance(s, NamedSharding) for s in jax.tree_util.tree_leaves(plan.train_state_shardings))


def test_optimizer_leaves_mirroring_a_param_share_its_sharding_inside_chain_and_inject():
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3))
  make = lambda: dt.TrainState.initial_state(helpers.init_mlp(jax.random.key(0), helpers.SIZES), tx, jax.random.key(0))
  plan = _planner().plan(jax.eval_shape(make))
  adam_state = plan.train_state_shardings.opt_state[1].inner_state[0]
  for moments in (adam_state.mu, adam_state.nu):
    assert moments["0/w"].spec == P("fsdp", "tensor")
    assert moments["2/b"].spec == P("tensor")
  hyper = plan.train_state_shardings.opt_state[1].hyperparams
  assert hyper["learning_rate"].spec == P()
  assert adam_state.count.spec == P()


def test_step_root_rng_model_rest_and_loss_state_are_replicated():
  model = {"w": jnp.ones((16, 64)), "table": jnp.arange(8)}
  make = lambda: dt.TrainState.initial_state(model, optax.adam(0.1), jax.random.key(0), loss_fn_state=jnp.zeros(4))
  plan = _planner(param_axes=[("w", ("embed", "mlp"))]).plan(make())
  shardings = plan.train_state_shardings
  assert shardings.step.spec == P() and shardings.root_rng.spec == P()
  assert shardings.model_without_params["table"].spec == P()
  assert shardings.loss_fn_state.spec == P()


def test_input_shardings_default_to_batch_on_dim_zero_and_take_input_axes():
  inputs = {"tokens": jax.ShapeDtypeStruct((8, 16), jnp.int32), "mask": jax.ShapeDtypeStruct((8, 16), jnp.bool_)}
  plan = _planner().plan(jax.eval_shape(helpers.make_state), inputs=inputs, input_axes={"tokens": ("batch", "length")})
  assert plan.input_kwarg_shardings["tokens"].spec == P(("data", "fsdp"), None)
  assert plan.input_kwarg_shardings["mask"].spec == P(("data", "fsdp"), None)
  only_axes = _planner().plan(jax.eval_shape(helpers.make_state), input_axes={"tokens": ("length", "batch")})
  assert only_axes.input_kwarg_shardings["tokens"].spec == P(None, ("data", "fsdp"))


def test_aux_shardings_follow_aux_axes_and_otherwise_replicate():
  def loss_fn(*, model, state, rng, inputs, targets):
    logits = helpers.apply_mlp(model, inputs)
    loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))
    return loss, state, {"loss": loss, "logits": logits}

  plan = _planner().plan(
    jax.eval_shape(helpers.make_state),
    loss_fn=loss_fn,
    inputs=_example_inputs(),
    aux_axes={"logits": ("batch", "vocab")},
  )
  assert plan.aux_output_shardings["loss"].spec == P()
  assert plan.aux_output_shardings["logits"].spec == P(("data", "fsdp"), "tensor")


def test_loss_fn_without_inputs_is_an_error():
  with pytest.raises(ValueError, match="needs inputs="):
    _planner().plan(jax.eval_shape(helpers.make_state), loss_fn=helpers.classification_loss)


def test_param_logical_axes_argument_overrides_param_axes():
  plan = _planner().plan(jax.eval_shape(helpers.make_state), param_logical_axes={"0/w": ("mlp", "embed")})
  assert plan.train_state_shardings.params["0/w"].spec == P("tensor", "fsdp")
  assert plan.train_state_shardings.params["1/w"].spec == P("fsdp", "tensor")


def test_param_logical_axes_of_the_wrong_rank_names_the_parameter():
  with pytest.raises(
    ValueError, match=r"params/0/w: logical axes \('embed',\) have 1 entries but the array has rank 2"
  ):
    _planner().plan(jax.eval_shape(helpers.make_state), param_logical_axes={"0/w": ("embed",)})


def test_unannotated_params_are_replicated_and_listed():
  plan = _planner(param_axes=()).plan(jax.eval_shape(helpers.make_state))
  assert plan.train_state_shardings.params["0/w"].spec == P()
  assert set(plan.unannotated) == {"0/w", "0/b", "1/w", "1/b", "2/w", "2/b"}
  assert "Smaller params with no logical axes, replicated: 6" in plan.report()


def test_unannotated_params_over_one_mib_are_named_in_the_report():
  model = {"big": jnp.zeros((1024, 512)), "small": jnp.zeros((4, 4)), "named": jnp.zeros((1024, 512))}
  make = lambda: dt.TrainState.initial_state(model, optax.sgd(0.1), jax.random.key(0))
  plan = _planner(param_axes=[("named", ("embed", "mlp"))]).plan(jax.eval_shape(make))
  report = plan.report()
  assert "Params over 1 MiB with no logical axes, replicated on every device (1):\n  big (2.00 MiB)" in report
  assert "Smaller params with no logical axes, replicated: 1" in report


def test_report_lists_every_array_totals_and_rule_skips():
  # tensor=4 cannot split the last layer's 6 outputs: the rule is skipped.
  make = lambda: dt.TrainState.initial_state(
    helpers.init_mlp(jax.random.key(0), [16, 64, 6]), optax.adam(0.1), jax.random.key(0), loss_fn_state=jnp.int32(0)
  )
  plan = _planner(_mesh((1, 2, 4))).plan(
    jax.eval_shape(make), loss_fn=helpers.classification_loss, inputs=_example_inputs()
  )
  assert plan.train_state_shardings.params["1/w"].spec == P("fsdp", None)
  report = plan.report()
  assert "Plan on mesh data=1 × fsdp=2 × tensor=4 (8 devices)" in report
  assert "params         0/w" in report and "P('fsdp', 'tensor')" in report
  assert "opt_state      0/mu/0/w" in report
  assert "inputs         inputs" in report and "aux            loss" in report
  assert "Rule skips (2):" in report
  assert "params/1/b: dim 0 ('mlp', size 6) not split over tensor (size 4)" in report
  assert "params/1/w: dim 1 ('mlp', size 6) not split over tensor (size 4)" in report
  per_device = plan.bytes_per_device()
  # 0/w (16, 64) on fsdp 2 × tensor 4 → 8 × 16 floats; 0/b (64,) on tensor 4 → 16 floats;
  # 1/w (64, 6) on fsdp 2 → 32 × 6 floats; 1/b (6,) replicated.
  expected_params = 4 * (8 * 16 + 16 + 32 * 6 + 6)
  assert per_device["params"] == expected_params
  assert per_device["opt_state"] == 2 * expected_params + 4  # mu, nu and the int32 count
  assert f"params {expected_params / 1024:.2f} KiB" in report


def test_sharded_init_puts_exactly_the_reported_bytes_on_each_device():
  state, plan = _planner().init(helpers.make_state, inputs=_example_inputs(), loss_fn=helpers.classification_loss)
  per_device = plan.bytes_per_device()
  for group in ("params", "opt_state", "loss_fn_state"):
    held = {}
    for leaf in jax.tree_util.tree_leaves(getattr(state, group)):
      for shard in leaf.addressable_shards:
        held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    assert set(held.values()) == {per_device[group]}, group
    assert len(held) == 8
  for got, want in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(plan.train_state_shardings)):
    assert got.sharding == want


def test_sharded_init_matches_unsharded_init():
  state, _ = _planner().init(helpers.make_state)
  reference = helpers.make_state()
  # A sharded jax.random.normal may round differently in the last places from
  # the eager one (seen on jax 0.12: 3 ulp): equal to float32 rounding, not
  # bit for bit.
  for name, value in reference.params.items():
    np.testing.assert_allclose(np.asarray(state.params[name]), np.asarray(value), rtol=1e-6, atol=1e-7)


def test_init_fn_unlike_the_plan_is_an_error():
  plan = _planner().plan(jax.eval_shape(helpers.make_state))
  other = lambda: dt.TrainState.initial_state(
    helpers.init_mlp(jax.random.key(0), [16, 32, 64, 8]),
    optax.adam(1e-2),
    jax.random.key(0),
    loss_fn_state=jnp.int32(0),
  )
  with pytest.raises(
    ValueError, match=r"init_fn builds params/0/b as float32\[32\]; the plan has params/0/b as float32\[64\]"
  ):
    plan.init(other)


def test_rules_naming_an_unknown_axis_the_mesh_lacks_fail_at_construction():
  mesh = dt.build_mesh(dt.MeshConfig(("data",), (8,)))
  with pytest.raises(ValueError, match="names mesh axis 'fsdpp', which the mesh does not have"):
    dt.MeshPlanner(mesh, dt.AxisRules([("batch", "data"), ("embed", "fsdpp")]))


def test_the_fsdp_tensor_rules_plan_a_data_by_fsdp_mesh_with_tensor_as_size_1():
  mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp"), (2, 4)))
  plan = dt.MeshPlanner(mesh, dt.AxisRules("fsdp_tensor", param_axes=helpers.MLP_PARAM_AXES)).plan(
    jax.eval_shape(helpers.make_state), inputs=_example_inputs()
  )
  shardings = plan.train_state_shardings.params
  assert shardings["0/w"].spec == P("fsdp", None) and shardings["0/b"].spec == P(None)  # ("mlp", "tensor"): whole
  assert plan.input_kwarg_shardings["inputs"].spec[0] == ("data", "fsdp")
  state = plan.init(helpers.make_state)
  assert state.params["0/w"].sharding.spec == P("fsdp", None)


def test_a_jax_make_mesh_explicit_mesh_is_accepted_and_the_step_runs():
  explicit = jax.make_mesh((2, 2, 2), AXES3, axis_types=(jax.sharding.AxisType.Explicit,) * 3)
  planner = _planner(explicit)
  assert all(t == jax.sharding.AxisType.Auto for t in planner.mesh.axis_types)
  x, y = helpers.batch(0)
  state, plan = planner.init(helpers.make_state, inputs=_example_inputs(), loss_fn=helpers.classification_loss)
  step_fn = dt.build_train_step_fn(
    helpers.classification_loss,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
  )
  # Inputs placed on the user's own explicit mesh work too.
  x = jax.device_put(x, NamedSharding(explicit, P(("data", "fsdp"))))
  state, aux = step_fn(state, inputs=x, targets=y)
  assert np.isfinite(float(aux["loss"]))


@pytest.mark.parametrize("shape", [(8, 1, 1), (1, 4, 2), (2, 2, 2)], ids=["data8", "fsdp4-tensor2", "2x2x2"])
def test_training_is_the_same_on_every_mesh(shape):
  one_device = dt.build_mesh(dt.MeshConfig(AXES3, (1, 1, 1)), devices=jax.devices()[:1])
  ref_losses, ref_params = helpers.train_small_model(one_device, steps=10)
  losses, params = helpers.train_small_model(_mesh(shape), steps=10)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  for name in ref_params:
    np.testing.assert_allclose(params[name], ref_params[name], rtol=1e-5, atol=1e-6, err_msg=name)
  assert losses[-1] < losses[0]


def test_a_train_state_subclass_with_extra_fields_is_planned():
  class EmaTrainState(dt.TrainState):
    ema: dict = None

  def make():
    state = helpers.make_state()
    return EmaTrainState(**{f: getattr(state, f) for f in state.__dataclass_fields__}, ema=dict(state.params))

  state, plan = _planner().init(make)
  assert isinstance(state, EmaTrainState)
  assert plan.train_state_shardings.ema["0/w"].spec == P()
  assert "ema            0/w" in plan.report()


def test_logical_axes_given_as_lists_are_accepted():
  plan = _planner().plan(
    jax.eval_shape(helpers.make_state),
    param_logical_axes={"0/w": ["mlp", "embed"]},
    inputs={"tokens": jax.ShapeDtypeStruct((8, 16), jnp.int32)},
    input_axes={"tokens": ["length", "batch"]},
  )
  assert plan.train_state_shardings.params["0/w"].spec == P("tensor", "fsdp")
  assert plan.input_kwarg_shardings["tokens"].spec == P(None, ("data", "fsdp"))


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(param_logical_axes={"0/W": ("embed", "mlp")}), r"param_logical_axes names '0/W', which match"),
    (
      dict(loss_fn=helpers.classification_loss, inputs=_example_inputs(), aux_axes={"logits": ("batch",)}),
      r"aux_axes names 'logits'.*count, loss",
    ),
  ],
)
def test_logical_axes_naming_nothing_are_an_error(kwargs, message):
  with pytest.raises(ValueError, match=message):
    _planner().plan(jax.eval_shape(helpers.make_state), **kwargs)


def test_plan_init_keeps_init_fns_own_optimizer_and_checks_dtypes():
  plan = _planner().plan(jax.eval_shape(helpers.make_state))
  other_lr = lambda: dt.TrainState.initial_state(
    helpers.init_mlp(jax.random.key(0), helpers.SIZES), optax.adam(0.5), jax.random.key(42), loss_fn_state=jnp.int32(0)
  )
  state = plan.init(other_lr)
  assert state.optimizer_def is not plan.train_state_shardings.optimizer_def
  bf16 = lambda: jax.tree_util.tree_map(
    lambda x: x.astype(jnp.bfloat16) if getattr(x, "dtype", None) == jnp.float32 else x, helpers.make_state()
  )
  with pytest.raises(
    ValueError, match=r"builds params/0/b as bfloat16\[64\]; the plan has params/0/b as float32\[64\]"
  ):
    plan.init(bf16)


def test_data_parallel_rule_set_works_on_a_pure_data_mesh():
  mesh = dt.build_mesh(dt.MeshConfig(("data",), (8,)))
  plan = dt.MeshPlanner(mesh, "data_parallel").plan(jax.eval_shape(helpers.make_state), inputs=_example_inputs())
  assert plan.input_kwarg_shardings["inputs"].spec == P("data", None)
  assert plan.train_state_shardings.params["0/w"].spec == P()


def test_input_axes_for_inputs_not_given_are_listed_in_the_report():
  plan = _planner().plan(
    jax.eval_shape(helpers.make_state),
    inputs={"tokens": jax.ShapeDtypeStruct((8, 16), jnp.int32)},
    input_axes={"tokens": ("batch", None), "segment_ids": ("batch", None)},
  )
  assert "input_axes for inputs not given (ignored): segment_ids" in plan.report()


def test_summary_is_a_few_lines_with_fitting_units_and_the_report_is_the_whole_table():
  plan = _planner().plan(jax.eval_shape(helpers.make_state))
  summary = plan.summary()
  assert len(summary.splitlines()) <= 2
  assert summary.startswith("Plan on mesh data=2 × fsdp=2 × tensor=2 (8 devices):")
  assert "0.00 GiB" not in summary and "KiB" in summary
  assert len(plan.report().splitlines()) > len(summary.splitlines()) + 5


def test_human_bytes_picks_the_unit():
  from distrib_train.sharding.plan import human_bytes

  assert [human_bytes(n) for n in (12, 3 * 1024, 5 * 2**20, 2**31)] == ["12 B", "3.00 KiB", "5.00 MiB", "2.00 GiB"]
