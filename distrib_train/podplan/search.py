"""Recommend a mesh: which factorisation of the devices over the mesh axes is fastest and fits.

``recommend(config, mesh_config, kind, devices)`` enumerates every
factorisation of the devices over the mesh config's axes (ICI inside a
granule; DCN across granules, never for ``tensor``), plans each without
compiling and drops those whose state does not fit, whose batch does not
split over ``data × fsdp`` or whose rules skip a parameter dimension. The
rest are ordered — those whose state plus ``rough_activation_bytes`` fits
first, each group by ``rough_seconds``, a compile-free estimate of the
communication — and at most ``max_compiles`` of them are compiled
(``podplan.plan_pod``); those that fit are ranked by the estimated step
time. ``mesh_config_yaml`` writes one as a mesh-config file.

Not for: the figures of one mesh (``podplan.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax

from distrib_train.cluster import hardware
from distrib_train.microbatches import STAGE_AXIS, Pipelining, bubble_fraction
from distrib_train.sharding.axis_rules import AxisRules
from distrib_train.config.run import Config
from distrib_train.sharding.mesh import MeshConfig
from distrib_train.podplan.estimate import DEFAULT_EFFICIENCY, Layout, PodPlan, StepSpec, plan_pod, step_spec
from distrib_train.sharding.topology import TpuTopology


def _factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
  """Every ordered way to write ``n`` as a product of ``parts`` positive integers."""
  if parts == 1:
    return [(n,)]
  out = []
  for first in range(1, n + 1):
    if n % first == 0:
      out += [(first,) + rest for rest in _factorisations(n // first, parts - 1)]
  return out


def candidate_meshes(mesh_config: MeshConfig, devices: int, granules: int) -> list[MeshConfig]:
  """Mesh configs over the same axes for ``devices``: every ICI factorisation of a
  granule's devices, times every DCN factorisation of the granules over the
  axes other than ``tensor`` (tensor parallelism across DCN is never worth it)."""
  names = mesh_config.axis_names
  per_granule = devices // granules
  dcn_axes = [i for i, n in enumerate(names) if n != "tensor"] or list(range(len(names)))
  dcn_options = []
  for sizes in _factorisations(granules, len(dcn_axes)):
    dcn = [1] * len(names)
    for i, s in zip(dcn_axes, sizes):
      dcn[i] = s
    dcn_options.append(tuple(dcn))
  out = []
  for ici in _factorisations(per_granule, len(names)):
    for dcn in dcn_options:
      label = "×".join(f"{n}{i * d}" for n, i, d in zip(names, ici, dcn))
      out.append(MeshConfig(names, ici, dcn, rules=mesh_config.rules, source=f"candidate {label}", devices=devices))
  return out


def rough_seconds(candidate: Layout, spec: StepSpec, kind: hardware.DeviceKind, emulated: bool = True) -> float:
  """A compile-free guess of a layout's communication time, to order compiles.

  FSDP: the params gathered for the forward and the backward pass and the
  gradients reduce-scattered; data: the gradients all-reduced; tensor: two
  all-reduces of the activations per layer in each forward pass (two with
  full remat) and in the backward pass, in f32 on the CPU compiler; stage:
  each stage holds 1/stage of the layers, and every pipeline iteration
  sends one microbatch's activations to the next stage, forward and
  backward, while the bubble's share of the compute is lost. An axis that
  spans DCN moves at DCN speed.
  """
  sizes = {n: i * d for n, i, d in zip(candidate.axis_names, candidate.ici, candidate.dcn)}
  over_dcn = {n for n, d in zip(candidate.axis_names, candidate.dcn) if d > 1}
  bandwidth = lambda axis: kind.dcn_bandwidth if axis in over_dcn else kind.ici_bandwidth
  data, fsdp, tensor = sizes.get("data", 1), sizes.get("fsdp", 1), sizes.get("tensor", 1)
  stage = sizes.get(STAGE_AXIS, 1)
  params = jax.tree_util.tree_leaves(spec.abstract_state.params)
  param_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in params) / stage
  seconds = 3 * param_bytes / tensor * (fsdp - 1) / fsdp / bandwidth("fsdp")
  seconds += 2 * param_bytes / (fsdp * tensor) * (data - 1) / data / bandwidth("data")
  caps = spec.family.capabilities()
  d_model, layers = caps.d_model, caps.num_layers
  local_tokens = spec.tokens_per_step / max(1, data * fsdp)
  value = 4 if emulated or caps.dtype == "float32" else 2
  passes = 3 if caps.remat == "full" else 2
  seconds += (
    2 * passes * layers / stage * local_tokens * d_model * value * 2 * (tensor - 1) / tensor / bandwidth("tensor")
  )
  if stage > 1:
    m, r = spec.microbatches, spec.pipeline_repeats
    iterations = r * m + stage - 1
    seconds += 2 * iterations * local_tokens / m * d_model * value / bandwidth(STAGE_AXIS)
    flops = spec.model_flops_per_step()
    if flops:  # the bubble: each stage idles (S-1)/(R·M+S-1) of its iterations
      busy = flops / (data * fsdp * tensor * stage) / (kind.peak_flops * DEFAULT_EFFICIENCY)
      seconds += busy * bubble_fraction(stage, m, r) / (1 - bubble_fraction(stage, m, r))
  return seconds


def rough_activation_bytes(candidate: Layout, spec: StepSpec) -> float:
  """A compile-free guess of a decoder's activation memory per device, to order compiles.

  Per device ``T = tokens / (data × fsdp)``. Kept for the backward pass: the
  residual stream ``[T, d]`` per layer with remat, else about ``6d + 3·mlp/t``
  values per token per layer. Live in one layer: three ``[T/S, heads/t, S, S]``
  attention-score arrays and four ``[T, mlp/t]``. Values of the compute dtype
  (2 bytes for bf16). The sum is scaled by 1.25: the 7B preset's compile on
  fsdp 256 needs that much more than the count (fusion buffers, the loss
  chunks, the optimizer update).
  """
  caps = spec.family.capabilities()
  d, layers = caps.d_model, caps.num_layers
  if not d or not layers:
    return 0.0
  sizes = {n: i * dc for n, i, dc in zip(candidate.axis_names, candidate.ici, candidate.dcn)}
  tensor = sizes.get("tensor", 1)
  layers = layers / sizes.get(STAGE_AXIS, 1)  # a stage keeps its layers' activations for every microbatch
  tokens = spec.tokens_per_step / max(1, sizes.get("data", 1) * sizes.get("fsdp", 1))
  seq_len = spec.inputs["tokens"].shape[1] if "tokens" in spec.inputs else 0
  heads, mlp = caps.num_heads / tensor, caps.mlp_dim / tensor
  value = 2 if caps.dtype == "bfloat16" else 4
  kept = d if caps.remat == "full" else 6 * d + 3 * mlp
  return 1.25 * value * tokens * (layers * kept + 3 * heads * seq_len + 4 * mlp)


def _pipeline_fits(pod: PodPlan, spec: StepSpec) -> bool:
  """Whether a candidate's stage axis can pipeline the model: the schedule runs these microbatches on this
  batch (``Pipelining.check``, the step's own check), the layers split into stages × repeats, and a
  microbatch splits over the batch axes."""
  sizes = dict(zip(pod.layout.axis_names, pod.layout.shape))
  stage = sizes.get(STAGE_AXIS, 1)
  if stage <= 1:
    return spec.pipeline_repeats == 1 or STAGE_AXIS not in sizes
  m, r = spec.microbatches, spec.pipeline_repeats
  batch = next(iter(spec.inputs.values())).shape[0]
  try:
    Pipelining(pod.plan.mesh, m, r).check(batch)
  except ValueError:
    return False
  stacks = spec.family.capabilities().scan_lengths  # each stack of layers is pipelined by itself
  ways = sizes.get("data", 1) * sizes.get("fsdp", 1)
  return all(n % (stage * r) == 0 for n in stacks) and (batch // m) % ways == 0


def drop_reason(pod: PodPlan, spec: StepSpec) -> str | None:
  """Why an uncompiled plan cannot be a candidate (a key of ``Recommendation.dropped``), or None."""
  if not _pipeline_fits(pod, spec):
    return "the pipeline cannot split the layers or the batch"
  if any(s.path.startswith("inputs") and s.logical_name == "batch" for s in pod.plan.skips):
    return "batch does not split"
  if any(s.path.startswith("params") for s in pod.plan.skips):
    return "a rule skips a parameter dimension"
  if pod.memory.state + pod.memory.inputs > pod.memory.usable:
    return "state does not fit"
  return None


@dataclasses.dataclass
class Recommendation:
  """What ``recommend`` found: the ranked compiled plans and what it skipped."""

  ranked: list[PodPlan]
  candidates: int
  dropped: dict[str, int]
  compiled: int
  not_fitting_compiled: list[PodPlan]


def recommend(
  config: Config,
  mesh_config: MeshConfig,
  kind: hardware.DeviceKind,
  devices: int,
  *,
  granules: int = 1,
  max_compiles: int = 6,
  efficiency: float = DEFAULT_EFFICIENCY,
  memory_fraction: float | None = None,
  constrain_activations: bool = True,
  progress: Any = None,
  target: Any = None,
) -> Recommendation:
  """Ranks the mesh factorisations of ``devices`` by estimated step time.

  Every candidate is planned without compiling (state bytes per device, rule
  skips); those whose state alone does not fit, whose batch does not split
  over ``data × fsdp``, or whose rules skip a parameter dimension are
  dropped. The rest are ordered by ``rough_seconds`` and at most
  ``max_compiles`` are compiled; those whose compiled total fits are ranked
  by the estimated step time. With a TPU ``target`` every candidate is laid
  on libtpu's devices for it (one that does not map onto the topology is
  dropped) and the finalists are compiled by libtpu.
  """
  say = progress or (lambda message: None)
  platform = jax.devices()[0].platform if target is None else "tpu" if isinstance(target, TpuTopology) else "gpu"
  spec = step_spec(config, platform)
  dropped = {
    "state does not fit": 0,
    "batch does not split": 0,
    "a rule skips a parameter dimension": 0,
    "the pipeline cannot split the layers or the batch": 0,
    "does not map onto the TPU topology": 0,
    "the compiler failed": 0,
  }
  survivors = []
  candidates = candidate_meshes(mesh_config, devices, granules)
  for candidate in candidates:
    try:
      pod = plan_pod(
        config,
        candidate,
        kind,
        devices,
        granules=granules,
        compile=False,
        spec=spec,
        memory_fraction=memory_fraction,
        target=target,
      )
    except ValueError as e:
      if target is None or "does not fit TPU topology" not in str(e):
        raise
      dropped["does not map onto the TPU topology"] += 1
      continue
    why = drop_reason(pod, spec)
    if why:
      dropped[why] += 1
    else:
      rough_total = pod.memory.state + pod.memory.inputs + rough_activation_bytes(pod.layout, spec)
      seconds = rough_seconds(pod.layout, spec, kind, pod.emulated)
      survivors.append((rough_total > pod.memory.usable, seconds, rough_total, candidate))
  # Likely to fit first, then the fastest communication; the rest by how little memory they need.
  survivors.sort(key=lambda s: (s[0], s[1] if not s[0] else s[2]))
  ranked, not_fitting = [], []
  for number, (*_, candidate) in enumerate(survivors[:max_compiles], 1):
    say(f"compiling {number}/{min(max_compiles, len(survivors))}: {candidate.source.removeprefix('candidate ')}")
    try:
      pod = plan_pod(
        config,
        candidate,
        kind,
        devices,
        granules=granules,
        spec=spec,
        efficiency=efficiency,
        memory_fraction=memory_fraction,
        constrain_activations=constrain_activations,
        target=target,
      )
    except ValueError as e:  # the target's compiler could not compile this layout
      if target is None:
        raise
      say(f"  not compiled: {e}")
      dropped["the compiler failed"] += 1
      continue
    finally:
      jax.clear_caches()
    (ranked if pod.memory.fits else not_fitting).append(pod)
  ranked.sort(key=lambda p: p.time.step_s)
  return Recommendation(ranked, len(candidates), dropped, min(max_compiles, len(survivors)), not_fitting)


def mesh_config_yaml(pod: PodPlan, rules: AxisRules, header: Sequence[str] = ()) -> str:
  """A mesh-config file for ``pod``'s mesh (loadable by ``MeshConfig.from_yaml``)."""
  layout = pod.layout
  topology = pod.topology if isinstance(pod.topology, TpuTopology) else None
  return MeshConfig(
    layout.axis_names, layout.ici, layout.dcn, rules=rules, devices=pod.devices, topology=topology
  ).to_yaml(header)
