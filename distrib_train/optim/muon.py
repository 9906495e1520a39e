"""Muon on the right matrices: which params Newton–Schulz orthogonalizes, and along which axes.

``optax.contrib.muon`` orthogonalizes every leaf it is given dimension numbers for
(``MuonDimensionNumbers``: the reduction and output axes; every other axis is a batch axis, each slice its own
matrix) and sends the rest to AdamW. Its default — every 2-D leaf to Muon — is backwards for a scanned decoder
(the ``[layers, in, out]`` kernels are 3-D, the embedding and head 2-D), so ``dimension_numbers`` reads each
param's logical axes instead:

* AdamW: the embedding and the output head (an axis named ``vocab``), and whatever has fewer than two axes left
  once the batch axes are set aside — norms, biases, the router's bias (Moonlight's split).
* Batch axes: ``layers`` (a scanned stack), ``expert`` (each expert's matrix on its own, as Moonlight and
  Kimi K2 train DeepSeek-style mixtures) and the head axes ``heads`` / ``kv_heads`` (each head's projection its
  own matrix).
* The two axes left are the projection's reduction (input) and output axes, in the weight's order: the
  decoder's weights are all ``x @ W`` ``[in, out]`` (``wq`` ``[embed | heads, head_dim]``, ``wo``
  ``[heads | head_dim, embed]``, ``w_down`` ``[mlp, embed]``, an expert's ``[expert | embed, expert_mlp]``).
  MLA's down projections (``wq_a`` ``[embed, latent]``, ``wkv_a`` ``[embed, kv_lora + rope]``) are one matrix
  each, its up projections (``wq_b``, ``wkv_b`` ``[latent | heads, head_dim]``) one per head; the router
  ``[embed, experts]`` is a matrix. More than two axes left (a model of the user's with other names): all but
  the last reduce.
* A param without logical axes: optax's rule (2-D → Muon).

Not for: building the optimizer (``optimizers.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers, MuonState
from optax.transforms import MaskedNode

from distrib_train.common.naming import path_str
from distrib_train.sharding.axis_rules import active_activation_sharding

BATCH_AXES = ("layers", "expert", "heads", "kv_heads")
ADAMW_AXES = ("vocab",)


def dimension_numbers_for(axes: tuple[str | None, ...] | None, shape: tuple[int, ...]) -> MuonDimensionNumbers | None:
  """One param's: its ``MuonDimensionNumbers``, or None for AdamW (module docstring)."""
  if axes is None or len(axes) != len(shape):
    return MuonDimensionNumbers((0,), (1,)) if len(shape) == 2 else None
  if any(a in ADAMW_AXES for a in axes):
    return None
  matrix = [i for i, a in enumerate(axes) if a not in BATCH_AXES]
  if len(matrix) < 2:
    return None
  return MuonDimensionNumbers(tuple(matrix[:-1]), (matrix[-1],))


def _find(axes_by_path: Mapping[str, tuple[str | None, ...]], path: tuple[Any, ...]) -> tuple[str | None, ...] | None:
  name = path_str(path)  # the optimizer may see a flax fp8 model's ``params`` collection alone
  return axes_by_path.get(name, axes_by_path.get(f"params/{name}"))


def dimension_numbers(axes_by_path: Mapping[str, tuple[str | None, ...]]) -> Any:
  """``optax.contrib.muon``'s ``muon_weight_dimension_numbers`` as a function of the params (or updates): each
  leaf's from its ``/``-path's logical axes in ``axes_by_path`` (``models.annotated_axes``)."""

  def of(tree: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
      lambda path, x: dimension_numbers_for(_find(axes_by_path, path), x.shape), tree
    )

  return of


def describe(params: Any, axes_by_path: Mapping[str, tuple[str | None, ...]]) -> dict[str, str]:
  """Each param's treatment, by path: ``muon reduce (1,) out (2,)`` or ``adamw`` (for the plan and the docs)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dims = dimension_numbers_for(_find(axes_by_path, path), tuple(leaf.shape))
    out[path_str(path)] = "adamw" if dims is None else f"muon reduce {dims.reduction_axis} out {dims.output_axis}"
  return out


# --- Newton–Schulz on whole matrices, spread over the mesh --------------------------------------------------------


def _entries(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
  """Each dimension's mesh axes in ``spec`` (a tuple, empty where the dimension is whole)."""
  entries = list(spec) + [None] * (ndim - len(spec))
  return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]


