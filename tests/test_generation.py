"""Generation without a reference library: the cached decode against the model's own forward, sampling's seeds
across meshes, end ids, buckets, the CLI on a trained run, and two processes.

transformers' own ``generate`` is the reference in ``test_generation_hf.py``
(every family, on 8 devices); here the cache is checked against the
uncached forward of the same model, greedy token by token, for the variants
whose cache differs (a sliding window's ring that wraps, MLA's latent,
experts on the expert axis, LoRA's adapters).
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import distrib_train as dt
from distrib_train import recipes
from distrib_train.checkpoint import hf
from distrib_train.generation.engine import Generator, bucket
from distrib_train.generation.sampling import Sampling

ROOT = pathlib.Path(__file__).resolve().parents[1]
FP32 = dict(dtype="float32", param_dtype="float32", attention="xla")
# The variants whose cache differs from a plain decoder's: a window of 8 that the prompts and new tokens outgrow
# (the ring wraps) beside a full layer, with Gemma 3's norms, caps and scaled embeddings; MLA's latent; experts.
VARIANTS = {
  "sliding_ring": (
    "llama",
    dict(
      sliding_window=8,
      layer_types=("sliding", "full"),
      qk_norm=True,
      sandwich_norms=True,
      attn_logit_softcap=20.0,
      final_logit_softcap=15.0,
      scale_embeddings=True,
      local_rope_theta=1e4,
      attention_sinks=True,
      attention_bias=True,
    ),
  ),
  "mla_experts": (
    "moe",
    dict(
      attention_kind="mla",
      q_lora_rank=16,
      kv_lora_rank=16,
      qk_rope_head_dim=8,
      head_dim=16,
      v_head_dim=16,
      rope_interleave=True,
    ),
  ),
  "lora": ("llama", dict(lora_rank=4)),
}


def _model(kind, fields, seed=0):
  config = recipes.get(kind, "tiny", **FP32, **fields).config
  model = config.build(seed)
  if config.lora_rank:  # adapters that change the output (their B starts at zero)
    from flax import nnx

    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(1), a.shape, a.dtype), state)
    model = nnx.merge(graphdef, state)
  return model


def _uncached_greedy(model, prompt, steps, width=32):
  """Greedy tokens from the whole sequence's forward at each step (right-padded to ``width``: causal, so the pads
  change nothing before them; one compile)."""
  forward = jax.jit(lambda tokens: model.logits(model(tokens))[0])
  seq = list(prompt)
  for _ in range(steps):
    seq.append(int(jnp.argmax(forward(jnp.asarray([seq + [0] * (width - len(seq))]))[len(seq) - 1])))
  return seq[len(prompt) :]


def _prompts(vocab, lengths=(5, 13, 2)):
  rng = np.random.default_rng(0)
  return [rng.integers(0, vocab, size=length).tolist() for length in lengths]


def _mesh(kind):
  axes = ("data", "expert", "fsdp", "tensor") if kind == "moe" else ("data", "fsdp", "tensor")
  sizes = (1, 4, 2, 1) if kind == "moe" else (2, 2, 2)
  return dt.build_mesh(dt.MeshConfig(axes, sizes)), dt.AxisRules("fsdp_tensor")


def _sharded(model, mesh, rules):
  """The model's params laid out on ``mesh`` as the planner lays them out."""
  make = lambda: dt.TrainState.initial_state(model, optax.sgd(0.0), jax.random.key(0))
  state, _ = dt.MeshPlanner(mesh, rules).init(make)
  return state.model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_greedy_decode_is_the_uncached_forwards_on_8_devices(variant):
  """Three prompts of mixed lengths in one batch, 12 new tokens each, on 8 devices (a mixture: expert 4 × fsdp 2,
  two prompts' rows padded to the 8 the batch splits over): token for token the model's own forward, run again
  on the whole sequence for every token."""
  kind, fields = VARIANTS[variant]
  model = _model(kind, fields)
  prompts = _prompts(model.config.vocab_size)
  mesh, rules = _mesh(kind)
  generator = Generator(_sharded(model, mesh, rules), mesh=mesh, rules=rules)
  completions = generator.generate(prompts, max_new_tokens=12)
  for prompt, completion in zip(prompts, completions):
    assert completion.ids == _uncached_greedy(model, prompt, 12), variant
    assert completion.finish_reason == "length" and len(completion.logprobs) == 12
  assert generator.compiles == 2


