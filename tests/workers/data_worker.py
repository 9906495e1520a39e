"""Worker: the data pipeline in 2 processes × 4 devices.

argv: CORPUS_DIR CHECKPOINT_DIR
"""

import pathlib
import sys

import mp_harness

mp_harness.worker_init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import data_helpers  # noqa: E402
import distrib_train as dt  # noqa: E402
from distrib_train import data  # noqa: E402

corpus_dir, checkpoint_dir = sys.argv[1], sys.argv[2]
configs = pathlib.Path(__file__).resolve().parents[2] / "mesh_configs"
# Each process writes the same corpus to its own file: no cross-process race.
own_dir = pathlib.Path(corpus_dir) / f"p{jax.process_index()}"
own_dir.mkdir()
corpus = data_helpers.write_corpus(own_dir)
result = {}

# 1. The batch axis spans the processes: each reads half of the documents.
mesh = data_helpers.mesh_from(configs / "cpu-2proc.yaml")
config = data.DataConfig(
  source="text", paths=(corpus,), seq_len=8, global_batch_size=8, packing=False, eval_fraction=0.0
)
loader = data.DataLoader(config, data_helpers.shardings(mesh), num_epochs=1)
ids, global_ok = [], True
while True:
  try:
    local = loader.next_local()
  except StopIteration:
    break
  batch = data.to_global(local, loader.input_shardings, config.global_batch_size)
  global_ok &= batch["tokens"].shape == (8, 8)
  global_ok &= bool(np.array_equal(data_helpers.first_local_rows(batch["tokens"]), local["tokens"]))
  ids.extend(data_helpers.doc_ids(local["tokens"]))
result["split"] = {"shard": [loader.shard_index, loader.shard_count], "ids": ids, "global_ok": global_ok}

# 2. A mesh axis (tensor, across processes over DCN) replicates the batch:
#    both processes read the same rows and feed identical data.
replicated_mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (2, 2, 1), (1, 1, 2)))
loader = data.DataLoader(config, data_helpers.shardings(replicated_mesh), num_epochs=1)
local = loader.next_local()
batch = data.to_global(local, loader.input_shardings, config.global_batch_size)
result["replicated"] = {
  "shard": [loader.shard_index, loader.shard_count],
  "ids": data_helpers.doc_ids(local["tokens"]),
  "global_ok": bool(np.array_equal(data_helpers.first_local_rows(batch["tokens"]), local["tokens"])),
}

# 3. Exact resume through the checkpoint's data position.
packed = data.DataConfig(seq_len=32, global_batch_size=8)
loader = data.DataLoader(packed, data_helpers.shardings(mesh))
for _ in range(3):
  next(loader)
state = dt.TrainState.create(apply_fn=None, params={"w": np.zeros(2, np.float32)}, tx=optax.sgd(0.1))
with dt.CheckpointManager(checkpoint_dir) as checkpoints:
  checkpoints.save(3, state, data_iterator=loader)
expected = [loader.next_local()["tokens"].tolist() for _ in range(2)]
fresh = data.DataLoader(packed, data_helpers.shardings(mesh))
with dt.CheckpointManager(checkpoint_dir) as checkpoints:
  checkpoints.restore(state, data_iterator=fresh)
result["resume_equal"] = [fresh.next_local()["tokens"].tolist() for _ in range(2)] == expected
result["after_save"] = expected  # this process's rows; a job of another shape resumes with the same rows

# 4. Exact resume at step 0 and at a step where a document ends exactly at a
#    packed row's end: every document here is one row of seq_len + 1 tokens.
rows_dir = own_dir / "rows"
rows_dir.mkdir()
exact = data.DataConfig(
  source="text",
  paths=(data_helpers.write_documents(rows_dir, [8] * 32),),
  seq_len=7,
  global_batch_size=8,
  eval_fraction=0.0,
)
loader = data.DataLoader(exact, data_helpers.shardings(mesh))
with dt.CheckpointManager(f"{checkpoint_dir}-exact", max_to_keep=None) as checkpoints:
  checkpoints.save(0, state, data_iterator=loader)
  drawn = [loader.next_local() for _ in range(2)]
  checkpoints.save(2, state, data_iterator=loader)
drawn += [loader.next_local() for _ in range(3)]
result["exact_resume"] = {}
for step in (0, 2):
  fresh = data.DataLoader(exact, data_helpers.shardings(mesh))
  with dt.CheckpointManager(f"{checkpoint_dir}-exact") as checkpoints:
    checkpoints.restore(state, step=step, data_iterator=fresh)
  got = [fresh.next_local() for _ in range(3)]
  result["exact_resume"][str(step)] = all(
    np.array_equal(g[name], want[name]) for g, want in zip(got, drawn[step : step + 3]) for name in want
  )

# 5. A finite pass (eval) ends at the same batch in every process, although
#    packing leaves the two shards with different numbers of batches.
eval_loader = data.DataLoader(
  data.DataConfig(seq_len=32, global_batch_size=8), data_helpers.shardings(mesh), split="eval", num_epochs=1
)
result["eval_batches"] = sum(1 for _ in eval_loader)
mp_harness.write_result(result)
