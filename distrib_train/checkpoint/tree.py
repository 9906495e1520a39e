"""A TrainState's saved fields as plain nested dicts of arrays, and back.

Checkpoints store arrays by path (``params/layers/0/kernel``), not Python
classes, so they load with no pickles and into any model class whose tree
has the same paths. Not for: reading or writing files (``checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from distrib_train.common.naming import key_name
from distrib_train.train_state import TrainState

Keys = tuple[str, ...]


def is_prng_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys(field: str, path: tuple[Any, ...]) -> Keys:
  # The .value step into an nnx Variable is dropped, as in pure dicts.
  return (field,) + tuple(key_name(e) for e in path if getattr(e, "name", None) != "value")


def flatten_fields(state: Any, fields: Sequence[str]) -> dict[Keys, Any]:
  """``(field, key, …) → leaf`` for ``fields`` of a TrainState."""
  return {
    _keys(field, path): leaf
    for field in fields
    for path, leaf in jax.tree_util.tree_flatten_with_path(getattr(state, field))[0]
  }


def fill_fields(target: TrainState, fields: Sequence[str], values: Mapping[Keys, Any]) -> TrainState:
  """``target`` with the leaves of ``fields`` replaced from ``values``."""
  return target.replace(
    **{
      field: jax.tree_util.tree_map_with_path(
        lambda path, leaf, field=field: values[_keys(field, path)], getattr(target, field)
      )
      for field in fields
    }
  )


def nest(flat: Mapping[Keys, Any]) -> dict[str, Any]:
  """``{(a, b): x}`` → ``{a: {b: x}}``."""
  root: dict[str, Any] = {}
  for keys, leaf in flat.items():
    node = root
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    node[keys[-1]] = leaf
  return root


def unnest(tree: Mapping[str, Any], prefix: Keys = ()) -> dict[Keys, Any]:
  """Inverse of ``nest`` (keys become strings, as a checkpoint gives them)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(unnest(value, prefix + (str(key),)))
    else:
      out[prefix + (str(key),)] = value
  return out
