"""A checkpoint directory that fills up or turns read-only in the middle of a
run (the CLI, one process × 8 CPU devices).

The run is paused (SIGSTOP) right after its first checkpoint commits, the
fault is made, and the run goes on. It must stop on its own with exit status
1 and one ``distrib-train: error:`` line naming the step, the checkpoint
directory and the cause — no orbax or tensorstore traceback; the step
committed before is intact (its arrays equal an uninterrupted run's) and the
only one listed; and once the fault is gone, a relaunch resumes from it and
ends bit-identical to the uninterrupted run.

Root ignores file permissions, so as root "read-only" is a tmpfs remounted
read-only (or, where mounting is not allowed, ``chattr +i``), and "full" is
a tmpfs filled up; without root, read-only is ``chmod 555`` and the full-disk
cases skip.
"""

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import kill_harness

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS, EVERY = 30, 10
RUN_TIMEOUT = 180  # a failed save must end the run, never hang it


def _command(workdir, xla_cache):
  return [
    sys.executable,
    "-m",
    "distrib_train",
    "--config",
    "tiny",
    "--workdir",
    str(workdir),
    "--cpu_devices",
    "8",
    "--steps",
    str(STEPS),
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
    f"train.checkpoint_every={EVERY}",
    "--set",
    "train.keep_checkpoints=3",
    "--set",
    "optimizer.warmup_steps=0",
    "--set",
    "optimizer.decay_steps=10",
    "--set",
    f"train.compilation_cache_dir={xla_cache}",
  ]


def _run(workdir, xla_cache):
  out = subprocess.run(
    _command(workdir, xla_cache),
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=RUN_TIMEOUT,
  )
  return out.returncode, out.stdout + out.stderr


def _past_the_moment(checkpoints):
  """Whether the save after step ``EVERY`` has begun (its temporary or its final directory)."""
  return any(p.name.split(".")[0].isdigit() and p.name.split(".")[0] != str(EVERY) for p in checkpoints.iterdir())


def _run_with_fault(workdir, xla_cache, make_fault):
  """Runs to the first committed checkpoint, pauses, ``make_fault()``, goes on.

  None, and no fault, where the pause came after the next save had begun (on a busy machine the run can train the
  steps between two saves before the pause lands).
  """
  checkpoints = workdir / "checkpoints"
  proc = subprocess.Popen(
    _command(workdir, xla_cache),
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )
  try:
    deadline = time.monotonic() + RUN_TIMEOUT
    while not ((checkpoints / str(EVERY)).is_dir() and not list(checkpoints.glob("*orbax-checkpoint-tmp*"))):
      assert proc.poll() is None, f"exited early ({proc.returncode}): {proc.stdout.read()[-3000:]}"
      assert time.monotonic() < deadline, f"no checkpoint of step {EVERY} within {RUN_TIMEOUT} s"
      time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGSTOP)
    late = _past_the_moment(checkpoints)
    try:
      if not late:
        make_fault()
    finally:
      os.killpg(proc.pid, signal.SIGCONT)
    output, _ = proc.communicate(timeout=RUN_TIMEOUT)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  if late:  # the run went on without a fault: it must end as the reference did
    assert proc.returncode == 0, f"the run without a fault failed ({proc.returncode}): {output[-3000:]}"
    return None
  return proc.returncode, output


@contextlib.contextmanager
def _tmpfs(path, size="16m"):
  """A small tmpfs at ``path`` (root only), unmounted at the end."""
  if os.geteuid() != 0:
    pytest.skip("mounting a tmpfs needs root")
  path.mkdir(parents=True)
  mounted = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
  )
  if mounted.returncode:
    pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(directory, leave_bytes):
  """Writes a filler file until ``directory``'s file system has ``leave_bytes`` free."""
  fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
  try:
    while True:
      free = os.statvfs(directory)
      if free.f_bavail * free.f_frsize <= leave_bytes:
        break
      os.write(fd, b"\0" * 4096)
  except OSError as e:
    assert e.errno == 28, e
  finally:
    os.close(fd)


def _reference(tmp_path_factory, xla_cache):
  workdir = tmp_path_factory.mktemp("disk_full_reference") / "run"
  code, output = _run(workdir, xla_cache)
  assert code == 0, output[-3000:]
  return workdir


@pytest.fixture(scope="session")
def reference(tmp_path_factory, xla_cache, once_per_run):
  """The same run without a fault (read only)."""
  return once_per_run("disk_full_reference", lambda: _reference(tmp_path_factory, xla_cache))


def _check_failed_run(code, output, checkpoints, causes):
  """Exit 1, one error line naming the step, the directory and the cause; returns the step."""
  assert code == 1, output[-3000:]
  errors = [line for line in output.splitlines() if line.startswith("distrib-train: error:")]
  assert len(errors) == 1, output[-3000:]
  assert str(checkpoints) in errors[0] and re.search(causes, errors[0]), errors[0]
  assert "Traceback" not in output and not re.search(r"^E\d{4} ", output, re.M), output[-5000:]
  for echo in ("never retrieved", "Exception ignored", "Event loop is closed", "destroyed but it is pending"):
    assert echo not in output, output[-5000:]  # the writes in flight beside the failed one finished (faults.py)
  failed = int(re.search(r"Checkpoint step (\d+) could not be written", errors[0]).group(1))
  assert f"step {EVERY} there is intact" in errors[0], errors[0]
  return failed


