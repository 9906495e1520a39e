"""Log-likelihoods of token sequences, many packed into each row: what an evaluation harness asks of a model.

``Scorer(model, mesh=…, rules=…).score(sequences, scored)`` gives, for each
sequence of ids, the summed log-probability of its last ``scored[i]`` tokens
(each given the ones before it) and whether every one of them is the
model's argmax there (``Score``).

The sequences are packed as the trainer packs documents: best fit, longest
first, into rows of ``row_len`` tokens, each sequence a segment of its own
(``segment_ids``, positions from 0), so the attention of one never reads
another and no row is padded more than its tail. Rows go through the model
``rows`` at a time, one compiled program per (rows, row length), the
activations laid out by the rules as in training; the figures come from the
chunked head (``kernels/cross_entropy.chunked_scores``: no float32 [rows,
length, vocab] array).

Not for: requests as text (``training/harness.py``), sampling (``engine.py``).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from distrib_train.generation.engine import batch_multiple
from distrib_train.kernels.cross_entropy import chunked_scores
from distrib_train.sharding.axis_rules import activation_sharding


@dataclasses.dataclass(frozen=True)
class Score:
  """A sequence's scored tokens: ``logprob`` (their log-probabilities summed), ``greedy`` (each the argmax) and
  ``logprobs`` (each one's)."""

  logprob: float
  greedy: bool
  logprobs: tuple[float, ...]


def pack(lengths: Sequence[int], row_len: int) -> list[tuple[int, int]]:
  """``(row, offset)`` of each length in rows of ``row_len``: best fit, longest first (each at most
  ``row_len``)."""
  order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
  free: list[tuple[int, int]] = []  # (room left, row), sorted
  rows = 0
  placed: list[tuple[int, int]] = [(0, 0)] * len(lengths)
  for i in order:
    n = lengths[i]
    at = bisect.bisect_left(free, (n, -1))
    if at == len(free):
      room, row = row_len, rows
      rows += 1
    else:
      room, row = free.pop(at)
    placed[i] = (row, row_len - room)
    if room - n > 0:
      bisect.insort(free, (room - n, row))
  return placed


class Scorer:
  """Scores sequences with ``model`` (a reference decoder), its params as they are laid out (``mesh`` and
  ``rules``: the activations' layout, as in training). ``state`` may be replaced by later weights of the same
  layout (a training run's): the compiled programs stay."""

  def __init__(self, model: Any, *, mesh: Any = None, rules: Any = None):
    if mesh is not None and rules is None:
      raise ValueError("Scorer: a mesh needs its axis rules (rules=).")
    if mesh is not None and dict(mesh.shape).get("context", 1) > 1:
      raise ValueError("Scorer: the mesh's context axis splits each row's length; score on a mesh without one"
                       " (--mesh_config).")
    self.config = model.config
    self.graphdef, self.state = nnx.split(model)
    self.mesh, self.rules = mesh, rules
    self._programs: dict[tuple[int, int], Any] = {}

  @property
  def compiles(self) -> int:
    return len(self._programs)

  def _program(self, rows: int, row_len: int):
    key = (rows, row_len)
    if key not in self._programs:
      graphdef, config = self.graphdef, self.config

      def run(state, tokens, positions, segment_ids, targets):
        model = nnx.merge(graphdef, state)
        hidden, _ = model.hidden_and_aux(tokens, positions=positions, segment_ids=segment_ids)
        return chunked_scores(hidden, model.head_weight(), targets, config.loss_chunk_size,
                              softcap=config.final_logit_softcap)

      replicated = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
      self._programs[key] = jax.jit(run, out_shardings=replicated)
    return self._programs[key]

  def score(self, sequences: Sequence[Sequence[int]], scored: Sequence[int], *, row_len: int,
            rows: int = 8) -> list[Score]:
    """Each sequence's last ``scored[i]`` tokens scored (module docstring); ``row_len``: tokens per row (each
    sequence, less its last token, must fit), ``rows``: rows per call (rounded up to the devices the batch
    splits over).

    Raises:
      ValueError: a sequence too long for a row, one with nothing to score, ids outside the vocabulary (named).
    """
    vocab = self.config.vocab_size
    for i, (ids, k) in enumerate(zip(sequences, scored)):
      if not 1 <= k < len(ids):
        raise ValueError(f"sequence {i}: {k} tokens to score of {len(ids)}; each scored token needs one before it.")
      if len(ids) - 1 > row_len:
        raise ValueError(f"sequence {i}: {len(ids)} tokens do not fit a row of {row_len} (+1).")
      if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"sequence {i} holds token id {max(ids) if max(ids) >= vocab else min(ids)}, outside the"
                         f" model's vocabulary of {vocab}.")
    placed = pack([len(ids) - 1 for ids in sequences], row_len)
    multiple = batch_multiple(self.mesh, self.rules)
    rows = -(-max(rows, 1) // multiple) * multiple
    total = max((row for row, _ in placed), default=-1) + 1
    by_row: dict[int, list[int]] = {}
    for i, (row, _) in enumerate(placed):
      by_row.setdefault(row, []).append(i)
    out: list[Score | None] = [None] * len(sequences)
    program = self._program(rows, row_len) if sequences else None
    for first in range(0, total, rows):
      arrays = {name: np.zeros((rows, row_len), np.int32) for name in ("tokens", "positions", "segment", "targets")}
      for row in range(first, min(first + rows, total)):
        for segment, i in enumerate(by_row[row], 1):
          ids, (_, at) = np.asarray(sequences[i], np.int32), placed[i]
          n = len(ids) - 1
          span = (row - first, slice(at, at + n))
          arrays["tokens"][span], arrays["targets"][span] = ids[:-1], ids[1:]
          arrays["positions"][span], arrays["segment"][span] = np.arange(n), segment
      with activation_sharding(self.mesh, self.rules) if self.mesh is not None else contextlib.nullcontext():
        logprobs, greedy = program(self.state, arrays["tokens"], arrays["positions"], arrays["segment"],
                                   arrays["targets"])
      logprobs, greedy = np.asarray(logprobs), np.asarray(greedy)
      for row in range(first, min(first + rows, total)):
        for i in by_row[row]:
          n, at, k = len(sequences[i]) - 1, placed[i][1], scored[i]
          span = slice(at + n - k, at + n)
          values = logprobs[row - first, span]
          out[i] = Score(float(np.sum(values, dtype=np.float64)), bool(np.all(greedy[row - first, span])),
                         tuple(float(v) for v in values))
    return out  # type: ignore[return-value]
