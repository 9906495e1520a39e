"""``distrib-train plan``: will it fit, on which mesh, at what communication cost?

  distrib-train plan --config llama-7b-tpu --mesh_config tpu-v5e-256
  distrib-train plan --config llama-7b-gpu --devices 128 --set data.global_batch_size=256 --recommend --out mesh.yaml
  distrib-train plan --config tiny --devices 8 --json plan.json
  distrib-train plan --config tiny --tpu_topology v4:2x2x2 --num_slices 2 --mesh_config my-2slice.yaml

For a TPU target — ``--tpu_topology v5p:4x4x4`` (``--num_slices N`` for
multi-slice), or a mesh config that names its ``topology:`` (every shipped
``tpu-*.yaml`` does) — libtpu's own compiler compiles the step for that
topology on this host (``pip install 'jax[tpu]'``; no TPU needed): the
memory, collectives and FLOPs are the TPU program's. Otherwise (GPUs, or
``--emulate``) the mesh is built on N emulated CPU devices (``--devices``,
default: the mesh config's ``devices``) and the CPU compiler's figures are
corrected for the target (``estimate.py`` says how).

It plans the train state, compiles the trainer's step on abstract inputs
(nothing is allocated) and prints the memory per device against the device
kind's, the collectives per step by mesh axis (ICI or DCN), FLOPs, and an
estimated step time and MFU. ``--recommend`` (or ``--mesh_config auto``)
searches what a run's ``mesh_config: auto`` searches (``auto.py``): the
factorisations of the devices over the mesh axes, then remat and
microbatches on the best (not the attention kernel or FP8: only a run's timed
steps rank those), and writes the choice as a mesh-config
YAML (``--out``) and an experiment config the trainer loads as is
(``--out_config``); on a TPU target its finalists are compiled by libtpu.

A mistake in the flags, the config or the mesh config prints one ``error:``
line and exits with status 2. Exit status 1: ``--recommend`` found no mesh
that fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
from collections.abc import Sequence

from distrib_train.common.text import fail

DEFAULT_OUT = "recommended-mesh.yaml"
DEFAULT_CONFIG_OUT = "recommended-config.yaml"


class _UsageError(Exception):
  pass


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # argparse prints usage and exits 2; one line is the CLI's convention
    raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
  p = _Parser(
    prog="distrib-train plan",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog=__doc__.split("\n\n", 1)[1],
  )
  p.add_argument("--config", help="experiment preset name or YAML path (default: the built-in defaults)")
  p.add_argument("--mesh_config", help="a name in mesh_configs/ or a YAML path (default: the config's)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
  p.add_argument("--devices", type=int, help="devices to plan for (default: the mesh config's 'devices')")
  p.add_argument(
    "--device_kind",
    help="h100, h200, a100, v4, v5e, v5p or v6e (default: the one the mesh config or preset name mentions, else h100)",
  )
  p.add_argument(
    "--tpu_topology",
    help="compile with libtpu for this TPU slice, e.g. v5e:2x2, v5p:4x4x4 (default: the mesh config's topology)",
  )
  p.add_argument(
    "--num_slices", type=int, help="TPU slices joined over DCN (default: the mesh config's granules, else 1)"
  )
  p.add_argument("--emulate", action="store_true", help="plan on emulated CPU devices even for a TPU target")
  p.add_argument(
    "--granules", type=int, help="TPU slices or GPU hosts (default: from the mesh config; GPUs: one per 8 devices)"
  )
  p.add_argument(
    "--recommend",
    action="store_true",
    help="rank mesh factorisations, then settings (remat,"
    " microbatches) on the best; write the best as a mesh config and an experiment config",
  )
  p.add_argument("--top", type=int, default=5, help="candidates to print with --recommend (default 5)")
  p.add_argument("--max_compiles", type=int, default=6, help="candidates --recommend compiles at most (default 6)")
  p.add_argument("--out", help=f"where --recommend writes the mesh config (default ./{DEFAULT_OUT})")
  p.add_argument(
    "--out_config",
    help="where --recommend writes the experiment config with the chosen settings and"
    f" mesh (default: {DEFAULT_CONFIG_OUT} beside --out)",
  )
  p.add_argument("--json", help="also write the figures as JSON to this path")
  p.add_argument(
    "--kv_cache",
    metavar="ROWSxTOKENS",
    help="also the generation cache of ROWS rows of TOKENS tokens"
    " (prompt and new) on this mesh: its bytes per device, laid out by the rules (e.g. 64x4096)",
  )
  p.add_argument("--efficiency", type=float, default=None, help="share of peak FLOP/s the matmuls reach (default 0.6)")
  p.add_argument("--memory_fraction", type=float, help="usable share of device memory (default: TPU 1.0, GPU 0.92)")
  p.add_argument(
    "--no_activation_sharding", action="store_true", help="do not trace the model's activation sharding constraints"
  )
  p.add_argument("--no_compile", action="store_true", help="state and batch figures only (seconds, not minutes)")
  p.add_argument("--arrays", action="store_true", help="also print every array's layout (the plan report)")
  p.add_argument("--native", action="store_true", help="plan on this machine's devices instead of emulating")
  return p


def _positive(args: argparse.Namespace) -> None:
  for name in ("devices", "granules", "top", "max_compiles", "num_slices"):
    value = getattr(args, name)
    if value is not None and value < 1:
      raise _UsageError(f"--{name} must be at least 1, got {value}.")
  for name in ("out", "out_config"):
    value = getattr(args, name)
    if value is not None and not value.endswith((".yaml", ".yml")):
      raise _UsageError(f"--{name} must name a .yaml file (a name without it reads as a preset), got {value!r}.")
  for name in ("efficiency", "memory_fraction"):
    value = getattr(args, name)
    if value is not None and not 0 < value <= 1:
      raise _UsageError(f"--{name} must be in (0, 1], got {value}.")
  if args.kv_cache is not None:
    rows, x, tokens = args.kv_cache.lower().partition("x")
    if not (x and rows.isdigit() and tokens.isdigit() and int(rows) > 0 and int(tokens) > 0):
      raise _UsageError(f"--kv_cache must be ROWSxTOKENS, e.g. 64x4096, got {args.kv_cache!r}.")
    if args.recommend:
      raise _UsageError("--kv_cache reports the cache on the mesh planned; give it without --recommend.")


def _granules(args, mesh_config, devices, kind, matches) -> int:
  from distrib_train.podplan import estimate as podplan

  if args.granules:
    if devices % args.granules:
      raise _UsageError(f"--granules {args.granules} does not divide --devices {devices}.")
    return args.granules
  if matches and mesh_config.is_hybrid:
    return podplan.layout(mesh_config, devices, kind).granules
  if kind.platform == "gpu" and devices > kind.devices_per_host:
    if devices % kind.devices_per_host:
      raise _UsageError(f"{devices} {kind.name} GPUs do not fill hosts of {kind.devices_per_host}; pass --granules.")
    return devices // kind.devices_per_host
  return 1


def main(argv: Sequence[str]) -> int:
  """Runs ``distrib-train plan`` with ``argv`` (the arguments after ``plan``)."""
  try:
    args = _parser().parse_args(list(argv))
    _positive(args)
  except _UsageError as e:
    fail(str(e))
  from distrib_train.config import run as config_lib
  from distrib_train.cluster import hardware
  from distrib_train.podplan import estimate as podplan
  from distrib_train.sharding.mesh import MeshConfig, find_mesh_config

  notes = []
  try:
    overrides = config_lib.parse_overrides(args.set)
    if args.mesh_config:
      overrides["mesh_config"] = args.mesh_config
    config = config_lib.load(args.config, overrides)
    if config.mesh_config == "auto":  # the meshes a run's mesh_config: auto searches, here for the flags' machine
      from distrib_train.podplan.auto import axes

      names = axes(config)
      mesh_config = MeshConfig(names, (-1,) + (1,) * (len(names) - 1), source="mesh_config auto")
      args.recommend = True
    else:
      mesh_config = MeshConfig.from_yaml(find_mesh_config(config.mesh_config))
    devices = args.devices or mesh_config.devices or (_topology(args, mesh_config) or _NoTopology).devices
    if devices is None:
      raise _UsageError(f"{mesh_config.source} does not say how many devices it is for; pass --devices N.")
    matches = mesh_config.devices in (None, devices)
    if not matches and not args.recommend:
      raise _UsageError(
        f"{mesh_config.source} is for {mesh_config.devices} devices, not --devices {devices}; pick a"
        f" mesh config for {devices} devices (or --recommend one)."
      )
    topology = _topology(args, mesh_config)
    target = topology if topology is not None and not (args.emulate or args.native) else None
    if topology is not None:
      kind = podplan.tpu_lib.kind_of(topology)
      if args.device_kind and hardware.device_kind(args.device_kind) != kind:
        raise _UsageError(f"--device_kind {args.device_kind} but TPU topology {topology} is {kind.name} chips.")
      if args.devices and args.devices != topology.devices and not args.emulate:
        raise _UsageError(
          f"--devices {args.devices} but TPU topology {topology} has {topology.devices} chips; pass"
          f" --tpu_topology for a {args.devices}-chip slice, or --emulate."
        )
      devices = args.devices if args.emulate and args.devices else topology.devices
      matches = mesh_config.devices in (None, devices)
      if not matches and not args.recommend:
        raise _UsageError(
          f"{mesh_config.source} is for {mesh_config.devices} devices; TPU topology {topology} has"
          f" {devices} chips. Pick a mesh config for {devices} devices (or --recommend one)."
        )
    elif args.device_kind:
      kind = hardware.device_kind(args.device_kind)
    else:
      kind = hardware.guess_device_kind(os.path.basename(mesh_config.source), args.config or "")
      if kind is None:
        kind = hardware.DEVICE_KINDS["h100"]
        notes.append("no --device_kind and none named by the mesh config or preset: figures are for h100.")
    if target is None and kind.platform == "gpu" and not (args.emulate or args.native):
      if podplan.gpu_lib.available():
        target = podplan.gpu_lib.GpuTarget(kind, devices, kind.devices_per_host)
        podplan.gpu_lib.target_config(kind)  # a card it can describe, or a clear error now
      else:
        notes.append(
          f"planned on emulated CPU devices: XLA's CUDA compiler compiles for {kind.name} without a GPU"
          f" once JAX's CUDA plugin is installed ({podplan.gpu_lib.install_hint()})."
        )
    if isinstance(target, podplan.TpuTopology):
      granules = target.num_slices
    else:
      granules = _granules(args, mesh_config, devices, kind, matches) if args.recommend else args.granules
    if isinstance(target, podplan.gpu_lib.GpuTarget):
      podplan.tpu_lib.use_cpu_for_jax()
    elif target is not None:
      if not podplan.tpu_lib.available():
        raise podplan.tpu_lib.TpuCompilerMissing(
          f"planning for TPU {target} needs libtpu's compiler: {podplan.tpu_lib.install_hint()}."
        )
      podplan.tpu_lib.use_cpu_for_jax()
    elif args.native:
      import jax

      if len(jax.devices()) != devices:
        raise _UsageError(f"--native: this machine has {len(jax.devices())} devices, not {devices}.")
    else:
      podplan.use_emulated_devices(devices)
      if topology is not None:
        notes.append(f"--emulate: planned on emulated CPU devices for TPU {topology}, not with libtpu's compiler.")
  except (_UsageError, ValueError) as e:  # ConfigError is a ValueError
    fail(str(e))
  efficiency = args.efficiency or podplan.DEFAULT_EFFICIENCY
  common = dict(
    efficiency=efficiency, memory_fraction=args.memory_fraction, constrain_activations=not args.no_activation_sharding
  )
  name = args.config or "defaults"
  try:
    if args.recommend:
      return _recommend(args, config, mesh_config, kind, devices, granules, matches, notes, name, common, target)
    pod = podplan.plan_pod(
      config,
      mesh_config,
      kind,
      devices,
      config_name=name,
      granules=granules,
      compile=not args.no_compile,
      target=target,
      **common,
    )
  except ValueError as e:
    fail(str(e))
  pod.notes.extend(notes)
  print(pod.report())
  if args.kv_cache:
    print(_kv_cache_line(config, pod.plan.mesh, podplan.rules_for(config, mesh_config), args.kv_cache))
  if args.arrays:
    print("\n" + pod.plan.report())
  if args.json:
    _write_json(args.json, pod.to_dict())
  return 0


def _kv_cache_line(config, mesh, rules, text: str) -> str:
  """The generation cache's size for ``text`` (``ROWSxTOKENS``) on ``mesh`` (``generation/cache.py``)."""
  import jax
  from jax.sharding import NamedSharding

  from distrib_train.generation import cache as cache_lib
  from distrib_train.podplan import report as podplan_report

  model = config.model_recipe().config
  rows, tokens = (int(v) for v in text.lower().split("x"))
  spec, axes = cache_lib.cache_spec(model, rows, tokens), cache_lib.cache_axes(model, rows, tokens)
  is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
  per_device = sum(
    math.prod(NamedSharding(mesh, rules.spec(a, shape=s.shape, mesh=mesh)).shard_shape(s.shape)) * s.dtype.itemsize
    for s, a in zip(jax.tree.leaves(spec), jax.tree.leaves(axes, is_leaf=is_axes))
  )
  whole = cache_lib.cache_bytes(model, rows, tokens)
  layers = len(model.layer_kinds())
  held = cache_lib.values_per_token(model)
  return (
    f"Generation cache, {rows} rows × {tokens} tokens ({model.dtype}): {podplan_report.human_bytes(per_device)}"
    f" per device, {podplan_report.human_bytes(whole)} in all; {held} values per token and layer"
    f" ({layers} layers; a sliding layer keeps its window)."
  )


