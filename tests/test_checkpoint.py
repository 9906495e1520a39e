"""CheckpointManager: round trips, resharding, multi-host, kills, retention, errors."""

import json
import os
import pathlib
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ckpt_helpers
import distrib_train as dt
import mp_harness

AXES3 = ("data", "fsdp", "tensor")
WORKERS = pathlib.Path(__file__).parent / "workers"


def _mesh(shape, devices=None):
  return dt.build_mesh(dt.MeshConfig(AXES3, shape), devices=devices)


def _trained(mesh=None, steps=3):
  plan, make, step_fn = ckpt_helpers.planned(mesh or _mesh((2, 2, 2)))
  return ckpt_helpers.train(plan.init(make), step_fn, 0, steps, plan), plan, step_fn


def _assert_same(a, b):
  arrays_a, arrays_b = ckpt_helpers.saved_arrays(a), ckpt_helpers.saved_arrays(b)
  assert arrays_a.keys() == arrays_b.keys()
  for key in arrays_a:
    np.testing.assert_array_equal(arrays_a[key], arrays_b[key], err_msg=key)


def test_round_trip_is_bit_exact_with_integer_keyed_layers(tmp_path):
  state, plan, _ = _trained()
  with dt.CheckpointManager(tmp_path) as checkpoints:
    assert checkpoints.save(3, state)
    checkpoints.wait_until_finished()
    restored = checkpoints.restore(plan.abstract_train_state)
  _assert_same(restored, state)
  assert list(dt.models.to_pure_dict(restored.params)["layers"]) == [0, 1]
  assert jax.random.key_data(restored.root_rng).tolist() == jax.random.key_data(state.root_rng).tolist()
  for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(plan.train_state_shardings)):
    assert got.sharding == want


@pytest.mark.parametrize("shape", [(1, 8, 1), (2, 1, 4), (1, 1, 1)], ids=["fsdp8", "tensor4-data2", "one-device"])
def test_restore_onto_another_mesh_keeps_values_and_takes_the_new_shardings(tmp_path, shape):
  state, _, _ = _trained()
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.save(3, state)
  devices = jax.devices()[:1] if shape == (1, 1, 1) else None
  plan, _, step_fn = ckpt_helpers.planned(_mesh(shape, devices))
  with dt.CheckpointManager(tmp_path) as checkpoints:
    restored = checkpoints.restore(plan.abstract_train_state)
  _assert_same(restored, state)
  for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(plan.train_state_shardings)):
    assert got.sharding == want
  ckpt_helpers.train(restored, step_fn, 3, 4, plan)  # and it trains on


def test_ten_steps_equal_five_saved_restored_and_five_more(tmp_path):
  straight, plan, step_fn = _trained(steps=10)
  five, _, _ = _trained(steps=5)
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.save(5, five)
  with dt.CheckpointManager(tmp_path) as checkpoints:
    resumed = checkpoints.restore(plan.abstract_train_state)
  resumed = ckpt_helpers.train(resumed, step_fn, 5, 10, plan)
  _assert_same(resumed, straight)


def test_params_only_restore_keeps_the_targets_optimizer_state(tmp_path):
  state, plan, _ = _trained()
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.save(3, state)
    fresh = plan.init(ckpt_helpers.make_state)
    restored = checkpoints.restore(fresh, params_only=True)
  np.testing.assert_array_equal(*(np.asarray(jax.tree_util.tree_leaves(s.params)[0]) for s in (restored, state)))
  np.testing.assert_array_equal(*(np.asarray(jax.tree_util.tree_leaves(s.local_state)[0]) for s in (restored, state)))
  assert int(restored.step) == 0 and int(restored.opt_state[0].count) == 0


def test_retention_keeps_the_newest_n_and_every_nth(tmp_path):
  state = dt.TrainState.initial_state({"w": jnp.ones(4)}, optax.sgd(0.1), jax.random.key(0))
  with dt.CheckpointManager(tmp_path, max_to_keep=2, keep_every_n_steps=4, async_save=False) as checkpoints:
    for step in range(1, 11):
      checkpoints.save(step, state.replace(step=step))
    assert checkpoints.all_steps() == [4, 8, 9, 10]
    assert checkpoints.latest_step() == 10


def test_an_old_step_leaves_by_one_rename_so_a_kill_while_deleting_it_lists_no_broken_step(tmp_path, monkeypatch):
  """orbax deleted an old step file by file where it lay: a kill in between left a listed step without its commit
  marker. It is renamed into ``.deleted`` first now. A removal cut short there (its first file gone, then the
  process "dies") leaves the listing whole, and the next start clears what it left."""
  from etils import epath

  def cut_short(path, missing_ok=False):
    (path / "commit_success.txt").unlink(missing_ok=True)
    raise OSError(f"killed while deleting {path}")

  monkeypatch.setattr(type(epath.Path(tmp_path)), "rmtree", cut_short)
  state = dt.TrainState.initial_state({"w": jnp.ones(4)}, optax.sgd(0.1), jax.random.key(0))
  with dt.CheckpointManager(tmp_path, max_to_keep=1, async_save=False) as checkpoints:
    for step in (1, 2, 3):
      checkpoints.save(step, state.replace(step=step))
  monkeypatch.undo()
  assert sorted(p.name for p in (tmp_path / ".deleted").iterdir()) == ["1", "2"]  # what the "kills" left
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3"]
  assert (tmp_path / "3" / "commit_success.txt").is_file()
  with dt.CheckpointManager(tmp_path, max_to_keep=1) as checkpoints:
    assert checkpoints.all_steps() == [3]
    checkpoints.save(4, state.replace(step=4))
  assert list((tmp_path / ".deleted").iterdir()) == []
  assert dt.CheckpointManager(tmp_path).all_steps() == [4]


