"""Model adapters (nnx, linen) with local state, and the reference models."""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import distrib_train as dt
from distrib_train import models, recipes
from distrib_train.kernels import cross_entropy
from distrib_train.kernels.attention import splash
from distrib_train.sharding.axis_rules import activation_sharding
from distrib_train.recipes import mlp
from distrib_train.models.pytree import path_str

AXES3 = ("data", "fsdp", "tensor")


def _mesh(shape=(2, 2, 2), devices=None):
  return dt.build_mesh(dt.MeshConfig(AXES3, shape), devices=devices)


def _classification_batch(step, in_features=16, classes=8, batch=32):
  rng = np.random.default_rng(step)
  x = rng.normal(size=(batch, in_features)).astype(np.float32) * 2 + 1
  return {"inputs": x, "targets": (x[:, :classes].argmax(-1)).astype(np.int32)}


def _planned(make_state, loss_fn, inputs, mesh=None, input_axes=None):
  planner = dt.MeshPlanner(mesh or _mesh(), "fsdp_tensor")
  state, plan = planner.init(make_state, loss_fn=loss_fn, inputs=inputs, input_axes=input_axes)
  kwargs = dict(
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
  )
  return state, plan, kwargs


def _only(tree):
  """The one array (or sharding) inside an nnx Variable or a bare leaf."""
  (leaf,) = jax.tree_util.tree_leaves(tree)
  return leaf


def _opt_paths(state):
  return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]]


# --- flax nnx: BatchNorm statistics as local state --------------------------


def _make_bn_mlp_state(dropout=0.0, tx=None):
  return lambda: dt.TrainState.initial_state(
    mlp.MLPConfig(dropout=dropout).build(0), tx or optax.adam(1e-2), jax.random.key(0)
  )


def test_nnx_module_splits_into_params_local_state_and_the_rest():
  state = _make_bn_mlp_state()()
  assert isinstance(state.model_without_params, models.nnx_model.NnxModelDef)
  assert sorted(path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]) == [
    "dense_in/bias",
    "dense_in/kernel",
    "dense_out/bias",
    "dense_out/kernel",
    "norm/bias",
    "norm/scale",
  ]
  assert sorted(path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.local_state)[0]) == [
    "norm/mean",
    "norm/var",
  ]
  assert isinstance(state.model, mlp.BatchNormMLP)


def test_nnx_batch_stats_update_every_step_and_never_reach_the_optimizer():
  inputs = _classification_batch(0)
  state, plan, kwargs = _planned(_make_bn_mlp_state(), mlp.loss_fn, inputs)
  step_fn = dt.build_train_step_fn(mlp.loss_fn, donate_params_and_state=True, **kwargs)
  means = []
  for i in range(4):
    old = state
    state, aux = step_fn(state, **_classification_batch(i))
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(old.local_state))  # donated like the params
    # Read a device copy: on CPU a numpy view of the buffer itself is cached
    # on the array and would keep the next step from donating it.
    means.append(np.asarray(jnp.copy(_only(state.local_state["norm"]["mean"]))))
  for a, b in zip(means, means[1:]):
    assert not np.allclose(a, b)
  assert not any("mean" in p or "var" in p for p in _opt_paths(state))
  for got, want in zip(
    jax.tree_util.tree_leaves(state.local_state), jax.tree_util.tree_leaves(plan.train_state_shardings.local_state)
  ):
    assert got.sharding == want
  # The params' own annotations were used: dense_in/kernel is (embed, mlp).
  assert _only(plan.train_state_shardings.params["dense_in"]["kernel"]).spec == P("fsdp", "tensor")
  assert _only(plan.train_state_shardings.params["norm"]["scale"]).spec == P("tensor")


class _GradientMeter(nnx.Module):
  """A linear layer whose ``seen`` state records, in the backward pass, the largest |gradient| at its output."""

  def __init__(self):
    self.w = nnx.Param(jnp.full((4, 2), 0.5))
    self.seen = dt.models.OverwriteWithGradient(jnp.zeros(()))

  def __call__(self, x):
    return _meter(x @ self.w[...], self.seen[...])


