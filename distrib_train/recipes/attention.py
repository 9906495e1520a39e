"""Splash attention: the TPU's flash attention (a Pallas kernel), sharded over the mesh.

``splash_attention(q, k, v, segment_ids)`` computes causal (and, with
``segment_ids``, per-document) attention like
``jax.nn.dot_product_attention(q, k, v, mask, is_causal=True)`` on
``[batch, length, heads, head_dim]`` arrays, with JAX's splash-attention kernel
(``jax.experimental.pallas.ops.tpu.splash_attention``): blocks of queries
against blocks of keys, never the ``[length, length]`` scores, skipping the
blocks the causal mask zeroes. Grouped-query attention (fewer key/value
heads) is native to the kernel, and so are a sliding window (a local mask:
the blocks outside the band are skipped too), per-head attention sinks and
a soft cap on the scores.

A Pallas kernel is one device's program, so under a sharded step it runs
inside ``shard_map``: batch and heads split as ``axis_rules.constrain`` would
split them (``batch`` over data/fsdp, ``heads`` over tensor), length whole.
Off a TPU it runs in Pallas' interpret mode — the same kernel, emulated, for
tests on CPU (slow: for small shapes only).

Not for: choosing it (``attention_kernels.py``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from distrib_train.sharding.axis_rules import active_activation_sharding


BLOCK = 128  # the kernel's key blocks are a multiple of the TPU's 128 lanes


def _block(length: int) -> int:
  """The largest of 512, 256, 128 that divides ``length``."""
  return next(b for b in (512, 256, 128) if length % b == 0)


def _kernel(heads: int, q_len: int, kv_len: int, window: int, softcap: float, interpret: bool):
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  shape = (q_len, kv_len)
  # A window of W keys: a query at i sees keys i − W + 1 … i (the kernel skips the blocks outside the band).
  one = splash.LocalMask(shape, window_size=(window - 1, 0), offset=0) if window else splash.CausalMask(shape)
  mask = splash.MultiHeadMask([one] * heads)
  bq, bkv = _block(q_len), _block(kv_len)
  sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                            block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
  return splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret,
                                attn_logits_soft_cap=softcap or None)


def _local(q, k, v, segment_ids, sinks, *, window: int, softcap: float, interpret: bool):
  """One device's attention: q [b, n, t, h], k/v [b, kv, s, h] (head-major, as the kernel wants)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  kernel = _kernel(q.shape[1], q.shape[2], k.shape[2], window, softcap, interpret)
  if segment_ids is None:
    return jax.vmap(lambda q, k, v: kernel(q, k, v, None, sinks))(q, k, v)
  return jax.vmap(lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(q=s, kv=s), sinks))(q, k, v, segment_ids)


def _two(spec: P) -> tuple:
  return tuple(spec) + (None,) * (2 - len(spec))


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                     window: int = 0, scale: float | None = None, softcap: float = 0.0,
                     sinks: jax.Array | None = None, interpret: bool | None = None) -> jax.Array:
  """Causal attention of ``q`` [batch, length, heads, qk_dim] over ``k`` [batch, length, kv_heads, qk_dim] and
  ``v`` [batch, length, kv_heads, v_dim].

  Args:
    q, k, v: queries, keys and values; ``heads`` a multiple of ``kv_heads``.
    segment_ids: [batch, length] document ids; a token attends only within
      its document. None: one document per row.
    window: a sliding window of this many keys, the query's own included (0: all earlier keys).
    scale: the softmax scale (default 1/√qk_dim), applied to the queries.
    softcap: the scores' soft cap (0: none).
    sinks: [heads] per-head sink logits that join each softmax (gpt-oss), or None.
    interpret: run the kernel in Pallas' interpret mode (default: unless the
      mesh, or JAX, is on TPU).

  Returns:
    [batch, length, heads, v_dim] in ``q``'s dtype.
  """
  if q.shape[1] % BLOCK or k.shape[1] % BLOCK:
    raise ValueError(f"splash attention needs a sequence length that is a multiple of {BLOCK}, got {q.shape[1]};"
                     " use attention: xla (or auto, which does) for this length.")
  active = active_activation_sharding()
  mesh = active[0] if active else None
  if interpret is None:
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.devices()[0].platform
    interpret = platform != "tpu"
  q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, q.dtype)
  qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
  sinks = None if sinks is None else sinks.astype(jnp.float32)
  local = functools.partial(_local, window=window, softcap=softcap, interpret=interpret)
  if mesh is None or mesh.size == 1:
    return local(qt, kt, vt, segment_ids, sinks).transpose(0, 2, 1, 3)
  rules = active[1]
  batch, heads = _two(rules.spec(("batch", "heads"), shape=(q.shape[0], q.shape[2]), mesh=mesh))
  _, kv_heads = _two(rules.spec(("batch", "kv_heads"), shape=(k.shape[0], k.shape[2]), mesh=mesh))
  if kv_heads != heads:  # keys split otherwise than queries: give each query head its own copy
    repeat = q.shape[2] // k.shape[2]
    kt, vt = (jnp.repeat(x, repeat, axis=1) for x in (kt, vt))
  q_spec = P(batch, heads, None, None)
  in_specs = (q_spec, q_spec if kv_heads != heads else P(batch, kv_heads, None, None))
  in_specs = in_specs + (in_specs[1], None if segment_ids is None else P(batch, None),
                         None if sinks is None else P(heads))
  out = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)(qt, kt, vt, segment_ids,
                                                                                             sinks)
  return out.transpose(0, 2, 1, 3)