@dataclasses.dataclass(frozen=True)
class _Stack:
  """How a param's local block becomes whole matrices: its axis order (batch, reduction, output), the mesh axes of
  its batch dimensions (they stay: whole matrices split by them) and of the others (all-to-all'd into the batch)."""

  order: tuple[int, ...]
  nbatch: int
  batch_axes: tuple[str, ...]
  moved: tuple[tuple[int, tuple[str, ...]], ...]  # (position in ``order`` after the batch's one, its mesh axes)
  shared: tuple[str, ...]  # the mesh axes the param is whole over (data): each of their devices takes a part
  pad: int  # zero matrices each device adds, so the moved and shared axes' devices divide its batch
  m: int
  n: int

  @staticmethod
  def of(dims: MuonDimensionNumbers, shape: tuple[int, ...], spec: PartitionSpec, mesh: Any) -> "_Stack":
    red, out = tuple(dims.reduction_axis), tuple(dims.output_axis)
    batch = tuple(i for i in range(len(shape)) if i not in red + out)
    entries = _entries(spec, len(shape))
    batch_axes = tuple(a for i in batch for a in entries[i])
    moved = tuple((1 + k, entries[i]) for k, i in enumerate(red + out) if entries[i])
    used = {a for e in entries for a in e}
    shared = tuple(a for a, size in mesh.shape.items() if size > 1 and a not in used)
    local = math.prod(shape[i] for i in batch) // math.prod(mesh.shape[a] for a in batch_axes)
    ways = math.prod(mesh.shape[a] for a in tuple(a for _, axes in moved for a in axes) + shared)
    return _Stack(
      batch + red + out,
      len(batch),
      batch_axes,
      moved,
      shared,
      -local % ways,
      math.prod(shape[i] for i in red),
      math.prod(shape[i] for i in out),
    )

  @property
  def spec(self) -> PartitionSpec:
    axes = self.batch_axes + tuple(a for _, axes in self.moved for a in axes) + self.shared
    return PartitionSpec(axes or None, None, None)


def _spread(x: jax.Array, stack: _Stack, spec: PartitionSpec, mesh: Any) -> jax.Array:
  """``x`` (laid out as ``spec``) as a stack of whole matrices ``[B', M, N]`` split over the devices: each
  device's block is regrouped locally, padded with zero matrices, and its split reduction and output axes are
  gathered by one all-to-all each (the batch split instead), so Newton–Schulz needs no collective; where the
  param is whole over a mesh axis (data), each of its devices keeps a part of the stack (gathered back after)."""

  def local(block):
    block = block.transpose(stack.order)
    rest = block.shape[stack.nbatch :]
    block = block.reshape(-1, *rest)
    if stack.pad:
      block = jnp.concatenate([block, jnp.zeros((stack.pad, *rest), block.dtype)])
    for dim, axes in stack.moved:
      block = jax.lax.all_to_all(block, axes, 0, dim, tiled=True)
    if stack.shared:  # the same block on each of these devices: each keeps its part
      part = block.shape[0] // math.prod(mesh.shape[a] for a in stack.shared)
      block = jax.lax.dynamic_slice_in_dim(block, jax.lax.axis_index(stack.shared) * part, part, 0)
    return block.reshape(-1, stack.m, stack.n)

  return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=stack.spec, check_vma=False)(x)


