"""Reading a compiled XLA module's text: computations, instructions, shapes, how often each runs.

``parse_module(compiled.as_text())`` splits the text into computations of
instructions (name, shape, op, operands, attributes); ``multiplicities``
says how many times one run of the entry computation runs each computation
— a ``while`` body ``known_trip_count`` times (nested loops multiply; where
the compiler states none, as libtpu does not, the trips of the counter its
condition compares with a constant), every
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

from distrib_train.kernels import grouped
from distrib_train.kernels.attention.work import kernel_flops

_DTYPE_BITS = {
  "pred": 8,
  "s2": 2,
  "u2": 2,
  "s4": 4,
  "u4": 4,
  "s8": 8,
  "u8": 8,
  "s16": 16,
  "u16": 16,
  "s32": 32,
  "u32": 32,
  "s64": 64,
  "u64": 64,
  "f16": 16,
  "bf16": 16,
  "f32": 32,
  "f64": 64,
  "c64": 64,
  "c128": 128,
}
ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+[a-z]*)?)\[([0-9,]*)\]")
CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_CALL_LISTS = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
NAME = re.compile(r"%([\w.\-]+)")
_ESTIMATED_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')


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
  attrs_index: str = ""  # a parameter's number, a constant's value
  root: bool = False


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
  root = line.startswith("ROOT ")
  if root:
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
  inside = rest[paren + 1 : close - 1]
  index = inside.strip() if op in ("parameter", "constant") else ""
  return Instruction(name[1:], shape, op, tuple(NAME.findall(inside)), rest[close:], index, root)


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
    if line.rstrip() == "}":  # not "}}, metadata=…": a custom call's backend config spans lines
      current = None
      continue
    instruction = _parse_instruction(line)
    if instruction is not None:
      current.instructions.append(instruction)
    elif current.instructions:  # an attribute that spans lines (a Mosaic kernel's metadata): its instruction's
      current.instructions[-1].attrs += "\n" + line
  partitions = re.search(r"\bnum_partitions=(\d+)", hlo_text)
  return computations, int(partitions.group(1)) if partitions else None


def _int_constant(instruction: Instruction | None) -> int | None:
  if instruction is None or instruction.op != "constant" or not re.fullmatch(r"-?\d+", instruction.attrs_index):
    return None
  return int(instruction.attrs_index)


def _tuple_index(instruction: Instruction | None) -> int | None:
  if instruction is None or instruction.op != "get-tuple-element":
    return None
  index = re.search(r"\bindex=(\d+)", instruction.attrs)
  return int(index.group(1)) if index else None


def _derived_trip_count(loop: Instruction, caller: Computation, computations: Mapping[str, Computation]) -> int | None:
  """Trips of a loop ``for (i = start; i < N; i += step)`` read from its condition, body and initial tuple.

  libtpu states no ``known_trip_count``; its scans count a tuple element up
  to a constant, by 2 in a loop it has unrolled twice ("wide" loops).
  """
  names = dict(re.findall(r"\b(condition|body)=%([\w.\-]+)", loop.attrs))
  condition, body = computations.get(names.get("condition", "")), computations.get(names.get("body", ""))
  if condition is None or body is None:
    return None
  in_condition = {i.name: i for i in condition.instructions}
  counter = bound = None
  for instruction in reversed(condition.instructions):
    direction = re.search(r"direction=(\w+)", instruction.attrs)
    if instruction.op != "compare" or len(instruction.operands) != 2 or not direction:
      continue
    left, right = (in_condition.get(o) for o in instruction.operands)
    if direction.group(1) == "GT":
      left, right = right, left
    elif direction.group(1) != "LT":
      continue
    counter, bound = _tuple_index(left), _int_constant(right)
    if counter is not None and bound is not None:
      break
  if counter is None or bound is None:
    return None
  in_body = {i.name: i for i in body.instructions}
  root = next((i for i in body.instructions if i.root), None)
  step = 1
  if root is not None and root.op == "tuple" and counter < len(root.operands):
    update = in_body.get(root.operands[counter])
    if update is not None and update.op == "add" and len(update.operands) == 2:
      increments = [_int_constant(in_body.get(o)) for o in update.operands if _tuple_index(in_body.get(o)) != counter]
      step = increments[0] if increments and increments[0] else 1
  in_caller = {i.name: i for i in caller.instructions}
  start = 0
  init = in_caller.get(loop.operands[0]) if loop.operands else None
  if init is not None and init.op == "tuple" and counter < len(init.operands):
    start = _int_constant(in_caller.get(init.operands[counter])) or 0
  return max(0, -(-(bound - start) // step)) if step > 0 else None


def _callees(
  instruction: Instruction, caller: Computation, computations: Mapping[str, Computation]
) -> list[tuple[str, int]]:
  """Computations an instruction calls, each with how often per call."""
  out = [(name, 1) for _, name in CALLS.findall(instruction.attrs)]
  for _, names in _CALL_LISTS.findall(instruction.attrs):
    out += [(name, 1) for name in NAME.findall(names)]
  if instruction.op == "while":
    trip = _TRIP_COUNT.search(instruction.attrs)
    count = int(trip.group(1)) if trip else _derived_trip_count(instruction, caller, computations)
    out = [(name, 1 if count is None else count) for name, _ in out]
  return out


def multiplicities(computations: Mapping[str, Computation]) -> dict[str, int]:
  """How many times one run of the entry computation runs each computation."""
  callers: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
  for computation in computations.values():
    for instruction in computation.instructions:
      for callee, count in _callees(instruction, computation, computations):
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


def estimated_cycles(hlo_text: str) -> int | None:
  """libtpu's own estimate of one run of a compiled TPU program: the cycles its backend config gives each
  instruction, a loop's body by its trip count (a dynamic count once); None where the program carries none
  (another compiler's)."""
  computations, _ = parse_module(hlo_text)
  times = multiplicities(computations)
  fused = {
    name
    for c in computations.values()
    for i in c.instructions
    if i.op == "fusion"
    for name in re.findall(r"calls=%([\w.\-]+)", i.attrs)
  }  # a fusion's estimate is its body's: once
  found = [
    (name, int(m.group(1)))
    for name, c in computations.items()
    if name not in fused
    for i in c.instructions
    if (m := _ESTIMATED_CYCLES.search(i.attrs))
  ]
  return sum(times[name] * cycles for name, cycles in found) if found else None


def element_count(shape_text: str) -> int:
  return sum(math.prod(int(d) for d in dims.split(",") if d) for _, dims in ARRAY.findall(shape_text))


def _dims(shape_text: str) -> list[int]:
  match = ARRAY.search(shape_text)
  return [int(d) for d in match.group(2).split(",") if d] if match else []


def _convolution_flops(instruction: Instruction, symbols: Mapping[str, str]) -> float:
  """FLOPs of a convolution: libtpu writes matmuls, batched ones included, as convolutions.

  ``2 · output elements · input features · taps``, where a spatial dimension's
  taps are the window positions that meet a real input element: libtpu
  encodes batch dimensions as windows over a dilated or padded input of which
  each output sees one element.
  """
  labels = re.search(r"dim_labels=(\w+)_(\w+)->", instruction.attrs)
  if not labels or len(instruction.operands) < 2:
    return 0.0
  lhs = _dims(symbols.get(instruction.operands[0], ""))
  rhs = _dims(symbols.get(instruction.operands[1], ""))
  lhs_labels, rhs_labels = labels.group(1), labels.group(2)
  if len(lhs_labels) != len(lhs) or len(rhs_labels) != len(rhs) or "i" not in rhs_labels:
    return 0.0
  window = re.search(r"window=\{([^}]*)\}", instruction.attrs)
  fields = dict(re.findall(r"(\w+)=([\w.\-]+)", window.group(1))) if window else {}
  spatial = sorted(c for c in lhs_labels if c.isdigit())
  sizes = [int(x) for x in fields["size"].split("x")] if "size" in fields else [1] * len(spatial)
  dilation = [int(x) for x in fields["lhs_dilate"].split("x")] if "lhs_dilate" in fields else [1] * len(spatial)
  taps = 1
  for k, (size, dilate) in enumerate(zip(sizes, dilation)):
    extent = lhs[lhs_labels.index(str(k))] if str(k) in lhs_labels else 1
    taps *= max(1, min(size, -(-size // dilate), extent))
  return 2.0 * element_count(instruction.shape) * rhs[rhs_labels.index("i")] * taps


_KERNEL = re.compile(
  r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton|__cudnn\$fmha\w*)"'
)  # Pallas, cuDNN


def _op_name(attrs: str) -> str:
  match = re.search(r'op_name="([^"]*)"', attrs)
  return match.group(1) if match else ""


def matmul_flops(hlo_text: str) -> float:
  """FLOPs of every ``dot`` (and ``convolution``) a run of the module executes (loops multiplied), kernels'
  included (``flops``)."""
  return sum(flops(hlo_text).values())


def flops(hlo_text: str) -> dict[str, float]:
  """FLOPs a run of the module executes (loops multiplied), as ``{"dots", "attention_kernels",
  "grouped_kernels"}``.

  ``2 · output elements · contracted size`` per dot: the matmuls of one
  device's program, recomputation (remat) included, elementwise work not.
  A kernel's work is invisible in the program, so it is read from the name
  scope its caller put it in: a grouped-matmul kernel (``kernels.grouped``)
  counts ``2 · rows · k · n`` for the rows it multiplies under even routing,
  which its grid follows; a fused attention kernel (splash, cuDNN:
  ``kernels/attention/work.flops_scope``) counts the query-key pairs its mask
  lets run, for the pass it is (``kernel_flops``).
  """
  computations, _ = parse_module(hlo_text)
  times = multiplicities(computations)
  found = dict.fromkeys(("dots", "attention_kernels", "grouped_kernels"), 0.0)
  for computation in computations.values():
    count = times.get(computation.name, 0)
    if not count:
      continue
    symbols = None
    for instruction in computation.instructions:
      if instruction.op == "custom-call":  # a kernel: its FLOPs from its name scope, if any
        kernel = _KERNEL.search(instruction.attrs)  # not the compiler's own custom calls (gathers) in that scope
        if kernel:
          op_name = _op_name(instruction.attrs)
          found["grouped_kernels"] += grouped.flops_tag(op_name) * count
          found["attention_kernels"] += kernel_flops(op_name, instruction.name + " " + kernel.group(1)) * count
        continue
      if instruction.op not in ("dot", "convolution"):
        continue
      if symbols is None:
        symbols = {i.name: i.shape for i in computation.instructions}
      if instruction.op == "convolution":
        found["dots"] += _convolution_flops(instruction, symbols) * count
        continue
      contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attrs)
      lhs = _dims(symbols.get(instruction.operands[0], "")) if instruction.operands else []
      size = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting and lhs else 1
      found["dots"] += 2.0 * element_count(instruction.shape) * size * count
  return found
