"""``mesh_config: auto``: the layout a job's own devices run fastest, as their own compiler says.

``search(config, workdir)`` is the ``Trainer``'s ``layout_search`` (``distrib-train`` hands it over): the
layout kept in the workdir for these devices (``layout_choice.py``), else a search, on the devices
the job has, with the compiler that will run it:

1. **Meshes.** Every factorisation of the devices over ``data``, ``fsdp`` and ``tensor`` (``expert`` too
   for a mixture; ``context`` and ``stage`` are not searched: a long-context or pipelined preset names its
   mesh), DCN across granules (slices, else processes) never for ``tensor`` (``search.candidate_meshes``), with
   the preset's remat and microbatches. Those whose state does not fit,
   whose batch does not split or whose rules skip a parameter dimension are dropped without compiling; the
   rest are ordered by a compile-free guess of their communication and the first ``MESH_COMPILES`` compiled
   (``search.recommend``).
2. **Settings,** on the fastest mesh that fits (``settings_space``): the reference model's remat (``none``,
   ``dots_saveable``, ``full``) and microbatches that keep the global batch (1, 2, 4); where the finalists are
   timed (below), also its attention kernel (the platform's fused kernel or XLA's) and FP8 matmuls
   (``model.fp8: current``, on an H100 or H200 where ``train.layout_fp8`` allows them), which the estimate
   cannot rank. The preset's own first, then those that change fewer of its settings; a setting that fits is
   not tried again with more microbatches. At most ``train.layout_compiles`` compiles in all.
3. **Choice.** Each compiled candidate's memory is the compiled figure against what the trainer's
   allocator gives (on GPU the share ``XLA_PYTHON_CLIENT_MEM_FRACTION`` gives, 0.92 unless set); a
   candidate the compiler refuses for memory does not fit. Of those that fit and that the trainer's start-up
   checks take, on a GPU or TPU the three shortest estimates (``timing.py``: compiled FLOPs and collective
   bytes) each run ``train.layout_timed_steps`` steps on the job's devices (``timed.py``), and the shortest
   measured step wins; one that runs out of memory is dropped. On CPU devices, or with
   ``layout_timed_steps: 0``, the shortest estimate wins.

One choice per job: every process compiles the same candidates (a GPU compile may share its autotuning
between processes) and times the finalists process 0 names; process 0's choice is broadcast to the others, as
is process 0's reading of the kept record (or its error), so no process searches or fails alone. The log gets
one line: what was chosen and its step, and the runner-up with its own.

``plan --recommend`` searches the same space (``search_space``) for a machine you do not have, with libtpu or
XLA's CUDA compiler, and writes the choice as a mesh config and an experiment config.

Not for: the figures of one layout (``estimate.py``), the meshes alone (``search.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from distrib_train.cluster import hardware
from distrib_train.podplan import search as search_lib
from distrib_train.podplan import timed
from distrib_train.podplan.estimate import PodPlan, plan_pod
from distrib_train.sharding.mesh import MeshConfig, granules_of
from distrib_train.podplan import layout_choice
from distrib_train.config.plan_checks import check_context, check_microbatches
from distrib_train.config.run import Config

REMATS = ("none", "dots_saveable", "full")
MICROBATCHES = (1, 2, 4)
KERNELS = {"gpu": "cudnn", "tpu": "splash"}  # the fused attention kernel a platform has, besides XLA's
FP8_KINDS = ("h100", "h200")  # cards whose matmuls take FP8 operands (model.fp8): these and their variants
MESH_COMPILES = 3  # of the meshes, at most; the rest of ``max_compiles`` goes to the settings
TIMED = 3  # finalists timed on an accelerator
_BROADCAST_BYTES = 8192


def device_kind() -> hardware.DeviceKind:
  """The figures of the job's devices; for CPU devices (emulated, sharing the host), a stand-in with the host's
  memory split between them."""
  device = jax.devices()[0]
  kind = hardware.kind_of_device(getattr(device, "device_kind", ""))
  if kind is not None:
    return kind
  if device.platform != "cpu":
    raise ValueError(
      f"mesh_config: auto has no figures for {device.device_kind!r} devices (cluster/hardware.py"
      " knows " + ", ".join(hardware.DEVICE_KINDS) + "); name a mesh config instead."
    )
  local = max(1, jax.local_device_count())
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local
  return hardware.DeviceKind(
    "cpu",
    "CPU device (emulated)",
    "cpu",
    memory_bytes=memory,
    usable_fraction=0.8,
    peak_flops=1e11,
    hbm_bandwidth=2e10,
    ici_bandwidth=1e10,
    dcn_bandwidth=1e9,
    devices_per_host=local,
    max_slice=local,
  )


def axes(config: Config) -> tuple[str, ...]:
  """The mesh axes searched: data, fsdp, tensor, and expert for a mixture."""
  model = config.model_recipe().config
  return ("data", "fsdp", "tensor") + (("expert",) if getattr(model, "num_experts", 0) else ())


def _first(preset: Any, options: Sequence[Any]) -> tuple[Any, ...]:
  return (preset,) + tuple(o for o in options if o != preset)


def dimensions(config: Config, kind: hardware.DeviceKind, timing: bool = False) -> list[tuple[str, tuple[Any, ...]]]:
  """The settings searched on a mesh, each key with its options, the preset's first: the reference model's
  remat; microbatches that keep the global batch; and where the finalists are timed (``timing``), the attention kernel
  (the platform's fused kernel or XLA's, on a TPU or GPU) and FP8 matmuls (where ``train.layout_fp8`` allows
  them and the card has them). The compiler-based estimate sees neither the memory traffic a fused kernel saves
  nor FP8's faster matmuls (it counts FLOPs and collectives), so only measured steps choose those two."""
  model = config.model_recipe().config
  out = []
  if hasattr(model, "remat"):
    out.append(("model.remat", _first(model.remat, REMATS)))
  if hasattr(model, "attention") and kind.platform in KERNELS and timing:
    out.append(("model.attention", _first(model.attention, ("auto" if model.attention == "xla" else "xla",))))
  if hasattr(model, "fp8") and config.train.layout_fp8 and kind.name.startswith(FP8_KINDS) and timing:
    out.append(("model.fp8", _first(model.fp8, ("none", "current"))))
  batch = config.data.global_batch_size
  out.append(("train.microbatches", _first(config.train.microbatches, [m for m in MICROBATCHES if batch % m == 0])))
  return out


