"""The devices of a planned pod: an emulated device count, the mesh sizes, which granule each device is in.

``use_emulated_devices(n)`` makes JAX run on ``n`` CPU devices (before any
other JAX use); ``layout(mesh_config, n, kind)`` resolves a mesh config's
sizes for ``n`` devices and assigns each device to a granule (what DCN
links); ``emulated_mesh`` reshapes the devices into that mesh.

Granules: for a mesh config with DCN sizes, the emulated devices are laid
out as ``create_hybrid_device_mesh`` would (the DCN index is the major part
of each axis); GPU devices beyond one host are grouped by
``devices_per_host`` in mesh order; a TPU mesh without DCN sizes is one
slice.

Not for: what runs on the mesh (``estimate.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from distrib_train.cluster import distributed, hardware
from distrib_train.sharding.mesh import MeshConfig


def use_emulated_devices(count: int) -> None:
  """Makes JAX run on ``count`` emulated CPU devices; call before any JAX use.

  Raises:
    ValueError: JAX has already started with other devices.
  """
  distributed.use_cpu_devices(count, name="--devices")


@dataclasses.dataclass(frozen=True)
class Layout:
  """Mesh sizes for a device count, and which granule each device is in.

  Attributes:
    axis_names: mesh axes, in order.
    ici: per-axis size inside a granule.
    dcn: per-axis size across granules.
    granule_of: the granule of each device, by flat mesh position.
  """

  axis_names: tuple[str, ...]
  ici: tuple[int, ...]
  dcn: tuple[int, ...]
  granule_of: tuple[int, ...]

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(i * d for i, d in zip(self.ici, self.dcn))

  @property
  def granules(self) -> int:
    return len(set(self.granule_of))

  def describe(self) -> str:
    """``data=2 (2 over DCN) × fsdp=128 × tensor=4``."""
    parts = []
    for name, ici, dcn in zip(self.axis_names, self.ici, self.dcn):
      parts.append(f"{name}={ici * dcn}" + (f" ({dcn} over DCN)" if dcn > 1 else ""))
    return " × ".join(parts)


def layout(mesh_config: MeshConfig, devices: int, kind: hardware.DeviceKind, granules: int | None = None) -> Layout:
  """Resolves ``mesh_config`` for ``devices`` and assigns devices to granules.

  Raises:
    ValueError: the sizes do not fit the device count (named).
  """
  if mesh_config.devices is not None and mesh_config.devices != devices:
    raise ValueError(
      f"{mesh_config.source} is for {mesh_config.devices} devices, not {devices}; pick a mesh config"
      f" for {devices} devices or pass --devices {mesh_config.devices}."
    )
  if mesh_config.is_hybrid:
    if granules is None:  # from whichever level has no -1
      if -1 not in mesh_config.dcn:
        granules = math.prod(mesh_config.dcn)
      elif -1 not in mesh_config.ici:
        granules = devices // math.prod(mesh_config.ici)
      else:
        raise ValueError(f"{mesh_config.source}: cannot tell the number of granules; pass --granules.")
    ici, dcn = mesh_config.resolve(devices, granules)
    dcn_shape = tuple(dcn)
    coords = np.indices(tuple(i * d for i, d in zip(ici, dcn))).reshape(len(ici), -1)
    dcn_index = tuple(c // i for c, i in zip(coords, ici))
    granule_of = np.ravel_multi_index(dcn_index, dcn_shape)
  else:
    ici, dcn = mesh_config.resolve(devices)
    per_granule = kind.devices_per_host if kind.platform == "gpu" else kind.max_slice
    granule_of = np.arange(devices) // per_granule
  return Layout(mesh_config.axis_names, tuple(ici), tuple(dcn), tuple(int(g) for g in granule_of))


def emulated_mesh(lay: Layout, devices: Sequence[Any] | None = None) -> Mesh:
  """The devices reshaped to the layout's mesh (Auto axes), in device order."""
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) != math.prod(lay.shape):
    raise ValueError(f"The mesh {lay.describe()} needs {math.prod(lay.shape)} devices; JAX has {len(devices)}.")
  return Mesh(
    np.array(devices, dtype=object).reshape(lay.shape), lay.axis_names, axis_types=(AxisType.Auto,) * len(lay.shape)
  )
