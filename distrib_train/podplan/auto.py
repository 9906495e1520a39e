"""``mesh_config: auto``: the layout a job's own devices run fastest, as their own compiler says.

``search(config, workdir)`` is the ``Trainer``'s ``layout_search`` (``distrib-train`` hands it over): the
layout kept in the workdir for these devices (``training/layout_choice.py``), else a search, on the devices
the job has, with the compiler that will run it:

1. **Meshes.** Every factorisation of the devices over ``data``, ``fsdp`` and ``tensor`` (``expert`` too
   for a mixture; ``context`` and ``stage`` are not searched: a long-context or pipelined preset names its
   mesh), DCN across granules (slices, else processes) never for ``tensor`` (``search.candidate_meshes``), with
   the preset's remat and microbatches. Those whose state does not fit,
   whose batch does not split or whose rules skip a parameter dimension are dropped without compiling; the
   rest are ordered by a compile-free guess of their communication and the first ``MESH_COMPILES`` compiled
   (``search.recommend``).
2. **Settings,** on the fastest mesh that fits: the reference model's remat (``none``, ``dots_saveable``,
   ``full``) and microbatches that keep the global batch (1, 2, 4), most promising first, until
   ``train.layout_compiles`` compiles in all.
3. **Choice.** Each compiled candidate's memory is the compiled figure against what the trainer's
   allocator gives (on GPU the share ``XLA_PYTHON_CLIENT_MEM_FRACTION`` gives, 0.92 unless set); a
   candidate the compiler refuses for memory does not fit. Of those that fit and that the trainer's start-up
   checks take, the shortest estimated step (``timing.py``: compiled FLOPs and collective bytes) wins.

One choice per job: every process compiles the same candidates (a GPU compile may share its autotuning
between processes), and process 0's choice is broadcast to the others, as is process 0's reading of the kept
record (or its error), so no process searches or fails alone. The log gets one line: what was
chosen and its estimated step, and the runner-up with its own.

Not measured: the choice is the compiler-based estimate on every platform; the timed steps per finalist
that an accelerator would allow are not run (no accelerator was at hand to check them against).

Not for: the figures of one layout (``estimate.py``), ``plan --recommend`` on a machine you do not have
(``search.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from distrib_train.cluster import hardware
from distrib_train.podplan import search as search_lib
from distrib_train.podplan.estimate import PodPlan, plan_pod
from distrib_train.sharding.mesh import MeshConfig, granules_of
from distrib_train.training import layout_choice
from distrib_train.training.checks import check_context, check_microbatches
from distrib_train.training.config import Config

REMATS = ("none", "dots_saveable", "full")
MICROBATCHES = (1, 2, 4)
MESH_COMPILES = 3  # of the meshes, at most; the rest of ``max_compiles`` goes to the settings
_BROADCAST_BYTES = 8192


def device_kind() -> hardware.DeviceKind:
  """The figures of the job's devices; for CPU devices (emulated, sharing the host), a stand-in with the host's
  memory split between them."""
  device = jax.devices()[0]
  kind = hardware.kind_of_device(getattr(device, "device_kind", ""))
  if kind is not None:
    return kind
  if device.platform != "cpu":
    raise ValueError(f"mesh_config: auto has no figures for {device.device_kind!r} devices (cluster/hardware.py"
                     " knows " + ", ".join(hardware.DEVICE_KINDS) + "); name a mesh config instead.")
  local = max(1, jax.local_device_count())
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local
  return hardware.DeviceKind("cpu", "CPU device (emulated)", "cpu", memory_bytes=memory, usable_fraction=0.8,
                             peak_flops=1e11, hbm_bandwidth=2e10, ici_bandwidth=1e10, dcn_bandwidth=1e9,
                             devices_per_host=local, max_slice=local)


def _axes(config: Config) -> tuple[str, ...]:
  model = config.model_recipe().config
  return ("data", "fsdp", "tensor") + (("expert",) if getattr(model, "num_experts", 0) else ())


def _settings(config: Config) -> list[dict[str, Any]]:
  """The remat and microbatch settings to try, most promising first (less recomputation, fewer passes)."""
  model = config.model_recipe().config
  remats = REMATS if hasattr(model, "remat") else (None,)
  batch = config.data.global_batch_size
  out = []
  for microbatches in MICROBATCHES:
    if batch % microbatches:
      continue
    for remat in remats:
      out.append({**({"model.remat": remat} if remat else {}), "train.microbatches": microbatches})
  return out


def _label(pod: PodPlan, settings: dict[str, Any]) -> str:
  said = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in settings.items())
  return f"{pod.layout.describe()} ({said}): step {pod.time.step_s * 1e3:,.1f} ms"


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


def _compiled(config: Config, mesh: MeshConfig, kind, devices: int, granules: int,
              memory_fraction: float | None) -> tuple[PodPlan | None, bool]:
  """The compiled plan of ``config`` on ``mesh`` (None where the trainer would refuse it), and whether it was
  compiled."""
  options = dict(granules=granules, memory_fraction=memory_fraction)
  try:
    if not _runs(config, plan_pod(config, mesh, kind, devices, compile=False, **options)):
      return None, False
    return plan_pod(config, mesh, kind, devices, **options), True
  except ValueError:  # the compiler refused it
    return None, True
  finally:
    jax.clear_caches()


def _agree(payload: dict[str, Any]) -> dict[str, Any]:
  """Process 0's ``payload``, on every process."""
  if jax.process_count() == 1:
    return payload
  from jax.experimental import multihost_utils

  data = json.dumps(payload).encode()
  if len(data) > _BROADCAST_BYTES:
    raise ValueError(f"mesh_config: auto: the choice ({len(data)} bytes) exceeds {_BROADCAST_BYTES} to broadcast.")
  buffer = np.zeros(_BROADCAST_BYTES, np.uint8)
  buffer[:len(data)] = np.frombuffer(data, np.uint8)
  agreed = np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes().rstrip(b"\0")
  return json.loads(agreed.decode())


