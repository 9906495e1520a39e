"""Expert parallelism: routed tokens to the devices that hold their experts, by all-to-all, and back.

``dispatch(h, indices, weights, w_gate, w_up, w_down)`` runs a mixture of
SwiGLU experts on the tokens of ``h`` [batch, length, embed], each through
the experts ``indices`` [batch, length, k] names, weighted by ``weights``.
Outside a mesh (no ``activation_sharding``) it runs on the whole batch;
inside one it runs under ``shard_map`` over every mesh axis (in a pipeline,
``vmap`` adds the ``stage`` axis to its specs):

1. each device takes its own tokens (the batch is split over data, fsdp and
   ``expert``) and sorts its assignments (token, expert) by expert, so by the
   expert shard that holds the expert;
2. ``jax.lax.ragged_all_to_all`` over ``expert`` sends each shard only the
   rows routed to it; the receiver runs its experts' SwiGLU as grouped
   matmuls over the rows that arrived, sorted by its local expert and padded
   only to the kernel's tile (``grouped.swiglu``), its experts' weights
   gathered over the axes that split their embedding side (fsdp) and their
   hidden side split over ``tensor``;
3. a second ragged all-to-all returns the outputs (their partial sums over
   ``tensor`` added once home: a ``psum`` of the routed rows only), which
   are weighted and summed into each token.

Dropless (``capacity_factor`` 0) sends every assignment. What moves and
what the TPU and GPU kernels multiply follow the routing, but static shapes
size the receive buffer, the padded layout over it and the kernels' outputs
for the worst case (all of every shard's assignments to one shard: ``ep ×
tokens · k`` rows); the kernels skip the tiles past the rows that arrived
(on GPU they write zeros there), XLA:CPU's batched tiles do not. With ``capacity_factor`` cf
each expert takes at most ``ceil(cf · tokens · k / experts)`` of a device's
assignments; the rest are dropped (their weight is lost; counted per row)
and the receive buffer shrinks to ``cf`` times the mean. Without an expert
axis nothing moves and the layout holds the assignments exactly.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from distrib_train.microbatches import STAGE_AXIS
from distrib_train.kernels import grouped
from distrib_train.sharding.axis_rules import active_activation_sharding

EXPERT_AXIS = "expert"
EXPERT_OUTPUT = "expert_output"  # each assignment's expert output [tokens · k, embed], by its checkpoint name


def _axes(entry: Any) -> tuple[str, ...]:
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _positions(keys: jax.Array, groups: int) -> jax.Array:
  """Each element's rank among the elements with its key (keys in ``[0, groups]``), in order."""
  order = jnp.argsort(keys, stable=True)
  counts = jnp.bincount(keys, length=groups + 1)
  starts = jnp.cumsum(counts) - counts
  ranked = jnp.arange(keys.shape[0]) - starts[keys[order]]
  return jnp.zeros_like(keys).at[order].set(ranked)


def _exclusive(sizes: jax.Array) -> jax.Array:
  return jnp.cumsum(sizes) - sizes


def _exchange(x: jax.Array, rows: int, send_sizes: jax.Array, axis: str, platform: str) -> tuple[jax.Array, ...]:
  """``x`` [n, embed], sorted by destination shard with ``send_sizes`` [shards] rows each, to the shards: ``(what
  arrived [rows, embed] ordered by source, the sizes that arrived [shards])``.

  ``jax.lax.ragged_all_to_all`` moves only the rows sent. XLA:CPU has no such op, so there one ``all_to_all``
  of every chunk at its largest stands in for it, with the same result.
  """
  recv_sizes = jax.lax.all_to_all(send_sizes, axis, 0, 0, tiled=True)
  landed = jax.lax.all_to_all(_exclusive(recv_sizes), axis, 0, 0, tiled=True)  # my chunk's place at each shard
  return _ragged(x, rows, _exclusive(send_sizes), send_sizes, landed, recv_sizes, axis, platform), recv_sizes


def _ragged(x, rows, input_offsets, send_sizes, output_offsets, recv_sizes, axis, platform):
  out = jnp.zeros((rows, x.shape[1]), x.dtype)
  if platform != "cpu":
    return jax.lax.ragged_all_to_all(x, out, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis)
  shards, width = send_sizes.shape[0], min(x.shape[0], rows)  # no chunk outgrows the buffer it lands in
  j = jnp.arange(width)
  chunks = x.at[input_offsets[:, None] + j].get(mode="fill", fill_value=0)  # [shards, width, embed]
  chunks = jax.lax.all_to_all(chunks, axis, 0, 0, tiled=True)
  where = jax.lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)  # each source's chunk's place here
  target = jnp.where(j < recv_sizes[:, None], where[:, None] + j, rows)
  return out.at[target.reshape(-1)].set(chunks.reshape(shards * width, -1), mode="drop")


