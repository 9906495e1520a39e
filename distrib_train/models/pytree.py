"""The plain-pytree model adapter: split a model into params and the rest.

A plain model is any pytree (dicts, lists, dataclasses registered as pytrees).
Its parameters are the array leaves with an inexact dtype (floating or
complex), or those an ``is_param(path, leaf)`` filter selects. They are kept
in a flat ``dict[str, Array]`` keyed by ``/``-joined path, as penzai keeps
``params`` as a name → value dict. What is left, ``model_without_params``,
holds a ``ParamSlot`` where each parameter was; its non-array leaves (Python
numbers, strings, functions) are held as static ``StaticValue`` nodes so the
whole ``TrainState`` can cross a ``jax.jit`` boundary unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distrib_train.common.naming import path_str

IsParam = Callable[[str, Any], bool]


@jax.tree_util.register_pytree_node_class
class ParamSlot:
  """Marks where a parameter sits in ``model_without_params``."""

  def __init__(self, name: str):
    self.name = name

  def __repr__(self) -> str:
    return f"ParamSlot({self.name!r})"

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, ParamSlot) and other.name == self.name

  def __hash__(self) -> int:
    return hash(("ParamSlot", self.name))

  def tree_flatten(self):
    return (), self.name

  @classmethod
  def tree_unflatten(cls, name, children):
    del children
    return cls(name)


@jax.tree_util.register_pytree_node_class
class StaticValue:
  """A non-array model leaf carried in the tree structure, not as a leaf."""

  def __init__(self, value: Any):
    self.value = value

  def __repr__(self) -> str:
    return f"StaticValue({self.value!r})"

  def __eq__(self, other: Any) -> bool:
    if not isinstance(other, StaticValue) or type(other.value) is not type(self.value):
      return False
    try:
      return bool(other.value == self.value)
    except Exception:  # e.g. objects whose == is elementwise
      return other.value is self.value

  def __hash__(self) -> int:
    try:
      return hash((type(self.value), self.value))
    except TypeError:
      return id(self.value)

  def tree_flatten(self):
    return (), self

  @classmethod
  def tree_unflatten(cls, aux, children):
    del children
    return aux


def _is_marker(x: Any) -> bool:
  return isinstance(x, (ParamSlot, StaticValue))


def is_array(x: Any) -> bool:
  """Arrays, tracers and abstract arrays (``jax.ShapeDtypeStruct``)."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _is_inexact(x: Any) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def default_is_param(path: str, leaf: Any) -> bool:
  """Inexact-dtype (floating or complex) array leaves are parameters."""
  del path
  return is_array(leaf) and _is_inexact(leaf)


def split_params(model: Any, is_param: IsParam | None = None) -> tuple[dict[str, Any], Any]:
  """Splits a pytree model into ``(params, model_without_params)``.

  Args:
    model: any pytree.
    is_param: ``(path, leaf) -> bool`` choosing the parameters; by default
      the inexact-dtype array leaves.

  Returns:
    ``params``, a flat dict keyed by ``/``-joined path, and the model with a
    ``ParamSlot`` in place of each parameter.

  Raises:
    ValueError: two parameters share a path string, or ``is_param`` selected
      a leaf that is not an array.
  """
  is_param = is_param or default_is_param
  leaves, treedef = jax.tree_util.tree_flatten_with_path(model)
  params: dict[str, Any] = {}
  rest = []
  for path, leaf in leaves:
    name = path_str(path)
    if is_param(name, leaf):
      if not is_array(leaf):
        raise ValueError(f"is_param selected {name!r}, which is a {type(leaf).__name__}, not an array.")
      if name in params:
        raise ValueError(f"Two parameters share the path {name!r}; rename one of them.")
      params[name] = leaf
      rest.append(ParamSlot(name))
    elif is_array(leaf):
      rest.append(leaf)
    else:
      rest.append(StaticValue(leaf))
  return params, jax.tree_util.tree_unflatten(treedef, rest)


def merge_params(model_without_params: Any, params: Mapping[str, Any]) -> Any:
  """Inverse of ``split_params``: puts parameter values back in their slots.

  Raises:
    KeyError: a slot whose parameter is missing from ``params``.
  """

  def fill(x):
    if isinstance(x, ParamSlot):
      if x.name not in params:
        raise KeyError(f"Parameter {x.name!r} is missing; params has {len(params)} entries.")
      return params[x.name]
    if isinstance(x, StaticValue):
      return x.value
    return x

  return jax.tree_util.tree_map(fill, model_without_params, is_leaf=_is_marker)