@jax.custom_vjp
def _meter(y, seen):
  return y


_meter.defvjp(lambda y, seen: (y, None), lambda _, g: (g, jnp.max(jnp.abs(g))))


@pytest.mark.parametrize("microbatches", [1, 2])
def test_nnx_overwrite_with_gradient_state_is_written_by_the_backward_pass(microbatches):
  def loss_fn(*, model, state, rng, x):
    loss = jnp.sum(model(x) ** 2)
    return loss, state, {"loss": loss}

  state = dt.TrainState.initial_state(_GradientMeter(), optax.adam(0.1), jax.random.key(0))
  assert jax.tree_util.tree_leaves(state.local_state) and "seen" not in str(jax.tree_util.tree_structure(state.params))
  x = jnp.arange(8.0).reshape(2, 4)
  step = jax.jit(dt.build_train_step_fn(loss_fn, microbatches=microbatches))
  new, _ = step(state, x=x)
  # d(sum y²)/dy = 2y; with two microbatches the state threads through both and the last (row 1) writes it.
  y = np.asarray(x @ state.params["w"][...])
  want = np.abs(2 * y).max() if microbatches == 1 else np.abs(2 * y[1:]).max()
  np.testing.assert_allclose(float(new.local_state["seen"][...]), want, rtol=1e-6)
  assert "seen" not in str(jax.tree_util.tree_structure(new.opt_state))  # never seen by the optimizer
  assert not np.allclose(new.params["w"][...], state.params["w"][...])


def test_gradients_cover_params_only():
  state = _make_bn_mlp_state()()
  grads = jax.grad(
    lambda p: mlp.loss_fn(
      model=models.merge_model(state.model_without_params, p, state.local_state),
      state=None,
      rng=None,
      **_classification_batch(0),
    )[0]
  )(state.params)
  assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(state.params)


def test_nnx_eval_step_uses_running_statistics_and_updates_nothing():
  inputs = _classification_batch(0)
  state, _, kwargs = _planned(_make_bn_mlp_state(), mlp.loss_fn, inputs)
  step_fn = dt.build_train_step_fn(mlp.loss_fn, **kwargs)
  for i in range(3):
    state, _ = step_fn(state, **_classification_batch(i))
  eval_fn = dt.build_eval_step_fn(mlp.loss_fn, **kwargs)
  before = np.asarray(state.local_state["norm"]["mean"][...])
  first = eval_fn(state, **inputs)
  second = eval_fn(state, **inputs)
  np.testing.assert_array_equal(np.asarray(state.local_state["norm"]["mean"][...]), before)
  assert float(first["loss"]) == float(second["loss"])
  # By hand: the rebuilt module in eval mode normalises with the running stats.
  model = state.model
  model.eval()
  logits = model(inputs["inputs"])
  expected = optax.softmax_cross_entropy_with_integer_labels(logits, inputs["targets"]).mean()
  np.testing.assert_allclose(float(first["loss"]), float(expected), rtol=1e-5)
  train_mode_loss = float(mlp.loss_fn(model=state.model, state=None, rng=None, **inputs)[0])
  assert abs(train_mode_loss - float(expected)) > 1e-4


def test_nnx_dropout_draws_from_the_step_key():
  inputs = _classification_batch(0)
  state = _make_bn_mlp_state(dropout=0.5)()
  step_fn = dt.build_train_step_fn(mlp.loss_fn)
  _, first = step_fn(state, **inputs)
  _, replay = step_fn(state, **inputs)
  _, next_step = step_fn(state.replace(step=1), **inputs)  # same params, next step's key
  assert float(first["loss"]) == float(replay["loss"])
  assert float(first["loss"]) != float(next_step["loss"])
  _, other_root = step_fn(state.replace(root_rng=jax.random.key(1)), **inputs)
  assert float(first["loss"]) != float(other_root["loss"])