def _local(
  x: jax.Array,
  indices: jax.Array,
  weights: jax.Array,
  w_gate: jax.Array,
  w_up: jax.Array,
  w_down: jax.Array,
  biases: tuple[jax.Array, ...] | None,
  *,
  num_experts: int,
  capacity_factor: float,
  expert_axis: str | None,
  shards: int,
  gather_axes: tuple[str, ...],
  sum_axes: tuple[str, ...],
  platform: str,
  activation: Any,
  amax_axes: tuple[str, ...] = (),
) -> tuple[jax.Array, jax.Array]:
  """One device's part: ``x`` [rows, length, embed] of its tokens → (routed output, dropped per row).

  ``amax_axes``: the mesh axes one layer's tensors are split over, so FP8 scales (``model.fp8``) are whole
  tensors' (every axis but a pipeline's stage axis, whose stages hold other layers).
  """
  rows, length, d = x.shape
  k = indices.shape[-1]
  tokens = x.reshape(rows * length, d)
  experts = indices.reshape(-1).astype(jnp.int32)  # one assignment per (token, choice), token-major
  assigned = experts.shape[0]
  per_shard = num_experts // shards
  keep = jnp.ones((assigned,), bool)
  received = assigned * shards  # dropless: room for every assignment of every shard
  if capacity_factor > 0:
    capacity = max(1, math.ceil(capacity_factor * assigned / num_experts))
    keep = _positions(experts, num_experts) < capacity
    received = shards * min(assigned, per_shard * capacity)
  experts = jnp.where(keep, experts, num_experts)  # dropped ones: an expert that is not there
  for axis in gather_axes:  # the experts' embedding side, split over fsdp: gathered for the matmuls
    w_gate = jax.lax.all_gather(w_gate, axis, axis=1, tiled=True)
    w_up = jax.lax.all_gather(w_up, axis, axis=1, tiled=True)
    w_down = jax.lax.all_gather(w_down, axis, axis=2, tiled=True)
  gate_bias, up_bias, down_bias = biases if biases is not None else (None, None, None)
  run = lambda rows_in, groups, routed: grouped.swiglu(
    rows_in,
    groups,
    per_shard,
    w_gate,
    w_up,
    w_down,
    platform=platform,
    routed_rows=routed,
    amax_axes=amax_axes,
    activation=activation,
    gate_bias=gate_bias,
    up_bias=up_bias,
  )
  if expert_axis is None or shards == 1:
    back = run(tokens[jnp.arange(assigned) // k], experts, assigned)
  else:
    order = jnp.argsort(experts, stable=True)  # by expert, so by shard; dropped ones last, never sent
    counts = jnp.bincount(experts, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    send = tokens[order // k]
    sent = counts.reshape(shards, per_shard).sum(1)
    arrived, recv_sizes = _exchange(send, received, sent, expert_axis, platform)
    # what arrived is ordered by source, each source's rows by my local expert: each row's expert from the counts
    per_source = jax.lax.all_to_all(counts.reshape(shards, per_shard), expert_axis, 0, 0, tiled=True)
    runs = jnp.concatenate([per_source.reshape(-1), (received - jnp.sum(recv_sizes))[None]])
    labels = jnp.concatenate(
      [jnp.tile(jnp.arange(per_shard, dtype=jnp.int32), shards), jnp.array([per_shard], jnp.int32)]
    )
    local_expert = jnp.repeat(labels, runs, total_repeat_length=received)
    out = run(arrived, local_expert, assigned)
    home = jax.lax.all_to_all(_exclusive(sent), expert_axis, 0, 0, tiled=True)  # where each source sent from
    back_sorted = _ragged(out, assigned, _exclusive(recv_sizes), recv_sizes, home, sent, expert_axis, platform)
    back = jnp.zeros_like(back_sorted).at[order].set(back_sorted)
  for axis in sum_axes:  # the hidden side split over tensor: partial sums, added once the rows are back home
    back = jax.lax.psum(back, axis)
  if down_bias is not None:  # once, after the partial sums: each kept assignment's expert's bias
    back = back + jnp.where(keep[:, None], down_bias[jnp.minimum(experts, num_experts - 1)], 0).astype(back.dtype)
  back = checkpoint_name(back, EXPERT_OUTPUT)  # the router's gradient needs it: kept, not recomputed (moe.py)
  contribution = back * weights.reshape(-1)[:, None].astype(back.dtype)
  routed = contribution.reshape(rows * length, k, d).sum(axis=1).reshape(rows, length, d)
  dropped = jnp.sum((~keep).reshape(rows, length * k), axis=1).astype(jnp.float32)
  return routed, dropped


def dispatch(
  h: jax.Array,
  indices: jax.Array,
  weights: jax.Array,
  w_gate: jax.Array,
  w_up: jax.Array,
  w_down: jax.Array,
  *,
  capacity_factor: float = 0.0,
  activation: Any = None,
  biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The experts' output for ``h`` and the dropped assignments per batch row (module docstring).

  Args:
    h: [batch, length, embed] tokens.
    indices: [batch, length, k] expert ids per token.
    weights: [batch, length, k] their weights.
    w_gate, w_up: [experts, embed, expert_mlp]; w_down: [experts, expert_mlp, embed].
    capacity_factor: 0 for dropless, else the per-expert capacity over the mean load.
    activation: ``act(gate, up)`` of the experts' gated MLP (default SwiGLU).
    biases: the experts' ``(gate [experts, expert_mlp], up [experts, expert_mlp], down [experts, embed])``
      biases (gpt-oss), or None.
  """
  num_experts = w_gate.shape[0]
  options = dict(num_experts=num_experts, capacity_factor=capacity_factor, activation=activation or grouped.silu_gate)
  active = active_activation_sharding()
  if active is None:
    return _local(
      h,
      indices,
      weights,
      w_gate,
      w_up,
      w_down,
      biases,
      expert_axis=None,
      shards=1,
      gather_axes=(),
      sum_axes=(),
      platform=grouped.platform_of(),
      **options,
    )
  mesh, rules = active
  sizes = dict(mesh.shape)
  shards = sizes.get(EXPERT_AXIS, 1)
  if num_experts % shards:
    raise ValueError(
      f"The model's {num_experts} experts do not split over the expert axis ({shards}); pick an"
      " expert axis size that divides the number of experts."
    )
  batch = _axes(rules.spec(("batch",), shape=(h.shape[0],), mesh=mesh)[0])
  expert_spec = rules.spec(("expert", "embed", "expert_mlp"), shape=w_gate.shape, mesh=mesh)
  if _axes(expert_spec[0]) not in ((), (EXPERT_AXIS,)):
    raise ValueError(f"The rules split the experts over {expert_spec[0]!r}; only the expert axis can split them.")
  if shards > 1 and _axes(expert_spec[0]) != (EXPERT_AXIS,):
    raise ValueError(
      "The mesh has an expert axis but no rule maps the logical 'expert' axis onto it; add"
      " ('expert', 'expert') to the axis rules."
    )
  if shards > 1 and EXPERT_AXIS not in batch:
    raise ValueError(
      "The mesh has an expert axis but the batch is not split over it; the rules must map 'batch'"
      " onto it too (the shipped rules do: ('batch', ('data', 'fsdp', 'expert')))."
    )
  embed, hidden = _axes(expert_spec[1]), _axes(expert_spec[2])
  gate_spec = P(expert_spec[0], expert_spec[1], expert_spec[2])
  down_spec = P(expert_spec[0], expert_spec[2], expert_spec[1])
  tokens_spec = P(batch or None, None, None)
  manual = frozenset(mesh.axis_names)  # under a pipeline, vmap adds the stage axis to the specs
  # the hidden side's biases split as the weights are; the down projection's whole (added once, after the sums)
  bias_specs = None if biases is None else (P(expert_spec[0], expert_spec[2]),) * 2 + (P(None, None),)
  run = jax.shard_map(
    lambda *a: _local(
      *a,
      expert_axis=EXPERT_AXIS,
      shards=shards,
      gather_axes=embed,
      sum_axes=hidden,
      platform=grouped.platform_of(mesh),
      amax_axes=tuple(a for a in mesh.axis_names if a != STAGE_AXIS),
      **options,
    ),
    mesh=mesh,
    in_specs=(tokens_spec, tokens_spec, tokens_spec, gate_spec, gate_spec, down_spec, bias_specs),
    out_specs=(tokens_spec, P(batch or None)),
    axis_names=manual,
    check_vma=False,
  )
  return run(h, indices, weights, w_gate, w_up, w_down, biases)
