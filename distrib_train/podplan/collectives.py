"""The collectives of a compiled XLA program: what moves, over which mesh axes, at what cost.

``find_collectives(hlo_text, mesh_shape, axis_names)`` reads the text of a
compiled, SPMD-partitioned module (``compiled.as_text()``) and returns one
``Collective`` per all-gather, reduce-scatter, all-reduce, all-to-all and
collective-permute (their async ``-start`` forms included), each with:

- how many times a step runs it: ops inside ``while`` loops (scanned layers)
  count ``known_trip_count`` times, nested loops multiply; every branch of a
  conditional counts (an upper bound);
- its payload per device: the gathered result for all-gather, the operand(s)
  for the others, from the shapes in the module; for a ragged all-to-all,
  the smaller of its input and its output buffer (the rows routed out and
  back under even routing: the other is sized for the worst case);
- its replica groups, in any of XLA's three spellings: explicit
  ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, and mesh
  axes ``mesh['x'=2,'y'=4], device_ids=([2,4]T(1,0)) {'y'}``;
- the mesh axes a group spans: device ids are positions in the mesh's device
  order (``mesh.devices.flat``), unravelled to mesh coordinates; the axes
  whose coordinate varies within a group are the collective's axes;
- whether a group crosses granules (TPU slices or hosts: DCN) when the
  caller says which granule each device position is in;
- whether an all-reduce is a reduce-scatter in all but name: the CPU
  compiler writes one as an all-reduce whose every use keeps ``1/n`` of it.

A multi-slice TPU program (libtpu, ``num_slices`` > 1) is one slice's
program: its replica groups number the devices of one slice (pass the
slice's ICI mesh shape), and what crosses slices is a ``send`` to the
Megascale runtime over DCN (``_xla_megascale_transfer_type="ALL_REDUCE"``,
…), counted as that collective over the DCN axes the caller names, among
all the slices (with two axes over DCN, a transfer along one of them is
charged as if it spanned every slice: an upper bound).

Wire bytes per device follow the ring model, for a group of ``n`` devices and
a payload of ``S`` bytes per device: all-gather and reduce-scatter
``(n-1)/n·S`` (``S`` the full, unsharded buffer), all-reduce ``2(n-1)/n·S``
(a reduce-scatter then an all-gather), all-to-all ``(n-1)/n·S``,
collective-permute ``S``. It ignores latency, topology (a torus axis vs a
switch) and overlap with compute.

Not for: reading the module text (``hlo.py``), the replica groups' spellings
(``replica_groups.py``) or the step-time model (``timing.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from distrib_train.podplan.hlo import (
  CALLS,
  Computation,
  Instruction,
  array_bytes,
  element_count,
  multiplicities,
  parse_module,
)
from distrib_train.podplan.replica_groups import parse_replica_groups, parse_source_target_pairs

_OPTIMIZER_SCOPE = re.compile(r'op_name="[^"]*/optimizer/')
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_OPS = (
  {kind: kind for kind in KINDS}
  | {f"{kind}-start": kind for kind in KINDS}
  | {"ragged-all-to-all": "all-to-all", "ragged-all-to-all-start": "all-to-all"}
)


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op of a compiled step.

  Attributes:
    kind: ``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all``
      or ``collective-permute``.
    name: the HLO instruction's name.
    count: how many times one step runs it (loop trip counts multiplied).
    group_size: devices per replica group (``n`` of the ring model).
    payload_bytes: bytes per device per run (see the module docstring).
    wire_bytes: bytes each device sends per run, ring model.
    axes: the mesh axes a group spans, e.g. ``("fsdp",)``; empty: none.
    partial: a group covers only part of those axes (a sub-axis).
    dcn: a group spans more than one granule (slice / host).
    sliced: an all-reduce whose every use keeps ``1/n`` of it (a
      reduce-scatter in all but name; ``wire_bytes`` counts it as one).
    optimizer: it came from the optimizer's update (the ``optimizer`` name
      scope ``train_state.apply_optimizer`` opens: Muon's Newton–Schulz).
  """

  kind: str
  name: str
  count: int
  group_size: int
  payload_bytes: int
  wire_bytes: float
  axes: tuple[str, ...]
  partial: bool = False
  dcn: bool = False
  sliced: bool = False
  optimizer: bool = False

  @property
  def axes_label(self) -> str:
    label = "+".join(self.axes) if self.axes else "-"
    return f"{label} (part)" if self.partial else label


def _wire_bytes(kind: str, payload: int, n: int) -> float:
  if n <= 1:
    return 0.0
  if kind == "all-reduce":
    return 2 * (n - 1) / n * payload
  if kind == "collective-permute":
    return float(payload)
  return (n - 1) / n * payload


