"""Attention in plain XLA: the decode step's kernel, and training's and scoring's where no fused one serves.

The project's own XLA attentions are built here from two pieces,
``scores`` (grouped queries against keys: scaled, soft-capped, float32) and
``visible`` (causal attention's mask from positions: a window, packed
documents' segments), in one of two forms (where none of what they add is
needed, ``dispatch.py`` runs jax's own ``dot_product_attention``):

- ``masked_attention(q, keys, values, seen, …)``: one softmax over the
  [queries, slots] scores of ``q`` [batch, queries, heads, qk_dim] against
  ``keys`` [batch, slots, kv_heads, qk_dim] and ``values`` [batch, slots,
  kv_heads, v_dim], grouped-query heads, where ``seen`` [batch, queries,
  slots] says which keys each query sees. The caller decides the mask: a
  cache's causal order, a sliding window's ring and a left-padded row's
  pads (``generation/cache.py``), a training row's or a scoring tree's
  (``dispatch.reference_attention``), a query chunk's (the plan's stand-in
  for cuDNN, ``podplan/cpu_attention.py``). It runs what the fused kernels
  run on a layer's scores: a softmax scale, a soft cap, per-head sinks
  (gpt-oss). Scores, softmax and the weighted sum accumulate in float32 (at
  decode, one pass over the cache: the bytes read are the work).
- ``tiled_attention``: the same causal attention in rematerialized tiles of
  online softmax (``fold``), so that no [length, length] scores are kept:
  flash attention's memory. ``ring.py`` folds the same tiles
  over the blocks a context axis passes round.

**At decode, the bandwidth is the work.** Two choices bring libtpu's
estimate of the step near its own for only reading the weights and the
cache (``bench/generation.py tpu``):
- each kv head's queries (its group × the queries) are padded to at least
  two rows, eight on a TPU. With one query per kv head (multi-head
  attention at decode: Llama 2's 7B), the scores are a matrix-vector
  product, which XLA rewrites as a multiply and a reduce over the head
  dimension on the vector unit: 0.26 × the bandwidth on a probe (16 rows ×
  4,096 slots, 4 kv heads); as a matrix of two rows it runs on the matrix
  unit. On a TPU, eight rows (the matrix unit's tile has eight sublanes)
  take libtpu's estimate of the step from 13.86 to 12.99 ms (the 7B, 16 ×
  4,096) and from 16.00 to 15.06 ms (Qwen3-8B's four query heads a kv head,
  64 × 4,096); their float32 scores stay in VMEM. The padded rows are
  dropped.
- the new token's scores (``new``) join the cache's in one softmax without
  being concatenated to them: ``slots + 1`` keys are not a multiple of the
  128 lanes, and the copies that would pad them cost as much as the
  attention.

DeepSeek-V3's MLA decodes through it with one key/value head: the queries
absorbed into the latent (``q_nope · W_uk`` beside ``q_rope``), the cached
latent and rotary key as the keys, the latent as the values
(``generation/cache.py``).

Not for: choosing a layer's kernel (``dispatch.py``); the context axis's ring (``ring.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from distrib_train.sharding.axis_rules import active_device

MASKED = -1e30  # a masked score: finite, so a query (or a tile) with nothing visible gives no NaN


def _min_rows() -> int:
  """The query rows each kv head's product has at least (module docstring): 8 on a TPU, 2 elsewhere."""
  return 8 if active_device().platform == "tpu" else 2