def test_one_seed_gives_the_same_samples_on_1_and_8_devices_and_in_any_batch():
  """Sampled with temperature, top-k, top-p and min-p, 3 samples per prompt: the same completions on one device,
  on 8 (data × fsdp × tensor), and in batches of 2 rows (each sample in another row of another batch); another
  seed gives others."""
  model = _model("llama", {})
  prompts = _prompts(model.config.vocab_size)
  settings = dict(max_new_tokens=10, sampling=Sampling(temperature=0.9, top_k=50, top_p=0.95, min_p=0.01), n=3, seed=7)
  one = Generator(model).generate(prompts, **settings)
  mesh, rules = _mesh("llama")
  eight = Generator(_sharded(model, mesh, rules), mesh=mesh, rules=rules).generate(prompts, **settings)
  assert [c.ids for c in one] == [c.ids for c in eight]
  np.testing.assert_allclose([c.logprobs for c in one], [c.logprobs for c in eight], rtol=1e-5, atol=1e-5)
  small = Generator(model).generate(prompts, **{**settings, "batch_size": 2})
  assert [c.ids for c in small] == [c.ids for c in one]
  samples = [c.ids for c in one]
  assert len({tuple(s) for s in samples}) > len(prompts)  # the samples of one prompt differ
  other = Generator(model).generate(prompts, **{**settings, "seed": 8})
  assert [c.ids for c in other] != samples


def test_rows_stop_at_an_end_id_and_the_loop_ends_when_every_row_has():
  model = _model("llama", {})
  prompts = _prompts(model.config.vocab_size)
  generator = Generator(model)
  free = generator.generate(prompts, max_new_tokens=12)
  end = free[0].ids[4]  # the first prompt's fifth token ends it; the others go on unless they meet it
  stopped = generator.generate(prompts, max_new_tokens=12, eos_ids=[end])
  for a, b in zip(free, stopped):
    cut = a.ids.index(end) + 1 if end in a.ids else len(a.ids)
    assert b.ids == a.ids[:cut] and b.logprobs == pytest.approx(a.logprobs[:cut], abs=1e-6)
    assert b.finish_reason == ("stop" if end in a.ids else "length")
  assert stopped[0].finish_reason == "stop" and len(stopped[0].ids) <= 5
  # every row's first token an end id: one token each, the loop never runs a second step
  firsts = sorted({c.ids[0] for c in free})
  assert all(len(c.ids) == 1 for c in generator.generate(prompts, max_new_tokens=12, eos_ids=firsts))


def test_prompt_lengths_share_a_bucket_and_compiles_are_counted():
  model = _model("llama", {})
  generator = Generator(model)
  assert [bucket(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
  generator.generate([[1, 2, 3]], max_new_tokens=4)
  generator.generate([[5] * 11, [7] * 16], max_new_tokens=4)  # the same bucket, more rows: 2 rows
  assert generator.compiles == 4
  generator.generate([[4] * 9], max_new_tokens=4)  # bucket 16, one row: compiled already
  assert generator.compiles == 4
  with pytest.raises(ValueError, match="prompt 1 holds token id 256, outside the model's vocabulary of 256"):
    generator.generate([[1], [256]], max_new_tokens=4)
  with pytest.raises(ValueError, match="prompt 0 is empty"):
    generator.generate([[]], max_new_tokens=4)


def test_the_plan_reports_the_caches_bytes_per_device(capsys):
  """``plan --kv_cache``: the tiny Llama's cache (2 layers × k and v of 2 heads × 16, float32) of 8 rows × 64 tokens
  is 256 KiB, 32 KiB a device on cpu-8 (rows over data × fsdp, kv heads over tensor); DeepSeek-V3's MLA keeps its
  512 + 64 latent values per token and layer, not the expanded heads' 2 × 128 × (128 + 64)."""
  from distrib_train.generation import cache as cache_lib
  from distrib_train.podplan import cli as plan_cli
  from distrib_train.config import run as config_lib

  assert plan_cli.main(["--config", "tiny", "--no_compile", "--kv_cache", "8x64"]) == 0
  line = capsys.readouterr().out.strip().splitlines()[-1]
  assert line.startswith("Generation cache, 8 rows × 64 tokens (float32): 32.00 KiB per device, 256.00 KiB in all;")
  deepseek = config_lib.load("deepseek-v3-tpu").model_recipe().config
  assert cache_lib.values_per_token(deepseek) == 512 + 64
  assert cache_lib.cache_bytes(deepseek, 1, 1) == 61 * (512 + 64) * 2  # bfloat16, every layer


def _env():
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)
  return env


def _cli(*args, timeout=300):
  return subprocess.run(
    [sys.executable, "-m", "distrib_train.cli", "generate", *map(str, args)],
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=timeout,
  )


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, xla_cache, once_per_run):
  """test_bad_inputs' 2-step tiny run (byte-level, checkpoint at step 2): trained once for both."""
  from test_bad_inputs import _train

  return once_per_run("bad_inputs_trained", lambda: _train(tmp_path_factory, xla_cache))


