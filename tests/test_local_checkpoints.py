"""The fast checkpoint tier: each process's own shards on its own disk; a restart takes the newest complete tier."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import optax
import pytest

import distrib_train as dt
import kill_harness
import mp_harness
from distrib_train.checkpoint.local import LocalCheckpoints
from distrib_train.checkpoint.tiers import CheckpointTiers, local_tier
from test_cli import train_losses
import xla_test_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _state(mesh_shape=(2, 2, 2)):
  mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), mesh_shape))
  rules = dt.AxisRules([("embed", "fsdp"), ("mlp", "tensor")])
  params = {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.ones(8, np.float32)}
  axes = {"w": ("embed", "mlp"), "b": ("mlp",)}

  def make():
    return dt.TrainState.create(apply_fn=None, params=jax.tree.map(np.asarray, params), tx=optax.adam(0.1))

  state, plan = dt.MeshPlanner(mesh, rules).init(make, param_logical_axes=axes)
  return plan, state


def test_a_local_step_restores_onto_the_same_shards_and_refuses_other_runs_and_layouts(tmp_path):
  plan, state = _state()
  state = state.replace(step=3, params=jax.tree.map(lambda x: x * 2, state.params))
  (tmp_path / "process_0" / "5.tmp123").mkdir(parents=True)  # what a save killed half-way left
  local = LocalCheckpoints(tmp_path / "process_0", run_id="run-a")
  local.save(3, state)
  assert local.steps() == [3] and not list((tmp_path / "process_0").glob("*.tmp*"))
  assert LocalCheckpoints(tmp_path / "process_0", run_id="run-a").complete_step(plan.abstract_train_state, None) == 3
  assert local.complete_step(plan.abstract_train_state, newer_than=3) is None  # the persistent tier is as new
  restored = local.restore(plan.abstract_train_state, 3)
  for got, want in zip(
    jax.tree.leaves(restored.params) + jax.tree.leaves(restored.opt_state),
    jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state),
  ):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding == want.sharding
  assert int(restored.step) == 3
  assert LocalCheckpoints(tmp_path / "process_0", run_id="run-b").complete_step(plan.abstract_train_state, None) is None
  other_plan, _ = _state((1, 8, 1))  # another mesh: the shards are not this layout's
  assert local.complete_step(other_plan.abstract_train_state, None) is None
  for step in (5, 7):
    local.save(step, state)
  assert local.steps() == [5, 7]  # the newest two are kept
  # A run whose frozen weights come from a named source saves the rest: a restore keeps the target's others.
  part = LocalCheckpoints(tmp_path / "part", run_id="run-a", fields=("step", "params"))
  part.save(3, state)
  kept = jax.tree.map(lambda x: np.full_like(x, 7), state.opt_state)
  restored = part.restore(plan.abstract_train_state.replace(opt_state=kept), 3)
  np.testing.assert_array_equal(np.asarray(restored.params["w"]), np.asarray(state.params["w"]))
  assert all((np.asarray(x) == 7).all() for x in jax.tree.leaves(restored.opt_state))
  manifest = json.loads((tmp_path / "part" / "3" / "manifest.json").read_text())
  assert sorted(manifest["files"]) == ["params/b", "params/w", "step"]


def test_the_tiers_restore_the_newer_tier_of_this_run_and_say_which(tmp_path):
  plan, state = _state()
  logged = []
  with dt.CheckpointManager(tmp_path / "checkpoints", async_save=False) as ckpt:
    local = local_tier(tmp_path, str(tmp_path / "local"))
    assert CheckpointTiers(ckpt, local, logged.append).restore(plan.abstract_train_state) is None  # a new run
    ckpt.save(2, state.replace(step=2))
    local.save(4, state.replace(step=4))
    restored = CheckpointTiers(ckpt, local, logged.append).restore(plan.abstract_train_state)
    assert restored.step == 4 and logged[-1].startswith("Restored step 4 from the local tier")
    assert "persistent tier's newest is 2" in logged[-1]
    (tmp_path / "run_id").unlink()  # a wiped and recreated workdir: another run, whose local steps are not its own
    restored = CheckpointTiers(ckpt, local_tier(tmp_path, str(tmp_path / "local")), logged.append).restore(
      plan.abstract_train_state
    )
    assert restored.step == 2 and logged[-1] == f"Restored step 2 from {ckpt.directory}."
    assert any("local tier's step 4 is not complete on every process" in line for line in logged)


def _args(workdir, local_dir, cache, steps=8, checkpoint_every=4):
  return [
    "--config",
    "tiny",
    "--workdir",
    str(workdir),
    "--cpu_devices",
    "4",
    "--mesh_config",
    "cpu-2proc",
    "--steps",
    str(steps),
    "--set",
    "data.seq_len=32",
    "--set",
    "data.global_batch_size=8",
    "--set",
    "train.log_every=1",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.eval_batches=1",
    "--set",
    f"train.checkpoint_every={checkpoint_every}",
    "--set",
    "train.local_checkpoint_every=2",
    "--set",
    f"train.local_checkpoint_dir={local_dir}",
    "--set",
    "optimizer.warmup_steps=0",
    # synchronous saves: a kill right after a step keeps that step's save (a background write of the
    # first save can outlast the two steps up to a kill on a busy machine)
    "--set",
    "train.async_checkpoint=false",
    "--set",
    f"train.compilation_cache_dir={cache}",
  ]


def _launch(args, kill_at=None, kill_in_local_save=None):
  """Both processes of a 2-process job; with ``kill_at`` both stop right after that step; with
  ``kill_in_local_save`` process 0 stops inside that step's local save (two shard files written, no commit) and
  process 1 right after its own save of the step committed. The test SIGKILLs both once both are there.

  Neither process may die on its own in that kill: the survivor of a peer's death notices it (a gloo collective
  or the coordination service fails) and exits 1 at a moment that depends on the machine's load, before or
  after the test's kill, and before or after its own save committed."""
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
  )
  env["XLA_FLAGS"] = xla_test_flags.FAST_COMPILE
  script = ["-m", "distrib_train"]
  markers = pathlib.Path(tempfile.mkdtemp(prefix="kill_markers_"))  # each process's "at my kill point"
  if kill_at:
    script = [str(ROOT / "tests" / "workers" / "kill_at_step.py")]
    env.update(DT_KILL_AT_STEP=str(kill_at), DT_KILL_MARKERS=str(markers))
  if kill_in_local_save:
    script = [str(ROOT / "tests" / "workers" / "kill_in_local_save.py")]
    env.update(DT_KILL_IN_LOCAL_SAVE=str(kill_in_local_save), DT_KILL_PROCESS="0", DT_KILL_MARKERS=str(markers))
  port = mp_harness.free_port()
  # Output to files, not pipes: a process never blocks on a full pipe while the test waits for it.
  logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        *script,
        *args,
        "--coordinator_address",
        f"127.0.0.1:{port}",
        "--num_processes",
        "2",
        "--process_id",
        str(i),
      ],
      cwd=ROOT,
      env=env,
      stdout=logs[i],
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True,
    )
    for i in range(2)
  ]
  try:
    if kill_at or kill_in_local_save:
      deadline = time.monotonic() + 300
      while not all((markers / str(i)).exists() for i in range(2)):
        if any(p.poll() is not None for p in procs):
          break  # a process failed before its kill point: its exit code says so, the other is killed
        assert time.monotonic() < deadline, "the job did not reach its kill point within 300 s"
        time.sleep(0.05)
      for sig in (signal.SIGSTOP, signal.SIGKILL):  # both stopped first: neither can see the other die
        for p in procs:
          if p.poll() is None:
            os.killpg(p.pid, sig)
    for p in procs:
      p.wait(timeout=300)
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    shutil.rmtree(markers, ignore_errors=True)
  outputs = []
  for log in logs:
    log.seek(0)
    outputs.append(log.read())
    log.close()
  return [p.returncode for p in procs], outputs


