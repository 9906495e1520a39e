"""Microbatches inside the train step: gradient accumulation, and what a pipeline is asked to do.

``build_train_step_fn(..., microbatches=N)`` splits each input's batch into
``N`` strided microbatches (microbatch ``i`` holds rows ``i, i + N, i + 2N,
…``, so a device's rows stay on it) and then either

- accumulates gradients over them with a ``lax.scan`` (``accumulate``):
  float32 sums, one optimizer update, the loss function's state and the
  model's local state threaded through the microbatches in order; or,
- when the step's mesh has a ``stage`` axis of size > 1, hands them to the
  model's layer stack as a pipeline (``Pipelining``, read by
  ``parallel/pipeline.py``): the loss function runs once on the whole batch
  and the layer stack runs the microbatches through the stages.

Combining outputs (accumulation): gradients and floating aux leaves are
averaged over microbatches, weighted by the aux scalar named by
``microbatch_weight`` (e.g. ``"tokens"``: a per-token mean loss then equals
the whole batch's) or equally without one; the weight itself and integer
aux leaves are summed. Local state that must move once per step, from the
whole step (a router's load-balancing bias), reads ``last_microbatch()``: a
traced ``i == N - 1`` while microbatch ``i`` is traced, ``True`` otherwise.
Not for: the pipeline schedule itself (``parallel/pipeline.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

STAGE_AXIS = "stage"


def split(a: jax.Array, n: int) -> jax.Array:
  """[B, ...] → [n, B/n, ...]: microbatch i holds rows i, i + n, i + 2n, …"""
  return jnp.swapaxes(a.reshape(a.shape[0] // n, n, *a.shape[1:]), 0, 1)


def merge(a: jax.Array) -> jax.Array:
  """The inverse of ``split``: [n, B/n, ...] → [B, ...]."""
  return jnp.swapaxes(a, 0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def check_batch(inputs: dict[str, Any], n: int) -> None:
  """Raises ValueError naming the input whose batch ``n`` microbatches do not divide."""
  for name, value in inputs.items():
    for leaf in jax.tree_util.tree_leaves(value):
      shape = getattr(leaf, "shape", ())
      if not shape or shape[0] % n:
        raise ValueError(
          f"Input {name!r} has shape {tuple(shape)}: its batch (first) dimension does not split"
          f" into {n} microbatches (train.microbatches); make the global batch a multiple of {n}."
        )


def stages_of(mesh: Any) -> int:
  """The size of ``mesh``'s stage axis (1 without one)."""
  return int(dict(getattr(mesh, "shape", {})).get(STAGE_AXIS, 1)) if mesh is not None else 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
  """The idle share of each pipeline stage: ``(S − 1) / (R·M + S − 1)`` (GPipe when ``R == 1``)."""
  if stages <= 1:
    return 0.0
  return (stages - 1) / (repeats * microbatches + stages - 1)


@dataclasses.dataclass(frozen=True)
class Pipelining:
  """What the step asks of the model's layer stack: ``microbatches`` through ``mesh``'s stage axis,
  ``repeats`` rounds (1: GPipe; more: the circular schedule), FSDP weights gathered once per step."""

  mesh: Any
  microbatches: int
  repeats: int = 1

  @property
  def stages(self) -> int:
    return stages_of(self.mesh)

  def check(self, batch: int | None = None) -> None:
    """Raises ValueError for settings no schedule runs."""
    s, m, r = self.stages, self.microbatches, self.repeats
    if m < 1 or r < 1:
      raise ValueError(f"train.microbatches ({m}) and train.pipeline_repeats ({r}) must be at least 1.")
    if r > 1 and m < s:
      raise ValueError(
        f"The circular pipeline (train.pipeline_repeats {r}) needs at least as many microbatches"
        f" as stages: train.microbatches is {m}, the stage axis has {s}; raise it to {s} or more."
      )
    if batch is not None and batch % m:
      raise ValueError(f"The global batch ({batch}) does not split into train.microbatches ({m}) microbatches.")

  def bubble(self) -> float:
    return bubble_fraction(self.stages, self.microbatches, self.repeats)


@dataclasses.dataclass
class PipelineUse:
  """The active request and how many layer stacks took it (counted while the step is traced)."""

  request: Pipelining
  used: int = 0


_ACTIVE: contextvars.ContextVar[PipelineUse | None] = contextvars.ContextVar("distrib_train_pipeline", default=None)


@contextlib.contextmanager
def pipelining(request: Pipelining) -> Iterator[PipelineUse]:
  """Asks every ``parallel.layer_stack`` traced inside to pipeline as ``request`` says."""
  request.check()
  use = PipelineUse(request)
  token = _ACTIVE.set(use)
  try:
    yield use
  finally:
    _ACTIVE.reset(token)


def active_pipelining() -> PipelineUse | None:
  """The request of the enclosing ``pipelining``, or None."""
  return _ACTIVE.get()


_LAST: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("distrib_train_last_microbatch", default=None)


