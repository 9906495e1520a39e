"""A compiled step against a device's memory: what it needs with cuDNN's and the autotuner's share, the levers
that make it fit, and the one line for an out-of-memory error.

The trainer refuses a step that cannot fit before its first step (``train/checks.check_step_fits``) and
``distrib-train train`` says ``out_of_memory_message`` for one that runs out mid-run; ``mesh_config: auto``'s timed
search tells an out-of-memory candidate by it.
"""

from __future__ import annotations


# Memory a GPU step needs beyond its compiled figures: cuDNN's workspace (sized when a kernel first runs) and
# the autotuner's scratch, both taken from the same pool.
CUDNN_ALLOWANCE_BYTES = 1 << 30
CUDNN_ALLOWANCE_FRACTION = 0.03
MEMORY_LEVERS = (
  "lower data.global_batch_size, raise train.microbatches, set model.remat (dots_saveable or full),"
  " or shard the state over more devices (an fsdp axis in the mesh config)"
)


def step_memory_need(analysis, limit: int) -> tuple[int, int]:
  """``(need, allowance)``: the bytes a compiled step holds at its peak on one device (arguments, outputs
  that do not reuse them, temporaries) plus the allowance for cuDNN and autotuning, against a pool of
  ``limit`` bytes."""
  allowance = max(CUDNN_ALLOWANCE_BYTES, int(CUDNN_ALLOWANCE_FRACTION * limit))
  need = (
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
    + analysis.temp_size_in_bytes
  )
  return need + allowance, allowance


def out_of_memory_message(error: BaseException, step: int | None) -> str | None:
  """One line for an out-of-memory error of a step (``None`` for any other error)."""
  text = str(error)
  if type(error).__name__ not in ("JaxRuntimeError", "XlaRuntimeError") or (
    "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower()
  ):
    return None  # not the device's (a storage service's RESOURCE_EXHAUSTED is not an out-of-memory)
  first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
  at = f" at step {step}" if step is not None else ""
  return f"the device ran out of memory{at} ({first[:200]}); the last checkpoint is intact. To fit: {MEMORY_LEVERS}."
