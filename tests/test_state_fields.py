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
  assert step_core._DONATED == ("params", "opt_state", "loss_fn_state", "local_state")
  # Every donated field is an argument of the step core by its own name.
  assert set(step_core._DONATED) <= set(step_core._StepArrays._fields)
  assert checks.SAVED_FIELDS == tuple(f.name for f in STATE_FIELDS)
  assert checks.MODEL_FIELDS == ("params", "model_without_params", "local_state")
  assert plan._STATE_GROUPS == checks.SAVED_FIELDS
  # The memory figures count each field once: params, opt_state and local_state by name, the rest together.
  assert sorted(memory._OTHER_STATE + ("params", "opt_state", "local_state")) == sorted(checks.SAVED_FIELDS)
  assert state_fields(roles=("trainable",)) == ("params",)


def test_a_field_a_subclass_adds_is_replicated_saved_and_not_donated():
  row = state_field("ema")
  assert (row.layout, row.checkpointed, row.donated) == ("replicated", True, False)
