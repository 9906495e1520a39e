"""The dense decoders' config: Llama, Mistral, Qwen2 and Qwen3, Gemma 3 — and the presets.

``LlamaConfig`` names a decoder's shape and the variants its layers compose
(``blocks.py``, ``decoder.py``): grouped-query or multi-head latent
attention, q/k/v and output biases, q/k norms, sinks, a sliding window on
the layers ``layer_types`` marks (with their own RoPE base), soft caps,
Gemma's ``1 + w`` norms before and after each part, its embeddings scaled by
√d, and a gated MLP of SiLU, tanh GELU or gpt-oss's clamped SiLU. Its
fields are the ``model.*`` keys of a run's config; a Hugging Face
checkpoint's ``config.json`` sets them (``hf_shape.py``). Params are float32
and the compute dtype bfloat16 by default; ``scan_layers`` scans each
segment of equal layers (one compiled period) or unrolls them, ``remat``
picks a rematerialisation policy per layer.

``mtp_depth`` > 0 adds DeepSeek-V3's multi-token prediction modules and
their loss (``mtp.py``), weighted by ``mtp_loss_weight``.

The config is the family protocol's answer for its model (``family.py``):
vocabulary, FLOPs per token, capabilities. ``MoEConfig`` (``moe.py``) adds
the experts.

Not for: the model's code (``decoder.py``, ``blocks.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from typing import Any
from flax import nnx

from distrib_train.kernels import fp8
from distrib_train.kernels.attention import dispatch as attention_kernels
from distrib_train.recipes import attention, lora, mtp
from distrib_train.recipes.parts import Kind
from distrib_train.recipes.decoder import INPUT_AXES, REMAT_POLICIES, Decoder, loss_fn  # noqa: F401 (the family's)
from distrib_train.recipes.family import Capabilities
from distrib_train.recipes.rope import SCALINGS, Rope

LAYER_TYPES = ("full", "sliding")
MLP_ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oss")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape and numerics of a dense decoder (module docstring)."""

  vocab_size: int = 32000
  d_model: int = 768
  num_layers: int = 12
  num_heads: int = 12
  num_kv_heads: int = 12
  head_dim: int = 64  # MLA: the heads' q/k size without their rotary part (qk_nope_head_dim)
  mlp_dim: int = 2048
  max_seq_len: int = 1024
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: str = "none"
  scan_layers: bool = True
  attention: str = "auto"  # "auto" (attention_kernels.choose), "xla", "cudnn" or "splash" (TPU)
  max_segments: int = 8  # runs a packed row may hold in cuDNN's packed attention (cudnn_attention.py); 0: a mask
  loss_chunk_size: int = 1024  # tokens per cross-entropy chunk (per sequence)
  loss_remat: bool = True  # recompute each chunk's logits in the backward pass (False: keep them, more memory)
  tie_embeddings: bool = False  # the output head is the embedding table (Llama 3.2 1B/3B, small Qwen2.5, Gemma)
  attention_bias: bool = False  # biases on the q, k and v projections (Qwen2, gpt-oss)
  attention_out_bias: bool = False  # a bias on the output projection (gpt-oss)
  qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
  attention_sinks: bool = False  # a learned logit per head that joins each softmax (gpt-oss)
  query_pre_attn_scalar: float = 0.0  # the softmax scale is 1/√this (Gemma 3); 0: 1/√(the q/k head size)
  attn_logit_softcap: float = 0.0  # scores → cap·tanh(scores/cap) (0: off)
  final_logit_softcap: float = 0.0  # logits → cap·tanh(logits/cap) (0: off)
  sliding_window: int = 0  # keys a sliding layer's query sees, its own included (0: none)
  layer_types: tuple[str, ...] = ()  # "full" or "sliding" per layer; empty: all sliding when sliding_window, else full
  local_rope_theta: float = 0.0  # the sliding layers' RoPE base, unscaled (Gemma 3); 0: the full layers' RoPE
  norm_weight_offset: float = 0.0  # the norms scale by offset + w (Gemma: 1)
  sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 3)
  scale_embeddings: bool = False  # embeddings × √d_model (Gemma)
  # The token whose embedding row its lookups leave untrained (transformers' padding_idx, from config.json's
  # pad_token_id); -1: none. A zero row there (transformers zeroes it) keeps that token's hidden state at exactly
  # zero, where each RMSNorm's derivative is 1/√eps: the lookup's gradient to the row reaches ~1e19 and overflows
  # the gradient's norm, though the weights' gradients are unaffected (decoder.Decoder.hidden_and_aux).
  pad_token_id: int = -1
  mlp_activation: str = "silu"  # "silu" (SwiGLU), "gelu_tanh" (GeGLU, Gemma) or "swiglu_oss" (gpt-oss, clamped)
  swiglu_alpha: float = 1.702  # swiglu_oss only
  swiglu_limit: float = 7.0  # swiglu_oss only
  attention_kind: str = "gqa"  # "gqa" or "mla" (DeepSeek-V3's multi-head latent attention)
  q_lora_rank: int = 0  # MLA: the queries' low rank (0: a full q projection)
  kv_lora_rank: int = 512  # MLA: the keys' and values' latent
  qk_rope_head_dim: int = 64  # MLA: the rotary part of q and k, shared by the heads for k
  v_head_dim: int = 128  # MLA: the values' head size
  rope_interleave: bool = False  # rotate adjacent pairs (DeepSeek) rather than halves
  rope_scaling: str = "none"  # "none", "linear", "llama3" (Llama 3.1) or "yarn" (gpt-oss, DeepSeek-V3)
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0  # llama3 scaling only
  rope_high_freq_factor: float = 4.0  # llama3 scaling only
  rope_original_max_len: int = 8192  # llama3 and yarn scaling
  rope_beta_fast: float = 32.0  # yarn scaling only
  rope_beta_slow: float = 1.0  # yarn scaling only
  rope_truncate: bool = True  # yarn scaling only
  rope_mscale: float = 0.0  # yarn scaling only (DeepSeek)
  rope_mscale_all_dim: float = 0.0  # yarn scaling only (DeepSeek: also scales MLA's softmax)
  context_attention: str = "ring"  # with a context mesh axis: "ring" or "all_gather" (kernels/attention/ring.py)
  fp8: str = "none"  # "none", "current" or "delayed": the projections' operands rounded to FP8 (kernels/fp8.py)
  fp8_amax_history: int = 16  # steps of amax each delayed scale is taken from (fp8 "delayed" only)
  fp8_min_dim: int = 2048  # a matmul whose weight is smaller along its contraction or output stays bf16 (fp8.active)
  hf_model_type: str = ""  # the Hugging Face family it was read from and is written as ("qwen3", …); "": inferred
  lora_rank: int = 0  # LoRA adapters of this rank on lora_targets, the rest frozen (recipes/lora.py); 0: none
  lora_alpha: float = 16.0  # the adapters' scale is lora_alpha / lora_rank (PEFT's)
  lora_dropout: float = 0.0  # the probability of dropping an adapter's input in training (PEFT's lora_dropout)
  lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
  mtp_depth: int = 0  # DeepSeek-V3's multi-token prediction: this many modules, each a token further (mtp.py)
  mtp_loss_weight: float = 0.3  # the loss adds this × the depths' mean cross-entropy (DeepSeek-V3: 0.3, then 0.1)

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}).")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {self.remat!r}.")
    if self.rope_scaling not in SCALINGS:
      raise ValueError(f"rope_scaling must be one of {', '.join(SCALINGS)}, got {self.rope_scaling!r}.")
    fp8.check_mode(self.fp8)
    if self.fp8_amax_history < 1:
      raise ValueError(f"fp8_amax_history must be at least 1, got {self.fp8_amax_history}.")
    if self.context_attention not in ("ring", "all_gather"):
      raise ValueError(f"context_attention must be 'ring' or 'all_gather', got {self.context_attention!r}.")
    if (
      isinstance(self.max_segments, bool)
      or not isinstance(self.max_segments, int)
      or not (self.max_segments == 0 or self.max_segments >= 2)
    ):
      raise ValueError(
        f"max_segments must be 0 (a dense segment mask) or at least 2 (a document and the"
        f" padding), got {self.max_segments!r}."
      )
    if self.attention not in attention_kernels.REQUESTS:
      raise ValueError(f"attention must be 'auto', 'xla', 'cudnn' or 'splash', got {self.attention!r}.")
    if self.attention_kind not in attention.VARIANTS:
      raise ValueError(f"attention_kind must be one of {', '.join(attention.VARIANTS)}, got {self.attention_kind!r}.")
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(f"mlp_activation must be one of {', '.join(MLP_ACTIVATIONS)}, got {self.mlp_activation!r}.")
    if self.layer_types and (
      len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types)
    ):
      raise ValueError(
        f"layer_types must name 'full' or 'sliding' for each of the {self.num_layers} layers, got {self.layer_types!r}."
      )
    if "sliding" in self.layer_types and self.sliding_window < 1:
      raise ValueError("layer_types names sliding layers but sliding_window is 0: set the window's size.")
    if self.sliding_window < 0:
      raise ValueError(f"sliding_window must be 0 (none) or positive, got {self.sliding_window}.")
    if not -1 <= self.pad_token_id < self.vocab_size:
      raise ValueError(
        f"pad_token_id must be -1 (none) or a token id below vocab_size ({self.vocab_size}), got {self.pad_token_id}."
      )
    for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "local_rope_theta"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be 0 (off) or positive, got {getattr(self, name)}.")
    lora.check(self, attention.variant(self).lora_targets)
    if isinstance(self.mtp_depth, bool) or not isinstance(self.mtp_depth, int) or self.mtp_depth < 0:
      raise ValueError(
        f"mtp_depth must be 0 (no multi-token prediction) or a positive number of modules, got {self.mtp_depth!r}."
      )
    if not self.mtp_loss_weight >= 0:
      raise ValueError(f"mtp_loss_weight must be 0 or more (DeepSeek-V3: 0.3), got {self.mtp_loss_weight!r}.")

  def trainable(self) -> Any:
    """The nnx filter of the params that train: the LoRA adapters where there are any, else None (all)."""
    return lora.trainable if self.lora_rank else None

  # --- the layers --------------------------------------------------------------------------------

  def mixture_layers(self) -> frozenset[int]:
    """The layers whose MLP is a mixture of experts (none here; ``MoEConfig`` says which)."""
    return frozenset()

  def layer_kinds(self) -> tuple[Kind, ...]:
    """What each layer composes: experts or a gated MLP, a sliding window or full attention."""
    types = self.layer_types or (("sliding" if self.sliding_window else "full"),) * self.num_layers
    mixture = self.mixture_layers()
    return tuple(Kind(mixture=i in mixture, sliding=t == "sliding") for i, t in enumerate(types))

  @property
  def qk_dim(self) -> int:
    """A head's query and key size (MLA: with the rotary part)."""
    return attention.variant(self).qk_dim(self)

  @property
  def v_dim(self) -> int:
    return attention.variant(self).v_dim(self)

  def rope(self, sliding: bool = False) -> Rope:
    """The rotary embedding of a full layer, or of a sliding one (its own unscaled base, where it has one)."""
    if sliding and self.local_rope_theta:
      return Rope(theta=self.local_rope_theta)
    return Rope(
      theta=self.rope_theta,
      scaling=self.rope_scaling,
      factor=self.rope_factor,
      low_freq_factor=self.rope_low_freq_factor,
      high_freq_factor=self.rope_high_freq_factor,
      original_max_len=self.rope_original_max_len,
      beta_fast=self.rope_beta_fast,
      beta_slow=self.rope_beta_slow,
      truncate=self.rope_truncate,
      mscale=self.rope_mscale,
      mscale_all_dim=self.rope_mscale_all_dim,
    )

  def softmax_scale(self) -> float | None:
    """The attention softmax scale (None: 1/√qk_dim, the kernels' default)."""
    return attention.variant(self).softmax_scale(self)

  @property
  def packed_segments(self) -> int:
    """The documents + 1 a packed row may hold in cuDNN's packed layout: ``max_segments``, or 0 where the
    attention cannot run it (sinks or a soft cap: no cuDNN; MLA's values of another size), so the data loader
    caps no row for it."""
    cannot = self.attention_sinks or self.attn_logit_softcap or self.qk_dim != self.v_dim
    return 0 if cannot else self.max_segments

  def attention_for(self, kind: Kind) -> attention_kernels.Attention:
    """What a layer of ``kind``'s attention computes and the kernel it asks for."""
    return attention_kernels.Attention(
      requested=self.attention,
      window=self.sliding_window if kind.sliding else 0,
      scale=self.softmax_scale(),
      softcap=self.attn_logit_softcap,
      max_segments=self.packed_segments,
      context=self.context_attention,
      regather=self.remat == "none",
    )

  # --- the family protocol (family.py) -----------------------------------------------------------

  def num_params(self) -> int:
    """Every parameter, embeddings, output head and multi-token-prediction modules included (counted from the
    model's shapes)."""
    return sum(math.prod(shape) for shape in _param_shapes(self).values())

  def active_params(self) -> int:
    """The parameters one token passes through in training (all of a dense model's, MTP modules included)."""
    return self.num_params()

  def flops_per_token(self, seq_len: int) -> int:
    """Training FLOPs per token, PaLM's count: 6·N_active + 6·Σ_layers heads·(qk + v)·S, where a sliding layer's
    S is its window where that is shorter (12·L·heads·head_dim·S for a plain decoder); with ``mtp_depth``, each
    MTP module's block attention and the shared head's matmul again too (``mtp.extra_flops_per_token``)."""
    attention = sum(min(seq_len, self.sliding_window) if kind.sliding else seq_len for kind in self.layer_kinds())
    return (
      6 * self.active_params()
      + 6 * self.num_heads * (self.qk_dim + self.v_dim) * attention
      + mtp.extra_flops_per_token(self, seq_len)
    )

  def capabilities(self) -> Capabilities:
    """What the model runs (the family protocol, ``family.py``)."""
    from distrib_train.recipes.decoder import segments

    return Capabilities(
      fp8=self.fp8,
      attention=self.attention,
      max_segments=self.packed_segments,
      dtype=self.dtype,
      remat=self.remat,
      num_layers=self.num_layers,
      d_model=self.d_model,
      num_heads=self.num_heads,
      mlp_dim=self.mlp_dim,
      scan_lengths=tuple(s.count // len(s.kinds) for s in segments(self)),
    )

  def build(self, rngs: nnx.Rngs | int = 0) -> Decoder:
    """A freshly initialised model (annotations are logical: no eager sharding)."""
    rngs = nnx.Rngs(rngs) if isinstance(rngs, int) else rngs
    with nnx.use_eager_sharding(False):
      return Decoder(self, rngs=rngs)


@functools.lru_cache(maxsize=64)
def _param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """Each param's shape, by path, from the model built abstractly (nothing is allocated)."""
  abstract = nnx.eval_shape(lambda: config.build(0))
  leaves = jax.tree_util.tree_flatten_with_path(nnx.state(abstract, nnx.Param))[0]
  return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in leaves}


