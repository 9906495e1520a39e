"""A decoder layer: its attention (``attention.py``: GQA or MLA) then its MLP (gated or experts), as its kind says.

Every layer is pre-norm ``x + attention(norm(x))`` then ``x + mlp(norm(x))``,
with the norms after each part too under ``sandwich_norms`` (Gemma 3).

- **MLP, gated**: ``act(h·w_gate) · (h·w_up) · w_down`` with SiLU (SwiGLU),
  tanh GELU (GeGLU) or gpt-oss's clamped SwiGLU.
- **MLP, experts**: routing (``routing.py``), the routed experts'
  grouped matmuls (``parallel/experts.py``), optional shared experts.

Params are stacked per segment of equal layers (``decoder.py``): each
function here takes one layer's slice. ``Kind`` says which variants a layer
composes. The parts every variant uses (``Kind``, ``param``, ``rms_norm``,
a projection) are ``parts.py``'s.

Not for: the order of layers and their scan (``decoder.py``), the kernels
(``kernels/``), the config (``llama.py``, ``moe.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from distrib_train.parallel.experts import dispatch
from distrib_train.recipes import lora, routing
from distrib_train.recipes.attention import attention_params, attention_sublayer
from distrib_train.recipes.parts import Kind, norm as _norm, param, project as _project
from distrib_train.sharding.axis_rules import constrain


# --- MLP --------------------------------------------------------------------------------------


def _gated(gate: jax.Array, up: jax.Array, *, kind: str, alpha: float, limit: float) -> jax.Array:
  if kind == "gelu_tanh":
    return jax.nn.gelu(gate, approximate=True) * up
  if kind == "swiglu_oss":  # gpt-oss: both halves clamped, the up half shifted by one
    gate = jnp.minimum(gate, limit)
    return gate * jax.nn.sigmoid(gate * alpha) * (jnp.clip(up, -limit, limit) + 1)
  return jax.nn.silu(gate) * up


def activation(config) -> Any:
  """The gated MLP's ``act(gate, up)`` for ``config.mlp_activation`` (a hashable callable)."""
  return functools.partial(_gated, kind=config.mlp_activation, alpha=config.swiglu_alpha, limit=config.swiglu_limit)


def dense_params(config, rngs: nnx.Rngs, n: int, width: int, prefix: str = "w") -> dict[str, nnx.Param]:
  """``n`` layers' gated MLP of ``width`` (``prefix``: ``w`` for the MLP, ``shared`` for shared experts)."""
  pd, d = jnp.dtype(config.param_dtype), config.d_model
  names = ("w_gate", "w_up", "w_down") if prefix == "w" else ("shared_gate", "shared_up", "shared_down")
  return {
    names[0]: param(rngs, (n, d, width), ("layers", "embed", "mlp"), pd, fan_in=d),
    names[1]: param(rngs, (n, d, width), ("layers", "embed", "mlp"), pd, fan_in=d),
    names[2]: param(rngs, (n, width, d), ("layers", "mlp", "embed"), pd, fan_in=width),
  }


def gated_mlp(
  config, h: jax.Array, layer: dict, names: tuple[str, str, str] = ("w_gate", "w_up", "w_down")
) -> jax.Array:
  """The gated MLP on ``h`` [batch, length, embed] with one layer's ``names`` weights."""
  gate = _project("btd,df->btf", h, layer, names[0], config)
  up = _project("btd,df->btf", h, layer, names[1], config)
  hidden = constrain(activation(config)(gate, up), ("batch", "length", "mlp"))
  return constrain(_project("btf,fd->btd", hidden, layer, names[2], config), ("batch", "length", "embed"))


