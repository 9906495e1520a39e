"""The training loop's contracts with what feeds it: ``BatchSource``, and ``RunContext``, what a source may ask
of its run.

A batch source is the data loader (``pipeline.DataLoader``) or the policy's own completions
(``posttrain/rollouts.RolloutSource``); the loop (``train/loop.py``) asks it for each step's batch, logs its
figures, and checkpoints its position beside the state. A source that needs the run (its workdir, its log, the
phase clock, the steps either checkpoint tier may restore) is handed a ``RunContext``, never the trainer.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class BatchSource(Protocol):
  """Where a run's training batches come from."""

  def next_batch(self, state: Any) -> Mapping[str, Any]:
    """The batch the step after ``state.step`` trains on (global arrays laid out by the plan's input
    shardings)."""

  def data_position(self) -> Mapping[str, Any] | None:
    """Where the source stands, saved with each checkpoint (None: nothing to save)."""

  def set_data_position(self, position: Mapping[str, Any]) -> None:
    """Go back to a saved position (a restore)."""

  def take_figures(self) -> Mapping[str, float]:
    """The source's own figures since the last call (averaged over the log window, e.g. ``rollout/…``), once."""

  def counts(self) -> Mapping[str, int]:
    """Running counts as of the last batch, logged as ``data/<name>`` (e.g. ``skipped_documents``)."""


@runtime_checkable
class RunContext(Protocol):
  """What a batch source may ask of the run it feeds."""

  @property
  def workdir(self) -> pathlib.Path:
    """The run's workdir (a source's records live beside the checkpoints)."""

  def log(self, message: str) -> None:
    """A line in the run's log."""

  def phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
    """The phase clock's ``name`` phase (``goodput.json``) for the duration of a ``with``."""

  def checkpoint_steps(self) -> list[int]:
    """The steps either checkpoint tier may restore now (a source keeps what a restore would read)."""
