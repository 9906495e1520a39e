"""On a GPU: the compiled Triton grouped matmul (bf16, and FP8 under ``fp8.active``) against XLA's ``ragged_dot``,
values and gradients, at an MoE layer's shape; then each one's forward + backward time.

  python bench/gpu_runs/gmm_check.py        # prints one line per check, and the timings

Prints the largest difference relative to the reference's largest value (bf16: products of bf16 in float32,
outputs rounded to bf16; FP8: the same roundings and scales, only the summation order differs).
"""

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from distrib_train.kernels import grouped  # noqa: E402
from distrib_train.kernels import fp8  # noqa: E402

M, K, N, G, TILE = 8192, 1024, 2816, 8, 128
sizes = np.full(G, M // G)  # even routing, every group a whole number of tiles
tile_groups = jnp.asarray(np.repeat(np.arange(G), M // G // TILE), jnp.int32)
group_sizes = jnp.asarray(sizes, jnp.int32)
kx, kw, kg = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(kx, (M, K), jnp.bfloat16)
w = (jax.random.normal(kw, (G, K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
cotangent = jax.random.normal(kg, (M, N), jnp.bfloat16)


def kernel(x, w):
  return grouped.gmm(x, w, group_sizes, tile_groups, tile=TILE, platform="gpu", routed_rows=M)


def reference(x, w):
  return (
    fp8.ragged_dot(x, w, group_sizes)
    if fp8.mode() != "none"
    else jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)
  )


def run(fn, mode):
  # The cotangent is an argument: closed over, it would be a constant, and XLA folded FP8's amax of it at
  # compile time (over a minute on the H100, 2026-11-27).
  def loss_and_grads(x, w, cotangent):
    with fp8.active(mode):
      out, pullback = jax.vjp(fn, x, w)
      return (out,) + pullback(cotangent)

  return functools.partial(jax.jit(loss_and_grads), cotangent=cotangent)


for mode in ("none", "current"):
  got_fn, want_fn = run(kernel, mode), run(reference, mode)
  got, want = got_fn(x, w), want_fn(x, w)
  for name, a, b in zip(("out", "d x", "d w"), got, want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    print(
      f"{mode:8s} {name:4s} max |kernel - ragged_dot| / max |ragged_dot| = "
      f"{np.max(np.abs(a - b)) / np.max(np.abs(b)):.2e}",
      flush=True,
    )
  for label, fn in (("kernel", got_fn), ("ragged_dot", want_fn)):
    jax.block_until_ready(fn(x, w))
    start = time.perf_counter()
    for _ in range(20):
      result = fn(x, w)
    jax.block_until_ready(result)
    print(f"{mode:8s} {label:10s} forward + backward {1000 * (time.perf_counter() - start) / 20:7.3f} ms", flush=True)
