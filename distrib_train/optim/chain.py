"""The optimizer a config names, and the figures the trainer reads from it.

``build(config.optimizer, steps, nonfinite)`` returns an optax
transformation:

  record the gradient norm → [skip non-finite updates (``guard_updates``)]
  → clip by global norm → adamw / adam / sgd / muon with an injected
  (readable) learning rate

``muon`` is ``optax.contrib.muon`` with dimension numbers from the params'
logical axes (``muon.py``), its AdamW part at ``muon_adam_lr`` on the same
schedule's shape.

so the gradient norm, the learning rate and the count of skipped updates are
ordinary optimizer-state leaves: checkpointed with it, and read by
``metrics_of(opt_state)`` without changing the train step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from distrib_train.optim import muon


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Optimizer and learning-rate schedule (``build``; the run config's ``optimizer`` section).

  The schedule warms up linearly from 0 over ``warmup_steps``, then follows ``schedule`` (``constant``,
  ``cosine``, ``linear`` or ``wsd``) down to ``learning_rate * min_lr_ratio`` at ``decay_steps`` (0: the run's
  steps). ``wsd`` (warmup-stable-decay) holds the peak and decays over the last ``decay_fraction`` of the steps,
  ``decay_shape`` ``linear`` or ``1-sqrt``. ``muon`` takes the ``muon_*`` fields (YAML ``muon: {ns_steps: …}``,
  ``--set optimizer.muon.ns_steps=…``); ``muon_adam_lr`` 0: the AdamW part's peak is ``learning_rate``,
  ``muon_consistent_rms`` 0: Keller Jordan's √max(1, out/in) scale rather than Moonlight's RMS match.
  """

  name: str = "adamw"
  learning_rate: float = 3e-4
  schedule: str = "cosine"
  warmup_steps: int = 0
  decay_steps: int = 0
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.0
  grad_clip_norm: float = 1.0  # 0: no clipping
  decay_fraction: float = 0.2
  decay_shape: str = "linear"
  muon_ns_steps: int = 5
  muon_beta: float = 0.95
  muon_nesterov: bool = True
  muon_consistent_rms: float = 0.2
  muon_adam_lr: float = 0.0


class GradNormState(NamedTuple):
  """The global norm of the last gradients the optimizer saw."""

  grad_norm: jax.Array


def record_grad_norm() -> optax.GradientTransformation:
  """Passes updates through unchanged and keeps their global norm."""

  def init(params):
    del params
    return GradNormState(jnp.zeros((), jnp.float32))

  def update(updates, state, params=None):
    del state, params
    return updates, GradNormState(optax.tree.norm(updates).astype(jnp.float32))

  return optax.GradientTransformation(init, update)


def guard_updates(update: optax.GradientTransformation, policy: str) -> optax.GradientTransformation:
  """``update``, made to drop non-finite updates when ``policy`` (``train.nonfinite``) is ``skip``."""
  if policy != "skip":
    return update
  # The host-side guard (``nonfinite.NonFiniteGuard``) decides when too many in a row must stop the run;
  # optax's own limit (which lets a non-finite update through) is never reached.
  return optax.apply_if_finite(update, max_consecutive_errors=2**30)


def wsd_decay_start(config: OptimizerConfig, steps: int) -> int:
  """``wsd``'s last stable step: the updates after it decay (``steps`` or ``decay_steps`` less its
  ``decay_fraction``, rounded)."""
  total = config.decay_steps or steps
  return max(config.warmup_steps, total - round(config.decay_fraction * total))


