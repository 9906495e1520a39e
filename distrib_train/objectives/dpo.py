"""``train.objective: dpo``: DPO, SimPO and ORPO on preference pairs.

- ``dpo``: preference pairs (``data/preference.py``). A batch row holds
  whole pairs, each two segments: the chosen sequence (targets weigh +1
  where scored) and the rejected one (−1). The objective sums each
  sequence's target log-probabilities (``cross_entropy.chunked_logprobs``)
  per pair and applies ``dpo.loss`` (the batch's ``reference_logps``, where
  ``dpo.precompute_reference`` put them, stand in for the reference's):

  - ``sigmoid`` (DPO): ``−log σ(β·((π_w − ρ_w) − (π_l − ρ_l)))``, ``π`` the
    policy's summed log-probabilities of a completion and ``ρ`` the
    reference's. The reference is the starting model, forward only: with
    LoRA the same model with its adapters off (no copy); otherwise a frozen
    copy in the state (``Preference``), laid out by the params' axes and
    never in the optimizer; ``dpo.reference: hf:<dir>`` or ``ckpt:<dir>``
    (a distrib_train run's policy) reads the copy from another checkpoint.
  - ``simpo`` (SimPO, reference-free): ``−log σ(β·(ā_w − ā_l) − γ)``, ``ā``
    the mean log-probability per completion token.
  - ``orpo`` (ORPO, reference-free): ``−ā_w − λ·log σ(log odds(ā_w) − log
    odds(ā_l))``, ``log odds(a) = a − log(1 − eᵃ)`` (the chosen completion's
    NLL as its per-token mean, pair by pair).

  The loss is the mean over the batch's pairs (a pair with no scored token
  in either half, cut away by ``data.long_conversations: truncate``, is left
  out), so a sharded batch and microbatches (weighted by ``pairs``) give
  one device's figure. aux: ``loss``, ``pairs``, ``tokens`` (the scored
  ones), ``rewards/chosen``, ``rewards/rejected`` (β times the policy's
  log-ratio to the reference; the reference-free losses' β·ā), their
  ``rewards/margin``, ``rewards/accuracy`` (the fraction of pairs whose
  chosen reward is higher) and ``logps/chosen`` / ``logps/rejected`` (the
  policy's summed log-probabilities).

Not for: the pairs' data (``data/preference.py``), the model's forward pass
(``decoder.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from distrib_train.recipes import decoder
from distrib_train.kernels.cross_entropy import chunked_logprobs
from distrib_train.objectives.record import Objective

ROLES = ("policy", "reference")  # a ``Preference`` model's two halves
DPO_LOSSES = ("sigmoid", "simpo", "orpo")


@dataclasses.dataclass(frozen=True)
class DpoConfig:
  """The config's ``dpo`` section (read with ``train.objective: dpo``).

  Attributes:
    beta: DPO's and SimPO's β (the reward's scale).
    loss: ``sigmoid`` (DPO, with a reference), ``simpo`` or ``orpo`` (reference-free).
    reference: the reference model of ``sigmoid``: empty for the starting model (``train.init_from``'s weights,
      else the same random init), or ``hf:<dir>``, a Hugging Face checkpoint of the same shape.
    simpo_gamma: SimPO's target margin γ.
    orpo_lambda: ORPO's weight λ of the odds-ratio term.
    precompute_reference: ``sigmoid``'s reference figures from one pass over the data before training, kept
      beside it (``posttrain/reference_pass.py``) and read with the batch: no reference in memory or in the
      step.
  """

  beta: float = 0.1
  loss: str = "sigmoid"
  reference: str = ""
  simpo_gamma: float = 0.5
  orpo_lambda: float = 0.1
  precompute_reference: bool = False

  def __post_init__(self):
    if self.loss not in DPO_LOSSES:
      raise ValueError(f"dpo.loss={self.loss!r}; choose {', '.join(DPO_LOSSES)}.")
    if not self.beta > 0:
      raise ValueError(f"dpo.beta must be positive, got {self.beta!r}.")
    for name in ("simpo_gamma", "orpo_lambda"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"dpo.{name} must be 0 or more, got {getattr(self, name)!r}.")
    if self.reference and not self.reference.startswith(("hf:", "ckpt:")):
      raise ValueError(
        f"dpo.reference={self.reference!r}: give hf:<a Hugging Face directory> or ckpt:<a"
        " distrib_train run>, or leave it empty for the starting model."
      )
    if (self.reference or self.precompute_reference) and self.loss != "sigmoid":
      raise ValueError(
        f"dpo.reference and dpo.precompute_reference are read by dpo.loss=sigmoid; dpo.loss="
        f"{self.loss} is reference-free."
      )

  @property
  def uses_reference(self) -> bool:
    return self.loss == "sigmoid"

  @property
  def live_reference(self) -> bool:
    """Whether the step runs the reference (not precomputed)."""
    return self.uses_reference and not self.precompute_reference


class Preference(nnx.Module):
  """The policy (it trains) and a frozen reference copy of it, as one model: ``dpo`` without adapters."""

  def __init__(self, policy: nnx.Module, reference: nnx.Module):
    self.policy, self.reference = policy, reference
    self.config = policy.config


def policy_of(model: Any) -> Any:
  """The model that trains: a ``Preference``'s policy, else the model."""
  return model.policy if isinstance(model, Preference) else model


def preference_model(model_config: Any, is_param: Any, settings: DpoConfig) -> tuple[Callable[[int], Any], Any]:
  """``(model_fn, is_param)`` of a ``dpo`` run of the decoder ``model_config``: the decoder itself where the
  reference needs no copy (reference-free losses; LoRA's adapters off), else a ``Preference`` whose reference is
  built from the same seed (LoRA's adapters left out) and frozen; the decoder where the reference is
  precomputed."""
  if not settings.live_reference or (getattr(model_config, "lora_rank", 0) and not settings.reference):
    return model_config.build, is_param
  plain = dataclasses.replace(model_config, lora_rank=0) if getattr(model_config, "lora_rank", 0) else model_config

  def build(seed: int) -> Preference:
    return Preference(model_config.build(seed), plain.build(seed))

  def trains(path: tuple[Any, ...], value: Any) -> bool:
    inner = is_param(path[1:], value) if is_param is not None else isinstance(value, nnx.Param)
    return bool(path) and path[0] == "policy" and inner

  return build, trains


def objective(model_config: Any, is_param: Any, settings: DpoConfig, input_axes: Mapping[str, Any]) -> Any:
  """``train.objective: dpo``'s record (``objectives.Objective``): the policy (and its reference where that is a
  frozen copy), the loss, the figures weighed by pairs, a third more FLOPs for a live reference's forward, and the
  precomputed reference's figures as a batch field."""
  model_fn, is_param = preference_model(model_config, is_param, settings)
  extra = {"reference_logps": "float32"} if settings.precompute_reference else {}
  axes = {**input_axes, **{name: input_axes["tokens"] for name in extra}}
  return Objective(
    "dpo",
    model_fn,
    dpo_loss_fn(settings),
    is_param,
    axes,
    extra_inputs=extra,
    weight="pairs",
    perplexity=False,
    flops_scale=4 / 3 if settings.live_reference else 1.0,
  )


def head_logprobs(model: Any, hidden: jax.Array, targets: jax.Array) -> jax.Array:
  """Each target's log-probability [batch, length] from the decoder's final hidden states, by chunks."""
  c = model.config
  return chunked_logprobs(
    hidden, model.head_weight(), targets, c.loss_chunk_size, c.loss_remat, softcap=c.final_logit_softcap
  )


def token_logprobs(
  model: Any,
  tokens: jax.Array,
  rest: dict[str, jax.Array],
  dropout_rng: jax.Array | None = None,
  adapters: bool = True,
) -> tuple[jax.Array, dict]:
  """Each target's log-probability under ``model`` for a batch already in the context axis's order (``rest``:
  ``targets``, ``positions``, ``segment_ids``), and the routing figures; ``adapters=False``: a LoRA model's
  frozen base alone."""
  hidden, routing = model.hidden_and_aux(
    tokens, positions=rest["positions"], segment_ids=rest["segment_ids"], dropout_rng=dropout_rng, adapters=adapters
  )
  return head_logprobs(model, hidden, rest["targets"]), routing


def pair_sums(values: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """[batch, length] → [batch, pairs]: each row's sums over pair ``k``'s two segments (``2k − 1``, ``2k``);
  column 0 is the padding's."""
  count = values.shape[1] // 2 + 1  # a pair takes at least two tokens
  pair = (segment_ids + 1) // 2
  return jax.vmap(lambda v, p: jax.ops.segment_sum(v, p, num_segments=count))(values, pair)


def preference_figures(
  policy: dict[str, jax.Array], reference: dict[str, jax.Array] | None, settings: DpoConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The loss and aux from per-pair sums (any shape, the same for each): ``policy`` and ``reference`` hold
  ``chosen`` and ``rejected`` (summed log-probabilities) and ``n_chosen`` / ``n_rejected`` (scored tokens).
  Pairs with no scored token in a half count for nothing."""
  valid = (policy["n_chosen"] > 0) & (policy["n_rejected"] > 0)
  pairs = jnp.sum(valid.astype(jnp.float32))
  mean = lambda x: jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(pairs, 1.0)
  beta = settings.beta
  if settings.loss == "sigmoid":
    chosen = beta * (policy["chosen"] - reference["chosen"])
    rejected = beta * (policy["rejected"] - reference["rejected"])
    losses = -jax.nn.log_sigmoid(chosen - rejected)
  else:
    average_w = policy["chosen"] / jnp.maximum(policy["n_chosen"], 1.0)
    average_l = policy["rejected"] / jnp.maximum(policy["n_rejected"], 1.0)
    chosen, rejected = beta * average_w, beta * average_l
    if settings.loss == "simpo":
      losses = -jax.nn.log_sigmoid(chosen - rejected - settings.simpo_gamma)
    else:  # orpo
      log_odds = lambda a: a - jnp.log1p(-jnp.exp(jnp.minimum(a, -1e-6)))
      losses = -average_w - settings.orpo_lambda * jax.nn.log_sigmoid(log_odds(average_w) - log_odds(average_l))
  loss = mean(losses)
  tokens = jnp.sum(jnp.where(valid, policy["n_chosen"] + policy["n_rejected"], 0.0))
  return loss, {
    "loss": loss,
    "pairs": pairs,
    "tokens": tokens.astype(jnp.int32),
    "rewards/chosen": mean(chosen),
    "rewards/rejected": mean(rejected),
    "rewards/margin": mean(chosen - rejected),
    "rewards/accuracy": mean((chosen > rejected).astype(jnp.float32)),
    "logps/chosen": mean(policy["chosen"]),
    "logps/rejected": mean(policy["rejected"]),
  }


def _sums(logps: jax.Array, weights: jax.Array, segment_ids: jax.Array) -> dict[str, jax.Array]:
  chosen, rejected = weights > 0, weights < 0
  return {
    "chosen": pair_sums(jnp.where(chosen, logps, 0.0), segment_ids),
    "rejected": pair_sums(jnp.where(rejected, logps, 0.0), segment_ids),
    "n_chosen": pair_sums(chosen.astype(jnp.float32), segment_ids),
    "n_rejected": pair_sums(rejected.astype(jnp.float32), segment_ids),
  }


def dpo_loss_fn(settings: DpoConfig) -> Callable[..., Any]:
  """The penzai-style loss of ``train.objective: dpo`` with ``settings`` (the module docstring says what)."""

  def loss_fn(
    *,
    model: Any,
    state: Any,
    rng: jax.Array,
    tokens: jax.Array,
    targets: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    weights: jax.Array | None = None,
    reference_logps: jax.Array | None = None,
  ) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    if segment_ids is None or weights is None:
      raise ValueError(
        "train.objective=dpo reads packed preference pairs: the batch needs segment_ids and weights"
        " (data.packing: true)."
      )
    policy = policy_of(model)
    hidden, routing, rest = decoder.forward(
      policy,
      tokens,
      dropout_rng=rng,
      targets=targets,
      positions=positions,
      segment_ids=segment_ids,
      weights=weights,
      reference_logps=reference_logps,
    )  # the reference drops nothing
    tokens = rest["tokens"]
    logps = head_logprobs(policy, hidden, rest["targets"])
    reference = None
    if settings.uses_reference:
      if rest["reference_logps"] is not None:  # precomputed: each sequence's sum on one of its scored targets
        ref_logps = rest["reference_logps"]
      elif isinstance(model, Preference):
        ref_logps = token_logprobs(model.reference, tokens, rest)[0]
      elif getattr(policy.config, "lora_rank", 0):
        ref_logps = token_logprobs(policy, tokens, rest, adapters=False)[0]
      else:
        raise ValueError(
          "dpo.loss=sigmoid needs a reference: build the model with objectives.preference_model, or"
          " give the batch's reference_logps (dpo.precompute_reference)."
        )
      reference = _sums(jax.lax.stop_gradient(ref_logps), rest["weights"], rest["segment_ids"])
    loss, aux = preference_figures(_sums(logps, rest["weights"], rest["segment_ids"]), reference, settings)
    loss, aux = decoder.with_routing_losses(loss, aux, routing, policy.config, "preference_loss")
    return loss, state, aux

  return loss_fn
