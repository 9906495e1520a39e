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

DeepSeek-V3's MLA decodes through it with one key/value head: the queries
absorbed into the latent (``q_nope · W_uk`` beside ``q_rope``), the cached
latent and rotary key as the keys, the latent as the values
(``generation/cache.py``).

Not for: choosing a layer's kernel (``dispatch.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite: a query with nothing visible gives no NaN (its row is never read)


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
  scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, keys, preferred_element_type=jnp.float32) * scale
  if softcap:
    scores = softcap * jnp.tanh(scores / softcap)
  scores = jnp.where(jnp.broadcast_to(visible, (batch, queries, keys.shape[1]))[:, None, None], scores, _MASKED)
  if new is not None:
    own = jnp.einsum("bqkgd,bskd->bkgqs", qg, new[0], preferred_element_type=jnp.float32) * scale
    if softcap:
      own = softcap * jnp.tanh(own / softcap)
    causal = jnp.arange(queries)[None, :] <= jnp.arange(queries)[:, None]
    scores = jnp.concatenate([scores, jnp.where(causal, own, _MASKED)], axis=-1)
  if sinks is not None:
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, groups, 1, 1),
                            (batch, kv_heads, groups, queries, 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
  else:
    probs = jax.nn.softmax(scores, axis=-1)
  slots = keys.shape[1]
  out = jnp.einsum("bkgqs,bskd->bqkgd", probs[..., :slots].astype(values.dtype), values,
                   preferred_element_type=jnp.float32)
  if new is not None:
    out = out + jnp.einsum("bkgqs,bskd->bqkgd", probs[..., slots:].astype(values.dtype), new[1],
                           preferred_element_type=jnp.float32)
  return out.reshape(batch, queries, heads, values.shape[-1]).astype(q.dtype)
