"""The decoder's key/value cache and its cached forward: prefill a prompt, then decode one token at a time.

**Layout.** The cache mirrors the decoder's segments (``recipes/decoder.py``):
for each segment, one entry per position in its period, stacked on a
leading ``layers`` axis (the segment's periods), so the layers scan over
their params and their cache together. A GQA layer keeps its rotated keys
and values ``[layers, batch, kv_heads, slots, head_dim]``; an MLA layer
(DeepSeek-V3) keeps ``mla_latent``'s state ``[layers, batch, slots,
kv_lora_rank + qk_rope_head_dim]`` — the normed latent and the rotary key
all heads share, not the expanded heads. Heads come before slots, so each
row's and head's slots are one matrix (the two minor axes a TPU tiles):
with the slots after the heads, 1 to 4 kv heads a chip were padded into
each tile, and libtpu copied each layer's cache out of the stack before
its product (``bench/generation.py tpu``). A full layer has one slot per
token (``max_len``); a sliding layer (Gemma 3's local layers, gpt-oss's)
has a ring of ``window`` slots where that is shorter: token ``a`` goes to
slot ``a mod window``.

**Rows.** A batch's prompts are left-padded to one length, so every row
writes the same slot at each step. ``pads`` [batch] counts each row's pads:
the token at index ``a`` of the row has position ``a − pads`` (its first
real token is position 0, as transformers' ``generate`` counts a
left-padded row), and no query sees a pad.

**Prefill** runs the prompt through the training kernels
(``kernels/attention/dispatch``: splash, cuDNN, XLA), with the pads as a
segment of their own, and writes every layer's keys and values (or
latents). **Decode** writes one token's and reads the cache through
``kernels/attention/xla``; MLA decodes absorbed: the queries move into
the latent's space (``q_nope · W_uk``), attend over the cached latents as
one key/value head, and the result leaves it through ``W_uv``.

Logical axes: ``layers``, ``batch``, ``kv_heads``, ``length`` (slots),
``head_dim``, laid out by the planner's rules as activations are
(``cache_shardings``).

Not for: sampling (``sampling.py``), the loop over steps (``engine.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from distrib_train.kernels import fp8
from distrib_train.kernels.attention import dispatch as attention_kernels
from distrib_train.recipes import attention, blocks
from distrib_train.recipes.parts import Kind
from distrib_train.recipes.decoder import segments
from distrib_train.sharding.axis_rules import active_device, constrain


@dataclasses.dataclass(frozen=True)
class Entry:
  """One period position's cache in a segment: its name, the layers' kind, its slots, what it holds."""

  segment: str
  position: int
  kind: Kind
  periods: int
  slots: int
  ring: bool  # a sliding window's ring of ``slots`` (fewer than the cache's length)


def entries(config, max_len: int) -> tuple[Entry, ...]:
  """The cache's entries for a cache of ``max_len`` tokens (module docstring)."""
  out = []
  for segment in segments(config):
    period = len(segment.kinds)
    for i, kind in enumerate(segment.kinds):
      window = config.sliding_window if kind.sliding else 0
      ring = bool(window) and window < max_len
      out.append(Entry(segment.name, i, kind, segment.count // period, window if ring else max_len, ring))
  return tuple(out)


def _layout(dims: tuple, axes: tuple, periods, batch, slots) -> tuple[tuple, tuple]:
  """A cached array's shape and logical axes from what a token keeps (``attention.Variant.cached``): layers,
  rows, the token's leading dims (kv heads), the slots, its last dim (module docstring)."""
  return ((periods, batch, *dims[:-1], slots, dims[-1]), ("layers", "batch", *axes[:-1], "length", axes[-1]))


def _shapes(config, entry: Entry, batch: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
  """Each cached array's shape and logical axes, for the entry's periods, rows and slots."""
  return {
    name: _layout(dims, axes, entry.periods, batch, entry.slots)
    for name, (dims, axes) in attention.variant(config).cached(config).items()
  }


def cache_spec(config, batch: int, max_len: int, dtype: Any = None) -> dict[str, Any]:
  """The cache as ``{segment: ({name: ShapeDtypeStruct}, …) per period position}`` (no memory)."""
  dtype = jnp.dtype(dtype or config.dtype)
  out: dict[str, list] = {}
  for entry in entries(config, max_len):
    out.setdefault(entry.segment, []).append(
      {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, _) in _shapes(config, entry, batch).items()}
    )
  return {k: tuple(v) for k, v in out.items()}


def cache_axes(config, batch: int, max_len: int) -> dict[str, Any]:
  """The logical axes of each of the cache's arrays, as ``cache_spec`` lays them out."""
  out: dict[str, list] = {}
  for entry in entries(config, max_len):
    out.setdefault(entry.segment, []).append({name: axes for name, (_, axes) in _shapes(config, entry, batch).items()})
  return {k: tuple(v) for k, v in out.items()}


def cache_shardings(config, batch: int, max_len: int, mesh, rules) -> dict[str, Any]:
  """Each cache array's ``NamedSharding`` on ``mesh`` by ``rules`` (batch over data / fsdp, kv heads over
  tensor, as the activations are)."""
  spec, axes = cache_spec(config, batch, max_len), cache_axes(config, batch, max_len)
  return jax.tree.map(
    lambda s, a: NamedSharding(mesh, rules.spec(a, shape=s.shape, mesh=mesh)),
    spec,
    axes,
    is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x),
  )


def values_per_token(config) -> int:
  """The values a layer keeps per token: keys and values of every kv head (GQA), or the latent and the shared
  rotary key (MLA: ``kv_lora_rank + qk_rope_head_dim``, DeepSeek-V3's 512 + 64)."""
  return sum(math.prod(dims) for dims, _ in attention.variant(config).cached(config).values())


def cache_bytes(config, batch: int, max_len: int, dtype: Any = None) -> int:
  """The whole cache's bytes (every device's together)."""
  return sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(cache_spec(config, batch, max_len, dtype)))


