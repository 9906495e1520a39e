"""Silent failures turned into clear ones (issue 16), through the real CLI.

Two jobs on one workdir, a run without an eval split, signals outside the
step loop, and a resume with a changed setting. The bad inputs that are
refused before anything is written are in ``test_bad_inputs.py``.
"""

import gc
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import weakref

import pytest
import xla_test_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAST = [
  "--cpu_devices",
  "8",
  "--set",
  "data.seq_len=32",
  "--set",
  "data.global_batch_size=8",
  "--set",
  "data.source=synthetic",
  "--set",
  "data.synthetic_documents=64",
  "--set",
  "train.log_every=1",
  "--set",
  "train.eval_batches=1",
  "--set",
  "optimizer.warmup_steps=0",
  "--set",
  "optimizer.decay_steps=10",
]


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = xla_test_flags.FAST_COMPILE  # --cpu_devices sets the device count
  return env


def _cmd(workdir, cache, *args):
  return [
    sys.executable,
    "-m",
    "distrib_train",
    "--config",
    "tiny",
    "--workdir",
    str(workdir),
    *FAST,
    "--set",
    f"train.compilation_cache_dir={cache}",
    *args,
  ]


def cli(workdir, cache, *args, timeout=240):
  return subprocess.run(
    _cmd(workdir, cache, *args), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
  )


def popen(workdir, cache, *args):
  return subprocess.Popen(
    _cmd(workdir, cache, *args),
    cwd=ROOT,
    env=_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )


def _wait_for_line(proc, text, timeout=180):
  """Reads ``proc``'s output until a line holds ``text``; returns what was read."""
  seen = []
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    line = proc.stdout.readline()
    if not line:
      raise AssertionError(f"exited ({proc.wait(timeout=30)}) before {text!r}: {''.join(seen)[-3000:]}")
    seen.append(line)
    if text in line:
      return "".join(seen)
  raise AssertionError(f"no {text!r} within {timeout} s: {''.join(seen)[-3000:]}")


def _kill(proc):
  if proc.poll() is None:
    os.killpg(proc.pid, signal.SIGKILL)
  proc.wait(timeout=60)


def _steps(workdir):
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.timeout(600)
def test_a_second_job_on_a_running_workdir_is_refused_and_a_killed_job_leaves_no_lock(tmp_path, xla_cache):
  workdir = tmp_path / "run"
  first = popen(workdir, xla_cache, "--steps", "100000", "--set", "train.checkpoint_every=2")
  try:
    _wait_for_line(first, "step 3 ")  # a checkpoint is being written every other step
    second = cli(workdir, xla_cache, "--steps", "4")
    assert second.returncode == 2, second.stderr[-3000:]
    errors = [line for line in second.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert f"Workdir {str(workdir)!r} is in use by another job (pid {first.pid} on host" in errors[0]
    assert first.poll() is None, "the first job was disturbed"
  finally:
    _kill(first)  # SIGKILL: the kernel drops its lock
  third = cli(workdir, xla_cache, "--steps", str(_steps(workdir)[-1] + 1))
  assert third.returncode == 0, third.stderr[-3000:]
  assert "Restored step" in third.stderr
  assert not list((workdir / "checkpoints").glob("*.orbax-checkpoint-tmp*"))


@pytest.mark.timeout(300)
def test_every_process_of_a_job_learns_each_lock_outcome_however_many_runs_it_makes(tmp_path):
  """Process 0 tells the others through the coordination service, where a key is set once in a job: each check
  has its own key, so a job that runs the trainer twice gets a second answer, and a refusal reaches every process."""
  import mp_harness

  results = mp_harness.run_workers(ROOT / "tests" / "workers" / "workdir_lock_worker.py", str(tmp_path), timeout=240)
  refusal = f"Workdir {str(tmp_path)!r} is in use by another run in this process (pid "
  for result in results:
    assert result.result[:2] == ["taken", "taken"], result.output[-3000:]
    assert result.result[2].startswith(refusal), result.result


@pytest.mark.timeout(300)
def test_no_eval_split_trains_checkpoints_and_says_so_once(tmp_path, xla_cache):
  workdir = tmp_path / "run"
  # train.eval_every=0: no periodic evaluations asked for (with them the run is refused at start-up,
  # test_bad_inputs.py case eval-asked-without-eval-split); the final one is skipped.
  out = cli(workdir, xla_cache, "--steps", "2", "--set", "data.eval_fraction=0", "--set", "train.eval_every=0")
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stderr.count("No evaluation in this run: The eval split is empty: eval_fraction is 0.") == 1
  assert "eval/loss" not in out.stderr and "Traceback" not in out.stderr
  assert _steps(workdir) == [2]


@pytest.mark.timeout(300)
def test_a_failing_evaluation_loses_no_trained_step(tmp_path, xla_cache):
  import jax

  from distrib_train.config import run as config_lib
  from distrib_train.train.trainer import Trainer

  if jax.device_count() != 8:
    pytest.skip("needs the 8 emulated devices of conftest")
  config = config_lib.load(
    "tiny", [s for s in FAST[2:] if s != "--set"] + ["train.steps=2", f"train.compilation_cache_dir={xla_cache}"]
  )
  trainer = Trainer(config, tmp_path / "run")

  def broken_evaluation(*args, **kwargs):
    raise RuntimeError("evaluation failed")

  trainer._evaluate = broken_evaluation
  with pytest.raises(RuntimeError, match="evaluation failed"):
    trainer.run()
  assert _steps(tmp_path / "run") == [2]
  assert (tmp_path / "run" / "checkpoints" / "2" / "commit_success.txt").is_file()


@pytest.mark.timeout(300)
def test_sigterm_during_start_up_stops_at_once_with_one_line(tmp_path):
  # A cache of its own: the step compiles, so the signal lands in start-up, restore or compile.
  workdir = tmp_path / "run"
  proc = popen(workdir, tmp_path / "cache", "--steps", "100000")
  try:
    _wait_for_line(proc, "Plan on mesh")
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)  # hard limit; it takes seconds
  finally:
    _kill(proc)
  assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
  assert "distrib-train: stopped by SIGTERM" in output and "Traceback" not in output, output[-3000:]
  assert not (workdir / "checkpoints").exists() or not list((workdir / "checkpoints").iterdir())


