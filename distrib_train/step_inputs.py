"""What a step is called with: the loss function's keywords, and where its arrays sit.

``check_loss_fn_accepts`` reads a loss function's signature before the first
trace (the planner and the step both call it); ``on_auto_mesh`` and
``distinct_buffers`` place the step's arguments so that jit takes and
donates them. Not for: the step itself (``train_step.py``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any

import jax
from jax.sharding import NamedSharding

from distrib_train.common.auto_mesh import as_auto_mesh


def check_loss_fn_accepts(loss_fn: Any, input_names: Iterable[str]) -> None:
  """Checks, from its signature, that ``loss_fn`` takes ``model``, ``state``,
  ``rng`` and every input as keywords (``**kwargs`` takes any), and needs no
  other argument.

  Raises:
    ValueError: naming the function and the keywords it lacks or needs.
  """
  try:
    parameters = inspect.signature(loss_fn).parameters.values()
  except (TypeError, ValueError):  # a callable without a signature: the call itself tells
    return
  keywords = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  passed = ["model", "state", "rng", *sorted(set(input_names) - {"model", "state", "rng"})]
  takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
  missing = [] if takes_any else [name for name in passed if name not in keywords]
  needed = [
    p.name
    for p in parameters
    if p.default is p.empty
    and p.name not in passed
    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)
  ]
  if not missing and not needed:
    return
  function = loss_fn.func if isinstance(loss_fn, functools.partial) else loss_fn
  name = getattr(function, "__qualname__", None) or type(function).__name__
  problems = ([f"does not accept {', '.join(missing)}"] if missing else []) + (
    [f"needs {', '.join(needed)}, which the step does not pass"] if needed else []
  )
  raise ValueError(
    f"The loss function {name} {' and '.join(problems)}; it is called as loss_fn({', '.join(f'{n}=' for n in passed)})"
    " - add those keyword parameters, or **kwargs to take any batch key."
  )


def on_auto_mesh(x: Any, planned: Any = None) -> Any:
  """Moves an array sharded on an Explicit-axes mesh onto an Auto mesh.

  Arrays placed with ``jax.make_mesh``'s default (Explicit) mesh, or made
  under ``jax.set_mesh`` of one, carry that mesh in their type; mixed with
  the step's Auto-mesh shardings, jit rejects them. They go to the planned
  sharding when there is one, else to the same spec on the Auto twin.
  """
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    return x
  sharding = x.sharding
  if isinstance(sharding, NamedSharding) and not sharding.mesh.are_all_axes_auto:
    target = planned if isinstance(planned, NamedSharding) else None
    return jax.device_put(x, target or NamedSharding(as_auto_mesh(sharding.mesh), sharding.spec))
  return x


def distinct_buffers(tree: Any) -> Any:
  """Copies leaves that share a buffer with an earlier leaf.

  XLA refuses to donate one buffer twice, which happens when a hand-written
  init reuses one array for two params (a shared zeros bias, say).
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if len({id(x) for x in leaves}) == len(leaves) or any(isinstance(x, jax.core.Tracer) for x in leaves):
    return tree
  seen: set[int] = set()
  out = []
  for leaf in leaves:
    out.append(jax.numpy.copy(leaf) if id(leaf) in seen else leaf)
    seen.add(id(leaf))
  return jax.tree_util.tree_unflatten(treedef, out)
