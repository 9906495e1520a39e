"""launch/slurm_gpu.sbatch on a real SLURM (CPU variant: 2 tasks × 2 devices)."""

import json
import pathlib
import subprocess
import sys

import pytest

# The cluster may wait for another test run's SLURM on this machine (up to
# 240 s, see slurm_cluster.py) before its job's own 400 s.
pytestmark = pytest.mark.timeout(900)

from slurm_cluster import SlurmCluster

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "slurm_gpu.sbatch"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
  reason = SlurmCluster.unavailable()
  if reason:
    pytest.skip(f"no SLURM here: {reason}")
  cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
  try:
    cluster.start()
  except (RuntimeError, subprocess.SubprocessError, OSError) as e:
    cluster.stop()
    pytest.skip(f"the SLURM daemons cannot run on this machine: {e}")
  yield cluster
  cluster.stop()


def test_two_process_training_job_through_the_real_sbatch_script(slurm, tmp_path, xla_cache):
  # Submitted as the README's CPU example is from an ordinary shell: without
  # XLA_FLAGS (conftest sets one in this process; the script must not need it).
  mesh = tmp_path / "mesh-2x2.yaml"
  mesh.write_text(
    "devices: 4\ngranules: 2\naxes:\n  data: {ici: 1, dcn: 2}\n  fsdp: {ici: 2}\n  tensor: 1\nrules: fsdp_tensor\n"
  )
  workdir, log = tmp_path / "run", tmp_path / "job.out"
  out = slurm.sbatch(
    "--ntasks=2",
    "--nodes=1",
    f"--output={log}",
    "--export=ALL,CPU_DEVICES=2,PYTHON=" + sys.executable,
    str(SCRIPT),
    "--config",
    "tiny",
    "--mesh_config",
    str(mesh),
    "--workdir",
    str(workdir),
    "--steps",
    "4",
    "--set",
    "data.seq_len=32",
    "--set",
    "data.global_batch_size=8",
    "--set",
    "train.log_every=2",
    "--set",
    "train.eval_batches=1",
    "--set",
    f"train.compilation_cache_dir={xla_cache}",
    timeout=400,
    unset=("XLA_FLAGS",),
  )
  job_log = log.read_text() if log.exists() else "(no job log)"
  assert out.returncode == 0, f"{out.stdout}\n{out.stderr}\n{job_log[-4000:]}\n{slurm.logs()}"
  assert "2 process(es) × 2 device(s) = 4 cpu device(s)" in job_log, job_log[-3000:]
  assert "on 1 node(s)" in job_log and "2 task(s)" in job_log
  # Both processes' rows' data positions, kept in the checkpoint's metadata by process 0.
  saved_meta = json.loads((workdir / "checkpoints" / "4" / "meta" / "metadata").read_text())
  assert saved_meta["process_count"] == 2 and len(saved_meta["data_position"]["lanes"]) == 8
  assert "Done: step 4" in job_log


def test_script_refuses_bad_input_and_dry_runs_outside_slurm(tmp_path):
  run = lambda *a, **env: subprocess.run(
    ["bash", str(SCRIPT), *a], capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin", **env}
  )
  out = run()
  assert out.returncode == 2 and "no trainer arguments" in out.stderr
  out = run("--config", "tiny")
  assert out.returncode == 2 and "--workdir is required" in out.stderr
  out = run("--config", "tiny", "--workdir", "/x", CPU_DEVICES="two")
  assert out.returncode == 2 and "CPU_DEVICES must be a number" in out.stderr
  out = run("--config", "tiny", "--workdir", "/x")
  assert out.returncode == 2 and "not inside a SLURM job" in out.stderr
  assert "Environment:" in run("--help").stdout
  out = run("--config", "tiny", "--workdir", "/x", DRY_RUN="1", PER_NODE="1", SLURM_JOB_NUM_NODES="2")
  assert out.returncode == 0
  assert (
    "srun --kill-on-bad-exit=1 --unbuffered --ntasks-per-node=1 --ntasks=2 python3 -u -m distrib_train"
    " --config tiny --workdir /x --local_device_ids all"
  ) in out.stdout
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in out.stdout
  out = run("--dry-run", "--config", "tiny", "--workdir", "/x", CPU_DEVICES="2")
  assert "--cpu_devices 2" in out.stdout and "xla_gpu" not in out.stdout
