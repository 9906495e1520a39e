"""FP8 matmuls against bf16 on a GPU, product by product: where the 1b's FP8 step leaves its time.

Run from the repository root on an H100 / H200:

  python bench/fp8_gemms.py                                   # the 1b's projections, B 16 × 2048 tokens
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python bench/fp8_gemms.py   # cuBLAS for every GEMM
  JAX_PLATFORMS=cpu python bench/fp8_gemms.py --tokens 256 --shapes 64x96 --iters 2   # a smoke run

For each projection shape (tokens × K → N: the Llama 1b's attention, MLP
up/gate and down projections) it times, as the mean of ``--iters`` calls
dispatched back to back:

- ``bf16 product``: the forward product y = x·w, and the backward's
  dx = g·wᵀ and dw = xᵀ·g, on bf16 operands;
- ``fp8 as built``: the same three products on FP8 operands (e4m3 × e4m3
  forward, e5m2 × e4m3 backward, bf16 results divided by the scales
  after, as ``kernels/fp8.py`` writes them), in the layouts XLA's
  CUDA compiler gives them in the 1b's step with ``model.fp8`` set: the
  weight's e4m3 copy contraction-minor for the forward product, and read
  again, the other way, by dx; dw reading both operands token-major;
- ``fp8 K-major``: the same products given operands already transposed so
  that each one's contraction is its minor dimension, what Hopper's FP8
  tensor cores read (XLA asks for that layout only where both operands are
  e4m3, so the backward products of ``as built`` read at least one operand
  the other way: bench/NOTES.md lever 15);
- ``fp8 e4m3 grads``: the backward products with the gradient in e4m3
  instead of e5m2 (for which XLA's layout assignment asks contraction-minor
  operands; from these row-major inputs it gets them by a transpose inside
  the GEMM fusion, the same bytes read as ``as built``);
- ``matmul fwd+bwd``: ``fp8.einsum`` whole (amax, casts, the three products
  and their scaling), against ``jnp.einsum``, under ``jax.value_and_grad``.

With ``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false`` XLA builds FP8 GEMMs
with cuBLASLt, whose FP8 kernels read contraction-minor operands only, so it
writes such copies itself: ``as built`` then times that path.

Prints ms (the median of three batches of calls) and TFLOP/s
(2·tokens·K·N a product) per row, and each product's
relative error against bf16's (the same products in every FP8 variant:
FP8 rounding only, a few percent); ``--json`` writes them.

Not for: the model's step (``train_throughput.py``, ``profile_step.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from distrib_train.kernels import fp8  # noqa: E402

E4M3, E5M2, F32, BF16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32, jnp.bfloat16
SHAPES_1B = "2048x2048,2048x5632,5632x2048"  # K x N: q/k/v/o, gate/up, down


def _q(a, dtype):
  """``a`` scaled to ``dtype``'s range and cast: an FP8 operand (its scale returned too)."""
  scale = float(jnp.finfo(dtype).max) / jnp.maximum(jnp.max(jnp.abs(a.astype(F32))), 1e-30)
  return jnp.clip(a.astype(F32) * scale, -float(jnp.finfo(dtype).max), float(jnp.finfo(dtype).max)).astype(dtype), scale


def _scaled(product, sa, sb):
  return (product.astype(F32) / (sa * sb)).astype(BF16)


def timed(fn, *args, iters: int, repeats: int = 3) -> float:
  """Seconds of one call: the median over ``repeats`` batches of ``iters`` calls dispatched back to back, after
  a warm-up call."""
  jax.block_until_ready(fn(*args))
  batches = []
  for _ in range(repeats):
    started = time.perf_counter()
    out = None
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    batches.append((time.perf_counter() - started) / iters)
  return statistics.median(batches)


