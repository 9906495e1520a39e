"""One sequence of ``seq_len + 1`` tokens → one batch row: inputs, targets and their weights.

A row's ``tokens`` are the sequence less its last token and its ``targets``
the sequence less its first (each ``seq_len``). A packed sequence (the names
grain's packing gives: ``tokens``, ``tokens_segment_ids``,
``tokens_positions``) also yields ``segment_ids`` and ``positions``, and a
target weighs 0 where it is padding or belongs to another document than its
input; an unpacked sequence (the head of one document) weighs 1 throughout. A
conversation's targets also weigh 0 where its loss mask (``tokens_loss``,
``chat.py``) is off. A preference pair (``preference.py``) is one packed
document whose rejected half is marked in its loss codes: the half becomes a
segment of its own (its positions from 0), so a pair ``k`` of a row holds
segments ``2k − 1`` (chosen) and ``2k`` (rejected), and the rejected
completion's targets weigh −1; a precomputed reference's figures
(``tokens_ref``) become ``reference_logps``, beside the targets.

Both reads use these: the endless lanes (``lanes.py``) and the finite pass
(``finite.py``). Not for: packing, batching or placing rows on devices.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def shifted(packed: Mapping[str, np.ndarray], max_documents: int = 0) -> dict[str, np.ndarray]:
  """The row of a packed sequence (``tokens``, ``tokens_segment_ids``, ``tokens_positions``).

  ``max_documents`` (0: any number): the documents past that many in the
  row become one segment whose targets weigh 0, so the row holds at most
  ``max_documents + 1`` runs of segment ids, the padding at its end
  included (cuDNN's packed attention takes a fixed number,
  ``kernels/attention/cudnn.py``).
  """
  tokens, segments, positions = packed["tokens"], packed["tokens_segment_ids"], packed["tokens_positions"]
  loss = packed.get("tokens_loss")
  sign = None
  if loss is not None and (rejected := (loss & 2) > 0).any():  # preference pairs: each half its own segment
    starts = rejected & ~np.concatenate([[False], rejected[:-1]])
    segments = np.where(segments > 0, segments + np.cumsum(starts), 0)
    index = np.arange(len(positions))
    first = np.maximum.accumulate(np.where(starts, index, 0))  # the latest half's start
    positions = np.where(rejected, index - first, positions)
    sign = np.where(rejected[1:], -1.0, 1.0)
  same_document = (segments[1:] == segments[:-1]) & (segments[:-1] > 0)
  if max_documents and segments.max(initial=0) > max_documents:
    same_document &= segments[:-1] <= max_documents
    segments = np.where((segments > max_documents) | (segments == 0), max_documents + 1, segments)
  if loss is not None:  # a conversation's: only the targets its loss mask reads
    same_document &= (loss[1:] & 1) > 0
  weights = same_document.astype(np.float32) if sign is None else same_document * sign.astype(np.float32)
  extra = {"reference_logps": packed["tokens_ref"][1:].astype(np.float32)} if "tokens_ref" in packed else {}
  return {
    "tokens": tokens[:-1].astype(np.int32),
    "targets": tokens[1:].astype(np.int32),
    "segment_ids": segments[:-1].astype(np.int32),
    "positions": positions[:-1].astype(np.int32),
    "weights": weights,
    **extra,
  }


def unpacked(tokens: np.ndarray, loss: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """The row of one document's head, ``seq_len + 1`` tokens; a conversation's (padded) weighs its loss mask."""
  weights = np.ones(len(tokens) - 1, np.float32) if loss is None else ((loss[1:] & 1) > 0).astype(np.float32)
  return {
    "tokens": tokens[:-1].astype(np.int32),
    "targets": tokens[1:].astype(np.int32),
    "weights": weights,
  }