def settings_space(config: Config, kind: hardware.DeviceKind, timing: bool = False) -> list[dict[str, Any]]:
  """Every combination of ``dimensions``, most promising first: the preset's own, then those that change
  fewer of its settings, fewer microbatches before more (each one more pass over the layers)."""
  dims = dimensions(config, kind, timing)
  combos = itertools.product(*(range(len(options)) for _, options in dims))
  order = lambda picks: (sum(p > 0 for p in picks), picks[-1], tuple(-(p > 0) for p in picks), picks)
  return [{key: options[p] for (key, options), p in zip(dims, picks)} for picks in sorted(combos, key=order)]


def outrun(settings: dict[str, Any], fitted: Sequence[dict[str, Any]]) -> bool:
  """Whether ``settings`` differ from settings that fit only by more microbatches or a heavier remat: each
  microbatch more is another pass over the layers (and under FSDP another gather of the params), each remat
  step more recomputes more, so neither shortens a step; such settings are not tried."""
  weight = {"train.microbatches": lambda m: m, "model.remat": lambda r: REMATS.index(r) if r in REMATS else -1}
  for fit in fitted:
    heavier = [k for k in weight if k in fit and fit[k] != settings[k]]
    others = all(v == settings[k] for k, v in fit.items() if k not in weight)
    if others and heavier and all(weight[k](fit[k]) < weight[k](settings[k]) for k in heavier):
      return True
  return False


def candidate_label(pod: PodPlan, settings: dict[str, Any], measured: float | None = None) -> str:
  said = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in settings.items())
  ms = lambda seconds: f"{seconds * 1e3:,.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.3g}"
  step = f"measured {ms(measured)} ms" if measured is not None else f"{ms(pod.time.step_s)} ms"
  return f"{pod.layout.describe()} ({said}): step {step}"


def _runs(config: Config, pod: PodPlan) -> bool:
  """Whether the trainer takes ``config`` on ``pod``'s mesh (its start-up checks of the microbatches and the
  context split)."""
  t = config.train
  try:
    check_microbatches(pod.plan, config.data.global_batch_size, t.microbatches, t.pipeline_repeats)
    check_context(pod.plan, config.data.seq_len)
  except ValueError:
    return False
  return True


