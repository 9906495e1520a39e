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

With a ``context`` mesh axis, ``context_splash_attention`` runs the same
kernel for all-gather context parallelism: each device gathers the whole
sequence's keys and values (small with grouped-query heads) and attends its
own load-balanced query chunks (``sharding/context.zigzag``: chunks ``i`` and
``2C − 1 − i``) in one kernel call. The mask is one precomputed mask over the
whole sequence, queries in zigzag order and keys in true order, whose block
info splash splits by query shard (``q_seq_shards``): every device skips the
blocks its chunks cannot see, a causal split costs half the square, a window
its band. The gathered keys and values are rematerialised for the backward
pass (the gather runs again), so no layer keeps a whole sequence's keys; the
backward pass reduce-scatters their gradients.

Not for: choosing it (``attention_kernels.py``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from distrib_train.kernels.attention.work import flops_scope, fused_backward_scope, note
from distrib_train.sharding import context
from distrib_train.sharding.axis_rules import active_activation_sharding


BLOCK = 128  # the kernel's key blocks are a multiple of the TPU's 128 lanes
RESIDUALS = "splash_residuals"  # the checkpoint name of what the context kernel keeps for its backward pass


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
  sizes = splash.BlockSizes(
    block_q=bq,
    block_kv=bkv,
    block_kv_compute=bkv,
    block_q_dkv=bq,
    block_kv_dkv=bkv,
    block_kv_dkv_compute=bkv,
    block_q_dq=bq,
    block_kv_dq=bkv,
  )
  return splash.make_splash_mha(
    mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret, attn_logits_soft_cap=softcap or None
  )


def _local(q, k, v, segment_ids, sinks, *, window: int, softcap: float, interpret: bool):
  """One device's attention: q [b, n, t, h], k/v [b, kv, s, h] (head-major, as the kernel wants)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  with jax.ensure_compile_time_eval():
    kernel = _kernel(q.shape[1], q.shape[2], k.shape[2], window, softcap, interpret)
  pairs = visible_pairs(kernel, 1)
  note(pairs, q.shape[2], window, 1)
  with flops_scope(pairs * q.shape[0] * q.shape[1], q.shape[-1], v.shape[-1]):
    if segment_ids is None:
      return jax.vmap(lambda q, k, v: kernel(q, k, v, None, sinks))(q, k, v)
    return jax.vmap(lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(q=s, kv=s), sinks))(q, k, v, segment_ids)


def _two(spec: P) -> tuple:
  return tuple(spec) + (None,) * (2 - len(spec))


def splash_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array | None = None,
  *,
  window: int = 0,
  scale: float | None = None,
  softcap: float = 0.0,
  sinks: jax.Array | None = None,
  interpret: bool | None = None,
) -> jax.Array:
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
    raise ValueError(
      f"splash attention needs a sequence length that is a multiple of {BLOCK}, got {q.shape[1]};"
      " use attention: xla (or auto, which does) for this length."
    )
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
  in_specs = in_specs + (
    in_specs[1],
    None if segment_ids is None else P(batch, None),
    None if sinks is None else P(heads),
  )
  out = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)(
    qt, kt, vt, segment_ids, sinks
  )
  return out.transpose(0, 2, 1, 3)


def _zigzag_mask(size: int, length: int, window: int):
  """Splash's mask for ``length`` queries in zigzag order over ``size`` devices against ``length`` keys in true
  order: causal (within ``window`` keys when > 0) on the queries' true positions, computed in the kernel."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  class ZigzagCausal(masks._ComputableMask):  # private base: the lazily computed masks' (CausalMask's) own
    def __init__(self):
      def visible(q_ids, kv_ids):
        seen = q_ids >= kv_ids
        return seen & (q_ids - kv_ids < window) if window else seen

      super().__init__(shape=(length, length), mask_function=visible)
      self.q_sequence = context.zigzag(length, size).astype(np.int32)  # each query row's true position

    def __getitem__(self, index):
      # splash asks for every block of the [length, length] mask (65,536 at 128k): answer the blocks all
      # seen or all hidden from their corners, computing only the ones the diagonal or the window cuts
      rows, cols = index
      q = self.q_sequence[rows]
      first, last = int(q.min()), int(q.max())
      shape = (len(q), len(range(*cols.indices(self.shape[1]))))
      k_first, k_last = cols.start or 0, (cols.stop or self.shape[1]) - 1
      if k_first > last or (window and first - k_last >= window):
        return np.zeros(shape, bool)
      if k_last <= first and (not window or last - k_first < window):
        return np.ones(shape, bool)
      return super().__getitem__(index)

    def __eq__(self, other):
      return isinstance(other, ZigzagCausal) and other.shape == self.shape and other.key == self.key

    def __hash__(self):
      return hash((type(self).__name__, self.shape, self.key))

    key = (size, window)

  return ZigzagCausal()


def _context_kernel(heads: int, size: int, length: int, window: int, softcap: float, interpret: bool):
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  mask = splash.MultiHeadMask([_zigzag_mask(size, length, window)] * heads)
  chunk = length // (2 * size)
  b = _block(chunk)  # blocks inside a chunk: only the diagonal ones are partial
  # One backward kernel (dq, dk and dv from one recomputation of the scores, not two): it sums dq over key
  # blocks of up to a chunk, a [length / block_kv_dkv, heads, queries, head_dim] buffer while a layer's
  # backward runs (2 GiB for the 7b at 128k over 32 devices).
  wide = next(w for w in (2048, 1024, 512, 256, 128) if chunk % w == 0)
  sizes = splash.BlockSizes(
    block_q=b,
    block_kv=b,
    block_kv_compute=b,
    block_q_dkv=b,
    block_kv_dkv=wide,
    block_kv_dkv_compute=wide,
    use_fused_bwd_kernel=True,
  )
  # its output and log-sum-exp carry RESIDUALS, which a layer's remat keeps (decoder.py): the backward pass
  # gathers the keys and values again but does not run the forward kernel a second time
  return splash.make_splash_mha(
    mask,
    head_shards=1,
    q_seq_shards=size,
    block_sizes=sizes,
    interpret=interpret,
    attn_logits_soft_cap=softcap or None,
    residual_checkpoint_name=RESIDUALS,
  )


def visible_pairs(kernel, q_shards: int, phase: str = "fwd") -> int:
  """Query-key pairs one query shard's kernel computes per head in ``phase`` (``fwd``, ``dkv``): the blocks its
  mask info lets run × the block size (the busiest shard's; a load-balanced causal mask gives each about the
  same)."""
  sizes = kernel.kwargs.get("block_sizes")
  info, q_len, kv_len = (
    (kernel.fwd_mask_info, sizes.block_q, sizes.block_kv)
    if phase == "fwd"
    else (kernel.dkv_mask_info, sizes.block_q_dkv, sizes.block_kv_dkv)
  )
  blocks = np.asarray(info.block_mask)  # [heads or 1, q blocks, kv blocks]: 0 skipped, 1 partial, 2 full
  per_shard = blocks[0].reshape(q_shards, -1, blocks.shape[-1])
  return int((per_shard != 0).sum(axis=(1, 2)).max()) * q_len * kv_len


def _gather(a: jax.Array, size: int, axis: int) -> jax.Array:
  """``a``'s zigzag-ordered ``axis`` gathered over the context axis, in true order (device ``i`` held chunks
  ``i`` and ``2C − 1 − i``); its transpose, the backward pass, reduce-scatters."""
  a = jax.lax.all_gather(a, context.CONTEXT_AXIS, axis=axis, tiled=True)
  shape = a.shape
  parts = a.reshape(*shape[:axis], size, 2, shape[axis] // (2 * size), *shape[axis + 1 :])
  front = jax.lax.index_in_dim(parts, 0, axis + 1, keepdims=False)
  back = jnp.flip(jax.lax.index_in_dim(parts, 1, axis + 1, keepdims=False), axis)
  return jnp.concatenate([front, back], axis=axis).reshape(shape)


def context_splash_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array | None = None,
  *,
  window: int = 0,
  scale: float | None = None,
  softcap: float = 0.0,
  sinks: jax.Array | None = None,
  interpret: bool | None = None,
  regather: bool = True,
) -> jax.Array:
  """``splash_attention`` of a sequence split over the context axis in zigzag order, by all-gather (module
  docstring); the arguments as ``splash_attention``'s, each length the whole sequence's. ``regather``: the
  backward pass gathers the keys and values again, not keeping them (False where the layer's remat does)."""
  mesh, rules = active_activation_sharding()
  size, length = int(mesh.shape[context.CONTEXT_AXIS]), q.shape[1]
  if length % (2 * size * BLOCK):
    raise ValueError(
      f"splash attention over the context axis needs a sequence length that is a multiple of"
      f" 2 × context × {BLOCK} = {2 * size * BLOCK}, got {length}; use model.context_attention:"
      " ring, or another length."
    )
  if interpret is None:
    interpret = mesh.devices.flat[0].platform != "tpu"
  q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, q.dtype)
  qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
  batch, heads, tokens = _two(rules.spec(("batch", "heads"), shape=(q.shape[0], q.shape[2]), mesh=mesh)) + (
    rules.spec(("length",), shape=(length,), mesh=mesh)[0],
  )
  _, kv_heads = _two(rules.spec(("batch", "kv_heads"), shape=(k.shape[0], k.shape[2]), mesh=mesh))
  if kv_heads != heads:  # keys split otherwise than queries: give each query head its own copy
    kt, vt = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=1) for x in (kt, vt))
    kv_heads = heads
  if tokens not in (context.CONTEXT_AXIS, (context.CONTEXT_AXIS,)):
    raise ValueError(
      f"splash attention over the context axis needs the logical 'length' axis on 'context' alone,"
      f" got {tokens!r}; use model.context_attention: ring."
    )
  q_spec, kv_spec = P(batch, heads, tokens, None), P(batch, kv_heads, tokens, None)
  local_batch, local_heads = NamedSharding(mesh, q_spec).shard_shape(qt.shape)[:2]
  local_kv = NamedSharding(mesh, kv_spec).shard_shape(kt.shape)[1]
  with jax.ensure_compile_time_eval():  # its mask info as constants, not values of the step being traced
    kernel = _context_kernel(local_heads, size, length, window, softcap, interpret)
  kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(None, context.CONTEXT_AXIS)))
  gather = functools.partial(_gather, size=size)
  name = jax.ad_checkpoint.checkpoint_name
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  def attend(kernel, q, k, v, seg, sinks):
    k, v = (name(gather(x, axis=2), "context_kv") for x in (k, v))
    if seg is None:
      return jax.vmap(lambda q, k, v: kernel(q, k, v, None, sinks))(q, k, v)
    return jax.vmap(lambda q, k, v, s, t: kernel(q, k, v, splash.SegmentIds(q=s, kv=t), sinks))(
      q, k, v, seg, gather(seg, axis=1)
    )

  pairs, backward_pairs = visible_pairs(kernel, size), visible_pairs(kernel, size, "dkv")
  note(
    pairs,
    length,
    window,
    size,
    gathered_bytes=local_batch * length * local_kv * (k.shape[-1] * k.dtype.itemsize + v.shape[-1] * v.dtype.itemsize),
  )
  # the gathered keys and values are not kept for the backward pass: it gathers them again (a layer's remat
  # does so already; without one, this does)
  local = (
    attend
    if not regather
    else jax.checkpoint(attend, policy=jax.checkpoint_policies.save_anything_except_these_names("context_kv"))
  )

  def scoped(kernel, q, k, v, seg, sinks):
    rows = q.shape[0] * q.shape[1]  # sequences × heads of the call
    with fused_backward_scope(pairs * rows, backward_pairs * rows, q.shape[-1], v.shape[-1]):
      return local(kernel, q, k, v, seg, sinks)

  out = jax.shard_map(
    scoped,
    mesh=mesh,
    in_specs=(
      kernel_spec,
      q_spec,
      kv_spec,
      kv_spec,
      None if segment_ids is None else P(batch, tokens),
      None if sinks is None else P(heads),
    ),
    out_specs=q_spec,
    check_vma=False,
  )(kernel, qt, kt, vt, segment_ids, None if sinks is None else sinks.astype(jnp.float32))
  return out.transpose(0, 2, 1, 3)
