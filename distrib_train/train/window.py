"""The metrics window: what the loop gathers between two log points.

``MetricsWindow`` holds the finite steps' losses, gradient norms and aux
scalars, the last step's optimizer figures (learning rate, skipped count),
and the clock: steps and seconds since it last restarted, and how long the
loop waited for data (and the malformed documents its loader skipped).
``figures`` turns it into the record a log point writes (means,
throughput, MFU, memory).

Not for: where records go (``metrics.MetricWriter``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from distrib_train.train import metrics as metrics_lib


@dataclasses.dataclass
class MetricsWindow:
  """Steps since the last log point.

  Attributes:
    start: ``time.perf_counter()`` when the clock last restarted.
    steps: steps since then.
    data_wait_s: seconds waited for batches since then.
    losses: the finite steps' losses since the last log point.
    grad_norms: their gradient norms.
    aux: their aux scalars, by name (first seen first).
    last: the last judged step's figures (``learning_rate``, ``skipped``, …).
    counts: the batch source's running counts as of the last batch
      (``BatchSource.counts``: malformed documents skipped, conversations
      longer than a row), logged as ``data/<name>``.
  """

  start: float = dataclasses.field(default_factory=time.perf_counter)
  steps: int = 0
  data_wait_s: float = 0.0
  losses: list[float] = dataclasses.field(default_factory=list)
  grad_norms: list[float] = dataclasses.field(default_factory=list)
  aux: dict[str, list[float]] = dataclasses.field(default_factory=dict)
  last: dict[str, float] = dataclasses.field(default_factory=dict)
  counts: dict[str, int] = dataclasses.field(default_factory=dict)

  def add(self, loss: float, grad_norm: float, aux: Mapping[str, float]) -> None:
    """One finite step's figures."""
    self.losses.append(loss)
    self.grad_norms.append(grad_norm)
    for name, value in aux.items():
      self.aux.setdefault(name, []).append(value)

  def note(self, figures: Mapping[str, float]) -> None:
    """Figures a batch source reports of its batch (an RL objective's rollouts), averaged like the aux."""
    for name, value in figures.items():
      self.aux.setdefault(name, []).append(value)

  def mean(self) -> dict[str, float]:
    """``loss`` and ``grad_norm`` means (when a step was finite), then the aux means."""
    out: dict[str, float] = {}
    if self.losses:
      out["loss"] = float(np.mean(self.losses))
      out["grad_norm"] = float(np.mean(self.grad_norms))
    for name, values in self.aux.items():
      out.setdefault(name, float(np.mean(values)))
    return out

  def restart_clock(self) -> None:
    """Time from now on (after work that is not step time: a save, an evaluation)."""
    self.start, self.steps, self.data_wait_s = time.perf_counter(), 0, 0.0

  def reset(self) -> None:
    """An empty window (after a log point or a rollback); ``last`` is kept."""
    self.restart_clock()
    self.losses, self.grad_norms, self.aux = [], [], {}


def figures(
  window: MetricsWindow,
  *,
  tokens_per_step: int,
  num_devices: int,
  peak_flops: float | None,
  flops_per_token: float | None,
) -> dict[str, Any] | None:
  """The record of a log point, or None when the window has no step."""
  steps = window.steps
  if not steps:
    return None
  step_time = (time.perf_counter() - window.start) / steps
  tokens_per_s = tokens_per_step / step_time
  out: dict[str, Any] = window.mean()
  if "learning_rate" in window.last:
    out["learning_rate"] = window.last["learning_rate"]
  if "skipped" in window.last:
    out["skipped"] = int(window.last["skipped"])
  out.update(
    step_time_ms=step_time * 1e3,
    tokens_per_s=tokens_per_s,
    tokens_per_s_per_device=tokens_per_s / num_devices,
    data_wait_ms=window.data_wait_s / steps * 1e3,
  )
  out.update({f"data/{name}": int(count) for name, count in window.counts.items()})
  if peak_flops and flops_per_token:
    out["mfu"] = flops_per_token * tokens_per_s / (peak_flops * num_devices)
  memory = metrics_lib.memory_in_use(jax.local_devices()[0])
  if memory is not None:
    out["memory_bytes"] = float(memory)
  return out