class _NoTopology:
  devices = None


def _topology(args, mesh_config):
  """The TPU topology the plan is for: ``--tpu_topology``, else the mesh config's; ``--num_slices`` overrides."""
  from distrib_train.sharding.topology import TpuTopology

  if args.tpu_topology:
    slices = args.num_slices or (mesh_config.topology.num_slices if mesh_config.topology else None)
    if slices is None:  # the mesh config's DCN sizes, where it gives them all
      slices = math.prod(mesh_config.dcn) if -1 not in mesh_config.dcn else 1
    return TpuTopology.parse(args.tpu_topology, slices, where="--tpu_topology")
  if mesh_config.topology is None:
    if args.num_slices:
      raise _UsageError(
        f"--num_slices needs a TPU topology: pass --tpu_topology (e.g. v5p:4x4x4), or a mesh config"
        f" with 'topology:' ({mesh_config.source} has none)."
      )
    return None
  if args.num_slices and args.num_slices != mesh_config.topology.num_slices:
    return TpuTopology(mesh_config.topology.generation, mesh_config.topology.grid, args.num_slices)
  return mesh_config.topology


def _recommend(args, config, mesh_config, kind, devices, granules, matches, notes, name, common, target) -> int:
  from distrib_train.podplan import auto
  from distrib_train.podplan import search as mesh_search
  from distrib_train.podplan import estimate as podplan
  from distrib_train.podplan import report as podplan_report
  from distrib_train.config import run as config_lib
  from distrib_train.podplan.layout_choice import Choice

  if not matches:
    notes.append(
      f"{mesh_config.source} is for {mesh_config.devices} devices: its axes and rules are used, not its sizes."
    )
  print(
    f"Recommending a layout for {name} on {devices} × {kind.name} ({granules} granule(s)) over axes"
    f" {', '.join(mesh_config.axis_names)}, then its settings",
    flush=True,
  )
  progress = lambda m: print(f"  {m}", file=sys.stderr, flush=True)
  try:
    found = auto.search_space(
      config,
      kind,
      devices,
      granules=granules,
      max_compiles=args.max_compiles,
      target=target,
      base=mesh_config,
      say=progress,
      **common,
    )
  except ValueError as e:
    if "found no layout" not in str(e):
      raise
    found, failure = None, str(e)
  rec = found.meshes if found else None
  if rec is not None:
    print(podplan_report.recommendation_text(rec, args.top))
  out = (
    {}
    if rec is None
    else {
      "candidates": rec.candidates,
      "dropped": rec.dropped,
      "compiled": found.compiled,
      "ranked": [p.to_dict() for p in rec.ranked[: args.top]],
      "not_fitting": [p.to_dict() for p in rec.not_fitting_compiled],
      "settings": [{"settings": s, "step_s": p.time.step_s, "memory": p.memory.total} for p, s in found.finalists],
    }
  )
  if found is None:
    print(failure)
    for note in notes:
      print(f"  - {note}")
    if args.json:
      _write_json(args.json, out)
    return 1
  print("\nSettings on the fastest mesh, by estimated step time:")
  for pod, settings in found.finalists[: args.top]:
    print(f"  {auto.candidate_label(pod, settings)}, {podplan_report.human_bytes(pod.memory.total)} per device")
  best, settings = found.finalists[0]
  best.config_name = name
  best.notes.extend(notes)
  rules = podplan.rules_for(config, mesh_config)
  said = ", ".join(f"{k}={v}" for k, v in settings.items())
  header = [
    f"Recommended by `distrib-train plan --recommend` for {name} on {devices} × {kind.name}"
    f" ({datetime.date.today().isoformat()}), with {said}.",
    f"Estimated step {best.time.step_s:.3g} s, MFU {best.time.mfu or 0:.1%};"
    f" {podplan_report.human_bytes(best.memory.total)} of {podplan_report.human_bytes(best.memory.usable)}"
    f" per device ({podplan_report.compiler_line(best)}).",
  ]
  path = args.out or DEFAULT_OUT
  config_path = args.out_config or os.path.join(os.path.dirname(path), DEFAULT_CONFIG_OUT)
  chosen = Choice(None, settings, "").apply(config)
  chosen = dataclasses.replace(chosen, mesh_config=path)  # as --out was given: relative to where you run
  try:
    for written in (path, config_path):
      os.makedirs(os.path.dirname(os.path.abspath(written)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      f.write(mesh_search.mesh_config_yaml(best, rules, header))
    with open(config_path, "w", encoding="utf-8") as f:
      f.write(
        "".join(f"# {line}\n" for line in header) + f"# Run it: distrib-train --config {config_path}\n"
        f"# (its mesh_config is the path --out was given, {path}: run from here, or edit it)\n" + chosen.to_yaml()
      )
  except OSError as e:
    fail(f"cannot write {e.filename!r}: {e.strerror}.")
  from distrib_train.sharding.mesh import MeshConfig

  MeshConfig.from_yaml(path)  # what was written loads
  config_lib.load(config_path)
  print(f"\nBest: {best.layout.describe()} with {said} → wrote {path} and {config_path}\n")
  print(best.report())
  out.update(out=path, config_out=config_path, chosen=settings)
  if args.json:
    _write_json(args.json, out)
  return 0


def _write_json(path: str, data) -> None:
  try:
    with open(path, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=1, default=str)
  except OSError as e:
    fail(f"cannot write {path!r}: {e.strerror}.")


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
