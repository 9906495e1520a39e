"""Attention in plain XLA over an explicit mask: the decode step's kernel, and training's where no fused one serves.

``masked_attention(q, keys, values, visible, …)`` computes softmax
attention of ``q`` [batch, queries, heads, qk_dim] over ``keys`` [batch,
slots, kv_heads, qk_dim] and ``values`` [batch, slots, kv_heads, v_dim],
grouped-query heads, where ``visible`` [batch, queries, slots] says which
keys each query sees. The caller decides the mask: a cache's causal order,
a sliding window's ring and a left-padded row's pads
(``generation/cache.py``), or a training row's causal, windowed, per-document
mask (``dispatch.reference_attention``); this kernel knows nothing of
positions. It runs what the fused kernels run on a layer's scores: a
softmax scale, a soft cap, per-head sinks (gpt-oss). Scores, softmax and
the weighted sum accumulate in float32 (at decode, one pass over the cache:
the bytes read are the work).

**At decode, the bandwidth is the work.** Two choices keep libtpu's
program at the cache's bandwidth (``bench/generation.py tpu``):
- each kv head's queries (its group × the queries) are padded to at least
  two rows. With one query per kv head (multi-head attention at decode:
  Llama 2's 7B), the scores are a matrix-vector product, which XLA
  rewrites as a multiply and a reduce over the head dimension on the
  vector unit: 0.26 × the bandwidth on a probe (16 rows × 4,096 slots,
  4 kv heads). As a matrix of two rows it runs on the matrix unit at
  1.0 ×. The padded row is dropped.
- the new token's scores (``new``) join the cache's in one softmax without
  being concatenated to them: ``slots + 1`` keys are not a multiple of the
  128 lanes, and the copies that would pad them cost as much as the
  attention.

DeepSeek-V3's MLA decodes through it with one key/value head: the queries
absorbed into the latent (``q_nope · W_uk`` beside ``q_rope``), the cached
latent and rotary key as the keys, the latent as the values
(``generation/cache.py``).

Not for: choosing a layer's kernel (``dispatch.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite: a query with nothing visible gives no NaN (its row is never read)
NEGATIVE = -1e30  # a masked score in a tile: finite, so a block with nothing to see gives no NaN
_MIN_ROWS = 2  # the query rows each kv head's product has at least (module docstring)


def masked_attention(q: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array, *, scale: float,
                     softcap: float = 0.0, sinks: jax.Array | None = None,
                     new: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
  """Attention of ``q`` over the visible keys → [batch, queries, heads, v_dim] in ``q``'s dtype.

  Args:
    q: [batch, queries, heads, qk_dim]; ``heads`` a multiple of the cache's ``kv_heads``.
    keys: [batch, slots, kv_heads, qk_dim].
    values: [batch, slots, kv_heads, v_dim].
    visible: [batch, queries, slots] bool (or broadcastable to it).
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
  if rows < _MIN_ROWS:  # a matrix-vector product: padded to a matrix (module docstring)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, -(-_MIN_ROWS // queries) - groups), (0, 0)))
  scores = _scores(qg, keys, scale, softcap)
  scores = jnp.where(jnp.broadcast_to(visible, (batch, queries, keys.shape[1]))[:, None, None], scores, _MASKED)
  parts = [scores]  # each part's scores [batch, kv_heads, groups, queries, its slots], one softmax over all
  if new is not None:
    causal = jnp.arange(queries)[None, :] <= jnp.arange(queries)[:, None]
    parts.append(jnp.where(causal, _scores(qg, new[0], scale, softcap), _MASKED))
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
  out = sum(jnp.einsum("bkgqs,bskd->bqkgd", (w / total).astype(v.dtype), v, preferred_element_type=jnp.float32)
            for w, v in zip(weights, [values] + ([new[1]] if new is not None else [])))
  return out[:, :, :, :groups].reshape(batch, queries, heads, values.shape[-1]).astype(q.dtype)


def _scores(qg: jax.Array, keys: jax.Array, scale: float, softcap: float) -> jax.Array:
  scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, keys, preferred_element_type=jnp.float32) * scale
  return softcap * jnp.tanh(scores / softcap) if softcap else scores


def fold_block(q, k, v, pos_q, pos_k, seg_q, seg_k, state, window: int = 0, softcap: float = 0.0):
  """Folds one key/value block into the online softmax ``state`` = (max, sum, accumulator)."""
  m, l, acc = state
  scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k.astype(jnp.float32))
  if softcap:
    scores = softcap * jnp.tanh(scores / softcap)
  visible = pos_k[:, None, None, None, :] <= pos_q[:, None, None, :, None]
  if window:
    visible &= pos_q[:, None, None, :, None] - pos_k[:, None, None, None, :] < window
  if seg_q is not None:
    visible &= seg_k[:, None, None, None, :] == seg_q[:, None, None, :, None]
  scores = jnp.where(visible, scores, NEGATIVE)
  m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
  p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
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
  tiles = lambda a, t, axis: None if a is None else jnp.moveaxis(
      a.reshape(*a.shape[:axis], a.shape[axis] // t, t, *a.shape[axis + 1:]), axis, 0)
  untile = lambda a, axis: jnp.moveaxis(a, 0, axis).reshape(*a.shape[1:axis + 1], -1, *a.shape[axis + 2:])
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
  xs = (tiles(q, tq, 1), tiles(pos_q, tq, 1), tiles(seg_q, tq, 1), tiles(m, tq, 3), tiles(l, tq, 3),
        tiles(acc, tq, 1))
  m, l, acc = jax.lax.map(one_query_tile, xs)
  return untile(m, 3), untile(l, 3), untile(acc, 1)