@dataclasses.dataclass
class Found:
  """What ``search_space`` found: the compiled candidates that fit, fastest estimate first, each with its
  settings; the mesh search's record; how many candidates were compiled in all."""

  finalists: list[tuple[PodPlan, dict[str, Any]]]
  meshes: search_lib.Recommendation
  compiled: int
  settings: int

  def record(self) -> dict[str, Any]:
    return {
      "meshes": self.meshes.candidates,
      "dropped": {k: v for k, v in self.meshes.dropped.items() if v},
      "settings": self.settings,
      "compiled": self.compiled,
      "finalists": [candidate_label(p, s) for p, s in self.finalists],
    }


def search_space(
  config: Config,
  kind: hardware.DeviceKind,
  devices: int,
  *,
  granules: int,
  max_compiles: int,
  memory_fraction: float | None = None,
  target: Any = None,
  base: MeshConfig | None = None,
  timing: bool = False,
  say: Callable[[str], None] = lambda message: None,
  **options: Any,
) -> Found:
  """The layouts of ``config`` on ``devices`` devices of ``kind`` (on this job's devices, or a ``target``'s
  compiler for a machine you do not have), compiling at most ``max_compiles``: the meshes over ``base``'s axes
  (default ``axes(config)``) by ``search.recommend``, then the settings of ``settings_space`` on the fastest mesh
  that fits (module docstring); the attention kernel and FP8 only where the finalists will be timed (``timing``).

  Raises:
    ValueError: no candidate fits (the smallest need and the drops named).
  """
  names = base.axis_names if base is not None else axes(config)
  base = base or MeshConfig(
    names,
    (devices // granules,) + (1,) * (len(names) - 1),
    (granules,) + (1,) * (len(names) - 1),
    source="mesh_config: auto",
    devices=devices,
  )
  common = dict(granules=granules, memory_fraction=memory_fraction, target=target, **options)
  meshes = search_lib.recommend(
    config,
    base,
    kind,
    devices,
    max_compiles=max(1, min(MESH_COMPILES, max_compiles - 1)),
    progress=lambda line: say(f"meshes: {line}"),
    **common,
  )
  ranked = [pod for pod in meshes.ranked if _runs(config, pod)]
  if not ranked:
    needs = sorted(meshes.not_fitting_compiled, key=lambda p: p.memory.total)
    closest = (
      (
        f"; the closest, {needs[0].layout.describe()}, needs {needs[0].memory.total / 2**30:.2f} GiB of"
        f" {needs[0].memory.usable / 2**30:.2f}"
      )
      if needs
      else ""
    )
    dropped = "".join(f", {n} dropped: {why}" for why, n in meshes.dropped.items() if n)
    refused = len(meshes.ranked) - len(ranked)
    raise ValueError(
      f"mesh_config: auto found no layout of {devices} devices that runs {config.model.preset}"
      f" ({meshes.candidates} meshes{dropped}; {meshes.compiled} compiled, {len(needs)} of them too"
      f" large{closest}"
      + (f", {refused} refused by the trainer's checks (train.microbatches, data.seq_len)" if refused else "")
      + "): lower data.global_batch_size or data.seq_len, use"
      " more devices, or name a mesh config."
    )
  space = settings_space(config, kind, timing)
  preset, best = space[0], ranked[0]
  mesh = MeshConfig(
    best.layout.axis_names,
    best.layout.ici,
    best.layout.dcn,
    rules=base.rules,
    source="mesh_config: auto",
    devices=devices,
    topology=getattr(base, "topology", None),
  )
  finalists = [(pod, preset) for pod in ranked]
  compiled, fitted = meshes.compiled, [preset]
  for settings in space[1:]:
    if compiled >= max_compiles:
      break
    if outrun(settings, fitted):
      continue
    variant = layout_choice.Choice(mesh, settings, "").apply(config)
    try:
      if not _runs(variant, plan_pod(variant, mesh, kind, devices, compile=False, **common)):
        continue
      compiled += 1
      pod = plan_pod(variant, mesh, kind, devices, **common)
    except ValueError as e:  # the compiler refused it (or the model refused the setting: a kernel it cannot run)
      say(f"settings: {', '.join(f'{k}={v}' for k, v in settings.items())} not compiled: {str(e)[:200]}")
      continue
    finally:
      jax.clear_caches()
    say(f"settings: compiled {compiled}/{max_compiles}: {', '.join(f'{k}={v}' for k, v in settings.items())}")
    if pod.memory.fits and pod.compiled:
      fitted.append(settings)
      finalists.append((pod, settings))
  finalists.sort(key=lambda f: f[0].time.step_s)
  return Found(finalists, meshes, compiled, len(space))


def _agree(payload: dict[str, Any]) -> dict[str, Any]:
  """Process 0's ``payload``, on every process (a payload too large to send is an error on every process)."""
  if jax.process_count() == 1:
    return payload
  from jax.experimental import multihost_utils

  data = json.dumps(payload).encode()
  if len(data) > _BROADCAST_BYTES:
    data = json.dumps(
      {
        "__error__": f"mesh_config: auto: process 0's message ({len(data)} bytes) exceeds"
        f" {_BROADCAST_BYTES} to broadcast."
      }
    ).encode()
  buffer = np.zeros(_BROADCAST_BYTES, np.uint8)
  buffer[: len(data)] = np.frombuffer(data, np.uint8)
  agreed = json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes().rstrip(b"\0").decode())
  if "__error__" in agreed:
    raise ValueError(agreed["__error__"])
  return agreed


