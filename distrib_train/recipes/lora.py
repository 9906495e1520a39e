"""LoRA adapters on the reference decoders' projections: ``model.lora: {rank, alpha, dropout, targets}``.

With ``lora_rank`` > 0, each targeted projection ``W`` (``q``, ``k``, ``v``,
``o`` of GQA attention; ``gate``, ``up``, ``down`` of a dense MLP) gets two
params, ``lora_a_<w>`` (its inputs → rank, normal / √fan-in) and
``lora_b_<w>`` (rank → its outputs, zeros, so a new adapter leaves the
model as it was), and computes ``x·W + (alpha / rank)·(drop(x)·A)·B``,
PEFT's default scaling and dropout: with ``lora.dropout`` = p > 0, a training
step zeroes each adapter's inputs with probability p (scaling the rest by
1 / (1 − p)), with its own mask per layer, projection and step
(``dropout_seeds``); evaluation, ``model.eval()``, drops nothing; a stage
axis is refused (``decoder.py``: the mask would repeat over microbatches). Only the adapters train (``trainable``): the base weights
are frozen, out of the optimizer, and laid out by their logical axes like
params (``train_state.STATE_FIELDS``); the adapters carry their weight's
axes on its own side and none on the rank.

``merged`` adds the adapters into their weights (for a Hugging Face export).
``hidden_and_aux(..., adapters=False)`` runs the model without its adapters
(``without_adapters``: the layers' arrays handed to the blocks leave them out):
the base, a preference objective's reference at no memory cost. It is an
argument of the traced call, so a trace with and one without adapters are two
programs.

Not for: the projections themselves (``blocks.py``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from distrib_train.models.nnx_model import variable_axes

TARGETS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}
_LETTERS = "r"  # the rank's einsum letter (the projections' subscripts use b, t, d, n, h, k, f)


def is_adapter(name: str) -> bool:
  """Whether a layer array is an adapter (``lora_a_<w>``, ``lora_b_<w>``)."""
  return name.startswith(("lora_a_", "lora_b_"))


def without_adapters(layers: dict[str, Any]) -> dict[str, Any]:
  """A stack's arrays without its adapters: the projections then compute the frozen base alone."""
  return {k: v for k, v in layers.items() if not is_adapter(k)}


def check(config, attention_targets: frozenset[str] = frozenset("qkvo")) -> None:
  """Refuses a LoRA setting the decoder cannot run (``attention_targets``: which of q, k, v, o the model's
  attention variant takes: ``attention.Variant.lora_targets``).

  Raises:
    ValueError: a negative rank, a dropout outside [0, 1), an unknown target, or an attention target the
      variant does not take (MLA takes none).
  """
  if isinstance(config.lora_rank, bool) or config.lora_rank < 0:
    raise ValueError(f"lora.rank must be 0 (no adapters) or positive, got {config.lora_rank!r}.")
  if not config.lora_rank:
    return
  unknown = [t for t in config.lora_targets if t not in TARGETS]
  if unknown or not config.lora_targets:
    raise ValueError(f"lora.targets names {unknown or 'nothing'}; choose among {', '.join(TARGETS)}.")
  if isinstance(config.lora_dropout, bool) or not 0 <= config.lora_dropout < 1:
    raise ValueError(
      f"lora.dropout is the probability of dropping an adapter's input: 0 ≤ p < 1, got {config.lora_dropout!r}."
    )
  refused = sorted(set(config.lora_targets) & ({"q", "k", "v", "o"} - set(attention_targets)))
  if refused:
    raise ValueError(
      f"lora.targets q, k, v and o adapt GQA attention; this model's is"
      f" {config.attention_kind.upper()}: adapt gate, up and down only."
    )


def weights(config) -> tuple[str, ...]:
  """The projection weights that carry adapters (``wq``, ``w_up``, …)."""
  return tuple(TARGETS[t] for t in config.lora_targets) if config.lora_rank else ()


