"""cuDNN attention, as the CPU compiler can plan it: same result, same memory shape.

The CPU backend cannot compile ``jax.nn.dot_product_attention(...,
implementation="cudnn")``. Planning a GPU config on emulated CPU devices with
XLA attention instead would keep every layer's ``[batch, heads, length,
length]`` scores for the backward pass — 413 GiB of temporaries for the 1b
preset, which runs in 80 GiB on an H100. ``emulating_cudnn()`` swaps in, while
a step is traced, a query-chunked XLA attention whose chunks are
rematerialised: like flash attention it keeps only its inputs and output for
the backward pass and holds the scores of one chunk at a time.

It computes the full score matrix (causal blocks are not skipped as cuDNN's
kernel does), so its FLOPs are an upper bound. Not for: running models
(``models/llama.py`` picks the real implementation).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

CHUNK = 512  # query positions per chunk


def chunked_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, chunk=CHUNK):
  """``jax.nn.dot_product_attention`` ([batch, length, heads, dim] in and out) a query chunk at a time.

  Grouped-query attention (fewer key/value heads) is supported; ``bias`` and
  ``mask`` broadcast to ``[batch, heads, q_length, kv_length]``.
  """
  batch, length, heads, dim = query.shape
  kv_length, kv_heads = key.shape[1], key.shape[2]
  groups = heads // kv_heads
  scale = 1.0 / math.sqrt(dim) if scale is None else scale
  size = chunk if length % chunk == 0 else length
  count = length // size

  def rows(array, start):  # [batch, 1 or heads, length, kv_length] → this chunk's, by kv head and group
    array = jnp.broadcast_to(array, (batch, array.shape[-3], length, kv_length))
    part = jax.lax.dynamic_slice_in_dim(array, start, size, axis=2)
    return part[:, :, None] if part.shape[1] == 1 else part.reshape(batch, kv_heads, groups, size, kv_length)

  def block(q, start):
    q = q.reshape(batch, size, kv_heads, groups, dim)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", q, key).astype(jnp.float32) * scale
    if bias is not None:
      logits = logits + rows(jnp.asarray(bias), start).astype(jnp.float32)
    keep = jnp.ones((size, kv_length), bool)
    if is_causal:
      keep = (start + jnp.arange(size))[:, None] >= jnp.arange(kv_length)[None, :]
    if mask is not None:
      keep = keep & rows(jnp.asarray(mask), start)
    logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", weights, value).reshape(batch, size, heads, dim)

  def body(carry, xs):
    q, start = xs
    return carry, jax.checkpoint(block)(q, start)

  chunks = jnp.moveaxis(query.reshape(batch, count, size, heads, dim), 1, 0)
  _, out = jax.lax.scan(body, None, (chunks, jnp.arange(count) * size))
  return jnp.moveaxis(out, 0, 1).reshape(batch, length, heads, dim)


@contextlib.contextmanager
def emulating_cudnn() -> Iterator[None]:
  """While entered, ``jax.nn.dot_product_attention(..., implementation="cudnn")`` traces ``chunked_attention``."""
  original = jax.nn.dot_product_attention

  def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                            implementation=None, **kwargs):
    unsupported = {k: v for k, v in kwargs.items() if v is not None and v is not False}
    if implementation != "cudnn" or unsupported:
      return original(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                      implementation=implementation, **kwargs)
    return chunked_attention(query, key, value, bias, mask, scale=scale, is_causal=is_causal)

  jax.nn.dot_product_attention = dot_product_attention
  try:
    yield
  finally:
    jax.nn.dot_product_attention = original
