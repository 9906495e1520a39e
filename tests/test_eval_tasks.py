"""Evaluation without a reference model: packed scoring against the sampler, ``distrib-train eval`` on a trained
run (lm-eval's table, results JSON and samples), its refusals, and ``train.eval_tasks`` in a run.

lm-eval's own ``hf`` model is the reference in ``test_eval_tasks_hf.py``
(a Llama and a Qwen3-MoE on 8 devices, and 2 processes).
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="distrib-train eval needs lm-eval: pip install 'distrib_train[eval]'")

from distrib_train.generation.engine import Generator  # noqa: E402
from distrib_train.generation.scoring import Scorer, pack  # noqa: E402

import test_generation  # noqa: E402
from test_bad_inputs import FAST, _env  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
trained_run = test_generation.trained_run  # the fixture: test_bad_inputs' 2-step tiny run


def test_pack_fits_each_length_best_first_and_never_overlaps():
  lengths = [7, 3, 5, 8, 2, 1, 6, 4]
  for shortest in (0, 2):
    placed, sizes = pack(lengths, 8, shortest)
    rows: dict[int, list[tuple[int, int]]] = {}
    for n, (row, at) in zip(lengths, placed):
      rows.setdefault(row, []).append((at, at + n))
    assert sum(sizes) < 8 * 6  # 36 tokens: few rows, little padding
    for row, spans in rows.items():
      spans.sort()
      assert spans[-1][1] <= sizes[row] and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
  assert pack(lengths, 8)[1] == [8] * 5  # without ``shortest``, every row is the longest: the fewest rows
  assert sorted(pack([3, 3, 15], 16, 4)[1]) == [4, 4, 16]  # short rows for what the long one cannot hold
  rows = [row for row, _ in pack([1] * 10, 16, 0, per_row=3)[0]]
  assert max(rows.count(r) for r in rows) == 3 and len(set(rows)) == 4  # a GPU's cap on a row's segments


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_packed_scores_of_greedy_completions_are_the_samplers_on_8_devices(kind):
  """The sampler's greedy completions, scored as continuations of their prompts, several to a row: each token
  is the argmax (``is_greedy``) and its log-probability the sampler's; a changed last token is not greedy."""
  model = test_generation._model(kind, {})
  mesh, rules = test_generation._mesh(kind)
  sharded = test_generation._sharded(model, mesh, rules)
  prompts = test_generation._prompts(model.config.vocab_size, lengths=(5, 13, 2, 9, 4))
  completions = Generator(sharded, mesh=mesh, rules=rules).generate(prompts, max_new_tokens=6)
  scorer = Scorer(sharded, mesh=mesh, rules=rules)
  sequences = [p + c.ids for p, c in zip(prompts, completions)]
  changed = sequences[0][:-1] + [(sequences[0][-1] + 1) % model.config.vocab_size]  # the same prefix
  scores = scorer.score(sequences + [changed], [6] * 6, row_len=32, rows=1, shortest=16)
  for score, completion in zip(scores, completions):
    assert score.greedy
    np.testing.assert_allclose(score.logprobs, completion.logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(score.logprob, sum(completion.logprobs), rtol=1e-5)
  assert not scores[-1].greedy and scores[-1].logprobs[:5] == scores[0].logprobs[:5]
  assert scores[-1].logprobs[5] < scores[0].logprobs[5]
  assert scorer.compiles == 2  # rows of 16 and of 32 tokens


@pytest.mark.parametrize("variant", ["sliding_ring", "mla_experts"])
def test_a_contexts_continuations_share_its_rows_and_score_as_each_alone_on_8_devices(variant):
  """Several continuations of a context in one row (its trunk once, each branch seeing it and itself), on 8
  devices: every figure and argmax as the model's own forward gives them, each sequence alone in its row —
  for a window the branches outgrow (Gemma 3's caps, sinks) and MLA with experts. The cases: branches of many
  tokens, of one (read at the trunk's end), sharing their first tokens, one input reached from two contexts,
  a trunk too short to share, a tree split over rows of 32, and questions after one few-shot prompt (its
  trunk, their answer letters read at each question's end)."""
  import jax
  import jax.numpy as jnp

  from distrib_train.generation import scoring

  kind, fields = test_generation.VARIANTS[variant]
  model = test_generation._model(kind, fields)
  mesh, rules = test_generation._mesh(kind)
  vocab = model.config.vocab_size
  rng = np.random.default_rng(1)
  ids = lambda n: rng.integers(0, vocab, n).tolist()
  sequences, scored = [], []
  for context in (ids(14), ids(20), ids(scoring.MIN_TRUNK - 3)):
    shared = ids(2)
    for continuation in (ids(5), ids(1), ids(9), shared + ids(3), shared + ids(4), ids(1)):
      sequences.append(context + continuation)
      scored.append(len(continuation))
  sequences.append(sequences[3][:-1] + ids(1))  # sequence 3's context and its first 4 ids as a context
  scored.append(1)
  fewshot = ids(12)
  for question in (ids(6), ids(9), ids(4)):
    sequences += [fewshot + question + ids(1) for _ in range(3)]
    scored += [1] * 3
  scorer = Scorer(test_generation._sharded(model, mesh, rules), mesh=mesh, rules=rules)
  scores = scorer.score(sequences, scored, row_len=32, rows=2)
  trees, _ = scoring._trees([tuple(s[:-1]) for s in sequences], True, 32)
  assert scorer.layout.trees == len(trees) < len({tuple(s[:-1]) for s in sequences})
  assert any(t.trunk == tuple(fewshot) and len(t.branches) == 3 for t in trees)
  assert any(len(t.trunk) == 14 and len(t.branches) > 1 for t in trees)
  assert len([t for t in trees if len(t.trunk) == 20]) > 1  # a tree split over rows
  width = max(map(len, sequences))
  tokens = np.array([s + [0] * (width - len(s)) for s in sequences], np.int32)
  logits = jax.jit(lambda m, t: m.logits(m(t)).astype(jnp.float32))(model, tokens)
  logprobs = np.asarray(jax.nn.log_softmax(logits))
  for i, (seq, k, score) in enumerate(zip(sequences, scored, scores)):
    at = np.arange(len(seq) - 1 - k, len(seq) - 1)
    want = logprobs[i, at, np.array(seq)[at + 1]]
    np.testing.assert_allclose(score.logprobs, want, rtol=2e-5, atol=2e-5, err_msg=f"sequence {i}")
    assert score.greedy == bool(np.all(np.argmax(logits[i, at], -1) == np.array(seq)[at + 1]))


def _eval(*args, env=None, timeout=300):
  return subprocess.run(
    [sys.executable, "-m", "distrib_train.cli", "eval", *map(str, args)],
    cwd=ROOT,
    env=env or _env(),
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def test_cli_prints_lm_evals_table_and_writes_its_results_and_samples(trained_run, tmp_path):
  out = tmp_path / "results"
  run = _eval(
    "--init_from",
    f"ckpt:{trained_run}",
    "--tasks",
    "demo",
    "--limit",
    4,
    "--output_path",
    out,
    "--log_samples",
    "--cpu_devices",
    8,
    "--batch_size",
    2,
    "--max_length",
    64,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  for name in ("demo_choice", "demo_perplexity", "demo_completion"):
    assert name in run.stdout
  assert "acc_norm" in run.stdout and "word_perplexity" in run.stdout and "exact_match" in run.stdout
  (folder,) = out.iterdir()
  (results,) = folder.glob("results_*.json")
  data = json.loads(results.read_text())
  assert data["results"]["demo_choice"]["sample_len"] == 4
  assert 0 <= data["results"]["demo_choice"]["acc,none"] <= 1
  assert data["results"]["demo_perplexity"]["bits_per_byte,none"] > 0
  samples = sorted(p.name.split("_2")[0] for p in folder.glob("samples_*.jsonl"))
  assert samples == ["samples_demo_choice", "samples_demo_completion", "samples_demo_perplexity"]
  choice = [json.loads(line) for line in next(folder.glob("samples_demo_choice_*.jsonl")).read_text().splitlines()]
  assert len(choice) == 4 and all(len(s["resps"]) == 4 for s in choice)  # four choices, each scored


@pytest.mark.parametrize(
  "args, message",
  [
    (
      ["--tasks", "remote_task"],
      "task remote_task: its data (dataset_path: some_org/some_data) would be downloaded, and eval runs offline",
    ),
    (["--tasks", "missing_file"], "task missing_file: its data file 'nowhere/test.jsonl' does not exist"),
    (["--tasks", "demo", "--log_samples"], "--log_samples needs --output_path"),
  ],
)
def test_cli_refuses_in_one_line_before_reading_the_model(trained_run, tmp_path, args, message):
  tasks = tmp_path / "tasks"
  tasks.mkdir()
  (tasks / "remote.yaml").write_text(
    "task: remote_task\ndataset_path: some_org/some_data\noutput_type:"
    " loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\ndoc_to_target: x\n"
  )
  (tasks / "missing.yaml").write_text(
    "task: missing_file\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
    "    test: nowhere/test.jsonl\noutput_type: loglikelihood_rolling\n"
    "test_split: test\ndoc_to_text: ''\ndoc_to_target: x\n"
  )
  run = (
    _eval(
      "--init_from",
      f"ckpt:{trained_run}",
      "--include_path",
      tasks,
      *args,
      "--output_path",
      tmp_path / "out",
      "--cpu_devices",
      8,
    )
    if "--log_samples" not in args
    else _eval("--init_from", f"ckpt:{trained_run}", *args, "--cpu_devices", 8)
  )
  assert run.returncode == 2
  (line,) = [line for line in run.stderr.splitlines() if line.startswith("distrib-train: error:")]
  assert message in line
  assert not (tmp_path / "out").exists()


def test_cli_without_lm_eval_names_the_extra(trained_run):
  run = _eval("--init_from", f"ckpt:{trained_run}", "--tasks", "demo", env=_env(hide=("lm_eval",)))
  assert run.returncode == 2
  assert "distrib-train eval needs lm-eval: pip install 'distrib_train[eval]'" in run.stderr


def test_a_run_logs_task_scores_and_their_time_as_it_goes(tmp_path, xla_cache):
  workdir = tmp_path / "run"
  cmd = [
    sys.executable,
    "-m",
    "distrib_train",
    "--config",
    "tiny",
    "--workdir",
    str(workdir),
    *FAST,
    "--steps",
    "4",
    "--set",
    "data.seq_len=64",
    "--set",
    "train.eval_tasks=demo_choice,demo_perplexity",
    "--set",
    "train.eval_tasks_every=2",
    "--set",
    "train.eval_tasks_limit=3",
    "--set",
    f"train.compilation_cache_dir={xla_cache}",
  ]
  run = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  scored = [r for r in records if "eval/demo_choice/acc" in r]
  assert [r["step"] for r in scored] == [2, 4]
  for r in scored:
    assert set(r) >= {
      "eval/demo_choice/acc",
      "eval/demo_choice/acc_norm",
      "eval/demo_perplexity/word_perplexity",
      "eval/demo_perplexity/byte_perplexity",
      "eval/demo_perplexity/bits_per_byte",
    }
  goodput = json.loads((workdir / "goodput.json").read_text())
  assert goodput["runs"][-1]["seconds"]["eval_tasks"] > 0


def test_a_run_with_a_task_it_cannot_read_stops_before_writing(tmp_path):
  tasks = tmp_path / "tasks"
  tasks.mkdir()
  (tasks / "remote.yaml").write_text(
    "task: remote_task\ndataset_path: some_org/some_data\noutput_type:"
    " loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\ndoc_to_target: x\n"
  )
  workdir = tmp_path / "run"
  run = subprocess.run(
    [
      sys.executable,
      "-m",
      "distrib_train",
      "--config",
      "tiny",
      "--workdir",
      str(workdir),
      *FAST,
      "--set",
      "train.eval_tasks=demo_choice,remote_task",
      "--set",
      f"train.eval_include_path={tasks}",
    ],
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 2
  assert "task remote_task: its data (dataset_path: some_org/some_data) would be downloaded" in run.stderr
  assert not workdir.exists()


def test_demo_tasks_are_built_from_held_out_text():
  from distrib_train.evaluation import demo_tasks

  choice = list(demo_tasks.choice()["test"])
  assert len(choice) >= 20 and all(len(d["choices"]) == 4 and 0 <= d["label"] < 4 for d in choice)
  assert len({d["label"] for d in choice}) > 1
  completion = list(demo_tasks.completion()["test"])
  assert all(d["context"].endswith(" ") and d["answer"].isalpha() for d in completion)
