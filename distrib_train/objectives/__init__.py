"""Training objectives, apart from the model family: ``train.objective``, each one ``Objective`` record.

- ``lm`` (the default): the family's own next-token cross-entropy (``decoder.loss_fn``): pretraining, and SFT
  with ``data.loss_on``.
- ``dpo``: DPO / SimPO / ORPO on preference pairs (``dpo.py``).
- ``grpo``: GRPO and its variants on the policy's own completions (``grpo.py``; the rollouts in
  ``posttrain/rollouts.py``).

The record is what the job, the trainer, the loop and evaluation read of an objective: the model it trains
(``model_fn``, ``is_param``), its loss, the batch fields and their logical axes, the aux count its figures are
weighed by, the aux entries that are counts (not figures to average), whether evaluation reports a perplexity,
and the step's FLOPs over the family's training count.

Not for: the model (``recipes/``), the batches (``data/``, ``posttrain/rollouts.py``).
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


def build(name: str, recipe: Any, model_config: Any, is_param: Any, settings: Any = None, *,
          model_fn: Callable[[int], Any] | None = None, loss_fn: Callable[..., Any] | None = None,
          input_axes: Mapping[str, Any] | None = None) -> Objective:
  """The objective ``name`` of the reference model ``recipe`` (its ``model_config``; None for a model given as
  code), with its config section ``settings`` (``dpo``, ``grpo``); ``model_fn``, ``loss_fn`` and ``input_axes``
  where the caller gives them.

  Raises:
    ValueError: a preference or RL objective asked of a model and loss given as code, or of a model with
      multi-token prediction (``mtp_depth`` > 0: only ``lm`` trains it).
  """
  if name == "lm":
    custom = loss_fn is not None
    return Objective("custom" if custom else "lm", model_fn or recipe.config.build, loss_fn or recipe.loss_fn,
                     is_param, input_axes if input_axes is not None else recipe.input_axes,
                     weight=None if custom else "tokens", perplexity=True)
  if getattr(model_config, "mtp_depth", 0):
    raise ValueError(f"train.objective={name} does not train multi-token prediction (model.mtp_depth"
                     f" {model_config.mtp_depth}); train it with objective lm, or set model.mtp_depth=0.")
  if model_config is None or loss_fn is not None:
    raise ValueError(f"train.objective={name} trains the reference decoders (model.name llama or moe); a model and"
                     " loss given as code brings its own objective.")
  if name == "dpo":
    from distrib_train.objectives import dpo

    return dpo.objective(model_config, is_param, settings, recipe.input_axes)
  if name == "grpo":
    from distrib_train.objectives import grpo

    return grpo.objective(model_config, is_param, settings, recipe.input_axes)
  raise ValueError(f"train.objective must be one of {', '.join(OBJECTIVES)}, got {name!r}.")
