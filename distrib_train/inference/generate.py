"""``distrib-train generate`` and ``dt.generate``: completions of text prompts from a run's model or a Hugging Face one.

  distrib-train generate --init_from hf:/models/qwen3 --prompts q.jsonl --out a.jsonl --max_new_tokens 256
  distrib-train generate --init_from ckpt:/tmp/distrib_train_demo --prompt "The Python"   # streamed
  distrib-train generate --init_from ckpt:runs/sft --prompts q.jsonl --out a.jsonl --temperature 0.7 --n 4

The model loads onto the mesh as ``weights/load.py`` reads it, and
``generation/engine.py`` samples. Prompts: each line of ``--prompts`` is a
JSON record with ``prompt`` (text, encoded as the tokenizer encodes text by
default: transformers' ``tokenizer(prompt)``, a BOS where the tokenizer
adds one) or ``messages`` (rendered through the model's chat template with
the generation prompt, as ``apply_chat_template(…, add_generation_prompt=True)``).
Each output line is one completion: ``index`` (the prompt's line),
``sample``, ``text``, ``ids`` (the new tokens), ``logprobs`` (the model's,
one per new token) and ``finish_reason`` (``stop``: an end id or a stop
string; ``length``: ``max_new_tokens``).

The tokenizer and chat template are the Hugging Face directory's (``hf:``,
or the one a run started from), unless ``data.tokenizer`` names another
(``--set data.tokenizer=hf:DIR``: a directory, or its ``tokenizer.json``);
a run of its own tokenizer uses it. End ids (``--end_ids``): by default
transformers' ``generate`` rule, ``generation_config.json``'s
``eos_token_id`` (else ``config.json``'s) and a run's ``data.eos_token``;
``union`` adds the tokenizer's own end token (``tokenizer_config.json``'s
``eos_token``), as TRL's ``GRPOTrainer`` and vLLM stop and GRPO's rollouts do.

A mistake prints one ``error:`` line and exits with status 2, before any
model is read.

Not for: the cache and the loop (``generation/``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from distrib_train.weights import load as run_model
from distrib_train.inference import text as generate_text
from distrib_train.inference.text import END_RULES, Codec, prompt_ids, read_prompts, truncate_at_stop, codec_for
from distrib_train.common.text import fail


def generate(
  init_from: str | None = None,
  prompts: Sequence[str | dict] = (),
  *,
  model: Any = None,
  step: int | None = None,
  max_new_tokens: int = 256,
  temperature: float = 0.0,
  top_p: float = 1.0,
  top_k: int = 0,
  min_p: float = 0.0,
  n: int = 1,
  seed: int = 0,
  stop: Sequence[str] = (),
  end_ids: str = "generation_config",
  mesh_config: str | None = None,
  dtype: str | None = None,
  overrides: dict | None = None,
  batch_size: int = 64,
  on_text: Callable[[str], None] | None = None,
  log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
  """Completions of ``prompts`` (texts, or records with ``prompt`` or ``messages``), ``n`` each, as the records
  ``distrib-train generate`` writes (module docstring).

  Args:
    init_from: ``hf:<dir>`` or ``ckpt:<run>`` (or ``model``: a ``run_model.RunModel`` already loaded).
    prompts: the prompts.
    step: a run's checkpoint step (default: the newest).
    max_new_tokens, temperature, top_p, top_k, min_p, n, seed: as ``generation.sampling.Sampling`` and
      ``generation.engine.Generator.generate`` (temperature 0: greedy).
    stop: strings that end a completion (the text before the first one is kept).
    end_ids: the rule of the ids that end a completion (``generate_text.END_RULES``): ``generation_config``
      (transformers' ``generate``) or ``union`` (the tokenizer's end token too, as TRL and vLLM).
    mesh_config, dtype, overrides: as ``run_model.load``.
    batch_size: rows decoded together.
    on_text: called with each piece of the first completion's text as it is decoded (one prompt, n 1).
    log: lines about compiles.

  Raises:
    ValueError: a bad prompt, setting or source (named), before the model is read where it can be.
  """
  from distrib_train.generation.engine import Generator
  from distrib_train.generation.sampling import Sampling

  sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
  if end_ids not in END_RULES:
    raise ValueError(f"end_ids={end_ids!r}: choose {' or '.join(END_RULES)}.")
  records = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
  # The tokenizer and the prompts first, from the source's files alone: a bad prompt is refused before any weight
  # is read.
  found = model if model is not None else run_model.source(init_from, dtype=dtype, overrides=overrides or {})
  codec = codec_for(found)
  ids = [prompt_ids(codec, record, f"prompt {i}") for i, record in enumerate(records)]
  loaded = model if model is not None else run_model.load(found, step=step, mesh_config=mesh_config)
  stream = _Streamer(codec, on_text, stop) if on_text is not None and len(ids) == 1 and n == 1 else None
  generator = Generator(loaded.model, mesh=loaded.mesh, rules=loaded.rules, log=log)
  completions = generator.generate(
    ids,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    n=n,
    seed=seed,
    eos_ids=generate_text.end_ids(loaded, codec, end_ids),
    batch_size=batch_size,
    on_token=stream,
  )
  out = []
  for c in completions:
    text, kept, stopped = truncate_at_stop(codec, c.ids, stop)
    out.append(
      {
        "index": c.index,
        "sample": c.sample,
        "text": text,
        "ids": c.ids[:kept],
        "logprobs": c.logprobs[:kept],
        "finish_reason": "stop" if stopped else c.finish_reason,
      }
    )
  if stream is not None:
    stream.finish(out[0]["text"])
  return out


class _Streamer:
  """``on_token`` for one row: the text decoded so far passed on in pieces as it becomes final — not a character
  cut between tokens, nor what may begin a stop string — and nothing past a stop string; ``finish`` passes the
  rest of the completion's final text."""

  def __init__(self, codec: Codec, on_text: Callable[[str], None], stop: Sequence[str]):
    self.codec, self.on_text, self.stop = codec, on_text, [s for s in stop if s]
    self.ids: list[int] = []
    self.shown, self.done = 0, False

  def _emit(self, text: str, end: int) -> None:
    if end > self.shown:
      self.on_text(text[self.shown : end])
      self.shown = end

  def __call__(self, tokens, finished) -> None:
    if self.done or bool(finished[0]):
      self.done = True
      return
    self.ids.append(int(tokens[0]))
    text = self.codec.decode(self.ids)
    hits = [text.find(s) for s in self.stop if s in text]
    if hits:
      self._emit(text, min(hits))
      self.done = True
      return
    end = len(text.rstrip("\ufffd"))  # a character cut between tokens waits for the rest
    held = max((k for s in self.stop for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0)
    self._emit(text, end - held)

  def finish(self, text: str) -> None:
    self._emit(text, len(text))


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(prog="distrib-train generate", description=__doc__.split("\n\n")[0])
  parser.add_argument("--prompts", help="a JSONL file of records with 'prompt' (text) or 'messages' (a chat)")
  parser.add_argument("--prompt", help="one text prompt; its answer is printed as it is generated")
  parser.add_argument("--out", help="the JSONL file of completions (with --prompts)")
  parser.add_argument("--max_new_tokens", type=int, default=256)
  parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  parser.add_argument("--top_p", type=float, default=1.0)
  parser.add_argument("--top_k", type=int, default=0)
  parser.add_argument("--min_p", type=float, default=0.0)
  parser.add_argument("--n", type=int, default=1, help="samples per prompt")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--stop", action="append", default=[], help="a string that ends a completion (repeatable)")
  parser.add_argument(
    "--end_ids",
    choices=END_RULES,
    default="generation_config",
    help="the ids that end a completion: generation_config (transformers' generate:"
    " generation_config.json's eos_token_id, else config.json's) or union (also the"
    " tokenizer's eos_token, as TRL's GRPOTrainer, vLLM and GRPO's rollouts stop)",
  )
  parser.add_argument("--batch_size", type=int, default=64, help="rows decoded together")
  run_model.add_flags(parser)
  args = parser.parse_args(list(argv))
  try:
    if bool(args.prompts) == bool(args.prompt):
      raise ValueError("give --prompts FILE.jsonl (with --out) or --prompt TEXT, one of the two.")
    if args.prompts and not args.out:
      raise ValueError("--prompts needs --out FILE.jsonl for the completions.")
    if args.out and os.path.isdir(args.out):
      raise ValueError(f"--out {args.out!r} is a directory; name a .jsonl file.")
    prompts = read_prompts(args.prompts) if args.prompts else [args.prompt]
    from distrib_train.generation.sampling import Sampling
    from distrib_train.config import run as config_lib

    Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    if args.max_new_tokens < 1 or args.n < 1 or args.batch_size < 1:
      raise ValueError("--max_new_tokens, --n and --batch_size must be at least 1.")
    overrides = config_lib.parse_overrides(args.overrides)
  except (ValueError, OSError) as e:
    fail(str(e))
  first, say = run_model.start(args)
  on_text = (lambda piece: print(piece, end="", flush=True)) if args.prompt and first else None
  try:
    records = generate(
      args.init_from,
      prompts,
      step=args.step,
      max_new_tokens=args.max_new_tokens,
      temperature=args.temperature,
      top_p=args.top_p,
      top_k=args.top_k,
      min_p=args.min_p,
      n=args.n,
      seed=args.seed,
      stop=args.stop,
      end_ids=args.end_ids,
      mesh_config=args.mesh_config,
      dtype=args.dtype,
      overrides=overrides,
      batch_size=args.batch_size,
      on_text=on_text,
      log=say,
    )
  except ValueError as e:  # ConfigError, CheckpointError and HfCheckpointError are ValueErrors
    fail(str(e))
  if args.prompt:
    if first:
      print(flush=True)
    return 0
  if first:
    partial = args.out + ".partial"
    with open(partial, "w", encoding="utf-8") as f:
      for record in records:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(partial, args.out)
    print(f"wrote {len(records)} completions of {len(prompts)} prompts to {args.out}", file=sys.stderr)
  return 0
