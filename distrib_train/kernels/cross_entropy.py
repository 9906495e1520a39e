"""Token cross-entropy over a large vocabulary, chunk by chunk.

``chunked_cross_entropy(hidden, head, targets, weights, chunk_size)`` is the
reference models' training loss (``llama.py``, ``moe.py``): the summed
cross-entropy of the output head's logits and the weight total, computed a
chunk of positions at a time so that no float32 [batch, length, vocab] array
exists. On a context mesh the chunks stay inside each device's block of the
length.

Not for: the model's forward pass or the mean a loss function returns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distrib_train.sharding import context


def chunked_cross_entropy(
  hidden: jax.Array,
  head: jax.Array,
  targets: jax.Array,
  weights: jax.Array,
  chunk_size: int,
  remat: bool = True,
  softcap: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
  """Summed token cross-entropy and the weight total, chunk by chunk.

  Logits for ``chunk_size`` positions at a time are computed and reduced, so
  no float32 [batch, length, vocab] array ever exists. With ``remat`` each
  chunk's logits are recomputed in the backward pass (one more head matmul);
  without it the compute-dtype logits of every chunk are kept for it.
  ``softcap`` > 0 caps the logits at ``softcap · tanh(logits / softcap)``
  first (Gemma's final soft cap).
  """
  split, _ = _chunks(hidden, chunk_size)

  def chunk_loss(h, t, w):
    return -jnp.sum(_target_logprobs(h, head, t, softcap) * w)

  if remat:
    chunk_loss = jax.checkpoint(chunk_loss)

  def body(total, xs):
    return total + chunk_loss(*xs), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (split(hidden), split(targets), split(weights)))
  return total, jnp.sum(weights)


def chunked_logprobs(
  hidden: jax.Array, head: jax.Array, targets: jax.Array, chunk_size: int, remat: bool = True, softcap: float = 0.0
) -> jax.Array:
  """Each target's log-probability [batch, length] (float32), chunk by chunk as ``chunked_cross_entropy``
  computes the loss: no float32 [batch, length, vocab] array exists (a preference objective's per-token
  figures, ``objectives.py``)."""
  split, join = _chunks(hidden, chunk_size)
  logprobs = lambda h, t: _target_logprobs(h, head, t, softcap)
  if remat:
    logprobs = jax.checkpoint(logprobs)
  _, out = jax.lax.scan(lambda carry, xs: (carry, logprobs(*xs)), None, (split(hidden), split(targets)))
  return join(out)


def chunked_logprobs_and_entropy(
  hidden: jax.Array,
  head: jax.Array,
  targets: jax.Array,
  chunk_size: int,
  remat: bool = True,
  softcap: float = 0.0,
  temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
  """Each target's log-probability and its position's entropy [batch, length] (float32), under the logits divided
  by ``temperature`` (after the softcap, as a sampler divides them), chunk by chunk as ``chunked_logprobs``: an RL
  objective's per-token figures (``objectives/grpo.py``). The entropy carries no gradient."""
  split, join = _chunks(hidden, chunk_size)

  def figures(h, t):
    logits = _logits(h, head, softcap) / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
    plain = jax.lax.stop_gradient(logits)
    probs = jax.nn.softmax(plain, axis=-1)
    entropy = jax.lax.stop_gradient(logz) - jnp.sum(probs * plain, axis=-1)
    return target_logit - logz, entropy

  if remat:
    figures = jax.checkpoint(figures)
  _, (logprobs, entropy) = jax.lax.scan(lambda carry, xs: (carry, figures(*xs)), None, (split(hidden), split(targets)))
  return join(logprobs), join(entropy)


def chunked_scores(
  hidden: jax.Array, head: jax.Array, targets: jax.Array, chunk_size: int, softcap: float = 0.0
) -> tuple[jax.Array, jax.Array]:
  """Each target's log-probability [batch, length] (float32) and whether it is the logits' argmax (the first
  of equal maxima, as ``torch.argmax``), chunk by chunk as ``chunked_logprobs``: a scorer's figures (no
  gradient; ``generation/scoring.py``)."""
  split, join = _chunks(hidden, chunk_size)

  def scores(carry, xs):
    h, t = xs
    logits = _logits(h, head, softcap)
    target_logit = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
    greedy = jnp.argmax(logits, axis=-1) == t
    return carry, (target_logit - jax.nn.logsumexp(logits, axis=-1), greedy)

  _, (logprobs, greedy) = jax.lax.scan(scores, None, (split(hidden), split(targets)))
  return join(logprobs), join(greedy)


def _logits(h: jax.Array, head: jax.Array, softcap: float) -> jax.Array:
  logits = jnp.einsum("...d,dv->...v", h, head.astype(h.dtype)).astype(jnp.float32)
  return softcap * jnp.tanh(logits / softcap) if softcap else logits


def _target_logprobs(h: jax.Array, head: jax.Array, t: jax.Array, softcap: float) -> jax.Array:
  logits = _logits(h, head, softcap)
  target_logit = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
  return target_logit - jax.nn.logsumexp(logits, axis=-1)


def _chunks(hidden: jax.Array, chunk_size: int):
  """``split`` ([batch, length, …] → [chunks, batch, blocks, chunk, …]) and ``join`` (its inverse for
  [chunks, batch, blocks, chunk]) for chunks of ``chunk_size`` positions (the whole block when it does not
  divide it). On a context mesh each device holds a block of the length: the chunks are taken inside every block
  at once ([batch, blocks, chunk] per iteration), so no iteration reads another device's tokens (scanning over
  chunks of the whole length gathered the hidden states over the context axis at every chunk)."""
  batch, length = hidden.shape[:2]
  blocks = context.context_size()
  if length % blocks:
    blocks = 1
  local = length // blocks
  chunk = chunk_size if local % chunk_size == 0 else local
  n = local // chunk
  split = lambda a: jnp.moveaxis(a.reshape(batch, blocks, n, chunk, *a.shape[2:]), 2, 0)
  join = lambda a: jnp.moveaxis(a, 0, 2).reshape(batch, length)
  return split, join
