"""XLA's CUDA compiler on a host without a GPU: compile-only GPU devices for a described card.

With JAX's CUDA plugin installed (``pip install 'jax[cuda12]'``; the two
plugin wheels ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` are enough to
compile, without NVIDIA's libraries), ``devices(target)`` asks it for
compile-only devices (``jax.experimental.topologies.get_topology_desc(
platform="cuda", target_config=…, topology="1x<hosts>x<per host>")``) from a
description of the card (``GpuTargetConfigProto``: SMs, shared memory, L2,
clock, compute capability, memory). A step compiled on a mesh of them is the
GPU compiler's own program: its ``memory_analysis()``, collectives and FLOPs.
Nothing runs.

What it cannot see: without a GPU, XLA cannot autotune its matmuls (it
picks Triton GEMMs where a real card may pick cuBLAS: temporaries can
differ), and without NVIDIA's cuDNN library it cannot build cuDNN attention
(``estimate.py`` then plans the model's cuDNN attention with the query-chunked
stand-in of the same memory profile, ``cpu_attention.py``).

Not for: TPU topologies (``tpu.py``), the cards' figures
(``cluster/hardware.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from distrib_train.cluster import hardware

# Per card: SMs, compute capability, shared memory per SM and per block (opt-in), L2 bytes, boost clock GHz,
# FP32 lanes per SM — NVIDIA's H100 / H200 / A100 datasheets and CUDA programming guide (compute capability
# tables); memory and bandwidth come from cluster/hardware.py.
_CARDS = {
  "h100": (132, (9, 0), 233472, 232448, 50 * hardware.MiB, 1.98, 128, "NVIDIA H100 80GB HBM3"),
  "h200": (132, (9, 0), 233472, 232448, 50 * hardware.MiB, 1.98, 128, "NVIDIA H200"),
  "h100-pcie": (114, (9, 0), 233472, 232448, 50 * hardware.MiB, 1.755, 128, "NVIDIA H100 PCIe"),
  "a100": (108, (8, 0), 167936, 166912, 40 * hardware.MiB, 1.41, 64, "NVIDIA A100-SXM4-80GB"),
}


def available() -> bool:
  """Whether JAX's CUDA plugin is installed (its compiler can be used without a GPU)."""
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except (ImportError, ValueError):
    return False


def install_hint() -> str:
  import jax

  return (
    f"pip install jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__} (about 180 MB; the"
    " compiler needs no GPU), or the full jax[cuda12]"
  )


CUDA_RUNTIME = (12, 8)


def target_config(kind: hardware.DeviceKind) -> str:
  """The card as XLA's ``GpuTargetConfigProto`` (text format).

  Raises:
    ValueError: a card the table does not describe.
  """
  if kind.name not in _CARDS:
    raise ValueError(f"no compiler description of {kind.name} GPUs; known: {', '.join(_CARDS)}.")
  sms, (major, minor), shared_per_sm, shared_per_block, l2, clock, fpus, name = _CARDS[kind.name]
  return (
    "gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152"
    f" shared_memory_per_core: {shared_per_sm} threads_per_core_limit: 2048 core_count: {sms}"
    f" fpus_per_core: {fpus} block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535"
    f" memory_bandwidth: {int(kind.hbm_bandwidth)} l2_cache_size: {l2} clock_rate_ghz: {clock}"
    f" device_memory_size: {kind.memory_bytes} shared_memory_per_block_optin: {shared_per_block}"
    f" cuda_compute_capability {{ major: {major} minor: {minor} }} registers_per_core_limit: 65536"
    f' registers_per_block_limit: 65536 }} platform_name: "CUDA" device_description_str: "{name}"'
    # The CUDA runtime of JAX's cuda12 wheels. Without one XLA assumes none: it then builds no FP8 cuBLASLt
    # GEMMs, so a program with FP8 matmuls would not be the one a card runs.
    f" runtime_version {{ major: {CUDA_RUNTIME[0]} minor: {CUDA_RUNTIME[1]} }}"
  )


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """``devices`` GPUs of one kind, ``per_host`` to a host."""

  kind: hardware.DeviceKind
  devices: int
  per_host: int

  def __str__(self) -> str:
    hosts = self.devices // self.per_host
    return f"{self.devices} × {self.kind.name}" + (f" ({hosts} hosts × {self.per_host})" if hosts > 1 else "")


_NOISE = re.compile(rb"cudart_stub\.cc|All log messages before absl::InitializeLog")


@contextlib.contextmanager
def _plugin_noise_dropped() -> Iterator[None]:
  """Keeps the plugin's "Could not find cuda drivers on your machine" lines (and absl's preamble) off stderr
  while it makes the devices.

  They are written to file descriptor 2 by C++ before any logging setting
  applies: descriptor 2 goes to a file meanwhile, and what else it holds is
  written back. (The plugin writes the same line once more when ``import
  jax`` loads it, before any of this package's code runs.)
  """
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      for line in captured:
        if not _NOISE.search(line):
          os.write(2, line)


@functools.lru_cache(maxsize=8)
def _devices(kind_name: str, devices: int, per_host: int) -> tuple[Any, ...]:
  from jax.experimental import topologies

  kind = hardware.device_kind(kind_name)
  description = topologies.get_topology_desc(
    platform="cuda", target_config=target_config(kind), topology=f"1x{devices // per_host}x{per_host}"
  )
  return tuple(description.devices)


def devices(target: GpuTarget) -> list[Any]:
  """Compile-only devices for ``target``, host by host.

  Raises:
    ValueError: the plugin is missing or refuses (its message, named).
  """
  if not available():
    raise ValueError(f"compiling for {target} without GPUs needs JAX's CUDA plugin: {install_hint()}.")
  per_host = min(target.per_host, target.devices)
  if target.devices % per_host:
    raise ValueError(f"{target.devices} GPUs do not fill hosts of {per_host}.")
  try:
    with _plugin_noise_dropped():
      return list(_devices(target.kind.name, target.devices, per_host))
  except Exception as e:  # the plugin's errors are JaxRuntimeErrors with its own text
    if isinstance(e, ValueError) and not type(e).__module__.startswith("jax"):
      raise
    raise ValueError(
      f"JAX's CUDA plugin does not make compile-only devices for {target}: {str(e).splitlines()[0] if str(e) else e!r}"
    ) from None
