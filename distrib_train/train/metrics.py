"""Throughput, MFU and where metrics go.

- ``peak_flops(device)``: bf16 dense peak FLOP/s of one device, read from
  the device table (``cluster/hardware.py``: TPU v4 / v5e / v5p / v6e,
  A100, H100, H100 PCIe, H200); None where unknown (CPU).
- ``MetricWriter``: one call per log point fans a dict of scalars out to
  the console, ``metrics.jsonl`` and TensorBoard event files. Only process
  0 writes. On a terminal the console is a live progress bar (rich);
  otherwise plain log lines (CI, SLURM logs).

TensorBoard files are written with ``tensorboardX`` (no TensorFlow); when it
is not installed the writer says so once and the other sinks go on.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import jax

from distrib_train.cluster import hardware
from distrib_train.common.text import human_bytes


def peak_flops(device: Any, configured_tflops: float = 0.0) -> float | None:
  """Peak FLOP/s of ``device`` (a configured value wins), from the device
  table (``cluster/hardware.py``); None if unknown."""
  if configured_tflops:
    return configured_tflops * 1e12
  kind = hardware.kind_of_device(getattr(device, "device_kind", ""))
  return None if kind is None else kind.peak_flops


def memory_in_use(device: Any) -> int | None:
  """Bytes in use on ``device`` where the backend reports it (not CPU)."""
  try:
    stats = device.memory_stats()
  except Exception:  # backends without the call raise various errors
    return None
  return None if not stats else stats.get("bytes_in_use")


def _fmt(key: str, value: Any) -> str:
  if isinstance(value, float):
    if key in ("learning_rate",):
      return f"{key} {value:.3g}"
    if key.endswith("_ms"):
      return f"{key} {value:.1f}"
    if key == "mfu":
      return f"mfu {value:.1%}"
    if key.startswith("tokens_per_s"):
      return f"{key} {value:,.0f}"
    if key.endswith("_bytes"):
      return f"{key.removesuffix('_bytes')} {human_bytes(value)}"
    return f"{key} {value:.4g}"
  return f"{key} {value}"


class MetricWriter:
  """Writes scalar metrics to the console, ``metrics.jsonl`` and TensorBoard.

  Args:
    workdir: where ``metrics.jsonl`` and ``tensorboard/`` go (None: console
      only).
    total_steps: for the progress bar.
    console: a stream (default stderr); a terminal gets a live bar.
    tensorboard: write TensorBoard event files.
  """

  def __init__(
    self,
    workdir: str | os.PathLike | None,
    total_steps: int,
    *,
    console: TextIO | None = None,
    tensorboard: bool = True,
  ):
    self.enabled = jax.process_index() == 0
    self.total_steps = total_steps
    self._stream = console or sys.stderr
    self._jsonl = None
    self._tb = None
    self._bar = None
    # The files are opened at the first metric: a run that stops during setup
    # (a damaged checkpoint, say) leaves its workdir as it found it.
    self._workdir = pathlib.Path(workdir) if workdir is not None and self.enabled else None
    self._tensorboard = tensorboard

  def _open_files(self) -> None:
    workdir, self._workdir = self._workdir, None
    self._jsonl = open(workdir / "metrics.jsonl", "a")
    if self._tensorboard:
      try:
        from tensorboardX import SummaryWriter
      except ImportError:
        self.log("tensorboardX is not installed: no TensorBoard files (pip install tensorboardX).")
      else:
        self._tb = SummaryWriter(str(workdir / "tensorboard"), flush_secs=10)

  def start_progress(self, step: int) -> None:
    """Shows a live progress bar from ``step`` when the console is a terminal."""
    if not (self.enabled and self._stream.isatty()):
      return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    self._bar = Progress(
      TextColumn("[bold]train"),
      BarColumn(),
      MofNCompleteColumn(),
      TimeRemainingColumn(),
      TextColumn("{task.fields[metrics]}"),
      console=Console(file=self._stream),
      transient=False,
    )
    self._task = self._bar.add_task("train", total=self.total_steps, completed=step, metrics="")
    self._bar.start()

  def log(self, message: str) -> None:
    """A line on the console (process 0 only), above the bar if one is live."""
    if not self.enabled:
      return
    line = f"[{time.strftime('%H:%M:%S')}] {message}"
    if self._bar is not None:
      self._bar.console.print(line, markup=False, highlight=False)
    else:
      print(line, file=self._stream, flush=True)

  def write(self, step: int, metrics: Mapping[str, Any], *, prefix: str = "") -> None:
    """Scalars at ``step``; ``prefix`` ("eval/") names a group."""
    if not self.enabled:
      return
    if self._workdir is not None:
      self._open_files()
    scalars = {
      f"{prefix}{k}": (float(v) if not isinstance(v, (int, str)) else v) for k, v in metrics.items() if v is not None
    }
    if self._jsonl is not None:
      record = {
        "step": int(step),
        "time": time.time(),
        **{k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in scalars.items()},
      }
      self._jsonl.write(json.dumps(record) + "\n")
      self._jsonl.flush()
    if self._tb is not None:
      for key, value in scalars.items():
        if isinstance(value, (int, float)):
          self._tb.add_scalar(key, value, int(step))
    text = "  ".join(_fmt(k, v) for k, v in scalars.items())
    if self._bar is not None and not prefix:
      self._bar.update(self._task, completed=int(step), metrics=text)
    else:
      self.log(f"step {int(step)}  {text}")

  def advance(self, step: int) -> None:
    if self._bar is not None:
      self._bar.update(self._task, completed=int(step))

  def close(self) -> None:
    if self._bar is not None:
      self._bar.stop()
      self._bar = None
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
