"""The grouped matmul kernel (``kernels/gmm_triton.py``): its values and gradients in Pallas' interpreter on CPU,
and its program from XLA's CUDA compiler for an H100 (compile-only devices, no GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cuda_plugin
from distrib_train.kernels.gmm_triton import gmm

BLOCKS = dict(block_n=16, block_k=16, wgrad_block_k=16, interpret=True)


def _padded_layout(sizes, tile_m, trailing_tiles):
  """Where each of the unpadded rows (sorted by group, ``sizes`` per group) goes once every group is padded to
  whole tiles, the padded row count, and the tiles' groups (-1 for ``trailing_tiles`` more)."""
  tiles = [-(-s // tile_m) for s in sizes]
  starts = np.cumsum([0] + tiles[:-1]) * tile_m
  rows = np.concatenate([start + np.arange(s) for start, s in zip(starts, sizes)])
  tile_groups = np.concatenate([np.full(t, g) for g, t in enumerate(tiles)] + [np.full(trailing_tiles, -1)])
  return rows, len(tile_groups) * tile_m, jnp.asarray(tile_groups, jnp.int32)


def test_values_and_gradients_equal_ragged_dot_over_the_unpadded_rows():
  """float32: uneven groups, an empty one (group 1), two trailing -1 tiles, K and N not multiples of the 16-wide
  blocks (padded in the wrapper). The padding rows and the -1 tiles come out zero."""
  sizes, tile_m, k, n = [5, 0, 20, 9], 8, 40, 24
  rows, m, tile_groups = _padded_layout(sizes, tile_m, trailing_tiles=2)
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (sum(sizes), k), jnp.float32)
  w = jax.random.normal(kw, (len(sizes), k, n), jnp.float32)
  cotangent = jax.random.normal(kd, (sum(sizes), n), jnp.float32)

  def grouped(x, w):
    out = gmm(jnp.zeros((m, k), x.dtype).at[rows].set(x), w, tile_groups, tile_m=tile_m, **BLOCKS)
    return out[rows], out.at[rows].set(0)

  def reference(x, w):
    return jax.lax.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32), precision=jax.lax.Precision.HIGHEST)

  (out, rest), pullback = jax.vjp(grouped, x, w)
  expected, expected_pullback = jax.vjp(reference, x, w)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  assert not np.any(rest)  # padding rows and the tiles past the last group
  dx, dw = pullback((cotangent, jnp.zeros_like(rest)))
  expected_dx, expected_dw = expected_pullback(cotangent)
  np.testing.assert_allclose(dx, expected_dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, expected_dw, rtol=1e-5, atol=1e-5)
  assert not np.any(dw[1])  # the empty group


