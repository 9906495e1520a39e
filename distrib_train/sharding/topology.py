"""TPU topology names: ``v5p:4x4x4`` is a TPU generation and its grid of chips.

A mesh config may name the TPU slice it is for (``topology: v5e:16x16``) and
``distrib-train plan --tpu_topology v5p:4x4x4 --num_slices 2`` takes the same
spelling. ``TpuTopology.parse`` checks it and says what it holds: the
generation (``v4``, ``v5e``, ``v5p``, ``v6e``; ``v5litepod`` is ``v5e``), the
chips per slice, the slices, and how libtpu names it. One JAX device per chip:
v4 and v5p chips run as one "megacore" device, as JAX uses them by default.

Hosts: every generation here has 4 chips per host in a multi-host slice (a
2×2 block of the grid); a slice of at most 8 chips (v5e, v6e) or 4 chips
(v4, v5p) is one host.

Not for: compiling (``podplan/tpu.py``), the chips' figures
(``cluster/hardware.py``).
"""

from __future__ import annotations

import dataclasses
import math
import re

# generation → (libtpu's name, chip config, grid dimensions)
_GENERATIONS = {
  "v4": ("v4", "megacore", 3),
  "v5p": ("v5", "megacore", 3),
  "v5e": ("v5e", "default", 2),
  "v6e": ("v6e", "default", 2),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "v5": "v5p"}
_SPELLING = re.compile(r"^([a-z0-9]+):(\d+(?:x\d+)*)$")
_SINGLE_HOST_CHIPS = {"v4": 4, "v5p": 4, "v5e": 8, "v6e": 8}


@dataclasses.dataclass(frozen=True)
class TpuTopology:
  """One or more identical TPU slices.

  Attributes:
    generation: ``v4``, ``v5e``, ``v5p`` or ``v6e``.
    grid: chips along each dimension of one slice, e.g. ``(4, 4, 4)``.
    num_slices: slices joined over DCN (multi-slice).
  """

  generation: str
  grid: tuple[int, ...]
  num_slices: int = 1

  @classmethod
  def parse(cls, text: str, num_slices: int = 1, where: str = "topology") -> TpuTopology:
    """``v5p:4x4x4`` (or ``v5litepod:16x16``, …) and a slice count.

    Raises:
      ValueError: the spelling, the generation or a size is wrong (named).
    """
    match = _SPELLING.match(str(text).strip().lower())
    known = ", ".join(f"{g}:{'x'.join(['4'] * n)}" for g, (_, _, n) in _GENERATIONS.items())
    if not match:
      raise ValueError(
        f"{where}: {text!r} is not a TPU topology; write <generation>:<chips per dimension>, e.g. {known}."
      )
    generation = _ALIASES.get(match.group(1), match.group(1))
    if generation not in _GENERATIONS:
      raise ValueError(
        f"{where}: unknown TPU generation {match.group(1)!r} in {text!r}; known: {', '.join(_GENERATIONS)}."
      )
    grid = tuple(int(d) for d in match.group(2).split("x"))
    dims = _GENERATIONS[generation][2]
    if len(grid) == 2 and dims == 3:
      grid = grid + (1,)
    if len(grid) != dims or any(d < 1 for d in grid):
      raise ValueError(
        f"{where}: a {generation} slice is a {dims}-D grid of chips ({'x'.join(['N'] * dims)}), got {text!r}."
      )
    if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
      raise ValueError(f"{where}: the number of slices must be a positive integer, got {num_slices!r}.")
    return cls(generation, grid, num_slices)

  @property
  def name(self) -> str:
    """Our spelling, ``v5p:4x4x4``."""
    return f"{self.generation}:{'x'.join(map(str, self.grid))}"

  def __str__(self) -> str:
    return self.name + (f" × {self.num_slices} slices" if self.num_slices > 1 else "")

  @property
  def chips_per_slice(self) -> int:
    return math.prod(self.grid)

  @property
  def devices(self) -> int:
    """JAX devices in all slices (one per chip)."""
    return self.chips_per_slice * self.num_slices

  @property
  def hosts_per_slice(self) -> int:
    chips = self.chips_per_slice
    return 1 if chips <= _SINGLE_HOST_CHIPS[self.generation] else math.ceil(chips / 4)

  @property
  def chips_per_host_bounds(self) -> tuple[int, int, int]:
    """One host's block of chips: the whole grid for a one-host slice, else 2×2×1."""
    grid = tuple(self.grid) + (1,) * (3 - len(self.grid))
    if self.hosts_per_slice == 1:
      return grid  # type: ignore[return-value]
    return (2, 2, 1)

  @property
  def libtpu_name(self) -> str:
    """libtpu's spelling: ``v5:4x4x4`` for a v5p slice."""
    return f"{_GENERATIONS[self.generation][0]}:{'x'.join(map(str, self.grid))}"

  @property
  def chip_config(self) -> str:
    return _GENERATIONS[self.generation][1]

  @property
  def accelerator_type(self) -> str:
    """Cloud TPU's name for one slice: ``v5p-128`` counts TensorCores, ``v5litepod-16`` chips."""
    chips = self.chips_per_slice
    return {"v4": f"v4-{2 * chips}", "v5p": f"v5p-{2 * chips}", "v5e": f"v5litepod-{chips}", "v6e": f"v6e-{chips}"}[
      self.generation
    ]

  @property
  def wraparound(self) -> tuple[bool, bool, bool]:
    """Which grid dimensions close into a torus: v4/v5p slices built of whole
    4×4×4 cubes wrap in all three; v5e/v6e wrap a dimension of 16 chips."""
    grid = tuple(self.grid) + (1,) * (3 - len(self.grid))
    if self.generation in ("v4", "v5p"):
      whole_cubes = all(d % 4 == 0 for d in grid)
      return (whole_cubes,) * 3
    return tuple(d == 16 for d in grid)  # type: ignore[return-value]