def search(config: Config, workdir: str | os.PathLike, *, max_compiles: int | None = None,
           say: Callable[[str], None] | None = None) -> layout_choice.Choice:
  """The layout for ``config`` on this job's devices (module docstring): the one kept in ``workdir`` for them,
  else the fastest that fits of a search compiling at most ``max_compiles`` candidates (default
  ``train.layout_compiles``).

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
  memory_fraction = float(fraction) if fraction else None
  names = _axes(config)
  base = MeshConfig(names, (devices // granules,) + (1,) * (len(names) - 1), (granules,) + (1,) * (len(names) - 1),
                    source="mesh_config: auto", devices=devices)
  say(f"mesh_config: auto: searching layouts of {devices} {kind.name} devices over {', '.join(names)}")
  meshes = search_lib.recommend(config, base, kind, devices, granules=granules, memory_fraction=memory_fraction,
                                max_compiles=max(1, min(MESH_COMPILES, max_compiles - 1)),
                                progress=lambda line: say(f"meshes: {line}"))
  ranked = [pod for pod in meshes.ranked if _runs(config, pod)]
  if not ranked:
    needs = sorted(meshes.not_fitting_compiled, key=lambda p: p.memory.total)
    closest = (f"; the closest, {needs[0].layout.describe()}, needs {needs[0].memory.total / 2**30:.2f} GiB of"
               f" {needs[0].memory.usable / 2**30:.2f}") if needs else ""
    dropped = "".join(f", {n} dropped: {why}" for why, n in meshes.dropped.items() if n)
    refused = len(meshes.ranked) - len(ranked)
    raise ValueError(f"mesh_config: auto found no layout of {devices} devices that runs {config.model.preset}"
                     f" ({meshes.candidates} meshes{dropped}; {meshes.compiled} compiled, {len(needs)} of them too"
                     f" large{closest}" + (f", {refused} refused by the trainer's checks (train.microbatches,"
                     " data.seq_len)" if refused else "") + "): lower data.global_batch_size or data.seq_len, use"
                     " more devices, or name a mesh config.")
  model = config.model_recipe().config
  preset = {**({"model.remat": model.remat} if hasattr(model, "remat") else {}),
            "train.microbatches": config.train.microbatches}
  best = ranked[0]
  mesh = MeshConfig(best.layout.axis_names, best.layout.ici, best.layout.dcn, source="mesh_config: auto",
                    devices=devices)
  finalists = [(pod, preset, pod.layout) for pod in ranked]
  compiled = meshes.compiled
  for settings in _settings(config):
    if compiled >= max_compiles:
      break
    if settings == preset:
      continue
    variant = layout_choice.Choice(mesh, settings, "").apply(config)
    pod, ran = _compiled(variant, mesh, kind, devices, granules, memory_fraction)
    compiled += ran
    if ran:
      say(f"settings: compiled {compiled}/{max_compiles}: {', '.join(f'{k}={v}' for k, v in settings.items())}")
    if pod is not None and pod.memory.fits and pod.compiled:
      finalists.append((pod, settings, pod.layout))
  finalists.sort(key=lambda f: f[0].time.step_s)
  (chosen, settings, layout), *rest = finalists
  line = (f"mesh_config: auto chose {_label(chosen, settings)}" + (f"; runner-up {_label(rest[0][0], rest[0][1])}"
          if rest else "") + f" (estimated by the {chosen.compiler} compiler; {meshes.candidates} meshes,"
          f" {compiled} compiled, in {time.perf_counter() - start:.1f} s)")
  agreed = _agree(_payload(layout, settings, line))
  searched = {"meshes": meshes.candidates, "dropped": {k: v for k, v in meshes.dropped.items() if v},
              "compiled": compiled, "finalists": [_label(p, s) for p, s, _ in finalists]}
  return _choice(agreed, time.perf_counter() - start, searched, signature)


def _payload(layout, settings: dict[str, Any], line: str) -> dict[str, Any]:
  """A choice as JSON-able values (``layout``: a mesh config's or a plan's layout)."""
  return {"names": list(layout.axis_names), "ici": list(layout.ici), "dcn": list(layout.dcn),
          "settings": dict(settings), "line": line}


def _choice(payload: dict[str, Any], seconds: float, searched: dict[str, Any], signature: dict[str, Any],
            reused: bool = False) -> layout_choice.Choice:
  mesh = MeshConfig(tuple(payload["names"]), tuple(payload["ici"]), tuple(payload["dcn"]),
                    source="mesh_config: auto", devices=jax.device_count())
  return layout_choice.Choice(mesh, payload["settings"], payload["line"], seconds, searched, reused, signature)
