"""Names for places in a pytree: one path entry, and a whole path as ``a/b/c``.

Models (params keyed by path), the planner (its report, ``param_axes``
regexes) and checkpoints (arrays stored by path) all name a leaf the same way.
"""

from __future__ import annotations

from typing import Any

# Attribute steps that only unwrap a value (nnx Variable, penzai NamedArray).
_SKIPPED_ATTRIBUTES = ("value", "data_array")


def key_name(entry: Any) -> str:
  """One path entry as a plain string (dict key, index or attribute)."""
  for attr in ("key", "idx", "name"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def path_str(path: tuple[Any, ...]) -> str:
  """A ``jax.tree_util`` key path as a ``/``-joined string.

  The ``.value`` step into an nnx ``Variable`` is left out, so an nnx
  kernel is ``layers/0/kernel`` as in ``nnx.to_pure_dict``; so is the
  ``.data_array`` step into a penzai ``NamedArray``, so a penzai param is
  named by its own name.
  """
  return "/".join(key_name(e) for e in path if getattr(e, "name", None) not in _SKIPPED_ATTRIBUTES)
