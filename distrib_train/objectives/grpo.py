"""``train.objective: grpo``: GRPO and its variants (Dr. GRPO, DAPO, BNPO, GSPO) on the policy's own completions.

A batch row holds one prompt and one of its ``num_generations`` completions (``posttrain/rollouts.py`` samples
them with the policy and scores them with the reward functions): ``weights`` is 1 on the completion's targets
(0 on the prompt, the padding, and a truncated completion's with ``mask_truncated_completions``),
``advantages`` the row's advantage on every position, ``sampler_logps`` the sampler's log-probability of each
completion token and, with ``num_iterations`` > 1, ``old_logps`` the policy's at generation time.

The loss is TRL's ``GRPOTrainer``'s, with its names. Per completion token, ``π`` the policy's log-probability
under the logits divided by ``temperature``, ``π_old`` the policy's at generation time (``π`` itself, without
gradient, when ``num_iterations`` is 1), ``A`` the advantage:

- the importance weight ``w = exp(π − π_old)`` per token (``importance_sampling_level: token``), or the exp of the
  completion's mean of ``π − π_old`` (``sequence``: GSPO);
- ``ℓ = −min(w·A, clip(w, 1 − epsilon, 1 + epsilon_high)·A)``, plus ``beta · (exp(ρ − π) − (ρ − π) − 1)`` with
  ``ρ`` the reference's log-probability (k3's KL estimate) when ``beta`` > 0;
- ``loss_type``: ``grpo`` the mean over completions of each one's mean ``ℓ``; ``bnpo`` the sum over the
  microbatch's tokens over their count; ``dapo`` the same over the whole step's batch; ``dr_grpo`` the sum over
  tokens over (completions × ``max_completion_length``).

aux: ``loss``, the counts (``tokens``, ``sequences``, and ``batches`` for bnpo), ``clip_ratio/low_mean``,
``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``entropy``, ``kl`` (beta > 0), and the gap between the
sampler's log-probabilities and the policy's at generation time, ``sampler_gap/mean`` and ``sampler_gap/max``.

Not for: sampling, rewards and advantages (``posttrain/rollouts.py``, ``posttrain/rewards.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from distrib_train.kernels.cross_entropy import chunked_logprobs_and_entropy
from distrib_train.objectives import dpo
from distrib_train.objectives.record import Objective
from distrib_train.recipes import decoder

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
LEVELS = ("token", "sequence")
WEIGHT_OF_LOSS = {"grpo": "sequences", "dr_grpo": "sequences", "dapo": "tokens", "bnpo": "batches"}


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
  """The config's ``grpo`` section (read with ``train.objective: grpo``), named as TRL's ``GRPOConfig``.

  Attributes:
    num_generations: completions sampled per prompt (a group); ``data.global_batch_size`` is prompts × this.
    max_completion_length: new tokens per completion at most.
    max_prompt_length: prompt tokens kept (the last ones), 0: ``data.seq_len − max_completion_length``.
    temperature, top_p, top_k, min_p: the sampler's; the loss's log-probabilities are of the logits divided by
      ``temperature`` too.
    beta: the KL penalty's weight; 0 holds no reference.
    reference: with ``beta`` > 0, the reference: empty for the starting model, or ``hf:<dir>`` / ``ckpt:<run>``.
    epsilon, epsilon_high: the clip range's lower and upper widths (``epsilon_high`` 0: ``epsilon``).
    loss_type: ``grpo``, ``dr_grpo``, ``dapo`` or ``bnpo`` (module docstring).
    scale_rewards: ``group``, ``batch`` or ``none``: what the advantages are divided by (the group's reward std,
      the batch's, nothing).
    importance_sampling_level: ``token`` or ``sequence`` (GSPO).
    mask_truncated_completions: completions cut at ``max_completion_length`` count for nothing in the loss.
    num_iterations: optimizer steps on each batch of completions (the policy's log-probabilities at generation
      time kept for the importance weights).
    reward_funcs: built-ins (``accuracy``, ``format``, ``overlong``) or ``module:function`` names.
    reward_weights: one weight per function (empty: all 1).
    format_pattern: the ``format`` reward's regex, matched against the whole completion.
    overlong_buffer: DAPO's soft overlong penalty's buffer in tokens (0: a quarter of ``max_completion_length``).
  """

  num_generations: int = 8
  max_completion_length: int = 256
  max_prompt_length: int = 0
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  beta: float = 0.0
  reference: str = ""
  epsilon: float = 0.2
  epsilon_high: float = 0.0
  loss_type: str = "dapo"
  scale_rewards: str = "group"
  importance_sampling_level: str = "token"
  mask_truncated_completions: bool = False
  num_iterations: int = 1
  reward_funcs: tuple[str, ...] = ()
  reward_weights: tuple[float, ...] = ()
  format_pattern: str = r"^<think>(?!.*<think>).*?</think>.*$"
  overlong_buffer: int = 0

  def __post_init__(self):
    for name, choices in (
      ("loss_type", LOSS_TYPES),
      ("scale_rewards", SCALE_REWARDS),
      ("importance_sampling_level", LEVELS),
    ):
      if getattr(self, name) not in choices:
        raise ValueError(f"grpo.{name}={getattr(self, name)!r}; choose {', '.join(choices)}.")
    for name, ok, rule in (
      ("num_generations", self.num_generations >= 2, "at least 2 (a group needs a spread)"),
      ("max_completion_length", self.max_completion_length >= 1, "at least 1"),
      ("max_prompt_length", self.max_prompt_length >= 0, "0 or more"),
      ("temperature", self.temperature > 0, "positive (GRPO samples)"),
      ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
      ("top_k", self.top_k >= 0, "0 or more"),
      ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
      ("beta", self.beta >= 0, "0 or more"),
      ("epsilon", self.epsilon >= 0, "0 or more"),
      ("epsilon_high", self.epsilon_high >= 0, "0 or more"),
      ("num_iterations", self.num_iterations >= 1, "at least 1"),
      ("overlong_buffer", self.overlong_buffer >= 0, "0 or more"),
    ):
      if not ok:
        raise ValueError(f"grpo.{name} must be {rule}, got {getattr(self, name)!r}.")
    if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
      raise ValueError(
        f"grpo.reward_weights has {len(self.reward_weights)} weights for {len(self.reward_funcs)}"
        " grpo.reward_funcs; give one per function, or none."
      )
    if self.reference and not self.reference.startswith(("hf:", "ckpt:")):
      raise ValueError(
        f"grpo.reference={self.reference!r}: give hf:<a Hugging Face directory> or ckpt:<a"
        " distrib_train run>, or leave it empty for the starting model."
      )
    if self.reference and not self.beta:
      raise ValueError(f"grpo.reference={self.reference!r} is read with grpo.beta > 0; beta 0 holds no reference.")

  # What ``dpo.preference_model`` asks of an objective's settings: a reference in the step when beta > 0.
  live_reference = property(lambda self: self.beta > 0)
  precompute_reference = False

  @property
  def epsilon_low(self) -> float:
    return self.epsilon

  @property
  def upper_epsilon(self) -> float:
    return self.epsilon_high or self.epsilon


def objective(model_config: Any, is_param: Any, settings: GrpoConfig, input_axes: Mapping[str, Any]) -> Any:
  """``train.objective: grpo``'s record (``objectives.Objective``): the policy (and its frozen reference where
  beta > 0 and no adapters can be turned off), the loss, the rollout fields, the loss type's weight."""
  model_fn, is_param = dpo.preference_model(model_config, is_param, settings)
  extra = {"advantages": "float32", "sampler_logps": "float32"}
  if settings.num_iterations > 1:
    extra["old_logps"] = "float32"
  axes = {**input_axes, **{name: input_axes["tokens"] for name in extra}}
  return Objective(
    "grpo",
    model_fn,
    grpo_loss_fn(settings),
    is_param,
    axes,
    extra_inputs=extra,
    weight=WEIGHT_OF_LOSS[settings.loss_type],
    perplexity=False,
    rollouts=True,
    flops_scale=4 / 3 if settings.beta else 1.0,
  )


