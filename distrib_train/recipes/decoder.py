"""The decoder every family builds: embeddings, segments of equal layers, the final norm and the head.

A config's ``layer_kinds()`` says what each layer composes (``blocks.Kind``:
experts or a gated MLP, a sliding window or full attention). Layers are cut
into **segments** (``segments``): runs of consecutive layers with the same
params (a dense layer and a mixture layer differ), each stacked on a leading
``layers`` axis under its own key — ``layers`` for the first (all of a
uniform model's), ``layers_<first index>`` for the others (DeepSeek-V3's
mixture after its dense first layers). Within a segment, the layer kinds
repeat with a **period** (Gemma 3: five sliding, one full; gpt-oss: sliding,
full): the segment is scanned over whole periods, each period's layers
unrolled with their own static window and RoPE, so every attention kernel
knows its mask when compiled. A run that is not a whole number of periods
leaves its last layers to a segment of their own.

Each segment is ``parallel.layer_stack``'s: a scan (one compiled period), an
unrolled loop, or the stages of a pipeline on a mesh with a ``stage`` axis.
``remat`` checkpoints each layer. A mixture's routing figures are carried
through the layers as per-row sums (``routing.py``); with
``router_bias_update_rate`` > 0 the step's loads move each mixture layer's
``router_bias`` once per step.

With ``mtp_depth`` > 0 the decoder also holds DeepSeek-V3's multi-token
prediction modules under ``mtp`` (``mtp.py``); only ``loss_fn`` runs them,
never the forward pass or generation.

Logical axes: ``batch``, ``length``, ``embed``, ``heads``, ``kv_heads``,
``head_dim``, ``mlp``, ``vocab``, ``layers``, ``latent`` (MLA's low ranks),
``expert``, ``expert_mlp``.

Not for: the layers' parts (``blocks.py``), the configs and presets
(``llama.py``, ``moe.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import distrib_train.microbatches as microbatching
from distrib_train.sharding import context
from distrib_train.parallel.experts import EXPERT_OUTPUT
from distrib_train.parallel.pipeline import layer_stack
from distrib_train.kernels.attention import splash as attention_lib
from distrib_train.kernels import fp8
from distrib_train.recipes import attention, blocks, lora, mtp
from distrib_train.recipes.parts import Kind, param, rms_norm, token_weights
from distrib_train.kernels.cross_entropy import chunked_cross_entropy
from distrib_train.recipes.routing import RouterBias
from distrib_train.sharding.axis_rules import constrain

REMAT_POLICIES = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

INPUT_AXES = {
  "tokens": ("batch", "length"),
  "targets": ("batch", "length"),
  "segment_ids": ("batch", "length"),
  "positions": ("batch", "length"),
  "weights": ("batch", "length"),
}


@dataclasses.dataclass(frozen=True)
class Segment:
  """Consecutive layers with the same params: stacked under ``name``, scanned by periods of ``kinds``."""

  name: str
  start: int
  count: int
  kinds: tuple[Kind, ...]


def _period(kinds: tuple[Kind, ...]) -> int:
  return next(p for p in range(1, len(kinds) + 1) if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))


def segments(config) -> tuple[Segment, ...]:
  """The config's layers cut into segments (module docstring)."""
  kinds, out, start = tuple(config.layer_kinds()), [], 0
  while start < len(kinds):
    end = start
    while end < len(kinds) and kinds[end].mixture == kinds[start].mixture:
      end += 1
    while start < end:  # whole periods of the run, then its rest
      period = _period(kinds[start:end])
      whole = (end - start) // period * period
      out.append((start, whole, kinds[start : start + period]))
      start += whole
  return tuple(Segment("layers" if i == 0 else f"layers_{s}", s, n, k) for i, (s, n, k) in enumerate(out))


def has_mixture(config) -> bool:
  return any(kind.mixture for kind in config.layer_kinds())


def _mixture_layers(config) -> int:
  return sum(kind.mixture for kind in config.layer_kinds())


def _fp8_matmuls(config, mixture: bool) -> tuple[str, ...]:
  """The weights of a segment whose matmuls run in FP8 (each gets an amax history under ``delayed``)."""
  if not mixture:
    return attention.attention_matmuls(config) + ("w_gate", "w_up", "w_down")
  return attention.attention_matmuls(config) + (
    ("shared_gate", "shared_up", "shared_down") if config.num_shared_experts else ()
  )


