"""The mixtures' config: Mixtral, Qwen2-MoE and Qwen3-MoE, DeepSeek-V3, gpt-oss — and the presets.

``MoEConfig`` is a ``LlamaConfig`` whose layers (all but ``dense_layers``,
which keep a gated MLP of ``mlp_dim``) route each token to
``experts_per_token`` of ``num_experts`` experts (``routing.py``: a
softmax, sigmoid or top-k-softmax router, DeepSeek's groups and score
correction, gpt-oss's logit bias), plus optional shared experts that see
every token (DeepSeek; Qwen2-MoE's behind a sigmoid gate). The training loss
adds a load-balancing loss (Switch's ``E · Σ f_e · P_e``) and a router
z-loss (``mean logsumexp²``), weighted by ``aux_loss_weight`` and
``z_loss_weight``.

``router_score_bias`` gives each mixture layer DeepSeek-V3's per-expert
score correction (``RouterBias`` local state, never seen by the optimizer),
added to the scores to choose the experts only; ``router_bias_update_rate``
> 0 also moves it, once per step, by ``rate · sign(mean load − load)`` from
the loads the step measured over the whole global batch (a step of several
microbatches sums theirs).

Dropless by default: every token reaches its experts, through grouped
matmuls (``kernels/grouped.py``: each expert's rows padded only to the
kernel's tile); ``capacity_factor`` > 0 caps each expert at ``ceil(cf ·
assignments / experts)`` assignments of a device's tokens and drops (and
counts) the rest. On a mesh the experts are split over the ``expert`` axis
(``parallel/experts.py``).

Not for: the model's code (``decoder.py``, ``blocks.py``).
"""

from __future__ import annotations

import dataclasses

from distrib_train.recipes import llama, mtp
from distrib_train.recipes.decoder import INPUT_AXES, loss_fn  # noqa: F401 (the family's)
from distrib_train.recipes.routing import ROUTERS


@dataclasses.dataclass(frozen=True)
class MoEConfig(llama.LlamaConfig):
  """A decoder config plus the mixture of experts (``mlp_dim``: the ``dense_layers``' width)."""

  num_experts: int = 8
  experts_per_token: int = 2
  expert_mlp_dim: int = 1024
  num_shared_experts: int = 0
  shared_mlp_dim: int = 0  # all shared experts together; 0: num_shared_experts × expert_mlp_dim
  shared_expert_gate: bool = False  # Qwen2-MoE: a sigmoid gate on the shared experts' output
  router: str = "softmax"  # "softmax" (Mixtral, Qwen), "sigmoid" (DeepSeek-V3) or "softmax_topk" (gpt-oss)
  router_groups: int = 1  # DeepSeek-V3: experts in this many groups, ...
  router_group_topk: int = 1  # ... of which a token's experts come from the best this many
  router_logit_bias: bool = False  # a trained bias on the router's logits (gpt-oss)
  router_score_bias: bool = False  # DeepSeek-V3's score correction (local state; moved by the update rate)
  expert_bias: bool = False  # biases on the experts' projections (gpt-oss)
  norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1
  routed_scaling: float = 1.0  # DeepSeek-V3 scales the routed output (2.5)
  dense_layers: tuple[int, ...] = ()  # layers with a gated MLP of mlp_dim instead of experts (DeepSeek's first 3)
  capacity_factor: float = 0.0  # 0: dropless
  aux_loss_weight: float = 0.01
  z_loss_weight: float = 0.001
  router_bias_update_rate: float = 0.0  # DeepSeek-V3's loss-free balancing bias, its step per update (0: off; 0.001)

  def __post_init__(self):
    super().__post_init__()
    if self.router not in ROUTERS:
      raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}.")
    if not 1 <= self.experts_per_token <= self.num_experts:
      raise ValueError(
        f"experts_per_token ({self.experts_per_token}) must be between 1 and num_experts ({self.num_experts})."
      )
    per_group = self.num_experts // max(self.router_groups, 1)
    if (
      self.router_groups < 1
      or self.num_experts % self.router_groups
      or not (1 <= self.router_group_topk <= self.router_groups)
    ):
      raise ValueError(
        f"router_groups ({self.router_groups}) must divide num_experts ({self.num_experts}) and"
        f" router_group_topk ({self.router_group_topk}) be between 1 and it."
      )
    if self.router_groups > 1 and (per_group < 2 or self.router_group_topk * per_group < self.experts_per_token):
      raise ValueError(
        f"router_groups ({self.router_groups}) of {per_group} experts, the best"
        f" {self.router_group_topk} kept: a group needs at least 2 experts (it scores its best two)"
        f" and the kept groups at least experts_per_token ({self.experts_per_token})."
      )
    if self.capacity_factor < 0:
      raise ValueError(f"capacity_factor must be 0 (dropless) or positive, got {self.capacity_factor}.")
    if not self.router_bias_update_rate >= 0:
      raise ValueError(
        f"router_bias_update_rate must be 0 (off) or positive (DeepSeek-V3: 0.001), got {self.router_bias_update_rate}."
      )
    if any(not 0 <= layer < self.num_layers for layer in self.dense_layers):
      raise ValueError(f"dense_layers {self.dense_layers!r} names layers outside 0…{self.num_layers - 1}.")

  @property
  def shared_width(self) -> int:
    return self.shared_mlp_dim or self.num_shared_experts * self.expert_mlp_dim

  def mixture_layers(self) -> frozenset[int]:
    return frozenset(range(self.num_layers)) - frozenset(self.dense_layers)

  def active_params(self) -> int:
    """The parameters one token passes through (its ``experts_per_token`` routed experts), in the MTP modules'
    mixture blocks too."""
    d, f = self.d_model, self.expert_mlp_dim
    per_expert = 3 * d * f + ((2 * f + d) if self.expert_bias else 0)
    blocks = len(self.mixture_layers()) + (self.mtp_depth if mtp.kind(self).mixture else 0)
    unused = (self.num_experts - self.experts_per_token) * per_expert * blocks
    return self.num_params() - unused


