"""Generation against transformers (PyTorch, CPU): greedy tokens and log-probabilities, and the sampling filters.

Each family's tiny model (``test_hf.FAMILIES``: random weights, saved by
transformers, fp32) is read onto 8 emulated devices as ``distrib-train
generate --init_from hf:`` reads it (``weights/load.py``): fsdp 2 ×
tensor 2 × data 2, or fsdp 2 × expert 4 for a mixture. Three prompts of
mixed lengths decode together (left-padded into one bucket); each must give
``generate(do_sample=False)``'s 64 new tokens, token for token (up to an end
id where one comes), and transformers' log-probabilities (1e-4).

A chat model whose tokenizer ends with ``<|im_end|>`` while its generation config names another end id
(``grpo_helpers.save_chat_model``) runs on past ``<|im_end|>`` as transformers' ``generate`` does, unless
``--end_ids union`` asks for TRL's and vLLM's rule.
"""

import os

import numpy as np
import pytest

try:
  import torch
  import transformers
except ImportError:
  if os.environ.get("DT_REQUIRE_TORCH") == "1":
    raise
  pytest.skip("transformers and torch are the reference here: pip install torch transformers", allow_module_level=True)

import test_hf
from distrib_train.generation import sampling as sampling_lib
from distrib_train.inference import generate as generate_lib
from distrib_train.weights import load as run_model

pytestmark = pytest.mark.compat

NEW_TOKENS = 64
MIXTURE_MESH = "cpu-8-expert"


def _prompts():
  rng = np.random.default_rng(1)
  return [rng.integers(1, test_hf.COMMON["vocab_size"], size=length).tolist() for length in (7, 19, 3)]


def _transformers_greedy(model, prompt, eos):
  """transformers' greedy new tokens of one prompt (no padding) and the log-probability of each."""
  with torch.no_grad():
    out = model.generate(
      torch.tensor([prompt]),
      attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
      do_sample=False,
      max_new_tokens=NEW_TOKENS,
      min_new_tokens=0,
      eos_token_id=eos,
      pad_token_id=0,
      output_logits=True,
      return_dict_in_generate=True,
    )
  ids = out.sequences[0, len(prompt) :].tolist()
  logprobs = [torch.log_softmax(logits[0].float(), -1)[t].item() for logits, t in zip(out.logits, ids)]
  if eos is not None and eos in ids:
    cut = ids.index(eos) + 1
    ids, logprobs = ids[:cut], logprobs[:cut]
  return ids, logprobs


@pytest.mark.parametrize("family", list(test_hf.FAMILIES))
def test_greedy_decode_on_8_devices_gives_transformers_tokens_and_logprobs(family, tmp_path):
  reference = test_hf._save(family, tmp_path / "hf")
  mesh = MIXTURE_MESH if family in test_hf.MIXTURES else "cpu-8"
  loaded = run_model.load(f"hf:{tmp_path / 'hf'}", mesh_config=mesh, overrides={"model.attention": "xla"})
  eos = reference.generation_config.eos_token_id
  eos = eos[0] if isinstance(eos, list) else eos
  from distrib_train.generation.engine import Generator

  generator = Generator(loaded.model, mesh=loaded.mesh, rules=loaded.rules)
  prompts = _prompts()
  ours = generator.generate(prompts, max_new_tokens=NEW_TOKENS, eos_ids=[eos] if eos is not None else [])
  assert generator.compiles == 2  # one prefill and one decode serve the three lengths
  for prompt, completion in zip(prompts, ours):
    ids, logprobs = _transformers_greedy(reference, prompt, eos)
    assert completion.ids == ids
    np.testing.assert_allclose(completion.logprobs, logprobs, rtol=1e-4, atol=1e-4)
    assert completion.finish_reason == ("stop" if eos in ids else "length")


def test_top_k_top_p_and_min_p_keep_the_tokens_transformers_processors_keep():
  rng = np.random.default_rng(0)
  logits = (rng.standard_normal((6, 50)) * 3).astype(np.float32)
  settings = [
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.6, top_k=20, top_p=0.9, min_p=0.05),
  ]
  for s in settings:
    processors = transformers.LogitsProcessorList(
      [transformers.TemperatureLogitsWarper(s["temperature"])]
      + ([transformers.TopKLogitsWarper(s["top_k"])] if s.get("top_k") else [])
      + ([transformers.TopPLogitsWarper(s["top_p"])] if s.get("top_p") else [])
      + ([transformers.MinPLogitsWarper(s["min_p"])] if s.get("min_p") else [])
    )
    want = processors(torch.zeros(6, 1, dtype=torch.long), torch.from_numpy(logits.copy())).numpy()
    got = np.asarray(sampling_lib.filtered(logits, sampling_lib.Sampling(**s)))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=str(s))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6, err_msg=str(s))


