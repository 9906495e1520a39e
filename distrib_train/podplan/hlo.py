"""Reading a compiled XLA module's text: computations, instructions, shapes, how often each runs.

``parse_module(compiled.as_text())`` splits the text into computations of
instructions (name, shape, op, operands, attributes); ``multiplicities``
says how many times one run of the entry computation runs each computation
— a ``while`` body ``known_trip_count`` times (nested loops multiply), every
other callee (fusions, conditionals' branches, reducers) once per call;
``matmul_flops`` counts the FLOPs of every ``dot`` that runs.

Not for: what the collectives mean (``collectives.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Mapping

_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32,
    "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
}
ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+[a-z]*)?)\[([0-9,]*)\]")
CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_CALL_LISTS = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
NAME = re.compile(r"%([\w.\-]+)")


def array_bytes(shape_text: str) -> int:
  """Bytes of every array in an HLO shape (a tuple's elements summed)."""
  total = 0
  for dtype, dims in ARRAY.findall(shape_text):
    bits = _DTYPE_BITS.get(dtype, 8 if dtype.startswith("f8") else None)
    if bits is None:  # token[], opaque types: no data
      continue
    total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
  return total


@dataclasses.dataclass
class Instruction:
  """One HLO instruction, as much of it as the collectives need."""

  name: str
  shape: str
  op: str
  operands: tuple[str, ...]
  attrs: str
  attrs_index: str = ""  # a parameter's number


@dataclasses.dataclass
class Computation:
  name: str
  is_entry: bool
  instructions: list[Instruction] = dataclasses.field(default_factory=list)


def balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at ``text[start]``."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack = []
  for i in range(start, len(text)):
    c = text[i]
    if c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
  return len(text)


def _parse_instruction(line: str) -> Instruction | None:
  line = re.sub(r"/\*.*?\*/", "", line).strip()
  if line.startswith("ROOT "):
    line = line[5:]
  if not line.startswith("%") or " = " not in line:
    return None
  name, _, rest = line.partition(" = ")
  # The shape: an array type, or a (possibly nested) tuple in parentheses.
  end = balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
  if end <= 0:
    return None
  shape, rest = rest[:end], rest[end:].lstrip()
  paren = rest.find("(")
  if paren <= 0:
    return None
  op = rest[:paren].strip()
  close = balanced(rest, paren)
  inside = rest[paren + 1:close - 1]
  index = inside.strip() if op == "parameter" else ""
  return Instruction(name[1:], shape, op, tuple(NAME.findall(inside)), rest[close:], index)


def parse_module(hlo_text: str) -> tuple[dict[str, Computation], int | None]:
  """The computations of a module's text, and its ``num_partitions``."""
  computations: dict[str, Computation] = {}
  current = None
  for line in hlo_text.splitlines():
    if current is None:
      match = _HEADER.match(line)
      if match and not line.startswith(" "):
        current = Computation(match.group(2), bool(match.group(1)))
        computations[current.name] = current
      continue
    if line.startswith("}"):
      current = None
      continue
    instruction = _parse_instruction(line)
    if instruction is not None:
      current.instructions.append(instruction)
  partitions = re.search(r"\bnum_partitions=(\d+)", hlo_text)
  return computations, int(partitions.group(1)) if partitions else None


def _callees(instruction: Instruction) -> list[tuple[str, int]]:
  """Computations an instruction calls, each with how often per call."""
  out = [(name, 1) for _, name in CALLS.findall(instruction.attrs)]
  for _, names in _CALL_LISTS.findall(instruction.attrs):
    out += [(name, 1) for name in NAME.findall(names)]
  if instruction.op == "while":
    trip = _TRIP_COUNT.search(instruction.attrs)
    count = int(trip.group(1)) if trip else 1
    out = [(name, count) for name, _ in out]
  return out


def multiplicities(computations: Mapping[str, Computation]) -> dict[str, int]:
  """How many times one run of the entry computation runs each computation."""
  callers: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
  for computation in computations.values():
    for instruction in computation.instructions:
      for callee, count in _callees(instruction):
        callers[callee].append((computation.name, count))
  memo: dict[str, int] = {}

  def times(name: str) -> int:
    if name not in memo:
      computation = computations.get(name)
      if computation is not None and computation.is_entry:
        memo[name] = 1
      else:
        memo[name] = 0  # guards against a malformed cycle
        memo[name] = sum(times(caller) * count for caller, count in callers.get(name, ()))
    return memo[name]

  return {name: times(name) for name in computations}



def element_count(shape_text: str) -> int:
  return sum(math.prod(int(d) for d in dims.split(",") if d) for _, dims in ARRAY.findall(shape_text))


def _dims(shape_text: str) -> list[int]:
  match = ARRAY.search(shape_text)
  return [int(d) for d in match.group(2).split(",") if d] if match else []


def matmul_flops(hlo_text: str) -> float:
  """FLOPs of every ``dot`` a run of the module executes (loops multiplied).

  ``2 · output elements · contracted size`` per dot: the matmuls of one
  device's program, recomputation (remat) included, elementwise work not.
  """
  computations, _ = parse_module(hlo_text)
  times = multiplicities(computations)
  total = 0.0
  for computation in computations.values():
    count = times.get(computation.name, 0)
    if not count:
      continue
    symbols = None
    for instruction in computation.instructions:
      if instruction.op != "dot":
        continue
      if symbols is None:
        symbols = {i.name: i.shape for i in computation.instructions}
      contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attrs)
      lhs = _dims(symbols.get(instruction.operands[0], "")) if instruction.operands else []
      size = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting and lhs else 1
      total += 2.0 * element_count(instruction.shape) * size * count
  return total
