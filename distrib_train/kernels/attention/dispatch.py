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
  axis (``ring.py``, XLA tiles);
- ``all_gather_splash``: the same split, ``model.context_attention:
  all_gather`` on TPU (or ``model.attention: splash``, in interpret mode
  off a TPU): the whole sequence's keys gathered, splash per query shard
  (``attention.context_splash_attention``). On GPU the all-gather runs in
  XLA tiles: a query chunk needs a causal mask aligned to the bottom right
  of the gathered keys, and jax's cuDNN attention has only the top-left one
  (``MaskType.CAUSAL`` / ``PADDING_CAUSAL``, no offsets);
- ``splash``: on TPU for lengths a multiple of 128 (``splash.py``), the
  window as a local mask, sinks and the soft cap in the kernel;
- ``cudnn_packed``: packed rows on a Hopper GPU (``cudnn.py``),
  the window as cuDNN's sliding window;
- ``cudnn``: jax's cuDNN flash attention on an Ampere or newer GPU (16-bit,
  head sizes a multiple of 8 up to 128, 256 on Hopper), its window likewise;
- ``xla``: elsewhere, and wherever the kernels cannot serve (sinks or a
  soft cap on GPU): jax's attention, which materialises the [length, length]
  scores; or, where sinks or a soft cap are asked for or the values' head
  size is not the queries' (MLA), this module's own, past ``TILE`` tokens in
  rematerialized tiles of online softmax (``xla.tiled_attention``), as
  flash attention keeps its memory;
- ``xla`` with branches: inside ``shared_prefixes(branch_ids)``, rows whose
  documents hold a shared prefix and its continuations side by side
  (``generation/scoring.py``): this module's own over the [length, length]
  scores, with a mask segment ids cannot say.

``model.attention`` asks for one (``auto`` lets ``choose`` pick); a kernel
asked for that cannot run the layer is refused with the reason. Inside
``recorded()`` each choice is kept with its reason, for the plan's report.

