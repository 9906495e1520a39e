"""``python -m distrib_train`` end to end, in subprocesses."""

import json
import os
import pathlib
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from mp_harness import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = [
  "--set",
  "data.seq_len=32",
  "--set",
  "data.global_batch_size=8",
  "--set",
  "train.log_every=1",
  "--set",
  "train.eval_batches=1",
  "--set",
  "optimizer.warmup_steps=0",
  "--set",
  "optimizer.decay_steps=10",
]


def cli(*args, timeout=240, cache=None, popen=False):
  cmd = [sys.executable, "-m", "distrib_train", "--config", "tiny", *args]
  if cache:
    cmd += ["--set", f"train.compilation_cache_dir={cache}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if popen:
    return subprocess.Popen(
      cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def metrics(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def train_losses(workdir):
  return {m["step"]: m["loss"] for m in metrics(workdir) if "eval/loss" not in m and "loss" in m}


def tensorboard_events(workdir):
  """Every scalar in the TensorBoard files, as ``(tag, step, value)``, repeats included."""
  from tensorboardX.proto import event_pb2

  out = []
  for path in (workdir / "tensorboard").glob("events.out.tfevents.*"):
    data, i = path.read_bytes(), 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i : i + 8])
      event = event_pb2.Event()
      event.ParseFromString(data[i + 12 : i + 12 + n])
      i += 16 + n
      out += [(value.tag, event.step, value.simple_value) for value in event.summary.value]
  return out


def tensorboard_scalars(workdir):
  out = {}
  for tag, step, value in tensorboard_events(workdir):
    out.setdefault(tag, {})[step] = value
  return out


def checkpoint_arrays(workdir, step):
  import orbax.checkpoint as ocp

  restored = ocp.PyTreeCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")
  flat = {}

  def walk(prefix, node):
    if isinstance(node, dict):
      for k, v in node.items():
        walk(f"{prefix}/{k}", v)
    else:
      flat[prefix] = np.asarray(node)

  walk("", restored)
  return flat


def test_end_to_end_files_metrics_profile_and_cache(tmp_path, xla_cache):
  workdir = tmp_path / "run"
  out = cli(
    "--workdir",
    str(workdir),
    "--cpu_devices",
    "8",
    "--steps",
    "4",
    "--profile_steps",
    "2:3",
    "--set",
    "train.eval_every=4",
    "--set",
    "train.peak_tflops=0.5",
    *SMALL,
    cache=xla_cache,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  log = out.stderr
  assert "Plan on mesh data=2 × fsdp=2 × tensor=2 (8 devices)" in log
  assert "First step done" in log and "temporaries" in log
  for name in ("config.yaml", "plan.txt", "metrics.jsonl"):
    assert (workdir / name).is_file(), name
  # The console gets the plan's summary; the whole table is in plan.txt.
  assert "bytes/device" in (workdir / "plan.txt").read_text() and "bytes/device" not in log
  assert "0.00 GiB" not in log
  assert "Involuntary full rematerialization" not in log
  from distrib_train.config import run as config_lib

  saved = config_lib.load(str(workdir / "config.yaml"))
  assert saved.train.steps == 4 and saved.data.seq_len == 32
  lines = metrics(workdir)
  steps = [m for m in lines if "step_time_ms" in m]
  assert [m["step"] for m in steps] == [1, 2, 3, 4]
  for key in ("loss", "grad_norm", "learning_rate", "tokens_per_s", "tokens_per_s_per_device", "mfu", "data_wait_ms"):
    assert all(np.isfinite(m[key]) for m in steps), key
  assert steps[0]["tokens_per_s"] == pytest.approx(steps[0]["tokens_per_s_per_device"] * 8)
  evals = [m for m in lines if "eval/loss" in m]
  assert len(evals) == 1 and evals[0]["step"] == 4 and np.isfinite(evals[0]["eval/loss"])
  scalars = tensorboard_scalars(workdir)
  assert sorted(scalars["loss"]) == [1, 2, 3, 4]
  assert scalars["loss"][4] == pytest.approx(steps[-1]["loss"], rel=1e-6)
  assert "eval/loss" in scalars
  assert (workdir / "checkpoints" / "4").is_dir()
  assert list((workdir / "profile" / "process_0").rglob("*.xplane.pb"))

  # A second launch resumes and takes the step from the persistent cache (jax ≥ 0.11: on jax 0.10 the
  # trainer keeps multi-device CPU steps out of it, compilation.cache_unsafe_reason).
  again = cli("--workdir", str(workdir), "--cpu_devices", "8", "--steps", "6", *SMALL, cache=xla_cache)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "Restored step 4" in again.stderr
  from distrib_train.common.versions import jax_version

  if jax_version() >= (0, 11):
    assert "Train step from the persistent cache" in again.stderr
  else:
    assert "compilation cache: off: jax" in again.stderr and "Train step compiled in" in again.stderr
  assert sorted(train_losses(workdir)) == [1, 2, 3, 4, 5, 6]


def test_each_log_point_and_the_final_evaluation_are_written_once(tmp_path, xla_cache):
  # 6 steps, a log point every 2, the evaluation and the checkpoint at the end only: the last step's record
  # must not be written again by the work done after it (a reader or TensorBoard would count it twice).
  workdir = tmp_path / "run"
  out = cli(
    "--workdir",
    str(workdir),
    "--cpu_devices",
    "8",
    "--steps",
    "6",
    *SMALL,
    "--set",
    "train.log_every=2",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.checkpoint_every=0",
    cache=xla_cache,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  lines = metrics(workdir)
  assert [(m["step"], "eval/loss" in m) for m in lines] == [(2, False), (4, False), (6, False), (6, True)]
  assert len({json.dumps(m, sort_keys=True) for m in lines}) == len(lines)
  steps_of = lambda tag: sorted(step for t, step, _ in tensorboard_events(workdir) if t == tag)
  assert steps_of("loss") == [2, 4, 6] and steps_of("eval/loss") == [6]
  assert out.stderr.count("step 6  loss") == 1 and out.stderr.count("step 6  eval/loss") == 1


def test_resume_matches_a_straight_run(tmp_path, xla_cache):
  straight, split = tmp_path / "straight", tmp_path / "split"
  common = ["--cpu_devices", "8", *SMALL, "--set", "train.eval_every=0"]
  assert cli("--workdir", str(straight), "--steps", "10", *common, cache=xla_cache).returncode == 0
  first = cli("--workdir", str(split), "--steps", "5", *common, cache=xla_cache)
  assert first.returncode == 0, first.stderr[-3000:]
  second = cli("--workdir", str(split), "--steps", "10", *common, cache=xla_cache)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "Restored step 5" in second.stderr
  a, b = train_losses(straight), train_losses(split)
  assert sorted(a) == sorted(b) == list(range(1, 11))
  assert a == b  # bit for bit: same data order, keys and optimizer state
  arrays_a, arrays_b = checkpoint_arrays(straight, 10), checkpoint_arrays(split, 10)
  assert arrays_a.keys() == arrays_b.keys() and any("params" in k for k in arrays_a)
  for key in arrays_a:
    np.testing.assert_array_equal(arrays_a[key], arrays_b[key], err_msg=key)


def _wait_for_step(workdir, proc, step, timeout=180):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise AssertionError(f"exited early ({proc.returncode}): {proc.stdout.read()[-3000:]}")
    if (workdir / "metrics.jsonl").is_file() and any(m.get("step", 0) >= step for m in metrics(workdir)):
      return
    time.sleep(0.2)
  raise AssertionError(f"no step {step} within {timeout} s")


def test_sigterm_checkpoints_and_exits_0_then_resumes(tmp_path, xla_cache):
  workdir = tmp_path / "run"
  args = ["--workdir", str(workdir), "--cpu_devices", "8", *SMALL]
  proc = cli(*args, "--steps", "100000", cache=xla_cache, popen=True)
  try:
    _wait_for_step(workdir, proc, 3)
    step_at_signal = max(train_losses(workdir))
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=240)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  assert proc.returncode == 0, output[-3000:]
  saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert len(saved) == 1 and saved[0] >= 3
  stopped = saved[0]
  # It stops at a step after the signal and saves it, whatever the checkpoint
  # interval; how many steps ran meanwhile depends on the machine's load.
  assert step_at_signal <= stopped < 100000, (step_at_signal, stopped)
  assert f"Preemption: saving step {stopped} and stopping" in output
  assert max(train_losses(workdir)) == stopped
  resumed = cli(*args, "--steps", str(stopped + 2), cache=xla_cache)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"Restored step {stopped}" in resumed.stderr
  assert sorted(train_losses(workdir))[-2:] == [stopped + 1, stopped + 2]


def test_sigterm_to_one_of_two_processes_stops_both_at_one_step(tmp_path, xla_cache):
  workdir = tmp_path / "run"
  port = free_port()
  procs = [
    cli(
      "--workdir",
      str(workdir),
      "--cpu_devices",
      "4",
      "--mesh_config",
      "cpu-2proc",
      "--steps",
      "100000",
      "--coordinator_address",
      f"127.0.0.1:{port}",
      "--num_processes",
      "2",
      "--process_id",
      str(i),
      *SMALL,
      cache=xla_cache,
      popen=True,
    )
    for i in range(2)
  ]
  outputs = []
  try:
    _wait_for_step(workdir, procs[0], 3)
    step_at_signal = max(train_losses(workdir))
    procs[1].send_signal(signal.SIGTERM)  # the other process hears of it through JAX's preemption service
    outputs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
  assert not any("[Gloo] Rank" in o for o in outputs)  # gloo's per-communicator banner is dropped
  saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert len(saved) == 1 and saved[0] >= 3
  stopped = saved[0]
  assert f"Preemption: saving step {stopped}" in outputs[0]
  # Both processes' rows' data positions, kept in the checkpoint's metadata by process 0.
  saved_meta = json.loads((workdir / "checkpoints" / str(stopped) / "meta" / "metadata").read_text())
  assert saved_meta["process_count"] == 2 and len(saved_meta["data_position"]["lanes"]) == 8
  # The processes agree on one step at JAX's next preemption sync point and
  # both save it. How many steps run before that point depends on the
  # machine's load, so only the order is checked, not a count.
  assert step_at_signal <= stopped < 100000, (step_at_signal, stopped)

  port = free_port()
  procs = [
    cli(
      "--workdir",
      str(workdir),
      "--cpu_devices",
      "4",
      "--mesh_config",
      "cpu-2proc",
      "--steps",
      str(stopped + 2),
      "--coordinator_address",
      f"127.0.0.1:{port}",
      "--num_processes",
      "2",
      "--process_id",
      str(i),
      *SMALL,
      cache=xla_cache,
      popen=True,
    )
    for i in range(2)
  ]
  try:
    outputs = [p.communicate(timeout=180)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
  assert f"Restored step {stopped}" in outputs[0]
  assert sorted(train_losses(workdir))[-2:] == [stopped + 1, stopped + 2]


def test_halt_on_non_finite_exits_3_without_a_checkpoint(tmp_path, xla_cache):
  workdir = tmp_path / "run"
  out = cli(
    "--workdir",
    str(workdir),
    "--cpu_devices",
    "8",
    "--steps",
    "6",
    *SMALL,
    "--set",
    "optimizer.learning_rate=1e30",
    "--set",
    "train.nonfinite=halt",
    cache=xla_cache,
  )
  assert out.returncode == 3, out.stderr[-3000:]
  assert "stopping without a checkpoint (train.nonfinite=halt)" in out.stderr
  assert not [p for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]


def test_a_valid_flag_gets_past_checking(tmp_path, xla_cache):
  """The bad flags and configs are in test_bad_inputs.py; this one is valid."""
  workdir = tmp_path / "run"
  out = cli(
    "--workdir", str(workdir), "--cpu_devices", "8", "--steps", "1", *SMALL, "--profile_steps", "5", cache=xla_cache
  )
  assert out.returncode == 0, out.stderr[-2000:]


def test_missing_workdir_is_an_error():
  out = cli("--cpu_devices", "8")
  assert out.returncode == 2 and "distrib-train: error: --workdir is required." in out.stderr


def test_local_demo_script_trains_then_resumes_at_once(tmp_path, xla_cache):
  """launch/local.sh: 2 processes × 4 devices; run twice, the second is a no-op."""
  env = dict(os.environ, VENV=sys.prefix, WORKDIR=str(tmp_path / "demo"), TIMEOUT="240")
  args = [
    "bash",
    str(ROOT / "launch" / "local.sh"),
    "--steps",
    "6",
    *SMALL,
    "--set",
    "train.eval_every=6",
    "--set",
    f"train.compilation_cache_dir={xla_cache}",
  ]
  first = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
  assert "2 process(es) × 4 device(s) = 8 cpu device(s)" in first.stderr and "eval/loss" in first.stderr
  assert "Finished with status 0" in first.stdout
  second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
  assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
  assert "Step 6 of 6 is already done" in second.stderr


def test_a_dead_process_stops_the_others_with_a_message(tmp_path, xla_cache):
  """kill -9 one of two processes: the survivor exits non-zero, saying why,
  within the heartbeat timeout — it never hangs."""
  workdir = tmp_path / "run"
  port = free_port()
  procs = [
    cli(
      "--workdir",
      str(workdir),
      "--cpu_devices",
      "4",
      "--mesh_config",
      "cpu-2proc",
      "--steps",
      "100000",
      "--coordinator_address",
      f"127.0.0.1:{port}",
      "--num_processes",
      "2",
      "--process_id",
      str(i),
      "--heartbeat_timeout",
      "10",
      *SMALL,
      cache=xla_cache,
      popen=True,
    )
    for i in range(2)
  ]
  try:
    _wait_for_step(workdir, procs[0], 3)
    os.killpg(procs[1].pid, signal.SIGKILL)
    # The survivor stops after the 10 s heartbeat timeout; the limit here only
    # keeps a hang from lasting, it is not the figure under test.
    output, _ = procs[0].communicate(timeout=240)
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert procs[0].returncode != 0
  assert "another process died" in output or "another task died" in output or "process 0 of 2 stopped" in output, (
    output[-3000:]
  )


def test_local_demo_script_help_dry_run_and_bad_input():
  script = str(ROOT / "launch" / "local.sh")
  help_text = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, timeout=30).stdout
  assert "NPROC" in help_text and "--dry-run" in help_text
  env = dict(os.environ, VENV=sys.prefix, NPROC="2", DEVICES="4", WORKDIR="/tmp/w")
  out = subprocess.run(
    ["bash", script, "--dry-run", "--steps", "7"], env=env, capture_output=True, text=True, timeout=30
  )
  lines = out.stdout.strip().splitlines()
  assert out.returncode == 0 and len(lines) == 3, out.stdout  # install + 2 processes
  for i, line in enumerate(lines[1:]):
    assert line.startswith("timeout 900 ") and "-m distrib_train --config tiny --mesh_config cpu-2proc" in line
    assert "--workdir /tmp/w --cpu_devices 4 --steps 7 --coordinator_address 127.0.0.1:PORT" in line
    assert line.rstrip().endswith(f"--num_processes 2 --process_id {i}")
  out = subprocess.run(["bash", script], env=dict(env, NPROC="two"), capture_output=True, text=True, timeout=30)
  assert out.returncode == 2 and "NPROC must be a positive integer, got 'two'" in out.stderr


def test_a_batch_the_mesh_does_not_divide_runs_replicated_when_allowed(tmp_path, xla_cache):
  # data 2 × fsdp 2 = 4 does not divide 6: refused by default (the bad-input
  # catalogue), run replicated when the user says so.
  workdir = tmp_path / "run"
  args = [
    "--workdir",
    str(workdir),
    "--cpu_devices",
    "8",
    "--steps",
    "2",
    *SMALL,
    "--set",
    "data.global_batch_size=6",
    "--set",
    "train.eval_every=0",
  ]
  out = cli(*args, "--set", "data.allow_replicated_batch=true", cache=xla_cache)
  assert out.returncode == 0, out.stderr[-3000:]
  assert sorted(train_losses(workdir)) == [1, 2]
