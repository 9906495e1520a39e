"""train_state.STATE_FIELDS is the one list of TrainState's fields the step, planner and checkpoints read."""

import dataclasses

from distrib_train import step_core
from distrib_train.checkpoint import checks
from distrib_train.podplan import memory
from distrib_train.sharding import plan
from distrib_train.train_state import STATE_FIELDS, TrainState, state_field, state_fields


def test_the_table_lists_every_array_field_of_train_state_once():
  fields = [f.name for f in dataclasses.fields(TrainState) if f.metadata.get("pytree_node", True)]
  assert sorted(fields) == sorted(f.name for f in STATE_FIELDS)
  assert len({f.name for f in STATE_FIELDS}) == len(STATE_FIELDS)


def test_the_step_planner_and_checkpoints_read_their_lists_from_the_table():
  assert step_core.DONATED == ("params", "opt_state", "loss_fn_state", "local_state")
  # Every donated field is an argument of the step core by its own name.
  assert set(step_core.DONATED) <= set(step_core.StepArrays._fields)
  assert checks.SAVED_FIELDS == tuple(f.name for f in STATE_FIELDS)
  assert checks.MODEL_FIELDS == ("params", "model_without_params", "local_state")
  assert plan._STATE_GROUPS == checks.SAVED_FIELDS
  # The memory figures count each field once: params, opt_state and local_state by name, the rest together.
  assert sorted(memory._OTHER_STATE + ("params", "opt_state", "local_state")) == sorted(checks.SAVED_FIELDS)
  assert state_fields(roles=("trainable",)) == ("params",)


def test_a_field_a_subclass_adds_is_replicated_and_neither_donated_nor_saved():
  row = state_field("ema")
  assert (row.layout, row.checkpointed, row.donated) == ("replicated", False, False)
  assert "ema" not in checks.SAVED_FIELDS


def test_frozen_weights_are_laid_out_by_their_logical_axes_and_never_updated():
  """A model whose first two layers are frozen (a LoRA base, a DPO reference): they sit in
  model_without_params, sharded by the same rules as params, out of the optimizer, unchanged by steps;
  the sharded run's losses and params equal one device's."""
  import jax
  import numpy as np
  import optax
  from jax.sharding import PartitionSpec

  import distrib_train as dt
  import helpers

  if jax.device_count() < 8:
    import pytest

    pytest.skip("needs the 8 emulated devices of conftest")

  def make_state():
    return dt.TrainState.initial_state(
      helpers.init_mlp(jax.random.key(0), helpers.SIZES),
      optax.adam(1e-2),
      jax.random.key(42),
      loss_fn_state=np.int32(0),
      is_param=lambda path, leaf: path.startswith("2/"),
    )

  mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), devices=jax.devices()[:8])
  x, y = helpers.batch(0)
  planner = dt.MeshPlanner(mesh, dt.AxisRules("fsdp_tensor", param_axes=helpers.MLP_PARAM_AXES))
  plan = planner.plan(
    jax.eval_shape(make_state),
    loss_fn=helpers.classification_loss,
    inputs={"inputs": x, "targets": y},
    input_axes={"inputs": ("batch", "embed"), "targets": ("batch",)},
  )
  frozen = {e.path: e.spec for e in plan.entries if e.group == "model_without_params"}
  assert frozen["0/w"] == PartitionSpec("fsdp", "tensor") and frozen["1/b"] == PartitionSpec("tensor")
  assert sorted(make_state().params) == ["2/b", "2/w"]
  opt_bytes = sum(e.bytes_per_device * 8 for e in plan.entries if e.group == "opt_state")
  assert opt_bytes <= 3 * 4 * (64 * 8 + 8)  # adam's two moments (and count) of layer 2 alone

  sharded_step = dt.build_train_step_fn(
    helpers.classification_loss,
    donate_params_and_state=True,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
  )
  one_step = dt.build_train_step_fn(helpers.classification_loss)
  sharded, single = plan.init(make_state), make_state()
  first_frozen = np.asarray(sharded.model_without_params[0]["w"])
  for step in range(3):
    x, y = helpers.batch(step)
    sharded, aux = sharded_step(sharded, inputs=x, targets=y)
    single, want = one_step(single, inputs=x, targets=y)
    np.testing.assert_allclose(float(aux["loss"]), float(want["loss"]), rtol=1e-5)
  for name in ("2/w", "2/b"):
    np.testing.assert_allclose(np.asarray(sharded.params[name]), np.asarray(single.params[name]), atol=1e-5)
  assert sharded.model_without_params[0]["w"].sharding.spec == PartitionSpec("fsdp", "tensor")
  np.testing.assert_array_equal(np.asarray(sharded.model_without_params[0]["w"]), first_frozen)


def test_frozen_nnx_variables_are_laid_out_by_their_annotations():
  import jax
  import optax
  from flax import nnx
  from jax.sharding import PartitionSpec

  import distrib_train as dt
  from distrib_train.sharding.plan import logical_annotations_only

  class Adapted(nnx.Module):
    def __init__(self, rngs):
      init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
      self.base = nnx.Linear(16, 32, kernel_init=init, use_bias=False, rngs=rngs)
      self.head = nnx.Linear(32, 4, rngs=rngs)

  def make_state():
    return dt.TrainState.initial_state(
      Adapted(nnx.Rngs(0)), optax.sgd(0.1), jax.random.key(0), is_param=nnx.All(nnx.Param, nnx.PathContains("head"))
    )

  mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), devices=jax.devices()[:8])
  with logical_annotations_only():
    plan = dt.MeshPlanner(mesh, dt.AxisRules("fsdp_tensor")).plan(jax.eval_shape(make_state))
  frozen = [e for e in plan.entries if e.group == "model_without_params" and e.path.endswith("base/kernel")]
  assert [e.spec for e in frozen] == [PartitionSpec("fsdp", "tensor")], [(e.path, e.spec) for e in plan.entries]