def test_fp8_products_in_the_kernels_equal_fp8_ragged_dot_values_and_gradients():
  """``model.fp8`` on GPU: ``fp8.grouped_matmul`` with the kernels' three FP8 products (e4m3 forward, e5m2 × e4m3
  backward as float16) gives ``fp8.ragged_dot``'s values and gradients: the same FP8 roundings and scales, and
  products of FP8 values are exact in float32, so only the summation order differs. Uneven groups, an empty one,
  trailing -1 tiles, K and N off the blocks."""
  from distrib_train.kernels.gmm_triton import fp8_products
  from distrib_train.kernels import fp8

  sizes, tile_m, k, n = [5, 0, 20, 9], 8, 40, 24
  rows, m, tile_groups = _padded_layout(sizes, tile_m, trailing_tiles=2)
  kx, kw, kd = jax.random.split(jax.random.key(3), 3)
  x = jnp.zeros((m, k), jnp.float32).at[rows].set(jax.random.normal(kx, (len(rows), k)))
  w = jax.random.normal(kw, (len(sizes), k, n), jnp.float32)
  cotangent = jnp.zeros((m, n), jnp.float32).at[rows].set(3e-3 * jax.random.normal(kd, (len(rows), n)))
  padded_sizes = jnp.asarray([-(-s // tile_m) * tile_m for s in sizes], jnp.int32)
  kernels = fp8_products(len(sizes), tile_m=tile_m, **BLOCKS)

  def run(matmul):
    with fp8.active("current"):
      return jax.vjp(matmul, x, w)

  out, pullback = run(lambda x, w: fp8.grouped_matmul(x, w, kernels, tile_groups))
  expected, expected_pullback = run(lambda x, w: fp8.ragged_dot(x, w, padded_sizes))
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
  assert np.any(out) and not np.any(np.delete(np.asarray(out), rows, axis=0))
  for got, want in zip(pullback(cotangent), expected_pullback(cotangent)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert np.any(got)
  exact = jax.lax.ragged_dot(x, w, padded_sizes, precision=jax.lax.Precision.HIGHEST)
  assert not np.allclose(out, exact, rtol=1e-4, atol=1e-4)  # the operands were rounded to FP8
  assert np.linalg.norm(out - exact) < 0.1 * np.linalg.norm(exact)  # and kept their scales


def test_every_tile_multiplies_its_own_groups_weights_in_bfloat16():
  """Each tile against ``lhs[t] @ rhs[tile_groups[t]]`` gathered per tile, in bfloat16 (float32 accumulation):
  the output and ``jax.grad`` of a loss, with nonzero rows everywhere (the tiles of -1 ignored), at the default
  (H100) blocks, which K=64 and N=96 do not fill."""
  tile_m, groups = 16, 3
  tile_groups = jnp.asarray([0, 2, 2, 2, -1], jnp.int32)
  m, k, n = tile_m * tile_groups.shape[0], 64, 96
  kx, kw = jax.random.split(jax.random.key(1))
  lhs = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  rhs = jax.random.normal(kw, (groups, k, n), jnp.float32).astype(jnp.bfloat16)
  live = (tile_groups >= 0).repeat(tile_m)[:, None]

  def reference(lhs, rhs):
    tiles = lhs.astype(jnp.float32).reshape(-1, tile_m, k)
    out = jnp.einsum(
      "tmk,tkn->tmn", tiles, rhs.astype(jnp.float32)[jnp.maximum(tile_groups, 0)], precision=jax.lax.Precision.HIGHEST
    )
    return jnp.where(live, out.reshape(m, n), 0)

  def loss(lhs, rhs, matmul):
    return jnp.sum(jnp.sin(matmul(lhs, rhs).astype(jnp.float32)))

  grouped = lambda lhs, rhs: gmm(lhs, rhs, tile_groups, tile_m=tile_m, interpret=True)
  out = grouped(lhs, rhs)
  assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
  np.testing.assert_allclose(out.astype(jnp.float32), reference(lhs, rhs), rtol=1e-2, atol=1e-2)
  grads = jax.grad(loss, argnums=(0, 1))(lhs, rhs, grouped)
  # The reference's gradients are taken at the kernel's rounded output, as the kernel's are.
  expected = jax.grad(lambda a, b: loss(a, b, lambda a, b: reference(a, b).astype(jnp.bfloat16)), argnums=(0, 1))(
    lhs, rhs
  )
  for got, want in zip(grads, expected):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), rtol=2e-2, atol=5e-2)
  assert not np.any(grads[0][-tile_m:].astype(jnp.float32))  # the -1 tile takes no part
  assert not np.any(grads[1][1].astype(jnp.float32))  # group 1 owns no tile


@pytest.mark.parametrize(
  "change, culprit",
  [
    (dict(lhs=(40, 32)), "not a multiple of tile_m"),
    (dict(rhs_dtype=jnp.bfloat16), "share one of"),
    (dict(tile_groups=(3,)), "tile_groups must be"),
    (dict(block_k=48), "block_k=48 must be a power of 2"),
    (dict(block_n=8, interpret=False), "block_n=8 must be a power of 2 of at least 16"),
    (dict(rhs=(65536, 32, 1024)), "rhs holds 8589934592 elements"),
    (dict(rhs=(2, 16, 8)), "lhs [M, K] and rhs [G, K, N]"),
  ],
)
def test_a_broken_layout_contract_is_one_clear_error(change, culprit):
  lhs = jnp.zeros(change.pop("lhs", (32, 32)), jnp.float32)
  rhs = jax.ShapeDtypeStruct(change.pop("rhs", (2, 32, 8)), change.pop("rhs_dtype", jnp.float32))
  tile_groups = jnp.zeros(change.pop("tile_groups", (2,)), jnp.int32)
  with pytest.raises(ValueError, match=culprit.replace("[", r"\[").replace("]", r"\]")):
    gmm(lhs, rhs, tile_groups, tile_m=16, **{"interpret": True, **change})


_H100_PROGRAM = r"""
import contextlib, json, math, re
import jax, jax.numpy as jnp
from distrib_train.kernels import grouped
from distrib_train.kernels.gmm_triton import gmm
from distrib_train.podplan import gpu
from distrib_train.kernels import fp8

devices = gpu._devices("{card}", 1, 1)
mesh = jax.sharding.Mesh(list(devices), ("x",))
replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
M, K, N, G = 8192, 1024, 2816, 8
FP8 = {fp8}
args = [jax.ShapeDtypeStruct(s, t, sharding=replicated)
        for s, t in [((M, K), jnp.bfloat16), ((G, K, N), jnp.bfloat16), ((M // 128,), jnp.int32)]]
if FP8:  # model.fp8 on GPU: the routed experts' matmul as the model calls it (its sizes unused by the kernels)
  matmul = lambda lhs, rhs, tile_groups: grouped.gmm(lhs, rhs, jnp.zeros(G, jnp.int32), tile_groups, tile=128,
                                                     platform="gpu", routed_rows=M)
else:
  matmul = gmm
loss = lambda lhs, rhs, tile_groups: jnp.sum(matmul(lhs, rhs, tile_groups).astype(jnp.float32) ** 2)
# jax 0.12's Pallas reads the card it lowers for from the default device (jax 0.10 assumes compute capability 9.0).
with jax.default_device(devices[0]), (fp8.active("current") if FP8 else contextlib.nullcontext()):
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
text = compiled.as_text()
shapes = set(re.findall(r"\b[a-z]+\d*\[[\d,]+\]", text))
print(json.dumps({"calls": re.findall(r'custom_call_target="([^"]+)"', text),
                  "fp8_kernel_operands": sorted({t for operands in re.findall(
                      r'custom_call_target="__gpu[^"]*", operand_layout_constraints=([^\n]*)', text)
                                                 for t in re.findall(r"f8e\w+", operands)}),
                  "largest": max(math.prod(int(d) for d in re.findall(r"\d+", s.split("[")[1])) for s in shapes),
                  "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}))
"""


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_an_h100_program_holds_the_three_triton_kernels_and_no_dense_expansion(fp8):
  """The loss's forward and both gradients compiled by XLA's CUDA compiler for an H100 at an MoE layer's shape
  (8192 routed rows, 1024 → 2816, 8 experts, bf16): three Triton kernels (forward, d lhs, d rhs), and no array
  larger than [M, N]. ``jax.lax.ragged_dot`` compiled the same way holds [8, 8192, 2816] masks and products.
  Under ``fp8.active`` the same three kernels take the float8 operands (``fp8.ragged_dot`` there would be
  expanded densely, with FP8 operands)."""
  cuda_plugin.require()
  found = cuda_plugin.run_program(_H100_PROGRAM.replace("{fp8}", str(fp8)).replace("{card}", "h100"))
  assert found["calls"].count("__gpu$xla.gpu.triton") == 3, found
  assert found["largest"] <= 8192 * 2816, found
  assert 0 < found["temp_bytes"], found
  assert found["fp8_kernel_operands"] == (["f8e4m3fn", "f8e5m2"] if fp8 else []), found


def test_fp8_experts_on_an_a100_take_ragged_dot_since_the_card_has_no_fp8():
  """Compute capability 8.0: Triton neither multiplies nor casts e4m3 there, so under ``fp8.active`` the
  grouped matmul keeps ``fp8.ragged_dot`` (XLA's dense lowering) and the program compiles."""
  cuda_plugin.require()
  found = cuda_plugin.run_program(_H100_PROGRAM.replace("{fp8}", "True").replace("{card}", "a100"))
  assert "__gpu$xla.gpu.triton" not in found["calls"], found
  assert found["largest"] >= 8 * 8192 * 2816, found  # every row times every expert's weights
