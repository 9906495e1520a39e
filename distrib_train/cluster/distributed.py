"""Starting JAX for one process of a job: cluster detection, emulation, topology.

``initialize(...)`` must run before any other JAX call. What it does:

- **Explicit job** (``coordinator_address`` + ``num_processes`` +
  ``process_id``, from arguments or the ``DT_COORDINATOR_ADDRESS``,
  ``DT_NUM_PROCESSES``, ``DT_PROCESS_ID`` environment variables): joins it
  through ``jax.distributed.initialize``. A loopback coordinator listens on
  loopback only.
- **Detected cluster** (nothing given): JAX's own cluster detection — Open
  MPI, SLURM, GKE TPU, Cloud TPU VM, Kubernetes — fills in everything.
  Nothing detected: a single process.
- **SLURM GPU**: one process per GPU is JAX's mapping (``local_device_ids``
  = ``[SLURM_LOCALID]``). For one process per node pass
  ``local_device_ids="all"`` (or set ``DT_LOCAL_DEVICE_IDS=all``): every GPU
  the node shows is used — forgetting it is how jobs end up with one GPU
  per node.
- **CPU emulation** (``cpu_devices``): N devices per process; collectives
  between processes go through gloo.
- Timeouts for joining and for heartbeats (a dead process brings the others
  down after ``heartbeat_timeout`` seconds instead of hanging them).

``topology()`` describes the job in one line (process 0 logs it);
``Preemption`` (``preemption.py``, imported here) tells every process of the job, at the same
iteration, that one of them got SIGTERM (or a TPU maintenance notice).

Not for: building the mesh (``mesh.py``) or launching processes (``launch/``).
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

import jax

from distrib_train.cluster import gpu_environment
from distrib_train.cluster.preemption import Preemption, Terminated  # noqa: F401  (re-exported)

_LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")


@dataclasses.dataclass(frozen=True)
class JobSpec:
  """How this process joins its job (what ``initialize`` decided)."""

  mode: str  # "single", "explicit" or "detected:<cluster>"
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  local_device_ids: tuple[int, ...] | None = None


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"Environment variable {name}={value!r} must be an integer.") from None


def detected_cluster() -> str | None:
  """The cluster JAX's auto-detection would use here (None: none)."""
  try:
    from jax._src import clusters
  except ImportError:  # pragma: no cover - the module moved; then trust jax.distributed
    return None
  for cluster in clusters.ClusterEnv._cluster_types:  # JAX's own detectors, in JAX's order
    try:
      if getattr(cluster, "opt_in_only_method", False):
        continue
      if cluster.is_env_present():
        return cluster.__name__
    except Exception:  # a detector that cannot tell (no metadata server, say) is not this cluster
      continue
  return None


def visible_gpu_ids() -> list[int]:
  """The GPUs this node shows, without starting a JAX backend.

  From ``CUDA_VISIBLE_DEVICES`` (as many as it lists), else SLURM's
  ``SLURM_GPUS_ON_NODE``, else ``nvidia-smi -L``.

  Raises:
    ValueError: no GPUs could be found.
  """
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible:
    return list(range(len([v for v in visible.split(",") if v.strip()])))
  on_node = _env_int("SLURM_GPUS_ON_NODE")
  if on_node:
    return list(range(on_node))
  if shutil.which("nvidia-smi"):
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    if count:
      return list(range(count))
  raise ValueError(
    "local_device_ids='all' but no GPUs were found (CUDA_VISIBLE_DEVICES, SLURM_GPUS_ON_NODE and nvidia-smi show none)."
  )


def use_cpu_devices(count: int, *, name: str = "cpu_devices") -> None:
  """Makes JAX run on ``count`` emulated CPU devices per process; call before any other JAX use.

  Processes this one starts run on CPU too (``JAX_PLATFORMS``). When JAX has
  already started on exactly ``count`` CPU devices, nothing changes.

  Args:
    count: the devices to emulate.
    name: what the caller calls the count (``--devices``), for the error.

  Raises:
    ValueError: ``count`` is below 1, or JAX has already started with other
      devices.
  """
  from jax._src import xla_bridge

  if count < 1:
    raise ValueError(f"{name} must be at least 1, got {count}.")
  if xla_bridge.backends_are_initialized():
    found = jax.devices()
    if len(found) != count or found[0].platform != "cpu":
      raise ValueError(
        f"JAX already runs on {len(found)} {found[0].platform} device(s); emulating {count} CPU"
        " devices must start before any other JAX use (a fresh process)."
      )
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", count)


