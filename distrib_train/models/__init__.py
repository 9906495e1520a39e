"""Model adapters: how a model splits into params, local state and the rest.

``split_model`` / ``merge_model`` are what ``TrainState.initial_state``,
``TrainState.model`` and the train step call. Each adapter owns one model
family:

- plain pytrees (``models/pytree.py``): params are the floating-point leaves;
- flax nnx modules (``models/nnx_model.py``): params are the ``nnx.Param``
  state, other mutable variables are local state;
- flax linen (``models/linen_model.py``): wrap as ``LinenModel(module,
  variables)``; ``params`` is learned, other collections are local state;
- penzai v1 models (``models/penzai_model.py``): params are the
  ``pz.nn.Parameter`` values keyed by their names, as in penzai's own
  ``TrainState``; ``FrozenParameter`` values stay in the model.

The reference models built on them (Llama, the BatchNorm MLP) are in
``distrib_train.recipes``.

For nnx and linen, ``model_without_params`` is an adapter object that knows
how to rebuild the model (``merge``), read back its local state after a
forward pass (``local_state_of``) and which logical axes the model's own
annotations give (``logical_axes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from distrib_train.models import linen_model, nnx_model, penzai_model
from distrib_train.models.linen_model import LinenModel, LinenModelDef
from distrib_train.models.nnx_model import NnxModelDef, OverwriteWithGradient
from distrib_train.models.pytree import ParamSlot, StaticValue, merge_params, split_params  # noqa: F401 (tests read the placeholders here)

_ADAPTER_DEFS = (NnxModelDef, LinenModelDef)


def split_model(model: Any, is_param: Any = None) -> tuple[Any, Any, Any]:
  """Splits ``model`` into ``(params, model_without_params, local_state)``.

  Args:
    model: an ``nnx.Module``, a ``LinenModel``, a penzai v1 model or any
      pytree.
    is_param: chooses the learned parameters: an nnx filter for nnx
      modules, ``(path, leaf) -> bool`` for pytrees; not used for linen
      (the ``params`` collection is learned) or penzai (its
      ``pz.nn.Parameter`` instances are).
  """
  if isinstance(model, nnx.Module):
    return nnx_model.split(model, is_param)
  if isinstance(model, LinenModel):
    if is_param is not None:
      raise ValueError("is_param does not apply to linen models: the 'params' collection is what is learned.")
    return linen_model.split(model)
  if penzai_model.is_penzai_model(model):
    if is_param is not None:
      raise ValueError(
        "is_param does not apply to penzai models: their pz.nn.Parameter instances are learned and"
        " FrozenParameters are not."
      )
    return (*penzai_model.split(model), None)
  params, model_without_params = split_params(model, is_param)
  return params, model_without_params, None


def merge_model(model_without_params: Any, params: Any, local_state: Any = None, rng: jax.Array | None = None) -> Any:
  """Rebuilds the model a loss function receives.

  With no ``model_without_params`` (states made by ``TrainState.create``)
  the model is ``params`` itself. ``rng`` seeds the model's own RNG streams
  (nnx, linen); plain pytrees ignore it.
  """
  if model_without_params is None:
    return params
  if isinstance(model_without_params, _ADAPTER_DEFS):
    return model_without_params.merge(params, local_state, rng)
  if penzai_model.is_penzai_model(model_without_params):
    return penzai_model.merge(model_without_params, params)
  return merge_params(model_without_params, params)


def local_state_of(model_without_params: Any, model: Any, local_state: Any) -> Any:
  """The local state after a forward pass on ``model`` (unchanged for pytrees)."""
  if isinstance(model_without_params, _ADAPTER_DEFS):
    return model_without_params.local_state_of(model)
  return local_state


def overwritten_by_gradient(model_without_params: Any, local_state: Any) -> tuple[bool, ...] | None:
  """Which array leaves of ``local_state`` the backward pass writes (nnx ``OverwriteWithGradient``), or None."""
  if isinstance(model_without_params, NnxModelDef) and local_state is not None:
    marks = model_without_params.overwritten_by_gradient(local_state)
    return marks if any(marks) else None
  return None


def annotated_axes(model_without_params: Any, params: Any = None) -> Mapping[str, tuple[str | None, ...]]:
  """``/``-path → logical axes from the model's own annotations (or empty).

  nnx and linen models keep them in ``model_without_params``; penzai
  params carry them in their values' named axes.
  """
  if isinstance(model_without_params, _ADAPTER_DEFS):
    return model_without_params.logical_axes
  if isinstance(params, Mapping) and penzai_model.is_penzai_model(model_without_params):
    return penzai_model.logical_axes(params)
  return {}


def to_pure_dict(tree: Any) -> Any:
  """A nested plain-dict view of params or local state, for checkpoints.

  ``nnx.State`` goes through ``nnx.to_pure_dict`` (integer keys of
  ``nnx.List`` layers stay integers); other trees are returned as they are.
  """
  if isinstance(tree, nnx.State):
    return nnx.to_pure_dict(tree)
  return tree


def from_pure_dict(template: Any, pure_dict: Any) -> Any:
  """Inverse of ``to_pure_dict``: values from ``pure_dict`` in ``template``'s shape.

  For ``nnx.State``, string keys that a checkpoint made of integer keys are
  turned back into integers (``nnx.restore_int_paths``) and the values are
  put into the template with ``nnx.replace_by_pure_dict``.
  """
  if isinstance(template, nnx.State):
    state = jax.tree_util.tree_map(lambda x: x, template)  # a copy: the template is left as it was
    nnx.replace_by_pure_dict(state, nnx.restore_int_paths(pure_dict))
    return state
  return pure_dict


# ParamSlot and StaticValue (the pytree adapter's placeholders) stay
# importable for tests and tools, but are not public API.
__all__ = [
  "LinenModel",
  "OverwriteWithGradient",
  "annotated_axes",
  "from_pure_dict",
  "to_pure_dict",
  "local_state_of",
  "merge_model",
  "overwritten_by_gradient",
  "split_model",
]
