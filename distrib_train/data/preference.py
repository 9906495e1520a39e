"""Preference records into pairs of scored sequences (``train.objective: dpo``).

A record names a prompt and two completions, as TRL's preference datasets do:

- ``{"prompt": ..., "chosen": ..., "rejected": ...}``: the prompt a string
  and the completions strings, or all three lists of messages (the
  completions the assistant's turns);
- ``{"messages": [...], "chosen": ..., "rejected": ...}``: the prompt as the
  conversation so far;
- ``{"chosen": [...], "rejected": [...]}``: two whole conversations, each
  scored on its last assistant turn (the prompt implicit).

Each completion is rendered after the prompt by the chat template
(``chat.ChatEncoder``, the completion's tokens scored) and the pair becomes
one document: the chosen sequence, then the rejected one. Its tokens are
``chat.SCORED_TOKENS`` whose ``loss`` codes say, bit 0, whether the loss
reads the token and, bit 1, whether it belongs to the rejected sequence;
``sequences.shifted`` makes each half a segment of its own. A pair is
packed whole into one row, never split.

A pair longer than ``seq_len + 1`` tokens is left out
(``data.long_conversations: drop``) or has each half cut to its share of
the row (``truncate``); a half cut before its completion is then not
scored, and the objective leaves that pair out (``recipes/objectives.py``).

Not for: the objective itself (``recipes/objectives.py``), the template
(``chat.py``), packing (``lanes.py``, ``finite.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from distrib_train.data.chat import SCORED_TOKENS, ChatEncoder, ConversationTokenizer, _check_messages

REJECTED = 2  # the loss code's bit that marks the rejected half


def encode_pair(encoder: ChatEncoder, record: Mapping[str, Any], where: str = "record"
                ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
  """A preference record's ``(ids, mask)`` for the chosen and for the rejected sequence (``encoder.loss_on``
  is ``completion``: the completions are scored).

  Raises:
    ValueError: a record without ``chosen`` and ``rejected``, or with parts of mixed kinds (named).
  """
  if not isinstance(record, Mapping) or "chosen" not in record or "rejected" not in record:
    keys = sorted(record)[:8] if isinstance(record, Mapping) else type(record).__name__
    raise ValueError(f"{where}: a preference record holds 'chosen' and 'rejected' (and 'prompt' or 'messages'"
                     f" unless they are whole conversations); it has {keys}.")
  prompt = record.get("prompt", record.get("messages"))
  out = []
  for name in ("chosen", "rejected"):
    completion, here = record[name], f"{where} ({name})"
    if prompt is None:
      if isinstance(completion, str):
        raise ValueError(f"{here}: a completion given as text needs a 'prompt'.")
      out.append(encoder.encode({"messages": _check_messages(completion, here)}, here))
    elif isinstance(prompt, str) != isinstance(completion, str):
      raise ValueError(f"{here}: the prompt and the completions are both text or both lists of messages.")
    else:
      out.append(encoder.encode({"prompt": prompt, "completion": completion}, here))
  return out[0], out[1]


class PairTokenizer(ConversationTokenizer):
  """A preference record (JSON text) → one document of ``SCORED_TOKENS``: the chosen sequence, then the rejected
  one (its ``loss`` codes carry ``REJECTED``); ``long`` counts the pairs longer than a row."""

  def __init__(self, config: Any):
    super().__init__(config)
    if self.encoder.loss_on != "completion":
      raise ValueError(f"Preference pairs score their completions: data.loss_on={self.encoder.loss_on!r} must be"
                       " completion.")

  def __call__(self, doc: str) -> np.ndarray:
    try:
      record = json.loads(doc)
    except ValueError:
      raise ValueError(f"A preference record is not JSON: {doc[:80]!r}.") from None
    (chosen, chosen_mask), (rejected, rejected_mask) = encode_pair(
        self.encoder, record, where=f"The preference record {doc[:100]!r}…")
    if len(chosen) + len(rejected) > self.limit:
      self.long += 1
      if self.drop:
        return np.zeros(0, SCORED_TOKENS)
      half = self.limit // 2
      keep = min(len(chosen), max(half, self.limit - len(rejected)))  # the shorter half whole, where it fits
      chosen, chosen_mask = chosen[:keep], chosen_mask[:keep]
      rejected, rejected_mask = rejected[:self.limit - keep], rejected_mask[:self.limit - keep]
    out = np.empty(len(chosen) + len(rejected), SCORED_TOKENS)
    out["ids"] = np.concatenate([chosen, rejected])
    out["loss"] = np.concatenate([chosen_mask.astype(np.int32), rejected_mask.astype(np.int32) | REJECTED])
    return out
