"""The penzai adapter: a penzai v1 model splits as penzai's own ``TrainState`` does.

``params`` are exactly the model's ``pz.nn.Parameter`` values, keyed by
``param.name`` (penzai's names, e.g. ``Affine_0.Linear.weights``), after
``pz.nn.check_no_duplicated_parameters``. ``model_without_params`` is the
model itself with ``pz.NotInThisPartition()`` where those values were; every
other array in it (``pz.nn.FrozenParameter`` values, constants) stays there
and is never trained. A penzai loss function that uses ``state`` for its
local states (``pz.de.handle_local_states``) runs unchanged.

Logical axes come from the params' own named axes (``pz.nx.NamedArray``):
a ``{"features": 8, "features_out": 16}`` weight is planned as
``("features", "features_out")``, so axis rules name penzai's axis names.

penzai v2 models (``pz.Parameter`` / ``pz.StateVariable``, mutable
variables rather than pytree leaves) are refused with a clear error: their
variables are not leaves of the model, and treating them as a plain pytree
would train nothing.

penzai is imported only when a model is built from its classes; this module
never imports it first. Not for: nnx, linen or plain pytree models (their
own adapters).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import jax


def _penzai_struct_class() -> type | None:
  module = sys.modules.get("penzai.core.struct")
  return None if module is None else module.Struct


def is_penzai_model(model: Any) -> bool:
  """Whether ``model`` is (or holds) a penzai ``Struct``; never imports penzai."""
  struct_class = _penzai_struct_class()
  if struct_class is None:
    return False
  if isinstance(model, struct_class):
    return True
  is_struct = lambda x: isinstance(x, struct_class)
  return any(is_struct(x) for x in jax.tree_util.tree_leaves(model, is_leaf=is_struct))


def _v2_variables(model: Any) -> list[tuple[str, Any]]:
  """``(path, variable)`` for each penzai v2 variable or variable slot in ``model``."""
  variables = sys.modules.get("penzai.core.variables")
  if variables is None:
    return []
  kinds = tuple(
    getattr(variables, name)
    for name in ("AbstractVariable", "AbstractVariableSlot", "AbstractVariableValue")
    if hasattr(variables, name)
  )
  is_var = lambda x: isinstance(x, kinds)
  found = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_var)[0]
  return [(jax.tree_util.keystr(path), leaf) for path, leaf in found if is_var(leaf)]


def _v1():
  from penzai.deprecated.v1 import pz  # pylint: disable=import-outside-toplevel

  return pz


def _refuse_v2(model: Any) -> None:
  found = _v2_variables(model)
  if found:
    path, variable = found[0]
    raise TypeError(
      f"This is a penzai v2 model ({type(variable).__name__} at model{path}, {len(found)} variable(s) in all);"
      " distrib_train trains penzai v1 models (pz.nn.Parameter, from penzai.deprecated.v1) and nnx, linen or"
      " pytree models. Train a v2 model with penzai.toolshed.basic_training, or port it to penzai.deprecated.v1."
    )


def split(model: Any) -> tuple[dict[str, Any], Any]:
  """Splits a penzai v1 model into ``(params, model_without_params)``.

  Raises:
    TypeError: a penzai v2 model.
    ValueError: two parameters share a name, or the model has no
      ``pz.nn.Parameter`` to train (uninitialized or all frozen).
  """
  _refuse_v2(model)
  pz = _v1()
  try:
    pz.nn.check_no_duplicated_parameters(model)
  except ValueError as e:
    raise ValueError(f"The penzai model's parameters must have distinct names: {e}") from None
  selection = pz.select(model).at_instances_of(pz.nn.Parameter)
  params = {param.name: param.value for param in selection.get_sequence()}
  if not params:
    uninitialized = pz.select(model).at_instances_of(pz.nn.UninitializedParameter).count()
    frozen = pz.select(model).at_instances_of(pz.nn.FrozenParameter).count()
    hint = (
      f" It has {uninitialized} UninitializedParameter(s): call pz.nn.initialize_parameters(model, key) first."
      if uninitialized
      else f" All {frozen} of its parameters are FrozenParameters."
      if frozen
      else ""
    )
    raise ValueError(f"The penzai model has no pz.nn.Parameter to train.{hint}")
  return params, selection.at(lambda param: param.value).set(pz.NotInThisPartition())


def merge(model_without_params: Any, params: Mapping[str, Any]) -> Any:
  """Inverse of ``split``: each ``pz.nn.Parameter`` gets ``params[param.name]``.

  Raises:
    KeyError: a parameter of the model that ``params`` lacks.
  """
  pz = _v1()

  def bind(param):
    if param.name not in params:
      raise KeyError(
        f"Parameter {param.name!r} of the penzai model is missing from params "
        f"({len(params)} entries: {', '.join(sorted(params)[:5])}{', …' if len(params) > 5 else ''})."
      )
    return dataclasses.replace(param, value=params[param.name])

  return pz.select(model_without_params).at_instances_of(pz.nn.Parameter).apply(bind)


def _named_axes(value: Any) -> tuple[str | None, ...] | None:
  """Logical axes of a ``NamedArray`` / ``NamedArrayView``'s data array."""
  named_axes = sys.modules.get("penzai.core.named_axes")
  if named_axes is None:
    return None
  if isinstance(value, named_axes.NamedArray):
    return (None,) * len(value.positional_shape) + tuple(value.named_axes)
  if isinstance(value, named_axes.NamedArrayView):
    axes: list[str | None] = [None] * len(value.data_shape)
    for name, index in value.data_axis_for_name.items():
      axes[index] = name
    return tuple(axes)
  return None


def logical_axes(params: Mapping[str, Any]) -> dict[str, tuple[str | None, ...]]:
  """Param name → logical axes, from the values' named axes where they have them."""
  return {name: axes for name, value in params.items() if (axes := _named_axes(value)) is not None}
