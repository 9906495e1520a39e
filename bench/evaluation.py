"""Evaluation's speed: log-likelihood requests per second, ``HarnessLM`` beside lm-eval's own ``hf`` model.

Run from the repository root (needs ``pip install 'lm-eval[hf]'`` and PyTorch's CPU build):

  python bench/evaluation.py                          # the rows of bench/RESULTS.md (CPU)
  python bench/evaluation.py --device cuda --rows 64  # both models on a GPU
  python bench/evaluation.py --smoke                  # a small, quick run

A random Llama (``--d_model``, ``--layers``, 8 heads, 2 kv heads, a 512-id
vocabulary, fp32, 512 positions) with a byte-level BPE, saved by
transformers (``tests/eval_helpers.py``). The requests are what multiple-
choice tasks send, from ``--docs`` held-out pydoc paragraphs of the demo
corpus, each cut at a random place (20 to 400 characters in; 200 after the
few-shot prompt), four pairs a
paragraph (``--kinds``): ``words``, four continuations of 1 to 8 words
(HellaSwag's or ARC's shape); ``letters``, the opening as a question and
the answers `` A`` … `` D`` (MMLU's, zero-shot); ``letters_5shot``, the same
after one prompt of five answered questions (MMLU's few-shot prompt, its
subject's first five, the same for every question). Both models answer the same
list through ``loglikelihood`` (tokenizing included) on the same
``--threads``: ours from the directory as ``distrib-train eval --init_from
hf:`` reads it, one device, ``--rows`` packed rows a call (``--no_share``:
no trees); lm-eval's ``HFLM`` at ``--batch_size``. The first call of each
(compiles, warm-up) is not timed; then the median of ``--repeats``. The
answers are checked equal (1e-4).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _requests(docs: int, kind: str):
  """``words``: four continuations of 1 to 8 words after a paragraph's opening; ``letters``: the paragraph's
  opening as a question, then `` A`` … `` D`` (one token each, as MMLU's answers); ``letters_5shot``: the same
  after five answered questions, one prompt for all (as MMLU's few-shot prompt is its subject's first five)."""
  import numpy as np
  from lm_eval.api.instance import Instance

  from distrib_train.evaluation import demo_tasks

  paragraphs = demo_tasks._paragraphs()
  rng = np.random.default_rng(0)
  out = []
  shots = (
    "".join(f"{p[:80]}\nAnswer: {'ABCD'[n % 4]}\n\n" for n, p in enumerate(paragraphs[-5:]))
    if kind == "letters_5shot"
    else ""
  )
  for i in range(docs):
    text = paragraphs[i % len(paragraphs)]
    cut = text.rfind(" ", 0, int(rng.integers(20, min(400 if not shots else 200, len(text) - 20))))
    for k in range(4):
      if kind.startswith("letters"):
        out.append(Instance("loglikelihood", {}, (f"{shots}{text[: max(cut, 10)]}\nAnswer:", " " + "ABCD"[k]), idx=k))
        continue
      source = paragraphs[(i + 5 * k) % len(paragraphs)].split()
      words = int(rng.integers(1, 9))
      start = int(rng.integers(0, max(1, len(source) - words)))
      out.append(
        Instance("loglikelihood", {}, (text[: max(cut, 10)], " " + " ".join(source[start : start + words])), idx=k)
      )
  return out


def _time(fn, repeats: int) -> tuple[float, list]:
  answers = fn()  # compiles, warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    answers = fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), answers


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--d_model", type=int, default=512)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--docs", type=int, default=64)
  parser.add_argument(
    "--rows",
    type=int,
    default=8,
    help="ours: packed rows per forward call (distrib-train eval's --batch_size, its default)",
  )
  parser.add_argument(
    "--batch_size",
    type=int,
    default=8,
    help="lm-eval's hf model: requests per forward call (8: faster than 32 on this CPU for short requests)",
  )
  parser.add_argument("--threads", type=int, default=os.cpu_count())
  parser.add_argument(
    "--device",
    choices=("cpu", "cuda"),
    default="cpu",
    help="cuda: both on the GPU (ours on jax's default backend, the hf model on cuda)",
  )
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument(
    "--kinds", default="words,letters,letters_5shot", help="which requests (words, letters, letters_5shot)"
  )
  parser.add_argument(
    "--no_share",
    action="store_true",
    help="ours with no trees: each distinct sequence its own segment (one read for several last ids still)",
  )
  parser.add_argument("--smoke", action="store_true", help="a small, quick run")
  parser.add_argument("--json", help="write the row here")
  args = parser.parse_args(argv)
  if args.smoke:
    args.d_model, args.layers, args.docs, args.repeats = 64, 2, 8, 1
  if args.device == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["TOKENIZERS_PARALLELISM"] = "false"
  import logging

  import numpy as np
  import torch

  import eval_helpers
  from lm_eval.models.huggingface import HFLM

  from distrib_train.evaluation import tasks as eval_tasks
  from distrib_train.evaluation.harness import HarnessLM

  logging.getLogger("lm_eval").setLevel(logging.ERROR)
  eval_tasks.offline()
  torch.set_num_threads(args.threads)
  directory = pathlib.Path(tempfile.mkdtemp(prefix="bench-evaluation-"))
  eval_helpers.save_model(
    "llama",
    directory,
    context=512,
    hidden_size=args.d_model,
    num_hidden_layers=args.layers,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=args.d_model // 8,
    intermediate_size=4 * args.d_model,
  )
  ours_lm = HarnessLM.load(f"hf:{directory}", batch_size=args.rows)
  ours_lm.share_contexts = not args.no_share
  theirs_lm = HFLM(pretrained=str(directory), dtype="float32", device=args.device, batch_size=args.batch_size)
  rows = []
  for kind in args.kinds.split(","):
    requests = _requests(args.docs, kind)
    ours_s, ours = _time(lambda: ours_lm.loglikelihood(requests, disable_tqdm=True), args.repeats)
    theirs_s, theirs = _time(lambda: theirs_lm.loglikelihood(requests, disable_tqdm=True), args.repeats)
    same = bool(np.allclose([a for a, _ in ours], [a for a, _ in theirs], rtol=1e-4, atol=1e-4)) and [
      g for _, g in ours
    ] == [g for _, g in theirs]
    tokens = [len(c) + len(x) for c, x in (theirs_lm._encode_pair(*r.args) for r in requests)]
    row = {
      "kind": kind,
      "d_model": args.d_model,
      "layers": args.layers,
      "requests": len(requests),
      "threads": args.threads,
      "tokens_min": min(tokens),
      "tokens_max": max(tokens),
      "tokens_mean": float(np.mean(tokens)),
      "ours_requests_per_s": len(requests) / ours_s,
      "hf_requests_per_s": len(requests) / theirs_s,
      "ratio": theirs_s / ours_s,
      "same_answers": same,
      "layout": str(ours_lm.scorer.layout),
    }
    rows.append(row)
    print(
      f"{args.device.upper()}, {args.threads} threads, d {args.d_model} × {args.layers} layers, {len(requests)} log-likelihood"
      f" requests ({kind}) of {row['tokens_min']}-{row['tokens_max']} tokens (mean {row['tokens_mean']:.0f}):"
      f" distrib_train {row['ours_requests_per_s']:,.1f} requests/s ({row['layout']}),"
      f" lm-eval's hf model {row['hf_requests_per_s']:,.1f} requests/s (batch {args.batch_size}):"
      f" {row['ratio']:.2f} ×; the same answers: {same}",
      flush=True,
    )
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  return 0 if all(row["same_answers"] for row in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
