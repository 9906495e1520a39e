"""Text in and out of generation: the tokenizer as a codec, prompt records into ids, end ids, stop strings.

- ``codec_for(run_model)``: the tokenizer ``data.tokenizer`` names where it
  is set (a run's own, or ``--set data.tokenizer=…``), else the Hugging
  Face directory's ``tokenizer.json`` (``hf:``, or the directory a run
  started from): the one tokenizer of ``data/tokenizer.py`` for every kind
  (bytes, ``hf:``, ``sentencepiece:``, ``tiktoken:``), text encoded with the
  tokenizer's own special tokens (as transformers' ``tokenizer(text)``),
  decoded without them.
- ``prompt_ids``: a ``prompt`` record's text so encoded (a run's
  ``data.bos_token`` before it, as its documents were); a ``messages``
  record through the chat template with the generation prompt, its ids
  with no special tokens added (the template writes them).
- ``end_ids``: the ids that end a completion, by one of two rules
  (``END_RULES``). ``generation_config`` (transformers' ``generate``):
  ``generation_config.json``'s ``eos_token_id`` (one or a list), else
  ``config.json``'s, and a run's ``data.eos_token``. ``union`` (TRL's
  ``GRPOTrainer``, vLLM): those and the tokenizer's own end token
  (``tokenizer_config.json``'s ``eos_token``), which a chat model saved by
  transformers may name (``<|im_end|>``) while its generation config keeps
  another.
- ``truncate_at_stop``: a completion cut before its first stop string.

Not for: reading documents for training (``data/``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from distrib_train.data import tokenizer as tokenizer_lib
from distrib_train.data.chat import special_tokens

END_RULES = ("generation_config", "union")  # end_ids's rules: transformers' generate's, TRL's GRPOTrainer's


@dataclasses.dataclass(frozen=True)
class Codec:
  """A tokenizer for generation: ``encode(text, special)`` (``special``: the tokenizer's own BOS and such
  added), ``decode(ids)`` (special tokens left out), ``token_id(text)``, where its files are (``path``: the
  ``tokenizer.json``'s, for the chat template), a run's ``bos``, and the tokenizer's own end token's id
  (``eos``: ``tokenizer_config.json``'s or ``special_tokens_map.json``'s ``eos_token``)."""

  spec: str
  encode: Callable[[str, bool], list[int]]
  decode: Callable[[Sequence[int]], str]
  token_id: Callable[[str], int | None]
  path: str = ""
  bos: int | None = None
  eos: int | None = None


def _codec(spec: str) -> Codec:
  """The codec of ``spec``, from ``data/tokenizer.load``: every kind the config names encodes and decodes."""
  tokenizer = tokenizer_lib.load(spec)
  kind, path = tokenizer_lib.parse(spec)
  path = os.path.expanduser(path) if kind == "hf" else ""  # a tokenizer.json's directory holds the chat template
  eos = special_tokens(path).get("eos_token") if path else None  # as transformers reads a tokenizer's end token
  return Codec(
    spec, tokenizer.encode, tokenizer.decode, tokenizer.token_id, path, eos=tokenizer.token_id(eos) if eos else None
  )


def codec_for(loaded: Any) -> Codec:
  """The codec of a model's source or of the model loaded (``run_model.Source`` or ``RunModel``: module
  docstring).

  Raises:
    ValueError: no tokenizer to be had, or one that cannot be read (named).
  """
  data = loaded.config.data
  spec = data.tokenizer
  if spec == "bytes" and loaded.hf_dir:  # the default: the model's own directory's
    file = os.path.join(loaded.hf_dir, "tokenizer.json")
    if not os.path.isfile(file):
      raise ValueError(
        f"{loaded.hf_dir!r} holds no tokenizer.json; name one with --set data.tokenizer=hf:<dir or tokenizer.json>."
      )
    return _codec(f"hf:{file}")
  codec = _codec(spec)
  bos = codec.token_id(data.bos_token) if data.bos_token else None
  return dataclasses.replace(codec, bos=bos)


def read_prompts(path: str) -> list[dict[str, Any]]:
  """The records of a prompts file, each checked to hold ``prompt`` (text) or ``messages`` (a list).

  Raises:
    ValueError: a missing file, a line that is no JSON object or holds neither key (file and line named).
  """
  path = os.path.expanduser(path)
  if not os.path.isfile(path):
    raise ValueError(f"--prompts {path!r} does not exist.")
  records = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except ValueError as e:
        raise ValueError(f"{path}:{number}: not a JSON record: {e}") from None
      if not isinstance(record, dict) or not (
        isinstance(record.get("prompt"), str) or isinstance(record.get("messages"), list)
      ):
        raise ValueError(
          f"{path}:{number}: a prompt record needs 'prompt' (text) or 'messages' (a list of {{role, content}})."
        )
      records.append(record)
  if not records:
    raise ValueError(f"--prompts {path!r} holds no prompt.")
  return records


def prompt_ids(codec: Codec, record: dict[str, Any], where: str) -> list[int]:
  """A record's prompt ids (module docstring)."""
  if "messages" in record and not isinstance(record.get("prompt"), str):
    from distrib_train.data.chat import ChatEncoder, ChatTemplate

    if not codec.path:
      raise ValueError(
        f"{where}: 'messages' need a chat template, and the tokenizer {codec.spec} has none; give"
        " 'prompt' text, or the model's tokenizer with --set data.tokenizer=hf:<dir>."
      )
    text = ChatEncoder(ChatTemplate.load(codec.path), None).render(
      record["messages"], add_generation_prompt=True, where=where
    )
    return codec.encode(text, False)
  ids = codec.encode(record["prompt"], True)
  return ([codec.bos] if codec.bos is not None else []) + ids


def _ids(value: Any) -> list[int]:
  if isinstance(value, int):
    return [value]
  return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def end_ids(loaded: Any, codec: Codec, rule: str = "generation_config") -> list[int]:
  """The ids that end a completion under ``rule``, one of ``END_RULES`` (module docstring): ``generation_config``
  for ``distrib-train generate`` and evaluation, as transformers' ``generate``; ``union`` for GRPO's rollouts,
  as TRL's ``GRPOTrainer``.

  Raises:
    ValueError: another rule.
  """
  if rule not in END_RULES:
    raise ValueError(f"end ids {rule!r}: choose {' or '.join(END_RULES)}.")
  ids: list[int] = []
  if loaded.hf_dir:
    for name in ("generation_config.json", "config.json"):
      path = os.path.join(loaded.hf_dir, name)
      if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
          found = _ids(json.load(f).get("eos_token_id"))
        if found:
          ids = found
          break
  eos = loaded.config.data.eos_token
  if eos and codec.token_id(eos) is not None:
    ids.append(codec.token_id(eos))
  if rule == "union" and codec.eos is not None:
    ids.append(codec.eos)
  return sorted(set(ids))


def truncate_at_stop(codec: Codec, ids: Sequence[int], stop: Sequence[str]) -> tuple[str, int, bool]:
  """``(text, ids kept, stopped)``: the completion's text before its first stop string, and the fewest ids whose
  text holds it; the whole completion where none occurs."""
  text = codec.decode(ids)
  hits = [(text.find(s), s) for s in stop if s and s in text]
  if not hits:
    return text, len(ids), False
  cut = min(hits)[0]
  kept = next(k for k in range(1, len(ids) + 1) if any(s in codec.decode(ids[:k]) for _, s in hits))
  return text[:cut], kept, True
