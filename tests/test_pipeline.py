"""Microbatches (gradient accumulation) and the pipeline (a stage mesh axis), proven against one device."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distrib_train as dt
import mp_harness
import pipeline_helpers as ph
from distrib_train import microbatches as microbatching
from distrib_train.parallel import layer_stack

_WORKERS = pathlib.Path(__file__).resolve().parent / "workers"
RTOL = 1e-4


@pytest.fixture(scope="session")
def one_device():
  """The reference: 10 steps on one device, the whole batch at once."""
  return ph.train(ph.mesh_of({}, devices=jax.devices()[:1]))


def _close_losses(got, want):
  np.testing.assert_allclose(got, want, rtol=RTOL)


def _close_params(got, want, atol=2e-5):
  assert got.keys() == want.keys()
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=atol, err_msg=name)


# --- gradient accumulation ----------------------------------------------------------------------------------


def test_gradient_accumulation_matches_the_whole_batch(one_device):
  losses, params = ph.train(ph.mesh_of({}, devices=jax.devices()[:1]), microbatches=4)
  _close_losses(losses, one_device[0])
  _close_params(params, one_device[1])


def test_gradient_accumulation_on_a_sharded_mesh(one_device):
  losses, params = ph.train(ph.mesh_of({"data": 2, "fsdp": 2, "tensor": 2}), microbatches=2)
  _close_losses(losses, one_device[0])
  _close_params(params, one_device[1])


def test_accumulation_weighted_by_tokens_is_exact_for_packed_rows_of_unequal_length():
  mesh = ph.mesh_of({}, devices=jax.devices()[:1])
  whole = ph.train(mesh, steps=4, packed=True)
  weighted = ph.train(mesh, steps=4, microbatches=4, packed=True)
  equal = ph.train(mesh, steps=4, microbatches=4, packed=True, weight=None)
  _close_losses(weighted[0], whole[0])
  # Weighing microbatches equally averages per-microbatch means: not the batch's per-token mean.
  assert abs(equal[0][0] - whole[0][0]) > 1e-5 * abs(whole[0][0])


def _counting_loss(*, model, state, rng, x, y):
  pred = x @ model["w"]
  loss = jnp.mean((pred - y) ** 2)
  return (
    loss,
    state + 1,
    {
      "loss": loss,
      "rows": jnp.asarray(x.shape[0], jnp.int32),
      "seen": jnp.asarray(x.shape[0], jnp.float32),
      "keys": jax.random.key_data(rng)[0] * 0,
    },
  )


def test_aux_and_loss_state_are_combined_as_documented():
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(12, 3)).astype(np.float32), rng.normal(size=(12, 2)).astype(np.float32)
  state = dt.TrainState.initial_state(
    {"w": jnp.ones((3, 2))}, optax.sgd(0.1), jax.random.key(0), loss_fn_state=jnp.zeros((), jnp.int32)
  )
  one, aux1 = dt.build_train_step_fn(_counting_loss)(state, x=x, y=y)
  three, aux3 = dt.build_train_step_fn(_counting_loss, microbatches=3, microbatch_weight="seen")(state, x=x, y=y)
  assert int(three.loss_fn_state) == 3 and int(one.loss_fn_state) == 1  # threaded through every microbatch
  assert int(aux3["rows"]) == 12  # integer leaves: summed
  assert float(aux3["seen"]) == 12.0  # the weight: summed
  np.testing.assert_allclose(float(aux3["loss"]), float(aux1["loss"]), rtol=1e-6)  # floats: weighted mean
  np.testing.assert_allclose(three.params["w"], one.params["w"], rtol=1e-6)


def test_local_state_is_threaded_through_the_microbatches():
  """BatchNorm's running statistics after one 2-microbatch step are its two updates, in order."""
  from distrib_train.recipes import mlp

  config = mlp.MLPConfig()
  model = config.build(0)
  rng = np.random.default_rng(1)
  inputs = rng.normal(size=(8, config.in_features)).astype(np.float32)
  targets = rng.integers(0, config.num_classes, 8).astype(np.int32)
  state = dt.TrainState.initial_state(model, optax.sgd(0.0), jax.random.key(0))
  new, _ = dt.build_train_step_fn(mlp.loss_fn, microbatches=2)(state, inputs=inputs, targets=targets)

  reference = config.build(0)
  reference.train()
  reference(jnp.asarray(inputs[0::2]))  # microbatch 0: rows 0, 2, 4, 6
  reference(jnp.asarray(inputs[1::2]))
  np.testing.assert_allclose(
    np.asarray(new.local_state["norm"]["mean"][...]), reference.norm.mean[...], rtol=1e-5, atol=1e-7
  )


