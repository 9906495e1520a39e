"""Plan a pod from a laptop: compile the real step for N devices, read memory, collectives and time.

``plan_pod(config, mesh_config, devices=256, device_kind="v5e")`` builds the
mesh on N emulated CPU devices, plans the train state with ``MeshPlanner``,
lowers and compiles the trainer's step with ``jax.ShapeDtypeStruct`` inputs
that carry the shardings (no array is ever allocated), and reads the result:

- **memory per device**: params, optimizer state and local state from the
  plan; the batch; the compiled step's temporaries and undonated outputs
  (``memory_analysis()``) — against the device kind's memory, with a
  verdict and the headroom;
- **collectives**: every all-gather, reduce-scatter, all-reduce, all-to-all
  and collective-permute of the compiled program (``collectives.py``), per step,
  by mesh axis, over ICI or DCN;
- **time**: FLOPs per step and an estimated step time and MFU.

The step-time model, stated once:

  compute = matmul FLOPs per device of the compiled program (loop bodies
            × trip counts, recomputation included) / (peak × efficiency)
  ici     = bytes each device sends over ICI per step (ring model) / ICI bandwidth
  dcn     = the same over DCN / DCN bandwidth
  step    = compute + ici + dcn          (no overlap: an upper bound)
  MFU     = model FLOPs per device (PaLM: 6·N + 12·L·H·S per token) / (step × peak)

``efficiency`` (default 0.6) is the share of peak the matmuls reach; 0.6 is
what the 1b preset measures on one H100 (59.9 % MFU, bench/RESULTS.md).
Device figures are in ``hardware.py``.

Granules (what DCN links): for a mesh config with DCN sizes, the emulated
devices are laid out as ``create_hybrid_device_mesh`` would (the DCN index is
the major part of each axis); GPU devices beyond one host are grouped by
``devices_per_host`` in mesh order; a TPU mesh without DCN sizes is one slice.

What emulation cannot see: the CPU compiler, not the TPU or GPU one, makes
the program. It computes bf16 in float32 (its temporaries of a bf16 model
count × ``CPU_BF16_TEMPORARIES``), writes
reduce-scatters as all-reduce + slice (recognised and counted as
reduce-scatters), and cannot compile cuDNN attention (``cpu_attention.py``
stands in with the same memory profile). Planning on the real machine's
devices (``distrib-train plan --native``) gives that compiler's figures.

Not for: running the step (``trainer.py``), reading HLO (``hlo_module.py``) or
choosing among meshes (``mesh_search.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from distrib_train.podplan import collectives as collectives_lib
from distrib_train.podplan import cpu_attention
from distrib_train.cluster import hardware
from distrib_train.podplan import hlo as hlo_module
from distrib_train.training import optimizers
from distrib_train.sharding.axis_rules import AxisRules, activation_sharding
from distrib_train.training.config import Config
from distrib_train.sharding.mesh import MeshConfig
from distrib_train.sharding.plan import Plan, logical_annotations_only
from distrib_train.sharding.planner import MeshPlanner
from distrib_train.train_state import TrainState
from distrib_train.train_step import build_train_step_fn

DEFAULT_EFFICIENCY = 0.6
_OTHER_STATE = ("step", "root_rng", "model_without_params", "loss_fn_state")


def use_emulated_devices(count: int) -> None:
  """Makes JAX run on ``count`` emulated CPU devices; call before any JAX use.

  Raises:
    ValueError: JAX has already started with other devices.
  """
  from jax._src import xla_bridge

  if count < 1:
    raise ValueError(f"--devices must be at least 1, got {count}.")
  if xla_bridge.backends_are_initialized():
    found = jax.devices()
    if len(found) != count or found[0].platform != "cpu":
      raise ValueError(f"JAX already runs on {len(found)} {found[0].platform} device(s); planning for {count}"
                       " emulated devices must start before any other JAX use (a fresh process).")
    return
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", count)


# --- the layout of the devices ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
  """Mesh sizes for a device count, and which granule each device is in.

  Attributes:
    axis_names: mesh axes, in order.
    ici: per-axis size inside a granule.
    dcn: per-axis size across granules.
    granule_of: the granule of each device, by flat mesh position.
  """

  axis_names: tuple[str, ...]
  ici: tuple[int, ...]
  dcn: tuple[int, ...]
  granule_of: tuple[int, ...]

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(i * d for i, d in zip(self.ici, self.dcn))

  @property
  def granules(self) -> int:
    return len(set(self.granule_of))

  def describe(self) -> str:
    """``data=2 (2 over DCN) × fsdp=128 × tensor=4``."""
    parts = []
    for name, ici, dcn in zip(self.axis_names, self.ici, self.dcn):
      parts.append(f"{name}={ici * dcn}" + (f" ({dcn} over DCN)" if dcn > 1 else ""))
    return " × ".join(parts)


def layout(mesh_config: MeshConfig, devices: int, kind: hardware.DeviceKind, granules: int | None = None) -> Layout:
  """Resolves ``mesh_config`` for ``devices`` and assigns devices to granules.

  Raises:
    ValueError: the sizes do not fit the device count (named).
  """
  if mesh_config.devices is not None and mesh_config.devices != devices:
    raise ValueError(f"{mesh_config.source} is for {mesh_config.devices} devices, not {devices}; pick a mesh config"
                     f" for {devices} devices or pass --devices {mesh_config.devices}.")
  if mesh_config.is_hybrid:
    if granules is None:  # from whichever level has no -1
      if -1 not in mesh_config.dcn:
        granules = math.prod(mesh_config.dcn)
      elif -1 not in mesh_config.ici:
        granules = devices // math.prod(mesh_config.ici)
      else:
        raise ValueError(f"{mesh_config.source}: cannot tell the number of granules; pass --granules.")
    ici, dcn = mesh_config.resolve(devices, granules)
    dcn_shape = tuple(dcn)
    coords = np.indices(tuple(i * d for i, d in zip(ici, dcn))).reshape(len(ici), -1)
    dcn_index = tuple(c // i for c, i in zip(coords, ici))
    granule_of = np.ravel_multi_index(dcn_index, dcn_shape)
  else:
    ici, dcn = mesh_config.resolve(devices)
    per_granule = kind.devices_per_host if kind.platform == "gpu" else kind.max_slice
    granule_of = np.arange(devices) // per_granule
  return Layout(mesh_config.axis_names, tuple(ici), tuple(dcn), tuple(int(g) for g in granule_of))


def emulated_mesh(lay: Layout, devices: Sequence[Any] | None = None) -> Mesh:
  """The devices reshaped to the layout's mesh (Auto axes), in device order."""
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) != math.prod(lay.shape):
    raise ValueError(f"The mesh {lay.describe()} needs {math.prod(lay.shape)} devices; JAX has {len(devices)}.")
  return Mesh(np.array(devices, dtype=object).reshape(lay.shape), lay.axis_names,
              axis_types=(AxisType.Auto,) * len(lay.shape))


