"""The flax linen adapter: a module plus its variables as params and local state.

Wrap a linen module and the variables ``module.init`` returned::

  model = LinenModel(module, variables)
  state = TrainState.initial_state(model, optax.adam(1e-3), jax.random.key(0))

The ``params`` collection is learned; every other collection
(``batch_stats``, …) is local state, passed as ``mutable`` on each call and
carried by the step. The loss function receives a ``LinenModel`` bound to the
current values and calls it like the module: ``model(x, train=True)``. Its RNG
streams (``rng_names``) are derived from the step's key. Logical axes come
from ``nn.with_logical_partitioning`` boxes.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax

from distrib_train.common.naming import path_str


def _boxed_axes(variables: Any) -> dict[str, tuple[str | None, ...]]:
  is_box = lambda x: isinstance(x, nn.Partitioned)
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(variables, is_leaf=is_box)[0]:
    if is_box(leaf):
      out[path_str(path)] = tuple(leaf.names)
  return out


class LinenModel:
  """A linen module with its variables; callable like the module.

  Args:
    module: the linen module.
    variables: what ``module.init`` returned (boxed or not).
    rng_names: RNG streams to feed from the step's key on each call.
  """

  def __init__(
    self,
    module: nn.Module,
    variables: Mapping[str, Any],
    *,
    rng_names: Sequence[str] = ("dropout",),
    rng: jax.Array | None = None,
  ):
    if "params" not in variables:
      raise ValueError(f"LinenModel needs a 'params' collection; the variables have {sorted(variables)}.")
    self.module = module
    self.variables = dict(variables)
    self.rng_names = tuple(rng_names)
    self.rng = rng

  @property
  def params(self) -> Any:
    return self.variables["params"]

  @property
  def local_state(self) -> dict[str, Any]:
    """Every collection but ``params``."""
    return {k: v for k, v in self.variables.items() if k != "params"}

  def __call__(self, *args: Any, rngs: Mapping[str, jax.Array] | None = None, **kwargs: Any) -> Any:
    """``module.apply`` with the local collections mutable; keeps their update."""
    if rngs is None and self.rng is not None:
      rngs = {name: jax.random.fold_in(self.rng, zlib.crc32(name.encode())) for name in self.rng_names}
    mutable = sorted(self.local_state)
    out = self.module.apply(self.variables, *args, rngs=rngs, mutable=mutable or False, **kwargs)
    if mutable:
      out, updates = out
      self.variables = {**self.variables, **{k: dict(v) for k, v in updates.items()}}
    return out


@jax.tree_util.register_pytree_node_class
class LinenModelDef:
  """``model_without_params`` for a linen module: the module (static)."""

  def __init__(self, module: nn.Module, rng_names: tuple[str, ...], logical_axes: tuple):
    self.module = module
    self.rng_names = rng_names
    self._logical_axes = logical_axes

  @property
  def logical_axes(self) -> Mapping[str, tuple[str | None, ...]]:
    """``/``-path → logical axes from ``nn.with_logical_partitioning``."""
    return dict(self._logical_axes)

  def __repr__(self) -> str:
    return f"LinenModelDef({type(self.module).__name__})"

  def tree_flatten(self):
    return (), (self.module, self.rng_names, self._logical_axes)

  @classmethod
  def tree_unflatten(cls, aux, children):
    del children
    return cls(*aux)

  def merge(self, params: Any, local_state: Any, rng: jax.Array | None = None) -> LinenModel:
    return LinenModel(self.module, {"params": params, **(local_state or {})}, rng_names=self.rng_names, rng=rng)

  def local_state_of(self, model: LinenModel) -> dict[str, Any]:
    return model.local_state


def split(model: LinenModel) -> tuple[Any, LinenModelDef, dict[str, Any]]:
  """Splits into ``(params, model_without_params, local_state)``, unboxed."""
  axes = _boxed_axes({"params": model.params})
  local_axes = _boxed_axes(model.local_state)
  # Paths are relative to params / local_state, as the planner walks them.
  logical_axes = {k.removeprefix("params/"): v for k, v in axes.items()}
  logical_axes.update(local_axes)
  params = nn.unbox(model.params)
  local_state = {k: dict(nn.unbox(v)) for k, v in model.local_state.items()}
  return (
    params,
    LinenModelDef(module=model.module, rng_names=model.rng_names, logical_axes=tuple(sorted(logical_axes.items()))),
    local_state,
  )
