"""The flax nnx adapter: an ``nnx.Module`` as params, local state and the rest.

``split`` cuts a live module with ``nnx.split`` into

- ``params``: the ``nnx.Param`` state (or what an ``is_param`` nnx filter
  selects) — learned by the optimizer;
- ``local_state``: every other variable that the forward pass may update
  (``nnx.BatchStat``, custom ``nnx.Variable`` subclasses) — carried, donated,
  sharded and checkpointed by the step, never seen by the optimizer. Local
  state of the kind ``OverwriteWithGradient`` is written by the backward pass
  instead: the step differentiates the loss with respect to it too and takes
  that "gradient" as its next value (flax's ``OVERWRITE_WITH_GRADIENT``, for
  nnx; FP8 amax histories that record the gradients' amax use it);
- ``NnxModelDef``: the graph definition plus the frozen rest (params left out
  by ``is_param``, and the RNG streams), which goes into
  ``model_without_params``.

RNG streams are not state here: before each step the adapter reseeds every
stream in the module from the step's key, so ``nnx.Dropout`` draws from
``fold_in(root_rng, step)`` as penzai's ``rng`` argument does.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from distrib_train.common.naming import path_str

# The metadata key naming a Variable's logical axes moved across flax
# releases; the first one present wins.
_SHARDING_METADATA_KEYS = ("out_sharding", "sharding_names", "sharding")


def variable_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
  """The logical axes a Variable was annotated with, if any."""
  metadata = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
  for key in _SHARDING_METADATA_KEYS:
    axes = metadata.get(key)
    if axes is not None:
      return tuple(axes)
  return None


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _axes_by_path(state: Any) -> dict[str, tuple[str | None, ...]]:
  out = {}
  for path, variable in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)[0]:
    if isinstance(variable, nnx.Variable):
      axes = variable_axes(variable)
      if axes is not None:
        out[path_str(path)] = axes
  return out


class OverwriteWithGradient(nnx.Variable):
  """Local state whose next value is the gradient the backward pass gives it (see the module docstring).

  A custom VJP that reads such a variable returns its new value as the
  variable's cotangent; the train step puts that value in the next step's
  local state, the optimizer never sees it. It must be floating point and
  read once per forward pass (a layer stack's scan reads one slice per layer).
  """


def _stream_tags(module: nnx.Module) -> tuple[str, ...]:
  tags = {node.tag for _, node in nnx.iter_graph(module) if isinstance(node, nnx.RngStream)}
  return tuple(sorted(tags))


@jax.tree_util.register_pytree_node_class
class NnxModelDef:
  """``model_without_params`` for an nnx module: graph + frozen variables."""

  def __init__(self, graphdef, rest, local_filter, stream_tags, logical_axes):
    self.graphdef = graphdef
    self.rest = rest
    self.local_filter = local_filter
    self.stream_tags = stream_tags
    self._logical_axes = logical_axes

  @property
  def logical_axes(self) -> Mapping[str, tuple[str | None, ...]]:
    """``/``-path → logical axes from the variables' sharding metadata."""
    return dict(self._logical_axes)

  def __repr__(self) -> str:
    return f"NnxModelDef({type(self.graphdef).__name__}, streams={self.stream_tags})"

  def tree_flatten(self):
    return (self.rest,), (self.graphdef, self.local_filter, self.stream_tags, self._logical_axes)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(aux[0], children[0], *aux[1:])

  def merge(self, params: Any, local_state: Any, rng: jax.Array | None = None) -> nnx.Module:
    """A live module; with ``rng``, every RNG stream is reseeded from it."""
    states = [s for s in (params, local_state, self.rest) if s is not None]
    # copy=True: fresh Variables at the current trace level (inside jax.grad),
    # so the forward pass may update BatchStat-like variables.
    module = nnx.merge(self.graphdef, *states, copy=True)
    if rng is not None and self.stream_tags:
      nnx.reseed(module, **{tag: jax.random.fold_in(rng, zlib.crc32(tag.encode())) for tag in self.stream_tags})
    return module

  def local_state_of(self, module: nnx.Module) -> Any:
    """The module's local state now (after the loss function ran)."""
    return nnx.state(module, self.local_filter)

  def overwritten_by_gradient(self, local_state: Any) -> tuple[bool, ...]:
    """For each array leaf of ``local_state``: is it ``OverwriteWithGradient`` state."""
    marks = []
    for variable in jax.tree_util.tree_leaves(local_state, is_leaf=_is_variable):
      count = len(jax.tree_util.tree_leaves(variable)) if isinstance(variable, nnx.Variable) else 1
      marks += [isinstance(variable, OverwriteWithGradient)] * count
    return tuple(marks)


def split(module: nnx.Module, is_param: Any = None) -> tuple[nnx.State, NnxModelDef, nnx.State]:
  """Splits a module into ``(params, model_without_params, local_state)``.

  Args:
    module: the nnx module.
    is_param: an nnx filter choosing the learned variables (default
      ``nnx.Param``); Params it leaves out stay frozen.
  """
  param_filter = nnx.Param if is_param is None else is_param
  local_filter = nnx.All(nnx.Not(nnx.Param), nnx.Not(nnx.RngState))
  graphdef, params, local_state, rest = nnx.split(module, param_filter, local_filter, ...)
  axes = {**_axes_by_path(params), **_axes_by_path(local_state)}
  # The frozen variables' axes too, by their paths in the model_without_params field (as the planner names its
  # leaves: the adapter's own index first), so that a frozen base is laid out as params are.
  frozen = _axes_by_path(NnxModelDef(graphdef, rest, local_filter, (), ()))
  model_def = NnxModelDef(graphdef, rest, local_filter, _stream_tags(module), tuple(sorted({**axes, **frozen}.items())))
  return params, model_def, local_state
