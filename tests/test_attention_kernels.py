"""Attention's variants in every kernel, and the decoders that compose them, against references and one device.

Sliding windows, sinks and soft caps run in splash attention (its interpret
mode here), in jax's attention, in the context axis's tiles and in this
module's plain reference, with the same outputs and gradients; decoders
built of every block variant (Gemma 3's, gpt-oss's, DeepSeek-V3's) train on
8 devices, with every axis their weights use, as on one device.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import distrib_train as dt
import pipeline_helpers as ph
from distrib_train.kernels.attention import ring
from distrib_train.sharding import context
from distrib_train.kernels.attention import dispatch as attention_kernels
from distrib_train.kernels.attention.splash import splash_attention
from distrib_train.sharding.axis_rules import activation_sharding

WINDOW = 24


def _inputs(length=128, heads=4, kv_heads=2, qk_dim=16, v_dim=16, batch=4):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(batch, length, heads, qk_dim)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(batch, length, kv_heads, qk_dim)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(batch, length, kv_heads, v_dim)), jnp.float32)
  sinks = jnp.asarray(rng.normal(size=(heads,)), jnp.float32)
  segments = jnp.asarray(np.arange(length)[None, :] >= (np.arange(batch)[:, None] * 17 + 30), jnp.int32) + 1
  return q, k, v, sinks, segments


def _value_and_grads(attention, *args):
  return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(attention(*a))), argnums=tuple(range(len(args)))))(*args)


def _close(got, want):
  # the value sums sin over 32k outputs to about 2.6: summation order alone moves it by ~5e-4
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-3)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def _reference(window, softcap, with_sinks, segments):
  return lambda q, k, v, sinks: attention_kernels.reference_attention(
    q, k, v, segments, window=window, scale=q.shape[-1] ** -0.5, softcap=softcap, sinks=sinks if with_sinks else None
  )


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("window, softcap, with_sinks", [(WINDOW, 0.0, False), (0, 3.0, True), (WINDOW, 3.0, True)])
def test_splash_runs_windows_sinks_and_soft_caps_as_the_reference_does(sharded, window, softcap, with_sinks):
  q, k, v, sinks, segments = _inputs()
  want = _value_and_grads(_reference(window, softcap, with_sinks, segments), q, k, v, sinks)
  splash = lambda q, k, v, sinks: splash_attention(
    q, k, v, segments, window=window, softcap=softcap, sinks=sinks if with_sinks else None
  )
  scope = contextlib.nullcontext()
  if sharded:  # batch over data × fsdp, heads over tensor (and each device's sinks with its heads)
    scope = activation_sharding(ph.mesh_of({"data": 2, "fsdp": 2, "tensor": 2}), dt.AxisRules("fsdp_tensor"))
  with scope:
    got = _value_and_grads(splash, q, k, v, sinks)
  _close(got, want)


def test_jax_attention_with_a_window_is_the_reference_and_mla_values_of_another_size_run_too():
  q, k, v, sinks, segments = _inputs()
  layer = attention_kernels.Attention("xla", window=WINDOW)
  run = lambda q, k, v: attention_kernels.attention(q, k, v, layer, positions=None, segment_ids=segments)
  want = _reference(WINDOW, 0.0, False, segments)
  _close(_value_and_grads(run, q, k, v), _value_and_grads(lambda q, k, v: want(q, k, v, sinks), q, k, v))
  q, k, v, _, _ = _inputs(qk_dim=24, v_dim=16)  # MLA: queries and keys with a rotary part, values without
  assert attention_kernels.attention(q, k, v, layer, positions=None).shape == (4, 128, 4, 16)


@pytest.mark.parametrize("implementation", ["ring", "all_gather"])
def test_the_context_tiles_run_windows_sinks_and_soft_caps_as_the_reference_does(implementation):
  q, k, v, sinks, segments = _inputs(length=64)
  positions = jnp.broadcast_to(jnp.arange(64), (4, 64))
  want = _value_and_grads(_reference(WINDOW, 3.0, True, segments), q, k, v, sinks)
  mesh = ph.mesh_of({"context": 4, "fsdp": 2})
  run = lambda q, k, v, sinks: ring.attention(
    q, k, v, positions, segments, implementation, block=16, window=WINDOW, softcap=3.0, sinks=sinks
  )
  with activation_sharding(mesh, dt.AxisRules("fsdp_tensor")):
    got = _value_and_grads(run, q, k, v, sinks)
  _close(got, want)


def test_the_kernel_is_chosen_in_one_place_for_what_the_layer_asks():
  q = jnp.zeros((1, 128, 2, 16), jnp.bfloat16)
  choose, Attention = attention_kernels.choose, attention_kernels.Attention
  assert choose(Attention("auto", window=WINDOW), q) == "xla"  # CPU here
  assert choose(Attention("splash", window=WINDOW), q, sinks=True) == "splash"
  with pytest.raises(ValueError, match="cannot run attention sinks or a soft cap"):
    choose(Attention("cudnn", softcap=30.0), q)
  with activation_sharding(ph.mesh_of({"context": 2}), dt.AxisRules("fsdp_tensor")):
    assert choose(Attention("auto", context="all_gather"), q) == "all_gather"  # XLA's tiles on CPU
    assert choose(Attention("splash", context="all_gather"), jnp.zeros((1, 512, 2, 16))) == "all_gather_splash"
    kernel, reason = attention_kernels.decide(Attention("splash", context="all_gather"), q)
    assert kernel == "all_gather" and "multiple of 2 × context × 128 = 512, got 128" in reason
    assert attention_kernels.decide(Attention("splash"), q)[0] == "ring"


@pytest.mark.parametrize("window", [0, 100])
def test_the_zigzag_masks_blocks_answered_from_their_corners_are_the_masks_own(window):
  from distrib_train.kernels.attention.splash import _zigzag_mask

  mask = _zigzag_mask(2, 512, window)
  whole = mask.mask_function(mask.q_sequence[:, None], np.arange(512)[None, :])
  for q in range(0, 512, 64):
    for k in range(0, 512, 128):
      np.testing.assert_array_equal(mask[slice(q, q + 64), slice(k, k + 128)], whole[q : q + 64, k : k + 128])


@pytest.mark.parametrize(
  "window, softcap, with_sinks, qk_dim",
  [(0, 0.0, False, 16), (100, 3.0, True, 16), (0, 0.0, False, 24)],
  ids=["causal", "window", "mla-heads"],
)
def test_splash_over_the_context_axis_by_all_gather_is_the_reference(window, softcap, with_sinks, qk_dim):
  """Zigzag chunks of 128 (context 2) gather the keys and run splash per query shard, heads split over tensor;
  MLA's values may have another head size than its queries."""
  q, k, v, sinks, _ = _inputs(length=512, batch=2, qk_dim=qk_dim)
  segments = jnp.asarray(np.repeat([[1] * 200 + [2] * 250 + [0] * 62], 2, axis=0), jnp.int32)
  order = context.zigzag(512, 2)
  take = lambda a: jnp.take(a, order, axis=1)
  mesh = ph.mesh_of({"context": 2, "fsdp": 2, "tensor": 2})
  layer = attention_kernels.Attention("splash", window=window, softcap=softcap, context="all_gather")

  def run(q, k, v, sinks):
    with activation_sharding(mesh, dt.AxisRules("fsdp_tensor")), attention_kernels.recorded() as decisions:
      out = attention_kernels.attention(
        take(q),
        take(k),
        take(v),
        layer,
        positions=None,
        segment_ids=take(segments),
        sinks=sinks if with_sinks else None,
      )
    (decision,) = decisions
    assert decision.kernel == "all_gather_splash" and decision.gathered_bytes == 512 * 1 * (qk_dim + 16) * 4
    # each shard (chunks 0 and 3, or 1 and 2) runs 5 of its 8 blocks of 128 × 128; a window, 3 or 4 of them
    assert decision.work == pytest.approx(
      5 * 128 * 128 / (512 * 513 / 4) if not window else 4 * 128 * 128 / ((100 * 101 / 2 + 412 * 100) / 2)
    )
    return jnp.sum(jnp.sin(out) * (take(segments) > 0)[..., None, None])

  reference = _reference(window, softcap, with_sinks, segments)
  want = _value_and_grads(
    lambda q, k, v, s: jnp.sum(jnp.sin(reference(q, k, v, s)) * (segments > 0)[..., None, None]), q, k, v, sinks
  )
  _close(_value_and_grads(run, q, k, v, sinks), want)


