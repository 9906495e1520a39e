"""The kill matrix: SIGKILL a 2-process training job at seeded random moments,
restart it each time, and check that it ends exactly where an uninterrupted
run ends.

The job is the real CLI (``python -m distrib_train``, the ``tiny``
preset, 2 processes × 4 CPU devices, an async checkpoint every 2 steps and a
local-tier one every 3). Each launch gets a target moment — ``startup`` (a
random time after launch), ``restore``, ``steps``, ``save_blocking`` (inside
``save()``), ``save_background`` (the background write), ``local_save`` (a
local-tier save) — reached by watching process 0's log, then both processes
are killed (together, or one and then the other a random gap later). Where process 0 really was is read back from its log
after it died (``kill_harness.phase_of``), and those phases are the figures
reported. After every kill:

- orbax's own manager lists only complete, committed steps;
- the next launch restores the newest step complete in either tier (its log
  names the step, and the tier).

At the end: the final checkpoint's arrays, every process's data-iterator
position and every logged loss (replays included) are bit-identical to an
uninterrupted run's, and no temporary directory is left.

6 kills by default, one at each target (a minute or two on 2 cores). ``DT_LONG_TESTS=1`` makes it
60; ``DT_KILLS=N`` sets any number, ``DT_KILL_SEED`` the seed, and
``DT_KILL_MATRIX_REPORT=path.json`` keeps the figures.
"""

import collections
import json
import os
import pathlib
import random
import signal
import time

import numpy as np
import pytest

import kill_harness
from kill_harness import Job
import xla_test_flags

TARGETS = ("startup", "restore", "steps", "save_blocking", "save_background", "local_save")
KILLS = int(os.environ.get("DT_KILLS") or (60 if os.environ.get("DT_LONG_TESTS") == "1" else len(TARGETS)))
SEED = int(os.environ.get("DT_KILL_SEED", "0"))
# A killed launch commits half a step of progress on average (0 to 4); near the
# end only moments that cannot finish the run are picked (see _Moment).
STEPS = KILLS // 2 + 14
LAUNCH_TIMEOUT = 150  # seconds from launch to the kill moment, or to the end of the final launch


def _args(workdir, xla_cache):
  return [
    "--config",
    "tiny",
    "--workdir",
    str(workdir),
    "--mesh_config",
    "cpu-2proc",
    "--cpu_devices",
    "4",
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
    "train.checkpoint_every=2",
    "--set",
    "train.keep_checkpoints=2",
    "--set",
    "train.local_checkpoint_every=3",
    "--set",
    f"train.local_checkpoint_dir={workdir}-local",
    "--set",
    "optimizer.warmup_steps=0",
    "--set",
    f"optimizer.decay_steps={STEPS}",
    "--set",
    f"train.compilation_cache_dir={xla_cache}",
    "--heartbeat_timeout",
    "10",
    "--verbosity",
    "0",
  ]  # orbax's INFO lines mark the parts of a save


def _env():
  # JAX writes the persistent compilation cache from process 0 only, and on
  # CPU process 1's cache key differs, so process 1 compiles the step at every
  # launch: the cheapest XLA backend settles that in half the time.
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_test_flags.FAST_COMPILE)