def test_a_batch_that_does_not_split_is_refused_naming_the_input():
  state = dt.TrainState.initial_state(
    {"w": jnp.ones((3, 2))}, optax.sgd(0.1), jax.random.key(0), loss_fn_state=jnp.zeros((), jnp.int32)
  )
  with pytest.raises(ValueError, match=r"Input 'x' has shape \(10, 3\).*4 microbatches"):
    dt.build_train_step_fn(_counting_loss, microbatches=4)(
      state, x=np.zeros((10, 3), np.float32), y=np.zeros((10, 2), np.float32)
    )


def test_microbatch_temporaries_shrink_with_the_microbatch_count():
  from distrib_train.recipes import llama

  cfg = ph.tiny_config(vocab_size=4096, d_model=128, mlp_dim=512)
  state = dt.TrainState.initial_state(cfg.build(0), optax.adam(1e-3), jax.random.key(0))
  abstract = jax.eval_shape(lambda: state)
  batch = {"tokens": jax.ShapeDtypeStruct((64, 256), jnp.int32), "targets": jax.ShapeDtypeStruct((64, 256), jnp.int32)}
  temps = {
    n: dt.build_train_step_fn(llama.loss_fn, microbatches=n)
    .compile(abstract, **batch)
    .memory_analysis()
    .temp_size_in_bytes
    for n in (1, 4)
  }
  assert temps[4] < 0.5 * temps[1], temps


# --- the pipeline -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "axes", [{"stage": 2, "fsdp": 2, "tensor": 2}, {"stage": 2, "fsdp": 4}], ids=["stage2-fsdp2-tensor2", "stage2-fsdp4"]
)
def test_pipeline_matches_one_device(one_device, axes):
  losses, params = ph.train(ph.mesh_of(axes), microbatches=4)
  _close_losses(losses, one_device[0])
  _close_params(params, one_device[1])


def test_circular_pipeline_matches_one_device():
  reference = ph.train(ph.mesh_of({}, devices=jax.devices()[:1]), num_layers=4)
  losses, params = ph.train(ph.mesh_of({"stage": 2, "fsdp": 2, "tensor": 2}), microbatches=4, repeats=2, num_layers=4)
  _close_losses(losses, reference[0])
  _close_params(params, reference[1])


def test_pipeline_with_unrolled_layers_and_packed_rows_matches_one_device():
  reference = ph.train(ph.mesh_of({}, devices=jax.devices()[:1]), steps=4, packed=True, scan_layers=False, num_layers=4)
  losses, _ = ph.train(
    ph.mesh_of({"stage": 4, "fsdp": 2}), steps=4, microbatches=4, packed=True, scan_layers=False, num_layers=4
  )
  _close_losses(losses, reference[0])


@pytest.mark.parametrize("repeats", [1, 2])
def test_pipeline_gradients_of_every_layer_match(repeats):
  want = ph.gradients(ph.mesh_of({}, devices=jax.devices()[:1]), packed=True, num_layers=4)
  got = ph.gradients(
    ph.mesh_of({"stage": 2, "fsdp": 2, "tensor": 2}), microbatches=4, repeats=repeats, packed=True, num_layers=4
  )
  assert {k for k in got if k.startswith("layers/")} == {k for k in want if k.startswith("layers/")}
  for name in want:
    scale = np.max(np.abs(want[name]))
    np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=1e-5 * scale, err_msg=name)