def _axes_of(
  groups: Sequence[Sequence[int]], mesh_shape: Sequence[int], axis_names: Sequence[str], granule_of: np.ndarray | None
) -> tuple[tuple[str, ...], bool, bool]:
  """The mesh axes along which the devices of each group differ."""
  size = math.prod(mesh_shape)
  varying: set[int] = set()
  partial = dcn = False
  for group in groups:
    ids = np.asarray(group)
    if len(ids) < 2 or ids.max() >= size:
      continue
    coords = np.unravel_index(ids, tuple(mesh_shape))
    spans = [i for i, c in enumerate(coords) if len(set(c.tolist())) > 1]
    varying.update(spans)
    if len(ids) < math.prod(mesh_shape[i] for i in spans):
      partial = True
    if granule_of is not None and len(set(granule_of[ids].tolist())) > 1:
      dcn = True
  return tuple(axis_names[i] for i in sorted(varying)), partial, dcn


_SHAPE_KEEPING = ("convert", "copy", "bitcast", "bitcast-convert", "reshape", "transpose")


class _SliceCheck:
  """Whether an all-reduce's result is only ever used cut to ``1/n`` of its size.

  XLA's CPU pipeline writes a reduce-scatter as an all-reduce followed by a
  dynamic slice (GPU and TPU compilers turn that pattern into a
  reduce-scatter). Uses that keep the element count (converts, copies,
  tuple elements, fusions of them) are followed; a fusion is looked into.
  """

  def __init__(self, computations: Mapping[str, Computation]):
    self.computations = computations
    self._users: dict[str, dict[str, list[Instruction]]] = {}
    self._memo: dict[tuple[str, str, int], bool] = {}

  def users(self, computation: Computation) -> dict[str, list[Instruction]]:
    if computation.name not in self._users:
      users: dict[str, list[Instruction]] = collections.defaultdict(list)
      for instruction in computation.instructions:
        for operand in set(instruction.operands):
          users[operand].append(instruction)
      self._users[computation.name] = users
    return self._users[computation.name]

  def __call__(self, computation: Computation, instruction: Instruction, n: int, depth: int = 0) -> bool:
    key = (computation.name, instruction.name, n)
    if key not in self._memo:
      self._memo[key] = False  # also what a cycle or a deep chain gets
      self._memo[key] = depth < 12 and self._check(computation, instruction, n, depth)
    return self._memo[key]

  def _check(self, computation: Computation, instruction: Instruction, n: int, depth: int) -> bool:
    count = element_count(instruction.shape)
    uses = self.users(computation).get(instruction.name, [])
    if not uses:
      return False
    for use in uses:
      used = element_count(use.shape)
      if use.op == "get-tuple-element" or (use.op in _SHAPE_KEEPING and used == count):
        ok = self(computation, use, n, depth + 1)
      elif use.op in ("dynamic-slice", "slice"):
        ok = used * n == count
      elif use.op == "fusion":
        ok = self._fused(computation, use, instruction.name, n, depth)
        if not ok and used == count:  # a fused convert or copy
          ok = self(computation, use, n, depth + 1)
      else:
        ok = False
      if not ok:
        return False
    return True

  def _fused(self, computation: Computation, fusion: Instruction, operand: str, n: int, depth: int) -> bool:
    called = CALLS.search(fusion.attrs)
    callee = self.computations.get(called.group(2)) if called else None
    if callee is None:
      return False
    params = {int(p.attrs_index): p for p in callee.instructions if p.op == "parameter" and p.attrs_index}
    positions = [k for k, name in enumerate(fusion.operands) if name == operand]
    return bool(positions) and all(k in params and self(callee, params[k], n, depth + 1) for k in positions)


_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_MEGASCALE_KINDS = {
  "ALL_REDUCE": "all-reduce",
  "ALL_GATHER": "all-gather",
  "REDUCE_SCATTER": "reduce-scatter",
  "ALL_TO_ALL": "all-to-all",
  "ONE_TO_ONE": "collective-permute",
  "PERMUTE": "collective-permute",
}


