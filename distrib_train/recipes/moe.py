"""A mixture-of-experts decoder (Mixtral, Qwen-MoE, DeepSeek-V3 style) in flax nnx.

The Llama's attention (``llama.py``) with a routed feed-forward in every
layer: a router picks ``experts_per_token`` of ``num_experts`` SwiGLU experts
per token (``router: softmax`` as Mixtral and Qwen, or ``sigmoid`` as
DeepSeek-V3; ``norm_topk_prob`` renormalises the chosen weights), optional
shared experts that see every token (DeepSeek; Qwen's behind a sigmoid gate,
``shared_expert_gate``), a load-balancing loss (Switch's ``E · Σ f_e · P_e``)
and a router z-loss (``mean logsumexp²``), weighted into the training loss by
``aux_loss_weight`` and ``z_loss_weight``.

``router_bias_update_rate`` > 0 adds DeepSeek-V3's load balancing without a
loss: a per-layer, per-expert bias (``RouterBias`` local state, never seen by
the optimizer) is added to the router's scores to choose the top-k experts
only (their weights are the unbiased scores), and after each step moves by
``rate · sign(mean load − load)`` from the loads the step measured over the
whole global batch (a step of several microbatches sums theirs in
``router_load`` and moves the bias once, at its last microbatch).

Dropless by default: every token reaches its experts. Assignments are sorted
by expert and multiplied by grouped matmuls (``parallel/grouped.py``: each
expert's rows padded only to the kernel's tile), so no expert drops. ``capacity_factor`` > 0 caps each expert at ``ceil(cf ·
assignments / experts)`` assignments of a device's tokens and drops (and
counts) the rest. On a mesh the experts are split over the ``expert`` axis
(``parallel/experts.py``): tokens go to the devices holding their experts
with a ragged all-to-all and come back with another.

Logical axes beside the Llama's: ``expert`` (the experts of a layer) and
``expert_mlp`` (an expert's hidden width).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import distrib_train.microbatches as microbatching
from distrib_train.parallel import context
from distrib_train.parallel.experts import EXPERT_OUTPUT, dispatch
from distrib_train.recipes import llama
from distrib_train.recipes.llama import _param, attention_sublayer, rms_norm, swiglu


@dataclasses.dataclass(frozen=True)
class MoEConfig(llama.LlamaConfig):
  """A Llama config plus the mixture of experts (``mlp_dim`` is unused; see ``expert_mlp_dim``)."""

  num_experts: int = 8
  experts_per_token: int = 2
  expert_mlp_dim: int = 1024
  num_shared_experts: int = 0
  shared_mlp_dim: int = 0  # all shared experts together; 0: num_shared_experts × expert_mlp_dim
  shared_expert_gate: bool = False  # Qwen-MoE: a sigmoid gate on the shared experts' output
  router: str = "softmax"  # "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3)
  norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1
  routed_scaling: float = 1.0  # DeepSeek-V3 scales the routed output (2.5)
  capacity_factor: float = 0.0  # 0: dropless
  aux_loss_weight: float = 0.01
  z_loss_weight: float = 0.001
  router_bias_update_rate: float = 0.0  # DeepSeek-V3's loss-free balancing bias, its step per update (0: off; 0.001)

  def __post_init__(self):
    super().__post_init__()
    if self.router not in ("softmax", "sigmoid"):
      raise ValueError(f"router must be 'softmax' or 'sigmoid', got {self.router!r}.")
    if not 1 <= self.experts_per_token <= self.num_experts:
      raise ValueError(f"experts_per_token ({self.experts_per_token}) must be between 1 and num_experts"
                       f" ({self.num_experts}).")
    if self.capacity_factor < 0:
      raise ValueError(f"capacity_factor must be 0 (dropless) or positive, got {self.capacity_factor}.")
    if not self.router_bias_update_rate >= 0:
      raise ValueError(f"router_bias_update_rate must be 0 (off) or positive (DeepSeek-V3: 0.001), got"
                       f" {self.router_bias_update_rate}.")

  @property
  def shared_width(self) -> int:
    return self.shared_mlp_dim or self.num_shared_experts * self.expert_mlp_dim

  def _per_layer(self, experts: int) -> int:
    d, h, kv, hd = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim
    attention = d * h * hd * 2 + d * kv * hd * 2
    if self.attention_bias:
      attention += (h + 2 * kv) * hd
    shared = 3 * d * self.shared_width + (d if self.shared_expert_gate else 0) if self.num_shared_experts else 0
    return attention + 2 * d + d * self.num_experts + experts * 3 * d * self.expert_mlp_dim + shared

  def num_params(self) -> int:
    """Every parameter (all experts)."""
    embeddings = (1 if self.tie_embeddings else 2) * self.vocab_size * self.d_model + self.d_model
    return self.num_layers * self._per_layer(self.num_experts) + embeddings

  def active_params(self) -> int:
    """The parameters one token passes through (its ``experts_per_token`` experts)."""
    embeddings = (1 if self.tie_embeddings else 2) * self.vocab_size * self.d_model + self.d_model
    return self.num_layers * self._per_layer(self.experts_per_token) + embeddings

  def flops_per_token(self, seq_len: int) -> int:
    """Training FLOPs per token by the active parameters: 6·N_active + 12·L·(heads·head_dim)·S."""
    return 6 * self.active_params() + 12 * self.num_layers * self.num_heads * self.head_dim * seq_len

  def build(self, rngs: nnx.Rngs | int = 0) -> MoE:
    rngs = nnx.Rngs(rngs) if isinstance(rngs, int) else rngs
    with nnx.use_eager_sharding(False):
      return MoE(self, rngs=rngs)


PRESETS: dict[str, MoEConfig] = {
    # Trains in seconds on CPU: 4 layers of 8 experts, 2 per token; byte-level vocabulary.
    "tiny": MoEConfig(vocab_size=256, d_model=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                          max_seq_len=256, dtype="float32", loss_chunk_size=64, num_experts=8,
                          experts_per_token=2, expert_mlp_dim=96, fp8_min_dim=0),
    # Mixtral-8x7B's shape: 46.7B parameters, 12.9B active.
    "mixtral-8x7b": MoEConfig(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                              head_dim=128, max_seq_len=4096, rope_theta=1e6, num_experts=8, experts_per_token=2,
                              expert_mlp_dim=14336, remat="full"),
    # DeepSeek-V3's 58 MoE layers (256 routed experts + 1 shared, 8 per token, sigmoid router) with GQA
    # attention in place of MLA; its 3 dense first layers are left out: 675B parameters, 39B active.
    "deepseek-v3": MoEConfig(vocab_size=129280, d_model=7168, num_layers=58, num_heads=128, num_kv_heads=8,
                             head_dim=128, max_seq_len=4096, num_experts=256, experts_per_token=8,
                             expert_mlp_dim=2048, num_shared_experts=1, router="sigmoid", routed_scaling=2.5,
                             remat="full", aux_loss_weight=0.0001),
}


class RouterBias(nnx.Variable):
  """Each layer's per-expert bias on the router's scores, and the loads a step's microbatches measured so far
  (``router_bias_update_rate``): local state, checkpointed with the train state, never seen by the optimizer."""


def route(config: MoEConfig, h: jax.Array, router: jax.Array,
          bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """Top-k experts per token of ``h`` [batch, length, embed]: ``(indices, weights, per-row aux)``.

  ``bias`` [experts] (``RouterBias``) is added to the scores to choose the experts only; their weights are
  the unbiased scores (DeepSeek-V3).

  The aux sums are per batch row (the layer stack carries them): ``balance``
  (this call's load-balancing loss on every row; the loss takes the rows'
  mean), ``z`` (the row's mean ``logsumexp²``) and ``load`` [batch, experts]
  (assignments per expert).
  """
  logits = jnp.einsum("btd,de->bte", h.astype(jnp.float32), router.astype(jnp.float32))
  e, k = config.num_experts, config.experts_per_token
  scores = jax.nn.softmax(logits, axis=-1) if config.router == "softmax" else jax.nn.sigmoid(logits)
  if bias is None:
    weights, indices = jax.lax.top_k(scores, k)
  else:
    indices = jax.lax.top_k(scores + bias, k)[1]
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


def moe_sublayer(config: MoEConfig, x: jax.Array, layer: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
  """``x`` plus the mixture of experts on its normed value, and the routing's per-row aux."""
  h = rms_norm(x, layer["mlp_norm"], config.norm_eps)
  indices, weights, aux = route(config, h, layer["router"], layer.get("router_bias"))
  dtype = h.dtype
  routed, dropped = dispatch(h, indices, weights.astype(dtype), layer["w_gate"].astype(dtype),
                             layer["w_up"].astype(dtype), layer["w_down"].astype(dtype),
                             capacity_factor=config.capacity_factor)
  out = routed
  if config.num_shared_experts:
    shared = swiglu(h, layer["shared_gate"], layer["shared_up"], layer["shared_down"],
                    tuple(layer.get(f"fp8_{k}") for k in ("shared_gate", "shared_up", "shared_down")))
    if config.shared_expert_gate:
      shared = shared * jax.nn.sigmoid(jnp.einsum("btd,do->bto", h, layer["shared_expert_gate"].astype(dtype)))
    out = out + shared
  return x + out, {**aux, "dropped": dropped}


class MoE(llama.Llama):
  """The decoder; ``model(tokens)`` returns the final hidden states, ``hidden_and_aux`` also the routing's
  losses and loads (``loss_fn`` adds the weighted losses to the cross-entropy; with the routing bias on, each
  layer's loads ``layer_load`` [layers, experts], which ``loss_fn`` hands to ``update_router_bias``)."""

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
    super().__init__(config, rngs=rngs)
    if config.router_bias_update_rate > 0:  # each layer's bias (read by its block), and a step's loads so far
      zeros = lambda: jnp.zeros((config.num_layers, config.num_experts), jnp.float32)
      self.layers["router_bias"] = RouterBias(zeros(), out_sharding=("layers", None))
      self.router_load = RouterBias(zeros(), out_sharding=("layers", None))

  def _mlp_params(self, rngs: nnx.Rngs) -> dict[str, nnx.Param]:
    c, pd = self.config, jnp.dtype(self.config.param_dtype)
    L, d, e, f = c.num_layers, c.d_model, c.num_experts, c.expert_mlp_dim
    params = {
        "router": _param(rngs, (L, d, e), ("layers", "embed", None), pd, fan_in=d),
        "w_gate": _param(rngs, (L, e, d, f), ("layers", "expert", "embed", "expert_mlp"), pd, fan_in=d),
        "w_up": _param(rngs, (L, e, d, f), ("layers", "expert", "embed", "expert_mlp"), pd, fan_in=d),
        "w_down": _param(rngs, (L, e, f, d), ("layers", "expert", "expert_mlp", "embed"), pd, fan_in=f),
    }
    if c.num_shared_experts:
      fs = c.shared_width
      params.update({
          "shared_gate": _param(rngs, (L, d, fs), ("layers", "embed", "mlp"), pd, fan_in=d),
          "shared_up": _param(rngs, (L, d, fs), ("layers", "embed", "mlp"), pd, fan_in=d),
          "shared_down": _param(rngs, (L, fs, d), ("layers", "mlp", "embed"), pd, fan_in=fs),
      })
      if c.shared_expert_gate:
        params["shared_expert_gate"] = _param(rngs, (L, d, 1), ("layers", "embed", None), pd, fan_in=d)
    return params

  def _remat_policy(self) -> Any:
    """The Llama's policy, and each assignment's expert output kept: the router's gradient needs it, and
    recomputing it costs the down projection and the all-to-all back again (tokens · k × embed per layer)."""
    policy = super()._remat_policy()
    keep = jax.checkpoint_policies.save_only_these_names(EXPERT_OUTPUT)
    return keep if policy is jax.checkpoint_policies.nothing_saveable else \
        jax.checkpoint_policies.save_from_both_policies(policy, keep)

  def _fp8_matmuls(self) -> tuple[str, ...]:
    shared = ("shared_gate", "shared_up", "shared_down") if self.config.num_shared_experts else ()
    return ("wq", "wk", "wv", "wo", *shared)

  def _block(self, carry, layer, positions, segment_ids):
    x, sums = carry
    x = attention_sublayer(self.config, x, layer, positions, segment_ids)
    x, aux = moe_sublayer(self.config, x, layer)
    new = {k: sums[k] + aux[k] for k in aux}
    if "layer_load" in sums:  # the bias's per-layer loads: the earlier layers' one place down, this layer's last
      new["layer_load"] = jnp.concatenate([sums["layer_load"][:, 1:], aux["load"][:, None]], axis=1)
    return x, new

  def _carry(self, x: jax.Array) -> Any:
    rows, e = x.shape[0], self.config.num_experts
    zeros = lambda *shape: jnp.zeros((rows, *shape), jnp.float32)
    sums = {"balance": zeros(), "z": zeros(), "load": zeros(e), "dropped": zeros()}
    if self.config.router_bias_update_rate > 0:
      sums["layer_load"] = zeros(self.config.num_layers, e)
    return x, sums

  def _hidden_and_aux(self, carry: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    x, sums = carry
    layers = self.config.num_layers
    load = jnp.sum(sums["load"], axis=0) / layers  # assignments per expert, per layer
    return x, {"balance_loss": jnp.mean(sums["balance"]) / layers, "z_loss": jnp.mean(sums["z"]) / layers,
               "expert_load_min": jnp.min(load) / jnp.maximum(jnp.mean(load), 1e-9),
               "expert_load_max": jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9),
               "dropped_tokens": jnp.sum(sums["dropped"]),
               **({"layer_load": jnp.sum(sums["layer_load"], axis=0)} if "layer_load" in sums else {})}

  def update_router_bias(self, layer_load: jax.Array) -> None:
    """Moves each layer's ``router_bias`` by ``rate · sign(mean load − load)``, once per step, from the loads
    [layers, experts] of the whole step (``router_load`` sums a step's microbatches until its last)."""
    load = self.router_load[...] + layer_load
    last = microbatching.last_microbatch()
    change = self.config.router_bias_update_rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    self.layers["router_bias"][...] = self.layers["router_bias"][...] + jnp.where(last, change, 0.0)
    self.router_load[...] = jnp.where(last, 0.0, load)


def loss_fn(*, model: MoE, state: Any, rng: jax.Array, tokens: jax.Array, targets: jax.Array,
            segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
            weights: jax.Array | None = None) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
  """Mean next-token cross-entropy plus the weighted routing losses; aux has each part and the loads.

  ``expert_load_min`` / ``expert_load_max`` are the least and most loaded
  experts' assignments over the mean (1.0 is perfect balance), averaged over
  layers; ``dropped_tokens`` counts dropped assignments (capacity mode).
  With ``router_bias_update_rate`` > 0 the model's router bias (local
  state) moves from this pass's loads.
  """
  del rng
  tokens, rest = context.reorder(tokens, targets=targets, positions=positions, segment_ids=segment_ids,
                                 weights=weights)
  targets, positions, segment_ids, weights = (rest[k] for k in ("targets", "positions", "segment_ids", "weights"))
  hidden, routing = model.hidden_and_aux(tokens, positions=positions, segment_ids=segment_ids)
  if "layer_load" in routing:  # the step's loads move the router bias (router_bias_update_rate)
    model.update_router_bias(routing.pop("layer_load"))
  if weights is None:
    weights = jnp.ones(targets.shape, jnp.float32) if segment_ids is None else (segment_ids > 0).astype(jnp.float32)
  total, count = llama.chunked_cross_entropy(hidden, model.head_weight(), targets, weights,
                                             model.config.loss_chunk_size, model.config.loss_remat)
  cross_entropy = total / jnp.maximum(count, 1.0)
  c = model.config
  loss = cross_entropy + c.aux_loss_weight * routing["balance_loss"] + c.z_loss_weight * routing["z_loss"]
  return loss, state, {"loss": loss, "cross_entropy": cross_entropy, "tokens": count, **routing}


INPUT_AXES = llama.INPUT_AXES