def _worst(status: int) -> int:
  """The largest of every process's ``status`` (0: well; higher: worse), on every process: what one process met,
  all act on, so none goes on alone into collectives the others have left."""
  if jax.process_count() == 1:
    return status
  from jax.experimental import multihost_utils

  return int(np.max(multihost_utils.process_allgather(np.array([status], np.int32))))


def _key(pod: PodPlan, settings: dict[str, Any]) -> str:
  return json.dumps([pod.layout.describe(), settings], sort_keys=True)


def _to_time(finalists: list[tuple[PodPlan, dict[str, Any]]]) -> list[tuple[PodPlan, dict[str, Any]]]:
  """The ``TIMED`` finalists to run: the best estimate of each attention kernel and FP8 mode (the estimate cannot
  rank those against each other), then the next best estimates."""
  firsts = {}
  for number, (_, settings) in enumerate(finalists):
    firsts.setdefault((settings.get("model.attention"), settings.get("model.fp8")), number)
  chosen = list(firsts.values())[:TIMED]
  chosen += [n for n in range(len(finalists)) if n not in chosen][: TIMED - len(chosen)]
  return [finalists[n] for n in chosen]


def _timed(
  config: Config, found: Found, devices: int, steps: int, say: Callable[[str], None]
) -> tuple[list[tuple], set[str]]:
  """``_to_time``'s finalists with their measured seconds per step (process 0's clock), fastest first, and the
  keys of those that ran out of memory on some process (dropped everywhere)."""
  mine = {_key(pod, settings): (pod, settings) for pod, settings in found.finalists}
  keys = _agree({"keys": [_key(pod, settings) for pod, settings in _to_time(found.finalists)]})["keys"]
  if _worst(int(any(key not in mine for key in keys))):  # every process must run the same steps
    raise ValueError("mesh_config: auto: the processes' compiles disagree on the finalists; name a mesh config.")
  out, dropped = [], set()
  for key in keys:
    pod, settings = mine[key]
    mesh = MeshConfig(
      pod.layout.axis_names, pod.layout.ici, pod.layout.dcn, source="mesh_config: auto", devices=devices
    )
    seconds, status, error = None, 0, ""
    try:
      seconds = timed.measure(layout_choice.Choice(mesh, settings, "").apply(config), mesh, steps=steps)
    except timed.OutOfMemory as e:
      status, error = 1, str(e)
    except Exception as e:  # noqa: BLE001 - every process must learn of it before any raises
      status, error = 2, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    worst = _worst(status)
    if worst == 2:
      raise ValueError(
        f"mesh_config: auto could not run {candidate_label(pod, settings)} to time it ("
        + (error or "on another process")
        + "); name a mesh config."
      )
    if worst == 1:
      dropped.add(key)
      say(f"timed: {candidate_label(pod, settings)}: out of memory when run, dropped ({error or 'on another process'})")
      continue
    seconds = _agree({"s": seconds})["s"]
    say(f"timed: {candidate_label(pod, settings, seconds)}")
    out.append((pod, settings, seconds))
  return sorted(out, key=lambda f: f[2]), dropped


