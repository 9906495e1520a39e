"""The optimizer a config names, and the figures the trainer reads from it.

``build(config.optimizer, steps, nonfinite)`` returns an optax
transformation:

  record the gradient norm → [skip non-finite updates (``nonfinite.py``)]
  → clip by global norm → adamw / adam / sgd with an injected (readable)
  learning rate

so the gradient norm, the learning rate and the count of skipped updates are
ordinary optimizer-state leaves: checkpointed with it, and read by
``metrics_of(opt_state)`` without changing the train step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from distrib_train.training.config import OptimizerConfig
from distrib_train.training.nonfinite import guard_updates


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


def schedule(config: OptimizerConfig, steps: int) -> optax.Schedule:
  """Linear warm-up from 0, then constant / cosine / linear decay."""
  peak = config.learning_rate
  decay_steps = max(1, (config.decay_steps or steps) - config.warmup_steps)
  end = peak * config.min_lr_ratio
  if config.schedule == "cosine":
    after = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.min_lr_ratio)
  elif config.schedule == "linear":
    after = optax.linear_schedule(peak, end, decay_steps)
  else:
    after = optax.constant_schedule(peak)
  if not config.warmup_steps:
    return after
  warmup = optax.linear_schedule(0.0, peak, config.warmup_steps)
  return optax.join_schedules([warmup, after], [config.warmup_steps])


def build(config: OptimizerConfig, steps: int, nonfinite: str = "skip") -> optax.GradientTransformation:
  """The configured optimizer, wrapped by the non-finite guard: with
  ``nonfinite="skip"`` a step whose gradients are not finite leaves params
  and optimizer moments unchanged."""
  lr = schedule(config, steps)
  if config.name == "adamw":
    inner = optax.inject_hyperparams(optax.adamw)(
        learning_rate=lr, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay)
  elif config.name == "adam":
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=lr, b1=config.b1, b2=config.b2, eps=config.eps)
  else:
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=lr, momentum=config.b1 or None)
  parts = [inner] if not config.grad_clip_norm else [optax.clip_by_global_norm(config.grad_clip_norm), inner]
  return optax.chain(record_grad_norm(), guard_updates(optax.chain(*parts), nonfinite))


def metrics_of(opt_state: Any) -> dict[str, jax.Array]:
  """``grad_norm``, ``learning_rate`` and (when skipping) ``skipped`` —
  scalars found in an optimizer state that ``build`` made."""
  out = {}
  nodes = jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, (GradNormState, optax.ApplyIfFiniteState))
      or (hasattr(x, "hyperparams") and hasattr(x, "inner_state")))
  for node in nodes:
    if isinstance(node, GradNormState):
      out["grad_norm"] = node.grad_norm
    elif isinstance(node, optax.ApplyIfFiniteState):
      out["skipped"] = node.total_notfinite
      out.update({k: v for k, v in metrics_of(node.inner_state).items() if k != "skipped"})
    elif "learning_rate" in getattr(node, "hyperparams", {}):
      out["learning_rate"] = node.hyperparams["learning_rate"]
  return out
