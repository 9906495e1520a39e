"""LoRA adapters on the reference decoder: the config, the adapted projection against its merged weight, and
a sharded run where only the adapters train (the base frozen, laid out by its axes, out of the optimizer)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distrib_train as dt
from distrib_train.recipes import lora
from distrib_train.recipes.llama import PRESETS
from distrib_train.config import run as config_lib
from distrib_train.config import job as job_lib
from distrib_train.common.yaml_loader import ConfigError


def test_model_lora_is_read_from_yaml_and_set(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("model:\n  name: llama\n  preset: tiny\n  lora: {rank: 8, alpha: 32, targets: [q, v]}\n")
  config = config_lib.load(str(path), ["model.lora.alpha=16"])
  model = config.model_recipe().config
  assert (model.lora_rank, model.lora_alpha, model.lora_targets) == (8, 16.0, ("q", "v"))
  again = config_lib.build(config_lib.read_yaml(path) | {}, {})
  assert again.model_recipe().config.lora_rank == 8


@pytest.mark.parametrize(
  "sets, message",
  [
    (["model.lora.rank=-1"], "must be at least 0"),
    (["model.lora.rank=4", "model.lora.targets=q,x"], r"lora.targets names \['x'\]"),
    (["model.lora.rank=4", "model.lora.dropout=1.0"], r"0 ≤ p < 1, got 1.0"),
  ],
)
def test_bad_lora_settings_are_refused_by_name(sets, message):
  with pytest.raises((ConfigError, ValueError), match=message):
    config_lib.load("tiny", sets).model_recipe()


def _model(**changes):
  import dataclasses

  return dataclasses.replace(PRESETS["tiny"], **changes).build(0)


def test_an_adapted_projection_equals_its_merged_weight():
  """The decoder with adapters (B made non-zero) gives the logits of the same decoder without adapters whose
  weights are ``lora.merged``'s; a new adapter (B = 0) changes nothing."""
  adapted = _model(lora_rank=4, lora_alpha=8.0)
  plain = _model()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 32)), jnp.int32)
  stack = adapted.layers
  base = {name: stack[name][...] for name in stack if not name.startswith("lora_")}
  base_logits = _with(plain, adapted, base)(tokens)
  np.testing.assert_allclose(np.asarray(adapted.logits(adapted(tokens))), np.asarray(base_logits), atol=1e-6)
  key = jax.random.key(1)
  for name in list(stack):
    if name.startswith("lora_b_"):
      key, sub = jax.random.split(key)
      stack[name][...] = jax.random.normal(sub, stack[name].shape) * 0.1
  merged = lora.merged(adapted.config, base, {name: stack[name][...] for name in stack})
  want = _with(plain, adapted, merged)(tokens)
  got = adapted.logits(adapted(tokens))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
  assert float(jnp.abs(got - base_logits).max()) > 1e-3  # the adapters matter


def test_adapters_off_is_an_argument_of_the_trace_and_runs_the_base_alone():
  """``adapters=False`` (a preference objective's reference) is part of the traced call: one jitted function
  traces twice, the program without adapters has fewer matmuls, and it gives the base model's hidden states."""
  from flax import nnx

  adapted, plain = _model(lora_rank=4, lora_alpha=8.0), _model()
  for name in list(adapted.layers):
    if name.startswith("lora_b_"):
      adapted.layers[name][...] = jnp.full(adapted.layers[name].shape, 0.1)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
  traces = []

  def hidden(model, tokens, adapters):
    traces.append(adapters)
    return model.hidden_and_aux(tokens, adapters=adapters)[0]

  step = nnx.jit(hidden, static_argnums=2)
  on, off = step(adapted, tokens, True), step(adapted, tokens, False)
  assert traces == [True, False] and np.abs(np.asarray(on) - np.asarray(off)).max() > 1e-3
  step(adapted, tokens, False)
  assert traces == [True, False]  # each switch's program is kept, none is baked into the other
  graph, params = nnx.split(adapted)
  lowered = {
    a: jax.jit(lambda p, t, a=a: nnx.merge(graph, p).hidden_and_aux(t, adapters=a)[0]).lower(params, tokens).as_text()
    for a in (True, False)
  }
  assert lowered[True].count("dot_general") > lowered[False].count("dot_general")
  _with(plain, adapted, {name: value[...] for name, value in adapted.layers.items() if not lora.is_adapter(name)})
  np.testing.assert_allclose(np.asarray(off), np.asarray(plain.hidden_and_aux(tokens)[0]), atol=1e-6)