@pytest.mark.timeout(900)
def test_a_kill_after_a_local_save_resumes_from_it_and_a_wiped_process_falls_back_to_the_persistent_tier(
  tmp_path, xla_cache
):
  codes, outputs = _launch(_args(tmp_path / "straight", tmp_path / "straight-local", xla_cache))
  assert codes == [0, 0], outputs[0][-3000:]
  want = train_losses(tmp_path / "straight")
  assert sorted(want) == list(range(1, 9))

  run, local = tmp_path / "run", tmp_path / "local"
  codes, outputs = _launch(_args(run, local, xla_cache), kill_at=6)  # after the local save of step 6
  assert codes == [-9, -9], outputs[0][-3000:]
  assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [4]
  assert kill_harness.local_steps(local) == [4, 6]
  wiped, wiped_local = tmp_path / "wiped", tmp_path / "wiped-local"
  shutil.copytree(run, wiped)
  shutil.copytree(local, wiped_local)
  shutil.rmtree(wiped_local / "process_1")  # one host lost its disk

  codes, outputs = _launch(_args(run, local, xla_cache))
  assert codes == [0, 0], outputs[0][-3000:]
  assert "Restored step 6 from the local tier" in outputs[0] and "persistent tier's newest is 4" in outputs[0]
  got = train_losses(run)
  assert [got[s] for s in range(1, 9)] == [want[s] for s in range(1, 9)]  # bit for bit

  codes, outputs = _launch(_args(wiped, wiped_local, xla_cache))
  assert codes == [0, 0], outputs[0][-3000:]
  assert "local tier's step 6 is not complete on every process" in outputs[0]
  assert "Restored step 4 from" in outputs[0]
  got = train_losses(wiped)
  assert [got[s] for s in range(1, 9)] == [want[s] for s in range(1, 9)]