GEMMA_LIKE = dict(
  qk_norm=True,
  sandwich_norms=True,
  norm_weight_offset=1.0,
  scale_embeddings=True,
  mlp_activation="gelu_tanh",
  query_pre_attn_scalar=24.0,
  sliding_window=16,
  layer_types=("sliding", "full"),
  local_rope_theta=100.0,
  final_logit_softcap=20.0,
)
GPT_OSS_LIKE = dict(
  family="moe",
  num_layers=4,
  attention_bias=True,
  attention_out_bias=True,
  attention_sinks=True,
  sliding_window=16,
  layer_types=("sliding", "full") * 2,
  rope_scaling="yarn",
  rope_factor=4.0,
  rope_original_max_len=16,
  mlp_activation="swiglu_oss",
  swiglu_limit=0.5,
  router="softmax_topk",
  router_logit_bias=True,
  expert_bias=True,
)
DEEPSEEK_LIKE = dict(
  family="moe",
  num_layers=3,
  num_kv_heads=4,
  attention_kind="mla",
  q_lora_rank=32,
  kv_lora_rank=16,
  qk_rope_head_dim=8,
  v_head_dim=16,
  rope_interleave=True,
  rope_scaling="yarn",
  rope_factor=4.0,
  rope_original_max_len=16,
  rope_mscale=1.0,
  rope_mscale_all_dim=1.0,
  num_shared_experts=1,
  router="sigmoid",
  router_groups=4,
  router_group_topk=2,
  router_score_bias=True,
  routed_scaling=2.5,
  dense_layers=(0,),
)