def test_adapter_dropout_drops_the_adapters_inputs_in_training_only():
  """``lora.dropout``: a training pass (a key given) drops each adapter's inputs, with a mask per key; the base
  projections see every input, so with the adapters off nothing changes; ``model.eval()`` drops nothing."""
  model = _model(lora_rank=4, lora_alpha=8.0, lora_dropout=0.5)
  for name in list(model.layers):
    if name.startswith("lora_b_"):
      model.layers[name][...] = jnp.full(model.layers[name].shape, 0.1)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
  run = lambda key: np.asarray(model.hidden_and_aux(tokens, dropout_rng=key)[0])
  plain, one, two = run(None), run(jax.random.key(1)), run(jax.random.key(2))
  assert np.abs(one - plain).max() > 1e-3 and np.abs(one - two).max() > 1e-3
  np.testing.assert_array_equal(one, run(jax.random.key(1)))  # the step's key decides the masks
  off = lambda key: np.asarray(model.hidden_and_aux(tokens, dropout_rng=key, adapters=False)[0])
  np.testing.assert_array_equal(off(None), off(jax.random.key(1)))
  from distrib_train import microbatches as microbatching

  stages = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
  with (
    microbatching.pipelining(microbatching.Pipelining(stages, 2)),
    pytest.raises(ValueError, match="lora.dropout does not run with a stage axis"),
  ):
    run(jax.random.key(1))
  model.eval()
  np.testing.assert_array_equal(run(jax.random.key(1)), plain)
  dropped = np.asarray(lora._dropped(jnp.ones((200_000,)), jnp.uint32(7), "wq", 0.25))
  assert set(np.unique(dropped)) == {0.0, np.float32(1 / 0.75)} and abs((dropped == 0).mean() - 0.25) < 0.01


def _with(plain, adapted, weights):
  """``plain`` with ``adapted``'s embedding, norms and head and ``weights`` in its stack: its logits function."""
  plain.embed[...], plain.final_norm[...] = adapted.embed[...], adapted.final_norm[...]
  if hasattr(adapted, "head"):
    plain.head[...] = adapted.head[...]
  for name, value in weights.items():
    if name in plain.layers:
      plain.layers[name][...] = value
  return lambda tokens: plain.logits(plain(tokens))


def test_only_the_adapters_train_sharded_as_on_one_device():
  """With the adapters' dropout on: each step's masks are the same on every mesh."""
  config = config_lib.load(
    "tiny",
    [
      "model.lora.rank=4",
      "model.lora.dropout=0.1",
      "train.compilation_cache_dir=",
      "optimizer.name=adamw",
      "optimizer.learning_rate=1e-2",
    ],
  )
  job = job_lib.job_spec(config)
  recipe = config.model_recipe()
  assert all(
    "lora_" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(job.abstract_state.params)[0]
  )
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), devices=jax.devices()[:8])
  plan = job_lib.plan_job(job, dt.MeshPlanner(mesh, job_lib.rules_for(config, dt.MeshConfig(("data",), (8,)))))
  frozen = {e.path: e.spec for e in plan.entries if e.group == "model_without_params"}
  assert any(spec != jax.sharding.PartitionSpec() for spec in frozen.values()), frozen
  adapter_bytes = sum(np.prod(x.shape) * 4 for x in jax.tree_util.tree_leaves(job.abstract_state.params))
  opt_bytes = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(job.abstract_state.opt_state))
  frozen_bytes = sum(np.prod(x.shape) * 4 for x in jax.tree_util.tree_leaves(job.abstract_state.model_without_params))
  # adam's two moments of the adapters (and its counts and schedule), not of the model's
  assert 2 * adapter_bytes <= opt_bytes <= 2 * adapter_bytes + 1024 and frozen_bytes > 5 * adapter_bytes
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (8, 33)).astype(np.int32)
  batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((8, 32), np.float32)}
  sharded_step = dt.build_train_step_fn(
    recipe.loss_fn,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings={k: plan.input_kwarg_shardings[k] for k in batch},
  )
  one_step = dt.build_train_step_fn(recipe.loss_fn)
  sharded, single = plan.init(job.make_state), job.make_state()
  # the frozen base against its own sharded start (jax 0.10 initialises a sharded state an ulp apart)
  frozen_before = [np.asarray(x) for x in jax.tree_util.tree_leaves(sharded.model_without_params)]
  for _ in range(3):
    sharded, aux = sharded_step(sharded, **batch)
    single, want = one_step(single, **batch)
    np.testing.assert_allclose(float(aux["loss"]), float(want["loss"]), rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(sharded.params), jax.tree_util.tree_leaves(single.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  for before, after in zip(frozen_before, jax.tree_util.tree_leaves(sharded.model_without_params)):
    np.testing.assert_array_equal(before, np.asarray(after))
  assert any(float(np.abs(np.asarray(x)).max()) > 0 for name, x in _named(sharded.params) if "lora_b" in name)


def _named(tree):
  return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
