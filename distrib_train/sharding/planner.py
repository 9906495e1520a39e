"""The mesh planner: from logical-axis rules to the step's three sharding trees.

``MeshPlanner(mesh, rules).plan(train_state, ...)`` returns a ``Plan`` whose
``train_state_shardings``, ``input_kwarg_shardings`` and
``aux_output_shardings`` go straight into ``build_train_step_fn``, and whose
``init`` builds the state already sharded. Shardings are plain data: nothing
downstream re-derives them. Not for: the rule semantics themselves
(``axis_rules.py``) or building meshes (``mesh.py``).

Where a parameter's (or local-state array's) logical axes come from, first
match wins: ``param_logical_axes`` given to ``plan``; the model's own
annotations (nnx variable metadata, linen ``with_logical_partitioning``);
the rules' ``param_axes`` regexes; otherwise it is replicated, and the report
lists the unannotated params over 1 MiB. Optimizer-state
leaves that mirror a parameter (same path suffix and shape, as Adam's ``mu``
and ``nu``) take that parameter's sharding; everything else is replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from distrib_train import models
from distrib_train.sharding.axis_rules import AxisRules, RuleSkip
from distrib_train.common.auto_mesh import as_auto_mesh
from distrib_train.sharding.plan import Plan, PlanEntry, logical_annotations_only
from distrib_train.common.naming import key_name, path_str
from distrib_train.train_state import TrainState, state_field
from distrib_train.step_inputs import check_loss_fn_accepts


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return tuple(x.shape), x.dtype
  # Python scalars in a state (a step counter, penzai's loss_fn_state=100).
  return (), jax.numpy.asarray(x).dtype


def _nbytes_per_device(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> int:
  return math.prod(sharding.shard_shape(shape)) * dtype.itemsize


def _is_axes(x: Any) -> bool:
  return isinstance(x, (tuple, list)) and all(a is None or isinstance(a, str) for a in x)


def lookup_axes(axes_tree: Any, path: tuple[Any, ...], used: set[str] | None = None) -> tuple[str | None, ...] | None:
  """Finds the logical axes for a leaf at ``path`` in a prefix tree of axes.

  ``axes_tree`` mirrors (a prefix of) the array tree with tuples (or lists)
  of logical names as leaves, or maps ``/``-joined paths to them. The
  top-level key that matched is added to ``used``.
  """
  if axes_tree is None:
    return None
  if isinstance(axes_tree, Mapping):
    full = path_str(path)
    if full in axes_tree and _is_axes(axes_tree[full]):
      if used is not None:
        used.add(full)
      return tuple(axes_tree[full])
  node = axes_tree
  for entry in path:
    if _is_axes(node):
      break
    key = key_name(entry)
    if isinstance(node, Mapping):
      node = node.get(key, node.get(getattr(entry, "key", key)))
    elif isinstance(node, (list, tuple)) and key.isdigit() and int(key) < len(node):
      node = node[int(key)]
    else:
      node = getattr(node, key, None)
    if node is None:
      return None
  if not _is_axes(node):
    return None
  if used is not None and isinstance(axes_tree, Mapping) and path:
    used.add(key_name(path[0]))
  return tuple(node)


def _check_all_used(what: str, axes_tree: Any, used: set[str], known: list[str]) -> None:
  """Raises if a key of a logical-axes mapping matched no array."""
  if not isinstance(axes_tree, Mapping):
    return
  unused = [k for k in axes_tree if str(k) not in used]
  if unused:
    sample = ", ".join(known[:8]) + (", …" if len(known) > 8 else "")
    raise ValueError(
      f"{what} names {', '.join(map(repr, unused))}, which match(es) nothing; the paths are: {sample or 'none'}."
    )


@dataclasses.dataclass(frozen=True)
class _LeafLayout:
  """One array's layout: its sharding, its report row, the rules it passed over.

  Not a pytree node: a tree of these keeps the laid-out tree's structure.
  """

  sharding: NamedSharding
  entry: PlanEntry
  skips: tuple[RuleSkip, ...] = ()


class _TreeLayout(NamedTuple):
  """A tree's layout: its shardings (a tree of the same structure), report rows and rule skips."""

  shardings: Any
  entries: tuple[PlanEntry, ...] = ()
  skips: tuple[RuleSkip, ...] = ()


