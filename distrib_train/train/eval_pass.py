"""A run's evaluation: whether it has a held-out split, and one pass over it.

The trainer checks the split at start-up (``missing_eval_split``: a run asked
to evaluate with nothing held out is refused before it trains) and runs
``evaluate`` from its evaluation hook. The figures are token-weighted means of
the eval step's aux, weighed by the objective's count (``Objective.weight``:
pairs for ``train.objective: dpo``), written under ``eval/``.

Not for: what the eval step computes (``train_step.build_eval_step_fn``) or
when it runs (the trainer's hooks).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from distrib_train import objectives
from distrib_train.train.checks import local_value
from distrib_train.train.loop import aux_scalars


def missing_eval_split(data_config: Any, shardings: Any, vocab_size: int | None, eval_every: int) -> str | None:
  """Why the run cannot evaluate (no held-out split), or None when it can.

  Checked at start-up: without it a run trained every step and then failed
  in its final evaluation.

  Raises:
    ValueError: evaluations were asked for (``train.eval_every``) but
      there is nothing to evaluate on.
  """
  from distrib_train.data.pipeline import DataLoader

  try:
    DataLoader(data_config, shardings, split="eval", num_epochs=1, vocab_size=vocab_size).close()
    return None
  except ValueError as e:
    why = str(e)
  if eval_every:
    raise ValueError(
      f"train.eval_every={eval_every} asks for evaluations, but there is no eval split: {why} Set"
      " train.eval_every=0 to train without them, or hold documents out with data.eval_fraction."
    )
  return why


def evaluate(
  eval_step: Callable[..., Any],
  state: Any,
  step: int,
  data_config: Any,
  shardings: Any,
  *,
  batches: int,
  writer: Any,
  phases: Any,
  objective: objectives.Objective | None = None,
) -> float:
  """One pass over the eval split (the first ``batches`` batches when > 0); writes the means of the aux weighed
  by ``objective``'s count (tokens without one) and, where it has one, the perplexity under ``eval/``, and returns
  the eval loss."""
  from distrib_train.data.pipeline import DataLoader

  start = time.perf_counter()
  loader = DataLoader(data_config, shardings, split="eval", num_epochs=1)
  total = count = 0.0
  weight = None
  done = 0
  aux_totals: dict[str, float] = {}
  try:
    for batch in loader:
      phases.enter("eval")  # progress, for the watchdog
      aux = eval_step(state, **batch)
      weight = objectives.weight_in(aux, objective.weight if objective else None)  # pairs (dpo), else tokens
      tokens = float(local_value(aux[weight])) if weight else 1.0
      loss = aux["loss"] if isinstance(aux, Mapping) else aux
      total += float(local_value(loss)) * tokens
      for name, value in aux_scalars(aux).items():  # token-weighted, like the loss
        aux_totals[name] = aux_totals.get(name, 0.0) + float(local_value(value)) * tokens
      count += tokens
      done += 1
      if batches and done >= batches:
        break
  finally:
    loader.close()
  eval_loss = total / max(count, 1.0)
  aux_means = {name: value / max(count, 1.0) for name, value in aux_totals.items()}
  # exp of a mean token cross-entropy (without a mixture's routing losses); capped below overflow
  figures = {weight or "tokens": count}
  if objective is None or objective.perplexity:
    figures["perplexity"] = math.exp(min(aux_means.get("cross_entropy", eval_loss), 700.0))
  writer.write(
    step,
    {**aux_means, "loss": eval_loss, **figures, "batches": done, "seconds": time.perf_counter() - start},
    prefix="eval/",
  )
  return eval_loss