def mixture_params(config, rngs: nnx.Rngs, n: int) -> dict[str, nnx.Param]:
  """``n`` layers' router, routed experts (and their biases) and shared experts."""
  c, pd = config, jnp.dtype(config.param_dtype)
  d, e, f = c.d_model, c.num_experts, c.expert_mlp_dim
  out = {
    "router": param(rngs, (n, d, e), ("layers", "embed", None), pd, fan_in=d),
    "w_gate": param(rngs, (n, e, d, f), ("layers", "expert", "embed", "expert_mlp"), pd, fan_in=d),
    "w_up": param(rngs, (n, e, d, f), ("layers", "expert", "embed", "expert_mlp"), pd, fan_in=d),
    "w_down": param(rngs, (n, e, f, d), ("layers", "expert", "expert_mlp", "embed"), pd, fan_in=f),
  }
  if c.router_logit_bias:
    out["router_logit_bias"] = param(rngs, (n, e), ("layers", None), pd, None, value=0.0)
  if c.expert_bias:
    out.update(
      b_gate=param(rngs, (n, e, f), ("layers", "expert", "expert_mlp"), pd, None, value=0.0),
      b_up=param(rngs, (n, e, f), ("layers", "expert", "expert_mlp"), pd, None, value=0.0),
      b_down=param(rngs, (n, e, d), ("layers", "expert", None), pd, None, value=0.0),
    )
  if c.num_shared_experts:
    out.update(dense_params(c, rngs, n, c.shared_width, prefix="shared"))
    if c.shared_expert_gate:
      out["shared_expert_gate"] = param(rngs, (n, d, 1), ("layers", "embed", None), pd, fan_in=d)
  return out


def mlp_sublayer(config, kind: Kind, x: jax.Array, layer: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
  """``x`` plus the MLP (gated, or experts) on its normed value; a mixture's routing aux (per batch row)."""
  h = _norm(config, x, layer["mlp_norm"])
  aux: dict[str, jax.Array] = {}
  if not kind.mixture:
    out = gated_mlp(config, h, layer)
  else:
    indices, weights, aux = routing.route(
      config, h, layer["router"], layer.get("router_bias"), layer.get("router_logit_bias")
    )
    dtype = h.dtype
    biases = tuple(layer[k].astype(dtype) for k in ("b_gate", "b_up", "b_down")) if config.expert_bias else None
    out, dropped = dispatch(
      h,
      indices,
      weights.astype(dtype),
      layer["w_gate"].astype(dtype),
      layer["w_up"].astype(dtype),
      layer["w_down"].astype(dtype),
      capacity_factor=config.capacity_factor,
      activation=activation(config),
      biases=biases,
    )
    aux = {**aux, "dropped": dropped}
    if config.num_shared_experts:
      shared = gated_mlp(config, h, layer, ("shared_gate", "shared_up", "shared_down"))
      if config.shared_expert_gate:
        shared = shared * jax.nn.sigmoid(jnp.einsum("btd,do->bto", h, layer["shared_expert_gate"].astype(dtype)))
      out = out + shared
  if config.sandwich_norms:
    out = _norm(config, out, layer["post_mlp_norm"])
  return x + out, aux


def layer_params(config, rngs: nnx.Rngs, n: int, mixture: bool) -> dict[str, Any]:
  """``n`` layers' params, stacked on a leading ``layers`` axis: the attention and its norm, the MLP's norm and
  the MLP (gated, or a mixture's experts), LoRA's adapters, the norm after the MLP under sandwich norms, and a
  mixture's router score correction (``RouterBias`` local state) where the config has one."""
  c = config
  norm = lambda: param(
    rngs, (n, c.d_model), ("layers", "embed"), jnp.dtype(c.param_dtype), None, value=1.0 - c.norm_weight_offset
  )
  stack = {**attention_params(c, rngs, n), "mlp_norm": norm()}
  stack.update(mixture_params(c, rngs, n) if mixture else dense_params(c, rngs, n, c.mlp_dim))
  stack.update(lora.adapter_params(c, rngs, stack, mixture))
  if c.sandwich_norms:
    stack["post_mlp_norm"] = norm()
  if mixture and (c.router_score_bias or c.router_bias_update_rate > 0):
    stack["router_bias"] = routing.RouterBias(jnp.zeros((n, c.num_experts), jnp.float32), out_sharding=("layers", None))
  return stack


def layer(config, kind: Kind, x: jax.Array, params: dict, positions, segment_ids) -> tuple[jax.Array, dict]:
  """One decoder layer of ``kind`` on ``x`` [batch, length, embed]: the hidden states and the routing aux."""
  x = attention_sublayer(config, kind, x, params, positions, segment_ids)
  return mlp_sublayer(config, kind, x, params)
