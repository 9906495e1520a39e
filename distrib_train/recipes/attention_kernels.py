"""The one place that picks and runs a layer's attention kernel, for every family.

``attention(q, k, v, layer, positions=…, segment_ids=…, sinks=…)`` computes
causal attention of ``q`` [batch, length, heads, qk_dim] over ``k``
[batch, length, kv_heads, qk_dim] and ``v`` [batch, length, kv_heads,
v_dim] — grouped-query heads, each packed document to itself — with what
the layer asks for (``Attention``): a sliding window (HF's rule: a query at
``i`` sees keys ``j`` with ``i − window < j ≤ i``), a softmax scale, a
soft cap on the scores, per-head sinks (gpt-oss: a logit per head that
joins each softmax and is then dropped). ``choose`` says which kernel runs:

- ``ring`` / ``all_gather``: the sequence is split over a ``context`` mesh
  axis (``parallel/context.py``, XLA tiles);
- ``splash``: on TPU for lengths a multiple of 128 (``attention.py``), the
  window as a local mask, sinks and the soft cap in the kernel;
- ``cudnn_packed``: packed rows on a Hopper GPU (``cudnn_attention.py``),
  the window as cuDNN's sliding window;
- ``cudnn``: jax's cuDNN flash attention on an Ampere or newer GPU (16-bit,
  head sizes a multiple of 8 up to 128, 256 on Hopper), its window likewise;
- ``xla``: elsewhere, and wherever the kernels cannot serve (sinks or a
  soft cap on GPU): jax's attention, which materialises the [length, length]
  scores; or, where sinks or a soft cap are asked for or the values' head
  size is not the queries' (MLA), this module's own, past ``TILE`` tokens in
  rematerialized tiles of online softmax (``parallel/context.py``), as
  flash attention keeps its memory.

``model.attention`` asks for one (``auto`` lets ``choose`` pick); a kernel
asked for that cannot run the layer is refused with the reason.

Not for: the kernels themselves (``attention.py``, ``cudnn_attention.py``,
``parallel/context.py``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from distrib_train.common.versions import gpu_capability
from distrib_train.parallel import context
from distrib_train.recipes import cudnn_attention
from distrib_train.recipes.attention import BLOCK as SPLASH_BLOCK
from distrib_train.recipes.attention import splash_attention
from distrib_train.sharding.axis_rules import active_activation_sharding

REQUESTS = ("auto", "xla", "cudnn", "splash")
TILE = 1024  # past this length, this module's own attention runs in tiles of this many queries and keys
_MASKED = -1e30  # finite: a row with nothing to see gives no NaN


@dataclasses.dataclass(frozen=True)
class Attention:
  """What one layer's attention computes and which kernel it asks for (static, part of the traced step).

  Attributes:
    requested: ``auto``, ``xla``, ``cudnn`` or ``splash`` (``model.attention``).
    window: a sliding window of this many keys, the query's own included (0: every earlier key).
    scale: the softmax scale (None: 1/√qk_dim).
    softcap: scores become ``softcap · tanh(scores / softcap)`` before the softmax (0: off).
    max_segments: runs a packed row may hold in cuDNN's packed layout (0: a dense segment mask instead).
    context: with a context mesh axis, ``ring`` or ``all_gather``.
  """

  requested: str = "auto"
  window: int = 0
  scale: float | None = None
  softcap: float = 0.0
  max_segments: int = 8
  context: str = "ring"


def _device():
  active = active_activation_sharding()
  return active[0].devices.flat[0] if active else jax.devices()[0]


def _cudnn_runs(q: jax.Array, v_dim: int, masked: bool) -> bool:
  """Whether jax's cuDNN flash attention takes these inputs on this device."""
  capability = gpu_capability(_device())
  hopper = capability >= (9, 0)
  limit = 256 if hopper else 128
  qk_dim = q.shape[-1]
  return (capability >= ((9, 0) if masked else (8, 0)) and q.dtype in (jnp.bfloat16, jnp.float16)
          and qk_dim % 8 == 0 and qk_dim <= limit and v_dim % 8 == 0 and v_dim <= limit
          and (v_dim == qk_dim or hopper))