def test_cli_generates_from_a_runs_checkpoint_to_jsonl_and_streams_one_prompt(trained_run, tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text(json.dumps({"prompt": "The Python"}) + "\n\n" + json.dumps({"prompt": "import os"}) + "\n")
  out = tmp_path / "out.jsonl"
  run = _cli(
    "--init_from",
    f"ckpt:{trained_run}",
    "--prompts",
    prompts,
    "--out",
    out,
    "--max_new_tokens",
    6,
    "--temperature",
    0.8,
    "--n",
    2,
    "--seed",
    3,
    "--cpu_devices",
    2,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["index"], r["sample"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  for r in records:
    assert set(r) == {"index", "sample", "text", "ids", "logprobs", "finish_reason"}
    assert len(r["ids"]) == len(r["logprobs"]) == 6 and r["finish_reason"] == "length"
    assert r["text"] == bytes(r["ids"]).decode("utf-8", errors="replace")
    assert all(lp <= 0 for lp in r["logprobs"])
  assert "wrote 4 completions of 2 prompts" in run.stderr
  # The same run from Python: the same completions (one seed, another device count)
  records_py = dt.generate(
    f"ckpt:{trained_run}", ["The Python", "import os"], max_new_tokens=6, temperature=0.8, n=2, seed=3
  )
  assert [r["ids"] for r in records_py] == [r["ids"] for r in records]
  streamed = _cli(
    "--init_from",
    f"ckpt:{trained_run}",
    "--step",
    2,
    "--prompt",
    "The Python",
    "--max_new_tokens",
    8,
    "--cpu_devices",
    2,
  )
  assert streamed.returncode == 0, streamed.stderr[-3000:]
  greedy = dt.generate(f"ckpt:{trained_run}", ["The Python"], max_new_tokens=8)[0]
  assert streamed.stdout == greedy["text"] + "\n"
  stop = dt.generate(f"ckpt:{trained_run}", ["The Python"], max_new_tokens=8, stop=[greedy["text"][2:4]])[0]
  assert stop["text"] == greedy["text"][:2] and stop["finish_reason"] == "stop"
  assert stop["ids"] == greedy["ids"][: len(stop["ids"])] and 2 < len(stop["ids"]) <= 4


@pytest.mark.parametrize(
  "args, message",
  [
    (("--prompt", "x"), "ckpt:{run}/nope: no checkpoint there"),
    (("--prompts", "{tmp}/missing.jsonl", "--out", "{tmp}/o.jsonl"), "--prompts '{tmp}/missing.jsonl' does not exist"),
    (("--prompts", "{tmp}/bad.jsonl", "--out", "{tmp}/o.jsonl"), "{tmp}/bad.jsonl:2: a prompt record needs 'prompt'"),
    (("--prompts", "{tmp}/bad.jsonl"), "--prompts needs --out FILE.jsonl"),
    (("--prompt", "x", "--top_p", "0"), "top_p must be in (0, 1], got 0.0"),
    (("--prompt", "x", "--step", "9"), "holds no step 9 (its steps: 2)"),
  ],
)
def test_cli_refuses_bad_input_in_one_line_before_writing(trained_run, tmp_path, args, message):
  (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no"}\n')
  fill = lambda s: s.format(tmp=tmp_path, run=trained_run)
  init = f"ckpt:{trained_run}/nope" if "nope" in message else f"ckpt:{trained_run}"
  run = _cli("--init_from", init, *map(fill, args), "--cpu_devices", 1)
  assert run.returncode == 2
  lines = run.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("distrib-train: error: ") and fill(message) in lines[0], run.stderr
  assert not (tmp_path / "o.jsonl").exists()


def _save_hf(model, directory):
  state = dt.TrainState.initial_state(model, optax.sgd(0.0), jax.random.key(0))
  hf.save(state.params, model.config, str(directory), local_state=state.local_state)


def test_two_processes_give_one_process_completions(tmp_path):
  """A Hugging Face directory read by 2 processes × 4 devices (fsdp and the batch across the processes, tensor
  within): the greedy and the sampled completions of one process on 8 devices."""
  import mp_harness

  model = _model("llama", dict(qk_norm=True, hf_model_type="qwen3"))
  _save_hf(model, tmp_path / "hf")
  (tmp_path / "mesh.yaml").write_text(
    "devices: 8\ngranules: 2\naxes:\n  data: 1\n  fsdp: {ici: 2, dcn: 2}\n  tensor: {ici: 2}\nrules: fsdp_tensor\n"
  )
  results = mp_harness.run_workers(
    ROOT / "tests" / "workers" / "generation_worker.py", str(tmp_path / "hf"), str(tmp_path / "mesh.yaml"), timeout=300
  )
  from distrib_train.weights import load as run_model

  loaded = run_model.load(f"hf:{tmp_path / 'hf'}", mesh_config="cpu-8")
  generator = Generator(loaded.model, mesh=loaded.mesh, rules=loaded.rules)
  prompts = _prompts(model.config.vocab_size)
  want = {
    name: [c.ids for c in generator.generate(prompts, max_new_tokens=8, **kwargs)]
    for name, kwargs in WORKER_SETTINGS.items()
  }
  for r in results:
    assert r.result == want


# What tests/workers/generation_worker.py generates (its own copy: a worker imports no test module).
WORKER_SETTINGS = {"greedy": {}, "sampled": dict(sampling=Sampling(temperature=1.0, top_p=0.9), n=2, seed=5)}