def adapter_params(config, rngs: nnx.Rngs, stack: dict[str, Any], mixture: bool = False) -> dict[str, nnx.Param]:
  """``lora_a_<w>`` and ``lora_b_<w>`` for each adapted weight of one stack of layers (its params in
  ``stack``, ``[layers, inputs…, outputs…]``); a mixture's experts carry none (their MLP weights stay frozen)."""
  out = {}
  r = config.lora_rank
  for name in weights(config):
    if name not in stack or (mixture and name.startswith("w_")):
      continue
    weight = stack[name]
    shape, axes = weight.shape, variable_axes(weight) or (None,) * len(weight.shape)
    n_in = _inputs(name)
    fan_in = math.prod(shape[1 : 1 + n_in])
    a = jax.random.normal(rngs.params(), (shape[0], *shape[1 : 1 + n_in], r), weight.dtype) / math.sqrt(fan_in)
    out[f"lora_a_{name}"] = nnx.Param(a, out_sharding=(axes[0], *axes[1 : 1 + n_in], None))
    out[f"lora_b_{name}"] = nnx.Param(
      jnp.zeros((shape[0], r, *shape[1 + n_in :]), weight.dtype), out_sharding=(axes[0], None, *axes[1 + n_in :])
    )
  return out


def _inputs(name: str) -> int:
  """How many of a weight's dimensions (after the layers') are its inputs: ``wo`` takes heads × head_dim."""
  return 2 if name == "wo" else 1


SEED = "lora_dropout_seed"  # a layer's dropout seed among its arrays (``dropout_seeds``)


def dropout_seeds(config, rng: jax.Array | None, layers: int) -> jax.Array | None:
  """One uint32 seed per layer of a stack for the adapters' dropout this pass, or None where nothing drops
  (no dropout, no key: evaluation and the reference pass)."""
  if not (config.lora_rank and config.lora_dropout) or rng is None:
    return None
  return jax.random.bits(rng, (layers,), jnp.uint32)


def _dropped(x: jax.Array, seed: jax.Array, name: str, p: float) -> jax.Array:
  """``x`` with each element zeroed with probability ``p`` and the rest scaled by 1 / (1 − p); the mask is
  the layer's seed's, folded with the projection's place among the targets."""
  key = jax.random.fold_in(jax.random.key(seed), list(TARGETS.values()).index(name))
  keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
  return jnp.where(keep, x / jnp.asarray(1.0 - p, x.dtype), jnp.zeros((), x.dtype))


def delta(subscripts: str, x: jax.Array, layer: dict, name: str, config) -> jax.Array | None:
  """``(alpha / rank)·(drop(x)·A)·B`` for weight ``name`` of one layer, in the projection's ``subscripts``,
  or None where it has no adapter; ``x`` is dropped where the layer carries a dropout seed."""
  a, b = layer.get(f"lora_a_{name}"), layer.get(f"lora_b_{name}")
  if a is None:
    return None
  if layer.get(SEED) is not None:
    x = _dropped(x, layer[SEED], name, config.lora_dropout)
  inputs, out = subscripts.split("->")
  x_sub, w_sub = inputs.split(",")
  n_in = _inputs(name)
  contracted, produced = w_sub[:n_in], w_sub[n_in:]
  kept = "".join(c for c in x_sub if c not in contracted)
  low = jnp.einsum(f"{x_sub},{contracted}{_LETTERS}->{kept}{_LETTERS}", x, a.astype(x.dtype))
  scale = config.lora_alpha / config.lora_rank
  return jnp.einsum(f"{kept}{_LETTERS},{_LETTERS}{produced}->{out}", low, b.astype(x.dtype)) * scale


def trainable(path: tuple[Any, ...], value: Any) -> bool:
  """The nnx filter of the params that train with adapters: the adapters alone."""
  return isinstance(value, nnx.Param) and any(str(k).startswith("lora_") for k in path)


def merged(config, base: dict[str, Any], adapters: dict[str, Any]) -> dict[str, Any]:
  """One stack's weights with its adapters added in (``W + (alpha / rank)·A·B``), as numpy-able arrays; the
  stack's other weights as they are."""
  out = dict(base)
  scale = config.lora_alpha / config.lora_rank
  for name in weights(config):
    a, b = adapters.get(f"lora_a_{name}"), adapters.get(f"lora_b_{name}")
    if a is None or name not in base:
      continue
    w = jnp.asarray(base[name], jnp.float32)
    n_in = _inputs(name)
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    lead, in_shape, out_shape = w.shape[0], w.shape[1 : 1 + n_in], w.shape[1 + n_in :]
    product = jnp.einsum(
      "lir,lro->lio", a32.reshape(lead, -1, config.lora_rank), b32.reshape(lead, config.lora_rank, -1)
    )
    out[name] = w + scale * product.reshape(lead, *in_shape, *out_shape)
  return out
