"""The demo's evaluation tasks, built from the demo corpus with no download: lm-eval ``custom_dataset`` functions.

The task YAMLs are ``distrib_train/configs/eval_tasks/demo_*.yaml`` (group
``demo``); each names one of these functions, which lm-eval calls for its
documents. They come from the paragraphs of the pydoc documents the tiny
preset holds out (its ``eval`` split: text the demo run did not train on):

- ``choice``: a paragraph's opening, then which of four continuations is the
  paragraph's own (the other three: other paragraphs' at the same place) —
  ``multiple_choice``, ``acc`` and ``acc_norm``;
- ``perplexity``: whole paragraphs — ``loglikelihood_rolling``,
  ``word_perplexity``, ``byte_perplexity``, ``bits_per_byte``;
- ``completion``: a sentence's opening, then its next word —
  ``generate_until`` a space or a line's end, ``exact_match``.

Not for: running tasks (``eval_tasks.py``).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np

_DOCUMENTS = 40


@functools.cache
def _paragraphs() -> tuple[str, ...]:
  from distrib_train.data import splits
  from distrib_train.config import run as config_lib

  data = config_lib.load("tiny", {}, training=False).data
  docs, indices, _ = splits.split_documents(data, "eval", 1, None)
  out = []
  for i in indices:
    for paragraph in str(docs[int(i)]).split("\n\n"):
      text = " ".join(paragraph.split())
      if 120 <= len(text) <= 600 and text.isascii() and text[0].isalpha():
        out.append(text)
  return tuple(out)


def _dataset(records: list[dict[str, Any]]):
  import datasets

  return datasets.DatasetDict({"test": datasets.Dataset.from_list(records)})


def choice(**kwargs: Any):
  """``multiple_choice`` documents (module docstring): ``context``, ``choices``, ``label``."""
  paragraphs = _paragraphs()
  rng = np.random.default_rng(0)
  records = []
  ending = lambda t: " " + " ".join(t[t.rfind(" ", 0, 60) :].split()[:4])  # four words after the 60th character
  for n, text in enumerate(paragraphs[:_DOCUMENTS]):
    cut = text.rfind(" ", 0, 60)
    others = [paragraphs[(n + k * 7) % len(paragraphs)] for k in (1, 2, 3)]
    choices = [ending(text)] + [ending(other) for other in others]
    order = rng.permutation(4)
    records.append({"context": text[:cut], "choices": [choices[k] for k in order], "label": int(np.argmax(order == 0))})
  return _dataset(records)


def perplexity(**kwargs: Any):
  """``loglikelihood_rolling`` documents: ``text``."""
  return _dataset([{"text": text} for text in _paragraphs()[: _DOCUMENTS // 2]])


def completion(**kwargs: Any):
  """``generate_until`` documents: ``context`` (a sentence's opening) and ``answer`` (its next word)."""
  records = []
  for text in _paragraphs():
    words = re.findall(r"[A-Za-z]+", text)
    if len(words) > 8 and len(records) < _DOCUMENTS // 2:
      at = text.find(" " + words[6] + " ", text.find(words[5]))
      if at > 0:
        records.append({"context": text[: at + 1], "answer": words[6]})
  return _dataset(records)