class _Moment:
  """When to kill one launch: a target phase and its seeded random parameters.

  ``remaining`` is the number of steps the run still has to train: below 8
  the moments come early in the launch (the first save, the first step), so
  the run does not finish before its last kill; below 5 the caller picks only
  moments before the first step.
  """

  def __init__(self, target, rng, remaining):
    self.target = target
    self.after_launch = rng.uniform(0.3, 3.0)  # startup
    # steps: this many steps past the restored one; odd, so the kill lands in the next step's compute.
    self.extra_steps = rng.choice([1, 3])
    self.save_index = rng.randint(1, 2)  # save_*: the first or second save of this launch
    if remaining < 8:
      self.extra_steps = self.save_index = 1
    self.delay = {
      "startup": 0.0,
      "restore": rng.uniform(0, 0.2),
      "steps": rng.uniform(0, 0.15),
      "save_blocking": rng.uniform(0, 0.25),
      "save_background": rng.uniform(0, 0.35),
      "local_save": rng.uniform(0, 0.01),
    }[target]
    self.mode = rng.choice(["both", "0 then 1", "1 then 0"])
    self.gap = rng.uniform(0.05, 0.5)

  def missed(self, log):
    """The target's moment has passed without being seen: kill now rather than let the run finish."""
    last = kill_harness.last_step(log)
    return last is not None and last >= (kill_harness.restored_step(log) or 0) + 6

  def reached(self, job, log):
    if self.target == "startup":
      return time.monotonic() - job.started >= self.after_launch
    if self.target == "restore":  # a local-tier restore logs no start: the step it restored instead
      return "Started load checkpoint" in log or "from the local tier" in log
    if self.target == "steps":
      base = kill_harness.restored_step(log) or 0
      last = kill_harness.last_step(log)
      return last is not None and last >= base + self.extra_steps and kill_harness.open_save(log) is None
    if self.target == "save_blocking":
      return log.count("Saving checkpoint at step") >= self.save_index
    if self.target == "local_save":
      return log.count("Local checkpoint: writing step") >= self.save_index
    return log.count("Finished blocking save in") >= self.save_index  # save_background

  def kill(self, job):
    if self.mode == "both":
      job.kill(0)
      job.kill(1)
    else:
      first = 0 if self.mode == "0 then 1" else 1
      job.kill(first)
      time.sleep(self.gap)
      job.kill(1 - first)


def _check_listing(checkpoints, when):
  """orbax lists only complete committed steps; returns (listed, on-disk view)."""
  on_disk = kill_harness.step_dirs(checkpoints)
  listed = kill_harness.orbax_steps(checkpoints) if checkpoints.is_dir() else []
  assert set(listed) <= set(on_disk["committed"]), (when, listed, on_disk)
  incomplete = [s for s in listed if not on_disk["committed"][s]]
  assert not incomplete, f"{when}: orbax lists incomplete step(s) {incomplete}; on disk {on_disk}"
  return listed, on_disk


def _check_restore(log, listed, local, when):
  """The launch restored the newest step complete in either tier (or initialised when none): ``listed`` the
  persistent tier's, ``local`` the steps every process holds in the local tier, both as before the launch."""
  restored = kill_harness.restored_step(log)
  newest = max(listed[-1:] + local[-1:], default=None)
  if restored is None:
    assert "Initialised a new train state" in log and newest is None, (when, listed, local)
  else:
    assert restored == newest, f"{when}: restored step {restored}, persistent {listed}, local {local}"
    from_local = bool(local) and local[-1] > (listed[-1] if listed else -1)
    assert ("from the local tier" in log) == from_local, (when, listed, local)
  return restored


