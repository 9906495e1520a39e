"""One objective's record: what the job, the trainer, the loop and evaluation read of it (``Objective``).

``objectives.build`` makes it; ``dpo.objective`` and ``grpo.objective`` fill it in for theirs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

OBJECTIVES = ("lm", "dpo", "grpo")
COUNTS = ("tokens", "pairs", "sequences", "batches")  # aux counts: weights, never averaged as figures


@dataclasses.dataclass(frozen=True)
class Objective:
  """One objective of a job.

  Attributes:
    name: ``train.objective``'s spelling (``custom`` for a loss given as code).
    model_fn: ``model_fn(seed) -> model`` (DPO's live reference: a ``Preference`` of two decoders).
    loss_fn: the penzai-style loss, ``loss_fn(*, model, state, rng, **batch) -> (loss, state, aux)``.
    is_param: which of the model's variables train (LoRA: the adapters); None: every param.
    input_axes: the batch's fields and their logical axes.
    extra_inputs: the batch fields the data loader does not make, by name: their dtype (each
      ``[global_batch_size, seq_len]``).
    weight: the aux count a batch's figures are weighed by, over microbatches and in evaluation; None: ``pairs``
      or ``tokens`` where the aux has it (a loss given as code), else equal weights.
    perplexity: evaluation reports ``exp`` of the mean cross-entropy.
    flops_scale: the step's FLOPs over the family's training count (DPO's reference forward: 4/3).
    rollouts: its batches are the policy's own completions (``posttrain/rollouts.py``), not the data loader's.
  """

  name: str
  model_fn: Callable[[int], Any]
  loss_fn: Callable[..., Any]
  is_param: Any
  input_axes: Mapping[str, Any]
  extra_inputs: Mapping[str, str] = dataclasses.field(default_factory=dict)
  weight: str | None = "tokens"
  perplexity: bool = True
  flops_scale: float = 1.0
  rollouts: bool = False


def weight_in(aux: Any, weight: str | None = None) -> str | None:
  """``weight`` where the mapping ``aux`` holds it; with None (a loss given as code), ``pairs`` or else ``tokens``
  where it holds them; else None."""
  if not isinstance(aux, Mapping):
    return None
  if weight is None:
    return next((k for k in ("pairs", "tokens") if k in aux), None)
  return weight if weight in aux else None