# --- the cached forward ----------------------------------------------------------------------


def _slots_of(entry: Entry, index: jax.Array) -> jax.Array:
  """The slot of absolute token ``index`` in the entry."""
  return index % entry.slots if entry.ring else index


def _visible(entry: Entry, t: jax.Array, pads: jax.Array) -> jax.Array:
  """[batch, 1, slots]: which of the cache's slots, as they were before token ``t`` is written, a query at
  absolute index ``t`` sees (its own key and value join apart: ``masked_attention``'s ``new``)."""
  slot = jnp.arange(entry.slots)
  held = t - (t - slot) % entry.slots if entry.ring else slot  # the index each slot holds once t is written
  seen = (held < t) & (held >= pads[:, None])  # slot t's old content (a ring's token t − window) is not seen
  return seen[:, None, :]


def _token_major(cached: jax.Array) -> jax.Array:
  """One layer's cached array [batch, …, slots, last] as [batch, slots, …, last], the tokens' own layout (a view
  the compiler folds into the products that read it)."""
  return jnp.moveaxis(cached, -2, 1)


def _write(entry: Entry, stacked: jax.Array, index: jax.Array, new: jax.Array, start: jax.Array | int) -> jax.Array:
  """The stacked cache [periods, batch, …, slots, last] with layer ``index``'s tokens ``new`` [batch, length, …,
  last] written from absolute index ``start`` (in place: the buffer is the loop's carry)."""
  new = jnp.moveaxis(new.astype(stacked.dtype), 1, -2)[None]  # [1, batch, …, length, last]
  length = new.shape[-2]
  at = lambda slot: (index,) + (0,) * (stacked.ndim - 3) + (slot, 0)
  if not entry.ring or length == 1:
    return jax.lax.dynamic_update_slice(stacked, new, at(_slots_of(entry, start)))
  kept = min(length, entry.slots)  # a ring keeps the last ``window`` tokens, each at its slot (no repeats)
  slots = (start + jnp.arange(length - kept, length)) % entry.slots
  written = jnp.moveaxis(stacked, -2, 1).at[index, slots].set(jnp.moveaxis(new[0, ..., length - kept :, :], -2, 0))
  return jnp.moveaxis(written, 1, -2)


