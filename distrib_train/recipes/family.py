"""What the trainer, the job and ``distrib-train plan`` ask of a model, whatever its family: the family protocol.

A reference model's config answers for its family (``LlamaConfig`` for the
dense decoders — Llama, Mistral, Qwen2/3, Gemma 3 — and ``MoEConfig`` for the
mixtures — Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss): its vocabulary, its
training FLOPs per token and what it can run (``Capabilities``). A model
given as code (``Trainer(model_fn=…)``) has no family: ``family_of`` gives
``NO_FAMILY``, which knows nothing, so MFU, the token-id check and the
planner's FLOP count are left out rather than guessed.

Nothing outside a family reads its config's fields by name: the loop, the
job and the planner go through this protocol.

Not for: building the model (each config's ``build``) or its checkpoint
tensors (``hf_tables.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """What a model runs and its size in the terms the planner's compile-free estimates use.

  Attributes:
    fp8: the FP8 mode of its projections (``model.fp8``): ``none``, ``current`` or ``delayed``.
    attention: the attention kernel asked for (``auto``, ``xla``, ``cudnn``, ``splash``); None: no attention.
    max_segments: the runs of a packed row cuDNN's packed attention takes (0: it takes none).
    dtype: the compute dtype.
    remat: the rematerialisation policy of its layers.
    num_layers, d_model, num_heads, mlp_dim: the decoder's size (0 where the model has none).
    scan_lengths: each stack of layers' length as the pipeline splits it (a stack scanned by periods of
      several layers counts its periods); empty where the model has none.
  """

  fp8: str = "none"
  attention: str | None = None
  max_segments: int = 0
  dtype: str = "float32"
  remat: str = "none"
  num_layers: int = 0
  d_model: int = 0
  num_heads: int = 0
  mlp_dim: int = 0
  scan_lengths: tuple[int, ...] = ()


@runtime_checkable
class Family(Protocol):
  """A model family, as the trainer, the job and the planner see it."""

  @property
  def vocab_size(self) -> int | None:
    """Token ids run from 0 to this (None: the model reads no tokens, or nobody knows)."""

  def flops_per_token(self, seq_len: int) -> float | None:
    """Training FLOPs per token at ``seq_len`` (forward and backward), None where unknown."""

  def capabilities(self) -> Capabilities:
    """What the model runs."""


class _NoFamily:
  """A model given as code: nothing is known about it."""

  vocab_size = None

  def flops_per_token(self, seq_len: int) -> None:
    del seq_len

  def capabilities(self) -> Capabilities:
    return Capabilities()


NO_FAMILY: Family = _NoFamily()


def family_of(model_config: Any) -> Family:
  """``model_config`` where it is a family (a reference model's config), else ``NO_FAMILY``."""
  return model_config if isinstance(model_config, Family) else NO_FAMILY
