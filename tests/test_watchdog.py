"""The hang watchdog (``train/watchdog.py``): limits per phase, the one line, and a stopped process in a real job.

The unit tests drive a ``Watchdog`` by hand (``tick()``) on a fake clock, with
a fake exit. The job test runs the real CLI in 2 processes, SIGSTOPs one
mid-run and checks that both processes end, each with the line naming the
phase and the stopped process.
"""

import io
import json
import os
import re
import signal
import threading
import time

import pytest

import kill_harness
from distrib_train.config import run as config_lib
from distrib_train.config.run import ConfigError
from distrib_train.train.goodput import PhaseClock
from distrib_train.train.watchdog import EXIT_HUNG, Limits, Watchdog

HANG_TIMEOUT_S = 20
MARGIN_S = 75  # a busy 2-core machine: stacks, files and the exit of a process holding 4 CPU devices
LINE = re.compile(
  r"^distrib-train: error: Hang: no progress for (\d+) s in phase '(\w+)' after step (\d+)"
  r" \(train\.hang_timeout_s=20\); (.*)\.$",
  re.M,
)


class FakeClock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self):
    return self.now


def _watchdog(tmp_path, clock, *, process=0, processes=2, step_s=10.0):
  phases = PhaseClock(clock)
  exits = []
  stream = io.StringIO()
  watchdog = Watchdog(
    Limits(step_s, 100.0, 300.0),
    phases,
    tmp_path,
    process_index=process,
    process_count=processes,
    stream=stream,
    exit_process=exits.append,
  )
  watchdog.directory.mkdir(exist_ok=True)
  return watchdog, phases, exits, stream


def _run_for(seconds, clock, watchdog):
  """``seconds`` of the watchdog's thread: a tick every second."""
  for _ in range(seconds):
    clock.now += 1
    watchdog.tick()


def _heartbeat(tmp_path, process, age_s, step, phase="step", exited=None):
  beat = {
    "process": process,
    "time": time.time() - age_s,
    "phase": phase,
    "step": step,
    **({"exited": exited} if exited else {}),
  }
  (tmp_path / "watchdog" / f"heartbeat_{process}.json").write_text(json.dumps(beat))


def test_the_watchdog_is_off_by_default_and_limits_default_relative_to_the_step_limit():
  assert config_lib.load("tiny").train.hang_timeout_s == 0
  assert Limits.from_config(config_lib.load("tiny", ["train.hang_timeout_s=120"]).train) == Limits(120, 1200, 1200)
  assert Limits.from_config(config_lib.load("tiny", ["train.hang_timeout_s=20"]).train) == Limits(20, 600, 600)
  set_both = ["train.hang_timeout_s=20", "train.hang_compile_timeout_s=90", "train.hang_checkpoint_timeout_s=60"]
  assert Limits.from_config(config_lib.load("tiny", set_both).train) == Limits(20, 90, 60)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["train.hang_timeout_s=-1"], "train.hang_timeout_s must be 0 or more"),
    (["train.hang_compile_timeout_s=60"], "train.hang_compile_timeout_s is set but the hang watchdog is off"),
  ],
)
def test_bad_watchdog_settings_are_refused(overrides, message):
  with pytest.raises(ConfigError, match=message):
    config_lib.load("tiny", overrides)


def test_compile_checkpoint_and_the_first_step_get_their_own_limits():
  limits = Limits(10, 100, 300)
  assert limits.of("step", first_step=False) == (10, "train.hang_timeout_s")
  assert limits.of("data", first_step=False) == (10, "train.hang_timeout_s")
  assert limits.of("step", first_step=True) == (100, "train.hang_compile_timeout_s")
  assert limits.of("compile", first_step=False) == (100, "train.hang_compile_timeout_s")
  assert limits.of("eval", first_step=False) == (100, "train.hang_compile_timeout_s")
  for phase in ("restore", "checkpoint", "init", "startup"):
    assert limits.of(phase, first_step=False) == (300, "train.hang_checkpoint_timeout_s")


def test_progress_within_the_limit_keeps_it_quiet(tmp_path):
  clock = FakeClock()
  watchdog, phases, exits, _ = _watchdog(tmp_path, clock)
  phases.step_done(1)
  for _ in range(25):  # 50 s of steps, 2 s each: never 10 s without progress
    _run_for(2, clock, watchdog)
    phases.step_done(phases.now.step + 1)
  assert exits == []
  phases.enter("checkpoint")
  _run_for(250, clock, watchdog)  # a long save: within the checkpoint limit
  assert exits == []


