"""An MLP with BatchNorm and Dropout (flax nnx): local state and per-step rng.

``Linear → BatchNorm → relu → Dropout → Linear``. The BatchNorm statistics
are local state (updated by each training forward pass, never by the
optimizer); Dropout draws from the step's key. ``model.eval()`` switches to
the running statistics and no dropout. Small enough for CPU tests, and the
smallest real example of everything ``TrainState`` carries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  """Sizes of the BatchNorm MLP."""

  in_features: int = 16
  hidden: int = 64
  num_classes: int = 8
  dropout: float = 0.1

  def build(self, rngs: nnx.Rngs | int = 0) -> BatchNormMLP:
    rngs = nnx.Rngs(rngs) if isinstance(rngs, int) else rngs
    with nnx.use_eager_sharding(False):
      return BatchNormMLP(self, rngs=rngs)


PRESETS = {"tiny": MLPConfig()}


class BatchNormMLP(nnx.Module):
  """``Linear → BatchNorm → relu → Dropout → Linear``, logically annotated."""

  def __init__(self, config: MLPConfig, *, rngs: nnx.Rngs):
    kernel_init = nnx.initializers.lecun_normal()
    self.dense_in = nnx.Linear(
      config.in_features,
      config.hidden,
      rngs=rngs,
      kernel_init=nnx.with_partitioning(kernel_init, ("embed", "mlp")),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",)),
    )
    self.norm = nnx.BatchNorm(
      config.hidden, rngs=rngs, scale_metadata={"out_sharding": ("mlp",)}, bias_metadata={"out_sharding": ("mlp",)}
    )
    self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
    self.dense_out = nnx.Linear(
      config.hidden,
      config.num_classes,
      rngs=rngs,
      kernel_init=nnx.with_partitioning(kernel_init, ("mlp", "embed")),
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jax.nn.relu(self.norm(self.dense_in(x)))
    return self.dense_out(self.dropout(x))


def loss_fn(
  *, model: BatchNormMLP, state: Any, rng: jax.Array, inputs: jax.Array, targets: jax.Array
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
  """Mean softmax cross-entropy (penzai contract); aux has loss and accuracy."""
  del rng  # Dropout draws from the module's streams, reseeded from it per step.
  logits = model(inputs)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  accuracy = jnp.mean(jnp.argmax(logits, -1) == targets)
  return loss, state, {"loss": loss, "accuracy": accuracy}


INPUT_AXES = {"inputs": ("batch", None), "targets": ("batch",)}