def choose(layer: Attention, q: jax.Array, *, masked: bool = False, sinks: bool = False,
           v_dim: int | None = None) -> str:
  """The kernel ``attention`` runs for ``layer`` on ``q`` [batch, length, heads, qk_dim] (module docstring).

  Args:
    layer: the layer's attention.
    q: the queries (their shape, dtype and the step's devices decide).
    masked: packed rows (segment ids).
    sinks: the layer has attention sinks.
    v_dim: the values' head size (default: ``q``'s).

  Raises:
    ValueError: a kernel asked for that cannot run this layer (the reason named).
  """
  if layer.requested not in REQUESTS:
    raise ValueError(f"model.attention must be one of {', '.join(REQUESTS)}, got {layer.requested!r}.")
  v_dim = q.shape[-1] if v_dim is None else v_dim
  if context.context_size() > 1:
    return layer.context
  device = _device()
  splash_fits = q.shape[1] % SPLASH_BLOCK == 0
  if layer.requested == "splash":
    return "splash"
  if layer.requested in ("auto", "cudnn") and device.platform == "tpu":
    if layer.requested == "cudnn":
      raise ValueError("model.attention=cudnn is a GPU kernel and this step runs on TPU: use auto or splash.")
    return "splash" if splash_fits else "xla"
  if layer.requested == "xla":
    return "xla"
  cudnn_can = not sinks and not layer.softcap
  if layer.requested == "cudnn" and not cudnn_can:
    raise ValueError("model.attention=cudnn cannot run attention sinks or a soft cap on the scores (cuDNN's"
                     " fused attention has neither): use auto, which runs them in XLA on GPU, or xla.")
  if layer.requested == "auto" and not (cudnn_can and _cudnn_runs(q, v_dim, masked)):
    return "xla"
  if masked and layer.max_segments and gpu_capability(device) >= (9, 0):
    return "cudnn_packed"  # packed rows without a mask array
  return "cudnn"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, layer: Attention, *, positions: jax.Array,
              segment_ids: jax.Array | None = None, sinks: jax.Array | None = None) -> jax.Array:
  """Causal attention as ``layer`` asks, with the kernel ``choose`` picks → [batch, length, heads, v_dim].

  Args:
    q, k, v: queries [batch, length, heads, qk_dim], keys [batch, length, kv_heads, qk_dim], values
      [batch, length, kv_heads, v_dim]; ``heads`` a multiple of ``kv_heads``.
    layer: the layer's attention (window, scale, soft cap, the kernel asked for).
    positions: [batch, length] each token's position in its document (a context mesh reorders tokens).
    segment_ids: [batch, length] document ids of packed rows (None: one document per row).
    sinks: [heads] the layer's attention sinks (None: none).
  """
  kernel = choose(layer, q, masked=segment_ids is not None, sinks=sinks is not None, v_dim=v.shape[-1])
  scale = layer.scale if layer.scale is not None else 1.0 / math.sqrt(q.shape[-1])
  if kernel in ("ring", "all_gather"):
    return context.attention(q, k, v, positions, segment_ids, kernel, window=layer.window, scale=scale,
                             softcap=layer.softcap, sinks=sinks)
  if kernel == "splash":
    return splash_attention(q, k, v, segment_ids, window=layer.window, scale=scale, softcap=layer.softcap,
                            sinks=sinks)
  if kernel == "cudnn_packed":
    return cudnn_attention.packed_attention(q, k, v, segment_ids, max_segments=layer.max_segments, scale=scale,
                                            window=layer.window)
  if kernel == "cudnn" and v.shape[-1] != q.shape[-1]:  # MLA's values: jax.nn's API wants one head size
    return cudnn_attention.causal_attention(q, k, v, segment_ids, scale=scale, window=layer.window)
  if sinks is not None or layer.softcap or v.shape[-1] != q.shape[-1]:
    options = dict(window=layer.window, scale=scale, softcap=layer.softcap, sinks=sinks)
    if q.shape[1] > TILE:  # flash attention's memory in XLA: no [length, length] scores
      return context.tiled_attention(q, k, v, positions, segment_ids, block=TILE, **options)
    return reference_attention(q, k, v, segment_ids, **options)
  mask = None if segment_ids is None else cudnn_attention.segment_mask(segment_ids)
  window = (layer.window - 1, 0) if layer.window else None
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=layer.scale,
                                      local_window_size=window, implementation="cudnn" if kernel == "cudnn"
                                      else (None if layer.requested == "auto" else "xla"))


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, *, window: int,
                        scale: float, softcap: float, sinks: jax.Array | None) -> jax.Array:
  """Attention in plain XLA with what jax's own lacks (sinks, a soft cap): the scores in float32, then the
  softmax, over the [length, length] scores of each head."""
  batch, length, heads, qk_dim = q.shape
  kv_heads = k.shape[2]
  groups = heads // kv_heads
  qg = q.reshape(batch, length, kv_heads, groups, qk_dim)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
  if softcap:
    scores = softcap * jnp.tanh(scores / softcap)
  query, key = jnp.arange(length)[:, None], jnp.arange(length)[None, :]
  visible = key <= query
  if window:
    visible &= query - key < window
  visible = visible[None, None, None]
  if segment_ids is not None:
    visible = visible & (segment_ids[:, None, None, :, None] == segment_ids[:, None, None, None, :])
  scores = jnp.where(visible, scores, _MASKED)
  if sinks is not None:
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, groups, 1, 1),
                            (batch, kv_heads, groups, length, 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
  else:
    probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
  return out.reshape(batch, length, heads, v.shape[-1])