PRESETS: dict[str, LlamaConfig] = {
  # Trains in seconds on CPU; byte-level vocabulary.
  "tiny": LlamaConfig(
    vocab_size=256,
    d_model=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=192,
    max_seq_len=256,
    dtype="float32",
    loss_chunk_size=64,
    fp8_min_dim=0,
  ),
  "124m": LlamaConfig(d_model=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64, mlp_dim=2048),
  "350m": LlamaConfig(d_model=1024, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=64, mlp_dim=2816),
  "1b": LlamaConfig(
    d_model=2048, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=128, mlp_dim=5632, max_seq_len=2048
  ),
  "7b": LlamaConfig(
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    mlp_dim=11008,
    max_seq_len=4096,
    remat="full",
  ),
  "70b": LlamaConfig(
    d_model=8192,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=28672,
    max_seq_len=4096,
    remat="full",
  ),
  # Qwen3-8B's shape (8.2B parameters): q/k norms, GQA 32/8, an untied 152k head.
  "qwen3-8b": LlamaConfig(
    vocab_size=151936,
    d_model=4096,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=12288,
    max_seq_len=40960,
    rope_theta=1e6,
    norm_eps=1e-6,
    qk_norm=True,
    remat="full",
    hf_model_type="qwen3",
  ),
  # Gemma 3 27B, text (27.0B parameters): 62 layers, every 6th global (RoPE 1e6, linear ×8), the others a
  # window of 1024 (RoPE 1e4); GeGLU, sandwich norms, q/k norms, a tied 262k vocabulary.
  "gemma3-27b": LlamaConfig(
    vocab_size=262208,
    d_model=5376,
    num_layers=62,
    num_heads=32,
    num_kv_heads=16,
    head_dim=128,
    mlp_dim=21504,
    max_seq_len=131072,
    rope_theta=1e6,
    norm_eps=1e-6,
    qk_norm=True,
    sandwich_norms=True,
    norm_weight_offset=1.0,
    scale_embeddings=True,
    mlp_activation="gelu_tanh",
    query_pre_attn_scalar=168.0,
    sliding_window=1024,
    layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(62)),
    local_rope_theta=1e4,
    rope_scaling="linear",
    rope_factor=8.0,
    tie_embeddings=True,
    remat="full",
    hf_model_type="gemma3_text",
  ),
}