def masked_attention(
  q: jax.Array,
  keys: jax.Array,
  values: jax.Array,
  seen: jax.Array,
  *,
  scale: float,
  softcap: float = 0.0,
  sinks: jax.Array | None = None,
  new: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """Attention of ``q`` over the visible keys → [batch, queries, heads, v_dim] in ``q``'s dtype.

  Args:
    q: [batch, queries, heads, qk_dim]; ``heads`` a multiple of the cache's ``kv_heads``.
    keys: [batch, slots, kv_heads, qk_dim].
    values: [batch, slots, kv_heads, v_dim].
    seen: [batch, queries, slots] bool (or broadcastable to it): which keys each query sees.
    scale: the softmax scale.
    softcap: scores become ``softcap · tanh(scores / softcap)`` before the softmax (0: off).
    sinks: [heads] a logit per head that joins each softmax and is then dropped (None: none).
    new: the queries' own keys [batch, queries, kv_heads, qk_dim] and values, seen by every query (causally
      among themselves), apart from ``keys`` and ``values``: a decode step's token, not yet in the cache it reads,
      so the cache is read once and written in place rather than copied with the token in it.
  """
  batch, queries, heads, qk_dim = q.shape
  kv_heads = keys.shape[2]
  groups = heads // kv_heads
  qg = q.reshape(batch, queries, kv_heads, groups, qk_dim)
  rows = groups * queries
  if rows < (least := _min_rows()):  # a matrix-vector product, or a sliver of the matrix unit's tile: padded
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, -(-least // queries) - groups), (0, 0)))
  # each part's scores [batch, kv_heads, groups, queries, its slots], one softmax over all
  seen = jnp.broadcast_to(seen, (batch, queries, keys.shape[1]))[:, None, None]
  parts = [jnp.where(seen, scores(qg, keys, scale, softcap), MASKED)]
  if new is not None:
    order = jnp.arange(queries)[None]
    parts.append(jnp.where(visible(order, order)[:, None, None], scores(qg, new[0], scale, softcap), MASKED))
  top = functools.reduce(jnp.maximum, [p.max(-1, keepdims=True) for p in parts])
  padded_groups = qg.shape[3]
  if sinks is not None:
    sink = jnp.pad(sinks.astype(jnp.float32).reshape(kv_heads, groups), ((0, 0), (0, padded_groups - groups)))
    sink = sink.reshape(1, kv_heads, padded_groups, 1, 1)
    top = jnp.maximum(top, sink)
  top = jax.lax.stop_gradient(top)  # the softmax does not depend on it (as in jax.nn.softmax)
  weights = [jnp.exp(p - top) for p in parts]
  total = sum(w.sum(-1, keepdims=True) for w in weights)
  if sinks is not None:
    total = total + jnp.exp(sink - top)
  out = sum(
    jnp.einsum("bkgqs,bskd->bqkgd", (w / total).astype(v.dtype), v, preferred_element_type=jnp.float32)
    for w, v in zip(weights, [values] + ([new[1]] if new is not None else []))
  )
  return out[:, :, :, :groups].reshape(batch, queries, heads, values.shape[-1]).astype(q.dtype)


def scores(qg: jax.Array, keys: jax.Array, scale: float, softcap: float = 0.0) -> jax.Array:
  """Grouped queries ``qg`` [batch, queries, kv_heads, groups, qk_dim] against ``keys`` [batch, slots, kv_heads,
  qk_dim] → [batch, kv_heads, groups, queries, slots] float32, scaled and (``softcap``) soft-capped."""
  out = jnp.einsum("bqkgd,bskd->bkgqs", qg, keys, preferred_element_type=jnp.float32) * scale
  return softcap * jnp.tanh(out / softcap) if softcap else out


def visible(
  query_positions: jax.Array,
  key_positions: jax.Array,
  *,
  window: int = 0,
  query_segments: jax.Array | None = None,
  key_segments: jax.Array | None = None,
) -> jax.Array:
  """Causal attention's mask [batch, queries, keys]: a key is seen if its position is not after the query's,
  fewer than ``window`` positions before it (0: any; HF's rule, the query's own key included) and, with
  segments, in the query's segment (a packed document). Positions [batch or 1, n]. The tiles, the reference
  (``dispatch.reference_attention``) and the plan's stand-in for cuDNN read their masks here; a cache's decode
  step builds its own over slots (``generation/cache.py``)."""
  seen = key_positions[:, None, :] <= query_positions[:, :, None]
  if window:
    seen &= query_positions[:, :, None] - key_positions[:, None, :] < window
  if query_segments is not None:
    seen &= key_segments[:, None, :] == query_segments[:, :, None]
  return seen


def fold_block(q, k, v, pos_q, pos_k, seg_q, seg_k, state, window: int = 0, softcap: float = 0.0):
  """Folds one key/value block into the online softmax ``state`` = (max, sum, accumulator); ``q`` grouped,
  float32 and already scaled."""
  m, l, acc = state
  seen = visible(pos_q, pos_k, window=window, query_segments=seg_q, key_segments=seg_k)[:, None, None]
  block_scores = jnp.where(seen, scores(q, k.astype(jnp.float32), 1.0, softcap), MASKED)
  m_new = jnp.maximum(m, jnp.max(block_scores, axis=-1))
  p = jnp.where(seen, jnp.exp(block_scores - m_new[..., None]), 0.0)
  correction = jnp.exp(m - m_new)
  l = l * correction + jnp.sum(p, axis=-1)
  acc = acc * jnp.moveaxis(correction, 3, 1)[..., None] + jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32))
  return m_new, l, acc