def initialize(
  *,
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  local_device_ids: Sequence[int] | str | None = None,
  cpu_devices: int | None = None,
  initialization_timeout: int = 300,
  heartbeat_timeout: int = 100,
  auto_detect: bool = True,
) -> JobSpec:
  """Prepares JAX for this process of the job; call it before any JAX use.

  Args:
    coordinator_address: ``host:port`` of process 0's coordinator.
    num_processes: processes in the job.
    process_id: this process's index.
    local_device_ids: devices this process uses (GPU ids), or ``"all"``
      for every GPU on the node (one process per node).
    cpu_devices: run on CPU with this many emulated devices.
    initialization_timeout: seconds to wait for every process to join.
    heartbeat_timeout: seconds without a heartbeat after which a process
      counts as dead and the job stops.
    auto_detect: use JAX's cluster detection when nothing is given.

  Returns:
    What was decided.

  Raises:
    ValueError: an incomplete or inconsistent setup (named), before any
      connection is tried.
  """
  gpu_environment.prepare()  # the GPU client's memory fraction and command buffers, before JAX starts it
  coordinator_address = coordinator_address or os.environ.get("DT_COORDINATOR_ADDRESS") or None
  num_processes = num_processes if num_processes is not None else _env_int("DT_NUM_PROCESSES")
  process_id = process_id if process_id is not None else _env_int("DT_PROCESS_ID")
  if local_device_ids is None and os.environ.get("DT_LOCAL_DEVICE_IDS"):
    local_device_ids = os.environ["DT_LOCAL_DEVICE_IDS"]
  for name, value in (("initialization_timeout", initialization_timeout), ("heartbeat_timeout", heartbeat_timeout)):
    if value < 1:
      raise ValueError(f"{name} must be at least 1 second, got {value}.")
  if cpu_devices is not None:
    use_cpu_devices(cpu_devices)
  if isinstance(local_device_ids, str):
    if local_device_ids == "all":
      local_device_ids = visible_gpu_ids()
    else:
      try:
        local_device_ids = [int(v) for v in local_device_ids.split(",") if v.strip()]
      except ValueError:
        raise ValueError(
          f"local_device_ids must be 'all' or a comma-separated list of ids, got {local_device_ids!r}."
        ) from None
  ids = None if local_device_ids is None else tuple(int(i) for i in local_device_ids)
  timeouts = dict(initialization_timeout=initialization_timeout, heartbeat_timeout_seconds=heartbeat_timeout)

  explicit = [v is not None for v in (coordinator_address, num_processes, process_id)]
  if any(explicit):
    if num_processes == 1 and coordinator_address is None:
      return JobSpec("single")
    if not all(explicit):
      missing = [n for n, given in zip(("coordinator_address", "num_processes", "process_id"), explicit) if not given]
      raise ValueError(
        f"A multi-process job needs coordinator_address, num_processes and process_id; missing"
        f" {', '.join(missing)} (flags or DT_* environment variables)."
      )
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f"process_id {process_id} is outside 0..{num_processes - 1} (num_processes {num_processes}).")
    if ":" not in coordinator_address:
      raise ValueError(f"coordinator_address {coordinator_address!r} must be host:port.")
    host = coordinator_address.rsplit(":", 1)[0]
    bind = coordinator_address if host in _LOOPBACK else None
    jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      local_device_ids=ids,
      coordinator_bind_address=bind,
      **timeouts,
    )
    if bind is not None:
      _cpu_collectives_on_loopback()
    if cpu_devices is not None:
      _drop_gloo_banner()
    return JobSpec("explicit", coordinator_address, num_processes, process_id, ids)
  cluster = detected_cluster() if auto_detect else None
  if cluster is None:
    if ids is not None:
      raise ValueError("local_device_ids only applies to a multi-process job (none was given or detected).")
    return JobSpec("single")
  jax.distributed.initialize(
    local_device_ids=ids, coordinator_bind_address=_single_node_bind_address(cluster), **timeouts
  )
  return JobSpec(f"detected:{cluster}", local_device_ids=ids)


