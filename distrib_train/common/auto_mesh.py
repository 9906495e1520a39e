"""Meshes with Auto axis types, whatever jax made them with."""

from __future__ import annotations

from jax.sharding import AxisType, Mesh


def as_auto_mesh(mesh: Mesh) -> Mesh:
  """Returns ``mesh`` with Auto axis types (same devices, names and shape).

  ``jax.make_mesh`` gives Explicit axes by default in recent jax, under which
  an unannotated loss function can fail with ``ShardingTypeError``.
  """
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