@pytest.mark.timeout(300 + 30 * KILLS)
def test_kill_matrix_resumes_bit_identically(tmp_path, xla_cache):
  started = time.monotonic()
  env = _env()
  logs = tmp_path / "logs"
  logs.mkdir()

  reference = tmp_path / "reference"
  job = Job(_args(reference, xla_cache), logs / "reference", env)
  assert job.wait(LAUNCH_TIMEOUT + 60) == [0, 0], job.tails()
  reference_seconds = time.monotonic() - started

  rng = random.Random(SEED)
  targets = [TARGETS[i % len(TARGETS)] for i in range(KILLS)]
  rng.shuffle(targets)
  workdir = tmp_path / "run"
  checkpoints = workdir / "checkpoints"
  records = []
  missed = 0
  listed, _ = _check_listing(checkpoints, "before the first launch")
  for index, target in enumerate(targets):
    local = kill_harness.local_steps(pathlib.Path(f"{workdir}-local"))
    remaining = STEPS - max(listed[-1:] + local[-1:], default=0)  # from the newest step in either tier
    if remaining <= 4:  # only moments before the first step cannot finish the run
      target = "restore" if target in ("restore", "steps") else "startup"
    if target == "restore" and not (listed or local):  # nothing to restore yet: swap with a later target
      later = [j for j in range(index + 1, len(targets)) if targets[j] != "restore"]
      if later:
        targets[index], targets[later[0]] = targets[later[0]], targets[index]
      target = targets[index] if later else "steps"
    when = f"launch {index} (target {target})"
    moment = _Moment(target, rng, remaining)
    job = Job(_args(workdir, xla_cache), logs / f"launch_{index:02d}", env)
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    finished = was_missed = False
    seen = -1
    try:
      while True:
        log = job.text(0)
        # Only new log lines can move a log-watching target (the matching costs CPU the job needs).
        if (len(log) != seen or target == "startup") and moment.reached(job, log):
          time.sleep(moment.delay)
          moment.kill(job)
          break
        if moment.missed(log):
          was_missed = True
          missed += 1
          moment.kill(job)
          break
        codes = job.codes()
        if all(c == 0 for c in codes):
          finished = True
          break
        assert not any(codes), f"{when}: a process exited {codes} before the kill\n{job.tails()}"
        assert time.monotonic() < deadline, f"{when}: no kill moment within {LAUNCH_TIMEOUT} s\n{job.tails()}"
        seen = len(log)
        time.sleep(0.005)
      killed_at = time.monotonic() - job.started
      job.wait(30)
    finally:
      job.kill_all()
    assert not finished, (
      f"{when}: the run finished before kill {index + 1} of {KILLS}; the matrix needs more steps than {STEPS}"
    )
    log = job.text(0)
    if "Restored step" in log or "Initialised a new train state" in log:
      _check_restore(log, listed, local, when)
    phase = kill_harness.phase_of(log)
    listed, on_disk = _check_listing(checkpoints, f"after {when}")
    records.append(
      {
        "launch": index,
        "target": target,
        "missed": was_missed,
        "phase": phase,
        "mode": moment.mode,
        "seconds_after_launch": round(killed_at, 2),
        "restored": kill_harness.restored_step(log),
        "restored_from_local": "from the local tier" in log,
        "last_step_logged": kill_harness.last_step(log),
        "open_save": kill_harness.open_save(log),
        "committed_after": sorted(on_disk["committed"]),
        "tmp_after": on_disk["tmp"],
      }
    )

  local = kill_harness.local_steps(pathlib.Path(f"{workdir}-local"))
  final = Job(_args(workdir, xla_cache), logs / "final", env)
  assert final.wait(LAUNCH_TIMEOUT + 60) == [0, 0], final.tails()
  final_log = final.text(0)
  _check_restore(final_log, listed, local, "the final launch")
  listed, on_disk = _check_listing(checkpoints, "at the end")
  assert listed[-1] == STEPS and not on_disk["tmp"], on_disk

  want = kill_harness.saved_arrays(reference / "checkpoints" / str(STEPS))
  got = kill_harness.saved_arrays(checkpoints / str(STEPS))
  assert want.keys() == got.keys() and any(k.startswith("params/") for k in want)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  assert kill_harness.data_positions(checkpoints / str(STEPS)) == kill_harness.data_positions(
    reference / "checkpoints" / str(STEPS)
  )
  want_losses, _ = kill_harness.step_losses(reference)
  got_losses, broken_lines = kill_harness.step_losses(workdir)
  assert sorted(got_losses) == sorted(want_losses) == list(range(1, STEPS + 1))
  for step, losses in got_losses.items():
    assert losses == want_losses[step] * len(losses), f"step {step}: {losses} vs {want_losses[step]}"

  phases = collections.Counter(r["phase"] for r in records)
  figures = {
    "kills": len(records),
    "seed": SEED,
    "steps": STEPS,
    "launches": len(records) + 2,
    "restarts_that_restored": sum(r["restored"] is not None for r in records)
    + (kill_harness.restored_step(final_log) is not None),
    "restores_from_the_local_tier": sum(r["restored_from_local"] for r in records)
    + ("from the local tier" in final_log),
    "phases": dict(sorted(phases.items())),
    "targets_to_phases": {
      t: dict(collections.Counter(r["phase"] for r in records if r["target"] == t)) for t in TARGETS
    },
    "kill_modes": dict(collections.Counter(r["mode"] for r in records)),
    "steps_replayed": sum(len(v) - 1 for v in got_losses.values()),
    "tmp_dirs_left_by_kills": sum(bool(r["tmp_after"]) for r in records),
    "broken_metrics_lines": len(broken_lines),
    "targets_missed": missed,
    "reference_seconds": round(reference_seconds, 1),
    "total_seconds": round(time.monotonic() - started, 1),
    "records": records,
  }
  text = json.dumps(figures, indent=1)
  (tmp_path / "kill_matrix.json").write_text(text)
  if os.environ.get("DT_KILL_MATRIX_REPORT"):
    with open(os.environ["DT_KILL_MATRIX_REPORT"], "w") as f:
      f.write(text)
  print("kill matrix:", json.dumps({k: v for k, v in figures.items() if k != "records"}))
  # Every kind of moment was hit (phases are where process 0 really was).
  assert (
    phases["steps"] and phases["save_blocking"] + phases["save_background"] and (phases["restore"] + phases["startup"])
  ), figures


