"""distributed.initialize: the choices it makes and the mistakes it names
(a real multi-process join is in test_cli, test_multiprocess and test_slurm)."""

import pytest

from distrib_train.cluster import distributed


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
  for name in (
    "DT_COORDINATOR_ADDRESS",
    "DT_NUM_PROCESSES",
    "DT_PROCESS_ID",
    "DT_LOCAL_DEVICE_IDS",
    "CUDA_VISIBLE_DEVICES",
    "SLURM_GPUS_ON_NODE",
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "OMPI_MCA_orte_hnp_uri",
  ):
    monkeypatch.delenv(name, raising=False)


def test_nothing_given_and_no_cluster_is_a_single_process():
  assert distributed.detected_cluster() is None
  assert distributed.initialize() == distributed.JobSpec("single")
  assert distributed.initialize(num_processes=1) == distributed.JobSpec("single")


def test_slurm_is_detected_by_jax_own_detector(monkeypatch):
  for name, value in (
    ("SLURM_JOB_ID", "7"),
    ("SLURM_STEP_NODELIST", "node[1-2]"),
    ("SLURM_NTASKS", "2"),
    ("SLURM_PROCID", "0"),
    ("SLURM_LOCALID", "0"),
  ):
    monkeypatch.setenv(name, value)
  assert distributed.detected_cluster() == "SlurmCluster"


@pytest.mark.parametrize(
  "kwargs, env, message",
  [
    (dict(num_processes=2), {}, "missing coordinator_address, process_id"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), {}, "process_id 2 is outside 0..1"),
    (dict(coordinator_address="host", num_processes=2, process_id=0), {}, "must be host:port"),
    (dict(), {"DT_NUM_PROCESSES": "2", "DT_PROCESS_ID": "0"}, "missing coordinator_address"),
    (dict(), {"DT_NUM_PROCESSES": "two"}, "DT_NUM_PROCESSES='two' must be an integer"),
    (dict(heartbeat_timeout=0), {}, "heartbeat_timeout must be at least 1 second"),
    (dict(local_device_ids="0,x"), {}, "comma-separated list of ids"),
    (dict(local_device_ids=[0, 1]), {}, "local_device_ids only applies to a multi-process job"),
  ],
)
def test_mistakes_are_named_before_connecting(monkeypatch, kwargs, env, message):
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=message):
    distributed.initialize(**kwargs)


def test_all_local_gpus(monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
  assert distributed.visible_gpu_ids() == [0, 1, 2]
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
  monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
  assert distributed.visible_gpu_ids() == list(range(8))
  monkeypatch.delenv("SLURM_GPUS_ON_NODE")
  monkeypatch.setenv("PATH", "/nonexistent")
  with pytest.raises(ValueError, match="no GPUs were found"):
    distributed.visible_gpu_ids()


def test_topology_line():
  assert distributed.topology() == "1 process(es) × 8 device(s) = 8 cpu device(s), platform cpu"


def test_a_one_node_slurm_coordinator_listens_on_its_resolved_address_only(monkeypatch):
  monkeypatch.setenv("SLURM_JOB_ID", "4096")
  monkeypatch.setenv("SLURM_STEP_NODELIST", "localhost")
  monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
  bind = distributed._single_node_bind_address("SlurmCluster")
  assert bind == f"127.0.0.1:{4096 % 2**12 + 65535 - 2**12 + 1}"
  monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")  # several nodes: JAX's default (every interface)
  assert distributed._single_node_bind_address("SlurmCluster") is None
  assert distributed._single_node_bind_address("GkeTpuCluster") is None


def test_gloo_banner_lines_are_dropped_from_stdout_and_the_rest_kept():
  import subprocess
  import sys

  code = (
    "import os, sys\n"
    "from distrib_train.cluster import distributed\n"
    "distributed._drop_gloo_banner()\n"
    "print('before', flush=True)\n"
    "os.write(1, b'[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\\n')\n"
    "os.write(1, b'[Gloo] Rank [Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer"
    " ranks is : 3\\n1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\\n')\n"
    "os.write(1, b'[Gloo] something else\\n')\n"
    "print('after')\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout == "before\n[Gloo] something else\nafter\n"