def logprobs(model: Any, hidden: jax.Array, targets: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
  """Each target's log-probability and its position's entropy under the logits divided by ``temperature``."""
  c = model.config
  return chunked_logprobs_and_entropy(
    hidden,
    model.head_weight(),
    targets,
    c.loss_chunk_size,
    c.loss_remat,
    softcap=c.final_logit_softcap,
    temperature=temperature,
  )


def reference_logprobs(model: Any, rest: Mapping[str, jax.Array], temperature: float) -> jax.Array:
  """The reference's log-probabilities of the targets: a ``Preference``'s frozen copy, or LoRA's adapters off."""
  policy = dpo.policy_of(model)
  kwargs = dict(positions=rest["positions"], segment_ids=rest.get("segment_ids"))
  if isinstance(model, dpo.Preference):
    hidden, _ = model.reference.hidden_and_aux(rest["tokens"], **kwargs)
    return logprobs(model.reference, hidden, rest["targets"], temperature)[0]
  if getattr(policy.config, "lora_rank", 0):
    hidden, _ = policy.hidden_and_aux(rest["tokens"], **kwargs, adapters=False)
    return logprobs(policy, hidden, rest["targets"], temperature)[0]
  raise ValueError("grpo.beta > 0 needs a reference: build the model with objectives.grpo.objective.")


def figures(
  logps: jax.Array,
  entropy: jax.Array,
  mask: jax.Array,
  advantages: jax.Array,
  old_logps: jax.Array,
  sampler_logps: jax.Array,
  ref_logps: jax.Array | None,
  settings: GrpoConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The loss and aux (module docstring) from per-token figures, each [completions, length]; ``mask`` 1 on the
  completion tokens that count."""
  mask = mask.astype(jnp.float32)
  per_row = jnp.sum(mask, axis=-1)
  tokens = jnp.sum(per_row)
  rows = jnp.float32(mask.shape[0])
  masked_mean = lambda x: jnp.sum(x * mask) / jnp.maximum(tokens, 1.0)
  log_ratio = jnp.where(mask > 0, logps - old_logps, 0.0)  # nothing overflows where nothing counts
  if settings.importance_sampling_level == "sequence":
    log_weight = (jnp.sum(log_ratio * mask, axis=-1) / jnp.maximum(per_row, 1.0))[:, None]
  else:
    log_weight = log_ratio
  coef = jnp.exp(log_weight)
  clipped = jnp.clip(coef, 1 - settings.epsilon_low, 1 + settings.upper_epsilon)
  per_token = -jnp.minimum(coef * advantages, clipped * advantages)
  aux: dict[str, jax.Array] = {}
  if ref_logps is not None and settings.beta:
    delta = jnp.where(mask > 0, ref_logps - logps, 0.0)
    kl = jnp.exp(delta) - delta - 1
    per_token = per_token + settings.beta * kl
    aux["kl"] = masked_mean(kl)
  total = jnp.sum(per_token * mask)
  if settings.loss_type == "grpo":
    loss = jnp.sum(jnp.sum(per_token * mask, axis=-1) / jnp.maximum(per_row, 1.0)) / rows
  elif settings.loss_type == "dr_grpo":
    loss = total / (rows * settings.max_completion_length)
  else:  # dapo, bnpo: over the tokens (the step's or the microbatch's: the weight says)
    loss = total / jnp.maximum(tokens, 1.0)
  low = (coef < 1 - settings.epsilon_low) & (advantages < 0)
  high = (coef > 1 + settings.upper_epsilon) & (advantages > 0)
  clip_mean = (
    (lambda x: jnp.mean(x[:, 0].astype(jnp.float32)))
    if coef.shape[-1] == 1
    else (lambda x: masked_mean(x.astype(jnp.float32)))
  )
  gap = jnp.abs(sampler_logps - old_logps) * mask
  aux.update(
    {
      "loss": loss,
      "tokens": tokens,
      "sequences": rows,
      "clip_ratio/low_mean": clip_mean(low),
      "clip_ratio/high_mean": clip_mean(high),
      "clip_ratio/region_mean": clip_mean(low | high),
      "entropy": masked_mean(entropy),
      "sampler_gap/mean": masked_mean(gap),
      "sampler_gap/max": jnp.max(gap),
    }
  )
  if settings.loss_type == "bnpo":
    aux["batches"] = jnp.float32(1.0)
  return loss, aux


def grpo_loss_fn(settings: GrpoConfig) -> Callable[..., Any]:
  """The penzai-style loss of ``train.objective: grpo`` with ``settings`` (the module docstring says what)."""

  def loss_fn(
    *,
    model: Any,
    state: Any,
    rng: jax.Array,
    tokens: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    advantages: jax.Array,
    sampler_logps: jax.Array,
    old_logps: jax.Array | None = None,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
  ) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    policy = dpo.policy_of(model)
    hidden, routing, rest = decoder.forward(
      policy,
      tokens,
      dropout_rng=rng,
      targets=targets,
      positions=positions,
      segment_ids=segment_ids,
      weights=weights,
      advantages=advantages,
      sampler_logps=sampler_logps,
      old_logps=old_logps,
    )
    logps, entropy = logprobs(policy, hidden, rest["targets"], settings.temperature)
    old = jax.lax.stop_gradient(logps) if rest["old_logps"] is None else rest["old_logps"]
    ref = jax.lax.stop_gradient(reference_logprobs(model, rest, settings.temperature)) if settings.beta else None
    loss, aux = figures(logps, entropy, rest["weights"], rest["advantages"], old, rest["sampler_logps"], ref, settings)
    loss, aux = decoder.with_routing_losses(loss, aux, routing, policy.config, "policy_loss")
    return loss, state, aux

  return loss_fn