def _cpu_collectives_on_loopback() -> None:
  """Makes gloo (the CPU collectives) listen on 127.0.0.1 in a local job.

  gloo listens on the address the host name resolves to, which is the
  network address on many machines. jax (0.10.2 to 0.11) has no option for
  it, but its CPU client takes a collectives object, and jaxlib's
  ``make_gloo_tcp_collectives`` takes a ``hostname``: the CPU backend is
  registered again (before it starts) with gloo given the loopback address.
  Where those private hooks differ, JAX's default stays.
  """
  try:
    from jax._src import config as jax_config
    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    make_gloo = _jax.make_gloo_tcp_collectives
    if jax_config.cpu_collectives_implementation.value != "gloo":
      return
  except (ImportError, AttributeError):
    return

  def make_cpu_client():
    collectives = make_gloo(distributed_client=jax_distributed.global_state.client, hostname="127.0.0.1")
    return xla_bridge.make_cpu_client(collectives=collectives)

  try:
    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)
  except RuntimeError:  # the CPU backend already started (a jax call came first): JAX's default stays
    pass


# gloo's threads print these concurrently, so two can interleave mid-line
# ("[Gloo] Rank [Gloo] Rank 1 is connected …" then "1 is connected …"): a
# line with either piece is one of them.
_GLOO_BANNER = re.compile(rb"\[Gloo\] Rank |Expected number of connected peer ranks is : ")


def _drop_gloo_banner() -> None:
  """Keeps gloo's "[Gloo] Rank i is connected to n peer ranks" lines off stdout.

  gloo's C++ code prints one for every communicator it opens (15 in a short
  2-process run) straight to file descriptor 1, which no logging setting
  reaches. Descriptor 1 becomes a pipe that a thread copies to the real
  stdout, less those lines; at exit the real stdout is put back, which ends
  the thread once it has copied everything.
  """
  sys.stdout.flush()
  read_fd, write_fd = os.pipe()
  real_stdout = os.dup(1)
  os.dup2(write_fd, 1)
  os.close(write_fd)

  def copy() -> None:
    with os.fdopen(read_fd, "rb") as lines:
      for line in lines:
        if not _GLOO_BANNER.search(line):
          os.write(real_stdout, line)

  thread = threading.Thread(target=copy, name="gloo-banner-filter", daemon=True)
  thread.start()

  def restore() -> None:
    sys.stdout.flush()
    os.dup2(real_stdout, 1)  # closes the pipe's last write end: the thread reads to its end
    thread.join(timeout=5)

  atexit.register(restore)


def _single_node_bind_address(cluster: str) -> str | None:
  """Where the coordinator of a one-node SLURM job listens: the address its host
  name resolves to, not every interface (JAX's default, right for many nodes).

  Every process of a one-node job resolves the coordinator's name on the same
  machine, so the resolved address is the one they all connect to.
  """
  if cluster != "SlurmCluster" or os.environ.get("SLURM_JOB_NUM_NODES", os.environ.get("SLURM_NNODES")) != "1":
    return None
  try:
    from jax._src import clusters

    slurm = next(c for c in clusters.ClusterEnv._cluster_types if c.__name__ == cluster)
    host, port = slurm.get_coordinator_address(timeout_secs=None, override_coordinator_port=None).rsplit(":", 1)
    return f"{socket.gethostbyname(host)}:{port}"
  except Exception:  # JAX moved things, or the name does not resolve: keep JAX's default
    return None


def topology() -> str:
  """One line: processes, devices per process, device kind, slices."""
  devices = jax.devices()
  per_process = len(jax.local_devices())
  kinds = sorted({d.device_kind for d in devices})
  slices = {getattr(d, "slice_index", None) for d in devices} - {None}
  line = (
    f"{jax.process_count()} process(es) × {per_process} device(s) = {len(devices)} {'/'.join(kinds)}"
    f" device(s), platform {devices[0].platform}"
  )
  if len(slices) > 1:
    line += f", {len(slices)} slices"
  return line


def is_multiprocess() -> bool:
  return jax.process_count() > 1


_barrier_ids = itertools.count()


def wait_for_every_process(what: str, timeout_s: int = 1800) -> None:
  """A barrier on JAX's coordination service, which waits as long as it takes.

  Process 0 loads the step from the persistent compilation cache while the
  others may compile it (JAX writes the cache from process 0 only; on CPU the
  other processes' keys differ), and the first step's collectives wait only
  30 s for a late process (gloo's rendezvous) before failing the job.
  """
  if jax.process_count() == 1:
    return
  import orbax.checkpoint as ocp

  ocp.multihost.sync_global_processes(
    f"distrib_train: {what} #{next(_barrier_ids)}", timeout=timeout_s, processes=set(range(jax.process_count()))
  )