def test_a_stuck_step_fires_once_with_stacks_and_one_line_naming_the_silent_process(tmp_path):
  clock = FakeClock()
  watchdog, phases, exits, stream = _watchdog(tmp_path, clock)
  phases.enter("data", 6)
  phases.enter("step")
  phases.step_done(7)
  _heartbeat(tmp_path, 1, age_s=12, step=6)
  _run_for(10, clock, watchdog)
  assert exits == []
  _run_for(2, clock, watchdog)
  assert exits == [EXIT_HUNG]
  output = stream.getvalue()
  line = output.splitlines()[-1]
  # the heartbeat's age is read on the wall clock, after 12 ticks of real file writes: 12 s, or more on a busy disk
  assert re.fullmatch(
    r"distrib-train: error: Hang: no progress for 11 s in phase 'step' after step 7"
    r" \(train\.hang_timeout_s=10\); process 1 is silent \(last heartbeat 1[2-5] s ago, phase 'step'"
    r" after step 6\)\.",
    line,
  ), line
  assert "Python stacks:" in output and "test_watchdog.py" in output  # this thread's stack
  assert line.removeprefix("distrib-train: error: ") in (tmp_path / "watchdog" / "stacks_0.txt").read_text()
  assert json.loads((tmp_path / "watchdog" / "heartbeat_0.json").read_text())["exited"] == "hang"


def test_without_a_silent_process_the_one_behind_is_named(tmp_path):
  clock = FakeClock()
  watchdog, phases, exits, stream = _watchdog(tmp_path, clock, processes=3)
  phases.enter("step")
  phases.step_done(5)
  _heartbeat(tmp_path, 1, age_s=0, step=5)
  _heartbeat(tmp_path, 2, age_s=0, step=4, phase="data")
  _run_for(11, clock, watchdog)
  assert stream.getvalue().splitlines()[-1].endswith("; process 2 is behind (phase 'data' after step 4).")


def test_a_process_that_was_stopped_names_itself_when_it_runs_again(tmp_path):
  clock = FakeClock()
  watchdog, phases, exits, stream = _watchdog(tmp_path, clock, process=1)
  phases.enter("step")
  phases.step_done(3)
  clock.now += 1
  watchdog.tick()
  clock.now += 40  # SIGSTOP … SIGCONT: no tick ran
  _heartbeat(tmp_path, 0, age_s=5, step=3)
  watchdog.tick()
  assert exits == [EXIT_HUNG]
  assert (
    stream.getvalue()
    .splitlines()[-1]
    .endswith(
      "in phase 'step' after step 3 (train.hang_timeout_s=10);"
      " process 1 (this process) is silent: it did not run for 40 s (stopped or starved)."
    )
  )


def test_a_stop_in_the_middle_of_a_tick_is_still_named_as_this_process_s_silence(tmp_path):
  """SIGSTOP can land inside a tick, after it read the clock (here: while it writes the heartbeat). The tick that
  runs on after SIGCONT must not call the stop idle time in the phase; the next tick sees the gap and names it."""
  clock = FakeClock()
  watchdog, phases, exits, stream = _watchdog(tmp_path, clock)
  phases.enter("step")
  phases.step_done(3)
  _run_for(1, clock, watchdog)
  write_heartbeat = watchdog._beat

  def stopped_while_writing(**kwargs):
    write_heartbeat(**kwargs)
    clock.now += 40  # SIGSTOP … SIGCONT; process 1's watchdog fired meanwhile
    _heartbeat(tmp_path, 1, age_s=20, step=3, exited="hang")

  watchdog._beat = stopped_while_writing
  clock.now += 1
  watchdog.tick()
  watchdog._beat = write_heartbeat
  assert exits == []
  _run_for(1, clock, watchdog)
  assert exits == [EXIT_HUNG]
  assert (
    stream.getvalue()
    .splitlines()[-1]
    .endswith(
      "in phase 'step' after step 3 (train.hang_timeout_s=10);"
      " process 0 (this process) is silent: it did not run for 41 s (stopped or starved)."
    )
  )


