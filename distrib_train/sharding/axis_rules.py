"""Logical axis rules: name the dimensions of an array, get a PartitionSpec.

A model names the dimensions of its arrays with *logical* axis names
(``("embed", "mlp")``); a rule set maps those names onto the axes of a device
mesh (``("embed", "fsdp")``, ``("mlp", "tensor")``). This module only resolves
names to ``PartitionSpec``s. It does not build meshes (``mesh.py``) or decide
which arrays get which names (``planner.py``).

The resolution follows flax / T5X (``flax.linen.spmd``): rules are tried in
priority order across the whole array, not dimension by dimension. For each
rule in turn, the dimension carrying that logical name (if still unassigned)
takes the rule's mesh axes, provided none of those mesh axes is already used
by another dimension of the same array. Worked example, with rules
``[("mlp", "tensor"), ("heads", "tensor"), ("embed", "fsdp")]``::

  ("heads", "mlp")          -> P(None, "tensor")   # the earlier *rule* wins
  ("embed", "heads")        -> P("fsdp", "tensor")
  ("embed", "mlp", "heads") -> P("fsdp", "tensor", None)

A ``None`` rule claims a dimension as replicated; a name with no usable rule
is replicated (``strict=True`` makes that an error). Given the array's shape
and the mesh, a rule whose mesh-axis product does not divide the dimension is
skipped and the next rule for that name is tried; each skip is recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Union

import jax
from jax.sharding import NamedSharding, PartitionSpec

MeshAxes = Union[str, tuple[str, ...], None]
LogicalAxes = Sequence[Union[str, None]]

# The mesh axes the shipped rule sets and the parallel/ modules name. A mesh
# may leave any of them out: a rule reads a missing one as an axis of size 1
# (a mesh without "tensor" has no tensor parallelism, one without "stage" no
# pipeline). Any other axis a rule names must be in the mesh, so that a typo
# ("tensr") fails rather than silently replicating.
KNOWN_MESH_AXES = frozenset({"data", "fsdp", "tensor", "stage", "expert", "context"})

# A rule set that fits most decoder-only transformers on a
# ("data", "fsdp", "tensor") mesh: the batch is split over data and fsdp,
# weights are split over fsdp on their embedding side and over tensor on
# their hidden side (Megatron-style), everything else is replicated. With a
# "stage" axis, the stacked layers are split into pipeline stages; with an
# "expert" axis, a mixture's experts are split over it and the batch too;
# with a "context" axis, every sequence's length is split over it.
FSDP_TENSOR_RULES: tuple[tuple[str, MeshAxes], ...] = (
  ("batch", ("data", "fsdp", "expert")),
  ("batch", ("data", "fsdp")),
  ("expert", "expert"),
  ("expert_mlp", "tensor"),
  ("embed", "fsdp"),
  ("latent", "fsdp"),  # MLA's low-rank dims: their up-projections split over fsdp there, heads over tensor
  ("mlp", "tensor"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("vocab", "tensor"),
  ("length", "context"),
  ("length", None),
  ("head_dim", None),
  ("layers", "stage"),
  ("layers", None),
)

# Pure data parallelism on a mesh with a "data" axis: only the batch is split;
# every weight is replicated.
DATA_PARALLEL_RULES: tuple[tuple[str, MeshAxes], ...] = (("batch", "data"),)

RULE_SETS: Mapping[str, tuple[tuple[str, MeshAxes], ...]] = {
  "fsdp_tensor": FSDP_TENSOR_RULES,
  "data_parallel": DATA_PARALLEL_RULES,
}


@dataclasses.dataclass(frozen=True)
class RuleSkip:
  """A rule passed over because its mesh axes do not divide a dimension."""

  path: str
  dim: int
  logical_name: str
  dim_size: int
  mesh_axes: tuple[str, ...]
  mesh_axes_size: int

  def __str__(self) -> str:
    where = f"{self.path}: " if self.path else ""
    return (
      f"{where}dim {self.dim} ({self.logical_name!r}, size {self.dim_size})"
      f" not split over {'×'.join(self.mesh_axes)} (size"
      f" {self.mesh_axes_size}): {self.dim_size} is not a multiple of"
      f" {self.mesh_axes_size}"
    )


def _normalize_mesh_axes(mesh_axes: Any, where: str) -> tuple[str, ...] | None:
  if mesh_axes is None:
    return None
  if isinstance(mesh_axes, str):
    return (mesh_axes,)
  if isinstance(mesh_axes, (tuple, list)) and all(isinstance(a, str) for a in mesh_axes):
    if len(set(mesh_axes)) != len(mesh_axes):
      raise ValueError(f"{where}: mesh axes {tuple(mesh_axes)} repeat an axis.")
    return tuple(mesh_axes) or None
  raise ValueError(f"{where}: mesh axes must be a mesh-axis name, a tuple of names or None, got {mesh_axes!r}.")


def _normalize_rule(index: int, rule: Any) -> tuple[str, tuple[str, ...] | None]:
  where = f"axis rule #{index} {rule!r}"
  if not isinstance(rule, (tuple, list)) or len(rule) != 2:
    raise ValueError(f"{where}: a rule is a pair (logical_name, mesh_axes).")
  logical, mesh_axes = rule
  if not isinstance(logical, str) or not logical:
    raise ValueError(f"{where}: the logical name must be a non-empty string.")
  return logical, _normalize_mesh_axes(mesh_axes, where)


def _to_spec_entry(mesh_axes: tuple[str, ...] | None) -> MeshAxes:
  if mesh_axes is None:
    return None
  return mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes


class AxisRules:
  """Ordered rules mapping logical axis names to mesh axes.

  Example::

    rules = AxisRules([("batch", ("data", "fsdp")), ("embed", "fsdp"),
                       ("mlp", "tensor")])
    rules.spec(("embed", "mlp"))  # PartitionSpec('fsdp', 'tensor')

  Args:
    rules: ordered ``(logical_name, mesh_axes)`` pairs, or the name of a
      shipped rule set (``"fsdp_tensor"``, ``"data_parallel"``). ``mesh_axes``
      is a mesh-axis name, a tuple of them, or ``None`` (replicate).
    strict: raise instead of replicating a logical name with no usable rule.
    param_axes: ``(regex, logical_axes)`` pairs giving logical axes to
      parameters that carry no annotation; the regex must match the whole
      ``/``-joined parameter path, and the first match wins.

  Raises:
    ValueError: a malformed rule, an unknown rule-set name, or a malformed
      ``param_axes`` entry.
  """

  def __init__(
    self,
    rules: Sequence[tuple[str, MeshAxes]] | str,
    *,
    strict: bool = False,
    param_axes: Sequence[tuple[str, LogicalAxes]] = (),
  ):
    if isinstance(rules, str):
      if rules not in RULE_SETS:
        raise ValueError(f"Unknown axis rule set {rules!r}; known sets: {', '.join(sorted(RULE_SETS))}.")
      rules = RULE_SETS[rules]
    if not isinstance(rules, (tuple, list)):
      raise ValueError(f"Axis rules must be a sequence of (logical_name, mesh_axes) pairs, got {type(rules).__name__}.")
    self.rules = tuple(_normalize_rule(i, r) for i, r in enumerate(rules))
    for i, rule in enumerate(self.rules):
      if rule in self.rules[:i]:
        # A later rule for a name is its fallback; the same rule again could
        # never apply, so it is a slip (a rule meant for another name?).
        raise ValueError(
          f"axis rule #{i} {(rule[0], _to_spec_entry(rule[1]))!r} repeats rule #{self.rules.index(rule)};"
          f" a later rule for {rule[0]!r} is a fallback and must name other mesh axes."
        )
    self.strict = bool(strict)
    if isinstance(param_axes, (str, bytes, Mapping)) or not isinstance(param_axes, Sequence):
      raise ValueError(f"param_axes must be a list of (regex, logical_axes) pairs, got {param_axes!r}.")
    compiled = []
    for i, entry in enumerate(param_axes):
      if not isinstance(entry, (tuple, list)) or len(entry) != 2:
        raise ValueError(f"param_axes entry #{i} {entry!r}: expected (regex, logical_axes).")
      pattern, axes = entry
      try:
        regex = re.compile(pattern)
      except (re.error, TypeError) as e:
        raise ValueError(f"param_axes entry #{i}: bad regex {pattern!r}: {e}")
      compiled.append((regex, _check_logical_axes(axes, f"param_axes {pattern!r}")))
    self.param_axes = tuple(compiled)

  def __repr__(self) -> str:
    return f"AxisRules({[(n, _to_spec_entry(m)) for n, m in self.rules]!r})"

  def with_param_axes(self, param_axes: Sequence[tuple[str, LogicalAxes]]) -> AxisRules:
    """The same rules with ``param_axes`` patterns put before the current ones."""
    patterns = [(regex.pattern, axes) for regex, axes in self.param_axes]
    return AxisRules(self.rules, strict=self.strict, param_axes=list(param_axes) + patterns)

  @property
  def mesh_axis_names(self) -> frozenset[str]:
    """Every mesh axis some rule names."""
    return frozenset(a for _, axes in self.rules for a in (axes or ()))

  def check_mesh(self, mesh_axis_names: Sequence[str], where: str = "the mesh") -> None:
    """Raises ValueError if a rule names a mesh axis ``where`` does not have
    (``KNOWN_MESH_AXES`` excepted: a missing one is read as size 1)."""
    for logical, axes in self.rules:
      for axis in axes or ():
        if axis not in mesh_axis_names and axis not in KNOWN_MESH_AXES:
          raise ValueError(
            f"Axis rule ({logical!r}, {_to_spec_entry(axes)!r}) names mesh"
            f" axis {axis!r}, which {where} does not have (axes:"
            f" {', '.join(mesh_axis_names)}). A mesh may leave out only"
            f" {', '.join(sorted(KNOWN_MESH_AXES))} (read as size 1); fix the"
            " axis name or add the axis to the mesh."
          )

  def axes_for_path(self, path: str) -> tuple[str | None, ...] | None:
    """Logical axes from ``param_axes`` for a ``/``-joined path, or None."""
    for regex, axes in self.param_axes:
      if regex.fullmatch(path):
        return axes
    return None

  def spec(
    self,
    logical_axes: LogicalAxes,
    shape: Sequence[int] | None = None,
    mesh: Any = None,
  ) -> PartitionSpec:
    """Resolves logical axis names to a PartitionSpec.

    Args:
      logical_axes: one logical name (or None) per array dimension.
      shape: the array's shape; with ``mesh``, enables divisibility checks.
      mesh: a ``jax.sharding.Mesh``; a rule naming one of
        ``KNOWN_MESH_AXES`` it lacks reads that axis as size 1 (left out of
        the spec), naming any other axis it lacks is an error.

    Returns:
      The PartitionSpec, one entry per dimension.

    Raises:
      ValueError: a repeated logical name, a rank mismatch with ``shape``, a
        rule naming a mesh axis that ``mesh`` lacks, or (strict) a name with
        no usable rule.
    """
    return self.resolve(logical_axes, shape=shape, mesh=mesh)[0]

  def resolve(
    self,
    logical_axes: LogicalAxes,
    shape: Sequence[int] | None = None,
    mesh: Any = None,
    path: str = "",
  ) -> tuple[PartitionSpec, tuple[RuleSkip, ...]]:
    """Like ``spec``, also returning the rules skipped for divisibility."""
    where = f"{path}: " if path else ""
    names = _check_logical_axes(logical_axes, f"{where}logical axes")
    if shape is not None and len(shape) != len(names):
      raise ValueError(
        f"{where}logical axes {names} have {len(names)} entries but the"
        f" array has rank {len(shape)} (shape {tuple(shape)})."
      )
    mesh_sizes = None
    if mesh is not None:
      mesh_sizes = dict(mesh.shape)
      self.check_mesh(tuple(mesh.axis_names))

    unassigned = object()
    result: list[Any] = [unassigned if n is not None else None for n in names]
    used: set[str] = set()
    skips = []
    for logical, mesh_axes in self.rules:
      if logical not in names:
        continue
      pos = names.index(logical)
      if result[pos] is not unassigned:
        continue
      if mesh_axes is None:
        result[pos] = None
        continue
      if used.intersection(mesh_axes):
        continue
      # An axis the mesh leaves out is one of size 1: it splits nothing, and the spec cannot name it.
      present = mesh_axes if mesh_sizes is None else tuple(a for a in mesh_axes if a in mesh_sizes)
      if shape is not None and mesh_sizes is not None and present:
        size = math.prod(mesh_sizes[a] for a in present)
        if shape[pos] % size:
          skip = RuleSkip(path, pos, logical, int(shape[pos]), present, size)
          if skip not in skips:  # a fallback rule that differs only in a missing axis
            skips.append(skip)
          continue
      result[pos] = present or None
      used.update(mesh_axes)

    missing = [n for n, r in zip(names, result) if r is unassigned]
    if missing and self.strict:
      raise ValueError(
        f"{where}no usable axis rule for logical name(s)"
        f" {', '.join(map(repr, missing))} (strict rules)."
        + (f" Skipped: {'; '.join(map(str, skips))}." if skips else "")
      )
    spec = PartitionSpec(*(None if r is unassigned else _to_spec_entry(r) for r in result))
    return spec, tuple(skips)

  def on(self, mesh: Any) -> Any:
    """``activation_sharding(mesh, self)``: what a step built with ``activation_rules=self`` enters while it is
    traced (the step's core sits below this package and asks the rules for it)."""
    return activation_sharding(mesh, self)


def _check_logical_axes(axes: Any, where: str) -> tuple[str | None, ...]:
  if isinstance(axes, str) or not isinstance(axes, (tuple, list)):
    raise ValueError(f"{where}: expected a tuple of logical names (or None) per dimension, got {axes!r}.")
  for name in axes:
    if name is not None and not isinstance(name, str):
      raise ValueError(f"{where}: {name!r} in {tuple(axes)} is not a name.")
  named = [n for n in axes if n is not None]
  repeated = sorted({n for n in named if named.count(n) > 1})
  if repeated:
    raise ValueError(
      f"{where}: logical name(s) {', '.join(map(repr, repeated))} appear more"
      f" than once in {tuple(axes)}; each dimension needs its own name."
    )
  return tuple(axes)


_ACTIVATION_SHARDING: contextvars.ContextVar[tuple[Any, AxisRules] | None] = contextvars.ContextVar(
  "distrib_train_activation_sharding", default=None
)


@contextlib.contextmanager
def activation_sharding(mesh: Any, rules: AxisRules) -> Iterator[None]:
  """Makes ``constrain`` pin activations to ``rules`` on ``mesh``.

  Wrap the first call of a step (when it is traced) in it, or build the step
  with ``activation_rules=rules``, which enters it inside the step's trace::

    with activation_sharding(plan.mesh, rules):
      state, aux = train_step(state, **batch)
  """
  token = _ACTIVATION_SHARDING.set((mesh, rules))
  try:
    yield
  finally:
    _ACTIVATION_SHARDING.reset(token)


def active_activation_sharding() -> tuple[Any, AxisRules] | None:
  """The ``(mesh, rules)`` of the enclosing ``activation_sharding``, or None."""
  return _ACTIVATION_SHARDING.get()


def active_device() -> Any:
  """A device the program being traced runs on: the active mesh's first (a compile-only TPU or GPU mesh too),
  else JAX's default device. Kernels read its platform to pick their form."""
  active = _ACTIVATION_SHARDING.get()
  return active[0].devices.flat[0] if active else jax.devices()[0]


def constrain(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
  """Constrains an activation's sharding by logical axes; a no-op outside
  ``activation_sharding``. Rules that do not divide a dimension are skipped."""
  active = _ACTIVATION_SHARDING.get()
  if active is None:
    return x
  mesh, rules = active
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(logical_axes, shape=x.shape, mesh=mesh)))
