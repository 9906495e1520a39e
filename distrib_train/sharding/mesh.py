"""Device meshes from a small declarative config (ICI × DCN axes).

A ``MeshConfig`` names the mesh axes in order and gives each an ICI size
(devices within a granule: a TPU slice, or one process/host elsewhere) and a
DCN size (granules). The mesh axis size is ``ici * dcn``. ``build_mesh`` turns
it into a ``jax.sharding.Mesh`` with *Auto* axis types, so loss functions need
no sharding annotations. Not for: mapping logical names to mesh axes
(``axis_rules.py``).

YAML form (``mesh_configs/*.yaml``)::

  # when to pick this file
  axes:
    data: {ici: 1, dcn: 2}
    fsdp: {ici: -1}        # -1: fill with what is left (once per level)
    tensor: 2              # shorthand for {ici: 2}
  rules: fsdp_tensor       # a shipped rule set, or a list of [name, axes]

Any of the axes the shipped rules name (data, fsdp, tensor, stage, expert,
context) may be left out: the rules read it as size 1 (``data`` × ``fsdp``
alone is plain FSDP).

A file may say the job it is for: ``devices`` (and ``granules``: slices or
hosts), and for a TPU slice its ``topology`` (``v5e:16x16``; with
``granules: 2``, two such slices). ``distrib-train plan`` compiles a mesh
config with a topology with libtpu's compiler for that topology.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from distrib_train.common.yaml_loader import safe_load_yaml
from distrib_train.sharding.axis_rules import RULE_SETS, AxisRules
from distrib_train.sharding.topology import TpuTopology

_LEVELS = ("ici", "dcn")
_KNOWN_KEYS = frozenset({"axes", "rules", "param_axes", "devices", "granules", "topology"})


def _check_sizes(sizes: Sequence[Any], level: str, names: Sequence[str], where: str) -> tuple[int, ...]:
  out = []
  for name, size in zip(names, sizes):
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
      raise ValueError(f"{where}: {level} size of axis {name!r} must be an integer, got {size!r}.")
    if size == 0 or size < -1:
      raise ValueError(f"{where}: {level} size of axis {name!r} is {size}; sizes are positive, or -1 to auto-fill.")
    out.append(int(size))
  fills = [n for n, s in zip(names, out) if s == -1]
  if len(fills) > 1:
    raise ValueError(
      f"{where}: {level} sizes of axes {', '.join(map(repr, fills))} are all -1; at most one"
      f" {level} size may auto-fill."
    )
  return tuple(out)


def _fill(
  sizes: tuple[int, ...], total: int, level: str, names: Sequence[str], where: str, what: str
) -> tuple[int, ...]:
  """Replaces a -1 so that the product is ``total``; checks the product."""
  terms = " × ".join(f"{n}={s}" for n, s in zip(names, sizes))
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if total % known:
      raise ValueError(
        f"{where}: cannot auto-fill the -1 {level} axis: {terms} must divide {total} ({what}), but {known} does not."
      )
    sizes = tuple(total // known if s == -1 else s for s in sizes)
  elif known != total:
    raise ValueError(f"{where}: {level} sizes {terms} = {known} do not match the {total} {what}.")
  return sizes


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Ordered mesh axes with ICI and DCN sizes.

  Args:
    axis_names: mesh axis names, in mesh order.
    ici: size of each axis within a granule; one -1 may auto-fill.
    dcn: size of each axis across granules (default all 1); one -1 may
      auto-fill. Any size > 1 makes a hybrid (multi-slice / multi-host) mesh.
    rules: optional axis rules that go with this mesh.
    source: where the config came from, for error messages.
    devices: the device count the file is for, if it says.
    topology: the TPU slice it is for (``v5e:16x16``), if it says; its
      slices are the DCN granules.

  Raises:
    ValueError: lengths that differ, repeated names, zero or negative sizes,
      two -1s in one level, or rules naming an axis the config lacks (the
      axes of ``axis_rules.KNOWN_MESH_AXES`` excepted: one left out is size 1).
  """

  axis_names: tuple[str, ...]
  ici: tuple[int, ...]
  dcn: tuple[int, ...] | None = None
  rules: AxisRules | None = dataclasses.field(default=None, compare=False)
  source: str = dataclasses.field(default="mesh config", compare=False)
  devices: int | None = dataclasses.field(default=None, compare=False)
  topology: TpuTopology | None = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    where = self.source
    names = tuple(self.axis_names)
    if not names or not all(isinstance(n, str) and n for n in names):
      raise ValueError(f"{where}: axis names must be non-empty strings, got {self.axis_names!r}.")
    if len(set(names)) != len(names):
      raise ValueError(f"{where}: axis names {names} repeat a name.")
    dcn = self.dcn if self.dcn is not None else (1,) * len(names)
    for level, sizes in (("ici", self.ici), ("dcn", dcn)):
      if not isinstance(sizes, (tuple, list)):
        raise ValueError(f"{where}: {level} must be a sequence of sizes, one per axis {names}, got {sizes!r}.")
      if len(sizes) != len(names):
        raise ValueError(f"{where}: {len(names)} axes {names} but {len(sizes)} {level} sizes {tuple(sizes)}.")
    object.__setattr__(self, "axis_names", names)
    object.__setattr__(self, "ici", _check_sizes(self.ici, "ici", names, where))
    object.__setattr__(self, "dcn", _check_sizes(dcn, "dcn", names, where))
    if self.rules is not None:
      try:
        rules = self.rules if isinstance(self.rules, AxisRules) else AxisRules(self.rules)
      except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
      rules.check_mesh(names, where)
      object.__setattr__(self, "rules", rules)

  @property
  def is_hybrid(self) -> bool:
    """Whether any axis spans granules (DCN)."""
    return any(s != 1 for s in self.dcn)

  def resolve(self, num_devices: int, num_granules: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Fills the -1 sizes for a device count; checks that the products match.

    Args:
      num_devices: devices in the whole job.
      num_granules: TPU slices, or processes where devices have no slice.

    Returns:
      ``(ici_sizes, dcn_sizes)`` with no -1 left.

    Raises:
      ValueError: the sizes cannot be made to match the device count.
    """
    if not self.is_hybrid:
      return _fill(self.ici, num_devices, "ici", self.axis_names, self.source, "devices found"), self.dcn
    if num_devices % num_granules:
      raise ValueError(f"{self.source}: {num_devices} devices do not split evenly over {num_granules} granules.")
    dcn = _fill(
      self.dcn, num_granules, "dcn", self.axis_names, self.source, "granules (TPU slices, or processes) found"
    )
    ici = _fill(self.ici, num_devices // num_granules, "ici", self.axis_names, self.source, "devices per granule found")
    return ici, dcn

  @classmethod
  def from_dict(cls, config: Mapping[str, Any], source: str = "mesh config") -> MeshConfig:
    """Builds a config from the YAML structure described in the module doc."""
    if not isinstance(config, Mapping):
      raise ValueError(f"{source}: expected a mapping with 'axes' (and 'rules'), got {type(config).__name__}.")
    unknown = sorted(set(config) - _KNOWN_KEYS, key=str)
    if unknown:
      raise ValueError(
        f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(_KNOWN_KEYS))}."
      )
    axes = config.get("axes")
    if not isinstance(axes, Mapping) or not axes:
      raise ValueError(f"{source}: 'axes' must map each mesh axis name to its sizes.")
    names, sizes = [], {level: [] for level in _LEVELS}
    for name, spec in axes.items():
      if not isinstance(spec, Mapping):
        spec = {"ici": spec}
      bad = sorted(set(spec) - set(_LEVELS), key=str)
      if bad:
        raise ValueError(f"{source}: axis {name!r} has unknown key(s) {', '.join(map(repr, bad))}; known: ici, dcn.")
      names.append(name)
      sizes["ici"].append(spec.get("ici", 1))
      sizes["dcn"].append(spec.get("dcn", 1))
    rules = None
    if "param_axes" in config and "rules" not in config:
      raise ValueError(f"{source}: 'param_axes' needs 'rules' beside it (a rule-set name or a list).")
    if "granules" in config and "devices" not in config and "topology" not in config:
      raise ValueError(f"{source}: 'granules' is checked against 'devices'; give both or neither.")
    if "rules" in config:
      try:
        rules = AxisRules(config["rules"], param_axes=config.get("param_axes") or ())
      except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    mesh_config = cls(tuple(names), tuple(sizes["ici"]), tuple(sizes["dcn"]), rules=rules, source=source)
    topology = None
    if "topology" in config:
      if not isinstance(config["topology"], str):
        raise ValueError(f"{source}: 'topology' must be a TPU topology such as v5e:16x16, got {config['topology']!r}.")
      slices = config.get("granules", 1)
      topology = TpuTopology.parse(config["topology"], slices, where=f"{source}: topology")
      declared = config.get("devices", topology.devices)
      if declared != topology.devices:
        raise ValueError(
          f"{source}: 'devices' is {declared!r} but topology {topology} has {topology.devices}"
          " chips (one device each); fix one of them."
        )
      if topology.num_slices > 1 and not mesh_config.is_hybrid:
        raise ValueError(
          f"{source}: topology {topology} has {topology.num_slices} slices (granules) but no axis spans"
          " them; give one axis a DCN size, e.g. data: {ici: 1, dcn: " + f"{topology.num_slices}}}."
        )
      config = {**config, "devices": topology.devices}
      mesh_config = dataclasses.replace(mesh_config, topology=topology)
    if "devices" in config:
      # A file may declare the job it is for; the sizes are checked against it
      # at load time, so a typo fails on a laptop, not on the pod.
      counts = {k: config.get(k, 1) for k in ("devices", "granules")}
      for key, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
          raise ValueError(f"{source}: {key!r} must be a positive integer, got {value!r}.")
      try:
        mesh_config.resolve(counts["devices"], counts["granules"])
      except ValueError as e:
        if topology is None:
          raise
        raise ValueError(f"{e} (topology {topology}: {topology.chips_per_slice} chips per slice)") from None
      mesh_config = dataclasses.replace(mesh_config, devices=counts["devices"])
    return mesh_config

  @classmethod
  def from_yaml(cls, path: str | os.PathLike) -> MeshConfig:
    """Loads a mesh config file (safe YAML; no code is evaluated).

    Raises:
      ValueError: the file is missing, is not valid YAML, or is malformed.
    """

    data = safe_load_yaml(path, what="Mesh config")  # a ConfigError is a ValueError
    return cls.from_dict(data, source=os.path.basename(os.fspath(path)))

  def to_yaml(self, header: Sequence[str] = ()) -> str:
    """The config as a mesh-config file, which ``from_yaml`` loads back.

    Args:
      header: comment lines for the top of the file (when to pick it).

    Returns:
      The YAML text: ``devices`` (and ``granules``, for a hybrid mesh whose
      DCN sizes are all given) when the config declares its device count;
      each axis as ``name: ici``, or
      ``{ici: …, dcn: …}`` when it spans granules; the rules, by name when
      they are a shipped rule set, and their ``param_axes``.
    """
    lines = [f"# {line}" for line in header]
    if self.topology is not None:
      lines.append(f"topology: {self.topology.name}")
    if self.devices is not None:
      lines.append(f"devices: {self.devices}")
      if self.is_hybrid and -1 not in self.dcn:
        lines.append(f"granules: {math.prod(self.dcn)}")
      elif self.topology is not None and self.topology.num_slices > 1:
        lines.append(f"granules: {self.topology.num_slices}")
    lines.append("axes:")
    for name, ici, dcn in zip(self.axis_names, self.ici, self.dcn):
      lines.append(f"  {name}: {{ici: {ici}, dcn: {dcn}}}" if dcn != 1 else f"  {name}: {ici}")
    if self.rules is not None:
      lines.extend(_rules_yaml(self.rules))
    return "\n".join(lines) + "\n"


def _rules_yaml(rules: AxisRules) -> list[str]:
  """The ``rules`` (and ``param_axes``) lines of a mesh-config file."""
  named = next((name for name, rule_set in RULE_SETS.items() if AxisRules(rule_set).rules == rules.rules), None)
  lines = [f"rules: {named}"] if named else ["rules:"]
  if not named:
    for logical, axes in rules.rules:
      value = "null" if axes is None else (axes[0] if len(axes) == 1 else "[" + ", ".join(axes) + "]")
      lines.append(f"  - [{logical}, {value}]")
  if rules.param_axes:
    lines.append("param_axes:")
    for regex, axes in rules.param_axes:
      names = ", ".join("null" if a is None else a for a in axes)
      lines.append(f"  - ['{regex.pattern}', [{names}]]")
  return lines


def mesh_config_dirs() -> list[str]:
  """Where ``find_mesh_config`` looks for a named mesh config, in order:
  ``./mesh_configs``, the checkout this package runs from, and the copy a
  regular (non-editable) install puts under ``<prefix>/share/distrib_train``."""
  import sys

  here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
  candidates = [
    os.path.join(os.getcwd(), "mesh_configs"),
    os.path.join(here, "mesh_configs"),
    os.path.join(sys.prefix, "share", "distrib_train", "mesh_configs"),
  ]
  out = []
  for d in candidates:
    if os.path.isdir(d) and d not in out:
      out.append(d)
  return out


def find_mesh_config(name_or_path: str | os.PathLike) -> str:
  """The file a mesh config name (``cpu-8``) or path refers to.

  Raises:
    ValueError: no such file; the message lists the named configs found.
  """
  text = os.fspath(name_or_path)
  if text.endswith((".yaml", ".yml")) or os.sep in text:
    if not os.path.isfile(os.path.expanduser(text)):
      raise ValueError(f"Mesh config file {text!r} does not exist.")
    return os.path.expanduser(text)
  names = set()
  for d in mesh_config_dirs():
    path = os.path.join(d, f"{text}.yaml")
    if os.path.isfile(path):
      return path
    names.update(f[:-5] for f in os.listdir(d) if f.endswith(".yaml"))
  raise ValueError(
    f"No mesh config named {text!r}; known: {', '.join(sorted(names)) or 'none found'} (or give a .yaml path)."
  )


def granules_of(devices: Sequence[Any]) -> tuple[int, bool]:
  """Counts granules: slices when devices span several, else processes.

  TPU multislice devices carry distinct ``slice_index`` values (so do GPUs
  whose processes passed ``partition_index``); CPU devices and single-slice
  jobs report one slice, and then each process is a granule.
  """
  slices = {getattr(d, "slice_index", None) for d in devices}
  if len(slices) > 1 and None not in slices:
    return len(slices), False
  return len({d.process_index for d in devices}), True


def build_mesh(config: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
  """Builds a ``jax.sharding.Mesh`` with Auto axis types from a config.

  Uses ``mesh_utils.create_device_mesh`` (topology-aware on TPU), or
  ``create_hybrid_device_mesh`` when any DCN size is not 1; where a mesh
  axis is not a product of whole physical TPU axes (tensor 4 on an 8x8x8
  slice), it lets that axis take part of one (``allow_split_physical_axes``).

  Args:
    config: the mesh config; one that declares ``devices`` must get that
      many.
    devices: devices to use; defaults to ``jax.devices()``.

  Returns:
    The mesh; each axis has size ``ici * dcn``.

  Raises:
    ValueError: the sizes do not fit the devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  if config.devices is not None and len(devices) != config.devices:
    raise ValueError(
      f"{config.source} is for {config.devices} devices; this job has {len(devices)}"
      f" ({jax.process_count()} process(es), {devices[0].device_kind}). Pick a mesh config for"
      f" {len(devices)} devices."
    )
  num_granules, process_is_granule = granules_of(devices)
  ici, dcn = config.resolve(len(devices), num_granules)

  def lay_out(split: bool) -> np.ndarray:
    if config.is_hybrid:
      return mesh_utils.create_hybrid_device_mesh(
        ici, dcn, devices, process_is_granule=process_is_granule, allow_split_physical_axes=split
      )
    return mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=split)

  try:
    device_array = lay_out(split=False)
  except (ValueError, NotImplementedError, AssertionError):
    # An axis that is not a product of whole physical TPU axes (tensor 4 on an 8x8x8 slice) takes part of one.
    device_array = lay_out(split=True)
  return Mesh(device_array, config.axis_names, axis_types=(AxisType.Auto,) * len(ici))