def test_save_interval_skips_steps_unless_forced(tmp_path):
  state = dt.TrainState.initial_state({"w": jnp.ones(4)}, optax.sgd(0.1), jax.random.key(0))
  with dt.CheckpointManager(tmp_path, save_interval_steps=5) as checkpoints:
    assert [checkpoints.save(s, state) for s in (3, 5)] == [False, True]
    assert checkpoints.save(7, state, force=True)
    checkpoints.wait_until_finished()
    assert checkpoints.all_steps() == [5, 7]


def test_close_waits_for_the_pending_async_save(tmp_path):
  state, _, _ = _trained()
  checkpoints = dt.CheckpointManager(tmp_path)
  checkpoints.save(3, state)
  checkpoints.close()
  assert dt.CheckpointManager(tmp_path).all_steps() == [3]
  with pytest.raises(ValueError, match="is closed"):
    checkpoints.save(4, state)


def test_kill_during_async_save_leaves_the_previous_step_restorable(tmp_path):
  out = subprocess.run(
    [sys.executable, str(WORKERS / "kill_during_save.py"), str(tmp_path)], capture_output=True, text=True, timeout=300
  )
  assert out.returncode == -9, out.stderr[-2000:]
  assert "save of step 2 started" in out.stdout
  mesh = _mesh((1, 8, 1))
  make = lambda: dt.TrainState.initial_state({"w": jnp.ones((4096, 6144))}, optax.adam(1e-3), jax.random.key(0))
  plan = dt.MeshPlanner(mesh, "fsdp_tensor").plan(jax.eval_shape(make), param_logical_axes={"w": ("embed", "mlp")})
  with dt.CheckpointManager(tmp_path) as checkpoints:
    assert checkpoints.all_steps() == [1]
    restored = checkpoints.restore(plan.abstract_train_state)
    assert int(restored.step) == 0 and float(restored.params["w"][0, 0]) == 1.0
    # The run continues: the next save commits, and no temporary directory is left.
    checkpoints.save(2, restored.replace(step=2), force=True)
  leftovers = [p.name for p in tmp_path.iterdir() if "tmp" in p.name]
  assert leftovers == []
  assert dt.CheckpointManager(tmp_path).all_steps() == [1, 2]


def test_two_processes_save_and_one_process_restores(tmp_path):
  results = mp_harness.run_workers(WORKERS / "checkpoint_worker.py", "save", str(tmp_path), timeout=240)
  assert results[0].result["steps"] == [3]
  for shape, devices in (((2, 2, 2), None), ((1, 1, 1), jax.devices()[:1])):
    plan, _, _ = ckpt_helpers.planned(_mesh(shape, devices))
    with dt.CheckpointManager(tmp_path) as checkpoints:
      restored = checkpoints.restore(plan.abstract_train_state)
    arrays = ckpt_helpers.saved_arrays(restored)
    for key, value in results[0].result["arrays"].items():
      np.testing.assert_array_equal(arrays[key], np.asarray(value), err_msg=key)


def test_one_process_saves_and_two_processes_restore(tmp_path):
  state, _, _ = _trained()
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.save(3, state)
  expected = ckpt_helpers.saved_arrays(state)
  results = mp_harness.run_workers(WORKERS / "checkpoint_worker.py", "restore", str(tmp_path), timeout=240)
  for r in results:
    assert r.result["shardings_ok"]
    for key, value in r.result["arrays"].items():
      np.testing.assert_array_equal(np.asarray(value), expected[key], err_msg=key)


def test_data_iterator_position_is_saved_and_restored(tmp_path):
  grain = pytest.importorskip("grain")  # installed with distrib_train; the GPU image lacks it
  make_iter = lambda: iter(grain.MapDataset.range(100).shuffle(seed=3).batch(4).to_iter_dataset())
  state = dt.TrainState.initial_state({"w": jnp.ones(4)}, optax.sgd(0.1), jax.random.key(0))
  iterator = make_iter()
  for _ in range(5):
    next(iterator)
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.save(5, state, data_iterator=iterator)
  expected = [next(iterator).tolist() for _ in range(3)]
  fresh = make_iter()
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.restore(state, data_iterator=fresh)
  assert [next(fresh).tolist() for _ in range(3)] == expected


