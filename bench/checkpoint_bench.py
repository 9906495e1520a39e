"""Checkpoint speed: async save and restore of a ≥ 1 GB train state, against raw disk I/O.

Run from the repository root (8 emulated CPU devices):

  python bench/checkpoint_bench.py [--gib 1.1] [--repeats 3] [--dir /tmp/ckpt_bench]

Prints, per repeat and as medians:
- blocking part of an async save (save() returning) and the whole save
  (until committed), and their ratio (target: blocking ≤ 20 % of the whole);
- save MB/s against a raw sequential write of the same bytes (numpy tofile,
  random data, then fsync: tensorstore syncs the files it writes) in the same
  directory (target ≥ 50 %);
- restore MB/s onto the sharded target against a raw read of the raw file
  (target ≥ 50 %). Page caches are dropped before each read when the machine
  allows it (the output says whether it did).
"""

import argparse
import os
import shutil
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import distrib_train as dt  # noqa: E402


def drop_caches() -> bool:
  try:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
      f.write("3\n")
    return True
  except OSError:
    return False


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gib", type=float, default=1.1, help="size of the train state (params + Adam)")
  parser.add_argument("--repeats", type=int, default=6)
  parser.add_argument("--dir", default="/tmp/distrib_train_ckpt_bench")
  args = parser.parse_args()

  # Params of n × (4096, 4096) float32; Adam adds mu and nu: 3 × params bytes.
  per_matrix = 4096 * 4096 * 4
  n = max(1, round(args.gib * 2**30 / (3 * per_matrix)))
  mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (1, 8, 1)))
  # Random values: constant arrays would compress to nothing on disk.
  keys = jax.random.split(jax.random.key(1), n)
  make = lambda: dt.TrainState.initial_state(
    {f"w{i}": jax.random.normal(keys[i], (4096, 4096)) for i in range(n)}, optax.adam(1e-3), jax.random.key(0)
  )
  planner = dt.MeshPlanner(mesh, dt.AxisRules("fsdp_tensor", param_axes=[(r"w\d+", ("embed", "mlp"))]))
  state, plan = planner.init(make)
  # Adam's moments start at zero; give them random values too.
  state = state.replace(
    opt_state=jax.tree_util.tree_map(
      lambda x: x + jax.random.normal(jax.random.key(2), x.shape, x.dtype) if x.ndim else x, state.opt_state
    )
  )
  jax.block_until_ready(state)
  nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves((state.params, state.opt_state)))
  mb = nbytes / 1e6
  print(
    f"train state: {n} params of 4096×4096 float32 + Adam = {nbytes / 2**30:.2f} GiB on {mesh.size} devices "
    f"(fsdp 8); directory {args.dir}"
  )

  rows = []
  for repeat in range(args.repeats):
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    raw_path = os.path.join(args.dir, "raw.bin")
    checkpoints = dt.CheckpointManager(os.path.join(args.dir, "ckpt"), max_to_keep=1)

    def raw_write_seconds():
      # The same number of bytes, random, from host memory; then fsync, as
      # tensorstore's file driver syncs what it writes.
      host = [np.asarray(jax.device_get(x)) for x in jax.tree_util.tree_leaves((state.params, state.opt_state))]
      os.sync()
      start = time.perf_counter()
      with open(raw_path, "wb") as f:
        for array in host:
          array.tofile(f)
        f.flush()
        os.fsync(f.fileno())
      return time.perf_counter() - start

    def save_seconds():
      os.sync()
      start = time.perf_counter()
      checkpoints.save(1, state)
      blocking = time.perf_counter() - start
      checkpoints.wait_until_finished()
      return blocking, time.perf_counter() - start

    # The disk's speed drifts (host-level caching): alternate which goes first.
    if repeat % 2:
      blocking, whole = save_seconds()
      raw_write = raw_write_seconds()
    else:
      raw_write = raw_write_seconds()
      blocking, whole = save_seconds()

    dropped = drop_caches()
    start = time.perf_counter()
    restored = checkpoints.restore(plan.abstract_train_state)
    jax.block_until_ready(restored)
    restore = time.perf_counter() - start
    del restored

    drop_caches()
    start = time.perf_counter()
    with open(raw_path, "rb") as f:
      while f.read(256 * 2**20):
        pass
    raw_read = time.perf_counter() - start
    checkpoints.close()
    row = dict(
      save_first=bool(repeat % 2),
      blocking=blocking,
      whole=whole,
      save_mbs=mb / whole,
      raw_write_mbs=mb / raw_write,
      restore_mbs=mb / restore,
      raw_read_mbs=mb / raw_read,
      dropped=dropped,
    )
    rows.append(row)
    print(
      f"repeat {repeat}: save blocking {blocking:.2f} s of {whole:.2f} s ({blocking / whole:.0%}); "
      f"save {row['save_mbs']:.0f} MB/s vs raw write {row['raw_write_mbs']:.0f} MB/s "
      f"({row['save_mbs'] / row['raw_write_mbs']:.0%}); restore {row['restore_mbs']:.0f} MB/s vs raw read "
      f"{row['raw_read_mbs']:.0f} MB/s ({row['restore_mbs'] / row['raw_read_mbs']:.0%}); "
      f"page cache dropped: {dropped}"
    )

  med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k not in ("dropped", "save_first")}
  write_ratio = statistics.median(r["save_mbs"] / r["raw_write_mbs"] for r in rows)
  read_ratio = statistics.median(r["restore_mbs"] / r["raw_read_mbs"] for r in rows)
  block_ratio = statistics.median(r["blocking"] / r["whole"] for r in rows)
  # The disk absorbs about a GiB fast, then slows: compare writes that ran in
  # the same position (first or second in their repeat).
  for position, first in (("first", True), ("second", False)):
    saves = [r["save_mbs"] for r in rows if r["save_first"] == first]
    raws = [r["raw_write_mbs"] for r in rows if r["save_first"] != first]
    if saves and raws:
      print(
        f"writes that ran {position}: save median {statistics.median(saves):.0f} MB/s, raw median"
        f" {statistics.median(raws):.0f} MB/s, ratio {statistics.median(saves) / statistics.median(raws):.0%}"
      )
  print(
    f"median of {len(rows)}: save blocking {med['blocking']:.2f} s of {med['whole']:.2f} s, ratio {block_ratio:.0%}"
    f" (target ≤ 20 %); save {med['save_mbs']:.0f} MB/s, raw write {med['raw_write_mbs']:.0f} MB/s, ratio"
    f" {write_ratio:.0%} (target ≥ 50 %); restore {med['restore_mbs']:.0f} MB/s, raw read"
    f" {med['raw_read_mbs']:.0f} MB/s, ratio {read_ratio:.0%} (target ≥ 50 %)"
  )
  shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
  main()
