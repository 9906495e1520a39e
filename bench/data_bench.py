"""Input pipeline speed: packed, batched tokens per second on this host.

Run from the repository root:

  python bench/data_bench.py [--seconds 10] [--seq_len 1024] [--batch 32]

For the embedded pydoc corpus (byte-level), times in one run:
- the grain pipeline (shuffle → shard → tokenize → pack with segment ids →
  batch), with 0 and 2 worker processes;
- a plain numpy slice of the same bytes into [batch, seq_len + 1] windows,
  the floor any pipeline pays.
Then trains the tiny Llama for --train_steps steps on 8 emulated devices
from the pipeline (planner → sharded init → donated step) and reports the
data wait: time spent in ``next(loader)`` as a share of the step time.
Targets: ≥ 1M tokens/s per host; data wait ≤ 1 % of step time.
"""

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import distrib_train as dt  # noqa: E402
from distrib_train import data  # noqa: E402


def tokens_per_second(next_batch, tokens_per_batch, seconds):
  next_batch()  # warm up (workers start, buffers fill)
  count, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    next_batch()
    count += 1
  return count * tokens_per_batch / (time.perf_counter() - start)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seconds", type=float, default=10.0)
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--train_steps", type=int, default=30)
  args = parser.parse_args()
  tokens_per_batch = args.batch * args.seq_len

  mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (2, 2, 2)))
  sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
  shardings = {k: sharding for k in ("tokens", "targets", "segment_ids", "positions", "weights")}

  corpus = np.frombuffer("\n\n".join(data.Documents(data.DataConfig())._docs).encode(), np.uint8)
  window = args.seq_len + 1
  rows = len(corpus) // window

  def numpy_batch(state={"i": 0}):
    start = (state["i"] * args.batch) % (rows - args.batch)
    state["i"] += 1
    block = corpus[start * window:(start + args.batch) * window].reshape(args.batch, window).astype(np.int32)
    return block[:, :-1], block[:, 1:]

  baseline = tokens_per_second(numpy_batch, tokens_per_batch, args.seconds)
  print(f"numpy slice of the same bytes: {baseline / 1e6:.2f} M tokens/s")
  for workers in (0, 2):
    config = data.DataConfig(seq_len=args.seq_len, global_batch_size=args.batch, num_workers=workers)
    loader = data.DataLoader(config, shardings)
    rate = tokens_per_second(loader.next_local, tokens_per_batch, args.seconds)
    loader.close()
    print(f"grain pipeline, {workers} workers: {rate / 1e6:.2f} M tokens/s ({rate / baseline:.1%} of the numpy slice;"
          f" target ≥ 1 M tokens/s: {'met' if rate >= 1e6 else 'NOT met'})")
  print(f"(seq_len {args.seq_len}, batch {args.batch}, {os.cpu_count()} CPUs, corpus {len(corpus) / 1e6:.2f} MB)")
  data_wait(mesh, args.train_steps)


def data_wait(mesh, steps):
  """The tiny Llama fed by the loader: how long the step waits for data."""
  import jax
  import optax

  recipe = dt.recipes.get("llama", "tiny")
  planner = dt.MeshPlanner(mesh, "fsdp_tensor")
  config = data.DataConfig(seq_len=128, global_batch_size=32)
  example = {k: jax.ShapeDtypeStruct((32, 128), np.float32 if k == "weights" else np.int32)
             for k in ("tokens", "targets", "segment_ids", "positions", "weights")}
  make = lambda: dt.TrainState.initial_state(recipe.config.build(0), optax.adam(1e-3), jax.random.key(0))
  state, plan = planner.init(make, loss_fn=recipe.loss_fn, inputs=example, input_axes=recipe.input_axes)
  step = dt.build_train_step_fn(recipe.loss_fn, donate_params_and_state=True,
                                train_state_shardings=plan.train_state_shardings,
                                input_kwarg_shardings=plan.input_kwarg_shardings,
                                aux_output_shardings=plan.aux_output_shardings)
  loader = data.DataLoader(config, plan.input_kwarg_shardings)
  state, aux = step(state, **next(loader))  # compile
  jax.block_until_ready(aux)
  waited, start = 0.0, time.perf_counter()
  for _ in range(steps):
    t = time.perf_counter()
    batch = next(loader)
    waited += time.perf_counter() - t
    state, aux = step(state, **batch)
    jax.block_until_ready(aux)  # as a trainer logging the loss each step does
  total = time.perf_counter() - start
  print(f"tiny Llama, batch 32 × 128, 8 emulated devices: step {total / steps * 1e3:.1f} ms, data wait"
        f" {waited / steps * 1e3:.2f} ms = {waited / total:.2%} of step time (target ≤ 1 %), loss"
        f" {float(aux['loss']):.3f}")


if __name__ == "__main__":
  main()
