"""The context axis: sequences split over devices, ring and all-gather attention, against one device."""

import pathlib

import jax
import numpy as np
import pytest

import mp_harness
import pipeline_helpers as ph
from distrib_train.kernels.attention import ring
from distrib_train.sharding import context

_WORKERS = pathlib.Path(__file__).resolve().parent / "workers"
RTOL = 1e-4
# The shortest rows that show every path: 512 tokens give each of context 4's devices 128, the smallest block
# splash takes (all-gather through splash), in two zigzag chunks of 64 (ring attention).
LENGTH = 512


@pytest.fixture(autouse=True)
def _long(monkeypatch):
  monkeypatch.setattr(ph, "LENGTH", LENGTH)
  monkeypatch.setattr(ph, "BATCH", 8)


def _one_device(packed, steps=3):
  return ph.train(ph.mesh_of({}, devices=jax.devices()[:1]), steps=steps, packed=packed)


@pytest.fixture
def packed_one_device(once_per_run):
  """Three steps on packed rows on one device (losses, final params), computed once in the run: the reference
  of the ring, composition and two-process tests (a shorter run's losses are its first ones)."""
  return once_per_run(f"context-one-device-packed-{LENGTH}", lambda: _one_device(True, steps=3))


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_ring_attention_on_context_4_fsdp_2_matches_one_device(packed, packed_one_device):
  want_losses, want_params = packed_one_device if packed else _one_device(packed)
  losses, params = ph.train(ph.mesh_of({"context": 4, "fsdp": 2}), steps=3, packed=packed)
  np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
  for name, want in want_params.items():
    np.testing.assert_allclose(params[name], want, rtol=RTOL, atol=2e-5, err_msg=name)


# all-gather through splash (interpreted here), under the layer's remat: its residuals kept, the keys regathered
SPLASH = dict(context_attention="all_gather", attention="splash", remat="full")


@pytest.mark.parametrize("implementation", ["ring", "all_gather", "all_gather_splash"])
def test_gradients_match_one_device(implementation):
  want = ph.gradients(ph.mesh_of({}, devices=jax.devices()[:1]), packed=True)
  options = SPLASH if implementation == "all_gather_splash" else dict(context_attention=implementation)
  got = ph.gradients(ph.mesh_of({"context": 4, "fsdp": 2}), packed=True, **options)
  for name in want:
    scale = np.max(np.abs(want[name]))
    np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=1e-5 * scale, err_msg=name)


def test_context_composes_with_tensor_stage_and_expert_axes(packed_one_device):
  want = packed_one_device[0][:2]
  losses, _ = ph.train(ph.mesh_of({"context": 2, "tensor": 2, "fsdp": 2}), steps=2, packed=True)
  np.testing.assert_allclose(losses, want, rtol=RTOL)
  losses, _ = ph.train(ph.mesh_of({"stage": 2, "context": 2, "fsdp": 2}), steps=2, packed=True, microbatches=4)
  np.testing.assert_allclose(losses, want, rtol=RTOL)
  moe_want = ph.train(ph.mesh_of({}, devices=jax.devices()[:1]), steps=2, family="moe")[0]
  moe_losses, _ = ph.train(ph.mesh_of({"context": 2, "expert": 2, "fsdp": 2}), steps=2, family="moe")
  np.testing.assert_allclose(moe_losses, moe_want, rtol=RTOL)


@pytest.mark.parametrize("implementation", ["ring", "all_gather"])
def test_tiled_scores_give_the_attention_and_gradients_of_one_block(implementation):
  """Tiles of 16 × 16 positions (4 × 4 tiles per ring block here) give plain causal attention in zigzag order."""
  import jax.numpy as jnp
  from distrib_train.sharding.axis_rules import AxisRules, FSDP_TENSOR_RULES, activation_sharding

  batch, length, heads, kv_heads, dim = 2, 256, 4, 2, 8
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(batch, length, h, dim)), jnp.float32) for h in (heads, kv_heads, kv_heads))
  segments = jnp.asarray(np.repeat([[1] * 100 + [2] * 120 + [0] * 36], batch, axis=0), jnp.int32)
  order = context.zigzag(length, 4)
  positions = jnp.broadcast_to(jnp.arange(length), (batch, length))

  def reference(q, k, v):
    seen = (positions[:, None, :] <= positions[:, :, None]) & (segments[:, None, :] == segments[:, :, None])
    out = jax.nn.dot_product_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), mask=seen[:, None])
    return jnp.sum(jnp.sin(out) * (segments > 0)[..., None, None])

  mesh = ph.mesh_of({"context": 4, "fsdp": 2})
  take = lambda a: jnp.take(a, order, axis=1)

  def tiled(q, k, v):
    with activation_sharding(mesh, AxisRules(FSDP_TENSOR_RULES)):
      out = ring.attention(take(q), take(k), take(v), take(positions), take(segments), implementation, block=16)
    return jnp.sum(jnp.sin(out) * (take(segments) > 0)[..., None, None])

  want, want_grads = jax.value_and_grad(reference, argnums=(0, 1, 2))(q, k, v)
  got, got_grads = jax.jit(jax.value_and_grad(tiled, argnums=(0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for name, g, w in zip("qkv", got_grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_zigzag_order_gives_each_device_a_front_and_a_back_chunk():
  order = context.zigzag(16, 2)
  assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
  assert sorted(order.tolist()) == list(range(16))


def test_a_length_the_context_axis_does_not_split_is_refused(tmp_path):
  with pytest.raises(
    ValueError,
    match=r"sequence length 1004 does not split over the context axis: it must be a"
    r" multiple of 2 × context \(8\)",
  ):
    context.zigzag(1004, 4)
  from distrib_train.config import run as config_lib
  from distrib_train.train.trainer import Trainer, TrainerSetupError

  config = config_lib.load("tiny", ["mesh_config=cpu-8-context", "data.seq_len=100"])
  with pytest.raises(TrainerSetupError, match=r"data.seq_len 100 does not split over the context axis \(4\)"):
    Trainer(config, tmp_path / "run").run()
  assert not (tmp_path / "run").exists()


def test_context_axis_across_two_processes(packed_one_device):
  want = packed_one_device[0]
  results = mp_harness.run_workers(_WORKERS / "context_worker.py", "3", str(LENGTH), timeout=300)
  for r in results:
    assert r.result["mesh"]["context"] == 4
    np.testing.assert_allclose(r.result["losses"], want, rtol=RTOL)
    np.testing.assert_allclose(r.result["splash_losses"], want, rtol=RTOL)  # all-gather, splash, gather over DCN