Not for: the kernels themselves (``splash.py``, ``cudnn.py``, ``xla.py``,
``ring.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from distrib_train.common.versions import gpu_capability
from distrib_train.kernels.attention import ring
from distrib_train.sharding import context
from distrib_train.kernels.attention import cudnn as cudnn_attention
from distrib_train.kernels.attention.splash import BLOCK as SPLASH_BLOCK
from distrib_train.kernels.attention.splash import context_splash_attention, splash_attention
from distrib_train.kernels.attention.xla import masked_attention, tiled_attention, visible
from distrib_train.kernels.attention import work as attention_work
from distrib_train.sharding.axis_rules import active_activation_sharding, active_device

REQUESTS = ("auto", "xla", "cudnn", "splash")
TILE = 1024  # past this length, this module's own attention runs in tiles of this many queries and keys


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
    regather: ``all_gather_splash`` gathers the keys and values again for the backward pass rather than keep
      them (False where the layer's remat recomputes them anyway).
  """

  requested: str = "auto"
  window: int = 0
  scale: float | None = None
  softcap: float = 0.0
  max_segments: int = 8
  context: str = "ring"
  regather: bool = True


def _cudnn_runs(q: jax.Array, v_dim: int, masked: bool) -> bool:
  """Whether jax's cuDNN flash attention takes these inputs on this device."""
  capability = gpu_capability(active_device())
  hopper = capability >= (9, 0)
  limit = 256 if hopper else 128
  qk_dim = q.shape[-1]
  return (
    capability >= ((9, 0) if masked else (8, 0))
    and q.dtype in (jnp.bfloat16, jnp.float16)
    and qk_dim % 8 == 0
    and qk_dim <= limit
    and v_dim % 8 == 0
    and v_dim <= limit
    and (v_dim == qk_dim or hopper)
  )


_DECISIONS: contextvars.ContextVar[list | None] = contextvars.ContextVar("attention_decisions", default=None)
_BRANCHES: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("attention_branches", default=None)


@contextlib.contextmanager
def shared_prefixes(branch_ids: jax.Array):
  """While entered (a program being traced), every ``attention`` also reads ``branch_ids`` [batch, length]: in
  each packed document, the tokens of branch 0 are a prefix every branch continues, and a token of branch
  ``b > 0`` sees those and the earlier tokens of its own branch, never another branch's. A row lays a document
  out as its prefix, then each branch after the other, the branches' positions each continuing the prefix's
  (sliding windows count positions, not places in the row). Several continuations of one context are so
  computed over the context once (``generation/scoring.py``). Runs in XLA over the [length, length] scores,
  whatever kernel the layer asks for; no context axis."""
  token = _BRANCHES.set(branch_ids)
  try:
    yield
  finally:
    _BRANCHES.reset(token)


@dataclasses.dataclass(frozen=True)
class Decision:
  """One attention layer's kernel as ``attention`` ran it while a step was traced: the kernel ``choose``
  picked, why, the sequence's length and the layer's window; for splash, the work its mask's blocks cost over
  the causal ideal, and the bytes of one layer's gathered keys and values on a context axis (per device)."""

  kernel: str
  reason: str
  length: int
  window: int
  work: float | None = None
  gathered_bytes: float | None = None


def recorded() -> contextlib.AbstractContextManager[list[Decision]]:
  """While entered, every ``attention`` call adds its ``Decision`` (once per distinct one) to the list it
  yields."""
  return attention_work.collecting(_DECISIONS)


def choose(
  layer: Attention, q: jax.Array, *, masked: bool = False, sinks: bool = False, v_dim: int | None = None
) -> str:
  """The kernel ``attention`` runs for ``layer`` on ``q`` (``decide`` says why)."""
  return decide(layer, q, masked=masked, sinks=sinks, v_dim=v_dim)[0]


def _context_choice(layer: Attention, q: jax.Array, size: int) -> tuple[str, str]:
  if layer.context == "ring":
    return "ring", (
      "model.context_attention: ring; its blocks run in XLA tiles (a fused kernel's blocks would"
      " need a differentiable log-sum-exp to merge)"
    )
  platform = active_device().platform
  if layer.requested not in ("auto", "splash") or (platform != "tpu" and layer.requested != "splash"):
    why = {
      "tpu": f"model.attention: {layer.requested}",
      "gpu": "jax's cuDNN attention has no bottom-right causal mask for a query chunk against the gathered keys",
    }.get(platform, f"no fused kernel on {platform} (model.attention: splash runs splash interpreted)")
    return "all_gather", f"all-gather of keys and values; XLA tiles: {why}"
  if q.shape[1] % (2 * size * SPLASH_BLOCK):
    return "all_gather", (
      f"all-gather; XLA tiles: splash needs the length to be a multiple of 2 × context ×"
      f" {SPLASH_BLOCK} = {2 * size * SPLASH_BLOCK}, got {q.shape[1]}"
    )
  mesh, rules = active_activation_sharding()
  split = rules.spec(("length",), shape=(q.shape[1],), mesh=mesh)[0]
  if split != context.CONTEXT_AXIS and tuple(split or ()) != (context.CONTEXT_AXIS,):
    return "all_gather", f"all-gather; XLA tiles: splash's query shards need 'length' on 'context' alone, got {split!r}"
  return "all_gather_splash", "all-gather of keys and values, splash per query shard (load-balanced causal mask)"


def decide(
  layer: Attention, q: jax.Array, *, masked: bool = False, sinks: bool = False, v_dim: int | None = None
) -> tuple[str, str]:
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
  size = context.context_size()
  if _BRANCHES.get() is not None:
    if size > 1:
      raise ValueError(
        "shared-prefix rows (scoring) split over a context axis: their mask is not the context"
        " kernels'; use a mesh without one."
      )
    return "xla", "shared-prefix rows: a prefix and its branches side by side, a mask beyond segment ids"
  if size > 1:
    return _context_choice(layer, q, size)
  device = active_device()
  splash_fits = q.shape[1] % SPLASH_BLOCK == 0
  if layer.requested == "splash":
    return "splash", "model.attention: splash"
  if layer.requested in ("auto", "cudnn") and device.platform == "tpu":
    if layer.requested == "cudnn":
      raise ValueError("model.attention=cudnn is a GPU kernel and this step runs on TPU: use auto or splash.")
    return (
      ("splash", "TPU")
      if splash_fits
      else ("xla", f"TPU, but splash needs a length that is a multiple of {SPLASH_BLOCK}, got {q.shape[1]}")
    )
  if layer.requested == "xla":
    return "xla", "model.attention: xla"
  cudnn_can = not sinks and not layer.softcap
  if layer.requested == "cudnn" and not cudnn_can:
    raise ValueError(
      "model.attention=cudnn cannot run attention sinks or a soft cap on the scores (cuDNN's"
      " fused attention has neither): use auto, which runs them in XLA on GPU, or xla."
    )
  if layer.requested == "auto" and not cudnn_can:
    return "xla", "attention sinks or a soft cap, which cuDNN's fused attention lacks"
  if layer.requested == "auto" and not _cudnn_runs(q, v_dim, masked):
    return "xla", (
      f"no cuDNN flash attention for {device.platform}, {q.dtype} and head sizes {q.shape[-1]}/{v_dim}"
      " (it needs an Ampere or newer GPU, 16-bit inputs, head sizes a multiple of 8)"
    )
  if masked and layer.max_segments and gpu_capability(device) >= (9, 0):
    return "cudnn_packed", "packed rows on a Hopper GPU: cuDNN's packed layout, no mask array"
  return "cudnn", f"model.attention: {layer.requested} on GPU"


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  layer: Attention,
  *,
  positions: jax.Array,
  segment_ids: jax.Array | None = None,
  sinks: jax.Array | None = None,
) -> jax.Array:
  """Causal attention as ``layer`` asks, with the kernel ``choose`` picks → [batch, length, heads, v_dim].

  Args:
    q, k, v: queries [batch, length, heads, qk_dim], keys [batch, length, kv_heads, qk_dim], values
      [batch, length, kv_heads, v_dim]; ``heads`` a multiple of ``kv_heads``.
    layer: the layer's attention (window, scale, soft cap, the kernel asked for).
    positions: [batch, length] each token's position in its document (a context mesh reorders tokens).
    segment_ids: [batch, length] document ids of packed rows (None: one document per row).
    sinks: [heads] the layer's attention sinks (None: none).
  """
  kernel, reason = decide(layer, q, masked=segment_ids is not None, sinks=sinks is not None, v_dim=v.shape[-1])
  with attention_work.noted() as notes:
    out = _run(kernel, q, k, v, layer, positions, segment_ids, sinks)
  decisions = _DECISIONS.get()
  decision = Decision(
    kernel,
    reason,
    int(q.shape[1]),
    layer.window,
    *((notes[0]["work"], notes[0].get("gathered_bytes")) if notes else ()),
  )
  if decisions is not None and decision not in decisions:
    decisions.append(decision)
  return out


def _run(kernel, q, k, v, layer, positions, segment_ids, sinks):
  scale = layer.scale if layer.scale is not None else 1.0 / math.sqrt(q.shape[-1])
  if kernel == "all_gather_splash":
    return context_splash_attention(
      q,
      k,
      v,
      segment_ids,
      window=layer.window,
      scale=scale,
      softcap=layer.softcap,
      sinks=sinks,
      regather=layer.regather,
    )
  if kernel in ("ring", "all_gather"):
    return ring.attention(
      q, k, v, positions, segment_ids, kernel, window=layer.window, scale=scale, softcap=layer.softcap, sinks=sinks
    )
  if kernel == "splash":
    return splash_attention(q, k, v, segment_ids, window=layer.window, scale=scale, softcap=layer.softcap, sinks=sinks)
  if kernel in ("cudnn_packed", "cudnn"):
    with _cudnn_work(q, v, layer.window):
      return _cudnn(kernel, q, k, v, layer, segment_ids, scale)
  options = dict(window=layer.window, scale=scale, softcap=layer.softcap, sinks=sinks)
  if (branch_ids := _BRANCHES.get()) is not None:
    return reference_attention(q, k, v, segment_ids, branch_ids=branch_ids, positions=positions, **options)
  if sinks is not None or layer.softcap or v.shape[-1] != q.shape[-1]:
    if q.shape[1] > TILE:  # flash attention's memory in XLA: no [length, length] scores
      return tiled_attention(q, k, v, positions, segment_ids, block=TILE, **options)
    return reference_attention(q, k, v, segment_ids, **options)
  return jax.nn.dot_product_attention(
    q,
    k,
    v,
    mask=None if segment_ids is None else cudnn_attention.segment_mask(segment_ids),
    is_causal=True,
    scale=layer.scale,
    local_window_size=(layer.window - 1, 0) if layer.window else None,
    implementation=None if layer.requested == "auto" else "xla",
  )


def _cudnn_work(q: jax.Array, v: jax.Array, window: int):
  """``work.flops_scope`` of a cuDNN call on one device: the causal pairs (a window's band) of its rows and
  heads, which XLA splits as the rules split batch and heads (packed rows count whole rows: an upper bound)."""
  rows, _, heads = q.shape[:3]
  active = active_activation_sharding()
  if active is not None:  # one device's share of the rows and heads
    mesh, rules = active
    spec = rules.spec(("batch", "length", "heads"), shape=q.shape[:3], mesh=mesh)
    rows, _, heads = NamedSharding(mesh, spec).shard_shape(q.shape[:3])
  pairs = rows * heads * attention_work.causal_pairs(q.shape[1], window)
  return attention_work.flops_scope(pairs, q.shape[-1], v.shape[-1])


def _cudnn(kernel, q, k, v, layer, segment_ids, scale):
  if kernel == "cudnn_packed":
    return cudnn_attention.packed_attention(
      q, k, v, segment_ids, max_segments=layer.max_segments, scale=scale, window=layer.window
    )
  if v.shape[-1] != q.shape[-1]:  # MLA's values: jax.nn's API wants one head size
    return cudnn_attention.causal_attention(q, k, v, segment_ids, scale=scale, window=layer.window)
  mask = None if segment_ids is None else cudnn_attention.segment_mask(segment_ids)
  window = (layer.window - 1, 0) if layer.window else None
  return jax.nn.dot_product_attention(
    q, k, v, mask=mask, is_causal=True, scale=layer.scale, local_window_size=window, implementation="cudnn"
  )


def reference_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array | None,
  *,
  window: int,
  scale: float,
  softcap: float,
  sinks: jax.Array | None,
  branch_ids: jax.Array | None = None,
  positions: jax.Array | None = None,
) -> jax.Array:
  """Attention in plain XLA with what jax's own lacks (sinks, a soft cap): each row's causal mask (a window's band,
  each packed document to itself) over the [length, length] scores, through ``xla.masked_attention``. With
  ``branch_ids`` (and ``positions``), shared-prefix rows (``shared_prefixes``): a branch sees its prefix and
  itself, the window counts positions."""
  rows = jnp.arange(q.shape[1])[None]
  if branch_ids is None:  # a packed document's rows are its order (its positions restart, its segment apart)
    seen = visible(rows, rows, window=window, query_segments=segment_ids, key_segments=segment_ids)
  else:  # a branch's positions continue its trunk's, in another place of the row: the window counts positions
    seen = (
      visible(rows, rows, query_segments=segment_ids, key_segments=segment_ids)
      & visible(positions, positions, window=window)
      & ((branch_ids[:, None, :] == 0) | (branch_ids[:, None, :] == branch_ids[:, :, None]))
    )
  return masked_attention(q, k, v, seen, scale=scale, softcap=softcap, sinks=sinks)
