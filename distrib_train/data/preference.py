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
scored, and the objective leaves that pair out (``objectives/dpo.py``).

With a precomputed reference (``data.reference_logps``, set by
``dpo.precompute_reference``; ``posttrain/reference_pass.py``) the tokens are
``PAIR_TOKENS``: each sequence's reference sum rides on its first scored
token (``ref``), read from the kept file by the record's hash.

Not for: the objective itself (``objectives/dpo.py``), the template
(``chat.py``), packing (``lanes.py``, ``finite.py``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from distrib_train.data.chat import ChatEncoder, ConversationTokenizer, check_messages
from distrib_train.data.config import REFERENCE_PENDING

REJECTED = 2  # the loss code's bit that marks the rejected half
# With a precomputed reference (``posttrain/reference_pass.py``): each sequence's summed reference log-probability
# on its first scored token, 0 elsewhere.
PAIR_TOKENS = np.dtype([("ids", np.int32), ("loss", np.int32), ("ref", np.float32)])


def record_hash(doc: str) -> int:
  """A record's 64-bit hash, as a precomputed reference's file keys it."""
  return int.from_bytes(hashlib.blake2b(doc.encode("utf-8"), digest_size=8).digest(), "little")


_MAGIC = b"distrib_train DPO reference v1\n"


def write_reference(path: str, hashes: np.ndarray, chosen: np.ndarray, rejected: np.ndarray) -> None:
  """Writes a precomputed reference's figures: a magic line, then each record's hash (uint64) and its two sums
  (float32), raw and little-endian (no pickle)."""
  with open(path, "wb") as f:
    f.write(_MAGIC + len(hashes).to_bytes(8, "little"))
    for values, dtype in ((hashes, "<u8"), (chosen, "<f4"), (rejected, "<f4")):
      f.write(np.ascontiguousarray(values, dtype).tobytes())


def read_reference(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``write_reference``'s hashes, chosen and rejected sums.

  Raises:
    ValueError: an unreadable file, or not one ``write_reference`` wrote (named).
  """
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise ValueError(f"The precomputed DPO reference {path!r} cannot be read: {e}.") from None
  head = len(_MAGIC) + 8
  count = int.from_bytes(raw[len(_MAGIC) : head], "little") if raw.startswith(_MAGIC) else -1
  if count < 0 or len(raw) != head + 16 * count:
    raise ValueError(f"{path!r} is not a precomputed DPO reference of this version (delete it to compute it again).")
  hashes = np.frombuffer(raw, "<u8", count, head)
  chosen = np.frombuffer(raw, "<f4", count, head + 8 * count)
  return hashes, chosen, np.frombuffer(raw, "<f4", count, head + 12 * count)


def encode_pair(
  encoder: ChatEncoder, record: Mapping[str, Any], where: str = "record"
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
  """A preference record's ``(ids, mask)`` for the chosen and for the rejected sequence (``encoder.loss_on``
  is ``completion``: the completions are scored).

  Raises:
    ValueError: a record without ``chosen`` and ``rejected``, or with parts of mixed kinds (named).
  """
  if not isinstance(record, Mapping) or "chosen" not in record or "rejected" not in record:
    keys = sorted(record)[:8] if isinstance(record, Mapping) else type(record).__name__
    raise ValueError(
      f"{where}: a preference record holds 'chosen' and 'rejected' (and 'prompt' or 'messages'"
      f" unless they are whole conversations); it has {keys}."
    )
  prompt = record.get("prompt", record.get("messages"))
  out = []
  for name in ("chosen", "rejected"):
    completion, here = record[name], f"{where} ({name})"
    if prompt is None:
      if isinstance(completion, str):
        raise ValueError(f"{here}: a completion given as text needs a 'prompt'.")
      out.append(encoder.encode({"messages": check_messages(completion, here)}, here))
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
      raise ValueError(
        f"Preference pairs score their completions: data.loss_on={self.encoder.loss_on!r} must be completion."
      )
    self._reference_file = getattr(config, "reference_logps", "")
    self._reference: dict[int, tuple[float, float]] | None = None
    if self._reference_file:
      self.dtype = PAIR_TOKENS

  def _reference_of(self, doc: str) -> tuple[float, float]:
    """The record's precomputed reference sums (chosen, rejected)."""
    if self._reference is None:
      if self._reference_file == REFERENCE_PENDING:
        raise ValueError(
          "dpo.precompute_reference: the reference's pass has not run yet"
          " (posttrain/reference_pass.ensure names its file in data.reference_logps)."
        )
      hashes, chosen, rejected = read_reference(self._reference_file)
      self._reference = dict(zip(hashes.tolist(), zip(chosen.tolist(), rejected.tolist())))
    found = self._reference.get(record_hash(doc))
    if found is None:
      raise ValueError(
        f"The preference record {doc[:100]!r}… is not in the precomputed DPO reference"
        f" {self._reference_file!r}: the data changed since; delete the file to compute it again."
      )
    return found

  def __call__(self, doc: str) -> np.ndarray:
    try:
      record = json.loads(doc)
    except ValueError:
      raise ValueError(f"A preference record is not JSON: {doc[:80]!r}.") from None
    (chosen, chosen_mask), (rejected, rejected_mask) = encode_pair(
      self.encoder, record, where=f"The preference record {doc[:100]!r}…"
    )
    if len(chosen) + len(rejected) > self.limit:
      self.long += 1
      if self.drop:
        return np.zeros(0, self.dtype)
      half = self.limit // 2
      keep = min(len(chosen), max(half, self.limit - len(rejected)))  # the shorter half whole, where it fits
      chosen, chosen_mask = chosen[:keep], chosen_mask[:keep]
      rejected, rejected_mask = rejected[: self.limit - keep], rejected_mask[: self.limit - keep]
    out = np.empty(len(chosen) + len(rejected), self.dtype)
    out["ids"] = np.concatenate([chosen, rejected])
    out["loss"] = np.concatenate([chosen_mask.astype(np.int32), rejected_mask.astype(np.int32) | REJECTED])
    if self._reference_file:  # each sum on its sequence's first scored target (a token past the first)
      out["ref"] = 0.0
      for value, start, mask in zip(self._reference_of(doc), (0, len(chosen)), (chosen_mask, rejected_mask)):
        scored = np.flatnonzero(mask[1:])
        if len(scored):
          out["ref"][start + 1 + scored[0]] = value
    return out
