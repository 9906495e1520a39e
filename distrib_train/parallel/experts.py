"""Expert parallelism: routed tokens to the devices that hold their experts, by all-to-all, and back.

``dispatch(h, indices, weights, w_gate, w_up, w_down)`` runs a mixture of
SwiGLU experts on the tokens of ``h`` [batch, length, embed], each through
the experts ``indices`` [batch, length, k] names, weighted by ``weights``.
Outside a mesh (no ``activation_sharding``) it runs on the whole batch;
inside one it runs under ``shard_map`` over every mesh axis (in a pipeline,
``vmap`` adds the ``stage`` axis to its specs):

1. each device takes its own tokens (the batch is split over data, fsdp and
   ``expert``) and orders its assignments (token, expert) by the expert
   shard that holds the expert: a [expert shards, slots, embed] send buffer;
2. one ``all_to_all`` over ``expert`` delivers them; the receiver sorts what
   it got by its local expert and runs the SwiGLU as three grouped matmuls
   (``jax.lax.ragged_dot``), its experts' weights gathered over the axes
   that split their embedding side (fsdp) and its hidden side split over
   ``tensor`` (a ``psum`` after the down projection);
3. a second ``all_to_all`` returns the outputs, which are weighted and
   summed into each token.

Dropless (``capacity_factor`` 0) sends every assignment, so the buffers have
room for the worst case, all of a device's assignments to one shard: ``ep ×
tokens · k × embed`` values per device. With ``capacity_factor`` cf each
expert takes at most ``ceil(cf · tokens · k / experts)`` of a device's
assignments; the rest are dropped (their weight is lost; counted per row)
and the buffers shrink to ``cf`` times the mean.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from distrib_train.microbatches import STAGE_AXIS
from distrib_train.recipes import fp8
from distrib_train.sharding.axis_rules import active_activation_sharding

EXPERT_AXIS = "expert"


def _axes(entry: Any) -> tuple[str, ...]:
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _positions(keys: jax.Array, groups: int) -> jax.Array:
  """Each element's rank among the elements with its key (keys in ``[0, groups]``), in order."""
  order = jnp.argsort(keys, stable=True)
  counts = jnp.bincount(keys, length=groups + 1)
  starts = jnp.cumsum(counts) - counts
  ranked = jnp.arange(keys.shape[0]) - starts[keys[order]]
  return jnp.zeros_like(keys).at[order].set(ranked)