def last_microbatch() -> bool | jax.Array:
  """Whether the loss function being traced runs the step's last microbatch: a traced bool inside
  ``accumulate``, ``True`` anywhere else (one pass over the whole batch)."""
  last = _LAST.get()
  return True if last is None else last


def check_used(use: PipelineUse, model: Any) -> None:
  """Raises ValueError when the traced model ran no layer stack under the pipeline."""
  if not use.used:
    raise ValueError(
      f"The mesh has a stage axis of size {use.request.stages}, but the model ({type(model).__name__}) never"
      " ran its repeated layers through distrib_train.parallel.layer_stack, so nothing can be split into"
      " stages. Run the layer stack through layer_stack (layer params stacked on a leading dimension and a"
      " block function; see distrib_train/parallel/pipeline.py) or drop the stage axis from the mesh config."
    )


def _weight_of(aux: Any, key: str | None) -> jax.Array:
  if key is None:
    return jnp.ones((), jnp.float32)
  if not isinstance(aux, dict) or key not in aux:
    raise ValueError(
      f"microbatch_weight is {key!r}, but the loss function's aux has no such key"
      f" (its keys: {sorted(aux) if isinstance(aux, dict) else type(aux).__name__})."
    )
  weight = jnp.asarray(aux[key])
  if weight.shape != ():
    raise ValueError(f"microbatch_weight {key!r} must name a scalar in aux; it has shape {weight.shape}.")
  return weight.astype(jnp.float32)


def accumulate(
  grad_fn: Callable[..., Any],
  params: Any,
  loss_fn_state: Any,
  local_state: Any,
  rng: jax.Array | None,
  inputs: dict[str, Any],
  n: int,
  weight_key: str | None,
  input_shardings: dict[str, Any] | None = None,
) -> tuple[Any, Any, Any, Any]:
  """Gradients accumulated over ``n`` microbatches of ``inputs`` with a ``lax.scan``.

  ``grad_fn(params, loss_fn_state, local_state, rng, inputs) -> (grads, (loss_fn_state, local_state,
  aux))`` is one microbatch's gradient. Microbatch ``i`` gets ``fold_in(rng, i)``.

  Returns:
    ``(grads, loss_fn_state, local_state, aux)``: weighted-mean float32 gradients cast to the params'
    dtypes, the states after the last microbatch, and aux combined as the module docstring says.
  """
  check_batch(inputs, n)

  def place(name, leaf):
    parts = split(leaf, n)
    sharding = (input_shardings or {}).get(name)
    if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.spec) <= leaf.ndim:
      spec = jax.sharding.PartitionSpec(None, *sharding.spec)
      parts = jax.lax.with_sharding_constraint(parts, jax.sharding.NamedSharding(sharding.mesh, spec))
    return parts

  micro = {
    name: jax.tree_util.tree_map(lambda leaf, name=name: place(name, leaf), value) for name, value in inputs.items()
  }
  first = jax.tree_util.tree_map(lambda a: a[0], micro)
  aux_shape = jax.eval_shape(lambda: grad_fn(params, loss_fn_state, local_state, rng, first)[1][2])
  zeros = lambda tree: jax.tree_util.tree_map(
    lambda a: jnp.zeros(a.shape, jnp.float32 if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype), tree
  )

  def body(carry, xs):
    grad_sum, aux_sum, weight_sum, lfs, ls = carry
    i, batch = xs
    mb_rng = None if rng is None else jax.random.fold_in(rng, i)
    token = _LAST.set(i == n - 1)
    try:
      grads, (lfs, ls, aux) = grad_fn(params, lfs, ls, mb_rng, batch)
    finally:
      _LAST.reset(token)
    w = _weight_of(aux, weight_key)
    grad_sum = jax.tree_util.tree_map(lambda s, g: s + w * g.astype(jnp.float32), grad_sum, grads)
    aux_sum = jax.tree_util.tree_map(
      lambda s, a: s + w * a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else s + a, aux_sum, aux
    )
    return (grad_sum, aux_sum, weight_sum + w, lfs, ls), None

  carry = (zeros(params), zeros(aux_shape), jnp.zeros((), jnp.float32), loss_fn_state, local_state)
  (grad_sum, aux_sum, weight_sum, lfs, ls), _ = jax.lax.scan(body, carry, (jnp.arange(n), micro))
  total = jnp.maximum(weight_sum, jnp.finfo(jnp.float32).tiny)
  grads = jax.tree_util.tree_map(lambda g, p: (g / total).astype(p.dtype), grad_sum, params)

  def combine(path, s, shape):
    if weight_key is not None and path and getattr(path[0], "key", None) == weight_key and len(path) == 1:
      return weight_sum.astype(shape.dtype)
    if jnp.issubdtype(shape.dtype, jnp.floating):
      return (s / total).astype(shape.dtype)
    return s

  aux = jax.tree_util.tree_map_with_path(combine, aux_sum, aux_shape)
  return grads, lfs, ls, aux
