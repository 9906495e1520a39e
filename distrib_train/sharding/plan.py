"""``Plan``: the shardings the planner chose, their report, and sharded init.

Made by ``MeshPlanner.plan`` (``planner.py``); consumed by
``build_train_step_fn``, ``CheckpointManager.restore`` and the trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from distrib_train.sharding.axis_rules import RuleSkip
from distrib_train.common.naming import key_name, path_str
from distrib_train.common.text import human_bytes
from distrib_train.train_state import STATE_FIELDS, TrainState

_STATE_GROUPS = tuple(f.name for f in STATE_FIELDS)
_NOT_STATE = ("inputs", "aux")
_LARGE_UNANNOTATED_BYTES = 1 << 20


def _row_name(path: tuple[Any, ...]) -> tuple[str, str]:
  """A train-state leaf's key path as its report row names it: (field, path in the field)."""
  return key_name(path[0]), path_str(path[1:])


def _numbered(names: list[tuple[str, str]]) -> list[tuple[str, str, int]]:
  """Names made unique by their count so far: only a dict key holding a ``/`` can repeat one."""
  seen: dict[tuple[str, str], int] = {}
  numbered = []
  for name in names:
    numbered.append((*name, seen.get(name, 0)))
    seen[name] = seen.get(name, 0) + 1
  return numbered


@dataclasses.dataclass(frozen=True)
class PlanEntry:
  """How one array is laid out: one row of the plan report."""

  group: str
  path: str
  shape: tuple[int, ...]
  dtype: str
  logical_axes: tuple[str | None, ...] | None
  spec: PartitionSpec
  bytes_per_device: int