def find_collectives(
  hlo_text: str,
  mesh_shape: Sequence[int],
  axis_names: Sequence[str],
  granule_of: Sequence[int] | None = None,
  dcn_axes: Sequence[str] = (),
  dcn_group_size: int = 1,
  infer_reduce_scatters: bool = True,
) -> list[Collective]:
  """Every collective of a compiled module, with counts, bytes and mesh axes.

  Args:
    hlo_text: ``compiled.as_text()`` of an SPMD-partitioned step.
    mesh_shape: the mesh's shape; device ids are positions in its flat order.
    axis_names: the mesh's axis names.
    granule_of: for each flat device position, its granule (slice or host);
      None: one granule.
    dcn_axes: the mesh axes that span TPU slices, for a multi-slice
      program's Megascale transfers.
    dcn_group_size: how many slices those axes span.
    infer_reduce_scatters: count an all-reduce whose uses all keep ``1/n``
      of it as a reduce-scatter (for the CPU compiler, which cannot write
      one); False for a TPU or GPU program, whose all-reduces are what run.

  Returns:
    One ``Collective`` per collective instruction that runs at least once.
  """
  computations, partitions = parse_module(hlo_text)
  times = multiplicities(computations)
  num_devices = partitions or math.prod(mesh_shape)
  granules = None if granule_of is None else np.asarray(granule_of)
  only_sliced = _SliceCheck(computations)
  out = []
  for computation in computations.values():
    count = times.get(computation.name, 0)
    if not count:
      continue
    symbols = {i.name: i.shape for i in computation.instructions}
    for instruction in computation.instructions:
      kind = _OPS.get(instruction.op)
      megascale = _MEGASCALE.search(instruction.attrs) if instruction.op == "send" else None
      if megascale:
        out.append(_megascale(instruction, megascale.group(1), symbols, count, dcn_axes, dcn_group_size))
      if kind is None:
        continue
      operand_bytes = sum(array_bytes(symbols[o]) for o in instruction.operands if o in symbols)
      if instruction.op.startswith("ragged-"):  # the rows routed, not a buffer sized for the worst case
        operand_bytes = min(array_bytes(symbols.get(o, "")) for o in instruction.operands[:2])
      if kind == "collective-permute":
        pairs = [(s, t) for s, t in parse_source_target_pairs(instruction.attrs) if s != t]
        groups = [list(p) for p in pairs]
        n = 2 if pairs else 1
      else:
        parsed = parse_replica_groups(instruction.attrs, num_devices)
        groups = [list(range(num_devices))] if parsed is None else parsed
        n = len(groups[0]) if len(groups) else 1
      payload = operand_bytes or array_bytes(instruction.shape)
      if kind == "all-gather":
        payload = (
          operand_bytes * n
          if instruction.op.endswith("-start") or not operand_bytes
          else array_bytes(instruction.shape)
        )
      sliced = infer_reduce_scatters and kind == "all-reduce" and n > 1 and only_sliced(computation, instruction, n)
      wire = _wire_bytes("reduce-scatter" if sliced else kind, payload, n)
      axes, partial, dcn = _axes_of(groups, mesh_shape, axis_names, granules)
      partial = partial and kind != "collective-permute"  # a pair is never a whole axis
      optimizer = bool(_OPTIMIZER_SCOPE.search(instruction.attrs))
      out.append(Collective(kind, instruction.name, count, n, payload, wire, axes, partial, dcn, sliced, optimizer))
  return out


def _megascale(
  instruction: Instruction, transfer: str, symbols: Mapping[str, str], count: int, dcn_axes: Sequence[str], n: int
) -> Collective:
  """A cross-slice transfer of a multi-slice TPU program, as the collective it performs."""
  kind = _MEGASCALE_KINDS.get(transfer, transfer.lower().replace("_", "-"))
  if kind not in KINDS:  # a transfer type this reader does not know: counted as sending its operand once
    kind = "collective-permute"
  payload = array_bytes(symbols.get(instruction.operands[0], "")) if instruction.operands else 0
  if kind == "all-gather":  # the payload of an all-gather is the gathered buffer, n slices' operands
    payload *= n
  return Collective(kind, instruction.name, count, n, payload, _wire_bytes(kind, payload, n), tuple(dcn_axes), dcn=True)


@dataclasses.dataclass(frozen=True)
class CollectiveTotal:
  """Collectives of one kind over one set of mesh axes, per step."""

  kind: str
  axes: str
  dcn: bool
  ops: int
  count: int
  payload_bytes: float
  wire_bytes: float


def summarize(collectives: Sequence[Collective]) -> list[CollectiveTotal]:
  """Per-step totals by kind, mesh axes and link, largest wire bytes first."""
  totals: dict[tuple[str, str, bool], list[float]] = {}
  for c in collectives:
    if c.group_size <= 1:
      continue
    kind = "reduce-scatter*" if c.sliced else c.kind
    entry = totals.setdefault((kind, c.axes_label, c.dcn), [0, 0, 0.0, 0.0])
    entry[0] += 1
    entry[1] += c.count
    entry[2] += c.count * c.payload_bytes
    entry[3] += c.count * c.wire_bytes
  rows = [CollectiveTotal(k, a, d, int(v[0]), int(v[1]), v[2], v[3]) for (k, a, d), v in totals.items()]
  return sorted(rows, key=lambda r: (-r.wire_bytes, r.kind, r.axes))


def optimizer_wire_bytes(collectives: Sequence[Collective]) -> float:
  """Bytes each device sends per step in the optimizer's update (Muon's Newton–Schulz; AdamW's: a norm's)."""
  return sum(c.count * c.wire_bytes for c in collectives if c.optimizer)


def wire_bytes_by_link(collectives: Sequence[Collective]) -> dict[str, float]:
  """Bytes each device sends per step over ICI and over DCN."""
  out = {"ici": 0.0, "dcn": 0.0}
  for c in collectives:
    out["dcn" if c.dcn else "ici"] += c.count * c.wire_bytes
  return out


def as_dicts(rows: Sequence[Any]) -> list[dict[str, Any]]:
  return [dataclasses.asdict(r) for r in rows]
