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

The step-time model is stated in ``timing.py``, the memory figures in
``memory.py``, the device layout (granules: what DCN links) in
``layout.py``; device figures are in ``cluster/hardware.py``.

For a TPU target (``target=TpuTopology``: a mesh config's ``topology``, or
``--tpu_topology``) the step is compiled by libtpu's own compiler for that
topology (``tpu.py``): the memory, the collectives (over ICI, and over DCN
between slices) and the FLOPs are the TPU program's, with no correction.

What emulation cannot see: the CPU compiler, not the TPU or GPU one, makes
the program. It computes bf16 in float32 (its temporaries of a bf16 model
count × ``CPU_BF16_TEMPORARIES``), writes
reduce-scatters as all-reduce + slice (recognised and counted as
reduce-scatters), and cannot compile cuDNN attention (``cpu_attention.py``
stands in with the same memory profile). Planning on the real machine's
devices (``distrib-train plan --native``) gives that compiler's figures.

Not for: running the step (``train/trainer.py``), building the job
(``config/job.py``), reading HLO (``hlo.py``) or choosing among meshes
(``search.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from typing import Any

import jax
from jax.sharding import Mesh

from distrib_train.podplan import collectives as collectives_lib
from distrib_train.podplan import cpu_attention
from distrib_train.common.versions import gpu_capability
from distrib_train.kernels.attention import cudnn as cudnn_attention
from distrib_train.kernels.attention import dispatch as attention_kernels
from distrib_train.podplan import gpu as gpu_lib
from distrib_train.podplan import tpu as tpu_lib
from distrib_train.cluster import hardware
from distrib_train.common.text import human_bytes
from distrib_train.podplan import hlo as hlo_module

# The layout, memory and time figures are importable from here, as before the split.
from distrib_train.podplan.layout import Layout, emulated_mesh, layout, use_emulated_devices  # noqa: F401
from distrib_train.podplan.memory import CPU_BF16_TEMPORARIES, Memory, memory_of  # noqa: F401
from distrib_train.podplan.timing import DEFAULT_EFFICIENCY, StepTime, step_time, xla_flops  # noqa: F401
from distrib_train.sharding.axis_rules import AxisRules
from distrib_train.microbatches import STAGE_AXIS, bubble_fraction
from distrib_train.config.run import Config
from distrib_train.config.job import JobSpec, job_spec, plan_job, rules_for, step_options  # noqa: F401
from distrib_train.sharding.mesh import MeshConfig
from distrib_train.sharding.plan import Plan
from distrib_train.sharding.planner import MeshPlanner
from distrib_train.sharding.topology import TpuTopology
from distrib_train.train_step import build_train_step_fn


# --- the step --------------------------------------------------------------------


@dataclasses.dataclass
class StepSpec(JobSpec):
  """The job the trainer would build for a config (``config/job.py``), and
  what planning it on this platform stands in for (``notes``)."""

  notes: list[str] = dataclasses.field(default_factory=list)


def step_spec(config: Config, platform: str = "cpu") -> StepSpec:
  """The abstract train state and batch the trainer builds for ``config``."""
  job = job_spec(config)
  notes = []
  attention = job.family.capabilities().attention
  if platform == "tpu" and attention == "cudnn":
    raise ValueError(
      "model.attention is cudnn, a GPU kernel, and the target is a TPU: set model.attention to auto"
      " (splash attention on TPU) or xla."
    )
  if attention == "cudnn" and platform == "cpu":
    notes.append(
      "cuDNN attention, which the CPU compiler cannot build, is planned as a query-chunked XLA attention"
      " of the same memory profile (cpu_attention.py); its FLOPs include the causal half cuDNN skips."
    )
  elif attention in ("cudnn", "auto") and platform == "gpu" and not cudnn_loadable():
    notes.append(
      "cuDNN attention is compiled as its custom calls without the cuDNN library (cuDNN"
      f" {cudnn_attention.ASSUMED_CUDNN_VERSION // 10000}.{cudnn_attention.ASSUMED_CUDNN_VERSION // 100 % 100}"
      " assumed); its workspace is sized when it first runs, outside the compiled figures."
    )
  return StepSpec(**{field.name: getattr(job, field.name) for field in dataclasses.fields(JobSpec)}, notes=notes)


def cudnn_loadable() -> bool:
  """Whether NVIDIA's cuDNN library loads here (a GPU compile without it cannot build cuDNN attention)."""
  try:
    from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

    check_cudnn_version()
  except Exception:  # RuntimeError("cuDNN not found."), or no CUDA plugin at all
    return False
  return True


def _stand_ins(mesh: Mesh):
  """What a trace needs in place of kernels this host cannot build: cuDNN attention on CPU devices, or on
  compile-only GPU devices without the cuDNN library."""
  device = mesh.devices.flat[0]
  if device.platform == "cpu":
    return cpu_attention.emulating_cudnn()
  stack = contextlib.ExitStack()
  if device.platform == "gpu":  # Pallas (the experts' Triton kernel) reads its target from the default device
    stack.enter_context(jax.default_device(device))
    if not cudnn_loadable():  # XLA's CUDA compiler builds cuDNN's custom calls
      stack.enter_context(cudnn_attention.compile_only(gpu_capability(device)))
  return stack


def plan_state(spec: StepSpec, mesh: Mesh, rules: AxisRules) -> Plan:
  with _stand_ins(mesh):  # the planner traces the loss for its aux outputs
    return plan_job(spec, MeshPlanner(mesh, rules))


def compile_step(
  spec: StepSpec, plan: Plan, rules: AxisRules, constrain_activations: bool = True, attention: list | None = None
) -> tuple[jax.stages.Compiled, dict[str, float]]:
  """Lowers and compiles the trainer's step on abstract, sharded arguments (``attention`` gets each attention
  layer's ``attention_kernels.Decision``)."""
  step = build_train_step_fn(
    spec.loss_fn,
    donate_params_and_state=True,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
    **step_options(spec, plan, rules if constrain_activations else None),
  )
  inputs = {
    name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=plan.input_kwarg_shardings[name])
    for name, x in spec.inputs.items()
  }
  start = time.perf_counter()
  with _stand_ins(plan.mesh), attention_kernels.recorded() as decisions:
    lowered = step.lower(plan.abstract_train_state.replace(step=0), **inputs)
  if attention is not None:
    attention.extend(decisions)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  return compiled, {"lower_s": lowered_at - start, "compile_s": time.perf_counter() - lowered_at}