def test_nnx_is_param_filter_freezes_the_rest():
  make = lambda: dt.TrainState.initial_state(
    mlp.MLPConfig().build(0),
    optax.adam(0.1),
    jax.random.key(0),
    is_param=nnx.All(nnx.Param, nnx.PathContains("dense_out")),
  )
  state = make()
  frozen = np.asarray(state.model.dense_in.kernel[...])
  step_fn = dt.build_train_step_fn(mlp.loss_fn)
  for i in range(2):
    state, _ = step_fn(state, **_classification_batch(i))
  np.testing.assert_array_equal(np.asarray(state.model.dense_in.kernel[...]), frozen)
  assert all("dense_out" in p or p.endswith("count") for p in _opt_paths(state))


def test_hyperparams_follow_a_schedule_inside_chain_through_the_step():
  schedule = optax.linear_schedule(0.1, 0.0, transition_steps=10)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=schedule))
  state = _make_bn_mlp_state(tx=tx)()
  step_fn = dt.build_train_step_fn(mlp.loss_fn, donate_params_and_state=True)
  for i in range(3):
    state, _ = step_fn(state, **_classification_batch(i))
    np.testing.assert_allclose(float(state.hyperparams["learning_rate"]), float(schedule(i)), rtol=1e-6)


# --- flax linen: batch_stats as local state ---------------------------------


class LinenBNModel(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(64, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.Dropout(0.5, deterministic=not train)(jax.nn.relu(x))
    return nn.Dense(8, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed")))(x)


def linen_loss(*, model, state, rng, inputs, targets):
  logits = model(inputs, train=True)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  return loss, state, {"loss": loss}


def linen_eval_loss(*, model, state, rng, inputs, targets):
  logits = model(inputs, train=False)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  return loss, state, {"loss": loss}


def _make_linen_state():
  module = LinenBNModel()
  variables = module.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, jnp.ones((2, 16)))
  return dt.TrainState.initial_state(models.LinenModel(module, variables), optax.adam(1e-2), jax.random.key(0))


def test_linen_batch_stats_are_local_state_updated_every_step():
  inputs = _classification_batch(0)
  state, plan, kwargs = _planned(_make_linen_state, linen_loss, inputs)
  assert set(state.local_state) == {"batch_stats"}
  assert plan.train_state_shardings.params["Dense_0"]["kernel"].spec == P("fsdp", "tensor")
  step_fn = dt.build_train_step_fn(linen_loss, donate_params_and_state=True, **kwargs)
  means = []
  for i in range(3):
    state, aux = step_fn(state, **_classification_batch(i))
    means.append(np.asarray(state.local_state["batch_stats"]["BatchNorm_0"]["mean"]))
  assert not np.allclose(means[0], means[1]) and not np.allclose(means[1], means[2])
  assert not any("batch_stats" in p or "mean" in p for p in _opt_paths(state))
  for got, want in zip(
    jax.tree_util.tree_leaves(state.local_state), jax.tree_util.tree_leaves(plan.train_state_shardings.local_state)
  ):
    assert got.sharding == want
  eval_fn = dt.build_eval_step_fn(linen_eval_loss, **kwargs)
  before = means[-1]
  a, b = eval_fn(state, **inputs), eval_fn(state, **inputs)
  assert float(a["loss"]) == float(b["loss"])
  np.testing.assert_array_equal(np.asarray(state.local_state["batch_stats"]["BatchNorm_0"]["mean"]), before)


def test_linen_dropout_draws_from_the_step_key():
  inputs = _classification_batch(0)
  state = _make_linen_state()
  step_fn = dt.build_train_step_fn(linen_loss)
  _, first = step_fn(state, **inputs)
  _, replay = step_fn(state, **inputs)
  _, next_step = step_fn(state.replace(step=1), **inputs)
  assert float(first["loss"]) == float(replay["loss"]) != float(next_step["loss"])


def test_linen_model_needs_a_params_collection():
  with pytest.raises(ValueError, match="needs a 'params' collection; the variables have \\['batch_stats'\\]"):
    models.LinenModel(LinenBNModel(), {"batch_stats": {}})


# --- pure dicts for checkpoints ---------------------------------------------


class Stack(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(3)])


def test_nnx_pure_dict_round_trip_through_orbax_keeps_integer_keys(tmp_path):
  import orbax.checkpoint as ocp

  state = dt.TrainState.initial_state(Stack(nnx.Rngs(0)), optax.sgd(0.1), jax.random.key(0))
  pure = models.to_pure_dict(state.params)
  assert list(pure["layers"]) == [0, 1, 2]
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "params", pure)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "params")
  assert list(restored["layers"]) == ["0", "1", "2"]  # what a checkpoint gives back
  params = models.from_pure_dict(state.params, restored)
  assert list(models.to_pure_dict(params)["layers"]) == [0, 1, 2]
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(state.params)):
    np.testing.assert_array_equal(a, b)
  assert isinstance(params, nnx.State)