@pytest.mark.parametrize(
  "variant, axes",
  [
    (GEMMA_LIKE, {"data": 2, "fsdp": 2, "tensor": 2}),
    (GEMMA_LIKE, {"context": 2, "fsdp": 2, "tensor": 2}),
    (GPT_OSS_LIKE, {"expert": 2, "fsdp": 2, "tensor": 2}),
    (DEEPSEEK_LIKE, {"expert": 4, "fsdp": 2}),
  ],
  ids=["gemma-data-fsdp-tensor", "gemma-context", "gpt-oss-expert", "deepseek-expert"],
)
def test_a_decoder_of_each_familys_blocks_trains_on_8_devices_as_on_one(variant, axes):
  """fp32 losses and params after 2 steps (packed rows: windows and documents together)."""
  want_losses, want_params = ph.train(ph.mesh_of({}, devices=jax.devices()[:1]), steps=2, packed=True, **variant)
  losses, params = ph.train(ph.mesh_of(axes), steps=2, packed=True, **variant)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  for name, want in want_params.items():
    np.testing.assert_allclose(params[name], want, rtol=1e-4, atol=5e-5, err_msg=name)


def test_the_rules_shard_mla_latents_over_fsdp_and_sinks_with_their_heads():
  mla = ph.tiny_config(**{k: v for k, v in DEEPSEEK_LIKE.items() if k != "family"}, family="moe")
  sinks = ph.tiny_config(**{k: v for k, v in GPT_OSS_LIKE.items() if k != "family"}, family="moe")
  mesh = ph.mesh_of({"expert": 2, "fsdp": 2, "tensor": 2})
  specs = {}
  for config in (mla, sinks):
    make = lambda: dt.TrainState.initial_state(config.build(0), optax.sgd(0.1), jax.random.key(0))
    plan = dt.MeshPlanner(mesh, "fsdp_tensor").plan(jax.eval_shape(make))
    flat = jax.tree_util.tree_flatten_with_path(plan.train_state_shardings.params)[0]
    specs.update({jax.tree_util.keystr(path): s.spec for path, s in flat})
  spec = lambda segment, name: next(v for k, v in specs.items() if f"'{segment}'" in k and f"'{name}'" in k)
  assert spec("layers_1", "wq_b") == P(None, "fsdp", "tensor", None)  # [layers, q latent, heads, head]
  assert spec("layers_1", "wkv_b") == P(None, "fsdp", "tensor", None)  # [layers, kv latent, heads, head]
  assert spec("layers_1", "wq_a") == P(None, "fsdp", None)  # [layers, embed, q latent]: embed takes fsdp first
  assert spec("layers_1", "w_gate") == P(None, "expert", "fsdp", "tensor")
  assert spec("layers", "sinks") == P(None, "tensor")
  assert spec("layers", "b_gate") == P(None, "expert", "tensor")


