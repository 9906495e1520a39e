"""The non-finite guard: what a step with a NaN or Inf loss or gradients does.

``train.nonfinite`` names the policy. On the devices, the optimizer drops a
non-finite update under ``skip`` (``optimizers.guard_updates``: optax's
``apply_if_finite``, its count of skipped updates an optimizer-state leaf,
checkpointed with it). On the host, this module's ``NonFiniteGuard.judge``
reads each finished step's loss and gradient norm and decides: go on, skip
(and log it), halt, or roll back to the last checkpoint — with the limits of
``train.max_nonfinite`` on steps skipped in a row and on rollbacks without a
clean checkpoint between.

Decisions are ``Verdict`` values the loop acts on, not exceptions.

Not for: building the optimizer (``optimizers.py``) or restoring a
checkpoint (the loop does that when told to roll back).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Literal

from distrib_train.config.checks import NONFINITE_POLICIES


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What the loop does after a step was judged (or a rollback asked for).

  Attributes:
    action: ``ok`` (finite), ``skip`` (non-finite, the update was dropped,
      go on), ``halt`` (stop the run, ``message`` says why) or ``rollback``
      (restore the last checkpoint; ``step`` is the bad step); the loop's own
      ``stop`` ends a run whose ``RunResult`` is already set (preempted).
    step: the step judged.
    message: why the run halts.
  """

  action: Literal["ok", "skip", "halt", "rollback", "stop"]
  step: int = 0
  message: str = ""


OK = Verdict("ok")


class NonFiniteGuard:
  """Judges finished steps by the ``train.nonfinite`` policy.

  Args:
    policy: ``skip``, ``halt`` or ``rollback``.
    max_nonfinite: skipped steps in a row (``skip``), or rollbacks without a
      checkpoint between (``rollback``), that stop the run.
    log: where the one line per skipped step goes.
  """

  def __init__(self, policy: str, max_nonfinite: int, log: Callable[[str], None]):
    if policy not in NONFINITE_POLICIES:
      raise ValueError(f"train.nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {policy!r}.")
    self.policy = policy
    self.max_nonfinite = max_nonfinite
    self._log = log
    self.consecutive_bad = 0
    self.rollbacks_since_checkpoint = 0

  def judge(self, step: int, values: Mapping[str, float]) -> Verdict:
    """The verdict on ``step`` from its ``loss``, ``grad_norm`` and ``skipped``."""
    loss, grad_norm = values["loss"], values.get("grad_norm", 0.0)
    if math.isfinite(loss) and math.isfinite(grad_norm):
      self.consecutive_bad = 0
      return OK
    what = (
      f"non-finite {'loss' if not math.isfinite(loss) else 'gradients'} at step {step}"
      f" (loss {loss}, grad norm {grad_norm})"
    )
    self.consecutive_bad += 1
    if self.policy == "skip":
      self._log(f"{what}: update skipped ({int(values.get('skipped', 0))} skipped in this run's state).")
      if self.consecutive_bad >= self.max_nonfinite:
        return Verdict(
          "halt", step, f"{what}: {self.consecutive_bad} steps in a row skipped (train.max_nonfinite); stopping."
        )
      return Verdict("skip", step)
    if self.policy == "halt":
      return Verdict("halt", step, f"{what}; stopping without a checkpoint (train.nonfinite=halt).")
    return Verdict("rollback", step)

  def may_roll_back(self, bad_step: int, latest_checkpoint: int | None) -> Verdict:
    """``ok`` to restore ``latest_checkpoint``, or ``halt`` (none, or too many rollbacks)."""
    self.rollbacks_since_checkpoint += 1
    if latest_checkpoint is not None and self.rollbacks_since_checkpoint <= self.max_nonfinite:
      return OK
    why = (
      "no checkpoint to roll back to"
      if latest_checkpoint is None
      else f"{self.rollbacks_since_checkpoint} rollbacks without a clean checkpoint (train.max_nonfinite)"
    )
    return Verdict("halt", bad_step, f"non-finite loss or gradients at step {bad_step}; {why}; stopping.")

  def checkpoint_saved(self) -> None:
    """A clean checkpoint was written: the rollback budget starts again."""
    self.rollbacks_since_checkpoint = 0

  @staticmethod
  def nothing_trained(steps_this_run: int) -> Verdict:
    """The verdict on a run that reached its last step with no finite step."""
    return Verdict(
      "halt",
      0,
      f"every one of the {steps_this_run} step(s) of this run had a non-finite loss or"
      " gradients (all updates skipped); stopping without a checkpoint. Check the data"
      " (token ids within the vocabulary?) and the learning rate.",
    )
