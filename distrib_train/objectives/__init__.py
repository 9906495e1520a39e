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

from collections.abc import Callable, Mapping
from typing import Any

from distrib_train.objectives.record import COUNTS, OBJECTIVES, Objective, weight_in

__all__ = ["COUNTS", "OBJECTIVES", "Objective", "build", "weight_in"]


def build(
  name: str,
  recipe: Any,
  model_config: Any,
  is_param: Any,
  settings: Any = None,
  *,
  model_fn: Callable[[int], Any] | None = None,
  loss_fn: Callable[..., Any] | None = None,
  input_axes: Mapping[str, Any] | None = None,
) -> Objective:
  """The objective ``name`` of the reference model ``recipe`` (its ``model_config``; None for a model given as
  code), with its config section ``settings`` (``dpo``, ``grpo``); ``model_fn``, ``loss_fn`` and ``input_axes``
  where the caller gives them.

  Raises:
    ValueError: a preference or RL objective asked of a model and loss given as code, or of a model with
      multi-token prediction (``mtp_depth`` > 0: only ``lm`` trains it).
  """
  if name == "lm":
    custom = loss_fn is not None
    return Objective(
      "custom" if custom else "lm",
      model_fn or recipe.config.build,
      loss_fn or recipe.loss_fn,
      is_param,
      input_axes if input_axes is not None else recipe.input_axes,
      weight=None if custom else "tokens",
      perplexity=True,
    )
  if getattr(model_config, "mtp_depth", 0):
    raise ValueError(
      f"train.objective={name} does not train multi-token prediction (model.mtp_depth"
      f" {model_config.mtp_depth}); train it with objective lm, or set model.mtp_depth=0."
    )
  if model_config is None or loss_fn is not None:
    raise ValueError(
      f"train.objective={name} trains the reference decoders (model.name llama or moe); a model and"
      " loss given as code brings its own objective."
    )
  if name == "dpo":
    from distrib_train.objectives import dpo

    return dpo.objective(model_config, is_param, settings, recipe.input_axes)
  if name == "grpo":
    from distrib_train.objectives import grpo

    return grpo.objective(model_config, is_param, settings, recipe.input_axes)
  raise ValueError(f"train.objective must be one of {', '.join(OBJECTIVES)}, got {name!r}.")