def test_a_signal_landing_in_a_garbage_collector_callback_is_not_dropped(capfd):
  """jax registers a garbage-collector callback. A SIGTERM in start-up that landed in it raised ``Terminated``
  there, where Python prints "Exception ignored" and drops the exception: the run went on training (a CI
  failure of the test above). The signal is now delivered again just after."""
  from distrib_train.cluster import preemption

  armed = [True]

  def callback(phase, info):
    if phase == "start" and armed:
      armed.clear()
      os.kill(os.getpid(), signal.SIGTERM)
      for _ in range(100_000):  # the handler runs here, inside the callback
        pass

  stopper = preemption.Preemption()
  gc.callbacks.append(callback)
  try:
    with pytest.raises(preemption.Terminated):
      gc.collect()
      time.sleep(10)  # the signal delivered again interrupts this
  finally:
    gc.callbacks.remove(callback)
    stopper.close()
  assert "Exception ignored" not in capfd.readouterr().err


def test_a_signal_landing_in_a_weakref_callback_is_not_dropped(capfd):
  """Python drops an exception raised in a weakref callback too (printing it through ``sys.unraisablehook``),
  and no frame tells such a callback from other code: the hook delivers the signal again, unprinted."""
  from distrib_train.cluster import preemption

  class Held:
    pass

  def callback(_):
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100_000):  # the handler runs here, inside the callback
      pass

  stopper = preemption.Preemption()
  held = Held()
  ref = weakref.ref(held, callback)
  try:
    with pytest.raises(preemption.Terminated):
      del held
      time.sleep(10)  # the signal delivered again interrupts this
  finally:
    stopper.close()
  assert ref() is None and "Exception ignored" not in capfd.readouterr().err


def test_a_terminated_that_code_swallowed_is_raised_again_when_the_steps_start():
  from distrib_train.cluster import preemption

  stopper = preemption.Preemption()
  try:
    try:
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(10)
    except BaseException:  # code that turns every exception into nothing
      pass
    with pytest.raises(preemption.Terminated):
      stopper.enter_steps()
    with pytest.raises(preemption.Terminated):
      stopper.reached(0)
  finally:
    stopper.close()


def _train(tmp_path_factory, xla_cache):
  workdir = tmp_path_factory.mktemp("trained") / "run"
  out = cli(workdir, xla_cache, "--steps", "2", "--set", "train.eval_every=0")
  assert out.returncode == 0, out.stderr[-3000:]
  return workdir


@pytest.fixture(scope="session")
def trained(tmp_path_factory, xla_cache, once_per_run):
  """A 2-step run (read only: a test copies it)."""
  return once_per_run("faults_trained", lambda: _train(tmp_path_factory, xla_cache))


def test_resume_with_packing_changed_names_the_setting(tmp_path, xla_cache, trained):
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  out = cli(workdir, xla_cache, "--steps", "4", "--set", "data.packing=false")
  assert out.returncode == 2, out.stderr[-3000:]
  errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
  assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert "data.packing: True → False" in errors[0] and "damaged" not in errors[0], errors[0]
  assert _steps(workdir) == [2]


def test_resume_with_another_seed_says_it_is_ignored(tmp_path, xla_cache, trained):
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  out = cli(workdir, xla_cache, "--steps", "3", "--set", "train.seed=1")
  assert out.returncode == 0, out.stderr[-3000:]
  assert "The config differs from the checkpoint's: train.seed: 0 → 1 (ignored" in out.stderr, out.stderr[-3000:]
