"""The next token from a step's logits: greedy, or sampled after temperature, top-k, top-p and min-p.

``Sampling`` holds the settings; ``choose(logits, keys, sampling)`` picks
one token per row and gives its log-probability. The filters run in
transformers' order and with its rules (``TemperatureLogitsWarper``, then
``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``; each
keeps at least one token), so the same logits keep the same tokens.
``temperature`` 0 is greedy, as in vLLM and OpenAI's API: the filters are
then moot.

The log-probability returned is the model's own, ``log_softmax`` of the raw
logits at the chosen token, before any filter (vLLM's default); with
``scaled_logprobs``, of the logits divided by the temperature (what an RL
objective's trainer computes, ``objectives/grpo.py``).

**Keys.** Each row's key is ``fold_in(fold_in(fold_in(key(seed), prompt),
sample), step)``: it comes from the prompt's index in the request, the
sample's index among its ``n`` and the step, never from a device or the
row a prompt landed in, so one seed gives the same completions on every
mesh and in every batch (``row_keys``).

Not for: the model's forward (``cache.py``), the loop (``engine.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_REMOVED = -jnp.inf


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How each next token is picked.

  Attributes:
    temperature: 0 for greedy (the most likely token); else the logits are divided by it before sampling.
    top_k: keep the ``top_k`` most likely tokens (0: all).
    top_p: keep the fewest most likely tokens whose probability sums to at least ``top_p`` (1: all).
    min_p: keep the tokens at least ``min_p`` times as likely as the most likely one (0: all).
    scaled_logprobs: the log-probability returned is of the logits divided by ``temperature`` (else the raw ones).
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  scaled_logprobs: bool = False

  def __post_init__(self):
    for name, ok, rule in (
      ("temperature", self.temperature >= 0, "0 (greedy) or positive"),
      ("top_k", self.top_k >= 0, "0 (off) or positive"),
      ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
      ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
    ):
      if not ok:
        raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}.")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def top_k_filter(logits: jax.Array, k: int) -> jax.Array:
  """``logits`` [rows, vocab] with every token below the ``k``-th largest removed (-inf)."""
  if not k or k >= logits.shape[-1]:
    return logits
  kth = jax.lax.top_k(logits, k)[0][..., -1:]
  return jnp.where(logits < kth, _REMOVED, logits)


def top_p_filter(logits: jax.Array, p: float) -> jax.Array:
  """``logits`` with the least likely tokens removed while their probabilities sum to at most ``1 − p``; the
  most likely token always stays."""
  if p >= 1.0:
    return logits
  order = jnp.argsort(logits, axis=-1)  # ascending
  ascending = jnp.take_along_axis(logits, order, axis=-1)
  cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
  remove = (cumulative <= 1.0 - p).at[..., -1].set(False)
  removed = jnp.zeros_like(remove).at[jnp.arange(logits.shape[0])[:, None], order].set(remove)
  return jnp.where(removed, _REMOVED, logits)


def min_p_filter(logits: jax.Array, min_p: float) -> jax.Array:
  """``logits`` with the tokens less likely than ``min_p`` × the most likely one's probability removed."""
  if not min_p:
    return logits
  probs = jax.nn.softmax(logits, axis=-1)
  remove = probs < min_p * jnp.max(probs, axis=-1, keepdims=True)
  return jnp.where(remove, _REMOVED, logits)


def filtered(logits: jax.Array, sampling: Sampling) -> jax.Array:
  """The logits a sampled token is drawn from: temperature, then top-k, top-p and min-p."""
  logits = logits / sampling.temperature
  return min_p_filter(top_p_filter(top_k_filter(logits, sampling.top_k), sampling.top_p), sampling.min_p)


def row_keys(seed: int | jax.Array, prompts: jax.Array, samples: jax.Array) -> jax.Array:
  """One key per row from ``seed``, each row's prompt index and sample index (module docstring)."""
  base = (
    jax.random.key(seed)
    if not isinstance(seed, jax.Array) or not jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key)
    else seed
  )
  return jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(base, p), s))(prompts, samples)


def choose(logits: jax.Array, keys: jax.Array, step: jax.Array, sampling: Sampling) -> tuple[jax.Array, jax.Array]:
  """The next token of each row [rows] (int32) and its log-probability under the model [rows] (float32).

  Args:
    logits: [rows, vocab] float32, the model's.
    keys: [rows] each row's key (``row_keys``).
    step: the index of the token being chosen (0 for the first new one).
    sampling: the settings.
  """
  if sampling.greedy:
    token = jnp.argmax(logits, axis=-1)
  else:
    draw = filtered(logits, sampling)
    token = jax.vmap(lambda key, row: jax.random.categorical(jax.random.fold_in(key, step), row))(keys, draw)
  token = token.astype(jnp.int32)
  scaled = logits / sampling.temperature if sampling.scaled_logprobs and not sampling.greedy else logits
  logprob = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), token[:, None], axis=-1)[:, 0]
  return token, logprob