def _gather(y: jax.Array, stack: _Stack, spec: PartitionSpec, mesh: Any, shape: tuple[int, ...]) -> jax.Array:
  """``_spread``'s inverse: the param's own shape and layout."""
  entries = _entries(spec, len(shape))
  block_shape = [shape[i] // math.prod(mesh.shape[a] for a in entries[i]) for i in stack.order]
  whole = [shape[i] for i in stack.order[stack.nbatch :]]
  inverse = tuple(sorted(range(len(shape)), key=lambda i: stack.order[i]))

  def local(block):
    block = block.reshape(-1, *whole)
    if stack.shared:
      block = jax.lax.all_gather(block, stack.shared, axis=0, tiled=True)
    for dim, axes in reversed(stack.moved):
      block = jax.lax.all_to_all(block, axes, dim, 0, tiled=True)
    block = block[: block.shape[0] - stack.pad] if stack.pad else block
    return block.reshape(block_shape).transpose(inverse)

  return jax.shard_map(local, mesh=mesh, in_specs=stack.spec, out_specs=spec, check_vma=False)(y)


STACKED = MuonDimensionNumbers((1,), (2,))  # a spread param's: [matrices, reduction, output]


@dataclasses.dataclass(frozen=True)
class _Matrices:
  """A Muon param's shape, its layout on the mesh and its stack (a leaf of the tree ``spread_over_mesh`` maps)."""

  shape: tuple[int, ...]
  spec: PartitionSpec
  stack: _Stack


def spread_over_mesh(
  inner_factory: Callable[[Any], optax.GradientTransformation], axes_by_path: Mapping[str, tuple[str | None, ...]]
) -> optax.GradientTransformation:
  """Muon whose Newton–Schulz runs on whole matrices spread over the devices.

  ``inner_factory(dimension_numbers)`` builds the Muon (``optax.contrib.muon``) for a dimension-numbers
  function. Under the step's mesh (``sharding.axis_rules.activation_sharding``, which the trainer's step enters)
  each Muon param's gradient, param and momentum go to Muon as stacks of whole matrices ``[B', M, N]`` (the
  batch axes flattened, padded to a multiple of the devices, sharded over every mesh axis): one all-to-all in
  and one out, rather than the all-gathers a Newton–Schulz step over an fsdp-sharded matrix needs in each of its
  iterations. Before and after, each is pinned to its param's own layout, and the momentum is kept in it (the
  plan mirrors it). Momentum, Nesterov and the updates are elementwise and Newton–Schulz is per matrix, so the
  numbers are optax's Muon's. Without a mesh (or on one device) it is the Muon of
  ``dimension_numbers(axes_by_path)``.
  """
  dims_of = dimension_numbers(axes_by_path)
  plain = inner_factory(dims_of)
  is_dims = lambda x: x is None or isinstance(x, MuonDimensionNumbers)
  is_info = lambda x: x is None or isinstance(x, _Matrices)

  def infos(tree, mesh, rules):
    def info(dims, axes, x):
      if dims is None:
        return None
      # the param's layout by its axes (axes of another rank are no layout of this leaf's: replicated)
      spec = rules.spec(
        axes if axes is not None and len(axes) == x.ndim else (None,) * x.ndim, shape=x.shape, mesh=mesh
      )
      return _Matrices(tuple(x.shape), spec, _Stack.of(dims, x.shape, spec, mesh))

    axes = jax.tree_util.tree_map_with_path(lambda path, x: _find(axes_by_path, path), tree)
    return jax.tree_util.tree_map(info, dims_of(tree), axes, tree, is_leaf=is_dims)

  def each(fn, tree, info):
    return jax.tree_util.tree_map(
      lambda i, x: x if i is None or isinstance(x, MaskedNode) else fn(x, i), info, tree, is_leaf=is_info
    )

  def moments(fn, state, info):
    return jax.tree_util.tree_map(
      lambda s: s._replace(mu=each(fn, s.mu, info)) if isinstance(s, MuonState) else s,
      state,
      is_leaf=lambda s: isinstance(s, MuonState),
    )

  def update(updates, state, params=None):
    active = active_activation_sharding()
    if active is None or active[0].size == 1:
      return plain.update(updates, state, params)
    mesh, rules = active
    info = infos(updates, mesh, rules)
    labels = jax.tree_util.tree_map(lambda i: None if i is None else STACKED, info, is_leaf=is_info)
    stacked = inner_factory(lambda tree: labels)  # the same Muon, on the stacks
    spread = lambda x, i: _spread(x, i.stack, i.spec, mesh)
    gather = lambda x, i: _gather(x, i.stack, i.spec, mesh, i.shape)
    out, new = stacked.update(
      each(spread, updates, info), moments(spread, state, info), None if params is None else each(spread, params, info)
    )
    return each(gather, out, info), moments(gather, new, info)

  return optax.GradientTransformation(plain.init, update)
