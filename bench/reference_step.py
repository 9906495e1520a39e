"""A hand-written Llama train step in plain JAX: the yardstick for the framework.

``bench/train_throughput.py`` times the framework's step against this one on
the same shape and batch. It is the step one would write without any
framework: params in a dict of arrays, one ``jax.jit`` with donated params
and optimizer state, no sharding, no adapters. It implements the same model
as ``distrib_train/models/llama.py`` — RMSNorm, rotary embeddings, a SwiGLU
MLP, grouped-query attention through ``jax.nn.dot_product_attention``, an
untied embedding and output head, float32 params with bfloat16 compute — so
that the two steps do the same arithmetic and their speed ratio measures the
framework, not a different model. The optimizer is passed in (the benchmark
gives both steps the same ``optax.adamw``).

Not for: training anything. It imports nothing from ``distrib_train`` on
purpose.

Example::

  config = ReferenceConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=16, mlp_dim=192, attention="xla")
  params = init_params(config, jax.random.key(0))
  optimizer = optax.adamw(3e-4)
  step = make_train_step(config, optimizer)
  tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, 256)
  params, opt_state, loss = step(params, optimizer.init(params), tokens[:, :-1], tokens[:, 1:])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

Params = dict[str, Any]
TrainStepFn = Callable[[Params, Any, jax.Array, jax.Array], tuple[Params, Any, jax.Array]]


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
  """Shape, numerics and the two implementation choices of the reference.

  Attributes:
    attention: ``jax.nn.dot_product_attention``'s ``implementation``:
      ``"xla"`` or ``"cudnn"`` (``"auto"`` passes None, which is XLA in jax
      0.10 and 0.11).
    scan_layers: params stacked along a leading layer axis and the blocks
      run by ``jax.lax.scan``; otherwise one dict per layer and a Python
      loop (the unrolled program XLA sees whole).
  """

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  attention: str = "xla"
  scan_layers: bool = False

  def __post_init__(self):
    if self.attention not in ("auto", "xla", "cudnn"):
      raise ValueError(f"attention must be 'auto', 'xla' or 'cudnn', got {self.attention!r}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}).")


def _layer_shapes(config: ReferenceConfig) -> dict[str, tuple[tuple[int, ...], int | None]]:
  """Each layer param's shape and the fan-in its initial scale divides by (None: ones)."""
  d, h, kv, hd, f = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim, config.mlp_dim
  return {
    "attn_norm": ((d,), None),
    "wq": ((d, h, hd), d),
    "wk": ((d, kv, hd), d),
    "wv": ((d, kv, hd), d),
    "wo": ((h, hd, d), h * hd),
    "mlp_norm": ((d,), None),
    "w_gate": ((d, f), d),
    "w_up": ((d, f), d),
    "w_down": ((f, d), f),
  }


def init_params(config: ReferenceConfig, key: jax.Array) -> Params:
  """Initial params: normal / sqrt(fan-in) for matrices, ones for norm scales.

  Returns:
    ``{"embed", "layers", "final_norm", "head"}``; ``layers`` is a dict of
    ``[num_layers, ...]`` arrays when ``scan_layers``, else a list of dicts.
  """
  dtype = jnp.dtype(config.param_dtype)
  shapes = _layer_shapes(config)
  keys = iter(jax.random.split(key, 2 + len(shapes)))

  def normal(shape, fan_in):
    return jax.random.normal(next(keys), shape, dtype) / math.sqrt(fan_in)

  stacked = {}
  for name, (shape, fan_in) in shapes.items():
    full = (config.num_layers, *shape)
    stacked[name] = jnp.ones(full, dtype) if fan_in is None else normal(full, fan_in)
  layers = stacked if config.scan_layers else unstack_layers(stacked)
  return {
    "embed": normal((config.vocab_size, config.d_model), 1),
    "layers": layers,
    "final_norm": jnp.ones((config.d_model,), dtype),
    "head": normal((config.d_model, config.vocab_size), config.d_model),
  }


def unstack_layers(stacked: Params) -> list[Params]:
  """``{name: [num_layers, ...]}`` → one ``{name: [...]}`` per layer.

  Called outside ``jax.jit`` on large models: an initialiser that slices
  under jit took over 9 minutes to compile for the 1b shape on an H100.
  """
  num_layers = len(next(iter(stacked.values())))
  return [{name: value[i] for name, value in stacked.items()} for i in range(num_layers)]


def num_params(params: Params) -> int:
  """Every parameter, embedding and head included."""
  return sum(x.size for x in jax.tree_util.tree_leaves(params))


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (y * scale).astype(x.dtype)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotary embedding of ``x`` [batch, length, heads, dim] (halves rotated)."""
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return rotated.astype(x.dtype)


def _block(config: ReferenceConfig, x: jax.Array, layer: Params, cos: jax.Array, sin: jax.Array) -> jax.Array:
  dtype = jnp.dtype(config.dtype)
  w = {name: value.astype(dtype) for name, value in layer.items()}
  h = _rms_norm(x, layer["attn_norm"], config.norm_eps)
  q = _rotate(jnp.einsum("btd,dnh->btnh", h, w["wq"]), cos, sin)
  k = _rotate(jnp.einsum("btd,dkh->btkh", h, w["wk"]), cos, sin)
  v = jnp.einsum("btd,dkh->btkh", h, w["wv"])
  implementation = None if config.attention == "auto" else config.attention
  attn = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
  x = x + jnp.einsum("btnh,nhd->btd", attn, w["wo"])
  h = _rms_norm(x, layer["mlp_norm"], config.norm_eps)
  hidden = jax.nn.silu(jnp.einsum("btd,df->btf", h, w["w_gate"])) * jnp.einsum("btd,df->btf", h, w["w_up"])
  return x + jnp.einsum("btf,fd->btd", hidden, w["w_down"])


def loss(params: Params, tokens: jax.Array, targets: jax.Array, config: ReferenceConfig) -> jax.Array:
  """Mean next-token cross-entropy over every position of ``tokens`` [batch, length]."""
  length = tokens.shape[1]
  half = config.head_dim // 2
  inv_freq = config.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq  # [length, half]
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]

  x = jnp.take(params["embed"], tokens, axis=0).astype(config.dtype)
  if config.scan_layers:
    x, _ = jax.lax.scan(lambda x, layer: (_block(config, x, layer, cos, sin), None), x, params["layers"])
  else:
    for layer in params["layers"]:
      x = _block(config, x, layer, cos, sin)
  x = _rms_norm(x, params["final_norm"], config.norm_eps)
  logits = jnp.einsum("btd,dv->btv", x, params["head"].astype(x.dtype)).astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))


def make_train_step(config: ReferenceConfig, optimizer: optax.GradientTransformation) -> TrainStepFn:
  """``step(params, opt_state, tokens, targets) -> (params, opt_state, loss)``, jitted.

  ``params`` and ``opt_state`` are donated: the caller's references to
  them are invalid after the call.
  """

  def step(params, opt_state, tokens, targets):
    value, grads = jax.value_and_grad(loss)(params, tokens, targets, config)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return jax.jit(step, donate_argnums=(0, 1))