@contextlib.contextmanager
def _without_compilation_cache():
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", before)


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_OOM = (
  re.compile(r"temporaries \(([\d.]+)([KMGT]?)i?B?\) exceeds available HBM \(([\d.]+)([KMGT]?)i?B?\)"),
  re.compile(r"Requires ([\d.]+)([KMGT]?)i?B?, has ([\d.]+)([KMGT]?)i?B? available"),
  re.compile(r"Used ([\d.]+)([KMGT]?)i?B? of ([\d.]+)([KMGT]?)i?B? hbm"),
)


def out_of_memory(error: BaseException) -> tuple[int, int] | None:
  """``(required, available)`` bytes per device when a compiler refused a step for memory (libtpu
  does: "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries
  (26.12G) exceeds available HBM (15.75G)"), else None."""
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text and "memory" not in text.lower():
    return None
  for pattern in _OOM:
    match = pattern.search(text)
    if match:
      need, need_unit, have, have_unit = match.groups()
      return int(float(need) * _UNITS[need_unit]), int(float(have) * _UNITS[have_unit])
  return None


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
  compiler: str = "cpu-emulated"  # "tpu": libtpu's compiler; else the platform of the devices compiled on
  device_kind: str = ""  # the compiled-for devices' own name ("TPU v5 lite"); emulated: the kind's
  topology: TpuTopology | gpu_lib.GpuTarget | None = None
  microbatches: int = 1
  pipeline_repeats: int = 1
  custom_calls: tuple[str, ...] = ()  # the compiled program's custom-call targets (cuDNN attention, cuBLAS, …)
  attention: list = dataclasses.field(default_factory=list)  # each attention layer's kernel and why
  flops: dict[str, float] | None = None  # the compiled step's FLOPs per device: dots, attention and grouped kernels
  estimated_cycles: int | None = None  # libtpu's own estimate of the step (hlo.estimated_cycles); None elsewhere

  @property
  def compiled(self) -> bool:
    return self.collectives is not None

  def wire_bytes(self) -> dict[str, float]:
    return collectives_lib.wire_bytes_by_link(self.collectives or [])

  def pipeline(self) -> dict[str, Any] | None:
    """The pipeline's figures when the mesh has a stage axis of size > 1: stages, microbatches, repeats,
    the bubble by formula, and the collective-permute bytes each device sends to its neighbour stage."""
    sizes = dict(zip(self.layout.axis_names, self.layout.shape))
    stages = sizes.get(STAGE_AXIS, 1)
    if stages <= 1:
      return None
    permutes = [c for c in self.collectives or [] if c.kind == "collective-permute" and STAGE_AXIS in c.axes]
    return {
      "stages": stages,
      "microbatches": self.microbatches,
      "repeats": self.pipeline_repeats,
      "schedule": "gpipe" if self.pipeline_repeats == 1 else "circular",
      "bubble_fraction": bubble_fraction(stages, self.microbatches, self.pipeline_repeats),
      "stage_permute_bytes": None
      if self.collectives is None
      else float(sum(c.payload_bytes * c.count for c in permutes)),
      "stage_permute_wire_bytes": None
      if self.collectives is None
      else float(sum(c.wire_bytes * c.count for c in permutes)),
    }

  def report(self) -> str:
    from distrib_train.podplan import report as podplan_report

    return podplan_report.text(self, self.efficiency)

  def to_dict(self) -> dict[str, Any]:
    from distrib_train.podplan import report as podplan_report

    return podplan_report.as_dict(self)