# --- the Llama reference model ----------------------------------------------


def _llama_batch(batch=8, length=64, seed=0):
  tokens = np.random.default_rng(seed).integers(0, 256, size=(batch, length + 1)).astype(np.int32)
  return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def _train_llama(mesh, steps, config_overrides=None, length=64):
  recipe = recipes.get("llama", "tiny", **(config_overrides or {}))
  make = lambda: dt.TrainState.initial_state(recipe.config.build(0), optax.adam(3e-3), jax.random.key(0))
  planner = dt.MeshPlanner(mesh, "fsdp_tensor")
  batch = _llama_batch(length=length)
  state, plan = planner.init(make, loss_fn=recipe.loss_fn, inputs=batch, input_axes=recipe.input_axes)
  step_fn = dt.build_train_step_fn(
    recipe.loss_fn,
    donate_params_and_state=True,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
  )
  losses = []
  with activation_sharding(plan.mesh, planner.rules):
    for _ in range(steps):
      state, aux = step_fn(state, **batch)
      losses.append(float(aux["loss"]))
  return losses, plan


def test_llama_tiny_learns_on_eight_devices_as_on_one():
  losses, plan = _train_llama(_mesh((2, 2, 2)), steps=30)
  one_device, _ = _train_llama(_mesh((1, 1, 1), devices=jax.devices()[:1]), steps=30)
  assert losses[-1] < 0.5 * losses[0]
  np.testing.assert_allclose(losses, one_device, rtol=2e-4)
  report = plan.report()
  params = plan.train_state_shardings.params
  assert _only(params["embed"]).spec == P("tensor", "fsdp")
  assert _only(params["layers"]["w_gate"]).spec == P(None, "fsdp", "tensor")
  assert _only(params["layers"]["wq"]).spec == P(None, "fsdp", "tensor", None)
  assert "(layers, embed, mlp)" in report and "P(None, 'fsdp', 'tensor')" in report
  assert "(layers, embed, heads, head_dim)" in report


def test_llama_unrolled_with_remat_matches_scanned():
  mesh = _mesh((1, 1, 1), devices=jax.devices()[:1])
  scanned, _ = _train_llama(mesh, steps=3)
  unrolled, _ = _train_llama(mesh, steps=3, config_overrides={"scan_layers": False, "remat": "full"})
  np.testing.assert_allclose(scanned, unrolled, rtol=1e-5)
  # The GPU presets' path: layers split (not indexed), logits kept for the backward pass.
  kept, _ = _train_llama(mesh, steps=3, config_overrides={"scan_layers": False, "loss_remat": False})
  np.testing.assert_allclose(scanned, kept, rtol=1e-5)


def test_llama_param_count_and_flops_follow_the_config():
  recipe = recipes.get("llama", "tiny")
  state = dt.TrainState.initial_state(recipe.config.build(0), optax.sgd(0.1), jax.random.key(0))
  assert sum(x.size for x in jax.tree_util.tree_leaves(state.params)) == recipe.config.num_params()
  c = recipe.config
  assert c.flops_per_token(128) == 6 * c.num_params() + 12 * c.num_layers * c.num_heads * c.head_dim * 128
  assert 1.2e9 < recipes.get("llama", "1b").config.num_params() < 1.5e9
  assert 6.5e9 < recipes.get("llama", "7b").config.num_params() < 7e9


