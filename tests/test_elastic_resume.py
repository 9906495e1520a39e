"""Resuming on another number of processes or devices: the same batches and losses as a run that never stopped.

The global batch at step s depends on the seed, s and the data config alone
(``data/lanes.py``): 2 processes × 4 devices for 5 steps, then 1 × 8 for 5,
then 4 × 2 for 5 train on exactly what 1 × 8 trains on in 15.
"""

import json
import os
import pathlib

import numpy as np

import mp_harness
from test_cli import SMALL, cli, train_losses

WORKERS = pathlib.Path(__file__).parent / "workers"
SHAPES = [(2, 4), (1, 8), (4, 2)]  # processes × devices per process, 5 steps each


def _mesh_config(tmp_path, processes):
  """data over the processes (DCN), fsdp inside each; 8 devices in all."""
  path = tmp_path / f"mesh-{processes}proc.yaml"
  inside = 8 // processes
  path.write_text(
    f"devices: 8\ngranules: {processes}\naxes:\n  data: {{ici: 1, dcn: {processes}}}\n"
    f"  fsdp: {{ici: {inside}}}\n  tensor: {{ici: 1}}\nrules: fsdp_tensor\n"
  )
  return path


def _train(workdir, processes, steps, mesh, cache):
  args = [
    "--workdir",
    str(workdir),
    "--cpu_devices",
    str(8 // processes),
    "--mesh_config",
    str(mesh),
    "--steps",
    str(steps),
    *SMALL,
    "--set",
    "optimizer.name=sgd",
    "--set",
    "optimizer.learning_rate=0.5",
    "--set",
    "train.checkpoint_every=5",
  ]
  if processes == 1:
    run = cli(*args, cache=cache, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stderr
  port = mp_harness.free_port()
  procs = [
    cli(
      *args,
      "--coordinator_address",
      f"127.0.0.1:{port}",
      "--num_processes",
      str(processes),
      "--process_id",
      str(i),
      cache=cache,
      popen=True,
    )
    for i in range(processes)
  ]
  try:
    outputs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, 9)
  assert [p.returncode for p in procs] == [0] * processes, "\n".join(o[-2000:] for o in outputs)
  return outputs[0]


def test_resuming_on_other_process_and_device_counts_trains_on_the_same_batches(tmp_path, xla_cache):
  reference = tmp_path / "reference"
  _train(reference, 1, 15, _mesh_config(tmp_path, 1), xla_cache)
  elastic = tmp_path / "elastic"
  for i, (processes, _) in enumerate(SHAPES):
    output = _train(elastic, processes, 5 * (i + 1), _mesh_config(tmp_path, processes), xla_cache)
    if i:
      assert f"Restored step {5 * i}" in output, output[-3000:]
      assert "restarts from its beginning" not in output
  want, got = train_losses(reference), train_losses(elastic)
  assert sorted(got) == sorted(want) == list(range(1, 16))
  np.testing.assert_allclose([got[s] for s in range(1, 16)], [want[s] for s in range(1, 16)], rtol=2e-5)


def _read(checkpoint_dir, phase, steps, processes):
  results = mp_harness.run_workers(
    WORKERS / "lanes_worker.py",
    str(checkpoint_dir),
    str(phase),
    str(steps),
    num_processes=processes,
    devices_per_process=8 // processes,
    timeout=300,
  )
  by_shard = sorted((r.result for r in results), key=lambda r: r["shard"])  # data spans the processes
  return [sum((r["tokens"][step] for r in by_shard), []) for step in range(steps)]


def test_the_batches_are_the_same_bit_for_bit_whatever_the_process_count(tmp_path):
  """Loaders of 2, 1 and 4 processes, each resuming the last one's data position, give the rows one process
  reads in one go."""
  resumed = sum((_read(tmp_path / "position", i, 5, processes) for i, (processes, _) in enumerate(SHAPES)), [])
  want = _read(tmp_path / "one-go", 0, 15, 1)
  assert resumed == want
  assert len({json.dumps(batch) for batch in want}) == 15
