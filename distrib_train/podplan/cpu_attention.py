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

from distrib_train.kernels.attention import xla

CHUNK = 512  # query positions per chunk


def chunked_attention(query, key, value, mask=None, *, scale=None, is_causal=False, window=0, chunk=CHUNK):
  """``jax.nn.dot_product_attention`` ([batch, length, heads, dim] in and out) a query chunk at a time, each
  through ``kernels/attention/xla.masked_attention`` (the decode step's and the reference's attention).

  Grouped-query attention (fewer key/value heads) is supported; ``mask`` broadcasts to ``[batch, 1, q_length,
  kv_length]`` (one mask for every head, as the models' segment masks are); ``window`` (causal only) the keys a
  query sees, its own included (jax's ``local_window_size=(window − 1, 0)``).
  """
  batch, length, heads, dim = query.shape
  kv_length = key.shape[1]
  scale = 1.0 / math.sqrt(dim) if scale is None else scale
  size = chunk if length % chunk == 0 else length
  count = length // size
  if window and not is_causal:
    raise ValueError("chunked_attention: a window is causal attention's (is_causal=True)")
  if mask is not None:
    mask = jnp.broadcast_to(jnp.asarray(mask), (batch, 1, length, kv_length))[:, 0]

  def block(q, start):
    rows = (start + jnp.arange(size))[None]
    keep = (
      xla.visible(rows, jnp.arange(kv_length)[None], window=window)
      if is_causal
      else jnp.ones((1, size, kv_length), bool)
    )
    if mask is not None:
      keep = keep & jax.lax.dynamic_slice_in_dim(mask, start, size, axis=1)
    return xla.masked_attention(q, key, value, keep, scale=scale)

  def body(carry, xs):
    q, start = xs
    return carry, jax.checkpoint(block)(q, start)

  chunks = jnp.moveaxis(query.reshape(batch, count, size, heads, dim), 1, 0)
  _, out = jax.lax.scan(body, None, (chunks, jnp.arange(count) * size))
  return jnp.moveaxis(out, 0, 1).reshape(batch, length, heads, value.shape[-1])


@contextlib.contextmanager
def emulating_cudnn() -> Iterator[None]:
  """While entered, ``jax.nn.dot_product_attention(..., implementation="cudnn")`` traces ``chunked_attention``."""
  original = jax.nn.dot_product_attention

  def dot_product_attention(
    query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, implementation=None, **kwargs
  ):
    if implementation != "cudnn":
      return original(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal, implementation=implementation, **kwargs
      )
    local = kwargs.pop("local_window_size", None)
    unsupported = sorted(k for k, v in kwargs.items() if v is not None and v is not False)
    if bias is not None:
      unsupported.append("bias")
    if mask is not None and jnp.ndim(mask) >= 3 and jnp.shape(mask)[-3] != 1:
      unsupported.append("a mask per head")
    if local is not None and (not is_causal or tuple(local)[1] != 0):
      unsupported.append(f"local_window_size={tuple(local)} beyond a causal window")
    if unsupported:
      raise NotImplementedError(
        f"planning on CPU stands in for cuDNN attention without {', '.join(unsupported)} (podplan/cpu_attention.py)"
      )
    return chunked_attention(
      query, key, value, mask, scale=scale, is_causal=is_causal, window=0 if local is None else int(local[0]) + 1
    )

  jax.nn.dot_product_attention = dot_product_attention
  try:
    yield
  finally:
    jax.nn.dot_product_attention = original