def test_a_process_late_to_the_first_step_does_not_fail_the_job(tmp_path, xla_cache):
  """Process 1 stopped for 40 s as it starts compiling the train step (on a
  loaded machine, compiling what process 0 loads from the cache can take that
  long): the first step's collectives would give up after gloo's 30 s; the
  trainer waits for every process at a barrier instead, and the run finishes."""
  args = _args(tmp_path / "run", xla_cache)
  args[args.index("--steps") + 1] = "2"
  args[args.index("--heartbeat_timeout") + 1] = "100"  # a stopped process sends no heartbeats (a compiling one does)
  job = Job(args, tmp_path / "late", dict(_env(), JAX_LOG_COMPILES="1"))
  try:
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while "Compiling jit(updated_params_and_states)" not in job.text(1):
      assert not any(job.codes()) and time.monotonic() < deadline, job.tails()
      time.sleep(0.01)
    os.killpg(job.procs[1].pid, signal.SIGSTOP)
    time.sleep(40)
    os.killpg(job.procs[1].pid, signal.SIGCONT)
    assert job.wait(LAUNCH_TIMEOUT) == [0, 0], job.tails()
  finally:
    job.kill_all()


@pytest.mark.timeout(900)
def test_a_kill_then_restarts_on_one_and_on_four_processes_continue_the_run(tmp_path, xla_cache):
  """2 processes × 4 devices SIGKILLed right after step 6 (persistent step 4, local step 6), restarted on
  1 process × 8 devices and SIGKILLed again after step 9 (persistent step 8), restarted on 4 × 2 to the end: the local
  tier is refused on the other shapes (the log says so) and the persistent step restores; the losses are an
  uninterrupted run's."""
  import subprocess
  import sys

  from test_cli import train_losses
  from test_elastic_resume import _mesh_config
  from test_local_checkpoints import _args as local_args, _launch

  # SGD: the meshes differ, so float sums do (local_args saves synchronously: a kill right after a step keeps it).
  sgd = ["--set", "optimizer.name=sgd", "--set", "optimizer.learning_rate=0.5"]
  codes, outputs = _launch(local_args(tmp_path / "straight", tmp_path / "straight-local", xla_cache, steps=12) + sgd)
  assert codes == [0, 0], outputs[0][-3000:]
  want = train_losses(tmp_path / "straight")

  run, local = tmp_path / "run", tmp_path / "local"
  codes, outputs = _launch(local_args(run, local, xla_cache, steps=12) + sgd, kill_at=6)
  assert codes == [-9, -9], outputs[0][-3000:]
  one = local_args(run, local, xla_cache, steps=12) + sgd
  one[one.index("--cpu_devices") + 1] = "8"
  one[one.index("--mesh_config") + 1] = str(_mesh_config(tmp_path, 1))
  env = dict(os.environ, JAX_PLATFORMS="cpu", DT_KILL_AT_STEP="9")
  env["XLA_FLAGS"] = xla_test_flags.FAST_COMPILE
  killed = subprocess.run(
    [sys.executable, str(pathlib.Path(__file__).parent / "workers" / "kill_at_step.py"), *one],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert killed.returncode == -9, killed.stderr[-3000:]
  assert "local tier's step 6 is not complete on every process (or not of this run and layout)" in killed.stderr
  assert "Restored step 4 from" in killed.stderr
  four = local_args(run, local, xla_cache, steps=12) + sgd
  four[four.index("--cpu_devices") + 1] = "2"
  four[four.index("--mesh_config") + 1] = str(_mesh_config(tmp_path, 4))
  env.pop("DT_KILL_AT_STEP")
  jobs = Job(four, tmp_path / "four", env, num_processes=4)
  try:
    assert jobs.wait(300) == [0] * 4, jobs.tails()
  finally:
    jobs.kill_all()
  assert "Restored step 8 from" in jobs.text(0)
  got = train_losses(run)
  assert sorted(got) == list(range(1, 13))
  np.testing.assert_allclose([got[s] for s in range(1, 13)], [want[s] for s in range(1, 13)], rtol=2e-5)
