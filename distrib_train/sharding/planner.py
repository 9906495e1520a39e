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
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from distrib_train import models
from distrib_train.sharding.axis_rules import AxisRules, RuleSkip
from distrib_train.common.auto_mesh import as_auto_mesh
from distrib_train.sharding.plan import Plan, PlanEntry, logical_annotations_only
from distrib_train.common.naming import key_name, path_str
from distrib_train.train_state import TrainState
from distrib_train.train_step import check_loss_fn_accepts
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

  def _sharding(self, group, path, leaf, axes, entries, skips) -> NamedSharding:
    shape, dtype = _shape_dtype(leaf)
    where = f"{group}/{path}" if path else group
    if axes is None:
      spec = PartitionSpec()
    else:
      spec, new_skips = self.rules.resolve(axes, shape=shape, mesh=self.mesh, path=where)
      skips.extend(new_skips)
    sharding = NamedSharding(self.mesh, spec)
    entries.append(
        PlanEntry(group, path, shape, str(dtype), None if axes is None else tuple(axes), spec,
                  _nbytes_per_device(shape, dtype, sharding))
    )
    return sharding

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
    entries: list[PlanEntry] = []
    skips: list[RuleSkip] = []
    unannotated: list[tuple[str, int]] = []
    annotated = models.annotated_axes(train_state.model_without_params, train_state.params)
    used_param_axes: set[str] = set()

    def axes_of(path, explicit=None):
      name = path_str(path)
      axes = lookup_axes(explicit, path, used_param_axes) if explicit is not None else None
      if axes is None:
        axes = annotated.get(name)
      if axes is None:
        axes = self.rules.axes_for_path(name)
      return name, axes

    param_leaves, _ = jax.tree_util.tree_flatten_with_path(train_state.params)
    # Param path (as key names) -> (shape, sharding, logical axes), for mirrors.
    by_suffix: dict[tuple[str, ...], tuple[tuple[int, ...], NamedSharding, Any]] = {}

    def param_sharding(path, leaf):
      name, axes = axes_of(path, param_logical_axes)
      shape, dtype = _shape_dtype(leaf)
      if axes is None and shape:
        unannotated.append((name, math.prod(shape) * dtype.itemsize))
      sharding = self._sharding("params", name, leaf, axes, entries, skips)
      by_suffix[tuple(key_name(e) for e in path)] = (_shape_dtype(leaf)[0], sharding, axes)
      return sharding

    def mirrored_sharding(path, leaf):
      keys = tuple(key_name(e) for e in path)
      shape, dtype = _shape_dtype(leaf)
      for n in range(len(keys), 0, -1):
        match = by_suffix.get(keys[-n:])
        if match is not None and match[0] == shape:
          _, sharding, axes = match
          entries.append(PlanEntry("opt_state", path_str(path), shape, str(dtype), axes, sharding.spec,
                                   _nbytes_per_device(shape, dtype, sharding)))
          return sharding
      return self._sharding("opt_state", path_str(path), leaf, None, entries, skips)

    def replicated(group):
      return lambda path, leaf: self._sharding(group, path_str(path), leaf, None, entries, skips)

    def local_state_sharding(path, leaf):
      name, axes = axes_of(path)
      return self._sharding("local_state", name, leaf, axes, entries, skips)

    map_with_path = jax.tree_util.tree_map_with_path
    planners = {"params": param_sharding, "opt_state": mirrored_sharding, "local_state": local_state_sharding}
    # Every pytree field, in the order TrainState flattens them; fields a
    # subclass adds (an EMA of the params, say) are replicated.
    fields = [f.name for f in dataclasses.fields(train_state) if f.metadata.get("pytree_node", True)]
    shardings = {f: map_with_path(planners.get(f) or replicated(f), getattr(train_state, f)) for f in fields}
    _check_all_used("param_logical_axes", param_logical_axes, used_param_axes,
                    [path_str(p) for p, _ in param_leaves])
    # Report rows in the order of the state's leaves, so Plan.init can zip them.
    order = {f.name: i for i, f in enumerate(dataclasses.fields(train_state))}
    state_entries = sorted(entries, key=lambda e: order[e.group])
    entries = []
    train_state_shardings = train_state.replace(**shardings)

    input_shardings = None
    # A model's input_axes may cover optional inputs (segment_ids, …) that
    # this job does not feed; they are listed in the report, not an error.
    absent_inputs = tuple(k for k in (input_axes or {}) if inputs is not None and k not in inputs)
    if inputs is not None or input_axes is not None:
      input_shardings = {}
      for name in inputs if inputs is not None else input_axes:
        axes_for_input = (input_axes or {}).get(name)
        if inputs is None:
          input_shardings[name] = NamedSharding(
              self.mesh, self.rules.resolve(axes_for_input, mesh=self.mesh, path=f"inputs/{name}")[0])
          continue

        def input_sharding(path, leaf, name=name, axes_for_input=axes_for_input):
          axes = lookup_axes(axes_for_input, path)
          if axes is None:
            ndim = len(_shape_dtype(leaf)[0])
            axes = ("batch",) + (None,) * (ndim - 1) if ndim else ()
          return self._sharding("inputs", "/".join(filter(None, (name, path_str(path)))), leaf, axes, entries, skips)

        input_shardings[name] = map_with_path(input_sharding, inputs[name])

    aux_shardings = None
    if loss_fn is not None:
      if inputs is None:
        raise ValueError("plan(loss_fn=...) needs inputs= (arrays or jax.ShapeDtypeStruct) to find the aux outputs.")

      check_loss_fn_accepts(loss_fn, inputs)

      def aux_of(state, example_inputs):
        rng = None if state.root_rng is None else jax.random.fold_in(state.root_rng, state.step)
        model = models.merge_model(state.model_without_params, state.params, state.local_state, rng)
        return loss_fn(model=model, state=state.loss_fn_state, rng=rng, **example_inputs)[2]

      aux = jax.eval_shape(aux_of, train_state, dict(inputs))
      used_aux_axes: set[str] = set()
      aux_shardings = map_with_path(
          lambda path, leaf: self._sharding("aux", path_str(path), leaf, lookup_axes(aux_axes, path, used_aux_axes),
                                            entries, skips),
          aux,
      )
      _check_all_used("aux_axes", aux_axes, used_aux_axes,
                      [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(aux)[0]])

    def abstract(leaf, sharding):
      shape, dtype = _shape_dtype(leaf)
      return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return Plan(
        mesh=self.mesh,
        train_state_shardings=train_state_shardings,
        abstract_train_state=jax.tree_util.tree_map(abstract, train_state, train_state_shardings),
        input_kwarg_shardings=input_shardings,
        aux_output_shardings=aux_shardings,
        entries=tuple(state_entries + entries),
        skips=tuple(skips),
        unannotated=tuple(name for name, _ in unannotated),
        unannotated_bytes=tuple(n for _, n in unannotated),
        absent_inputs=absent_inputs,
    )

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
