"""Packed rows through cuDNN on a GPU: values and gradients against XLA, and the time of each attention.

Run from the repository root on a Hopper GPU:

  python bench/gpu_attention.py                     # B 8 × 2048 × 16 heads × 128, 4 documents a row
  python bench/gpu_attention.py --kv_heads 4 --documents 12

Checks ``kernels/attention/cudnn.packed_attention`` (cuDNN's packed layout,
``max_segments`` runs a row) against XLA's attention with the dense segment
mask, computed in float32 from the same bf16 inputs: the output and the
three input gradients (of a random cotangent), as ``‖x − ref‖ / ‖ref‖``.
Rows hold random document lengths and a padded tail. Then it times forward
+ backward (median of ``--iters``) of: the packed layout at several
``max_segments``, cuDNN with the dense mask, cuDNN causal without segments,
and XLA with the mask.

Not for: CPU (cuDNN only); the model's step (``train_throughput.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from distrib_train.kernels.attention import cudnn as cudnn_attention  # noqa: E402


def segments(rng: np.random.Generator, batch: int, length: int, documents: int) -> np.ndarray:
  """Rows of ``documents`` random-length documents (ids 1…) and a padded tail (id 0) of up to 1/8 of the row."""
  out = np.zeros((batch, length), np.int32)
  for row in range(batch):
    used = length - int(rng.integers(0, length // 8))
    cuts = np.sort(rng.choice(np.arange(1, used), documents - 1, replace=False))
    bounds = [0, *cuts, used]
    for doc in range(documents):
      out[row, bounds[doc] : bounds[doc + 1]] = doc + 1
  return out


def rel(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def timed(fn, args, iters: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1000 * statistics.median(times)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--length", type=int, default=2048)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv_heads", type=int, default=16)
  p.add_argument("--head_dim", type=int, default=128)
  p.add_argument("--documents", type=int, default=4)
  p.add_argument("--max_segments", default="8,16,32", help="comma list; the first is the checked one")
  p.add_argument("--iters", type=int, default=20)
  args = p.parse_args()
  rng = np.random.default_rng(0)
  b, n, kv, h, length = args.batch, args.heads, args.kv_heads, args.head_dim, args.length
  ids = jnp.asarray(segments(rng, b, length, args.documents))
  q, k, v, cot = (
    jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    for s in ((b, length, n, h), (b, length, kv, h), (b, length, kv, h), (b, length, n, h))
  )
  ms = [int(x) for x in args.max_segments.split(",")]

  # Every array is an argument of the jitted functions: closed over, XLA would fold them as constants.
  def packed(m):
    return lambda q, k, v, ids: cudnn_attention.packed_attention(q, k, v, ids, max_segments=m)

  def dense(implementation, masked=True, dtype=None):
    def attend(q, k, v, ids):
      if dtype is not None:
        q, k, v = (x.astype(dtype) for x in (q, k, v))
      mask = cudnn_attention.segment_mask(ids) if masked else None
      return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)

    return attend

  def value_and_grads(fn):
    def run(q, k, v, cot, ids):
      out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, ids), q, k, v)
      return (out, *vjp(cot.astype(out.dtype)))

    return jax.jit(run)

  inputs = (q, k, v, cot, ids)
  reference = value_and_grads(dense("xla", dtype=jnp.float32))(*inputs)
  got = value_and_grads(packed(ms[0]))(*inputs)
  names = ("output", "dq", "dk", "dv")
  errors = {name: rel(x, r) for name, x, r in zip(names, got, reference)}
  finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in got)
  print(
    f"packed (max_segments {ms[0]}) vs XLA float32 with the segment mask, B {b} × {length} × {n} heads"
    f" ({kv} kv) × {h}, {args.documents} documents a row:"
  )
  print("  " + "  ".join(f"{name} {e:.2e}" for name, e in errors.items()) + f"  finite {finite}")
  ok = finite and all(e < 2e-2 for e in errors.values())
  print("  PASS" if ok else "  FAIL: above bf16 tolerance (2e-2)")

  rows = [(f"cuDNN packed, max_segments {m}", packed(m)) for m in ms]
  rows += [
    ("cuDNN, dense segment mask", dense("cudnn")),
    ("cuDNN causal, no segments", dense("cudnn", False)),
    ("XLA, dense segment mask", dense("xla")),
  ]
  print(f"forward + backward, median of {args.iters}:")
  for name, fn in rows:
    try:
      print(f"  {name:32s} {timed(value_and_grads(fn), inputs, args.iters):8.3f} ms")
    except Exception as e:  # noqa: BLE001 - a variant the card refuses is a row, not the end
      print(f"  {name:32s} failed: {str(e).splitlines()[0][:200]}")
  if not ok:
    raise SystemExit(1)


if __name__ == "__main__":
  main()
