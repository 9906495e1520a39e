"""The work of a fused attention kernel, which the compiled program cannot show, for the plan.

A Pallas or cuDNN kernel is one opaque custom call: XLA's cost analysis
counts none of its FLOPs. Each call is wrapped in a name scope that carries
its work (``flops_scope``: the query-key pairs its mask lets run, and the
head sizes; ``fused_backward_scope`` where one backward kernel runs its own
blocks), and ``podplan/hlo.py`` reads it back from the instructions' names
(``kernel_flops``: the FLOPs of the pass an instruction is). While
``noted()`` is entered, each splash call also notes what its mask costs
over the causal ideal (``note``), which ``dispatch`` keeps with its
decisions for the plan's report.

Not for: the kernels (``splash.py``, ``cudnn.py``), choosing one (``dispatch.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

SCOPE = "attention_kernel"  # the name scope that carries a fused attention call's work to the plan


def flops_scope(pairs: int, qk_dim: int, v_dim: int):
  """A name scope around a fused attention kernel's call (forward and backward) that tells ``podplan`` its work,
  which the compiled program cannot show: the query-key ``pairs`` it computes (its mask's blocks that run, all
  heads and rows of the call) and the head sizes."""
  return jax.named_scope(f"{SCOPE}(pairs={pairs},qk={qk_dim},v={v_dim})")


def fused_backward_scope(pairs: int, backward_pairs: int, qk_dim: int, v_dim: int):
  """``flops_scope`` of a kernel whose one backward kernel runs ``backward_pairs`` (its own blocks)."""
  return jax.named_scope(f"{SCOPE}(pairs={pairs},bwd={backward_pairs},qk={qk_dim},v={v_dim},fused=1)")


_NOTES: contextvars.ContextVar[list | None] = contextvars.ContextVar("attention_kernel_notes", default=None)


@contextlib.contextmanager
def collecting(into: contextvars.ContextVar) -> Iterator[list]:
  """While entered, ``into`` holds a new list, which this yields (what a trace adds to it)."""
  found: list = []
  token = into.set(found)
  try:
    yield found
  finally:
    into.reset(token)


def noted() -> contextlib.AbstractContextManager[list[dict]]:
  """While entered, each splash call traced adds what its mask costs to the list it yields: ``work``, the
  query-key pairs its blocks compute on the busiest device over the causal ideal's share (half the square, or
  a window's band), and with a context axis ``gathered_bytes``, one layer's gathered keys and values."""
  return collecting(_NOTES)


def causal_pairs(length: int, window: int = 0) -> int:
  """The query-key pairs causal attention over ``length`` tokens needs (within ``window`` keys when > 0)."""
  if not window or window >= length:
    return length * (length + 1) // 2
  return window * (window + 1) // 2 + (length - window) * window


def note(pairs: int, length: int, window: int, shards: int, **more: float) -> None:
  found = _NOTES.get()
  if found is not None:
    found.append({"work": pairs * shards / causal_pairs(length, window), **more})


def kernel_flops(op_name: str, kernel_name: str) -> float:
  """FLOPs of one fused attention kernel call from its ``flops_scope`` in ``op_name`` (0 outside one).

  ``kernel_name`` (the instruction's name and custom-call target) says which pass it is: the forward pass
  multiplies Q·Kᵀ and P·V (2·pairs·(qk + v)); splash's dq kernel recomputes the scores, dP and dQ
  (2·pairs·(2·qk + v)) and its dkv kernel the scores, dP, dV and dK (2·pairs·(2·qk + 2·v)); one backward
  kernel (cuDNN's, splash's fused one) the scores, dP, dV, dQ and dK (2·pairs·(3·qk + 2·v)).
  """
  start = op_name.rfind(SCOPE + "(")
  if start < 0:
    return 0.0
  fields = dict(part.split("=") for part in op_name[start + len(SCOPE) + 1 :].split(")")[0].split(","))
  pairs, qk, v = (int(fields[key]) for key in ("pairs", "qk", "v"))
  if "Backward" in kernel_name or ("_dkv" in kernel_name and fields.get("fused") == "1"):
    return 2.0 * int(fields.get("bwd", pairs)) * (3 * qk + 2 * v)
  if "_dkv" in kernel_name:
    return 2.0 * pairs * (2 * qk + 2 * v)
  if "_dq" in kernel_name:
    return 2.0 * pairs * (2 * qk + v)
  return 2.0 * pairs * (qk + v)
