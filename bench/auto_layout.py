"""``mesh_config: auto``'s search against an exhaustive compile of the same space, with libtpu, deviceless.

Run from the repository root on any host with libtpu (``pip install 'jax[tpu]'``; no TPU needed):

  python bench/auto_layout.py --presets llama-124m-tpu
  python bench/auto_layout.py --presets llama-124m-tpu --json /tmp/auto.json

For each TPU preset, on its mesh config's topology, with libtpu's compiler (as ``plan`` compiles):
(a) the search a run with ``mesh_config: auto`` makes (``podplan/auto.search_space``, at most
``--max_compiles`` compiles): meshes over data, fsdp and tensor (expert for a mixture), then remat and
microbatches on the best mesh (the attention kernel and FP8 are searched only where a run times its
finalists); (b) every candidate of the same space compiled: each mesh whose state fits and whose rules split
the batch and every parameter (as ``search.recommend`` drops without compiling), times every setting of
``auto.settings_space`` that the trainer's start-up checks take, except those ``auto.outrun`` skips (the same
settings with more microbatches or a heavier remat than settings that fit on that mesh: never a shorter
estimate; the search skips them too). Each compiled candidate is appended to ``<json>.<preset>.jsonl`` as
it is done. It prints the space, the compiles and wall time of each, the estimated step of (a)'s choice and of
(b)'s best, and their ratio (the target: within 1.05).

Not for: a run's own search on its devices (``distrib-train --mesh_config auto``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO_ROOT)


def _exhaustive(config, kind, devices, target, say, log=None):
  import jax

  from distrib_train.podplan import auto, search
  from distrib_train.podplan.estimate import plan_pod, step_spec
  from distrib_train.podplan.layout_choice import Choice

  names = auto.axes(config)
  base = auto.MeshConfig(
    names, (devices,) + (1,) * (len(names) - 1), source="exhaustive", devices=devices, topology=target
  )
  meshes = search.candidate_meshes(base, devices, target.num_slices)
  space = auto.settings_space(config, kind)
  best, compiled, refused, skipped = None, 0, 0, 0
  for mesh in meshes:
    fitted = []
    for settings in space:
      if auto.outrun(settings, fitted):  # as the search skips them
        skipped += 1
        continue
      variant = Choice(mesh, settings, "").apply(config)
      try:
        spec = step_spec(variant, "tpu")
        pod = plan_pod(variant, mesh, kind, devices, compile=False, target=target, spec=spec)
        if search.drop_reason(pod, spec) or not auto._runs(variant, pod):
          refused += 1
          continue
        compiled += 1
        pod = plan_pod(variant, mesh, kind, devices, target=target, spec=spec)
      except ValueError as e:
        say(f"  {mesh.source} {settings}: not compiled ({str(e)[:120]})")
        continue
      finally:
        jax.clear_caches()
      step = pod.time.step_s if pod.compiled and pod.memory.fits else None
      say(f"  {compiled}: {pod.layout.describe()} {settings}: " + (f"{step * 1e3:.3g} ms" if step else "does not fit"))
      if step:
        fitted.append(settings)
      if log:
        log.write(json.dumps({"mesh": pod.layout.describe(), "settings": settings, "step_s": step}) + "\n")
        log.flush()
      if step and (best is None or step < best[0]):
        best = (step, pod.layout.describe(), settings)
  return {
    "meshes": len(meshes),
    "settings": len(space),
    "space": len(meshes) * len(space),
    "refused_uncompiled": refused,
    "skipped_outrun": skipped,
    "compiled": compiled,
    "best": best,
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--presets", nargs="+", required=True)
  parser.add_argument("--max_compiles", type=int, default=6)
  parser.add_argument("--no_exhaustive", action="store_true")
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from distrib_train.podplan import auto, tpu
  from distrib_train.sharding.mesh import MeshConfig, find_mesh_config
  from distrib_train.config import run as config_lib

  tpu.use_cpu_for_jax()
  rows = []
  for preset in args.presets:
    config = config_lib.load(preset)
    topology = MeshConfig.from_yaml(find_mesh_config(config.mesh_config)).topology
    kind, devices = tpu.kind_of(topology), topology.devices
    say = lambda line: print(line, file=sys.stderr, flush=True)
    start = time.perf_counter()
    found = auto.search_space(
      config, kind, devices, granules=topology.num_slices, max_compiles=args.max_compiles, target=topology, say=say
    )
    pod, settings = found.finalists[0]
    row = {
      "preset": preset,
      "topology": str(topology),
      "search": {
        "seconds": round(time.perf_counter() - start, 1),
        "compiled": found.compiled,
        "meshes": found.meshes.candidates,
        "settings": found.settings,
        "chosen": [pod.layout.describe(), settings],
        "step_s": pod.time.step_s,
      },
    }
    say(f"search: {json.dumps(row['search'])}")
    if not args.no_exhaustive:
      start = time.perf_counter()
      with open(f"{args.json or 'auto_layout'}.{preset}.jsonl", "w", encoding="utf-8") as log:
        every = _exhaustive(config, kind, devices, topology, say, log)
      every["seconds"] = round(time.perf_counter() - start, 1)
      row["exhaustive"] = every
      row["ratio"] = pod.time.step_s / every["best"][0] if every["best"] else None
    print(json.dumps(row), flush=True)
    rows.append(row)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