def test_pipeline_sends_stage_outputs_with_collective_permutes_and_gathers_weights_once():
  mesh = ph.mesh_of({"stage": 2, "fsdp": 2, "tensor": 2})
  cfg = ph.tiny_config(num_layers=4)
  batch = ph.batches(1)[0]
  rules, plan, _ = ph._plan(cfg, mesh, batch)
  from distrib_train.recipes import llama

  step = dt.build_train_step_fn(
    llama.loss_fn,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
    microbatches=4,
  )
  inputs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=plan.input_kwarg_shardings[k]) for k, v in batch.items()}
  with dt.activation_sharding(mesh, rules):
    text = step.compile(plan.abstract_train_state, **inputs).as_text()
  from distrib_train.podplan import hlo

  computations, _ = hlo.parse_module(text)
  times = hlo.multiplicities(computations)
  in_loops = [i.op for name, c in computations.items() if times[name] > 1 for i in c.instructions]
  assert "collective-permute" in in_loops or "collective-permute-start" in in_loops
  # The stage's weights are all-gathered over fsdp before the microbatch loop, not in it.
  assert not any(op.startswith("all-gather") for op in in_loops)
  assert step.pipelining.bubble() == pytest.approx(1 / 5)


def test_bubble_formula():
  assert microbatching.bubble_fraction(4, 8) == pytest.approx(3 / 11)
  assert microbatching.bubble_fraction(4, 8, repeats=2) == pytest.approx(3 / 19)
  assert microbatching.bubble_fraction(1, 8) == 0.0


def test_a_model_without_a_layer_stack_is_refused_on_a_stage_mesh():
  import helpers

  mesh = ph.mesh_of({"stage": 2, "fsdp": 4})
  params = helpers.init_mlp(jax.random.key(0), [8, 16, 4])
  state = dt.TrainState.initial_state(params, optax.sgd(0.1), jax.random.key(0), loss_fn_state=jnp.zeros((), jnp.int32))
  inputs = {"inputs": jnp.zeros((8, 8)), "targets": jnp.zeros((8,), jnp.int32)}
  plan = dt.MeshPlanner(mesh, dt.AxisRules("fsdp_tensor", param_axes=helpers.MLP_PARAM_AXES)).plan(
    jax.eval_shape(lambda: state),
    loss_fn=helpers.classification_loss,
    inputs=inputs,
    input_axes={"inputs": ("batch", "embed"), "targets": ("batch",)},
  )
  step = dt.build_train_step_fn(
    helpers.classification_loss,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    microbatches=2,
  )
  with pytest.raises(
    ValueError,
    match=r"stage axis of size 2.*never ran its repeated layers through"
    r" distrib_train.parallel.layer_stack",
  ):
    step(jax.device_put(state, plan.train_state_shardings), **inputs)


def test_layers_that_do_not_split_into_stages_are_refused():
  with pytest.raises(
    ValueError,
    match=r"2 stacked layers \(or periods of layers\) do not split into stage axis \(2\) × pipeline repeats \(2\)",
  ):
    ph.gradients(ph.mesh_of({"stage": 2, "fsdp": 4}), microbatches=4, repeats=2)


def test_pipeline_settings_are_checked_when_the_step_is_built():
  mesh = ph.mesh_of({"stage": 4, "fsdp": 2})
  shardings = dt.TrainState.initial_state({"w": jnp.ones(4)}, optax.sgd(0.1), jax.random.key(0))
  shardings = jax.tree_util.tree_map(
    lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), shardings
  )
  with pytest.raises(ValueError, match="needs at least as many microbatches as stages"):
    dt.build_train_step_fn(lambda **kw: None, train_state_shardings=shardings, microbatches=2, pipeline_repeats=2)
  with pytest.raises(ValueError, match="has no stage axis"):
    dt.build_train_step_fn(lambda **kw: None, microbatches=2, pipeline_repeats=2)


def test_layer_stack_without_a_pipeline_is_a_scan():
  layers = {"w": jnp.arange(6.0).reshape(3, 2)}
  out = layer_stack(
    lambda x, layer, scale: x * layer["w"] + scale, jnp.ones((4, 2)), layers, per_example={"scale": jnp.ones((4, 2))}
  )
  want = jnp.ones((4, 2))
  for i in range(3):
    want = want * layers["w"][i] + 1
  np.testing.assert_allclose(out, want)