def products(tokens: int, k: int, n: int, iters: int) -> list[dict]:
  """The rows of one shape: each variant's three products, then the whole matmul forward + backward."""
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (tokens, k), BF16)
  w = jax.random.normal(keys[1], (k, n), F32) * 0.02
  g = (jax.random.normal(keys[2], (tokens, n), BF16) * 1e-3).astype(BF16)
  (qx, sx), (qw, sw), (qg, sg), (qg4, sg4) = _q(x, E4M3), _q(w, E4M3), _q(g, E5M2), _q(g, E4M3)
  qx_t, qw_t, qg_t = (jax.block_until_ready(jnp.asarray(a.T)) for a in (qx, qw, qg))  # materialized: row-major
  # bf16 results, divided by the scales in float32, as kernels/fp8.py writes them (bench/NOTES.md lever 20)
  ein = lambda spec: jax.jit(lambda a, b, sa, sb: _scaled(jnp.einsum(spec, a, b, preferred_element_type=BF16), sa, sb))
  bf = lambda spec: jax.jit(lambda a, b: jnp.einsum(spec, a, b))
  wb = w.astype(BF16)
  calls = {  # variant → its (function, operands) for y, dx, dw
    "bf16 product": ((bf("tk,kn->tn"), (x, wb)), (bf("tn,kn->tk"), (g, wb)), (bf("tk,tn->kn"), (x, g))),
    # The layouts of the 1b's FP8 step (XLA's CUDA compiler, bench/NOTES.md lever 15): the weight cast to
    # e4m3 contraction-minor for the forward product ([N, K] row-major) and that buffer read again by dx.
    "fp8 as built": (
      (ein("tk,nk->tn"), (qx, qw_t, sx, sw)),
      (ein("tn,nk->tk"), (qg, qw_t, sg, sw)),
      (ein("tk,tn->kn"), (qx, qg, sx, sg)),
    ),
    "fp8 K-major": (
      (ein("tk,nk->tn"), (qx, qw_t, sx, sw)),
      (ein("tn,kn->tk"), (qg, qw, sg, sw)),
      (ein("kt,nt->kn"), (qx_t, qg_t, sx, sg)),
    ),
    "fp8 e4m3 grads": (
      (ein("tk,nk->tn"), (qx, qw_t, sx, sw)),
      (ein("tn,nk->tk"), (qg4, qw_t, sg4, sw)),
      (ein("tk,tn->kn"), (qx, qg4, sx, sg4)),
    ),
  }
  flop = 2.0 * tokens * k * n
  reference = [fn(*a).astype(F32) for fn, a in calls["bf16 product"]]
  rows = []
  for name, triple in calls.items():
    seconds = [timed(fn, *a, iters=iters) for fn, a in triple]
    # The same products in every variant: each one's error against bf16's (FP8 rounding only).
    error = [
      float(jnp.linalg.norm(fn(*a).astype(F32) - ref) / jnp.linalg.norm(ref)) for (fn, a), ref in zip(triple, reference)
    ]
    rows.append(
      {
        "shape": f"{tokens}x{k}x{n}",
        "variant": name,
        "ms": [t * 1e3 for t in seconds],
        "tflops": [flop / t / 1e12 for t in seconds],
        "error": error,
      }
    )

  def whole(mode):
    def loss(x, w, g):  # its value needs y: the forward product stays in the program
      with fp8.active(mode):
        return jnp.sum(fp8.einsum("tk,kn->tn", x, w).astype(F32) * g.astype(F32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

  for mode in ("none", "current"):
    s = timed(whole(mode), x, w, g, iters=iters)
    rows.append(
      {
        "shape": f"{tokens}x{k}x{n}",
        "variant": f"matmul fwd+bwd {mode}",
        "ms": [s * 1e3],
        "tflops": [3 * flop / s / 1e12],
      }
    )
  return rows


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=16 * 2048)
  parser.add_argument("--shapes", default=SHAPES_1B, help="comma-separated KxN")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--json", default="")
  args = parser.parse_args(argv)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"{'shape':<18} {'variant':<22} {'ms: y, dx, dw':<26} {'TFLOP/s: y, dx, dw':<20} error vs bf16")
  rows = []
  for shape in args.shapes.split(","):
    k, n = (int(v) for v in shape.split("x"))
    for row in products(args.tokens, k, n, args.iters):
      rows.append(row)
      print(
        f"{row['shape']:<18} {row['variant']:<22} {', '.join(f'{m:.3f}' for m in row['ms']):<26} "
        f"{', '.join(f'{t:.0f}' for t in row['tflops']):<20} "
        f"{', '.join(f'{e:.1e}' for e in row.get('error', []))}",
        flush=True,
      )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