def search(
  config: Config,
  workdir: str | os.PathLike,
  *,
  max_compiles: int | None = None,
  say: Callable[[str], None] | None = None,
  timed_steps: int | None = None,
) -> layout_choice.Choice:
  """The layout for ``config`` on this job's devices (module docstring): the one kept in ``workdir`` for them,
  else the fastest that fits of a search compiling at most ``max_compiles`` candidates (default
  ``train.layout_compiles``), by the compiler's estimate, or on an accelerator by ``timed_steps`` timed steps of
  each of the first ``TIMED`` (default ``train.layout_timed_steps``; 0: the estimate alone).

  Raises:
    ValueError: no candidate fits (the smallest need named), or the devices are of an unknown kind.
  """
  signature = layout_choice.signature(config)
  kept = error = None
  if jax.process_index() == 0:  # process 0's record decides, wherever the others' workdirs are
    try:
      found = layout_choice.kept(workdir, config)
      kept = None if found is None else _payload(found.mesh_config, found.settings, found.line)
    except ValueError as e:
      error = str(e)
  agreed = _agree({"kept": kept, "error": error})
  if agreed["error"]:
    raise ValueError(agreed["error"])
  if agreed["kept"] is not None:
    return _choice(agreed["kept"], 0.0, {}, signature, reused=True)
  say = say or (lambda message: None)
  max_compiles = max_compiles or config.train.layout_compiles
  start = time.perf_counter()
  kind, devices, granules = device_kind(), jax.device_count(), granules_of(jax.devices())[0]
  # the share of a GPU the trainer's allocator gets (cluster/gpu_environment.py sets it unless it is set)
  fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") if kind.platform == "gpu" else None
  say(f"mesh_config: auto: searching layouts of {devices} {kind.name} devices over {', '.join(axes(config))}")
  steps = config.train.layout_timed_steps if timed_steps is None else timed_steps
  timing = bool(steps and kind.platform != "cpu" or timed_steps)  # timed_steps given: timed anywhere (tests)
  found = search_space(
    config,
    kind,
    devices,
    granules=granules,
    max_compiles=max_compiles,
    timing=timing,
    memory_fraction=float(fraction) if fraction else None,
    say=say,
  )
  ranked, dropped = _timed(config, found, devices, steps, say) if timing else ([], set())
  if dropped and not ranked:  # every timed finalist ran out of memory: the untimed ones that are left, by estimate
    found.finalists = [f for f in found.finalists if _key(*f) not in dropped]
    if not found.finalists:
      raise ValueError(
        f"mesh_config: auto: every layout that compiled to fit ran out of memory when run"
        f" ({len(dropped)}); lower data.global_batch_size or data.seq_len, or name a mesh config."
      )
  if ranked:
    (chosen, settings, seconds), *rest = ranked
    runner_up = f"; runner-up {candidate_label(rest[0][0], rest[0][1], rest[0][2])}" if rest else ""
    how = f"measured over {steps} steps each of the {len(ranked)} fastest estimates"
  else:
    (chosen, settings), *rest = found.finalists
    seconds, runner_up = None, f"; runner-up {candidate_label(*rest[0])}" if rest else ""
    how = f"estimated by the {chosen.compiler} compiler"
  line = (
    f"mesh_config: auto chose {candidate_label(chosen, settings, seconds)}{runner_up} ({how};"
    f" {found.meshes.candidates} meshes × {found.settings} settings, {found.compiled} compiled, in"
    f" {time.perf_counter() - start:.1f} s)"
  )
  agreed = _agree(_payload(chosen.layout, settings, line))
  return _choice(agreed, time.perf_counter() - start, found.record(), signature)


def _payload(layout, settings: dict[str, Any], line: str) -> dict[str, Any]:
  """A choice as JSON-able values (``layout``: a mesh config's or a plan's layout)."""
  return {
    "names": list(layout.axis_names),
    "ici": list(layout.ici),
    "dcn": list(layout.dcn),
    "settings": dict(settings),
    "line": line,
  }


def _choice(
  payload: dict[str, Any], seconds: float, searched: dict[str, Any], signature: dict[str, Any], reused: bool = False
) -> layout_choice.Choice:
  mesh = MeshConfig(
    tuple(payload["names"]),
    tuple(payload["ici"]),
    tuple(payload["dcn"]),
    source="mesh_config: auto",
    devices=jax.device_count(),
  )
  return layout_choice.Choice(mesh, payload["settings"], payload["line"], seconds, searched, reused, signature)