def _divisor_at_most(n: int, target: int) -> int:
  return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def fold(q, k, v, pos_q, pos_k, seg_q, seg_k, state, block: int, window: int = 0, softcap: float = 0.0):
  """Folds a whole key/value block into ``state`` in tiles of at most ``block`` queries × ``block`` keys.

  Each tile is rematerialized and the tiles run one after another (``lax.map`` over query tiles, ``lax.scan``
  over key tiles), so the largest score array, forward or backward, is [block × block] per head whatever the
  sequence length: the memory of flash attention, in plain XLA.
  """
  batch, q_len = q.shape[:2]
  k_len = k.shape[1]
  tq, tk = _divisor_at_most(q_len, block), _divisor_at_most(k_len, block)
  tiles = lambda a, t, axis: (
    None
    if a is None
    else jnp.moveaxis(a.reshape(*a.shape[:axis], a.shape[axis] // t, t, *a.shape[axis + 1 :]), axis, 0)
  )
  untile = lambda a, axis: jnp.moveaxis(a, 0, axis).reshape(*a.shape[1 : axis + 1], -1, *a.shape[axis + 2 :])
  # keep the tiles' inputs, not their [q, k] scores, for the backward pass
  fold_tile = jax.checkpoint(functools.partial(fold_block, window=window, softcap=softcap))
  key_tiles = (tiles(k, tk, 1), tiles(v, tk, 1), tiles(pos_k, tk, 1), tiles(seg_k, tk, 1))

  def one_query_tile(xs):
    q_t, pos_t, seg_t, m, l, acc = xs

    def over_keys(state, kv):
      k_t, v_t, posk_t, segk_t = kv
      return fold_tile(q_t, k_t, v_t, pos_t, posk_t, seg_t, segk_t, state), None

    return jax.lax.scan(over_keys, (m, l, acc), key_tiles)[0]

  m, l, acc = state
  xs = (tiles(q, tq, 1), tiles(pos_q, tq, 1), tiles(seg_q, tq, 1), tiles(m, tq, 3), tiles(l, tq, 3), tiles(acc, tq, 1))
  m, l, acc = jax.lax.map(one_query_tile, xs)
  return untile(m, 3), untile(l, 3), untile(acc, 1)


def online_start(qg: jax.Array, v_dim: int, sinks: jax.Array | None = None) -> tuple[jax.Array, ...]:
  """The online softmax's state before any key, for grouped queries ``qg`` [batch, length, kv_heads, groups, _]:
  (max, sum) [batch, kv_heads, groups, length] and the accumulator [batch, length, kv_heads, groups, v_dim]. A
  sink is a key every query sees whose value is zero: the softmax starts from it."""
  batch, length, kv, groups = qg.shape[:4]
  shape = (batch, kv, groups, length)
  if sinks is None:
    top, total = jnp.full(shape, MASKED, jnp.float32), 0.0
  else:
    top, total = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv, groups, 1), shape), 1.0
  return top, jnp.full(shape, total, jnp.float32), jnp.zeros((batch, length, kv, groups, v_dim), jnp.float32)


def online_result(state: tuple[jax.Array, ...], dtype) -> jax.Array:
  """The attention the folded ``state`` holds → [batch, length, heads, v_dim] in ``dtype``."""
  _, total, acc = state
  out = acc / jnp.moveaxis(jnp.maximum(total, 1e-30), 3, 1)[..., None]
  batch, length, kv, groups, v_dim = out.shape
  return out.reshape(batch, length, kv * groups, v_dim).astype(dtype)


def grouped(q: jax.Array, kv_heads: int, scale: float) -> jax.Array:
  """``q`` [batch, length, heads, dim] as float32 [batch, length, kv_heads, heads // kv_heads, dim], scaled."""
  batch, length, heads, dim = q.shape
  return q.astype(jnp.float32).reshape(batch, length, kv_heads, heads // kv_heads, dim) * scale


def tiled_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  positions: jax.Array | None,
  segment_ids: jax.Array | None,
  *,
  block: int = 1024,
  scale: float | None = None,
  window: int = 0,
  softcap: float = 0.0,
  sinks: jax.Array | None = None,
) -> jax.Array:
  """Causal attention of ``q`` [batch, length, heads, qk_dim] over ``k``, ``v`` [batch, length, kv_heads, _]
  in rematerialized tiles of online softmax (``fold``): the memory of flash attention in plain XLA, for what no
  fused kernel runs (``dispatch.py``). ``ring.py`` folds the same tiles over a context axis."""
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  qg = grouped(q, k.shape[2], scale)
  state = fold(
    qg,
    k,
    v,
    positions,
    positions,
    segment_ids,
    segment_ids,
    online_start(qg, v.shape[-1], sinks),
    block,
    window=window,
    softcap=softcap,
  )
  return online_result(state, q.dtype)