# --- the step --------------------------------------------------------------------


@dataclasses.dataclass
class StepSpec:
  """What the trainer would build for a config: state, inputs, loss, FLOPs."""

  abstract_state: TrainState
  inputs: dict[str, jax.ShapeDtypeStruct]
  loss_fn: Any
  input_axes: Mapping[str, Any]
  model_config: Any
  notes: list[str]
  make_state: Any = None  # builds the real state (``Plan.init(spec.make_state)``)

  @property
  def tokens_per_step(self) -> int:
    shape = self.inputs["tokens"].shape if "tokens" in self.inputs else next(iter(self.inputs.values())).shape
    return math.prod(shape[:2])

  def model_flops_per_step(self) -> float | None:
    if not hasattr(self.model_config, "flops_per_token"):
      return None
    seq_len = self.inputs["tokens"].shape[1]
    return float(self.model_config.flops_per_token(seq_len)) * self.tokens_per_step

  def param_count(self) -> int:
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(self.abstract_state.params))


def step_spec(config: Config, platform: str = "cpu") -> StepSpec:
  """The abstract train state and batch the trainer builds for ``config``."""
  from distrib_train.training.trainer import example_inputs

  notes = []
  recipe = config.model_recipe()
  if platform == "cpu" and getattr(recipe.config, "attention", None) == "cudnn":
    notes.append("model.attention is cudnn, which the CPU compiler cannot build: planned with a query-chunked XLA"
                 " attention of the same memory profile (cpu_attention.py); its FLOPs include the causal half cuDNN"
                 " skips.")
  t = config.train
  optimizer = optimizers.build(config.optimizer, t.steps, t.nonfinite)

  def make_state() -> TrainState:
    return TrainState.initial_state(recipe.config.build(t.seed), optimizer, jax.random.key(t.seed))

  with logical_annotations_only():
    abstract = jax.eval_shape(make_state)
  return StepSpec(abstract, example_inputs(config), recipe.loss_fn, recipe.input_axes, recipe.config, notes,
                  make_state)


