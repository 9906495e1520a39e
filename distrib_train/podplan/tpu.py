"""libtpu's own compiler on any host: TPU devices for a topology, with nothing to run on.

``devices(TpuTopology.parse("v5e:16x16"))`` asks libtpu (``pip install
'jax[tpu]'``) for compile-only devices of that topology
(``jax.experimental.topologies.get_topology_desc``), one per chip, with their
slice, host and coordinates; ``mesh(mesh_config, topology)`` lays a mesh
config over them as ``build_mesh`` would on the pod (topology-aware, hybrid
over slices). ``jax.jit(...).lower(ShapeDtypeStructs).compile()`` on that mesh
is the TPU compiler's program for the pod: its ``memory_analysis()``,
collectives and FLOPs are the TPU's own. Nothing executes; no TPU is needed.

On a host without a TPU, libtpu prints warnings about ``TPU_ACCELERATOR_TYPE``
and ``TPU_WORKER_HOSTNAMES`` unless they are set; ``devices`` sets them (to the
topology's accelerator type and ``localhost``) when they are not, and
``ALLOW_MULTIPLE_LIBTPU_LOAD=1``: libtpu otherwise lets one process at a time
load it, and a compile-only plan holds no chip.

Not for: parsing topology names (``sharding/topology.py``), what is planned
on the devices (``estimate.py``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from distrib_train.cluster import hardware
from distrib_train.sharding.mesh import MeshConfig, build_mesh
from distrib_train.sharding.topology import TpuTopology


class TpuCompilerMissing(ValueError):
  """libtpu is not installed, so there is no TPU compiler to plan with."""


def install_hint() -> str:
  return (
    f"pip install 'jax[tpu]=={jax.__version__}' (libtpu, about 700 MB, runs on a CPU-only host), or plan on"
    " emulated CPU devices with --emulate"
  )


def available() -> bool:
  """Whether libtpu is installed (its compiler can be used)."""
  try:
    import libtpu  # noqa: F401
  except ImportError:
    return False
  return True


def kind_of(topology: TpuTopology) -> hardware.DeviceKind:
  """The chip's figures (``cluster/hardware.py``)."""
  return hardware.device_kind(topology.generation)


def use_cpu_for_jax() -> None:
  """Keeps JAX's own backend on the CPU while libtpu compiles for TPU topologies.

  On a host without TPUs, JAX would otherwise try libtpu as its backend and
  spend seconds failing (with warnings). Only before JAX has started a
  backend, and only when ``JAX_PLATFORMS`` is not set.
  """
  from jax._src import xla_bridge

  if os.environ.get("JAX_PLATFORMS") or getattr(xla_bridge, "_backends", None):
    return
  jax.config.update("jax_platforms", "cpu")


def _quiet_environment(topology: TpuTopology) -> None:
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology.accelerator_type)
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # libtpu lets one process at a time load it (/tmp/libtpu_lockfile); a compile-only plan uses no chip, so
  # two plans (or a plan beside a run) may load it together.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@functools.lru_cache(maxsize=16)
def _devices(name: str, num_slices: int) -> tuple[Any, ...]:
  from jax.experimental import topologies

  topology = TpuTopology.parse(name, num_slices)
  _quiet_environment(topology)
  kwargs: dict[str, Any] = dict(
    chip_config_name=topology.chip_config,
    chips_per_host_bounds=topology.chips_per_host_bounds,
    wrap=topology.wraparound,
  )
  if num_slices > 1:
    kwargs["num_slices"] = num_slices
  # libtpu writes a line or two to stdout as it loads; the plan's output is the report.
  with contextlib.redirect_stdout(io.StringIO()):
    description = topologies.get_topology_desc(topology_name=topology.libtpu_name, platform="tpu", **kwargs)
  return tuple(description.devices)


def devices(topology: TpuTopology) -> list[Any]:
  """libtpu's compile-only devices for ``topology``, in its order.

  Raises:
    TpuCompilerMissing: libtpu is not installed.
    ValueError: libtpu does not know the topology (its message, named).
  """
  if not available():
    raise TpuCompilerMissing(f"planning for TPU {topology} needs libtpu's compiler: {install_hint()}.")
  try:
    found = list(_devices(topology.name, topology.num_slices))
  except Exception as e:  # libtpu's errors are RuntimeErrors / JaxRuntimeErrors with its own text
    if isinstance(e, ValueError) and not type(e).__module__.startswith("jax"):
      raise
    raise ValueError(
      f"libtpu does not make TPU topology {topology}: {str(e).splitlines()[0] if str(e) else e!r}"
    ) from None
  if len(found) != topology.devices:
    raise ValueError(
      f"libtpu made {len(found)} devices for TPU topology {topology}, not the {topology.devices}"
      " chips it has; is the installed libtpu for another JAX version?"
    )
  return found


def mesh(mesh_config: MeshConfig, topology: TpuTopology) -> Mesh:
  """``mesh_config`` laid over ``topology``'s devices, as ``build_mesh`` does on the pod.

  Raises:
    ValueError: the mesh axes do not fit the topology (named).
  """
  found = devices(topology)
  if mesh_config.devices is not None and mesh_config.devices != len(found):
    raise ValueError(
      f"{mesh_config.source} is for {mesh_config.devices} devices; TPU topology {topology} has"
      f" {len(found)} chips. Pick a mesh config for {len(found)} devices or another topology."
    )
  if topology.num_slices == 1 and mesh_config.is_hybrid:
    spans = [n for n, d in zip(mesh_config.axis_names, mesh_config.dcn) if d != 1]
    raise ValueError(
      f"{mesh_config.source}: axes {', '.join(spans)} span slices (dcn) but TPU topology {topology}"
      " is one slice; pass --num_slices N (or granules: N in the mesh config)."
    )
  if topology.num_slices > 1 and not mesh_config.is_hybrid:
    raise ValueError(
      f"{mesh_config.source}: TPU topology {topology} has {topology.num_slices} slices but no mesh axis"
      " spans them; give one axis a DCN size, e.g. data: {ici: 1, dcn: " + f"{topology.num_slices}}}."
    )
  try:
    return build_mesh(mesh_config, found)
  except (ValueError, AssertionError, NotImplementedError) as e:
    said = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ValueError(f"{mesh_config.source} does not fit TPU topology {topology}: {said[:300]}") from None


def granule_of(tpu_mesh: Mesh) -> tuple[int, ...]:
  """The slice of each device, by flat mesh position."""
  return tuple(int(getattr(d, "slice_index", 0) or 0) for d in tpu_mesh.devices.flat)


def dcn_axes(mesh_shape: Sequence[int], axis_names: Sequence[str], granules: Sequence[int]) -> tuple[str, ...]:
  """The mesh axes along which the slice changes."""
  slices = np.asarray(granules).reshape(tuple(mesh_shape))
  return tuple(name for i, name in enumerate(axis_names) if (np.diff(slices, axis=i) != 0).any())