def test_meta_records_mesh_versions_and_run_metadata(tmp_path):
  state, _, _ = _trained()
  with dt.CheckpointManager(tmp_path, metadata={"model": "layered-net", "lr": 0.01}) as checkpoints:
    checkpoints.save(3, state)
    meta = checkpoints.metadata_of(3)
  assert meta["format_version"] == 1 and meta["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  assert meta["run"] == {"model": "layered-net", "lr": 0.01}
  assert {"jax", "orbax-checkpoint", "flax"} <= set(meta["versions"])


# --- bad input: one clear error, nothing written ------------------------------


def test_restoring_into_a_different_model_lists_the_differences(tmp_path):
  state, _, _ = _trained()
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.save(3, state)
  plan, _, _ = ckpt_helpers.planned(_mesh((2, 2, 2)), width=32, depth=3)
  before = sorted(str(p) for p in tmp_path.rglob("*"))
  with dt.CheckpointManager(tmp_path) as checkpoints:
    with pytest.raises(ValueError) as error:
      checkpoints.restore(plan.abstract_train_state)
  message = str(error.value)
  assert "does not fit the target state" in message
  assert "params/layers/0/kernel: checkpoint [64, 64], target [32, 32]" in message
  assert "not in the checkpoint" in message
  assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_a_directory_that_cannot_be_written_fails_at_construction(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(ValueError, match=r"Checkpoint directory '.*a_file/ckpt' cannot be written"):
    dt.CheckpointManager(blocker / "ckpt")


def test_a_missing_step_lists_the_steps_there(tmp_path):
  state = dt.TrainState.initial_state({"w": jnp.ones(4)}, optax.sgd(0.1), jax.random.key(0))
  with dt.CheckpointManager(tmp_path, async_save=False) as checkpoints:
    checkpoints.save(2, state)
    checkpoints.save(4, state)
    with pytest.raises(ValueError, match=r"No checkpoint for step 3 in .*; steps there: 2, 4"):
      checkpoints.restore(state, step=3)
  with dt.CheckpointManager(tmp_path / "empty") as checkpoints:
    with pytest.raises(ValueError, match="No checkpoint in .* to restore"):
      checkpoints.restore(state)


def test_an_unknown_format_version_is_refused(tmp_path):
  state = dt.TrainState.initial_state({"w": jnp.ones(4)}, optax.sgd(0.1), jax.random.key(0))
  with dt.CheckpointManager(tmp_path, async_save=False) as checkpoints:
    checkpoints.save(1, state)
  meta_file = tmp_path / "1" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["format_version"] = 99
  meta_file.write_text(json.dumps(meta))
  with dt.CheckpointManager(tmp_path) as checkpoints:
    with pytest.raises(ValueError, match="has format version 99; this distrib_train reads version 1"):
      checkpoints.restore(state)


class _Bomb:
  def __reduce__(self):
    return (os.system, ("touch PICKLE_RAN",))


def test_a_pickle_in_place_of_the_metadata_is_refused_and_never_run(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  state = dt.TrainState.initial_state({"w": jnp.ones(4)}, optax.sgd(0.1), jax.random.key(0))
  with dt.CheckpointManager(tmp_path / "ckpt", async_save=False) as checkpoints:
    checkpoints.save(1, state)
  (tmp_path / "ckpt" / "1" / "meta" / "metadata").write_bytes(pickle.dumps(_Bomb()))
  (tmp_path / "ckpt" / "1" / "state" / "evil.pkl").write_bytes(pickle.dumps(_Bomb()))
  with dt.CheckpointManager(tmp_path / "ckpt") as checkpoints:
    with pytest.raises(ValueError, match="Checkpoint step 1 in .* has unreadable metadata"):
      checkpoints.restore(state)
  assert not (tmp_path / "PICKLE_RAN").exists()


def test_saving_a_step_not_after_the_latest_is_refused(tmp_path):
  state = dt.TrainState.initial_state({"w": jnp.ones(4)}, optax.sgd(0.1), jax.random.key(0))
  with dt.CheckpointManager(tmp_path, async_save=False) as checkpoints:
    checkpoints.save(10, state)
    for step, force in ((7, False), (10, True)):
      with pytest.raises(ValueError, match=f"Cannot save step {step}: .* already holds step 10"):
        checkpoints.save(step, state, force=force)


def test_params_only_restore_needs_a_concrete_target_and_reports_extra_layers(tmp_path):
  state, plan, _ = _trained()
  with dt.CheckpointManager(tmp_path) as checkpoints:
    checkpoints.save(3, state)
    with pytest.raises(ValueError, match="params_only restore keeps the target's optimizer state.*is abstract"):
      checkpoints.restore(plan.abstract_train_state, params_only=True)
    shallow_plan, shallow_make, _ = ckpt_helpers.planned(_mesh((2, 2, 2)), depth=1)
    with pytest.raises(ValueError, match=r"params/layers/1/kernel: in the checkpoint \[64, 64\], not in the target"):
      checkpoints.restore(shallow_plan.init(shallow_make), params_only=True)
