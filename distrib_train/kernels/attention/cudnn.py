"""cuDNN flash attention for packed rows: each document of a row attends to itself, no mask array.

A packed row holds several documents one after another (``segment_ids``:
1, 1, 1, 2, 2, 3, …, then 0 for the padding at its end). ``jax.nn.
dot_product_attention`` can keep them apart only with a dense ``[batch, 1,
length, length]`` mask, which cuDNN reads as a bias (2.29 ms forward and
backward on an H100 at B 8 × 2048 × 16 heads × 128, against 0.88 ms here).
jax's cuDNN module also takes the rows in cuDNN's "packed" layout: per row,
the length and start offset of each run of equal segment ids
(``q_seqlen`` ``[batch, M]`` and ``q_offsets`` ``[batch, M + 1]``, padded
with -1) and ``MaskType.PADDING_CAUSAL``. ``packed_attention`` builds those
from ``segment_ids`` inside the step and calls it.

``max_segments`` (M, static) bounds the runs a row may hold; the padding at
a row's end is a run of its own, so every position is computed. cuDNN keeps
a softmax statistic of ``[batch × M, heads, length]`` float32 for the
backward pass, so M costs memory: ``batch · M · heads · length · 4`` bytes a
layer. Runs past the M-th are merged into the M-th, so they attend to each
other: the data loader never gives a row that many (``data.
max_documents_per_row``, ``sequences.shifted``), and the tokens it merges
weigh 0 in the loss.

The packed layout needs a Hopper GPU (compute capability 9.0) and cuDNN
9.x. ``compile_only(capability)`` lets XLA's CUDA compiler build the same
program on a host with no GPU and no cuDNN library (``podplan/gpu.py``): it
answers jax's version and capability checks for the described card.

Not for: choosing it (``attention_kernels.py``), TPUs (splash
attention, ``attention.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from distrib_train.sharding.axis_rules import constrain

# cuDNN's version the deviceless compile assumes: the packed layout and the
# flash kernels of 9.x (jax's CUDA 12 wheels bring 9.8 and later).
ASSUMED_CUDNN_VERSION = 90800


def _module():
  from jax._src.cudnn import fused_attention_stablehlo  # private: jax's own cuDNN attention

  return fused_attention_stablehlo


def packs_rows(max_segments: int, attention: str, dtype: str, device) -> bool:
  """Whether a model's packed rows run through cuDNN's packed layout (``packed_attention``) on ``device``: a
  Hopper or newer GPU, ``model.attention`` auto or cudnn, 16-bit, ``model.max_segments`` > 0 (the runs a row may
  hold, the padding one of them; more are merged)."""
  from distrib_train.common.versions import gpu_capability

  return (
    max_segments > 0
    and attention in ("auto", "cudnn")
    and dtype in ("bfloat16", "float16")
    and gpu_capability(device) >= (9, 0)
  )


def segment_layout(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
  """cuDNN's packed layout of ``segment_ids`` ``[batch, length]``: each row's runs of equal ids.

  Returns ``(seqlen, offsets)``: int32 ``[batch, max_segments]`` run lengths
  and ``[batch, max_segments + 1]`` run starts, both -1 past a row's last
  run. Runs past the ``max_segments``-th are merged into it.
  """
  batch, length = segment_ids.shape
  starts = jnp.concatenate([jnp.ones((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  run = jnp.minimum(jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1, max_segments - 1)  # [batch, length]
  rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
  seqlen = jnp.zeros((batch, max_segments), jnp.int32).at[rows, run].add(1)
  offsets = jnp.cumsum(seqlen, axis=1, dtype=jnp.int32) - seqlen
  used = seqlen > 0
  seqlen = jnp.where(used, seqlen, -1)
  offsets = jnp.concatenate([jnp.where(used, offsets, -1), jnp.full((batch, 1), -1, jnp.int32)], axis=1)
  return seqlen, offsets


def packed_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array,
  *,
  max_segments: int,
  scale: float | None = None,
  window: int = 0,
) -> jax.Array:
  """Causal attention within each document of packed rows (``[batch, length, heads, head_dim]``, 16-bit).

  ``k`` and ``v`` may have fewer heads (grouped-query attention); ``window`` > 0 lets each query see only the
  ``window`` keys up to its own (cuDNN's sliding window).
  """
  fa = _module()
  seqlen, offsets = segment_layout(segment_ids, max_segments)
  # Split over the batch as the queries are: jax's partitioning leaves them free, and its offsets are per shard.
  seqlen, offsets = (constrain(x, ("batch", None)) for x in (seqlen, offsets))
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  return fa.dot_product_attention(
    q,
    k,
    v,
    q_seqlen=seqlen,
    kv_seqlen=seqlen,
    q_offsets=offsets,
    kv_offsets=offsets,
    scale=scale,
    mask_type=fa.MaskType.PADDING_CAUSAL,
    sliding_window_length=window or None,
  )


def causal_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, *, scale: float, window: int = 0
) -> jax.Array:
  """Causal attention (``[batch, length, heads, head_dim]``, 16-bit) through jax's cuDNN module itself, whose
  values may have another head size than the queries (MLA, Hopper and cuDNN 9.10 or later); with
  ``segment_ids``, a dense segment mask."""
  fa = _module()
  mask = None if segment_ids is None else segment_mask(segment_ids)
  return fa.dot_product_attention(
    q, k, v, mask=mask, scale=scale, mask_type=fa.MaskType.CAUSAL, sliding_window_length=window or None
  )


def segment_mask(segment_ids: jax.Array) -> jax.Array:
  """The dense ``[batch, 1, length, length]`` mask of the same attention (XLA's and pre-Hopper cuDNN's)."""
  return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


@contextlib.contextmanager
def compile_only(capability: tuple[int, int]) -> Iterator[None]:
  """While entered, jax's cuDNN attention traces for a GPU of ``capability`` with cuDNN
  ``ASSUMED_CUDNN_VERSION``, on a host that has neither (XLA's CUDA compiler builds the custom calls; cuDNN
  itself is needed only to run them)."""
  fa = _module()
  names = ("check_cudnn_version", "check_compute_capability", "is_cuda_compute_capability_equal")
  saved = {name: getattr(fa, name) for name in names if hasattr(fa, name)}
  patched = {
    "check_cudnn_version": lambda: ASSUMED_CUDNN_VERSION,
    "check_compute_capability": lambda c: tuple(int(x) for x in c.split(".")) <= capability,
    "is_cuda_compute_capability_equal": lambda c: tuple(int(x) for x in c.split(".")) == capability,
  }
  for name in saved:
    setattr(fa, name, patched[name])
  try:
    yield
  finally:
    for name, original in saved.items():
      setattr(fa, name, original)
