"""``train.objective: dpo``: preference records packed as pairs of segments, the DPO / SimPO / ORPO losses equal to
their formulas on each sequence scored alone, sharded equal to one device, and a run that resumes exactly."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jinja2")

import distrib_train as dt  # noqa: E402
from distrib_train import data  # noqa: E402
from distrib_train.data.chat import CHATML, ChatEncoder, ChatTemplate, Utf8Bytes  # noqa: E402
from distrib_train.data.preference import encode_pair  # noqa: E402
from distrib_train.objectives import dpo as objectives  # noqa: E402
from distrib_train.config import run as config_lib  # noqa: E402
from distrib_train.config import job as job_lib  # noqa: E402


def _records(n=48, seed=0):
  """Preference records in the three forms: text prompt and completions, messages and completions as turns,
  and two whole conversations."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    question = f"Question {i}: " + "why " * int(rng.integers(1, 12))
    good, bad = "Because " + "so " * int(rng.integers(1, 10)), "No" + "!" * int(rng.integers(1, 20))
    turn = lambda text: [{"role": "assistant", "content": text}]
    asked = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": question}]
    if i % 3 == 0:
      out.append({"prompt": question, "chosen": good, "rejected": bad})
    elif i % 3 == 1:
      out.append({"messages": asked, "chosen": turn(good), "rejected": turn(bad)})
    else:
      out.append({"chosen": asked + turn(good), "rejected": asked + turn(bad)})
  return out


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
  root = tmp_path_factory.mktemp("dpo")
  (root / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
  return root / "prefs.jsonl"


def _shardings(config):
  from jax.sharding import NamedSharding, PartitionSpec

  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  return {k: NamedSharding(mesh, PartitionSpec("data")) for k in data.DataLoader.batch_schema(config)}


def _config(prefs, *overrides):
  return config_lib.load(
    "tiny",
    [
      "train.objective=dpo",
      "data.source=text",
      f"data.paths={prefs}",
      "data.text_field=*",
      "data.seq_len=512",
      "data.global_batch_size=4",
      "data.eval_fraction=0",
      "model.dtype=float32",
      "model.attention=xla",
      *overrides,
    ],
  )


def _pairs(batch):
  """Each row's pairs: (chosen ids, chosen weights, rejected ids, rejected weights), each weight as long as its
  ids less one (a half that ends the row has its last token as the row's last target)."""
  out = []
  for tokens, targets, weights, segments, positions in zip(
    *(batch[k] for k in ("tokens", "targets", "weights", "segment_ids", "positions"))
  ):
    for k in range(1, segments.max() // 2 + 1):
      halves = []
      for s in (2 * k - 1, 2 * k):
        where = np.flatnonzero(segments == s)
        np.testing.assert_array_equal(positions[where], np.arange(len(where)))  # each half from position 0
        if where[-1] == len(tokens) - 1:
          halves += [np.append(tokens[where], targets[where[-1]]), weights[where]]
        else:  # its last input predicts the next segment's first token: weight 0
          assert weights[where[-1]] == 0
          halves += [tokens[where], weights[where[:-1]]]
      out.append(tuple(halves))
  return out


def test_preference_records_are_packed_as_two_segments_their_completions_scored(prefs):
  config = _config(prefs).data_config()
  assert config.pairs and config.loss_on == "completion"
  encoder = ChatEncoder(ChatTemplate(CHATML, "chatml"), Utf8Bytes(), "completion")
  want = {}
  for record in _records():
    (c, cm), (r, rm) = encode_pair(encoder, record)
    want[tuple(c.tolist()) + tuple(r.tolist())] = (cm, rm)
  seen = 0
  with data.DataLoader(config, _shardings(config)) as loader:
    for _ in range(3):
      pairs = _pairs(loader.next_local())
      assert len(pairs) >= 4  # one to three a row
      for chosen, chosen_w, rejected, rejected_w in pairs:
        key = tuple(chosen.tolist()) + tuple(rejected.tolist())
        assert key in want, "a packed pair that is no record's"
        chosen_mask, rejected_mask = want[key]
        np.testing.assert_array_equal(chosen_w, chosen_mask[1:].astype(np.float32))
        np.testing.assert_array_equal(rejected_w, -rejected_mask[1:].astype(np.float32))
        assert chosen_mask.any() and rejected_mask.any()
        seen += 1
  assert seen >= 15


@pytest.mark.parametrize(
  "record, message",
  [
    ({"prompt": "hi", "chosen": "a"}, "holds 'chosen' and 'rejected'"),
    ({"chosen": "a", "rejected": "b"}, "needs a 'prompt'"),
    ({"prompt": "hi", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}, "both text or both"),
  ],
)
def test_bad_preference_records_are_refused_by_name(record, message):
  encoder = ChatEncoder(ChatTemplate(CHATML, "chatml"), Utf8Bytes(), "completion")
  with pytest.raises(ValueError, match=message):
    encode_pair(encoder, record)


@pytest.mark.parametrize(
  "sets, message",
  [
    (["dpo.loss=ipo"], "dpo.loss='ipo'; choose sigmoid, simpo, orpo"),
    (["dpo.beta=0"], "dpo.beta must be positive"),
    (["dpo.reference=/tmp"], "give hf:<a Hugging Face directory> or ckpt:<a distrib_train run>"),
    (["dpo.reference=ckpt:/no/such/run", "train.init_from=hf:/tmp"], "'/no/such/run' is not a directory"),
    (["train.objective=rl"], "train.objective must be one of lm, dpo"),
    (["data.packing=false"], "data.packing=true"),
    (["data.loss_on=assistant"], "data.loss_on=completion"),
    (["train.objective=lm", "dpo.beta=0.5"], "The dpo section is read with train.objective: dpo"),
    (["dpo.loss=simpo", "dpo.precompute_reference=true"], "are read by dpo.loss=sigmoid"),
    (["dpo.reference=hf:/tmp"], "set train.init_from too"),
  ],
)
def test_bad_dpo_settings_are_refused_by_name(prefs, sets, message):
  with pytest.raises(config_lib.ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
    _config(prefs, *sets)


def _alone(model, ids, mask):
  """A sequence's summed log-probabilities of its scored targets, the model run on it alone (full logits)."""
  logits = model.logits(model(jnp.asarray(ids[None, :-1])))
  logps = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))[0]
  per_target = logps[np.arange(len(ids) - 1), ids[1:]]
  return float(np.sum(per_target[mask[1:]], dtype=np.float64)), int(mask[1:].sum())


@pytest.mark.parametrize("loss", ["sigmoid", "simpo", "orpo"])
def test_the_loss_is_the_formula_on_each_sequence_scored_alone(prefs, loss):
  """Packed rows through the objective equal each pair's sequences run alone (fp32): DPO with a reference of other
  weights, SimPO and ORPO without."""
  config = _config(prefs, f"dpo.loss={loss}", "dpo.beta=0.5")
  settings, model_config = config.dpo, config.model_recipe().config
  policy, reference = model_config.build(0), model_config.build(1)
  model = objectives.Preference(policy, reference) if loss == "sigmoid" else policy
  data_config = config.data_config()
  with data.DataLoader(data_config, _shardings(data_config)) as loader:
    batch = loader.next_local()
  ours, aux = objectives.dpo_loss_fn(settings)(
    model=model, state=None, rng=None, **{k: jnp.asarray(v) for k, v in batch.items()}
  )[::2]
  encoder = ChatEncoder(ChatTemplate(CHATML, "chatml"), Utf8Bytes(), "completion")
  by_ids = {}
  for record in _records():
    (c, cm), (r, rm) = encode_pair(encoder, record)
    by_ids[tuple(c.tolist()) + tuple(r.tolist())] = ((c, cm), (r, rm))
  losses, margins = [], []
  for chosen, _, rejected, _ in _pairs(batch):
    (c, cm), (r, rm) = by_ids[tuple(chosen.tolist()) + tuple(rejected.tolist())]
    (pw, nw), (pl, nl) = _alone(policy, c, cm), _alone(policy, r, rm)
    if loss == "sigmoid":
      h = 0.5 * ((pw - _alone(reference, c, cm)[0]) - (pl - _alone(reference, r, rm)[0]))
      losses.append(-math.log(1 / (1 + math.exp(-h))))
    elif loss == "simpo":
      h = 0.5 * (pw / nw - pl / nl) - settings.simpo_gamma
      losses.append(-math.log(1 / (1 + math.exp(-h))))
    else:
      odds = lambda a: a - math.log1p(-math.exp(a))
      ratio = odds(pw / nw) - odds(pl / nl)
      losses.append(-pw / nw - settings.orpo_lambda * math.log(1 / (1 + math.exp(-ratio))))
    margins.append(h if loss != "orpo" else 0.5 * (pw / nw - pl / nl))
  assert int(aux["pairs"]) == len(losses) >= 4
  np.testing.assert_allclose(float(ours), np.mean(losses), rtol=2e-5)
  np.testing.assert_allclose(
    float(aux["rewards/margin"]), np.mean(margins) + (settings.simpo_gamma if loss == "simpo" else 0), rtol=2e-4
  )


def test_dpo_sharded_equals_one_device_and_the_reference_stays_frozen(prefs):
  """The policy and its frozen reference copy on 8 devices (the reference laid out by the params' axes, out of the
  optimizer) take the steps one device takes; with LoRA the reference is the model with its adapters off, so a
  new adapter's loss is log 2."""
  config = _config(prefs, "data.global_batch_size=8", "optimizer.name=adamw", "optimizer.learning_rate=1e-2")
  job = job_lib.job_spec(config)
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), devices=jax.devices()[:8])
  plan = job_lib.plan_job(job, dt.MeshPlanner(mesh, job_lib.rules_for(config, dt.MeshConfig(("data",), (8,)))))
  frozen = {e.path: e.spec for e in plan.entries if e.group == "model_without_params"}
  assert any(spec != jax.sharding.PartitionSpec() for spec in frozen.values()), frozen
  params = lambda tree: sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree))
  assert params(job.abstract_state.model_without_params) == params(job.abstract_state.params)
  data_config = config.data_config()
  with data.DataLoader(data_config, _shardings(data_config)) as loader:
    batches = [loader.next_local() for _ in range(3)]
  sharded_step = dt.build_train_step_fn(
    job.loss_fn, train_state_shardings=plan.train_state_shardings, input_kwarg_shardings=plan.input_kwarg_shardings
  )
  one_step = dt.build_train_step_fn(job.loss_fn)
  sharded, single = plan.init(job.make_state), job.make_state()
  frozen_before = [np.asarray(x) for x in jax.tree_util.tree_leaves(sharded.model_without_params)]
  for i, batch in enumerate(batches):
    sharded, aux = sharded_step(sharded, **batch)
    single, want = one_step(single, **batch)
    if i == 0:  # the policy starts as its reference
      np.testing.assert_allclose(float(aux["loss"]), math.log(2), rtol=1e-6)
    # Every reward is 0 until the first update (the schedule's first rate is 0), up to rounding: accuracy then
    # breaks ties, and rounding differs by layout. The margin is beta times a difference of two sequences'
    # log-probability sums (hundreds in size), whose float32 rounding by layout reached 1.3e-6 on a CI run
    # (0 against -1.26e-6): its absolute tolerance is 1e-5, a tenth of a percent of the margin it must reach.
    for key in ("loss", "rewards/margin", "pairs") + (("rewards/accuracy",) if i == 2 else ()):
      atol = 1e-5 if key == "rewards/margin" else 1e-6
      np.testing.assert_allclose(float(aux[key]), float(want[key]), rtol=1e-5, atol=atol, err_msg=key)
  assert float(aux["rewards/margin"]) > 0.1
  for a, b in zip(jax.tree_util.tree_leaves(sharded.params), jax.tree_util.tree_leaves(single.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  for before, after in zip(frozen_before, jax.tree_util.tree_leaves(sharded.model_without_params)):
    np.testing.assert_array_equal(before, np.asarray(after))

  lora = job_lib.job_spec(
    _config(
      prefs, "data.global_batch_size=8", "model.lora.rank=4", "optimizer.name=adamw", "optimizer.learning_rate=1e-2"
    )
  )
  assert params(lora.abstract_state.params) < params(lora.abstract_state.model_without_params) / 5  # no copy
  step, state = dt.build_train_step_fn(lora.loss_fn), lora.make_state()
  for i, batch in enumerate(batches):
    state, aux = step(state, **batch)
    if i == 0:
      np.testing.assert_allclose(float(aux["loss"]), math.log(2), rtol=1e-6)
  assert float(aux["rewards/margin"]) > 0.01  # the adapters moved the policy away from the base


def test_a_dpo_run_resumes_exactly_and_evaluates_by_pairs(prefs, tmp_path, xla_cache):
  """Straight against stopped and resumed, bit for bit: the frozen reference is not in the checkpoint, which
  names its source (the ``init_from: hf:`` directory) and reads it again, from where its files are now, and
  refuses it changed; the held-out figures are means over pairs; the export writes the policy alone; a
  reference precomputed in one pass (kept beside the data, no copy in the state) trains as the live one."""
  import shutil

  from flax import nnx

  from distrib_train.checkpoint import checks, hf
  from distrib_train.weights import export
  from distrib_train.train.trainer import Trainer, TrainerSetupError

  model_config = _config(prefs).model_recipe().config
  base_weights = nnx.state(model_config.build(1), nnx.Param)  # not the runs' own start (seed 0)
  start = hf.hf_tensors(base_weights, model_config)  # the reference's weights
  hf.save(base_weights, model_config, str(tmp_path / "base"))
  sets = lambda steps, *more, base=tmp_path / "base", init="": _config(
    prefs,
    f"train.steps={steps}",
    "train.log_every=1",
    "data.eval_fraction=0.25",
    "train.eval_batches=1",
    "train.async_checkpoint=false",
    f"train.compilation_cache_dir={xla_cache}",
    "optimizer.learning_rate=1e-2",
    f"train.init_from={init or ('hf:' * bool(base)) + str(base or '')}",
    *more,
  )
  run = lambda workdir, steps, *more, **kw: Trainer(sets(steps, *more, **kw), workdir, console=False).run()
  run(tmp_path / "straight", 4)
  run(tmp_path / "split", 2)
  run(tmp_path / "split", 4)
  read = lambda w: [json.loads(line) for line in (w / "metrics.jsonl").read_text().splitlines()]
  straight, split = read(tmp_path / "straight"), read(tmp_path / "split")
  train = lambda log: {m["step"]: (m["loss"], m["rewards/margin"]) for m in log if "loss" in m}
  assert train(straight) == train(split) and sorted(train(straight)) == [1, 2, 3, 4]
  saved = tmp_path / "split" / "checkpoints"
  assert checks.held_fields(checks.read_meta(saved, 4)) == (
    "step",
    "root_rng",
    "params",
    "opt_state",
    "loss_fn_state",
    "local_state",
  )
  assert not [k for k in checks.saved_shapes(saved, 4) if k[0] == "model_without_params"]
  shutil.copytree(tmp_path / "base", tmp_path / "moved")
  (tmp_path / "base").rename(tmp_path / "gone")
  with pytest.raises(
    TrainerSetupError, match=r"frozen weights \(init_from\) are read from their source, and \S*base is missing\."
  ):
    run(tmp_path / "split", 5, base="")
  shutil.copytree(tmp_path / "moved", tmp_path / "changed")
  with open(tmp_path / "changed" / "model.safetensors", "r+b") as f:
    f.seek(os.path.getsize(f.name) // 2)
    f.write(b"\x7f" * 64)
  with pytest.raises(TrainerSetupError, match=r"base is missing; \S*changed differs: model.safetensors\."):
    run(tmp_path / "split", 5, base=tmp_path / "changed")
  run(tmp_path / "split", 5, base=tmp_path / "moved")  # the same files elsewhere
  assert [m["step"] for m in read(tmp_path / "split") if "loss" in m][-1] == 5
  (tmp_path / "gone").rename(tmp_path / "base")
  # Another run from this one's checkpoint (ckpt:): its policy, and the reference read from the recorded base.
  from distrib_train.weights import init_from

  fresh = job_lib.job_spec(sets(4)).make_state()
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x, fresh
  )
  from_base = init_from.load(sets(4), abstract, fresh)[0]
  from_run = init_from.load(sets(4, init=f"ckpt:{tmp_path / 'split'}"), abstract, fresh)[0]
  differs = lambda a, b: any(
    np.abs(np.asarray(x) - np.asarray(y)).max() > 0 for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
  for got, want in zip(*(jax.tree.leaves(s.model_without_params) for s in (from_run, from_base))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert differs(from_run.model_without_params, fresh.model_without_params)  # the base, not the seed's start
  assert differs(from_run.params, from_base.params)  # the run's trained policy
  # An SFT run's checkpoint (the bare model): ckpt: fills the policy and the reference (the starting model);
  # dpo.reference: ckpt: reads the reference alone from it; a LoRA run's adapters are refused as a reference.
  from distrib_train.checkpoint.manager import CheckpointManager
  from distrib_train.checkpoint.tree import flatten_fields

  sft = job_lib.job_spec(
    config_lib.load("tiny", ["model.dtype=float32", "model.attention=xla", "train.seed=2"])
  ).make_state()
  with CheckpointManager(tmp_path / "sft" / "checkpoints", async_save=False) as manager:
    manager.save(1, sft)
  model = lambda state, role: {
    k[k.index(role) + 1 :]: v
    for k, v in flatten_fields(state, ("params", "model_without_params")).items()
    if role in k[1:3]
  }
  want = {k[1:]: np.asarray(v) for k, v in flatten_fields(sft, ("params",)).items()}
  for init, reference, roles in (
    (f"ckpt:{tmp_path / 'sft'}", "", ("policy", "reference")),
    ("", f"ckpt:{tmp_path / 'sft'}", ("reference",)),
  ):
    config = sets(4, f"dpo.reference={reference}", init=init)
    init_from.check(config, abstract)
    loaded = init_from.load(config, abstract, fresh)[0]
    for role in roles:
      got = model(loaded, role)
      assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want), role
  assert not differs(model(loaded, "policy"), model(from_base, "policy"))  # the policy from hf:base
  lora = tmp_path / "lora" / "checkpoints"
  with CheckpointManager(lora, async_save=False) as manager:
    manager.save(1, job_lib.job_spec(config_lib.load("tiny", ["model.lora.rank=2"])).make_state())
  with pytest.raises(ValueError, match=r"is a LoRA run's: its params are adapters .* export"):
    init_from.check(sets(4, f"dpo.reference=ckpt:{lora}"), abstract)

  from distrib_train.posttrain import reference_pass

  kept = reference_pass.path_for(sets(4, "dpo.precompute_reference=true"))
  assert kept.startswith(str(prefs.parent)) and not os.path.exists(kept)
  run(tmp_path / "precomputed", 4, "dpo.precompute_reference=true")
  assert os.path.exists(kept)
  job = job_lib.job_spec(sets(4, "dpo.precompute_reference=true"))
  assert not jax.tree_util.tree_leaves(job.abstract_state.model_without_params)  # no reference copy
  precomputed = train(read(tmp_path / "precomputed"))
  for step, (loss, margin) in train(straight).items():
    # a margin is β × a difference of sums of ~200 log-probabilities: float32 rounds it by ~2e-6
    np.testing.assert_allclose(precomputed[step], (loss, margin), rtol=1e-5, atol=1e-5, err_msg=str(step))
  evals = [m for m in straight if "eval/loss" in m]
  assert evals and evals[-1]["eval/pairs"] > 0 and "eval/perplexity" not in evals[-1]
  assert "eval/rewards/accuracy" in evals[-1]
  export.export(tmp_path / "straight", str(tmp_path / "hf"))
  written = hf.SafetensorsDirectory(str(tmp_path / "hf"))
  assert sorted(written.tensors) == sorted(start)
  name = "model.layers.0.self_attn.q_proj.weight"
  assert np.abs(written.read(name) - start[name]).max() > 1e-4  # the trained policy, not the reference


def test_sft_and_dpo_in_two_processes_take_one_processs_steps(prefs):
  """2 real processes × 4 devices, the data axis across them and each process reading its own rows, against one
  process with 8: the same SFT (through LoRA adapters with dropout: the same masks) and DPO losses and figures,
  step by step (fp32)."""
  import pathlib

  import helpers
  import mp_harness

  results = mp_harness.run_workers(
    pathlib.Path(__file__).parent / "workers" / "post_training_worker.py", str(prefs), timeout=300
  )
  mesh = dt.build_mesh(dt.MeshConfig.from_yaml(pathlib.Path(__file__).parents[1] / "mesh_configs" / "cpu-8.yaml"))
  want = {
    "sft": helpers.post_training_losses(
      [
        "data.source=pydoc",
        "data.loss_on=assistant",
        "model.lora.rank=4",
        "model.lora.dropout=0.1",
        "data.seq_len=512",
        "data.global_batch_size=8",
      ],
      mesh,
    ),
    "dpo": helpers.post_training_losses(
      [
        "train.objective=dpo",
        "data.source=text",
        f"data.paths={prefs}",
        "data.text_field=*",
        "data.seq_len=512",
        "data.global_batch_size=8",
      ],
      mesh,
    ),
  }
  assert want["dpo"][-1]["rewards/margin"] > 0.05 and want["sft"][-1]["loss"] < want["sft"][0]["loss"]
  for r in results:
    for name, steps in want.items():
      for i, figures in enumerate(steps):
        for key in ("loss", "tokens") + (("rewards/margin", "pairs") if name == "dpo" else ()):
          np.testing.assert_allclose(
            r.result[name][i][key], figures[key], rtol=2e-5, atol=1e-6, err_msg=f"{name} step {i + 1} {key}"
          )