@pytest.mark.timeout(900)
def test_a_kill_inside_a_local_save_leaves_the_previous_local_step_to_resume_from(tmp_path, xla_cache):
  codes, outputs = _launch(
    _args(tmp_path / "straight", tmp_path / "straight-local", xla_cache, steps=7, checkpoint_every=0)
  )
  assert codes == [0, 0], outputs[0][-3000:]
  want = train_losses(tmp_path / "straight")

  run, local = tmp_path / "run", tmp_path / "local"
  # No persistent checkpoint before the end: the local tier is all there is to resume from.
  codes, outputs = _launch(_args(run, local, xla_cache, steps=7, checkpoint_every=0), kill_in_local_save=6)
  assert codes == [-9, -9], "\n".join(
    f"--- process {i} (exit {c}) ---\n{out[-3000:]}" for i, (c, out) in enumerate(zip(codes, outputs))
  )
  # Process 0 was killed after two shard files of step 6 and before its manifest; process 1 after its commit.
  tmp = list((local / "process_0").glob("6.tmp*"))
  assert len(tmp) == 1 and len(list(tmp[0].glob("*.npy"))) == 2 and not (tmp[0] / "manifest.json").exists()
  assert not (run / "checkpoints" / "6").exists()
  assert kill_harness.local_steps(local, 1) == [2, 4]  # process 0's step 6 is only a temporary directory
  assert sorted(int(p.parent.name) for p in (local / "process_1").glob("*/manifest.json")) == [4, 6]
  codes, outputs = _launch(_args(run, local, xla_cache, steps=7, checkpoint_every=0))
  assert codes == [0, 0], outputs[0][-3000:]
  assert "Restored step 4 from the local tier" in outputs[0] and "persistent tier's newest is None" in outputs[0]
  assert not list((local / "process_0").glob("*.tmp*"))
  got = train_losses(run)
  assert [got[s] for s in range(1, 8)] == [want[s] for s in range(1, 8)]