def rules_for(config: Config, mesh_config: MeshConfig) -> AxisRules:
  """The mesh config's rules, else the config's rule set (as the trainer picks them)."""
  return mesh_config.rules if mesh_config.rules is not None else AxisRules(config.train.rules)


def _stand_ins(mesh: Mesh):
  """What a trace on CPU devices needs in place of GPU-only kernels (cuDNN attention)."""
  return cpu_attention.emulating_cudnn() if mesh.devices.flat[0].platform == "cpu" else contextlib.nullcontext()


def plan_state(spec: StepSpec, mesh: Mesh, rules: AxisRules) -> Plan:
  with _stand_ins(mesh):  # the planner traces the loss for its aux outputs
    return MeshPlanner(mesh, rules).plan(spec.abstract_state, loss_fn=spec.loss_fn, inputs=spec.inputs,
                                         input_axes=spec.input_axes)


def compile_step(spec: StepSpec, plan: Plan, rules: AxisRules, constrain_activations: bool = True
                 ) -> tuple[jax.stages.Compiled, dict[str, float]]:
  """Lowers and compiles the trainer's step on abstract, sharded arguments."""
  step = build_train_step_fn(spec.loss_fn, donate_params_and_state=True,
                             train_state_shardings=plan.train_state_shardings,
                             input_kwarg_shardings=plan.input_kwarg_shardings,
                             aux_output_shardings=plan.aux_output_shardings)
  inputs = {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=plan.input_kwarg_shardings[name])
            for name, x in spec.inputs.items()}
  activations = activation_sharding(plan.mesh, rules) if constrain_activations else contextlib.nullcontext()
  start = time.perf_counter()
  with activations, _stand_ins(plan.mesh):
    lowered = step.lower(plan.abstract_train_state.replace(step=0), **inputs)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  return compiled, {"lower_s": lowered_at - start, "compile_s": time.perf_counter() - lowered_at}


# --- reading the compiled step ---------------------------------------------------


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


def memory_of(plan: Plan, kind: hardware.DeviceKind, compiled: Any = None, fraction: float | None = None,
              temporaries_scale: float = 1.0) -> Memory:
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
  return Memory(groups["params"], groups["opt_state"], groups["local_state"],
                sum(groups[g] for g in _OTHER_STATE), groups["inputs"], counted, outputs, usable,
                kind.memory_bytes, temporaries, temporaries_scale)


@dataclasses.dataclass(frozen=True)
class StepTime:
  """The step-time model's terms (module docstring), in seconds."""

  model_flops_per_device: float | None
  matmul_flops_per_device: float
  xla_flops_per_device: float | None
  compute_s: float
  ici_s: float
  dcn_s: float
  peak_flops: float

  @property
  def step_s(self) -> float:
    return self.compute_s + self.ici_s + self.dcn_s

  @property
  def mfu(self) -> float | None:
    if not self.model_flops_per_device or not self.step_s:
      return None
    return self.model_flops_per_device / (self.step_s * self.peak_flops)


def step_time(model_flops_per_device: float | None, matmul_flops_per_device: float, wire: Mapping[str, float],
              kind: hardware.DeviceKind, efficiency: float, xla_flops: float | None = None) -> StepTime:
  flops = matmul_flops_per_device or model_flops_per_device or 0.0
  return StepTime(model_flops_per_device, matmul_flops_per_device, xla_flops,
                  flops / (kind.peak_flops * efficiency), wire.get("ici", 0.0) / kind.ici_bandwidth,
                  wire.get("dcn", 0.0) / kind.dcn_bandwidth, kind.peak_flops)


def _xla_flops(compiled: Any) -> float | None:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # not every backend reports it
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return float(cost["flops"]) if cost and "flops" in cost else None


