"""Starting JAX: CPU emulation and the multi-process runtime.

``initialize(...)`` must run before any other JAX call. It sets the number
of emulated CPU devices (``cpu_devices``) and, for a job of several
processes, joins JAX's distributed runtime (``jax.distributed.initialize``:
a coordinator at ``coordinator_address``, gloo collectives on CPU).
"""

from __future__ import annotations

import os

import jax


def initialize(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    cpu_devices: int | None = None,
) -> None:
  """Prepares JAX for this process of the job.

  Args:
    coordinator_address: ``host:port`` of process 0's coordinator; with
      ``num_processes`` > 1.
    num_processes: processes in the job (None or 1: a single process).
    process_id: this process's index.
    cpu_devices: emulate this many CPU devices (and run on CPU).

  Raises:
    ValueError: an incomplete multi-process setup (named).
  """
  if cpu_devices is not None:
    if cpu_devices < 1:
      raise ValueError(f"cpu_devices must be at least 1, got {cpu_devices}.")
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  if num_processes is None or num_processes == 1:
    return
  missing = [name for name, value in (("coordinator_address", coordinator_address), ("process_id", process_id))
             if value is None]
  if missing:
    raise ValueError(f"A job of {num_processes} processes needs {' and '.join(missing)}.")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id {process_id} is outside 0..{num_processes - 1}.")
  host = coordinator_address.rsplit(":", 1)[0]
  # A loopback coordinator (one machine) listens on loopback only.
  bind = coordinator_address if host in ("127.0.0.1", "localhost", "[::1]") else None
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, coordinator_bind_address=bind)


def is_multiprocess() -> bool:
  return jax.process_count() > 1
