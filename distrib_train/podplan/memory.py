"""Memory per device of a planned step: the state by group, the batch, the compiled step's own.

``memory_of(plan, kind, compiled)`` reads the plan's bytes per device and
the compiled step's ``memory_analysis()`` (temporaries, outputs not donated)
and sets them against the device kind's usable memory.

What emulation cannot see: the CPU compiler computes bf16 in float32, so a
bf16 model planned on CPU counts its compiled temporaries
× ``CPU_BF16_TEMPORARIES``.

Not for: time (``timing.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from distrib_train.cluster import hardware
from distrib_train.sharding.plan import Plan
from distrib_train.train_state import state_fields

# The state the memory figures do not name a group of their own.
_OTHER_STATE = state_fields(roles=("counter", "rng", "frozen", "loss_state"))


# The CPU compiler holds bf16 work in f32. Its temporaries over an H100's for
# the same step (bench/gpu_runs): 124m 15.1 / 31.4 GiB = 0.48, 1b 54.2 / 127.7
# GiB = 0.42. A bf16 model planned on CPU counts half its compiled temporaries.
CPU_BF16_TEMPORARIES = 0.5


@dataclasses.dataclass(frozen=True)
class Memory:
  """Bytes per device: the state by group, the batch, and the compiled step's own.

  ``temporaries`` is what the total counts: ``compiled_temporaries`` (the
  compiler's figure) times ``temporaries_scale`` (``CPU_BF16_TEMPORARIES``
  for a bf16 model compiled for CPU, else 1).
  """

  params: int
  opt_state: int
  local_state: int
  other_state: int
  inputs: int
  temporaries: int | None
  outputs_not_donated: int | None
  usable: int
  capacity: int
  compiled_temporaries: int | None = None
  temporaries_scale: float = 1.0

  @property
  def state(self) -> int:
    return self.params + self.opt_state + self.local_state + self.other_state

  @property
  def total(self) -> int:
    return self.state + self.inputs + (self.temporaries or 0) + (self.outputs_not_donated or 0)

  @property
  def headroom(self) -> int:
    return self.usable - self.total

  @property
  def fits(self) -> bool:
    return self.headroom >= 0


def memory_of(
  plan: Plan,
  kind: hardware.DeviceKind,
  compiled: Any = None,
  fraction: float | None = None,
  temporaries_scale: float = 1.0,
) -> Memory:
  groups = plan.bytes_per_device()
  temporaries = outputs = None
  analysis = None
  if compiled is not None:
    try:
      analysis = compiled.memory_analysis()
    except Exception:  # not every backend reports it
      analysis = None
  if analysis is not None:
    temporaries = int(analysis.temp_size_in_bytes) + int(getattr(analysis, "generated_code_size_in_bytes", 0))
    outputs = max(0, int(analysis.output_size_in_bytes) - int(analysis.alias_size_in_bytes))
  usable = int(kind.memory_bytes * (kind.usable_fraction if fraction is None else fraction))
  counted = None if temporaries is None else int(temporaries * temporaries_scale)
  return Memory(
    groups["params"],
    groups["opt_state"],
    groups["local_state"],
    sum(groups[g] for g in _OTHER_STATE),
    groups["inputs"],
    counted,
    outputs,
    usable,
    kind.memory_bytes,
    temporaries,
    temporaries_scale,
  )