def _local(x: jax.Array, indices: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
           w_down: jax.Array, *, num_experts: int, capacity_factor: float, expert_axis: str | None, shards: int,
           gather_axes: tuple[str, ...], sum_axes: tuple[str, ...],
           amax_axes: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
  """One device's part: ``x`` [rows, length, embed] of its tokens → (routed output, dropped per row).

  ``amax_axes``: the mesh axes one layer's tensors are split over, so FP8 scales (``model.fp8``) are whole
  tensors' (every axis but a pipeline's stage axis, whose stages hold other layers).
  """
  rows, length, d = x.shape
  k = indices.shape[-1]
  tokens = x.reshape(rows * length, d)
  experts = indices.reshape(-1).astype(jnp.int32)  # one assignment per (token, choice)
  assigned = experts.shape[0]
  token_of = jnp.arange(assigned) // k
  per_shard = num_experts // shards
  if capacity_factor > 0:
    capacity = max(1, math.ceil(capacity_factor * assigned / num_experts))
    keep = _positions(experts, num_experts) < capacity
    slots = min(assigned, per_shard * capacity)
  else:
    keep = jnp.ones((assigned,), bool)
    slots = assigned
  shard = jnp.where(keep, experts // per_shard, shards)  # dropped ones go to a shard that is not there
  slot = _positions(shard, shards)
  send = jnp.zeros((shards, slots, d), x.dtype).at[shard, slot].set(tokens[token_of], mode="drop")
  send_expert = jnp.full((shards, slots), per_shard, jnp.int32).at[shard, slot].set(experts % per_shard,
                                                                                     mode="drop")
  if expert_axis is not None and shards > 1:
    send = jax.lax.all_to_all(send, expert_axis, 0, 0, tiled=True)
    send_expert = jax.lax.all_to_all(send_expert, expert_axis, 0, 0, tiled=True)
  for axis in gather_axes:  # the experts' embedding side, split over fsdp: gathered for the matmuls
    w_gate = jax.lax.all_gather(w_gate, axis, axis=1, tiled=True)
    w_up = jax.lax.all_gather(w_up, axis, axis=1, tiled=True)
    w_down = jax.lax.all_gather(w_down, axis, axis=2, tiled=True)
  received = send.reshape(shards * slots, d)
  local_expert = send_expert.reshape(-1)
  order = jnp.argsort(local_expert, stable=True)  # empty slots (local_expert == per_shard) last
  sizes = jnp.bincount(local_expert, length=per_shard + 1)[:per_shard].astype(jnp.int32)
  grouped = received[order]
  dot = lambda a, w: fp8.ragged_dot(a, w, sizes, amax_axes)
  hidden = jax.nn.silu(dot(grouped, w_gate)) * dot(grouped, w_up)
  out = dot(hidden, w_down)
  for axis in sum_axes:  # the hidden side split over tensor: partial sums
    out = jax.lax.psum(out, axis)
  out = jnp.zeros_like(out).at[order].set(out).reshape(shards, slots, d)
  if expert_axis is not None and shards > 1:
    out = jax.lax.all_to_all(out, expert_axis, 0, 0, tiled=True)
  back = out.at[shard, slot].get(mode="fill", fill_value=0)  # [assigned, d]; dropped: 0
  contribution = back * weights.reshape(-1)[:, None].astype(back.dtype)
  routed = jnp.zeros_like(tokens).at[token_of].add(contribution).reshape(rows, length, d)
  dropped = jnp.sum((~keep).reshape(rows, length * k), axis=1).astype(jnp.float32)
  return routed, dropped


def dispatch(h: jax.Array, indices: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
             w_down: jax.Array, *, capacity_factor: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """The experts' output for ``h`` and the dropped assignments per batch row (module docstring).

  Args:
    h: [batch, length, embed] tokens.
    indices: [batch, length, k] expert ids per token.
    weights: [batch, length, k] their weights.
    w_gate, w_up: [experts, embed, expert_mlp]; w_down: [experts, expert_mlp, embed].
    capacity_factor: 0 for dropless, else the per-expert capacity over the mean load.
  """
  num_experts = w_gate.shape[0]
  options = dict(num_experts=num_experts, capacity_factor=capacity_factor)
  active = active_activation_sharding()
  if active is None:
    return _local(h, indices, weights, w_gate, w_up, w_down, expert_axis=None, shards=1, gather_axes=(),
                  sum_axes=(), **options)
  mesh, rules = active
  sizes = dict(mesh.shape)
  shards = sizes.get(EXPERT_AXIS, 1)
  if num_experts % shards:
    raise ValueError(f"The model's {num_experts} experts do not split over the expert axis ({shards}); pick an"
                     " expert axis size that divides the number of experts.")
  batch = _axes(rules.spec(("batch",), shape=(h.shape[0],), mesh=mesh)[0])
  expert_spec = rules.spec(("expert", "embed", "expert_mlp"), shape=w_gate.shape, mesh=mesh)
  if _axes(expert_spec[0]) not in ((), (EXPERT_AXIS,)):
    raise ValueError(f"The rules split the experts over {expert_spec[0]!r}; only the expert axis can split them.")
  if shards > 1 and _axes(expert_spec[0]) != (EXPERT_AXIS,):
    raise ValueError("The mesh has an expert axis but no rule maps the logical 'expert' axis onto it; add"
                     " ('expert', 'expert') to the axis rules.")
  if shards > 1 and EXPERT_AXIS not in batch:
    raise ValueError("The mesh has an expert axis but the batch is not split over it; the rules must map 'batch'"
                     " onto it too (the shipped rules do: ('batch', ('data', 'fsdp', 'expert'))).")
  embed, hidden = _axes(expert_spec[1]), _axes(expert_spec[2])
  gate_spec = P(expert_spec[0], expert_spec[1], expert_spec[2])
  down_spec = P(expert_spec[0], expert_spec[2], expert_spec[1])
  tokens_spec = P(batch or None, None, None)
  manual = frozenset(mesh.axis_names)  # under a pipeline, vmap adds the stage axis to the specs
  run = jax.shard_map(
      lambda *a: _local(*a, expert_axis=EXPERT_AXIS, shards=shards, gather_axes=embed, sum_axes=hidden,
                        amax_axes=tuple(a for a in mesh.axis_names if a != STAGE_AXIS), **options),
      mesh=mesh, in_specs=(tokens_spec, tokens_spec, tokens_spec, gate_spec, gate_spec, down_spec),
      out_specs=(tokens_spec, P(batch or None)), axis_names=manual, check_vma=False)
  return run(h, indices, weights, w_gate, w_up, w_down)
