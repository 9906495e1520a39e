"""The ``context`` mesh axis: its size in the active mesh, and the load-balanced order of a sequence over it.

With a ``context`` axis of size ``C`` > 1 the shipped rules split the ``length`` of every activation over it;
attention over it is ``kernels/attention/ring.py`` (or splash's all-gather on TPU).

Causal masks are load-balanced: ``reorder`` puts each sequence in zigzag
order before the model — the sequence cut into ``2C`` chunks, device ``i``
holding chunks ``i`` and ``2C − 1 − i`` — so every device has as many early
as late tokens and none idles in the ring. The loss is a sum over tokens, so
it is computed in that order without undoing it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from distrib_train.sharding.axis_rules import active_activation_sharding

CONTEXT_AXIS = "context"


def context_size() -> int:
  """The active mesh's context axis size (1 outside ``activation_sharding`` or without the axis)."""
  active = active_activation_sharding()
  return 1 if active is None else int(dict(active[0].shape).get(CONTEXT_AXIS, 1))


def zigzag(length: int, size: int) -> np.ndarray:
  """The load-balanced order of ``length`` positions over ``size`` devices (module docstring)."""
  if length % (2 * size):
    raise ValueError(
      f"The sequence length {length} does not split over the context axis: it must be a multiple of"
      f" 2 × context ({2 * size}) for the load-balanced causal split; change data.seq_len or the"
      " context axis size."
    )
  chunks = np.arange(length).reshape(2 * size, length // (2 * size))
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * size - 1 - i]]) for i in range(size)])


def reorder(tokens: jax.Array, **per_token: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array | None]]:
  """``tokens`` [batch, length] and the other per-token arrays in zigzag order on a context mesh (as they are
  without one); ``positions`` is filled in first when None, so the model sees the true positions."""
  size = context_size()
  if size == 1:
    return tokens, per_token
  order = zigzag(tokens.shape[1], size)
  if per_token.get("positions") is None:
    per_token["positions"] = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  take = lambda a: None if a is None else jnp.take(a, order, axis=1)
  return take(tokens), {k: take(v) for k, v in per_token.items()}