def _check_intact(checkpoints, failed, reference):
  """Only complete steps are listed, not the failed one; the last equals the reference's."""
  on_disk = kill_harness.step_dirs(checkpoints, num_processes=1)
  listed = kill_harness.orbax_steps(checkpoints)
  assert listed == [EVERY] and failed not in on_disk["committed"], (listed, on_disk)
  assert all(on_disk["committed"][s] for s in listed), on_disk
  want = kill_harness.saved_arrays(reference / "checkpoints" / str(EVERY))
  got = kill_harness.saved_arrays(checkpoints / str(EVERY))
  assert want.keys() == got.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _check_resumes(workdir, xla_cache, reference):
  """With the fault gone, a relaunch resumes from the intact step and ends like the reference."""
  code, output = _run(workdir, xla_cache)
  assert code == 0, output[-3000:]
  assert f"Restored step {EVERY} from" in output
  checkpoints = workdir / "checkpoints"
  assert not kill_harness.step_dirs(checkpoints, num_processes=1)["tmp"]
  want = kill_harness.saved_arrays(reference / "checkpoints" / str(STEPS))
  got = kill_harness.saved_arrays(checkpoints / str(STEPS))
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  assert kill_harness.data_positions(checkpoints / str(STEPS)) == kill_harness.data_positions(
    reference / "checkpoints" / str(STEPS)
  )


def _array_files_of_the_failed_save(checkpoints, failed):
  """The array files (tensorstore's) that the failed step's save wrote whole into its temporary directory, which
  stays until a relaunch."""
  return [
    p.name for p in checkpoints.glob(f"{failed}.orbax-checkpoint-tmp*/state*/ocdbt.process_*/d/*") if p.stat().st_size
  ]


@pytest.mark.parametrize("leave_kib, where", [(0, "save() itself"), (800, "the background write")])
def test_disk_full_mid_run_stops_with_one_line_and_keeps_the_last_checkpoint(
  tmp_path, xla_cache, reference, leave_kib, where
):
  """0 KiB left fails the next save's first write (no array file is written
  whole); 800 KiB lets the arrays' write run until the disk is full, usually
  in the background part. The two are told apart by the array files the
  failed save wrote whole, not by the error's wording: the write that meets
  the full disk is tensorstore's or one of orbax's own metadata files,
  whichever comes last. Which step's save fails depends on the fault coming
  before the next save begins: a run paused too late is run again (up to
  three tries)."""
  for attempt in range(3):
    workdir = tmp_path / f"run{attempt}"
    checkpoints = workdir / "checkpoints"
    with _tmpfs(checkpoints):
      ran = _run_with_fault(workdir, xla_cache, lambda: _fill(checkpoints, leave_kib * 1024))
      if ran is None:
        continue
      code, output = ran
      failed = _check_failed_run(code, output, checkpoints, r"No space left on device")
      arrays = _array_files_of_the_failed_save(checkpoints, failed)  # written in the background part only
      assert bool(arrays) == bool(leave_kib), f"not {where}: array files {arrays}; {output[-2000:]}"
      _check_intact(checkpoints, failed, reference)
      (checkpoints / "filler").unlink()
      _check_resumes(workdir, xla_cache, reference)
      return
  _paused_too_late()


def _paused_too_late():
  pytest.fail(f"three runs began step {2 * EVERY}'s save before they could be paused after step {EVERY}'s")


def _read_only_switch(directory, scratch):
  """How to make ``directory`` read-only and back: chmod, or as root a tmpfs
  remount, or ``chattr +i``. Returns (context manager for the run, make, undo)."""
  if os.geteuid() != 0:
    directory.mkdir(parents=True)
    return contextlib.nullcontext(), lambda: directory.chmod(0o555), lambda: directory.chmod(0o755)
  probe = scratch / "mount_probe"
  probe.mkdir()
  can_mount = (
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True).returncode == 0
  )
  if can_mount:
    subprocess.run(["umount", str(probe)], check=True)
    remount = lambda mode: subprocess.run(["mount", "-o", f"remount,{mode}", str(directory)], check=True)
    return _tmpfs(directory), lambda: remount("ro"), lambda: remount("rw")
  directory.mkdir(parents=True, exist_ok=True)
  if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode:
    pytest.skip("as root, making a directory read-only needs a tmpfs mount or chattr +i; neither works here")
  subprocess.run(["chattr", "-i", str(directory)], check=True)
  return (
    contextlib.nullcontext(),
    lambda: subprocess.run(["chattr", "+i", str(directory)], check=True),
    lambda: subprocess.run(["chattr", "-i", str(directory)], check=True),
  )


def test_read_only_checkpoint_directory_mid_run_stops_with_one_line(tmp_path, xla_cache, reference):
  """A run paused after its next save began is run again (up to three tries), as for the full disk."""
  for attempt in range(3):
    workdir = tmp_path / f"run{attempt}"
    checkpoints = workdir / "checkpoints"
    scratch = tmp_path / f"scratch{attempt}"
    scratch.mkdir()
    context, make_read_only, undo = _read_only_switch(checkpoints, scratch)
    with context:
      try:
        ran = _run_with_fault(workdir, xla_cache, make_read_only)
        if ran is None:
          continue
        causes = r"Read-only file system|Permission denied|Operation not permitted"
        failed = _check_failed_run(*ran, checkpoints, causes)
        _check_intact(checkpoints, failed, reference)
      finally:
        undo()
      _check_resumes(workdir, xla_cache, reference)
      return
  _paused_too_late()
