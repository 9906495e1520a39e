"""A harness for real multi-process JAX tests on CPU.

``run_workers(script, ...)`` starts N Python processes on this machine, each
with K emulated CPU devices, joined by ``jax.distributed`` through a
coordinator on 127.0.0.1 at a free port (gloo collectives). It enforces a hard
timeout, stops every process as soon as one fails (the others would otherwise
wait for it until their heartbeat timeout), and on failure raises an
``AssertionError`` carrying the tail of every process's output.

A worker script calls ``worker_init()`` first and may ``write_result(obj)``;
the harness returns each process's result in process order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import xla_test_flags

_TESTS_DIR = pathlib.Path(__file__).resolve().parent


def free_port() -> int:
  """A port free now, below the kernel's ephemeral range: the job binds it seconds later, after its start-up, and
  meanwhile every bind to port 0 (gloo's listeners, the other xdist worker's jobs) lands in that range only."""
  try:
    low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
  except (OSError, ValueError, IndexError):
    low = 32768
  # Each xdist worker its own ports (gw0 even, gw1 odd with two), at random (not the tests' seeded generator).
  worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
  workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
  first = max(1024, low - 12000)
  ports = range(first + (worker - first) % workers, low, workers)
  pick = random.SystemRandom()
  for _ in range(200 if len(ports) >= 100 else 0):  # a machine whose ephemeral range starts low: port 0 below
    port = pick.choice(ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      try:
        s.bind(("127.0.0.1", port))
        return port
      except OSError:
        continue
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a machine using all of those: any free port
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class WorkerResult:
  process_id: int
  returncode: int
  output: str
  result: Any


def _tail(text: str, lines: int = 40) -> str:
  return "\n".join(text.splitlines()[-lines:])


def run_workers(
  script: str | os.PathLike,
  *args: str,
  num_processes: int = 2,
  devices_per_process: int = 4,
  timeout: float = 180.0,
  env: dict[str, str] | None = None,
) -> list[WorkerResult]:
  """Runs ``script`` in ``num_processes`` coordinated JAX processes.

  Raises:
    AssertionError: a process failed or the timeout passed; the message
      holds every process's exit status and output tail.
  """
  port = free_port()
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="mp_workers_"))
  procs, logs = [], []
  for i in range(num_processes):
    proc_env = dict(os.environ)
    proc_env.update(env or {})
    proc_env.update(
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=xla_test_flags.with_device_count(devices_per_process),
      PYTHONPATH=os.pathsep.join(filter(None, [str(_TESTS_DIR), proc_env.get("PYTHONPATH", "")])),
      DT_TEST_COORDINATOR=f"127.0.0.1:{port}",
      DT_TEST_NUM_PROCESSES=str(num_processes),
      DT_TEST_PROCESS_ID=str(i),
      DT_TEST_RESULT=str(workdir / f"result_{i}.json"),
    )
    log = open(workdir / f"output_{i}.log", "w+")
    logs.append(log)
    procs.append(
      subprocess.Popen(
        [sys.executable, str(script), *args],
        env=proc_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
      )
    )

  deadline = time.monotonic() + timeout
  failure = None
  while True:
    codes = [p.poll() for p in procs]
    if all(c is not None for c in codes):
      if any(codes):
        failure = "a process exited with an error"
      break
    if any(c not in (None, 0) for c in codes):
      failure = "a process exited with an error; the others were stopped"
      break
    if time.monotonic() > deadline:
      failure = f"timed out after {timeout:.0f} s"
      break
    time.sleep(0.1)

  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()

  results = []
  for i, (p, log) in enumerate(zip(procs, logs)):
    log.seek(0)
    output = log.read()
    log.close()
    result_file = workdir / f"result_{i}.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    results.append(WorkerResult(i, p.returncode, output, result))

  if failure:
    details = "\n".join(f"--- process {r.process_id} (exit {r.returncode}) ---\n{_tail(r.output)}" for r in results)
    raise AssertionError(f"Multi-process run of {pathlib.Path(script).name} {failure}.\n{details}")
  return results


def worker_init(initialization_timeout: int = 60, heartbeat_timeout_seconds: int = 30) -> None:
  """Joins the job (call first thing in a worker, before any other JAX call)."""
  import jax

  coordinator = os.environ["DT_TEST_COORDINATOR"]
  jax.distributed.initialize(
    coordinator_address=coordinator,
    num_processes=int(os.environ["DT_TEST_NUM_PROCESSES"]),
    process_id=int(os.environ["DT_TEST_PROCESS_ID"]),
    coordinator_bind_address=coordinator,
    initialization_timeout=initialization_timeout,
    heartbeat_timeout_seconds=heartbeat_timeout_seconds,
  )


def write_result(obj: Any) -> None:
  """Records this process's result for the harness (JSON)."""
  pathlib.Path(os.environ["DT_TEST_RESULT"]).write_text(json.dumps(obj))
