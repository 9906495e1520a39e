"""Goodput accounting (``train/goodput.py``): time per phase, replayed steps, ``goodput.json`` across restarts.

The unit tests drive a ``PhaseClock`` on a fake clock; the last test kills a
real run (the CLI) right after a known step and restarts it.
"""

import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

from distrib_train.train.goodput import CATEGORIES, Goodput, PhaseClock
import xla_test_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


class FakeClock:
  def __init__(self):
    self.now = 500.0

  def __call__(self):
    return self.now


def _run(workdir, clock, logs=None):
  phases = PhaseClock(clock)
  return Goodput(workdir, phases, started=clock(), log=(logs if logs is not None else []).append, enabled=True)


def _train(goodput, clock, steps, *, data_s=0.5, step_s=1.0):
  for step in steps:
    goodput.phases.enter("data", step - 1)
    clock.now += data_s
    goodput.phases.enter("step")
    clock.now += step_s
    goodput.on_step(types.SimpleNamespace(step=step))


def test_a_run_s_time_is_split_by_phase_and_sums_to_its_wall_time(tmp_path):
  clock, logs = FakeClock(), []
  goodput = _run(tmp_path, clock, logs)
  clock.now += 1  # start-up
  goodput.phases.enter("restore")
  clock.now += 2
  goodput.phases.enter("compile", 0)
  clock.now += 3
  goodput.start(0)
  _train(goodput, clock, [1, 2])
  with goodput.phases.phase("checkpoint"):
    clock.now += 4
  _train(goodput, clock, [3, 4])
  goodput.finish("finished")
  run = json.loads((tmp_path / "goodput.json").read_text())["runs"][0]
  assert run["seconds"] == {
    "productive": 4.0,
    "compile": 3.0,
    "checkpoint": 4.0,
    "data_wait": 2.0,
    "restore": 2.0,
    "replayed": 0.0,
    "eval": 0.0,
    "eval_tasks": 0.0,
    "generation": 0.0,
    "layout_search": 0.0,
    "other": 1.0,
  }
  assert run["wall_s"] == 16.0 and run["goodput"] == 0.25 and run["status"] == "finished"
  assert (run["start_step"], run["last_step"], run["steps"], run["steps_replayed"]) == (0, 4, 4, 0)
  assert logs[-1].startswith("Goodput 25.0% of 16.0 s (4.0 s productive; compile 3.0 s, checkpoint 4.0 s,")


def test_steps_an_earlier_run_reached_but_did_not_checkpoint_count_as_replayed(tmp_path):
  clock = FakeClock()
  killed = _run(tmp_path, clock)
  killed.start(0)
  _train(killed, clock, [1, 2, 3, 4, 5])
  killed.write()  # its last goodput.json: step 5 comes only from its own record, written after every step
  _train(killed, clock, [6])
  # Killed here. The next run restores the checkpoint of step 3.
  clock.now += 10
  again = _run(tmp_path, clock)
  again.start(3)
  _train(again, clock, [4, 5, 6, 7], data_s=0.25, step_s=2.0)
  again.finish("finished")
  document = json.loads((tmp_path / "goodput.json").read_text())
  first, second = document["runs"]
  assert (first["status"], first["last_step"], first["steps"], first["steps_replayed"]) == ("interrupted", 6, 6, 0)
  assert (second["status"], second["start_step"], second["steps"], second["steps_replayed"]) == ("finished", 3, 4, 3)
  assert second["seconds"]["replayed"] == 3 * 2.25 and second["seconds"]["productive"] == 2.0
  assert document["max_step"] == 7
  assert document["totals"]["steps_replayed"] == 3 and document["totals"]["runs"] == 2
  assert document["totals"]["wall_s"] == first["wall_s"] + second["wall_s"]


def test_an_unreadable_goodput_json_is_reported_and_counting_starts_again(tmp_path):
  (tmp_path / "goodput.json").write_text("{not json")
  clock, logs = FakeClock(), []
  goodput = _run(tmp_path, clock, logs)
  assert "goodput.json cannot be read (JSONDecodeError" in logs[0]
  goodput.start(0)
  _train(goodput, clock, [1])
  goodput.finish("finished")
  assert json.loads((tmp_path / "goodput.json").read_text())["totals"]["runs"] == 1


def test_a_run_stopped_before_it_restored_writes_nothing(tmp_path):
  goodput = _run(tmp_path, FakeClock())
  goodput.finish("failed")
  assert list(tmp_path.iterdir()) == []


def _cli_args(workdir, cache):
  return [
    "--config",
    "tiny",
    "--workdir",
    str(workdir),
    "--cpu_devices",
    "8",
    "--steps",
    "8",
    "--set",
    "data.seq_len=32",
    "--set",
    "data.global_batch_size=8",
    "--set",
    "train.log_every=4",
    "--set",
    "train.checkpoint_every=3",
    "--set",
    "train.async_checkpoint=false",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.eval_batches=1",
    "--set",
    "optimizer.warmup_steps=0",
    "--set",
    f"train.compilation_cache_dir={cache}",
  ]


@pytest.mark.timeout(480)
def test_a_kill_and_a_restart_report_the_steps_trained_again(tmp_path, xla_cache):
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    DT_KILL_AT_STEP="5",
    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
  )
  env["XLA_FLAGS"] = xla_test_flags.FAST_COMPILE  # --cpu_devices sets the device count
  workdir = tmp_path / "run"
  killed = subprocess.run(
    [sys.executable, str(ROOT / "tests" / "workers" / "kill_at_step.py"), *_cli_args(workdir, xla_cache)],
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert killed.returncode == -9, killed.stderr[-3000:]
  again = subprocess.run(
    [sys.executable, "-m", "distrib_train", *_cli_args(workdir, xla_cache)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert again.returncode == 0, again.stderr[-3000:]
  assert "Restored step 3 from" in again.stderr
  document = json.loads((workdir / "goodput.json").read_text())
  first, second = document["runs"]
  assert (first["status"], first["start_step"], first["last_step"], first["steps_replayed"]) == ("interrupted", 0, 5, 0)
  assert (second["status"], second["start_step"], second["last_step"]) == ("finished", 3, 8)
  assert second["steps_replayed"] == document["totals"]["steps_replayed"] == 2  # steps 4 and 5
  assert document["max_step"] == 8 and document["totals"]["steps"] == 5 + 5
  for run in (first, second):
    assert set(run["seconds"]) == set(CATEGORIES)
    assert sum(run["seconds"].values()) == pytest.approx(run["wall_s"], abs=0.01)
  assert second["seconds"]["replayed"] > 0 and second["seconds"]["restore"] > 0 and second["seconds"]["compile"] > 0
  assert "2 of 5 steps replayed); over the workdir's 2 run(s)" in again.stderr