def test_text_and_chat_prompts_are_encoded_as_transformers_encodes_them(tmp_path):
  """A text prompt is ``tokenizer(text)``'s ids (the BOS the tokenizer adds); a chat prompt is
  ``apply_chat_template(messages, add_generation_prompt=True)``'s; the tokenizer comes from the model's
  directory, or from ``data.tokenizer: hf:<dir>``."""
  import chat_helpers

  from tokenizers import processors

  reference = test_hf._save("qwen3", tmp_path / "hf", vocab_size=512)
  bpe = chat_helpers.bpe_tokenizer([m["content"] for c in chat_helpers.CONVERSATIONS for m in c] * 20)
  tokenizer_dir = chat_helpers.tokenizer_dir(tmp_path / "tok", bpe, "llama3", chat_helpers.LLAMA3)
  tok = __import__("tokenizers").Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
  bos = "<|begin_of_text|>"
  tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
  tok.save(str(tokenizer_dir / "tokenizer.json"))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
  text = "The quick brown fox"
  messages = [{"role": "user", "content": "What is two and two?"}]
  loaded = run_model.load(
    f"hf:{tmp_path / 'hf'}", mesh_config="cpu-8", overrides={"data.tokenizer": f"hf:{tokenizer_dir}"}
  )
  codec = generate_lib.codec_for(loaded)
  assert generate_lib.prompt_ids(codec, {"prompt": text}, "p") == theirs(text)["input_ids"]
  want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
  assert generate_lib.prompt_ids(codec, {"messages": messages}, "p") == list(want)
  records = generate_lib.generate(model=loaded, prompts=[text, {"messages": messages}], max_new_tokens=8)
  for record, ids in zip(records, (theirs(text)["input_ids"], list(want))):
    with torch.no_grad():
      out = reference.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=8, min_new_tokens=0, eos_token_id=None, pad_token_id=0
      )
    assert record["ids"] == out[0, len(ids) :].tolist()[: len(record["ids"])]
    assert record["text"] == theirs.decode(record["ids"], skip_special_tokens=True)


def test_the_cpu_bench_times_both_sides_on_the_same_tokens(tmp_path):
  """``bench/generation.py cpu --smoke``: tokens/s of both, and the same greedy tokens."""
  import json
  import pathlib
  import subprocess
  import sys

  root = pathlib.Path(__file__).resolve().parents[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(
    [sys.executable, "bench/generation.py", "cpu", "--smoke", "--json", str(tmp_path / "r.json")],
    cwd=root,
    env=dict(env, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  [row] = json.loads((tmp_path / "r.json").read_text())
  assert row["same_tokens"] and row["ours_tokens_per_s"] > 0 and row["transformers_tokens_per_s"] > 0
  assert "the same tokens: True" in out.stdout


def test_two_processes_give_transformers_greedy_tokens(tmp_path):
  """A model saved by transformers, read by 2 processes × 4 devices (fsdp and the batch across the processes,
  tensor within, ``tests/workers/generation_worker.py``): the greedy tokens of ``generate(do_sample=False)``."""
  import pathlib

  import mp_harness

  reference = test_hf._save("qwen3", tmp_path / "hf")
  (tmp_path / "mesh.yaml").write_text(
    "devices: 8\ngranules: 2\naxes:\n  data: 1\n  fsdp: {ici: 2, dcn: 2}\n  tensor: {ici: 2}\nrules: fsdp_tensor\n"
  )
  results = mp_harness.run_workers(
    pathlib.Path(__file__).parent / "workers" / "generation_worker.py",
    str(tmp_path / "hf"),
    str(tmp_path / "mesh.yaml"),
    timeout=300,
  )
  rng = np.random.default_rng(0)  # the worker's prompts
  prompts = [rng.integers(0, test_hf.COMMON["vocab_size"], size=n).tolist() for n in (5, 13, 2)]
  want = []
  for prompt in prompts:
    with torch.no_grad():
      out = reference.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8, eos_token_id=None, pad_token_id=0
      )
    want.append(out[0, len(prompt) :].tolist())
  for r in results:
    assert r.result["greedy"] == want


def test_generate_runs_past_the_tokenizers_end_token_unless_end_ids_union(tmp_path):
  """By default (transformers' rule: the generation config's end ids) a sampled completion runs on past
  ``<|im_end|>``; ``distrib-train generate --end_ids union`` stops the same sampled ids at their first end id of
  the union (TRL's cut), ``finish_reason`` ``stop``."""
  import json

  import grpo_helpers
  from test_generation import _cli

  im_end = grpo_helpers.save_chat_model(tmp_path / "hf", grpo_helpers.write_prompts(tmp_path / "chat.jsonl"))
  records = [
    {"prompt": r["prompt"]} if isinstance(r["prompt"], str) else {"messages": r["prompt"]}
    for r in grpo_helpers.read_jsonl(tmp_path / "chat.jsonl")
  ]
  (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  configured = transformers.GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id
  union = {im_end, *(configured if isinstance(configured, list) else [configured])}
  settings = dict(max_new_tokens=12, temperature=0.7, n=2, seed=3)
  default = generate_lib.generate(f"hf:{tmp_path / 'hf'}", records, **settings)
  run = _cli(
    "--init_from",
    f"hf:{tmp_path / 'hf'}",
    "--prompts",
    tmp_path / "prompts.jsonl",
    "--out",
    tmp_path / "out.jsonl",
    "--end_ids",
    "union",
    "--cpu_devices",
    8,
    *[word for k, v in settings.items() for word in (f"--{k}", v)],
  )
  assert run.returncode == 0, run.stderr[-3000:]
  stopped = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
  assert any(im_end in d["ids"][:-1] for d in default)  # transformers' rule: <|im_end|> is not an end
  for d, u in zip(default, stopped, strict=True):
    first_end = next((i for i, t in enumerate(d["ids"]) if t in union), None)
    assert u["ids"] == d["ids"][: None if first_end is None else first_end + 1]
    assert u["finish_reason"] == ("length" if first_end is None else "stop")
