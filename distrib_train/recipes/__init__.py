"""Reference models by name: their config, penzai-style loss and input axes.

``get("llama", preset="tiny")`` (``recipes/llama.py``: a Llama-style decoder,
presets tiny to 70b), ``get("moe", preset="tiny")`` (``recipes/moe.py``: a
mixture of experts, presets tiny, mixtral-8x7b, deepseek-v3) and ``get("mlp")`` (``recipes/mlp.py``: BatchNorm and
Dropout). A new model family goes here as a module with ``PRESETS``,
``loss_fn`` and ``INPUT_AXES``, registered in ``_REGISTRY``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from distrib_train.recipes import llama, mlp, moe


@dataclasses.dataclass(frozen=True)
class ModelRecipe:
  """A reference model: its config, penzai-style loss and input axes.

  ``recipe.config.build(seed)`` makes the nnx module.
  """

  name: str
  config: Any
  loss_fn: Callable[..., Any]
  input_axes: Mapping[str, tuple[str | None, ...]]


_REGISTRY = {
  "llama": (llama.PRESETS, llama.loss_fn, llama.INPUT_AXES),
  "mlp": (mlp.PRESETS, mlp.loss_fn, mlp.INPUT_AXES),
  "moe": (moe.PRESETS, moe.loss_fn, moe.INPUT_AXES),
}


def get(name: str, preset: str = "tiny", **overrides: Any) -> ModelRecipe:
  """A reference model by name and preset, with config fields overridden.

  Example: ``get("llama", preset="1b", remat="dots_saveable")``.

  Raises:
    ValueError: an unknown model, preset or config field (the message lists
      the known ones).
  """
  if name not in _REGISTRY:
    raise ValueError(f"Unknown model {name!r}; known: {', '.join(sorted(_REGISTRY))}.")
  presets, model_loss_fn, input_axes = _REGISTRY[name]
  if preset not in presets:
    raise ValueError(f"Unknown preset {preset!r} for {name}; known: {', '.join(presets)}.")
  config = presets[preset]
  fields = {f.name for f in dataclasses.fields(config)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"Unknown {name} config field(s) {', '.join(unknown)}; fields: {', '.join(sorted(fields))}.")
  return ModelRecipe(f"{name}-{preset}", dataclasses.replace(config, **overrides), model_loss_fn, input_axes)


__all__ = ["ModelRecipe", "get"]
