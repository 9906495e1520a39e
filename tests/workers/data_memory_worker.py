"""Reads 20 batches of a JSONL corpus through a DataLoader; prints the process's peak RSS in MiB.

Run as ``python data_memory_worker.py CORPUS``; the test compares a corpus
far larger than the growth it allows with a small one.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import distrib_train as dt  # noqa: E402
from distrib_train import data  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def main(corpus: str) -> None:
  mesh = dt.build_mesh(dt.MeshConfig(("data",), (8,)))
  config = data.DataConfig(source="text", paths=(corpus,), seq_len=512, global_batch_size=16, eval_fraction=0.0)
  sharding = NamedSharding(mesh, P("data", None))
  loader = data.DataLoader(config, {k: sharding for k in data.DataLoader.batch_schema(config)})
  for _ in range(20):
    loader.next_local()
  loader.close()
  # VmHWM, the peak resident set of this program (getrusage's ru_maxrss would count the forking parent's too).
  with open("/proc/self/status") as f:
    print(next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) // 1024)


if __name__ == "__main__":
  main(sys.argv[1])
