"""Accelerator figures for planning: memory, peak FLOP/s, interconnect bandwidths.

One ``DeviceKind`` per chip the planner knows (``distrib-train plan
--device_kind``). Figures are per device — one TPU chip, one GPU — and come
from the vendors' public spec sheets (each noted beside it); where a sheet
gives none, the figure is an assumption and says so.

Bandwidths are what one collective can use per device, in one direction:

- ``ici_bandwidth``: TPU, the pod's all-reduce bandwidth divided by its chips
  (the same as the per-chip "interchip interconnect BW" Google lists); GPU,
  half the NVLink bidirectional figure.
- ``dcn_bandwidth``: between granules (TPU slices, GPU hosts): the per-chip
  share of the data-center network, or one GPU's InfiniBand NIC.

The one table of peak FLOP/s: the MFU the trainer logs reads it too
(``kind_of_device`` maps a running device's reported kind onto it).

Not for: the step-time model itself (``podplan/timing.py``).
"""

from __future__ import annotations

import dataclasses

GiB = 1 << 30
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class DeviceKind:
  """One accelerator's figures.

  Attributes:
    name: the ``--device_kind`` name.
    description: what it is, for reports.
    platform: ``tpu`` or ``gpu``.
    memory_bytes: device memory (HBM).
    usable_fraction: the share of it a JAX process gets by default on this
      platform (GPU: ``XLA_PYTHON_CLIENT_MEM_FRACTION``).
    peak_flops: dense bf16 FLOP/s.
    hbm_bandwidth: bytes/s.
    ici_bandwidth: bytes/s per device for collectives inside a granule.
    dcn_bandwidth: bytes/s per device for collectives across granules.
    devices_per_host: devices one host (process) drives; a GPU granule.
    max_slice: devices one ICI domain can hold (TPU slice, GPU NVLink host).
  """

  name: str
  description: str
  platform: str
  memory_bytes: int
  usable_fraction: float
  peak_flops: float
  hbm_bandwidth: float
  ici_bandwidth: float
  dcn_bandwidth: float
  devices_per_host: int
  max_slice: int


# GPU memory fraction the presets are tuned at: the trainer (cluster/gpu_environment.py), launch/slurm_gpu.sbatch
# and the benchmarks set XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 unless it is set (jax's own default is 0.75).
GPU_MEMORY_FRACTION = 0.92
_GPU_FRACTION = GPU_MEMORY_FRACTION