def test_chunked_cross_entropy_matches_the_plain_one():
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(2, 16, 8)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 32, size=(2, 16)), jnp.int32)
  weights = jnp.ones((2, 16))
  total, count = cross_entropy.chunked_cross_entropy(hidden, head, targets, weights, chunk_size=4)
  plain = optax.softmax_cross_entropy_with_integer_labels(hidden @ head, targets).sum()
  np.testing.assert_allclose(float(total), float(plain), rtol=1e-5)
  assert float(count) == 32
  plain_grad = jax.grad(lambda h: optax.softmax_cross_entropy_with_integer_labels(h @ head, targets).sum())(hidden)
  for remat in (True, False):
    grad = jax.grad(lambda h: cross_entropy.chunked_cross_entropy(h, head, targets, weights, 4, remat=remat)[0])
    np.testing.assert_allclose(grad(hidden), plain_grad, rtol=1e-5, atol=1e-6)


def test_auto_attention_is_xla_off_gpu_and_explicit_choices_stand():
  from distrib_train.kernels.attention.dispatch import Attention, choose

  q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
  assert choose(Attention("auto"), q) == "xla"  # CPU here
  assert choose(Attention("cudnn"), q) == "cudnn"
  assert choose(Attention("xla"), q, masked=True) == "xla"
  assert choose(Attention("auto"), q, sinks=True) == "xla"
  with pytest.raises(ValueError, match="cudnn cannot run attention sinks or a soft cap"):
    choose(Attention("cudnn"), q, sinks=True)


@pytest.mark.parametrize(
  "args, kwargs, message",
  [
    (("gpt",), {}, r"Unknown model 'gpt'; known: llama, mlp"),
    (("llama", "3b"), {}, r"Unknown preset '3b' for llama; known: tiny, 124m"),
    (("llama", "tiny"), {"d_modle": 3}, r"Unknown llama config field\(s\) d_modle"),
    (("llama", "tiny"), {"num_kv_heads": 3}, r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
  ],
)
def test_models_get_rejects_unknown_names(args, kwargs, message):
  with pytest.raises(ValueError, match=message):
    recipes.get(*args, **kwargs)


def _attention_inputs(batch=4, length=128, heads=4, kv_heads=2, head_dim=16):
  rng = np.random.default_rng(0)
  q, k, v = (
    jnp.asarray(rng.normal(size=(batch, length, n, head_dim)), jnp.float32) for n in (heads, kv_heads, kv_heads)
  )
  # Two documents per row, split at a different place in each row.
  segments = jnp.asarray(np.arange(length)[None, :] >= (np.arange(batch)[:, None] * 17 + 30), jnp.int32) + 1
  return q, k, v, segments


def _xla_attention(q, k, v, segments):
  mask = segments[:, None, :, None] == segments[:, None, None, :]
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)


@pytest.mark.parametrize("sharded, kv_heads", [(False, 2), (True, 2), (True, 1)])
def test_splash_attention_equals_xla_attention_and_its_gradients(sharded, kv_heads):
  # kv_heads 1 does not split over tensor 2: each device gets copies of the key/value head.
  q, k, v, segments = _attention_inputs(kv_heads=kv_heads)
  loss = lambda attention: jax.jit(
    jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v, segments))), argnums=(0, 1, 2))
  )
  want, want_grads = loss(_xla_attention)(q, k, v)
  context = contextlib.nullcontext()
  if sharded:  # batch over data × fsdp, heads (and the 2 key/value heads) over tensor
    mesh = _mesh((2, 2, 2))
    context = activation_sharding(mesh, dt.AxisRules("fsdp_tensor"))
  with context:
    got, got_grads = loss(splash.splash_attention)(q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_llama_with_splash_attention_trains_as_with_xla_attention():
  splash, _ = _train_llama(_mesh((2, 2, 2)), steps=3, config_overrides={"attention": "splash"}, length=128)
  xla, _ = _train_llama(
    _mesh((1, 1, 1), devices=jax.devices()[:1]), steps=3, config_overrides={"attention": "xla"}, length=128
  )
  np.testing.assert_allclose(splash, xla, rtol=2e-5)