def test_a_stopped_process_that_ran_one_more_step_still_names_itself(tmp_path):
  """After SIGCONT the process finishes the step its peer had already sent its part of, then hangs in the next."""
  clock = FakeClock()
  watchdog, phases, exits, stream = _watchdog(tmp_path, clock)
  phases.enter("step")
  phases.step_done(3)
  clock.now += 1
  watchdog.tick()
  clock.now += 40  # SIGSTOP … SIGCONT: no tick ran; the peer's watchdog fired meanwhile
  phases.step_done(4)  # the main thread runs first: it ends the step process 1 had sent its part of
  watchdog.tick()
  clock.now += 1
  phases.enter("data", 4)
  phases.enter("step")  # then waits in the next step for a process that has exited
  _heartbeat(tmp_path, 1, age_s=20, step=3, exited="hang")
  _run_for(11, clock, watchdog)
  assert exits == [EXIT_HUNG]
  assert (
    stream.getvalue()
    .splitlines()[-1]
    .endswith(
      "in phase 'step' after step 4 (train.hang_timeout_s=10); process 0 (this process) was silent just before:"
      " it did not run for 40 s (stopped or starved); process 1 has exited (hang)."
    )
  )
  clock, later = FakeClock(), tmp_path / "later"
  later.mkdir()
  watchdog, phases, exits, stream = _watchdog(later, clock)  # a stop long before this phase is not named
  phases.enter("step")
  phases.step_done(3)
  clock.now += 1
  watchdog.tick()
  clock.now += 40
  for step in range(4, 20):  # 30 s of steps after it ran again
    phases.step_done(step)
    _run_for(2, clock, watchdog)
  _heartbeat(later, 1, age_s=0, step=19, exited="hang")
  _run_for(11, clock, watchdog)
  assert stream.getvalue().splitlines()[-1].endswith("(train.hang_timeout_s=10); process 1 has exited (hang).")


def test_a_run_failing_in_an_overdue_phase_ends_as_a_hang(tmp_path):
  clock = FakeClock()
  watchdog, phases, exits, _ = _watchdog(tmp_path, clock)
  watchdog.start()
  phases.enter("step")
  phases.step_done(2)
  clock.now += 20  # a peer died in this step; the collective failed
  watchdog.close(failed=True)
  assert exits == [EXIT_HUNG]


def test_a_clean_close_stops_the_thread_and_marks_the_heartbeat(tmp_path):
  clock = FakeClock()
  watchdog, phases, exits, _ = _watchdog(tmp_path, clock)
  watchdog.start()
  phases.step_done(2)
  watchdog.close()
  assert exits == [] and not any(t.name == "distrib_train-watchdog" for t in threading.enumerate())
  assert json.loads((tmp_path / "watchdog" / "heartbeat_0.json").read_text())["exited"] == "done"


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
    "1000",
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
    f"train.hang_timeout_s={HANG_TIMEOUT_S}",
    "--set",
    f"train.compilation_cache_dir={xla_cache}",
  ]


@pytest.mark.timeout(420)
def test_a_stopped_process_ends_the_job_with_a_line_naming_it(tmp_path, xla_cache):
  """Process 0 (it hosts JAX's coordination service) is stopped after step 3: process 1's watchdog names it and
  exits; process 0, let run again, reports the hang itself at once. (A stopped process 1 that runs again after
  process 0 has exited may be aborted first by JAX's coordination client, which has lost its service.)"""
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
  )
  job = kill_harness.Job(_args(tmp_path / "run", xla_cache), tmp_path / "job", env)
  try:
    deadline = time.monotonic() + 240
    while (kill_harness.last_step(job.text(0)) or 0) < 3:
      assert not any(job.codes()) and time.monotonic() < deadline, job.tails()
      time.sleep(0.05)
    os.killpg(job.procs[0].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
      job.procs[1].wait(timeout=HANG_TIMEOUT_S + MARGIN_S)
    finally:
      os.killpg(job.procs[0].pid, signal.SIGCONT)
    codes = job.wait(max(5.0, stopped + HANG_TIMEOUT_S + MARGIN_S - time.monotonic()))
  finally:
    job.kill_all()
  assert codes == [EXIT_HUNG, EXIT_HUNG], job.tails()
  found = [LINE.findall(job.text(i)) for i in (0, 1)]
  assert all(len(lines) == 1 for lines in found), job.tails()
  (idle_0, phase_0, _, who_0), (idle_1, phase_1, _, who_1) = found[0][0], found[1][0]
  assert phase_0 == phase_1 == "step"
  assert int(idle_0) >= HANG_TIMEOUT_S and int(idle_1) >= HANG_TIMEOUT_S
  assert who_1.startswith("process 0 is silent (last heartbeat"), who_1
  # Process 0 reports at once, or first ends the step process 1 had sent its part of, then waits in the next
  assert re.match(r"process 0 \(this process\) (is silent:|was silent just before:) it did not run for", who_0), who_0
  for i in (0, 1):
    assert "Python stacks:" in job.text(i) and (tmp_path / "run" / "watchdog" / f"stacks_{i}.txt").is_file()
