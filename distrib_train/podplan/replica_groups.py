"""Replica groups of XLA collectives: the device ids each group holds.

``parse_replica_groups(attrs, num_devices)`` reads a collective's
``replica_groups=`` in any of XLA's three spellings — explicit
``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, and mesh
axes ``mesh['x'=2,'y'=4], device_ids=([2,4]T(1,0)) {'y'}`` — as rows of
device ids; ``parse_source_target_pairs`` a collective-permute's pairs.

Not for: which mesh axes a group spans or what it costs (``collectives.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from distrib_train.podplan.hlo import balanced


def _iota(reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
  ids = np.arange(math.prod(reshape)).reshape(reshape)
  return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
  return [int(x) for x in re.findall(r"-?\d+", text)]


def _mesh_axes_groups(text: str) -> np.ndarray:
  """Groups from XLA's mesh-axes spelling: ``mesh['a'=2,'b'=4], device_ids=(...) {'b'}``.

  The devices, laid out on the named mesh, are grouped along the listed axes
  (a sub-axis ``'b':(1)2`` is the part of ``b`` of size 2 after a stride of 1).
  """
  head = re.match(r"mesh\[([^\]]*)\]", text)
  names, sizes = [], []
  for name, size in re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", head.group(1)):
    names.append(name)
    sizes.append(int(size))
  rest = text[head.end() :]
  devices = np.arange(math.prod(sizes))
  ids = re.match(r"\s*,\s*device_ids=\(", rest)
  if ids:
    close = balanced(rest, ids.end() - 1)
    spec = rest[ids.end() : close - 1].strip()
    iota = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?$", spec)
    if iota:
      devices = _iota(_ints(iota.group(1)), _ints(iota.group(2)) if iota.group(2) else None).reshape(-1)
    else:
      devices = np.array(_ints(spec))
    rest = rest[close:]
  brace = rest.find("{")
  refs = []
  for ref in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", rest[brace + 1 : balanced(rest, brace) - 1]):
    axis = names.index(ref[0])
    refs.append((axis, int(ref[1]) if ref[1] else None, int(ref[2]) if ref[2] else None))
  # Split each grouped axis into factors: [pre, size, rest] per sub-axis.
  factors: list[int] = []
  grouped_position: dict[int, int] = {}
  for axis, size in enumerate(sizes):
    subs = sorted((r for r in enumerate(refs) if r[1][0] == axis), key=lambda r: r[1][1] or 1)
    if not subs:
      factors.append(size)
      continue
    prefix = 1
    for ref_index, (_, pre, sub_size) in subs:
      pre, sub_size = (pre or 1), (sub_size or size)
      if pre != prefix:
        factors.append(pre // prefix)
        prefix = pre
      grouped_position[ref_index] = len(factors)
      factors.append(sub_size)
      prefix *= sub_size
    if prefix != size:
      factors.append(size // prefix)
  grouped = [grouped_position[i] for i in range(len(refs))]
  order = [i for i in range(len(factors)) if i not in grouped] + grouped
  group_size = math.prod(factors[i] for i in grouped)
  return devices.reshape(factors).transpose(order).reshape(-1, group_size)


def parse_replica_groups(attrs: str, num_devices: int | None) -> np.ndarray | list[list[int]] | None:
  """The replica groups of a collective's attributes, as rows of device ids.

  Returns None when the attributes name no groups.
  """
  start = attrs.find("replica_groups=")
  if start < 0:
    return None
  text = attrs[start + len("replica_groups=") :]
  if text.startswith("{"):
    body = text[: balanced(text, 0)]
    groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", body[1:-1])]
    if not groups:  # {}: one group of every device
      return None if num_devices is None else np.arange(num_devices)[None, :]
    return groups if len({len(g) for g in groups}) > 1 else np.array(groups)
  if text.startswith("["):
    iota = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if not iota:
      return None
    shape = (int(iota.group(1)), int(iota.group(2)))
    return _iota(_ints(iota.group(3)), _ints(iota.group(4)) if iota.group(4) else None).reshape(shape)
  if text.startswith("mesh["):
    end = text.find("}", text.find("{", text.find("]")))
    return _mesh_axes_groups(text[: end + 1])
  return None


def parse_source_target_pairs(attrs: str) -> list[tuple[int, int]]:
  match = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if not match:
    return []
  return [tuple(_ints(p)) for p in re.findall(r"\{(\d+\s*,\s*\d+)", match.group(1) + "}")]