def test_long_sequences_without_a_fused_kernel_run_in_tiles_as_the_reference_does(monkeypatch):
  """Past ``TILE`` tokens, sinks, a soft cap or MLA's values run in rematerialized tiles of online softmax."""
  monkeypatch.setattr(attention_kernels, "TILE", 32)
  q, k, v, sinks, segments = _inputs(length=128)
  positions = jnp.asarray(
    np.where(segments == 1, np.arange(128), np.arange(128) - np.argmax(segments == 2, 1)[:, None])
  )
  layer = attention_kernels.Attention("xla", window=WINDOW, softcap=3.0)
  tiled = lambda q, k, v, sinks: attention_kernels.attention(
    q, k, v, layer, positions=positions, segment_ids=segments, sinks=sinks
  )
  text = jax.jit(tiled).lower(q, k, v, sinks).as_text()
  assert "128x128" not in text and "32x32" in text  # score tiles, never the whole square
  _close(
    _value_and_grads(tiled, q, k, v, sinks), _value_and_grads(_reference(WINDOW, 3.0, True, segments), q, k, v, sinks)
  )


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (8, 2)])
def test_decode_queries_padded_for_the_matrix_unit_give_the_same_attention(monkeypatch, heads, kv_heads):
  """One query per row over a cache: each kv head's rows are padded (2 at least, 8 on a TPU); the padded rows,
  with sinks, a soft cap and the token's own key apart, change nothing."""
  from distrib_train.kernels.attention import xla

  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(3, 1, heads, 16)), jnp.float32)
  keys, values = (jnp.asarray(rng.normal(size=(3, 40, kv_heads, 16)), jnp.float32) for _ in range(2))
  new = tuple(jnp.asarray(rng.normal(size=(3, 1, kv_heads, 16)), jnp.float32) for _ in range(2))
  seen = jnp.asarray(np.arange(40)[None, None, :] < np.array([40, 17, 3])[:, None, None])
  sinks = jnp.asarray(rng.normal(size=(heads,)), jnp.float32)
  run = lambda: xla.masked_attention(q, keys, values, seen, scale=0.25, softcap=5.0, sinks=sinks, new=new)
  outs = {}
  for least in (1, 2, 8):
    monkeypatch.setattr(xla, "_min_rows", lambda least=least: least)
    outs[least] = run()
  each = lambda a: jnp.repeat(a, heads // kv_heads, 2)  # every query head's key or value
  scores = 5.0 * jnp.tanh(jnp.einsum("bqhd,bshd->bhqs", q, jnp.concatenate([each(keys), each(new[0])], 1)) / 20.0)
  scores = jnp.where(jnp.concatenate([seen, jnp.ones((3, 1, 1), bool)], -1)[:, None], scores, -jnp.inf)
  sink = jnp.broadcast_to(sinks[None, :, None, None], scores.shape[:3] + (1,))
  weights = jax.nn.softmax(jnp.concatenate([scores, sink], -1), -1)[..., :-1]
  want = jnp.einsum("bhqs,bshd->bqhd", weights, jnp.concatenate([each(values), each(new[1])], 1))
  for least, got in outs.items():
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"rows padded to {least}")


def test_under_remat_an_mla_layer_keeps_its_latent_per_token_not_keys_and_values_per_head():
  """The backward pass recomputes MLA's keys and values from the latent it kept (kv_lora_rank + the rotary
  part: 16 + 8 per token here), never keeping them per head (4 heads × 24 and × 16)."""
  from flax import nnx

  from distrib_train.recipes import decoder

  config = ph.tiny_config(**{k: v for k, v in DEEPSEEK_LIKE.items() if k != "family"}, family="moe", remat="full")
  graph, params, rest = nnx.split(config.build(0), nnx.Param, ...)
  tokens = np.zeros((2, 32), np.int32)
  loss = lambda params: decoder.loss_fn(
    model=nnx.merge(graph, params, rest), state=None, rng=None, tokens=tokens, targets=tokens
  )[0]
  text = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
  assert "f32[2,2,32,24]" in text  # the 2 mixture layers' latents (16) and rotary keys (8), kept for the backward
  assert not any(f"f32[2,2,32,4,{d}]" in text for d in (24, 16))  # no keys or values per head kept