@dataclasses.dataclass
class PodPlan:
  """One planned (and usually compiled) configuration and its figures."""

  config_name: str
  mesh_source: str
  devices: int
  kind: hardware.DeviceKind
  layout: Layout
  plan: Plan
  memory: Memory
  collectives: list[collectives_lib.Collective] | None
  time: StepTime | None
  tokens_per_step: int
  param_count: int
  timings: dict[str, float]
  notes: list[str]
  emulated: bool = True
  efficiency: float = DEFAULT_EFFICIENCY

  @property
  def compiled(self) -> bool:
    return self.collectives is not None

  def wire_bytes(self) -> dict[str, float]:
    return collectives_lib.wire_bytes_by_link(self.collectives or [])

  def report(self) -> str:
    from distrib_train.podplan import report as podplan_report

    return podplan_report.text(self, self.efficiency)

  def to_dict(self) -> dict[str, Any]:
    from distrib_train.podplan import report as podplan_report

    return podplan_report.as_dict(self)


def plan_pod(config: Config, mesh_config: MeshConfig, kind: hardware.DeviceKind, devices: int, *,
             config_name: str = "", granules: int | None = None, compile: bool = True,  # noqa: A002 - the verb
             constrain_activations: bool = True, efficiency: float = DEFAULT_EFFICIENCY,
             memory_fraction: float | None = None, spec: StepSpec | None = None) -> PodPlan:
  """Plans (and compiles) ``config``'s step on ``mesh_config`` for ``devices`` devices of ``kind``.

  JAX must already run on ``devices`` devices (``use_emulated_devices``, or
  the real machine's).

  Args:
    config: the experiment config.
    mesh_config: the mesh config; its ``devices`` must match.
    kind: the device the figures are for.
    devices: the device count.
    config_name: how the report names the config.
    granules: TPU slices / hosts for a hybrid mesh config (default: its sizes).
    compile: lower and compile the step (else: the state figures only).
    constrain_activations: trace the model's activation constraints
      (``axis_rules.activation_sharding``), as a sharded run should.
    efficiency: the share of peak FLOP/s the matmuls reach.
    memory_fraction: the usable share of device memory (default: the kind's).
    spec: a ``step_spec(config)`` to reuse.

  Raises:
    ValueError: the mesh does not fit the devices, or the rules the mesh.
  """
  found = jax.devices()
  emulated = found[0].platform == "cpu"
  spec = spec or step_spec(config, found[0].platform)
  lay = layout(mesh_config, devices, kind, granules)
  rules = rules_for(config, mesh_config)
  start = time.perf_counter()
  plan = plan_state(spec, emulated_mesh(lay, found[:devices]), rules)
  timings = {"plan_s": time.perf_counter() - start}
  notes = list(spec.notes)
  batch_skips = [s for s in plan.skips if s.path.startswith("inputs") and s.logical_name == "batch"]
  if batch_skips:
    skip = batch_skips[0]
    notes.insert(0, f"the global batch ({skip.dim_size}) does not split over {'×'.join(skip.mesh_axes)} ="
                    f" {skip.mesh_axes_size}: every device would compute the whole batch (the data loader refuses"
                    f" this); set data.global_batch_size to a multiple of {skip.mesh_axes_size}.")
  model_flops = spec.model_flops_per_step()
  model_flops = None if model_flops is None else model_flops / devices
  if not compile:
    return PodPlan(config_name, mesh_config.source, devices, kind, lay, plan,
                   memory_of(plan, kind, None, memory_fraction), None, None, spec.tokens_per_step,
                   spec.param_count(), timings, notes, emulated, efficiency)
  compiled, compile_timings = compile_step(spec, plan, rules, constrain_activations)
  timings.update(compile_timings)
  text = compiled.as_text()
  collectives = collectives_lib.find_collectives(text, lay.shape, lay.axis_names, lay.granule_of)
  wire = collectives_lib.wire_bytes_by_link(collectives)
  times = step_time(model_flops, hlo_module.matmul_flops(text), wire, kind, efficiency, _xla_flops(compiled))
  if not constrain_activations:
    notes.append("activations unconstrained (--no_activation_sharding): XLA chooses their layout.")
  scale = 1.0
  if emulated and str(getattr(spec.model_config, "dtype", "float32")) == "bfloat16":
    scale = CPU_BF16_TEMPORARIES
    notes.append(f"the CPU compiler holds bfloat16 work in float32: its temporaries count × {scale} (on one H100"
                 " the 124m and 1b presets need 0.48 and 0.42 of the CPU figure); collectives of activations may"
                 " be up to 2× what the TPU or GPU compiler sends.")
  return PodPlan(config_name, mesh_config.source, devices, kind, lay, plan,
                 memory_of(plan, kind, compiled, memory_fraction, scale), collectives, times, spec.tokens_per_step,
                 spec.param_count(), timings, notes, emulated, efficiency)