def plan_pod(
  config: Config,
  mesh_config: MeshConfig,
  kind: hardware.DeviceKind,
  devices: int,
  *,
  config_name: str = "",
  granules: int | None = None,
  compile: bool = True,  # noqa: A002 - the verb
  constrain_activations: bool = True,
  efficiency: float = DEFAULT_EFFICIENCY,
  memory_fraction: float | None = None,
  spec: StepSpec | None = None,
  target: TpuTopology | gpu_lib.GpuTarget | None = None,
) -> PodPlan:
  """Plans (and compiles) ``config``'s step on ``mesh_config`` for ``devices`` devices of ``kind``.

  JAX must already run on ``devices`` devices (``use_emulated_devices``, or
  the real machine's), unless ``target`` names a TPU topology: then libtpu
  makes the devices and compiles (``tpu.py``).

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
    target: compile with libtpu for this TPU topology (its chips are the
      devices; ``kind`` should be its chip's), or with XLA's CUDA compiler
      for a ``gpu.GpuTarget`` (``gpu.py``).

  Raises:
    ValueError: the mesh does not fit the devices, or the rules the mesh;
      libtpu is missing for a TPU target (``tpu.TpuCompilerMissing``).
  """
  rules = rules_for(config, mesh_config)
  start = time.perf_counter()
  if isinstance(target, gpu_lib.GpuTarget):
    lay = layout(mesh_config, devices, kind, granules)
    mesh = emulated_mesh(lay, gpu_lib.devices(target))
    emulated, compiler, device_kind = False, "gpu", mesh.devices.flat[0].device_kind
    spec = spec or step_spec(config, "gpu")
  elif target is not None:
    if devices != target.devices:
      raise ValueError(f"TPU topology {target} has {target.devices} chips, not {devices} devices.")
    mesh = tpu_lib.mesh(mesh_config, target)
    ici, dcn = mesh_config.resolve(devices, target.num_slices)
    lay = Layout(mesh_config.axis_names, tuple(ici), tuple(dcn), tpu_lib.granule_of(mesh))
    emulated, compiler, device_kind = False, "tpu", mesh.devices.flat[0].device_kind
    spec = spec or step_spec(config, "tpu")
  else:
    found = jax.devices()
    emulated = found[0].platform == "cpu"
    compiler = "cpu-emulated" if emulated else found[0].platform
    device_kind = kind.name if emulated else found[0].device_kind
    spec = spec or step_spec(config, found[0].platform)
    lay = layout(mesh_config, devices, kind, granules)
    mesh = emulated_mesh(lay, found[:devices])
  plan = plan_state(spec, mesh, rules)
  timings = {"plan_s": time.perf_counter() - start}
  notes = list(spec.notes)
  if isinstance(target, gpu_lib.GpuTarget):
    notes.append(
      f"compiled by XLA's CUDA compiler for {device_kind} without a GPU: memory, collectives and FLOPs"
      " are the GPU program's own, with Triton matmuls where a card would autotune (nothing runs)."
    )
  elif target is not None:
    notes.append(
      f"compiled by libtpu for {device_kind} chips, topology {target}: memory, collectives and FLOPs are"
      " the TPU program's own (nothing runs)."
    )
  extra = dict(
    compiler=compiler,
    device_kind=device_kind,
    topology=target,
    microbatches=spec.microbatches,
    pipeline_repeats=spec.pipeline_repeats,
  )
  batch_skips = [s for s in plan.skips if s.path.startswith("inputs") and s.logical_name == "batch"]
  if batch_skips:
    skip = batch_skips[0]
    notes.insert(
      0,
      f"the global batch ({skip.dim_size}) does not split over {'×'.join(skip.mesh_axes)} ="
      f" {skip.mesh_axes_size}: every device would compute the whole batch (the data loader refuses"
      f" this); set data.global_batch_size to a multiple of {skip.mesh_axes_size}.",
    )
  model_flops = spec.model_flops_per_step()
  model_flops = None if model_flops is None else model_flops / devices
  attention: list = []
  extra["attention"] = attention
  if not compile:
    return PodPlan(
      config_name,
      mesh_config.source,
      devices,
      kind,
      lay,
      plan,
      memory_of(plan, kind, None, memory_fraction),
      None,
      None,
      spec.tokens_per_step,
      spec.param_count(),
      timings,
      notes,
      emulated,
      efficiency,
      **extra,
    )
  try:
    # A compile-only executable cannot be read back from the persistent cache (libtpu: "PjRtCompiler must be
    # constructed with a Client"): keep it out of the cache.
    no_cache = _without_compilation_cache() if target is not None else contextlib.nullcontext()
    with no_cache:
      compiled, compile_timings = compile_step(spec, plan, rules, constrain_activations, attention)
  except Exception as e:  # jax's JaxRuntimeError
    refusal = out_of_memory(e) if target is not None or not emulated else None  # a compiler's own devices
    if refusal is None:
      if target is None or isinstance(e, ValueError):
        raise
      said = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise ValueError(
        f"the {compiler.upper()} compiler could not compile the step on {lay.describe()}: {said[:400]}"
      ) from None
    required, available = refusal
    notes.insert(
      0,
      f"the compiler refused the step: it needs {human_bytes(required)} of temporaries per device and"
      f" has {human_bytes(available)} ({str(e).splitlines()[0][:300]}). Shard more (fsdp, tensor),"
      " rematerialise more (model.remat) or lower the batch.",
    )
    memory = memory_of(plan, kind, None, memory_fraction)
    # The compiler's own limit (libtpu: 15.75 GiB of a 16 GiB v5e chip) is what the step did not fit.
    memory = dataclasses.replace(
      memory, temporaries=required, compiled_temporaries=required, usable=min(memory.usable, available)
    )
    return PodPlan(
      config_name,
      mesh_config.source,
      devices,
      kind,
      lay,
      plan,
      memory,
      None,
      None,
      spec.tokens_per_step,
      spec.param_count(),
      timings,
      notes,
      emulated,
      efficiency,
      **extra,
    )
  timings.update(compile_timings)
  text = compiled.as_text()
  if isinstance(target, TpuTopology) and target.num_slices > 1:
    # One slice's program: ICI groups number a slice's devices; DCN is Megascale transfers.
    collectives = collectives_lib.find_collectives(
      text,
      lay.ici,
      lay.axis_names,
      None,
      dcn_axes=tpu_lib.dcn_axes(lay.shape, lay.axis_names, lay.granule_of),
      dcn_group_size=target.num_slices,
      infer_reduce_scatters=False,
    )
  else:
    collectives = collectives_lib.find_collectives(
      text, lay.shape, lay.axis_names, lay.granule_of, infer_reduce_scatters=target is None
    )
  wire = collectives_lib.wire_bytes_by_link(collectives)
  extra["flops"] = hlo_module.flops(text)
  extra["estimated_cycles"] = hlo_module.estimated_cycles(text) if isinstance(target, TpuTopology) else None
  times = step_time(model_flops, sum(extra["flops"].values()), wire, kind, efficiency, xla_flops(compiled))
  if not constrain_activations:
    notes.append("activations unconstrained (--no_activation_sharding): XLA chooses their layout.")
    if isinstance(target, TpuTopology) and spec.family.capabilities().attention in ("auto", "splash"):
      notes.append(
        "without the activation sharding the model cannot see the TPU mesh: its attention was compiled"
        " as XLA attention (auto) or the splash kernel unsharded, not as a TPU run has it."
      )
  scale = 1.0
  if emulated and spec.family.capabilities().dtype == "bfloat16":
    scale = CPU_BF16_TEMPORARIES
    notes.append(
      f"the CPU compiler holds bfloat16 work in float32: its temporaries count × {scale} (on one H100"
      " the 124m and 1b presets need 0.48 and 0.42 of the CPU figure); collectives of activations may"
      " be up to 2× what the TPU or GPU compiler sends."
    )
  return PodPlan(
    config_name,
    mesh_config.source,
    devices,
    kind,
    lay,
    plan,
    memory_of(plan, kind, compiled, memory_fraction, scale),
    collectives,
    times,
    spec.tokens_per_step,
    spec.param_count(),
    timings,
    notes,
    emulated,
    efficiency,
    **extra,
    custom_calls=tuple(sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))),
  )