def logical_annotations_only():
  """nnx variables annotated with logical names are not placed eagerly.

  flax ≥ 0.12 shards an annotated variable when it is created, which needs
  the names to be mesh axes; ours are logical names that the plan resolves.
  """
  from flax import nnx

  return nnx.use_eager_sharding(False)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The shardings for one train state on one mesh, and how they were chosen.

  Attributes:
    mesh: the (Auto-typed) mesh every sharding refers to.
    train_state_shardings: a ``TrainState`` whose leaves are ``NamedSharding``.
    abstract_train_state: the same with ``jax.ShapeDtypeStruct`` leaves that
      carry the shardings: a target for checkpoint restore and for lowering
      the step ahead of time.
    input_kwarg_shardings: input name → sharding (pytree), or None.
    aux_output_shardings: shardings for the loss function's aux, or None.
    entries: one ``PlanEntry`` per state, input and aux array.
    skips: rules passed over because they did not divide a dimension.
    unannotated: paths of params that had no logical axes (replicated).
    unannotated_bytes: the full size of each of those params.
    absent_inputs: names in ``input_axes`` that were not among the inputs.
  """

  mesh: Mesh
  train_state_shardings: TrainState
  abstract_train_state: TrainState
  input_kwarg_shardings: dict[str, Any] | None
  aux_output_shardings: Any
  entries: tuple[PlanEntry, ...]
  skips: tuple[RuleSkip, ...]
  unannotated: tuple[str, ...]
  unannotated_bytes: tuple[int, ...] = ()
  absent_inputs: tuple[str, ...] = ()

  def bytes_per_device(self) -> dict[str, int]:
    """Bytes each device holds, per group (params, opt_state, …)."""
    totals = {group: 0 for group in _STATE_GROUPS + _NOT_STATE}
    for entry in self.entries:
      totals[entry.group] = totals.get(entry.group, 0) + entry.bytes_per_device
    return totals

  def summary(self) -> str:
    """A few lines for the console: the mesh, bytes per device, what to look at.

    ``report()`` is the whole table.
    """
    mesh_desc = " × ".join(f"{n}={s}" for n, s in self.mesh.shape.items())
    totals = self.bytes_per_device()
    state_total = sum(n for g, n in totals.items() if g not in _NOT_STATE)
    arrays = sum(1 for e in self.entries if e.group not in _NOT_STATE)
    lines = [
      f"Plan on mesh {mesh_desc} ({self.mesh.size} devices): {arrays} state arrays, per device "
      + ", ".join(f"{g} {human_bytes(totals[g])}" for g in ("params", "opt_state") if totals[g])
      + f"; whole train state {human_bytes(state_total)}"
    ]
    large = sum(1 for n in self.unannotated_bytes if n > _LARGE_UNANNOTATED_BYTES)
    notes = [
      f"{len(self.skips)} rule skip(s)" if self.skips else "",
      f"{large} param(s) over 1 MiB with no logical axes, replicated" if large else "",
    ]
    if any(notes):
      lines.append("  " + "; ".join(n for n in notes if n))
    return "\n".join(lines)

  def report(self) -> str:
    """A table of every array's layout, the totals per device, and skips."""
    mesh_desc = " × ".join(f"{n}={s}" for n, s in self.mesh.shape.items())
    lines = [f"Plan on mesh {mesh_desc} ({self.mesh.size} devices)"]
    header = ("group", "path", "shape", "dtype", "logical axes", "spec", "bytes/device")
    rows = [header]
    for e in self.entries:
      axes = "-" if e.logical_axes is None else "(" + ", ".join(str(a) for a in e.logical_axes) + ")"
      spec = "P(" + ", ".join(repr(s) for s in e.spec) + ")"
      rows.append((e.group, e.path or "-", str(e.shape), e.dtype, axes, spec, human_bytes(e.bytes_per_device)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
      lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    totals = self.bytes_per_device()
    state_total = sum(n for g, n in totals.items() if g not in _NOT_STATE)
    lines.append(
      "Per device: "
      + ", ".join(f"{g} {human_bytes(totals[g])}" for g in ("params", "opt_state", "loss_fn_state", "local_state"))
      + f"; whole train state {human_bytes(state_total)}"
    )
    if self.skips:
      lines.append(f"Rule skips ({len(self.skips)}):")
      lines.extend(f"  {s}" for s in self.skips)
    large = [(p, n) for p, n in zip(self.unannotated, self.unannotated_bytes) if n > _LARGE_UNANNOTATED_BYTES]
    if large:
      lines.append(f"Params over 1 MiB with no logical axes, replicated on every device ({len(large)}):")
      lines.extend(f"  {p} ({human_bytes(n)})" for p, n in large)
    if self.absent_inputs:
      lines.append(f"input_axes for inputs not given (ignored): {', '.join(self.absent_inputs)}")
    if len(self.unannotated) > len(large):
      lines.append(f"Smaller params with no logical axes, replicated: {len(self.unannotated) - len(large)}")
    return "\n".join(lines)

  def init(self, init_fn: Callable[..., TrainState], *args: Any) -> TrainState:
    """Runs ``init_fn(*args)`` under ``jax.jit`` with the planned shardings.

    Each device computes only its own shards; no device ever holds a whole
    sharded array.

    Raises:
      ValueError: ``init_fn`` builds a state unlike the planned one.
    """
    with logical_annotations_only():
      abstract = jax.eval_shape(init_fn, *args)
    got = jax.tree_util.tree_flatten_with_path(abstract)[0]
    rows = [e for e in self.entries if e.group not in _NOT_STATE]
    if len(got) != len(rows):
      raise ValueError(
        f"init_fn builds a state with {len(got)} arrays; the plan has {len(rows)}. Plan the state init_fn builds."
      )
    rows_by_name = dict(zip(_numbered([(e.group, e.path) for e in rows]), rows))
    planned = jax.tree_util.tree_flatten_with_path(self.train_state_shardings)[0]
    shardings_by_name = dict(zip(_numbered([_row_name(path) for path, _ in planned]), (s for _, s in planned)))
    names = _numbered([_row_name(path) for path, _ in got])
    for (path, leaf), name in zip(got, names):
      entry = rows_by_name.get(name)
      if entry is None:
        raise ValueError(
          f"init_fn builds {path_str(path)}, which the plan does not have. Plan the state init_fn builds."
        )
      if tuple(leaf.shape) != entry.shape or str(leaf.dtype) != entry.dtype:
        raise ValueError(
          f"init_fn builds {path_str(path)} as {leaf.dtype}{list(leaf.shape)}; the plan has"
          f" {entry.group}/{entry.path} as {entry.dtype}{list(entry.shape)}."
        )
    treedef_seen = []

    def flat_init(*a):
      leaves, treedef = jax.tree_util.tree_flatten(init_fn(*a))
      treedef_seen.append(treedef)
      return leaves

    # Leaves cross the jit boundary as a flat list: init_fn may build a new
    # (equal) optimizer object, whose static metadata would not match the
    # plan's in a pytree of shardings. The static parts are init_fn's own.
    shardings = [shardings_by_name[name] for name in names]
    with logical_annotations_only():
      leaves = jax.jit(flat_init, out_shardings=shardings)(*args)
    return jax.tree_util.tree_unflatten(treedef_seen[-1], leaves)