def schedule(config: OptimizerConfig, steps: int) -> optax.Schedule:
  """Linear warm-up from 0, then constant / cosine / linear decay, or ``wsd``: the peak held to its last stable
  step, then down to the end over the rest, linearly or as 1 − √(progress) (Hägele et al., 2024)."""
  peak = config.learning_rate
  decay_steps = max(1, (config.decay_steps or steps) - config.warmup_steps)
  end = peak * config.min_lr_ratio
  if config.schedule == "cosine":
    after = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.min_lr_ratio)
  elif config.schedule == "linear":
    after = optax.linear_schedule(peak, end, decay_steps)
  elif config.schedule == "wsd":
    stable = wsd_decay_start(config, steps) - config.warmup_steps
    length = max(1, (config.decay_steps or steps) - wsd_decay_start(config, steps))

    def after(count):
      progress = jnp.clip((count - stable) / length, 0.0, 1.0)
      fall = progress if config.decay_shape == "linear" else jnp.sqrt(progress)  # 1-sqrt: lr ∝ 1 − √progress
      return peak - (peak - end) * fall
  else:
    after = optax.constant_schedule(peak)
  if not config.warmup_steps:
    return after
  warmup = optax.linear_schedule(0.0, peak, config.warmup_steps)
  return optax.join_schedules([warmup, after], [config.warmup_steps])


def _muon(config: OptimizerConfig, lr: optax.Schedule, param_axes: Any) -> optax.GradientTransformation:
  """optax's Muon, its dimension numbers from ``param_axes`` (``muon.dimension_numbers``), its AdamW part at
  ``muon_adam_lr`` (0: ``learning_rate``) on the same schedule's shape."""
  ratio = (config.muon_adam_lr or config.learning_rate) / config.learning_rate
  static = ("ns_steps", "nesterov", "muon_weight_dimension_numbers", "consistent_rms")
  return muon.spread_over_mesh(
    lambda dimension_numbers: optax.inject_hyperparams(optax.contrib.muon, static_args=static)(
      learning_rate=lr,
      adam_learning_rate=lambda count: lr(count) * ratio,
      ns_steps=config.muon_ns_steps,
      beta=config.muon_beta,
      nesterov=config.muon_nesterov,
      eps=config.eps,
      consistent_rms=config.muon_consistent_rms or None,
      weight_decay=config.weight_decay,
      adam_b1=config.b1,
      adam_b2=config.b2,
      adam_weight_decay=config.weight_decay,
      muon_weight_dimension_numbers=dimension_numbers,
    ),
    param_axes or {},
  )


def build(
  config: OptimizerConfig, steps: int, nonfinite: str = "skip", param_axes: Any = None
) -> optax.GradientTransformation:
  """The configured optimizer, wrapped by the non-finite guard: with
  ``nonfinite="skip"`` a step whose gradients are not finite leaves params
  and optimizer moments unchanged. ``param_axes``: ``/``-path → logical axes
  (``models.annotated_axes``), which Muon's matrices are (``muon.py``)."""
  lr = schedule(config, steps)
  if config.name == "adamw":
    inner = optax.inject_hyperparams(optax.adamw)(
      learning_rate=lr, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay
    )
  elif config.name == "adam":
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=lr, b1=config.b1, b2=config.b2, eps=config.eps)
  elif config.name == "muon":
    inner = _muon(config, lr, param_axes)
  else:
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=lr, momentum=config.b1 or None)
  parts = [inner] if not config.grad_clip_norm else [optax.clip_by_global_norm(config.grad_clip_norm), inner]
  return optax.chain(record_grad_norm(), guard_updates(optax.chain(*parts), nonfinite))


def metrics_of(opt_state: Any) -> dict[str, jax.Array]:
  """``grad_norm``, ``learning_rate`` and (when skipping) ``skipped`` —
  scalars found in an optimizer state that ``build`` made."""
  out = {}
  nodes = jax.tree_util.tree_leaves(
    opt_state,
    is_leaf=lambda x: (
      isinstance(x, (GradNormState, optax.ApplyIfFiniteState))
      or (hasattr(x, "hyperparams") and hasattr(x, "inner_state"))
    ),
  )
  for node in nodes:
    if isinstance(node, GradNormState):
      out["grad_norm"] = node.grad_norm
    elif isinstance(node, optax.ApplyIfFiniteState):
      out["skipped"] = node.total_notfinite
      out.update({k: v for k, v in metrics_of(node.inner_state).items() if k != "skipped"})
    elif "learning_rate" in getattr(node, "hyperparams", {}):
      out["learning_rate"] = node.hyperparams["learning_rate"]
  return out
