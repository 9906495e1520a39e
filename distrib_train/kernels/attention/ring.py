"""Attention over the ``context`` mesh axis: ring or all-gather, over XLA's tiles.

With a ``context`` axis of size ``C`` > 1 the shipped rules split the
``length`` of every activation over it (inputs, norms, MLP and loss run on a
device's own tokens). Attention needs every earlier key of a sequence, so
``attention(q, k, v, positions, segment_ids)`` runs under ``shard_map``:

- ``ring`` (the default): each device keeps its queries and passes its key
  and value block round the axis with ``ppermute``, ``C`` steps, combining
  the blocks with an online softmax (float32); XLA overlaps each step's
  permute with the previous block's compute. Memory: one key/value block in
  flight; traffic: every device sends ``C − 1`` blocks.
- ``all_gather``: the keys and values of the whole sequence are gathered on
  every device and attended in one block. The same bytes arrive, in one
  collective with no overlap and ``C`` times the key/value memory; pick it
  for short sequences or a small axis, where the ring's ``C`` steps cost
  more than they hide. On TPU it runs splash instead of these tiles
  (``kernels/attention/splash.context_splash_attention``).

Scores are computed in rematerialized tiles of at most ``block`` × ``block``
(1024 by default) query and key positions per head, one tile at a time
(``kernels/attention/xla.fold``, which attention without a context axis
runs too), so attention's memory grows linearly with the sequence, as with
flash attention kernels; on TPU and GPU the tiles are XLA's (fused kernels
such as splash or cuDNN would need a differentiable log-sum-exp per block,
which neither exposes).

The mask comes from the tokens' true positions and segment ids (a key is
seen if it is in the query's segment and not after it), so packed documents
stay apart across chunks and RoPE uses the true positions.

The order of the tokens (load-balanced causal masks) is ``sharding/context.py``'s.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from distrib_train.kernels.attention import xla
from distrib_train.sharding.axis_rules import active_activation_sharding
from distrib_train.sharding.context import CONTEXT_AXIS


def _local(
  q, k, v, pos, seg, sinks, *, size: int, implementation: str, block: int, scale: float, window: int, softcap: float
):
  qg = xla.grouped(q, k.shape[2], scale)
  state = xla.online_start(qg, v.shape[-1], sinks)
  options = dict(window=window, softcap=softcap)
  if implementation == "all_gather":
    gather = lambda a: jax.lax.all_gather(a, CONTEXT_AXIS, axis=1, tiled=True)
    state = xla.fold(
      qg, gather(k), gather(v), pos, gather(pos), seg, None if seg is None else gather(seg), state, block, **options
    )
  else:
    ring = [(i, (i + 1) % size) for i in range(size)]
    chunk = (k, v, pos, seg)
    for step in range(size):
      k_b, v_b, pos_b, seg_b = chunk
      state = xla.fold(qg, k_b, v_b, pos, pos_b, seg, seg_b, state, block, **options)
      if step < size - 1:
        chunk = jax.tree_util.tree_map(lambda a: jax.lax.ppermute(a, CONTEXT_AXIS, ring), chunk)
  return xla.online_result(state, q.dtype)


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  positions: jax.Array,
  segment_ids: jax.Array | None,
  implementation: str = "ring",
  block: int = 1024,
  *,
  window: int = 0,
  scale: float | None = None,
  softcap: float = 0.0,
  sinks: jax.Array | None = None,
) -> jax.Array:
  """Causal attention of ``q`` [batch, length, heads, dim] over ``k``, ``v`` [batch, length, kv_heads, dim]
  with the length split over the context axis (module docstring); grouped-query heads allowed. Scores are
  computed in tiles of at most ``block`` queries × ``block`` keys (``kernels/attention/xla.fold``). ``window``
  (keys a query sees, its own included; 0: all), ``scale`` (default 1/√dim), ``softcap`` and per-head ``sinks``
  [heads] as in ``kernels/attention/dispatch.py``."""
  if implementation not in ("ring", "all_gather"):
    raise ValueError(f"context attention must be 'ring' or 'all_gather', got {implementation!r}.")
  mesh, rules = active_activation_sharding()
  size = int(mesh.shape[CONTEXT_AXIS])
  spec = lambda axes, shape: rules.spec(axes, shape=shape, mesh=mesh)
  q_spec = spec(("batch", "length", "heads", "head_dim"), q.shape)
  kv_spec = spec(("batch", "length", "kv_heads", "head_dim"), k.shape)
  if q_spec[2] != kv_spec[2]:  # query and key heads must split alike for the grouped heads to line up
    q_spec = kv_spec = P(q_spec[0], q_spec[1], None, None)
  token_spec = P(q_spec[0], q_spec[1])
  if q_spec[1] is None or CONTEXT_AXIS not in ((q_spec[1],) if isinstance(q_spec[1], str) else q_spec[1]):
    raise ValueError(
      "The mesh has a context axis but the rules do not split the logical 'length' axis over it;"
      " add ('length', 'context') to the axis rules (the shipped rules have it)."
    )
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  run = jax.shard_map(
    lambda q, k, v, pos, seg, sinks: _local(
      q,
      k,
      v,
      pos,
      seg,
      sinks,
      size=size,
      implementation=implementation,
      block=block,
      scale=scale,
      window=window,
      softcap=softcap,
    ),
    mesh=mesh,
    in_specs=(
      q_spec,
      kv_spec,
      kv_spec,
      token_spec,
      None if segment_ids is None else token_spec,
      None if sinks is None else P(q_spec[2]),
    ),
    out_specs=q_spec,
    axis_names=frozenset(mesh.axis_names),
    check_vma=False,
  )
  return run(q, k, v, positions, segment_ids, sinks)