def _collect(laid_out: Any) -> _TreeLayout:
  """Splits a tree of ``_LeafLayout`` into shardings, rows and skips, in leaf order."""
  layouts = jax.tree_util.tree_leaves(laid_out)
  return _TreeLayout(
    shardings=jax.tree_util.tree_map(lambda leaf: leaf.sharding, laid_out),
    entries=tuple(leaf.entry for leaf in layouts),
    skips=tuple(skip for leaf in layouts for skip in leaf.skips),
  )


class MeshPlanner:
  """Plans how a train state, inputs and aux outputs are laid out on a mesh.

  Example::

    planner = MeshPlanner(build_mesh(MeshConfig.from_yaml("cpu-8.yaml")),
                          AxisRules("fsdp_tensor"))
    state, plan = planner.init(make_state, inputs=batch, loss_fn=loss_fn)
    step = build_train_step_fn(loss_fn, donate_params_and_state=True,
                               train_state_shardings=plan.train_state_shardings,
                               input_kwarg_shardings=plan.input_kwarg_shardings,
                               aux_output_shardings=plan.aux_output_shardings)

  Args:
    mesh: the device mesh; Explicit axes (``jax.make_mesh``'s default) are
      replaced by Auto axes over the same devices.
    rules: an ``AxisRules``, a rule-set name, or a sequence of rules.

  Raises:
    ValueError: a rule names a mesh axis the mesh lacks.
  """

  def __init__(self, mesh: Mesh, rules: AxisRules | str | Sequence[Any]):
    self.mesh = as_auto_mesh(mesh)
    self.rules = rules if isinstance(rules, AxisRules) else AxisRules(rules)
    self.rules.check_mesh(tuple(self.mesh.axis_names))

  def _lay_out(self, group: str, path: str, leaf: Any, axes: Any) -> _LeafLayout:
    """Lays out one array by its logical ``axes``; None replicates it."""
    shape, dtype = _shape_dtype(leaf)
    where = f"{group}/{path}" if path else group
    skips: tuple[RuleSkip, ...] = ()
    if axes is None:
      spec = PartitionSpec()
    else:
      spec, skips = self.rules.resolve(axes, shape=shape, mesh=self.mesh, path=where)
    sharding = NamedSharding(self.mesh, spec)
    entry = PlanEntry(
      group,
      path,
      shape,
      str(dtype),
      None if axes is None else tuple(axes),
      spec,
      _nbytes_per_device(shape, dtype, sharding),
    )
    return _LeafLayout(sharding, entry, tuple(skips))

  def plan(
    self,
    train_state: TrainState,
    *,
    loss_fn: Callable[..., Any] | None = None,
    inputs: Mapping[str, Any] | None = None,
    input_axes: Mapping[str, Any] | None = None,
    aux_axes: Any = None,
    param_logical_axes: Any = None,
  ) -> Plan:
    """Plans shardings for a concrete or abstract (``jax.eval_shape``) state.

    Args:
      train_state: the state to lay out.
      loss_fn: the loss function; with ``inputs``, used (abstractly) to find
        the aux outputs' structure.
      inputs: example inputs (arrays or ``jax.ShapeDtypeStruct``), by name.
      input_axes: logical axes per input name, e.g. ``{"tokens": ("batch",
        "length")}``; inputs without one get ``("batch", None, ...)``.
      aux_axes: logical axes for aux leaves (a prefix tree of tuples);
        others are replicated.
      param_logical_axes: logical axes per parameter (a prefix tree of
        ``params`` with tuples as leaves, or ``/``-path → tuple).

    Returns:
      The ``Plan``.

    Raises:
      ValueError: logical axes that do not fit an array (named by path), or
        a ``loss_fn`` without ``inputs``.
    """
    state = self._plan_state(train_state, param_logical_axes)
    inputs_layout = self._plan_inputs(inputs, input_axes)
    aux = self._plan_aux(train_state, loss_fn, inputs, aux_axes)
    # A model's input_axes may cover optional inputs (segment_ids, …) that
    # this job does not feed; they are listed in the report, not an error.
    absent_inputs = tuple(k for k in (input_axes or {}) if inputs is not None and k not in inputs)
    # Unannotated params are replicated, so their bytes per device are their whole size.
    unannotated = [
      (e.path, e.bytes_per_device) for e in state.entries if e.group == "params" and e.logical_axes is None and e.shape
    ]
    layouts = [layout for layout in (state, inputs_layout, aux) if layout is not None]

    def abstract(leaf, sharding):
      shape, dtype = _shape_dtype(leaf)
      return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return Plan(
      mesh=self.mesh,
      train_state_shardings=state.shardings,
      abstract_train_state=jax.tree_util.tree_map(abstract, train_state, state.shardings),
      input_kwarg_shardings=None if inputs_layout is None else inputs_layout.shardings,
      aux_output_shardings=None if aux is None else aux.shardings,
      entries=tuple(entry for layout in layouts for entry in layout.entries),
      skips=tuple(skip for layout in layouts for skip in layout.skips),
      unannotated=tuple(name for name, _ in unannotated),
      unannotated_bytes=tuple(n for _, n in unannotated),
      absent_inputs=absent_inputs,
    )

  def _plan_state(self, train_state: TrainState, param_logical_axes: Any) -> _TreeLayout:
    """Lays out every pytree field of the state; the shardings are a ``TrainState``.

    Rows come field by field in the order the state flattens, each field's
    in leaf order.
    """
    annotated = models.annotated_axes(train_state.model_without_params, train_state.params)
    used_param_axes: set[str] = set()

    def axes_of(path, explicit=None):
      axes = lookup_axes(explicit, path, used_param_axes) if explicit is not None else None
      if axes is None:
        axes = annotated.get(path_str(path))
      if axes is None:
        axes = self.rules.axes_for_path(path_str(path))
      return axes

    map_with_path = jax.tree_util.tree_map_with_path
    params = map_with_path(
      lambda path, leaf: self._lay_out("params", path_str(path), leaf, axes_of(path, param_logical_axes)),
      train_state.params,
    )
    # Param path (as key names) -> its layout, for the optimizer leaves that mirror it.
    params_by_keys = {
      tuple(key_name(e) for e in path): layout for path, layout in jax.tree_util.tree_flatten_with_path(params)[0]
    }

    def mirrored(path, leaf):
      keys = tuple(key_name(e) for e in path)
      shape, dtype = _shape_dtype(leaf)
      for n in range(len(keys), 0, -1):
        param = params_by_keys.get(keys[-n:])
        if param is not None and param.entry.shape == shape:
          entry = PlanEntry(
            "opt_state",
            path_str(path),
            shape,
            str(dtype),
            param.entry.logical_axes,
            param.sharding.spec,
            _nbytes_per_device(shape, dtype, param.sharding),
          )
          return _LeafLayout(param.sharding, entry)
      return self._lay_out("opt_state", path_str(path), leaf, None)

    def fitting(axes, leaf):
      # A rule or annotation meant for an array of another rank (a frozen scale beside its weight) is not its.
      return axes if axes is None or len(axes) == len(_shape_dtype(leaf)[0]) else None

    def laid_out(field: str) -> Any:
      tree = getattr(train_state, field)
      layout = state_field(field).layout  # train_state.STATE_FIELDS; a subclass's own fields are replicated
      if field == "params":
        return params
      if layout == "mirrors_params":
        return map_with_path(mirrored, tree)
      if layout == "logical":
        frozen = state_field(field).role == "frozen"
        return map_with_path(
          lambda path, leaf: self._lay_out(
            field, path_str(path), leaf, fitting(axes_of(path), leaf) if frozen else axes_of(path)
          ),
          tree,
        )
      return map_with_path(lambda path, leaf: self._lay_out(field, path_str(path), leaf, None), tree)

    fields = [f.name for f in dataclasses.fields(train_state) if f.metadata.get("pytree_node", True)]
    layouts = {field: _collect(laid_out(field)) for field in fields}
    _check_all_used(
      "param_logical_axes",
      param_logical_axes,
      used_param_axes,
      [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(train_state.params)[0]],
    )
    return _TreeLayout(
      shardings=train_state.replace(**{field: layout.shardings for field, layout in layouts.items()}),
      entries=tuple(entry for layout in layouts.values() for entry in layout.entries),
      skips=tuple(skip for layout in layouts.values() for skip in layout.skips),
    )

  def _plan_inputs(self, inputs: Mapping[str, Any] | None, input_axes: Mapping[str, Any] | None) -> _TreeLayout | None:
    """Lays out the inputs, by name; without example inputs, from ``input_axes`` alone (and no rows)."""
    if inputs is None and input_axes is None:
      return None
    if inputs is None:
      return _TreeLayout(
        {
          name: NamedSharding(self.mesh, self.rules.resolve(axes, mesh=self.mesh, path=f"inputs/{name}")[0])
          for name, axes in input_axes.items()
        }
      )

    def input_layout(name, axes_for_input, path, leaf):
      axes = lookup_axes(axes_for_input, path)
      if axes is None:
        ndim = len(_shape_dtype(leaf)[0])
        axes = ("batch",) + (None,) * (ndim - 1) if ndim else ()
      return self._lay_out("inputs", "/".join(filter(None, (name, path_str(path)))), leaf, axes)

    # One input at a time, so the rows keep the inputs' own order.
    layouts = {
      name: _collect(
        jax.tree_util.tree_map_with_path(
          functools.partial(input_layout, name, (input_axes or {}).get(name)), inputs[name]
        )
      )
      for name in inputs
    }
    return _TreeLayout(
      shardings={name: layout.shardings for name, layout in layouts.items()},
      entries=tuple(entry for layout in layouts.values() for entry in layout.entries),
      skips=tuple(skip for layout in layouts.values() for skip in layout.skips),
    )

  def _plan_aux(
    self, train_state: TrainState, loss_fn: Callable[..., Any] | None, inputs: Mapping[str, Any] | None, aux_axes: Any
  ) -> _TreeLayout | None:
    """Lays out the loss function's aux outputs, found by running it abstractly."""
    if loss_fn is None:
      return None
    if inputs is None:
      raise ValueError("plan(loss_fn=...) needs inputs= (arrays or jax.ShapeDtypeStruct) to find the aux outputs.")
    check_loss_fn_accepts(loss_fn, inputs)

    def aux_of(state, example_inputs):
      rng = None if state.root_rng is None else jax.random.fold_in(state.root_rng, state.step)
      model = models.merge_model(state.model_without_params, state.params, state.local_state, rng)
      return loss_fn(model=model, state=state.loss_fn_state, rng=rng, **example_inputs)[2]

    aux = jax.eval_shape(aux_of, train_state, dict(inputs))
    used_aux_axes: set[str] = set()
    layout = _collect(
      jax.tree_util.tree_map_with_path(
        lambda path, leaf: self._lay_out("aux", path_str(path), leaf, lookup_axes(aux_axes, path, used_aux_axes)), aux
      )
    )
    _check_all_used(
      "aux_axes", aux_axes, used_aux_axes, [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(aux)[0]]
    )
    return layout

  def init(self, init_fn: Callable[..., TrainState], *args: Any, **plan_kwargs: Any) -> tuple[TrainState, Plan]:
    """Plans the state ``init_fn(*args)`` builds, then builds it sharded.

    Args:
      init_fn: returns a ``TrainState``; run abstractly, then under jit.
      *args: its arguments (e.g. a PRNG key).
      **plan_kwargs: passed to ``plan`` (``loss_fn``, ``inputs``, …).

    Returns:
      ``(train_state, plan)``.
    """
    with logical_annotations_only():
      abstract = jax.eval_shape(init_fn, *args)
    plan = self.plan(abstract, **plan_kwargs)
    return plan.init(init_fn, *args), plan
