"""Pipeline parallelism: a model's repeated layers split into stages over the ``stage`` mesh axis.

A model runs its stack of repeated layers through ``layer_stack(block, x,
layers, ...)`` instead of its own ``jax.lax.scan``. Outside a pipeline (no
``stage`` axis, or a size-1 one) that is exactly a scan, or an unrolled loop,
over the stacked layers. Inside one (the train and eval steps ask for it,
``microbatches.pipelining``, when their mesh has a ``stage`` axis of size
> 1):

- the batch is split into ``microbatches`` strided microbatches (rows ``i,
  i + M, i + 2M, …``, so every device keeps its own rows);
- the ``L`` stacked layers are cut into ``stages × repeats`` contiguous
  chunks; chunk ``r · S + s`` runs on stage ``s`` in repeat ``r``;
- every iteration each stage runs its chunk on one microbatch (a ``vmap``
  over the stage dimension, sharded on ``stage``) and hands its output to
  the next stage (``jnp.roll`` on the stage-sharded dimension: XLA emits one
  collective-permute); the last stage's output wraps round to the first for
  the next repeat.

``repeats == 1`` is GPipe's schedule: ``M + S − 1`` iterations, a bubble
(idle share of each stage) of ``(S − 1) / (M + S − 1)``. ``repeats = R > 1``
is the circular (interleaved) schedule: each stage holds ``R`` chunks of
``L / (S·R)`` layers, a microbatch goes round the ring ``R`` times, and the
bubble is ``(S − 1) / (R·M + S − 1)`` for iterations ``R`` times shorter
(it needs ``M ≥ S``). The backward pass is the scan's transpose: all
forwards, then all backwards, as in GPipe; rematerialisation is the model's
(its blocks' ``remat``).

The stage's weights are gathered over the batch mesh axes (FSDP) once per
step, before the loop, instead of in every iteration (when the model gives
their ``layer_axes``); their gradients are accumulated in the weights' dtype
(float32 params: fp32) and reduce-scattered once.

What a model must provide (the pipeline protocol): its repeated layers as
one pytree of arrays stacked on a leading ``layers`` dimension, a
``block(x, layer, **per_example)`` function for one layer whose output has
``x``'s shape, and any per-example arrays the block reads (positions,
segment ids) with the batch as their leading dimension. A loss function
whose model never calls ``layer_stack`` under a pipeline gets a ValueError
saying so (``microbatches.check_used``).

Around the pipeline (embedding, head, loss) the batch is split over the
batch axes only, so every stage computes them, on the whole batch; the
embedding's and head's gradients are summed over the stage axis.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from distrib_train.microbatches import STAGE_AXIS, Pipelining, active_pipelining, merge, split
from distrib_train.sharding.axis_rules import active_activation_sharding


def _scan(
  block: Callable[..., jax.Array], x: jax.Array, layers: Any, per_example: Mapping[str, Any], scan: bool
) -> jax.Array:
  """The layers one after another (no pipeline)."""
  n = jax.tree_util.tree_leaves(layers)[0].shape[0]
  if scan:
    x, _ = jax.lax.scan(lambda h, layer: (block(h, layer, **per_example), None), x, layers)
    return x
  # Split, not index: the gradient of a split is one concatenate into the stacked array, where the
  # gradient of ``v[i]`` is a zero-padded copy per layer, summed (bench/NOTES.md, lever 10).
  parts = jax.tree_util.tree_map(lambda v: jnp.split(v, n, axis=0), layers)
  for i in range(n):
    x = block(x, jax.tree_util.tree_map(lambda p: p[i][0], parts, is_leaf=lambda v: isinstance(v, list)), **per_example)
  return x


def _spec(mesh: Any, dims: list[Any]) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec(*dims))


def layer_stack(
  block: Callable[..., jax.Array],
  x: jax.Array,
  layers: Any,
  *,
  per_example: Mapping[str, jax.Array | None] | None = None,
  scan: bool = True,
  layer_axes: Any = None,
) -> jax.Array:
  """Runs ``x`` through the stacked ``layers``: a scan, or the pipeline when one is active.

  Args:
    block: ``block(x, layer, **per_example) -> x`` for one layer (``layer``: ``layers`` without the
      leading dimension).
    x: the activations, batch first: an array, or a pytree of arrays that all have the batch first
      (e.g. the hidden states and per-example sums a layer adds to, such as a mixture of experts'
      auxiliary losses).
    layers: a pytree of arrays stacked on a leading layers dimension.
    per_example: arrays with the batch first that the block reads (None values are passed as None).
    scan: scan over the layers (one compiled block) or unroll them.
    layer_axes: the logical axes of each ``layers`` leaf (a matching pytree of tuples), so that the
      pipeline gathers each stage's weights over FSDP once per step; without them XLA places them.

  Returns:
    The activations after the last layer, shaped like ``x`` (the same pytree).
  """
  per_example = dict(per_example or {})
  given = {k: v for k, v in per_example.items() if v is not None}
  fixed = {k: None for k, v in per_example.items() if v is None}
  run = (lambda h, layer, **kw: block(h, layer, **kw, **fixed)) if fixed else block
  use = active_pipelining()
  if use is None or use.request.stages == 1:
    return _scan(run, x, layers, given, scan)
  use.used += 1
  return _pipelined(run, x, layers, given, scan, layer_axes, use.request)


def _batch_mesh_axes() -> tuple[str, ...]:
  """The mesh axes the active rules split the batch over (data, fsdp)."""
  rules = active_activation_sharding()
  if rules is None:
    return ()
  mesh, axis_rules = rules
  spec = axis_rules.spec(("batch",), mesh=mesh)[0]
  return () if spec is None else ((spec,) if isinstance(spec, str) else tuple(spec))


def _activation_dims(x_shape: tuple[int, ...], lead: int) -> list[Any]:
  """The spec entries of a microbatch activation [mb, ...] (batch axes on mb), after ``lead`` leading dims."""
  rules = active_activation_sharding()
  batch_axes = _batch_mesh_axes()
  rest = [PartitionSpec.UNCONSTRAINED] * (len(x_shape) - 1)
  if rules is None:
    return [None] * lead + [PartitionSpec.UNCONSTRAINED] + rest
  return [None] * lead + [batch_axes or None] + rest


def _stage_weight_sharding(config: Pipelining, leaf: jax.Array, axes: Any) -> NamedSharding:
  """[R, S, Lc, ...] weights: S on the stage axis; the rest by the rules with the batch (FSDP) axes dropped."""
  rest = [PartitionSpec.UNCONSTRAINED] * (leaf.ndim - 3)
  active = active_activation_sharding()
  if axes is not None and active is not None:
    mesh, rules = active
    drop = set(_batch_mesh_axes()) | {STAGE_AXIS}
    spec = rules.spec(tuple(axes)[1:], shape=leaf.shape[3:], mesh=mesh)
    rest = []
    for entry in spec:
      names = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
      kept = tuple(n for n in names if n not in drop)
      rest.append(kept if len(kept) > 1 else (kept[0] if kept else None))
  return _spec(config.mesh, [None, STAGE_AXIS, None] + rest)


def _pipelined(
  block: Callable[..., Any],
  x: Any,
  layers: Any,
  per_example: Mapping[str, jax.Array],
  scan: bool,
  layer_axes: Any,
  config: Pipelining,
) -> Any:
  s, m, r = config.stages, config.microbatches, config.repeats
  config.check(jax.tree_util.tree_leaves(x)[0].shape[0])
  leaves = jax.tree_util.tree_leaves(layers)
  n_layers = leaves[0].shape[0]
  if n_layers % (s * r):
    raise ValueError(
      f"The model's {n_layers} stacked layers (or periods of layers) do not split into stage axis"
      f" ({s}) × pipeline repeats ({r}) = {s * r} equal chunks; pick a stage size and"
      f" train.pipeline_repeats whose product divides {n_layers}."
    )
  per_chunk = n_layers // (s * r)
  mesh = config.mesh
  tmap = jax.tree_util.tree_map

  # Weights: [L, ...] → [R, S, L/(S·R), ...]; chunk r·S + s is stage s's in repeat r.
  chunked = tmap(lambda a: a.reshape(r, s, per_chunk, *a.shape[1:]), layers)
  flat, treedef = jax.tree_util.tree_flatten(chunked)
  axes = [None] * len(flat) if layer_axes is None else treedef.flatten_up_to(layer_axes)
  chunked = treedef.unflatten(
    [jax.lax.with_sharding_constraint(a, _stage_weight_sharding(config, a, ax)) for a, ax in zip(flat, axes)]
  )

  # Activations (a pytree whose leaves all have the batch first): [B, ...] → [M, mb, ...].
  xs = tmap(lambda a: jax.lax.with_sharding_constraint(split(a, m), _spec(mesh, _activation_dims(a.shape, 1))), x)
  examples = {k: split(v, m) for k, v in per_example.items()}
  on_stages = lambda a: jax.lax.with_sharding_constraint(
    a, _spec(mesh, [STAGE_AXIS] + _activation_dims(a.shape[1:], 0))
  )
  in_buffer = lambda a: jax.lax.with_sharding_constraint(
    a, _spec(mesh, [STAGE_AXIS, None] + _activation_dims(a.shape[2:], 0))
  )
  stage_ids = jnp.arange(s)

  def stage_fn(chunk, h, examples_s):
    return _scan(block, h, chunk, examples_s, scan)

  run_stages = jax.vmap(stage_fn, spmd_axis_name=STAGE_AXIS)

  def run_iteration(chunked, rep, inputs, examples_s):
    def pick(a):  # [R, S, Lc, ...] → [S, Lc, ...]: each stage's chunk for its repeat
      chosen = a[0]
      for k in range(1, r):
        chosen = jnp.where((rep == k).reshape((s,) + (1,) * (a.ndim - 2)), a[k], chosen)
      return chosen

    chunk = tmap(pick, chunked)
    return run_stages(chunk, inputs, examples_s)

  if r > 1:
    # The picked weights change every iteration: kept for the backward pass they would be a copy of the
    # stage's weights per iteration (140 GiB per chip for the 70B preset at R = 2, M = 16). Each iteration
    # keeps only its inputs instead, and the backward pass runs its forward again (one more forward).
    run_iteration = jax.checkpoint(run_iteration, policy=jax.checkpoint_policies.nothing_saveable)

  def iteration(carry, t):
    state, buffer = carry
    slot = t % m

    def first_input(x_all, buf, st):
      fresh = jnp.broadcast_to(jax.lax.dynamic_index_in_dim(x_all, slot, 0, keepdims=True), (s,) + x_all.shape[1:])
      if r > 1:  # a later repeat takes the microbatch back from the ring buffer
        fresh = jnp.where(t < m, fresh, jax.lax.dynamic_index_in_dim(buf, slot, 1, keepdims=False))
      is_first = (stage_ids == 0).reshape((s,) + (1,) * (st.ndim - 1))
      return on_stages(jnp.where(is_first, fresh, st))

    inputs = tmap(first_input, xs, buffer, state)
    work = t - stage_ids  # the work item each stage runs: microbatch work % M, repeat work // M
    rep = jnp.clip(work // m, 0, r - 1)
    micro = work % m
    examples_s = {k: jnp.take(v, micro, axis=0) for k, v in examples.items()}
    out = run_iteration(chunked, rep, inputs, examples_s)
    # Stage s's output to stage s + 1; the last stage's wraps round to stage 0 (one collective-permute).
    state = tmap(lambda a: on_stages(jnp.roll(a, 1, axis=0)), out)
    done = t - (s - 1)  # the work item the last stage just finished, now at row 0
    keep = jnp.where(done >= 0, done % m, 0)

    def store(buf, st):
      old = jax.lax.dynamic_index_in_dim(buf, keep, 1, keepdims=False)
      return in_buffer(jax.lax.dynamic_update_index_in_dim(buf, jnp.where(done >= 0, st, old), keep, 1))

    return (state, tmap(store, buffer, state)), None

  state = tmap(lambda a: on_stages(jnp.zeros((s,) + a.shape[1:], a.dtype)), xs)
  buffer = tmap(lambda a: in_buffer(jnp.zeros((s, m) + a.shape[1:], a.dtype)), xs)
  (_, buffer), _ = jax.lax.scan(iteration, (state, buffer), jnp.arange(r * m + s - 1))
  # Row 0 (stage 0's devices) holds every microbatch's last output.
  return tmap(
    lambda a: merge(jax.lax.with_sharding_constraint(a[0], _spec(mesh, _activation_dims(a.shape[2:], 1)))), buffer
  )
