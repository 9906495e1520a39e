"""Model adapters: how a model splits into learned params and the rest.

``split_model`` / ``merge_model`` are what ``TrainState.initial_state`` and
``TrainState.model`` call. Today they handle plain pytrees
(``models/pytree.py``); each adapter owns one model family.
"""

from __future__ import annotations

from typing import Any

from distrib_train.models.pytree import IsParam, ParamSlot, StaticValue, merge_params, split_params


def split_model(model: Any, is_param: IsParam | None = None) -> tuple[Any, Any]:
  """Splits ``model`` into ``(params, model_without_params)``."""
  return split_params(model, is_param)


def merge_model(model_without_params: Any, params: Any) -> Any:
  """Rebuilds the full model; with no ``model_without_params``, the params."""
  if model_without_params is None:
    return params
  return merge_params(model_without_params, params)


__all__ = ["ParamSlot", "StaticValue", "merge_model", "split_model"]
