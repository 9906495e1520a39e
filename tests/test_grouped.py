"""The routed experts' grouped matmuls (``kernels/grouped.py``): the padded layout, each platform's kernel
against a per-row reference (values and gradients), and how the plan counts them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distrib_train.kernels import grouped
from distrib_train.podplan import collectives, hlo

ROWS, EMBED, HIDDEN, GROUPS = 50, 32, 48, 4


def _problem():
  keys = jax.random.split(jax.random.key(0), 5)
  rows = jax.random.normal(keys[0], (ROWS, EMBED))
  groups = jax.random.randint(keys[1], (ROWS,), 0, GROUPS + 1).at[:12].set(2).at[12:14].set(GROUPS)
  groups = jnp.where(groups == 0, 1, groups)  # group 0 gets no rows
  scale = lambda key, shape: jax.random.normal(key, shape) / 6
  return (
    rows,
    groups,
    (
      scale(keys[2], (GROUPS, EMBED, HIDDEN)),
      scale(keys[3], (GROUPS, EMBED, HIDDEN)),
      scale(keys[4], (GROUPS, HIDDEN, EMBED)),
    ),
  )


def _reference(rows, groups, w_gate, w_up, w_down):
  g = jnp.minimum(groups, GROUPS - 1)
  hidden = jax.nn.silu(jnp.einsum("rd,rdf->rf", rows, w_gate[g])) * jnp.einsum("rd,rdf->rf", rows, w_up[g])
  return jnp.where((groups < GROUPS)[:, None], jnp.einsum("rf,rfd->rd", hidden, w_down[g]), 0)


def test_the_padded_layout_gives_each_group_whole_tiles_and_no_more():
  _, groups, _ = _problem()
  tile = 16
  positions, sizes, tile_groups, m = grouped.padded_layout(groups, GROUPS, tile)
  positions, sizes, tile_groups = map(np.asarray, (positions, sizes, tile_groups))
  counts = np.bincount(np.asarray(groups), minlength=GROUPS + 1)[:GROUPS]
  assert m == grouped.layout_rows(ROWS, GROUPS, tile) and m % tile == 0
  np.testing.assert_array_equal(sizes, -(-counts // tile) * tile)  # each group padded to the tile only
  inside = np.asarray(groups) < GROUPS
  assert np.all(positions[~inside] == m) and len(set(positions[inside])) == inside.sum()
  starts = np.cumsum(sizes) - sizes
  for g in range(GROUPS):  # a group's rows fill the start of its own span, in their order
    mine = positions[np.asarray(groups) == g]
    np.testing.assert_array_equal(mine, starts[g] + np.arange(len(mine)))
    np.testing.assert_array_equal(tile_groups[starts[g] // tile : (starts[g] + sizes[g]) // tile], g)
  assert np.all(tile_groups[sizes.sum() // tile :] == -1)


@pytest.mark.parametrize("interpret", [False, True], ids=["cpu-tiles", "megablox-interpreted"])
def test_grouped_swiglu_equals_a_per_row_reference_with_its_gradients(interpret):
  """``interpret``: the TPU path (megablox's gmm and tgmm, with this module's VJP) run by Pallas' interpreter."""
  rows, groups, weights = _problem()
  mine = lambda rows, *w: grouped.swiglu(rows, groups, GROUPS, *w, platform="cpu", interpret=interpret)
  reference = lambda rows, *w: _reference(rows, groups, *w)
  np.testing.assert_allclose(mine(rows, *weights), reference(rows, *weights), rtol=1e-5, atol=1e-5)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  got = jax.grad(loss(mine), argnums=(0, 1, 2, 3))(rows, *weights)
  want = jax.grad(loss(reference), argnums=(0, 1, 2, 3))(rows, *weights)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_the_plan_counts_a_grouped_kernel_by_its_routed_rows_and_a_ragged_all_to_all_by_what_it_sends():
  scope = 'op_name="jit(step)/transpose(jvp(grouped_matmul(rows=256,k=64,n=96)))/pallas_call"'
  text = f"""HloModule m, num_partitions=4

ENTRY %main (x: bf16[256,64], o: bf16[1024,64], s: s32[4]) -> bf16[256,64] {{
  %x = bf16[256,64]{{1,0}} parameter(0)
  %o = bf16[1024,64]{{1,0}} parameter(1)
  %s = s32[4]{{0}} parameter(2)
  %k = bf16[1024,96]{{1,0}} custom-call(%x), custom_call_target="tpu_custom_call", metadata={{{scope}}}
  %other = bf16[8]{{0}} custom-call(%x), custom_call_target="tpu_custom_call"
  %r = bf16[1024,64]{{1,0}} ragged-all-to-all(%x, %o, %s, %s, %s, %s), replica_groups={{{{0,1,2,3}}}}
  ROOT %back = bf16[256,64]{{1,0}} ragged-all-to-all(%r, %x, %s, %s, %s, %s), replica_groups={{{{0,1,2,3}}}}
}}
"""
  assert hlo.matmul_flops(text) == 2.0 * 256 * 64 * 96
  out, back = collectives.find_collectives(text, (4,), ("expert",))
  for moved in (out, back):  # the rows routed, there and back, not the receive buffer sized for the worst case
    assert moved.kind == "all-to-all" and moved.payload_bytes == 256 * 64 * 2
