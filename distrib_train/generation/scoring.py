"""Log-likelihoods of token sequences, many packed into each row: what an evaluation harness asks of a model.

``Scorer(model, mesh=…, rules=…).score(sequences, scored)`` gives, for each
sequence of ids, the summed log-probability of its last ``scored[i]`` tokens
(each given the ones before it) and whether every one of them is the
model's argmax there (``Score``).

Sequences that differ only in their last token (a question's answer
letters, or choices that share all but their last token) are computed once:
their common prefix is one sequence, and the logits at its last position
are read for each last token — lm-eval's ``hf`` model does the same for
one-token continuations.

The prefixes are packed as the trainer packs documents: best fit, longest
first, into rows of up to ``row_len`` tokens (rows as short as their
sequences allow, ``shortest`` at least: short rows cost less attention), each
sequence a segment of its own (``segment_ids``, positions from 0), so the
attention of one never reads another and no row is padded more than its
tail. Rows go through the model ``rows`` at a time, one compiled program per
shape, the activations laid out by the rules as in training; the figures
inside a prefix come from the chunked head
(``kernels/cross_entropy.chunked_scores``: no float32 [rows, length, vocab]
array), the last tokens' from the logits at each prefix's end.

Not for: requests as text (``training/harness.py``), sampling (``engine.py``).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
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


def pack(lengths: Sequence[int], row_len: int, shortest: int = 0) -> tuple[list[tuple[int, int]], list[int]]:
  """``(row, offset)`` of each length, and each row's length: best fit, longest first, into rows of ``row_len``
  (each length at most that) — or, with ``shortest``, a new row as short as fits its first sequence (a power of
  two, ``shortest`` at least), later ones filling its room: short sequences share short rows, whose attention
  costs less."""
  order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
  free: list[tuple[int, int]] = []  # (room left, row), sorted
  sizes: list[int] = []
  placed: list[tuple[int, int]] = [(0, 0)] * len(lengths)
  for i in order:
    n = lengths[i]
    at = bisect.bisect_left(free, (n, -1))
    if at == len(free):
      size = row_len if not shortest else min(row_len, max(shortest, 1 << max(0, n - 1).bit_length()))
      room, row = size, len(sizes)
      sizes.append(size)
    else:
      room, row = free.pop(at)
    placed[i] = (row, sizes[row] - room)
    if room - n > 0:
      bisect.insort(free, (room - n, row))
  return placed, sizes


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
    self._programs: dict[tuple[int, ...], Any] = {}

  @property
  def compiles(self) -> int:
    return len(self._programs)

  def score(self, sequences: Sequence[Sequence[int]], scored: Sequence[int], *, row_len: int, rows: int = 8,
            shortest: int = 0) -> list[Score]:
    """Each sequence's last ``scored[i]`` tokens scored (module docstring); ``row_len``: the longest row (each
    sequence, less its last token, must fit), ``shortest``: rows as short as their sequences allow, this many
    tokens at least (``pack``; 0: every row ``row_len``); ``rows``: rows per call (rounded up to the devices the
    batch splits over).

    Raises:
      ValueError: a sequence too long for a row, one with nothing to score, ids outside the vocabulary (named).
    """
    vocab = self.config.vocab_size
    prefixes: dict[tuple[int, ...], int] = {}
    finals: list[list[tuple[int, int, int]]] = []  # per prefix: (sequence, last token, prefix tokens scored)
    for i, (ids, k) in enumerate(zip(sequences, scored)):
      if not 1 <= k < len(ids):
        raise ValueError(f"sequence {i}: {k} tokens to score of {len(ids)}; each scored token needs one before it.")
      if len(ids) - 1 > row_len:
        raise ValueError(f"sequence {i}: {len(ids)} tokens do not fit a row of {row_len} (+1).")
      if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"sequence {i} holds token id {max(ids) if max(ids) >= vocab else min(ids)}, outside the"
                         f" model's vocabulary of {vocab}.")
      prefix = tuple(ids[:-1])
      if prefix not in prefixes:
        prefixes[prefix] = len(finals)
        finals.append([])
      finals[prefixes[prefix]].append((i, int(ids[-1]), k - 1))
    keys = list(prefixes)
    placed, sizes = pack([len(p) for p in keys], row_len, shortest)
    multiple = batch_multiple(self.mesh, self.rules)
    rows = -(-max(rows, 1) // multiple) * multiple
    members: dict[int, list[int]] = {}
    for p, (row, _) in enumerate(placed):
      members.setdefault(row, []).append(p)
    slots = 1 << (max(map(len, members.values()), default=1) - 1).bit_length()  # prefixes in a row
    width = 1 << (max(map(len, finals), default=1) - 1).bit_length()  # last tokens of a prefix
    by_size: dict[int, list[int]] = {}
    for row, size in enumerate(sizes):
      by_size.setdefault(size, []).append(row)
    out: list[Score | None] = [None] * len(sequences)
    for size, row_ids in sorted(by_size.items()):
      for first in range(0, len(row_ids), rows):
        chunk = [members[row] for row in row_ids[first:first + rows]]
        self._call(keys, finals, placed, chunk, (rows, size, slots, width), out)
    return out  # type: ignore[return-value]

  def _call(self, keys, finals, placed, chunk: list[list[int]], shape: tuple[int, int, int, int], out: list) -> None:
    """One call of the program for ``shape`` (rows, length, prefixes a row, last tokens a prefix): the rows of
    ``chunk`` (each its prefixes' indices), their sequences' scores into ``out``."""
    rows, size, slots, width = shape
    arrays = {name: np.zeros((rows, size), np.int32) for name in ("tokens", "positions", "segment", "targets")}
    ends, lasts = np.zeros((rows, slots), np.int32), np.zeros((rows, slots, width), np.int32)
    for r, prefixes in enumerate(chunk):
      for n, p in enumerate(prefixes):
        ids, at = np.asarray(keys[p], np.int32), placed[p][1]
        span = (r, slice(at, at + len(ids)))
        arrays["tokens"][span], arrays["positions"][span], arrays["segment"][span] = ids, np.arange(len(ids)), n + 1
        arrays["targets"][r, at:at + len(ids) - 1] = ids[1:]
        ends[r, n], lasts[r, n, :len(finals[p])] = at + len(ids) - 1, [t for _, t, _ in finals[p]]
    with activation_sharding(self.mesh, self.rules) if self.mesh is not None else contextlib.nullcontext():
      inner, inner_greedy, last, last_greedy = self._program(*shape)(
          self.state, arrays["tokens"], arrays["positions"], arrays["segment"], arrays["targets"], ends, lasts)
    inner, inner_greedy, last, last_greedy = map(np.asarray, (inner, inner_greedy, last, last_greedy))
    for r, prefixes in enumerate(chunk):
      for n, p in enumerate(prefixes):
        end = placed[p][1] + len(keys[p]) - 1  # the prefix's last position: its last tokens' logits
        for j, (i, _, k) in enumerate(finals[p]):
          values = (*inner[r, end - k:end].tolist(), float(last[r, n, j]))
          greedy = bool(np.all(inner_greedy[r, end - k:end])) and bool(last_greedy[r, n, j])
          out[i] = Score(float(np.sum(values, dtype=np.float64)), greedy, tuple(values))

  def _program(self, rows: int, size: int, slots: int, width: int):
    key = (rows, size, slots, width)
    if key not in self._programs:
      graphdef, config = self.graphdef, self.config

      def run(state, tokens, positions, segment_ids, targets, ends, lasts):
        model = nnx.merge(graphdef, state)
        hidden, _ = model.hidden_and_aux(tokens, positions=positions, segment_ids=segment_ids)
        inner, inner_greedy = chunked_scores(hidden, model.head_weight(), targets, config.loss_chunk_size,
                                             softcap=config.final_logit_softcap)
        logits = model.logits(jnp.take_along_axis(hidden, ends[..., None], axis=1)).astype(jnp.float32)
        last = jnp.take_along_axis(jax.nn.log_softmax(logits), lasts, axis=-1)  # [rows, slots, width]
        return inner, inner_greedy, last, jnp.argmax(logits, axis=-1)[..., None] == lasts

      replicated = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
      self._programs[key] = jax.jit(run, out_shardings=replicated)
    return self._programs[key]