def _layer(config, kind: Kind, mixture_model: bool, carry, layer, positions, segment_ids):
  """One layer on the layer stack's carry: the hidden states, and a mixture model's routing sums."""
  x, sums = carry if mixture_model else (carry, None)
  x, aux = blocks.layer(config, kind, x, layer, positions, segment_ids)
  if not mixture_model:
    return x
  if not kind.mixture:
    return x, sums
  new = {k: sums[k] + aux[k] for k in aux}
  if "layer_load" in sums:  # the bias's per-layer loads: the earlier layers' one place down, this layer's last
    new["layer_load"] = jnp.concatenate([sums["layer_load"][:, 1:], aux["load"][:, None]], axis=1)
  return x, new


def _period_block(
  config, kinds: tuple[Kind, ...], policy: Any, mixture_model: bool, carry, layer, positions, segment_ids
):
  """One period of a segment: its layers one after another, each with its kind and checkpointed as asked."""
  for i, kind in enumerate(kinds):
    one = layer if len(kinds) == 1 else {k: v[i] for k, v in layer.items()}
    run = functools.partial(_layer, config, kind, mixture_model)
    if config.remat != "none":
      run = jax.checkpoint(run, policy=policy)
    carry = run(carry, one, positions, segment_ids)
  return carry


class Decoder(nnx.Module):
  """The decoder; ``model(tokens)`` returns the final hidden states, ``hidden_and_aux`` also a mixture's
  routing losses and loads. ``logits(hidden)`` or, for training, ``loss_fn`` (chunked cross-entropy that
  never materialises float32 [batch, length, vocab])."""

  def __init__(self, config, *, rngs: nnx.Rngs):
    self.config = config
    self.deterministic = False  # ``model.eval()`` sets it: the adapters' dropout is off (lora.py)
    c, pd = config, jnp.dtype(config.param_dtype)
    d = c.d_model
    self.embed = param(rngs, (c.vocab_size, d), ("vocab", "embed"), pd, fan_in=1)
    for segment in segments(c):
      n, mixture = segment.count, segment.kinds[0].mixture
      stack = blocks.layer_params(c, rngs, n, mixture)
      if c.fp8 == "delayed":  # one (3, history) amax history per layer and matmul, in local state
        for name in _fp8_matmuls(c, mixture):
          stack[f"fp8_{name}"] = fp8.AmaxHistory(
            jnp.zeros((n, 3, c.fp8_amax_history), jnp.float32), out_sharding=("layers", None, None)
          )
      setattr(self, segment.name, nnx.Dict(stack))
    if has_mixture(c) and c.router_bias_update_rate > 0:  # a step's loads so far, every mixture layer's
      self.router_load = RouterBias(
        jnp.zeros((_mixture_layers(c), c.num_experts), jnp.float32), out_sharding=("layers", None)
      )
    self.final_norm = param(rngs, (d,), ("embed",), pd, None, value=1.0 - c.norm_weight_offset)
    if not c.tie_embeddings:
      self.head = param(rngs, (d, c.vocab_size), ("embed", "vocab"), pd, fan_in=d)
    if c.mtp_depth:  # DeepSeek-V3's multi-token prediction modules (mtp.py); none at depth 0
      setattr(self, mtp.NAME, nnx.Dict(mtp.params(c, rngs)))

  def _remat_policy(self) -> Any:
    """What the backward pass keeps of a layer under remat; a mixture's expert outputs too (the router's
    gradient needs them, and recomputing them costs the down projection and the all-to-all back again), and
    MLA's key/value latent (its keys and values per head are recomputed from it, not kept)."""
    policy = REMAT_POLICIES[self.config.remat]
    names = ((EXPERT_OUTPUT,) if has_mixture(self.config) else ()) + attention.variant(self.config).remat_names
    if self.config.context_attention == "all_gather":  # the context kernel's output and log-sum-exp, not its rerun
      names += (attention_lib.RESIDUALS,)
    if not names:
      return policy
    keep = jax.checkpoint_policies.save_only_these_names(*names)
    return (
      keep
      if policy is jax.checkpoint_policies.nothing_saveable
      else jax.checkpoint_policies.save_from_both_policies(policy, keep)
    )

  def head_weight(self) -> jax.Array:
    """The output projection [embed, vocab]: the head, or the embedding table's transpose when tied."""
    return self.embed[...].T if self.config.tie_embeddings else self.head[...]

  def __call__(
    self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
  ) -> jax.Array:
    return self.hidden_and_aux(tokens, positions, segment_ids)[0]

  def hidden_and_aux(
    self,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    *,
    dropout_rng: jax.Array | None = None,
    adapters: bool = True,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The final hidden states and what the layers report besides (a mixture's losses and loads).
    ``dropout_rng``: the training step's key, for the adapters' dropout (none in eval mode). ``adapters``:
    False runs a LoRA model's frozen base alone (a preference objective's reference)."""
    c = self.config
    dropout_rng = None if self.deterministic else dropout_rng
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = self.embed_tokens(tokens)
    staged = (use := microbatching.active_pipelining()) is not None and use.request.stages > 1
    if c.fp8 == "delayed" and staged:
      raise ValueError(
        "model.fp8=delayed does not run with a stage axis: the pipeline runs every layer once per"
        " microbatch, and each run would write the layer's amax history. Use fp8=current."
      )
    if staged and dropout_rng is not None and c.lora_rank and c.lora_dropout:
      raise ValueError(
        "lora.dropout does not run with a stage axis: a layer's mask would repeat over the"
        " pipeline's microbatches. Set it to 0, or use a mesh without stages."
      )
    mixture_model = has_mixture(c)
    carry = (x, self._routing_sums(x)) if mixture_model else x
    per_example = {"positions": positions, "segment_ids": segment_ids}
    with fp8.active(c.fp8, c.fp8_min_dim):
      # Each segment: a scan over its periods (or an unrolled loop); the stages of a pipeline when the step's
      # mesh has a stage axis (parallel/pipeline.py).
      for index, segment in enumerate(segments(c)):
        stack = getattr(self, segment.name)
        layers = {k: v[...] for k, v in stack.items()}
        axes = {k: tuple(v.out_sharding) for k, v in stack.items()}
        if not adapters:
          layers, axes = lora.without_adapters(layers), lora.without_adapters(axes)
        seeds = lora.dropout_seeds(
          c, None if dropout_rng is None else jax.random.fold_in(dropout_rng, index), segment.count
        )
        if seeds is not None:
          layers[lora.SEED], axes[lora.SEED] = seeds, ("layers",)
        period = len(segment.kinds)
        if period > 1:
          layers = {k: v.reshape(segment.count // period, period, *v.shape[1:]) for k, v in layers.items()}
          axes = {k: (a[0], None, *a[1:]) for k, a in axes.items()}
        block = functools.partial(_period_block, c, segment.kinds, self._remat_policy(), mixture_model)
        carry = layer_stack(block, carry, layers, per_example=per_example, scan=c.scan_layers, layer_axes=axes)
    x, aux = (carry[0], self._routing_aux(carry[1])) if mixture_model else (carry, {})
    return self.final_hidden(x), aux

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """The layers' input for ``tokens`` [batch, length]: their embeddings in the compute dtype (Gemma's scaled)."""
    c = self.config
    # The table is gathered over its embedding side (fsdp) before the lookup: a lookup into the fsdp-sharded table
    # made XLA rematerialize it whole ("Involuntary full rematerialization") and moved about 40 % more bytes per
    # step (124m-like shape, 8 devices).
    table = constrain(self.embed[...], ("vocab", None))
    x = jnp.take(table, tokens, axis=0).astype(c.dtype)
    if c.pad_token_id >= 0:  # the pad token's lookups leave its row untrained, as transformers' padding_idx does
      x = jnp.where((tokens == c.pad_token_id)[..., None], jax.lax.stop_gradient(x), x)
    if c.scale_embeddings:  # Gemma: embeddings × √d_model
      x = x * jnp.asarray(math.sqrt(c.d_model), x.dtype)
    return constrain(x, ("batch", "length", "embed"))

  def final_hidden(self, x: jax.Array) -> jax.Array:
    """The last layer's output normed: the hidden states the head reads."""
    return rms_norm(x, self.final_norm[...], self.config.norm_eps, self.config.norm_weight_offset)

  def _routing_sums(self, x: jax.Array) -> dict[str, jax.Array]:
    rows, e = x.shape[0], self.config.num_experts
    zeros = lambda *shape: jnp.zeros((rows, *shape), jnp.float32)
    sums = {"balance": zeros(), "z": zeros(), "load": zeros(e), "dropped": zeros()}
    if self.config.router_bias_update_rate > 0:
      sums["layer_load"] = zeros(_mixture_layers(self.config), e)
    return sums

  def _routing_aux(self, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    layers = _mixture_layers(self.config)
    load = jnp.sum(sums["load"], axis=0) / layers  # assignments per expert, per layer
    return {
      "balance_loss": jnp.mean(sums["balance"]) / layers,
      "z_loss": jnp.mean(sums["z"]) / layers,
      "expert_load_min": jnp.min(load) / jnp.maximum(jnp.mean(load), 1e-9),
      "expert_load_max": jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9),
      "dropped_tokens": jnp.sum(sums["dropped"]),
      **({"layer_load": jnp.sum(sums["layer_load"], axis=0)} if "layer_load" in sums else {}),
    }

  def update_router_bias(self, layer_load: jax.Array) -> None:
    """Moves each mixture layer's ``router_bias`` by ``rate · sign(mean load − load)``, once per step, from the
    loads [mixture layers, experts] of the whole step (``router_load`` sums a step's microbatches until its
    last)."""
    load = self.router_load[...] + layer_load
    last = microbatching.last_microbatch()
    change = self.config.router_bias_update_rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    first = 0
    for segment in segments(self.config):
      if segment.kinds[0].mixture:
        stack = getattr(self, segment.name)
        rows = change[first : first + segment.count]
        stack["router_bias"][...] = stack["router_bias"][...] + jnp.where(last, rows, 0.0)
        first += segment.count
    self.router_load[...] = jnp.where(last, 0.0, load)

  def logits(self, hidden: jax.Array) -> jax.Array:
    logits = jnp.einsum("btd,dv->btv", hidden, self.head_weight().astype(hidden.dtype))
    cap = self.config.final_logit_softcap
    return cap * jnp.tanh(logits / cap) if cap else logits


