"""A mixture's router: which experts each token goes to, their weights, and the balancing figures.

``route(config, h, router, bias, logit_bias)`` scores every expert for
every token of ``h`` [batch, length, embed] and picks ``experts_per_token``:

- ``router: softmax`` (Mixtral, Qwen-MoE): the top k of the softmax over
  all experts, renormalised when ``norm_topk_prob``;
- ``router: sigmoid`` (DeepSeek-V3): the top k of the sigmoid scores plus
  ``bias`` (the score correction, ``RouterBias`` local state) within the
  ``router_group_topk`` best of ``router_groups`` groups of experts (a
  group's score: its two best), weighted by the unbiased scores,
  renormalised when ``norm_topk_prob``;
- ``router: softmax_topk`` (gpt-oss): the top k of the logits (plus the
  router's trained ``logit_bias``), weighted by the softmax over those k;

each weight then times ``routed_scaling``. The aux sums are per batch row
(the layer stack carries them): ``balance`` (Switch's ``E · Σ f_e · P_e`` on
every row), ``z`` (the row's mean ``logsumexp²``) and ``load`` [batch,
experts] (assignments per expert).

``RouterBias`` holds DeepSeek-V3's per-layer score correction and, with
``router_bias_update_rate`` > 0, the loads a step's microbatches measured
(``decoder.py`` moves the bias once per step).

Not for: sending tokens to their experts (``parallel/experts.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

ROUTERS = ("softmax", "sigmoid", "softmax_topk")


class RouterBias(nnx.Variable):
  """Each layer's per-expert bias on the router's scores, and the loads a step's microbatches measured so far
  (``router_bias_update_rate``): local state, checkpointed with the train state, never seen by the optimizer."""


def _group_limited(scores: jax.Array, groups: int, keep: int) -> jax.Array:
  """``scores`` [..., experts] with the experts outside the ``keep`` best of ``groups`` groups at −inf (a group
  scores its two best experts)."""
  experts = scores.shape[-1]
  grouped = scores.reshape(*scores.shape[:-1], groups, experts // groups)
  group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
  chosen = jax.lax.top_k(group_scores, keep)[1]
  allowed = jnp.sum(jax.nn.one_hot(chosen, groups), axis=-2) > 0  # [..., groups]
  mask = jnp.repeat(allowed, experts // groups, axis=-1)
  return jnp.where(mask, scores, -jnp.inf)


def route(
  config, h: jax.Array, router: jax.Array, bias: jax.Array | None = None, logit_bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """Top-k experts per token of ``h`` [batch, length, embed]: ``(indices, weights, per-row aux)``.

  ``bias`` [experts] (``RouterBias``) is added to the scores to choose the experts only; their weights are
  the unbiased scores (DeepSeek-V3). ``logit_bias`` [experts] is a trained bias on the logits (gpt-oss).
  """
  logits = jnp.einsum("btd,de->bte", h.astype(jnp.float32), router.astype(jnp.float32))
  if logit_bias is not None:
    logits = logits + logit_bias.astype(jnp.float32)
  e, k = config.num_experts, config.experts_per_token
  if config.router == "softmax_topk":
    top, indices = jax.lax.top_k(logits, k)
    weights = jax.nn.softmax(top, axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
  else:
    scores = jax.nn.softmax(logits, axis=-1) if config.router == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias
    if config.router_groups > 1:
      choice = _group_limited(choice, config.router_groups, config.router_group_topk)
    if bias is None and config.router_groups <= 1:
      weights, indices = jax.lax.top_k(scores, k)
    else:
      indices = jax.lax.top_k(choice, k)[1]
      weights = jnp.take_along_axis(scores, indices, axis=-1)
    probs = scores if config.router == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
    if config.norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  weights = weights * config.routed_scaling
  chosen = jax.nn.one_hot(indices, e, dtype=jnp.float32).sum(axis=2)  # [batch, length, experts]
  fraction = jnp.mean(chosen, axis=(0, 1)) / k
  balance = e * jnp.sum(fraction * jnp.mean(probs, axis=(0, 1)))
  z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2, axis=1)
  rows = h.shape[0]
  return indices, weights, {"balance": jnp.broadcast_to(balance, (rows,)), "z": z, "load": chosen.sum(axis=1)}