def test_pipeline_with_the_stage_axis_across_two_processes(one_device):
  results = mp_harness.run_workers(_WORKERS / "pipeline_worker.py", "10", timeout=300)
  for r in results:
    assert r.result["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2, "stage": 2}
    _close_losses(r.result["losses"], one_device[0])


# --- the trainer: config, checkpoints across pipeline layouts ---------------------------------------------


def _trainer_losses(tmp_path, name, mesh_config, steps, cache, workdir=None):
  import io
  import json

  from distrib_train.config import run as config_lib
  from distrib_train.train.trainer import Trainer

  config = config_lib.load(
    "tiny",
    [
      "data.seq_len=32",
      "data.global_batch_size=8",
      f"train.steps={steps}",
      "train.log_every=1",
      "train.eval_every=0",
      "train.checkpoint_every=4",
      "train.async_checkpoint=false",
      "train.microbatches=2",
      f"train.compilation_cache_dir={cache}",
      "optimizer.warmup_steps=0",
      "optimizer.schedule=constant",
      f"mesh_config={mesh_config}",
    ],
  )
  workdir = workdir or tmp_path / name
  console = io.StringIO()
  result = Trainer(config, workdir, console=console).run()
  assert result.status == "finished", console.getvalue()
  lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {m["step"]: m["loss"] for m in lines if "loss" in m}, console.getvalue()


@pytest.mark.parametrize("first,then", [("cpu-8-pipeline", "cpu-8"), ("cpu-8", "cpu-8-pipeline")])
def test_a_checkpoint_moves_between_pipelined_and_plain_meshes(tmp_path, xla_cache, first, then):
  straight, _ = _trainer_losses(tmp_path, "straight", "cpu-8", 8, xla_cache)
  resumed_dir = tmp_path / "resumed"
  before, log = _trainer_losses(tmp_path, "", first, 4, xla_cache, workdir=resumed_dir)
  after, log2 = _trainer_losses(tmp_path, "", then, 8, xla_cache, workdir=resumed_dir)
  assert "Restored" in log2 or "restored" in log2, log2
  pipelined_log = log if first == "cpu-8-pipeline" else log2
  assert "Pipeline: 2 stages, 2 microbatches" in pipelined_log
  for step in range(1, 9):
    np.testing.assert_allclose(after.get(step, before.get(step)), straight[step], rtol=RTOL, err_msg=f"step {step}")


# --- planning -----------------------------------------------------------------------------------------------


def test_the_plan_reports_the_pipeline_and_recommend_sizes_the_stage_axis():
  from distrib_train.cluster import hardware
  from distrib_train.podplan import estimate, search
  from distrib_train.sharding.mesh import MeshConfig
  from distrib_train.config import run as config_lib

  config = config_lib.load("tiny", ["train.microbatches=4", "model.num_layers=4", "data.global_batch_size=32"])
  mesh_config = MeshConfig.from_dict(
    {"devices": 8, "axes": {"data": 1, "stage": 2, "fsdp": 2, "tensor": 2}, "rules": "fsdp_tensor"}
  )
  pod = estimate.plan_pod(config, mesh_config, hardware.device_kind("v5p"), 8)
  pipeline = pod.to_dict()["pipeline"]
  assert pipeline["stages"] == 2 and pipeline["microbatches"] == 4 and pipeline["schedule"] == "gpipe"
  assert pipeline["bubble_fraction"] == pytest.approx(1 / 5) and pipeline["stage_permute_bytes"] > 0
  assert "Pipeline: 2 stages, 4 microbatches, GPipe; bubble 20.0%" in pod.report()

  searched = MeshConfig.from_dict({"axes": {"data": 1, "stage": 1, "fsdp": -1, "tensor": 1}, "rules": "fsdp_tensor"})
  rec = search.recommend(config, searched, hardware.device_kind("v5p"), 8, max_compiles=1)
  # stage 8 cannot split 4 layers; stage 1, 2 and 4 can.
  assert rec.dropped["the pipeline cannot split the layers or the batch"] >= 1
  assert rec.ranked and rec.compiled == 1