def forward(
  model: Decoder, tokens: jax.Array, *, dropout_rng: jax.Array | None = None, **per_token: jax.Array | None
) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array | None]]:
  """What every objective runs before its loss: the batch in the context axis's load-balanced order
  (``sharding/context.py``; a loss that sums over tokens is the same), positions filled in where None, the forward
  pass, and the router bias moved by the step's loads (``router_bias_update_rate``).

  Returns:
    ``(hidden, routing, rest)``: the final hidden states, a mixture's routing figures (empty for a dense model)
    and ``per_token`` in the order of ``hidden``, with ``positions`` and ``tokens``.
  """
  tokens, rest = context.reorder(tokens, **per_token)
  rest["tokens"] = tokens
  if rest.get("positions") is None:
    rest["positions"] = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  hidden, routing = model.hidden_and_aux(
    tokens, positions=rest["positions"], segment_ids=rest.get("segment_ids"), dropout_rng=dropout_rng
  )
  if "layer_load" in routing:
    model.update_router_bias(routing.pop("layer_load"))
  return hidden, routing, rest


def with_routing_losses(
  loss: jax.Array, aux: dict[str, jax.Array], routing: dict[str, jax.Array], config: Any, name: str
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """A mixture's weighted balance and z losses added to an objective's ``loss``, which aux keeps as ``name``; the
  routing figures join aux. A dense model's (no routing) unchanged."""
  if not routing:
    return loss, aux
  total = loss + config.aux_loss_weight * routing["balance_loss"] + config.z_loss_weight * routing["z_loss"]
  return total, {**aux, "loss": total, name: loss, **routing}


def loss_fn(
  *,
  model: Decoder,
  state: Any,
  rng: jax.Array,
  tokens: jax.Array,
  targets: jax.Array,
  segment_ids: jax.Array | None = None,
  positions: jax.Array | None = None,
  weights: jax.Array | None = None,
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
  """Mean next-token cross-entropy (penzai contract), plus a mixture's weighted routing losses.

  aux: ``loss`` and ``tokens``; a mixture's also ``cross_entropy``, ``balance_loss``, ``z_loss``,
  ``expert_load_min`` / ``expert_load_max`` (the least and most loaded experts' assignments over the mean,
  1.0 is perfect balance, averaged over layers) and ``dropped_tokens`` (capacity mode). With
  ``router_bias_update_rate`` > 0 the model's router bias (local state) moves from this pass's loads.

  With ``mtp_depth`` > 0 the multi-token-prediction losses join (``mtp.with_mtp_loss``: aux ``cross_entropy``,
  the main head's, and ``mtp_loss_<k>``).

  On a mesh with a context axis the tokens are taken in its load-balanced order (``forward``).
  """
  c = model.config
  ahead = mtp.shifted(c, targets, segment_ids, weights) if c.mtp_depth else {}  # in the batch's own order
  hidden, routing, rest = forward(
    model,
    tokens,
    dropout_rng=rng,
    targets=targets,
    positions=positions,
    segment_ids=segment_ids,
    weights=weights,
    **ahead,
  )
  targets, segment_ids, weights = (rest[k] for k in ("targets", "segment_ids", "weights"))
  weights = token_weights(targets, segment_ids, weights)
  head = model.head_weight()
  if c.mtp_depth:  # gathered over its embedding side once, for the main head and each depth (one all-gather)
    head = constrain(head, (None, "vocab"))
  total, count = chunked_cross_entropy(
    hidden, head, targets, weights, c.loss_chunk_size, c.loss_remat, softcap=c.final_logit_softcap
  )
  cross_entropy = total / jnp.maximum(count, 1.0)
  loss, aux = with_routing_losses(cross_entropy, {"loss": cross_entropy, "tokens": count}, routing, c, "cross_entropy")
  if c.mtp_depth:
    loss, aux = mtp.with_mtp_loss(model, hidden, rest, loss, aux, head)
  return loss, state, aux