def _constrain(config, arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
  cached = attention.variant(config).cached(config)
  return {k: constrain(v, _layout(*cached[k], *v.shape[:2], v.shape[-2])[1]) for k, v in arrays.items()}


def _attend(config, entry: Entry, h, layer, cache, index, positions, step):
  """One layer's attention output, and the segment's stacked cache with this layer's new tokens written."""
  variant, spec = attention.variant(config), config.attention_for(entry.kind)
  q, state = variant.project(config, entry.kind, h, layer, positions)
  if not step["decode"]:
    keys, values = variant.expand(config, state, layer)
    attn = attention_kernels.attention(
      q, keys, values, spec, positions=positions, segment_ids=step["segment_ids"], sinks=layer.get("sinks")
    )
    start = 0
  else:
    old = {k: _token_major(jax.lax.dynamic_index_in_dim(v, index, 0, keepdims=False)) for k, v in cache.items()}
    scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(config.qk_dim)
    attn = variant.decode(
      config,
      q,
      old,
      state,
      _visible(entry, step["t"], step["pads"]),
      layer,
      scale=scale,
      softcap=spec.softcap,
      sinks=layer.get("sinks"),
    )
    start = step["t"]
  cache = _constrain(config, {k: _write(entry, cache[k], index, state[k], start) for k in cache})
  return attention.attention_output(config, attn, layer), cache


def _layer(config, entry: Entry, x, layer, cache, index, positions, step):
  h = attention.attention_input(config, x, layer)
  out, cache = _attend(config, entry, h, layer, cache, index, positions, step)
  x = attention.attention_residual(config, x, out, layer)
  x, _ = blocks.mlp_sublayer(config, entry.kind, x, layer)
  return x, cache


def _layers(
  model, cache: dict[str, Any], x: jax.Array, positions: jax.Array, max_len: int, step: dict, unroll: bool = False
):
  """The layers over ``x``, each segment a scan over its periods that carries the segment's stacked cache (so
  each layer's writes land in place); ``unroll``: the scans unrolled (one program per layer, as a compiler's cost
  analysis counts a loop's body once)."""
  config = model.config
  pin = not unroll and active_device().platform == "tpu"
  by_segment: dict[str, list[Entry]] = {}
  for entry in entries(config, max_len):
    by_segment.setdefault(entry.segment, []).append(entry)
  new_cache = {}
  for segment in segments(config):
    seg_entries = by_segment[segment.name]
    period = len(seg_entries)
    layers = {k: v[...] for k, v in getattr(model, segment.name).items()}
    if period > 1:
      layers = {k: v.reshape(segment.count // period, period, *v.shape[1:]) for k, v in layers.items()}

    def body(carry, xs, seg_entries=seg_entries, period=period):
      x, caches = carry
      params, index = xs
      out = []
      for i, entry in enumerate(seg_entries):
        one = params if period == 1 else {k: v[i] for k, v in params.items()}
        x, c = _layer(config, entry, x, one, caches[i], index, positions, step)
        out.append(_in_argument_layout(c) if pin else c)
      return (x, tuple(out)), None

    periods = segment.count // period
    (x, new_cache[segment.name]), _ = jax.lax.scan(
      body, (x, cache[segment.name]), (layers, jnp.arange(periods)), unroll=periods if unroll else 1
    )
  return x, new_cache


def _in_argument_layout(cached: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The stacked cache as the layer scan carries it on a TPU, pinned to an argument's default layout (heads before
  slots, each row's and head's slots one matrix). Left free, libtpu lays the carry out for the one-slot write
  (rows and the head dimension as the tile, slots outside it) and then copies each layer's slice into the
  products' layout: 10 of the 7B's 20.9 ms a step (``bench/generation.py tpu``)."""
  from jax.experimental.layout import Layout, with_layout_constraint

  return {k: with_layout_constraint(c, Layout(tuple(range(c.ndim)))) for k, c in cached.items()}


def prefill(
  model, cache: dict[str, Any], tokens: jax.Array, pads: jax.Array, *, max_len: int
) -> tuple[jax.Array, dict[str, Any]]:
  """Runs the left-padded prompts ``tokens`` [batch, length] (``pads`` [batch] pads each) from the start of a
  cache of ``max_len`` tokens; returns the logits of each row's last token [batch, vocab] (float32) and the
  cache written."""
  c = model.config
  batch, length = tokens.shape
  index = jnp.arange(length)[None, :]
  positions = jnp.maximum(index - pads[:, None], 0)
  segment_ids = (index >= pads[:, None]).astype(jnp.int32)  # the pads a segment of their own (0)
  with fp8.active(c.fp8, c.fp8_min_dim):
    x = model.embed_tokens(tokens)
    x, cache = _layers(model, cache, x, positions, max_len, {"decode": False, "segment_ids": segment_ids})
  hidden = model.final_hidden(x[:, -1:])
  return model.logits(hidden)[:, 0].astype(jnp.float32), cache


def decode(
  model, cache: dict[str, Any], tokens: jax.Array, t: jax.Array, pads: jax.Array, *, max_len: int, unroll: bool = False
) -> tuple[jax.Array, dict]:
  """Runs one new token per row, ``tokens`` [batch], at absolute index ``t`` (a scalar: every row writes the same
  slot) in a cache of ``max_len`` tokens; returns its logits [batch, vocab] (float32) and the cache with its keys
  and values written (``unroll``: as ``_layers``)."""
  c = model.config
  positions = (t - pads)[:, None]
  with fp8.active(c.fp8, c.fp8_min_dim):
    x = model.embed_tokens(tokens[:, None])
    x, cache = _layers(model, cache, x, positions, max_len, {"decode": True, "t": t, "pads": pads}, unroll)
  return model.logits(model.final_hidden(x))[:, 0].astype(jnp.float32), cache
