"""Log-likelihoods of token sequences, many packed into each row: what an evaluation harness asks of a model.

``Scorer(model, mesh=…, rules=…).score(sequences, scored)`` gives, for each
sequence of ids, the summed log-probability of its last ``scored[i]`` tokens
(each given the ones before it) and whether every one of them is the
model's argmax there (``Score``).

A prefix is computed once for all the sequences that share it. Sequences
whose tokens before their last one share a prefix become one *tree*: the
prefix (the *trunk*: a question's context, or a few-shot prompt its
questions follow) once, then each distinct rest (a *branch*) after it in
the same row, its positions continuing the trunk's, seeing the trunk and
itself and no other branch (``kernels/attention/dispatch.shared_prefixes``:
XLA's attention with that mask). A sequence's last token and a branch's
first are read from the logits at the end of its branch or of the trunk, so
continuations that differ only in their last token (a question's answer
letters) add nothing — lm-eval's ``hf`` model computes those once too, but
each multi-token continuation with its context again, and each question
with its few-shot prompt. Which sequences share a trunk: ``_groups`` (runs
of the sorted inputs, cut where that computes the fewest tokens; one level
of branches; none under ``MIN_TRUNK`` ids shared). A tree holds ``dispatch.TILE``
tokens at most (the XLA attention's dense scores); more branches make more
trees of the same trunk, and an input too long for that is scored alone.

The trees are packed as the trainer packs documents: best fit, longest
first, the trees with branches apart from those without (which run the
layers' own kernels), into rows as short as their trees allow (``shortest``
at least, ``row_len`` or, for trees, ``TILE`` at most; without
``shortest`` every row that long), each tree a segment of its own
(``segment_ids``, positions from 0), so no tree's attention reads another's
and no row is padded more than its tail; on a GPU, fewer trees a row than
cuDNN's packed attention takes runs. Rows go through the model ``rows`` at
a time, one compiled program per shape, the activations laid out by the
rules as in training; the figures inside a trunk or branch come from the
chunked head (``kernels/cross_entropy.chunked_scores``: no float32 [rows,
length, vocab] array), the ones read at its end from the logits there.

Not for: requests as text (``evaluation/harness.py``), sampling (``engine.py``).
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
from distrib_train.kernels.attention.cudnn import packs_rows
from distrib_train.kernels.attention.dispatch import TILE, shared_prefixes
from distrib_train.kernels.cross_entropy import chunked_scores
from distrib_train.sharding.axis_rules import activation_sharding


@dataclasses.dataclass(frozen=True)
class Score:
  """A sequence's scored tokens: ``logprob`` (their log-probabilities summed), ``greedy`` (each the argmax) and
  ``logprobs`` (each one's)."""

  logprob: float
  greedy: bool
  logprobs: tuple[float, ...]


def pack(
  lengths: Sequence[int], row_len: int, shortest: int = 0, per_row: int = 0
) -> tuple[list[tuple[int, int]], list[int]]:
  """``(row, offset)`` of each length, and each row's length: best fit, longest first, into rows of ``row_len``
  (each length at most that) — or, with ``shortest``, a new row as short as fits its first sequence (a power of
  two, ``shortest`` at least), later ones filling its room: short sequences share short rows, whose attention
  costs less. ``per_row``: at most this many sequences a row (0: any)."""
  order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
  free: list[tuple[int, int]] = []  # (room left, row), sorted
  sizes: list[int] = []
  counts: list[int] = []
  placed: list[tuple[int, int]] = [(0, 0)] * len(lengths)
  for i in order:
    n = lengths[i]
    at = bisect.bisect_left(free, (n, -1))
    if at == len(free):
      size = row_len if not shortest else min(row_len, max(shortest, 1 << max(0, n - 1).bit_length()))
      room, row = size, len(sizes)
      sizes.append(size)
      counts.append(0)
    else:
      room, row = free.pop(at)
    placed[i] = (row, sizes[row] - room)
    counts[row] += 1
    if room - n > 0 and counts[row] != per_row:
      bisect.insort(free, (room - n, row))
  return placed, sizes


@dataclasses.dataclass(frozen=True)
class Layout:
  """How ``Scorer.score`` laid its last sequences out: how many, the trees and branches they made, the tokens
  computed and each row's length."""

  sequences: int
  trees: int
  branches: int
  tokens: int
  rows: tuple[int, ...]

  def __str__(self) -> str:
    rows = " + ".join(f"{self.rows.count(n)} × {n}" for n in sorted(set(self.rows)))
    return (
      f"{self.sequences} sequences as {self.trees} trees with {self.branches} branches, {self.tokens:,}"
      f" tokens in rows of {rows}"
    )


MIN_TRUNK = 8  # a shorter common prefix is not shared: it saves less than the branches' mask costs
_RUN = 64  # the most inputs one trunk's run may hold (``_groups``' search; each tree holds ``cap`` ids anyway)


@dataclasses.dataclass
class _Tree:
  """A trunk, its branches (each the ids after the trunk), and what is read at the end of each: ``reads[0]``
  at the trunk's last position, ``reads[b]`` at branch ``b``'s (the ids whose log-probability is read)."""

  trunk: tuple[int, ...]
  branches: list[tuple[int, ...]]
  reads: list[list[int]]

  @property
  def size(self) -> int:
    return len(self.trunk) + sum(map(len, self.branches))


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
  """How many leading ids ``a`` and ``b`` share, up to ``limit``."""
  return next((n for n in range(min(limit, len(a), len(b))) if a[n] != b[n]), min(limit, len(a), len(b)))


def _groups(distinct: list[tuple[int, ...]], cap: int) -> list[tuple[int, int, int]]:
  """The sorted ``distinct`` inputs cut into runs ``(first, end, trunk)`` that share their first ``trunk`` ids:
  the cut that computes the fewest tokens (a run of ``m`` inputs of ``S`` ids in all sharing ``T``: ``S − m·T``
  for their branches, and ``T`` again for each tree of ``cap`` ids they need), by dynamic programming over runs
  of up to ``_RUN`` inputs; a run shares ``MIN_TRUNK`` ids at least, and holds no input longer than ``cap``."""
  n = len(distinct)
  total = [0]
  for ids in distinct:
    total.append(total[-1] + len(ids))
  common = [_common(distinct[i], distinct[i + 1], len(distinct[i])) for i in range(n - 1)]
  best, cut = [0] * (n + 1), [(0, 0)] * (n + 1)  # best[j]: the fewest tokens for the first j inputs
  for j in range(1, n + 1):
    best[j], cut[j] = best[j - 1] + len(distinct[j - 1]), (j - 1, len(distinct[j - 1]))  # the input alone
    trunk, longest = len(distinct[j - 1]), len(distinct[j - 1])
    for i in range(j - 2, max(-1, j - 1 - _RUN), -1):  # the run i .. j - 1
      trunk, longest = min(trunk, common[i]), max(longest, len(distinct[i]))
      if trunk < MIN_TRUNK or longest > cap or trunk >= cap:
        break
      rest = total[j] - total[i] - (j - i) * trunk
      cost = best[i] + rest + trunk * max(1, -(-rest // (cap - trunk)))
      if cost < best[j]:
        best[j], cut[j] = cost, (i, trunk)
  runs, j = [], n
  while j:
    i, trunk = cut[j]
    runs.append((i, j, trunk))
    j = i
  return runs[::-1]


def _trees(inputs: list[tuple[int, ...]], share: bool, cap: int) -> tuple[list[_Tree], list[tuple[int, int]]]:
  """The trees of ``inputs`` (each sequence less its last id) and, per input, ``(tree, branch)`` (branch 0: it
  ends at the trunk's end). The sorted distinct inputs are cut into runs that share a trunk (``_groups``: a
  few-shot prompt, or a question's context, its questions or choices the branches); each run's branches fill
  trees of at most ``cap`` ids first fit, longest first, each tree with the trunk again; a tree that would hold
  one input alone is that input, with no branch (no mask to pay for). Without ``share``, identical inputs alone
  share."""
  distinct = sorted(set(inputs))
  runs = _groups(distinct, cap) if share else [(i, i + 1, len(ids)) for i, ids in enumerate(distinct)]
  clusters = [(trunk, distinct[i:j]) for i, j, trunk in runs]
  trees: list[_Tree] = []
  placed: dict[tuple[int, ...], tuple[int, int]] = {}
  for shared, members in clusters:
    trunk, mine = members[0][:shared], []  # mine: this trunk's trees
    for ids in sorted(members, key=len, reverse=True):  # first fit, the longest branch first
      rest = ids[shared:]
      if len(ids) > cap:  # too long to share: a tree of its own, no branch
        trees.append(_Tree(ids, [], [[]]))
        placed[ids] = (len(trees) - 1, 0)
        continue
      at = next((t for t in mine if not rest or trees[t].size + len(rest) <= cap), None)
      if at is None:
        trees.append(_Tree(trunk, [], [[]]))
        at = len(trees) - 1
        mine.append(at)
      if rest:
        trees[at].branches.append(rest)
        trees[at].reads.append([])
      placed[ids] = (at, len(trees[at].branches) if rest else 0)
  ending = {t for t, b in placed.values() if b == 0}
  alone = {t for t, tree in enumerate(trees) if len(tree.branches) == 1 and t not in ending}
  for t in alone:  # one branch and nothing ending at the trunk: the input, no mask
    trees[t] = _Tree(trees[t].trunk + trees[t].branches[0], [], [[]])
  placed = {ids: (t, 0 if t in alone else b) for ids, (t, b) in placed.items()}
  return trees, [placed[ids] for ids in inputs]


def _reads(tree: _Tree, ids: Sequence[int], k: int, b: int) -> list[tuple[int, int]]:
  """``(end, id)`` a sequence in ``tree``'s branch ``b`` (0: none) reads: at the trunk's end (0) the id after the
  trunk if it is scored, at its branch's end its last id."""
  trunk = len(tree.trunk)
  out = [(0, int(ids[trunk]))] if len(ids) - 1 - k <= trunk - 1 else []
  return out + [(b, int(ids[-1]))] if b else out


class Scorer:
  """Scores sequences with ``model`` (a reference decoder), its params as they are laid out (``mesh`` and
  ``rules``: the activations' layout, as in training). ``state`` may be replaced by later weights of the same
  layout (a training run's): the compiled programs stay."""

  def __init__(self, model: Any, *, mesh: Any = None, rules: Any = None):
    if mesh is not None and rules is None:
      raise ValueError("Scorer: a mesh needs its axis rules (rules=).")
    if mesh is not None and dict(mesh.shape).get("context", 1) > 1:
      raise ValueError(
        "Scorer: the mesh's context axis splits each row's length; score on a mesh without one (--mesh_config)."
      )
    self.config = model.config
    self.graphdef, self.state = nnx.split(model)
    self.mesh, self.rules = mesh, rules
    self._programs: dict[tuple[int, ...], Any] = {}
    self.layout: Layout | None = None  # the last score's

  @property
  def compiles(self) -> int:
    return len(self._programs)

  @property
  def _per_row(self) -> int:
    """The sequences a plain row may hold: where cuDNN's packed attention runs it (``cudnn.packs_rows``), fewer
    than the runs it takes, which it would otherwise merge; elsewhere any number."""
    caps = self.config.capabilities()
    device = self.mesh.devices.flat[0] if self.mesh is not None else jax.devices()[0]
    return caps.max_segments - 1 if packs_rows(caps.max_segments, caps.attention, caps.dtype, device) else 0

  def score(
    self,
    sequences: Sequence[Sequence[int]],
    scored: Sequence[int],
    *,
    row_len: int,
    rows: int = 8,
    shortest: int = 0,
    share: bool = True,
  ) -> list[Score]:
    """Each sequence's last ``scored[i]`` tokens scored (module docstring); ``row_len``: the longest row (each
    sequence, less its last token, must fit; with ``shortest``, trees fill rows of up to ``dispatch.TILE``);
    ``shortest``: rows as short as their trees allow, this many tokens at least (``pack``; 0: every row
    ``row_len``); ``rows``: rows per call (rounded up to the devices the batch splits over); ``share``:
    sequences that share a prefix in one tree (module docstring; False: each distinct sequence less its last id
    its own). ``layout`` then says how they were laid out.

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
        raise ValueError(
          f"sequence {i} holds token id {max(ids) if max(ids) >= vocab else min(ids)}, outside the"
          f" model's vocabulary of {vocab}."
        )
    if not sequences:
      return []
    longest, shortest = (max(row_len, TILE), min(shortest, row_len)) if shortest else (row_len, 0)
    trees, where = _trees([tuple(int(t) for t in ids[:-1]) for ids in sequences], share, min(longest, TILE))
    for (t, b), ids, k in zip(where, sequences, scored):  # the ids each sequence reads at its tree's ends
      for end, token in _reads(trees[t], ids, k, b):
        if token not in trees[t].reads[end]:
          trees[t].reads[end].append(token)
    placed: list[tuple[int, int]] = [(0, 0)] * len(trees)
    sizes: list[int] = []
    kinds: list[bool] = []  # each row's: branched trees (XLA's attention, TILE long at most) or not (its kernels)
    for branched in (False, True):
      group = [t for t, tree in enumerate(trees) if bool(tree.branches) == branched]
      spots, group_sizes = pack(
        [trees[t].size for t in group],
        min(longest, TILE) if branched else row_len,
        shortest,
        0 if branched else self._per_row,
      )
      for t, (row, at) in zip(group, spots):
        placed[t] = (len(sizes) + row, at)
      sizes += group_sizes
      kinds += [branched] * len(group_sizes)
    self.layout = Layout(
      len(sequences), len(trees), sum(len(t.branches) for t in trees), sum(t.size for t in trees), tuple(sizes)
    )
    multiple = batch_multiple(self.mesh, self.rules)
    rows = -(-max(rows, 1) // multiple) * multiple
    members: dict[int, list[int]] = {}
    for t, (row, _) in enumerate(placed):
      members.setdefault(row, []).append(t)
    # ends a row, ids read at an end: powers of two, at least 16 and 4, so that calls share their programs
    ends = max(16, 1 << (max(sum(1 + len(trees[t].branches) for t in ts) for ts in members.values()) - 1).bit_length())
    width = max(4, 1 << (max(len(r) for tree in trees for r in tree.reads) - 1).bit_length())
    by_shape: dict[tuple[int, bool], list[int]] = {}
    for row, (size, branched) in enumerate(zip(sizes, kinds)):
      by_shape.setdefault((size, branched), []).append(row)
    figures: dict[int, tuple] = {}  # tree → (row in its call, the call's outputs)
    for (size, branched), row_ids in sorted(by_shape.items()):
      for first in range(0, len(row_ids), rows):
        chunk = [members[row] for row in row_ids[first : first + rows]]
        # a shape's last call as few rows as hold it (a power of two, the batch's devices at least): a call of
        # ``rows`` rows holding one computed them all
        few = min(rows, -(-max(1 << (len(chunk) - 1).bit_length(), multiple) // multiple) * multiple)
        outputs = self._call(trees, placed, chunk, (few, size, ends, width, branched))
        for r, ts in enumerate(chunk):
          for t in ts:
            figures[t] = (r, outputs)
    return [self._figures(trees, placed, figures, seq, k, t, b) for seq, k, (t, b) in zip(sequences, scored, where)]

  def _figures(self, trees, placed, figures, ids, k: int, t: int, b: int) -> Score:
    """One sequence's ``Score`` from its tree's outputs, its scored positions in order: those inside the trunk,
    the id read at the trunk's end, those inside its branch, the id read at the branch's end (``_reads``)."""
    tree, at = trees[t], placed[t][1]
    r, (inner, inner_greedy, read, read_greedy, slot) = figures[t]
    trunk, start = len(tree.trunk), len(ids) - 1 - k  # start: the input position predicting the first scored id
    spans = [(at + start, at + trunk - 1)]  # row places of the figures before each end
    if b:
      branch_at = at + trunk + sum(map(len, tree.branches[: b - 1]))
      spans.append((branch_at + max(start - trunk, 0), branch_at + len(ids) - 2 - trunk))
    values: list[float] = []
    greedy = True
    for (end, token), (lo, hi) in zip(_reads(tree, ids, k, b), spans[-len(_reads(tree, ids, k, b)) :]):
      values += inner[r, lo:hi].tolist()
      greedy = greedy and bool(np.all(inner_greedy[r, lo:hi]))
      n, j = slot[t][end], tree.reads[end].index(token)
      values.append(float(read[r, n, j]))
      greedy = greedy and bool(read_greedy[r, n, j])
    return Score(float(np.sum(values, dtype=np.float64)), greedy, tuple(values))

  def _call(self, trees, placed, chunk: list[list[int]], shape: tuple) -> tuple:
    """One call of the program for ``shape`` (rows, length, ends a row, ids read at an end, branched) on the
    rows of ``chunk`` (each its trees' indices): its outputs on the host, and where each tree's ends are."""
    rows, size, ends, width, _ = shape
    arrays = {
      name: np.zeros((rows, size), np.int32) for name in ("tokens", "positions", "segment", "branch", "targets")
    }
    points, reads = np.zeros((rows, ends), np.int32), np.zeros((rows, ends, width), np.int32)
    slot: dict[int, list[int]] = {}
    for r, ts in enumerate(chunk):
      n = 0
      for s, t in enumerate(ts):
        tree, at = trees[t], placed[t][1]
        slot[t] = []
        for b, part in enumerate([tree.trunk, *tree.branches]):
          offset = 0 if b == 0 else len(tree.trunk)
          span = (r, slice(at, at + len(part)))
          arrays["tokens"][span], arrays["positions"][span] = part, offset + np.arange(len(part))
          arrays["segment"][span], arrays["branch"][span] = s + 1, b
          arrays["targets"][r, at : at + len(part) - 1] = part[1:]
          points[r, n], reads[r, n, : len(tree.reads[b])] = at + len(part) - 1, tree.reads[b]
          slot[t].append(n)
          n, at = n + 1, at + len(part)
    with activation_sharding(self.mesh, self.rules) if self.mesh is not None else contextlib.nullcontext():
      outputs = self._program(*shape)(
        self.state,
        arrays["tokens"],
        arrays["positions"],
        arrays["segment"],
        arrays["branch"],
        arrays["targets"],
        points,
        reads,
      )
    return (*map(np.asarray, outputs), slot)

  def _program(self, rows: int, size: int, ends: int, width: int, branched: bool):
    key = (rows, size, ends, width, branched)
    if key not in self._programs:
      graphdef, config = self.graphdef, self.config

      def run(state, tokens, positions, segment_ids, branch_ids, targets, points, reads):
        model = nnx.merge(graphdef, state)
        with shared_prefixes(branch_ids) if branched else contextlib.nullcontext():
          hidden, _ = model.hidden_and_aux(tokens, positions=positions, segment_ids=segment_ids)
        inner, inner_greedy = chunked_scores(
          hidden, model.head_weight(), targets, config.loss_chunk_size, softcap=config.final_logit_softcap
        )
        logits = model.logits(jnp.take_along_axis(hidden, points[..., None], axis=1)).astype(jnp.float32)
        read = jnp.take_along_axis(jax.nn.log_softmax(logits), reads, axis=-1)  # [rows, ends, width]
        return inner, inner_greedy, read, jnp.argmax(logits, axis=-1)[..., None] == reads

      replicated = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
      self._programs[key] = jax.jit(run, out_shardings=replicated)
    return self._programs[key]