PRESETS: dict[str, MoEConfig] = {
  # Trains in seconds on CPU: 4 layers of 8 experts, 2 per token; byte-level vocabulary.
  "tiny": MoEConfig(
    vocab_size=256,
    d_model=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_seq_len=256,
    dtype="float32",
    loss_chunk_size=64,
    num_experts=8,
    experts_per_token=2,
    expert_mlp_dim=96,
    fp8_min_dim=0,
  ),
  # Mixtral-8x7B's shape: 46.7B parameters, 12.9B active.
  "mixtral-8x7b": MoEConfig(
    vocab_size=32000,
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_seq_len=4096,
    rope_theta=1e6,
    num_experts=8,
    experts_per_token=2,
    expert_mlp_dim=14336,
    remat="full",
  ),
  # Qwen3-30B-A3B (30.5B parameters, 3.3B active): 48 layers of 128 experts, 8 per token, renormalised.
  "qwen3-30b-a3b": MoEConfig(
    vocab_size=151936,
    d_model=2048,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    mlp_dim=6144,
    max_seq_len=40960,
    rope_theta=1e6,
    norm_eps=1e-6,
    qk_norm=True,
    num_experts=128,
    experts_per_token=8,
    expert_mlp_dim=768,
    norm_topk_prob=True,
    aux_loss_weight=0.001,
    remat="full",
    hf_model_type="qwen3_moe",
  ),
  # gpt-oss-20b (20.9B parameters; 4.2B active, 3.6B without the head): 24 layers alternating a window of 128
  # and full attention, sinks, YaRN (×32 over 4096), q/k/v/o biases, 32 experts with biases, 4 per token, the
  # clamped SwiGLU.
  "gpt-oss-20b": MoEConfig(
    vocab_size=201088,
    d_model=2880,
    num_layers=24,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    mlp_dim=2880,
    max_seq_len=131072,
    rope_theta=150000.0,
    attention_bias=True,
    attention_out_bias=True,
    attention_sinks=True,
    sliding_window=128,
    layer_types=("sliding", "full") * 12,
    rope_scaling="yarn",
    rope_factor=32.0,
    rope_original_max_len=4096,
    rope_truncate=False,
    mlp_activation="swiglu_oss",
    num_experts=32,
    experts_per_token=4,
    expert_mlp_dim=2880,
    router="softmax_topk",
    router_logit_bias=True,
    expert_bias=True,
    aux_loss_weight=0.001,
    remat="full",
    hf_model_type="gpt_oss",
  ),
  # DeepSeek-V3 (671B parameters, 37B active): multi-head latent attention (q rank 1536, kv latent 512, heads
  # of 128 + a shared 64-dim rotary part, values of 128), YaRN (×40 over 4096), 3 dense layers then 58 of 256
  # routed experts + 1 shared, 8 per token from the best 4 of 8 groups, sigmoid scores with the correction bias.
  "deepseek-v3": MoEConfig(
    vocab_size=129280,
    d_model=7168,
    num_layers=61,
    num_heads=128,
    num_kv_heads=128,
    head_dim=128,
    mlp_dim=18432,
    max_seq_len=4096,
    norm_eps=1e-6,
    attention_kind="mla",
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_interleave=True,
    rope_scaling="yarn",
    rope_factor=40.0,
    rope_original_max_len=4096,
    rope_mscale=1.0,
    rope_mscale_all_dim=1.0,
    num_experts=256,
    experts_per_token=8,
    expert_mlp_dim=2048,
    num_shared_experts=1,
    router="sigmoid",
    router_groups=8,
    router_group_topk=4,
    router_score_bias=True,
    routed_scaling=2.5,
    dense_layers=(0, 1, 2),
    remat="full",
    aux_loss_weight=0.0001,
    hf_model_type="deepseek_v3",
  ),
}