DEVICE_KINDS: dict[str, DeviceKind] = {
  k.name: k
  for k in (
    DeviceKind(
      "v4",
      "Cloud TPU v4 chip",
      "tpu",
      memory_bytes=32 * GiB,  # cloud.google.com/tpu/docs/v4: HBM2 32 GiB, 1200 GBps
      usable_fraction=1.0,
      peak_flops=275e12,  # same page: 275 TFLOPs bf16 per chip
      hbm_bandwidth=1200e9,
      ici_bandwidth=1.1e15 / 4096,  # same page: all-reduce bandwidth per pod 1.1 PB/s, 4096 chips
      dcn_bandwidth=3.125e9,  # not published; assumed equal to v5e's per-chip share
      devices_per_host=4,
      max_slice=4096,
    ),
    DeviceKind(
      "v5e",
      "Cloud TPU v5e chip",
      "tpu",
      memory_bytes=16 * GiB,  # cloud.google.com/tpu/docs/v5e: HBM2 16 GB, 819 GBps
      usable_fraction=1.0,
      peak_flops=197e12,  # same page: 197 TFLOPs bf16 per chip
      hbm_bandwidth=819e9,
      ici_bandwidth=200e9,  # same page: ICI 1600 Gbps per chip; all-reduce 51.2 TB/s / 256
      dcn_bandwidth=6.4e12 / 8 / 256,  # same page: data-center network 6.4 Tbps per 256-chip pod
      devices_per_host=8,
      max_slice=256,
    ),
    DeviceKind(
      "v5p",
      "Cloud TPU v5p chip",
      "tpu",
      memory_bytes=95 * GiB,  # cloud.google.com/tpu/docs/v5p: HBM2e 95 GB, 2765 GBps
      usable_fraction=1.0,
      peak_flops=459e12,  # same page: 459 TFLOPs bf16 per chip
      hbm_bandwidth=2765e9,
      ici_bandwidth=4800e9 / 8,  # same page: interchip interconnect BW 4800 Gbps
      dcn_bandwidth=6.25e9,  # not published; assumed 2 × 100 Gbps per 4-chip host
      devices_per_host=4,
      max_slice=8960,
    ),
    DeviceKind(
      "v6e",
      "Cloud TPU v6e (Trillium) chip",
      "tpu",
      memory_bytes=32 * GiB,  # cloud.google.com/tpu/docs/v6e: HBM 32 GB, 1638 GBps
      usable_fraction=1.0,
      peak_flops=918e12,  # same page: 918 TFLOPs bf16 per chip
      hbm_bandwidth=1638e9,
      ici_bandwidth=102.4e12 / 256,  # same page: all-reduce bandwidth per pod 102.4 TB/s, 256 chips
      dcn_bandwidth=6.25e9,  # not published; assumed 4 × 100 Gbps per 8-chip host
      devices_per_host=8,
      max_slice=256,
    ),
    DeviceKind(
      "a100",
      "NVIDIA A100 SXM 80GB",
      "gpu",
      memory_bytes=81920 * MiB,  # NVIDIA A100 datasheet: 80 GB HBM2e, 2039 GB/s
      usable_fraction=_GPU_FRACTION,
      peak_flops=312e12,  # same: BF16 Tensor Core 312 TFLOPS dense
      hbm_bandwidth=2039e9,
      ici_bandwidth=600e9 / 2,  # same: NVLink 600 GB/s (both directions)
      dcn_bandwidth=200e9 / 8,  # DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU
      devices_per_host=8,
      max_slice=8,
    ),
    DeviceKind(
      "h100",
      "NVIDIA H100 SXM 80GB",
      "gpu",
      memory_bytes=81559 * MiB,  # NVIDIA H100 datasheet: 80 GB HBM3 (nvidia-smi: 81559 MiB), 3.35 TB/s
      usable_fraction=_GPU_FRACTION,
      peak_flops=989e12,  # same: BF16 Tensor Core 989 TFLOPS dense (1979 with sparsity)
      hbm_bandwidth=3.35e12,
      ici_bandwidth=900e9 / 2,  # same: NVLink 900 GB/s (both directions)
      dcn_bandwidth=400e9 / 8,  # DGX H100: one 400 Gb/s NDR InfiniBand NIC per GPU
      devices_per_host=8,
      max_slice=8,
    ),
    DeviceKind(
      "h100-pcie",
      "NVIDIA H100 PCIe 80GB",
      "gpu",
      memory_bytes=81559 * MiB,  # NVIDIA H100 datasheet: 80 GB HBM2e, 2 TB/s (size as the SXM's)
      usable_fraction=_GPU_FRACTION,
      peak_flops=756e12,  # same: BF16 Tensor Core 756 TFLOPS dense (1513 with sparsity)
      hbm_bandwidth=2.0e12,
      ici_bandwidth=600e9 / 2,  # same: NVLink bridge 600 GB/s (both directions), GPU pairs
      dcn_bandwidth=400e9 / 8,  # not published; assumed one 400 Gb/s NIC per GPU, as DGX H100
      devices_per_host=8,
      max_slice=2,
    ),
    DeviceKind(
      "h200",
      "NVIDIA H200 SXM 141GB",
      "gpu",
      memory_bytes=143771 * MiB,  # NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s
      usable_fraction=_GPU_FRACTION,
      peak_flops=989e12,  # same: BF16 Tensor Core 989 TFLOPS dense
      hbm_bandwidth=4.8e12,
      ici_bandwidth=900e9 / 2,  # same: NVLink 900 GB/s (both directions)
      dcn_bandwidth=400e9 / 8,  # HGX H200: one 400 Gb/s InfiniBand NIC per GPU
      devices_per_host=8,
      max_slice=8,
    ),
  )
}


# What JAX reports as a device's ``device_kind`` (lower-cased) → the kind it is.
# The first pattern contained in the reported name wins.
_REPORTED_AS: tuple[tuple[str, str], ...] = (
  ("tpu v6 lite", "v6e"),
  ("tpu v6e", "v6e"),
  ("tpu v5 lite", "v5e"),
  ("tpu v5e", "v5e"),
  ("tpu v5p", "v5p"),
  ("tpu v5", "v5p"),  # v5p reports "TPU v5"
  ("tpu v4", "v4"),
  ("h200", "h200"),
  ("h100 pcie", "h100-pcie"),
  ("h100", "h100"),
  ("a100", "a100"),
)


def kind_of_device(reported: str) -> DeviceKind | None:
  """The kind of a running device from its ``device.device_kind`` (``NVIDIA
  H100 80GB HBM3`` → h100, ``TPU v5 lite`` → v5e); None where unknown (CPU)."""
  text = str(reported).lower()
  for pattern, name in _REPORTED_AS:
    if pattern in text:
      return DEVICE_KINDS[name]
  return None


def device_kind(name: str) -> DeviceKind:
  """The figures for ``name`` (``h100``, ``v5e``, …; case and a ``tpu-`` prefix ignored).

  Raises:
    ValueError: an unknown kind; the message lists the known ones.
  """
  key = str(name).strip().lower().removeprefix("tpu-").removeprefix("tpu")
  if key in DEVICE_KINDS:
    return DEVICE_KINDS[key]
  raise ValueError(f"Unknown device kind {name!r}; known: {', '.join(DEVICE_KINDS)}.")


def guess_device_kind(*names: str) -> DeviceKind | None:
  """The kind a mesh-config or preset name mentions (``tpu-v5e-256`` → v5e), if any."""
  for name in names:
    text = str(name or "").lower()
    for key in ("v5e", "v5p", "v6e", "v4", "h200", "h100", "a100"):
      if key in text:
        return DEVICE_KINDS[key]
  return None
