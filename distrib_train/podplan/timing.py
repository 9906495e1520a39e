"""The step-time model of a planned step: FLOPs and bytes on the wire → seconds and MFU.

The model, stated once:

  compute = matmul FLOPs per device of the compiled program (loop bodies
            × trip counts, recomputation included) / (peak × efficiency)
  ici     = bytes each device sends over ICI per step (ring model) / ICI bandwidth
  dcn     = the same over DCN / DCN bandwidth
  step    = compute + ici + dcn          (no overlap: an upper bound)
  MFU     = model FLOPs per device (PaLM: 6·N + 12·L·H·S per token) / (step × peak)

``efficiency`` (default 0.6) is the share of peak the matmuls reach; 0.6 is
what the 1b preset measures on one H100 (59.9 % MFU, bench/RESULTS.md).
Device figures are in ``cluster/hardware.py``.

Not for: counting the FLOPs or bytes (``hlo.py``, ``collectives.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from distrib_train.cluster import hardware

DEFAULT_EFFICIENCY = 0.6


@dataclasses.dataclass(frozen=True)
class StepTime:
  """The step-time model's terms (module docstring), in seconds."""

  model_flops_per_device: float | None
  matmul_flops_per_device: float
  xla_flops_per_device: float | None
  compute_s: float
  ici_s: float
  dcn_s: float
  peak_flops: float

  @property
  def step_s(self) -> float:
    return self.compute_s + self.ici_s + self.dcn_s

  @property
  def mfu(self) -> float | None:
    if not self.model_flops_per_device or not self.step_s:
      return None
    return self.model_flops_per_device / (self.step_s * self.peak_flops)


def step_time(
  model_flops_per_device: float | None,
  matmul_flops_per_device: float,
  wire: Mapping[str, float],
  kind: hardware.DeviceKind,
  efficiency: float,
  xla_flops: float | None = None,
) -> StepTime:
  flops = matmul_flops_per_device or model_flops_per_device or 0.0
  return StepTime(
    model_flops_per_device,
    matmul_flops_per_device,
    xla_flops,
    flops / (kind.peak_flops * efficiency),
    wire.get("ici", 0.0) / kind.ici_bandwidth,
    wire.get("dcn", 0.0) / kind.dcn_bandwidth,
    kind.peak_flops,
  )


def xla_flops(compiled: Any) -> float | None:
  """XLA's own FLOP count of a compiled program, where the backend reports it."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # not every backend reports it
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return float(cost["flops"]) if cost and "flops" in cost else None
