"""Worker: import a Hugging Face checkpoint in 2 processes × 4 devices, fsdp spanning the processes.

argv: HF_DIRECTORY. Writes the logits of a fixed batch (gathered) and how many elements this process read.
"""

import sys

import mp_harness

mp_harness.worker_init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import distrib_train as dt  # noqa: E402
from distrib_train import recipes  # noqa: E402
from distrib_train.checkpoint import hf  # noqa: E402
from distrib_train.sharding.axis_rules import activation_sharding  # noqa: E402

directory = sys.argv[1]
read = [0]
original = hf.SafetensorsDirectory.read


def counting(self, name, index=()):
  out = original(self, name, index)
  read[0] += out.size
  return out


hf.SafetensorsDirectory.read = counting
config = hf.llama_config(directory, dtype="float32", attention="xla")
# fsdp 4 = 2 per process × 2 processes: each process holds half of every fsdp-split param.
mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (1, 2, 2), (1, 2, 1)))
planner = dt.MeshPlanner(mesh, "fsdp_tensor")
tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=(4, 32)).astype(np.int32)
make = lambda: dt.TrainState.initial_state(config.build(0), optax.sgd(0.0), jax.random.key(0))
plan = planner.plan(
  jax.eval_shape(make),
  loss_fn=recipes.llama.loss_fn,
  inputs={"tokens": tokens, "targets": tokens},
  input_axes=recipes.llama.INPUT_AXES,
)
params = hf.load_params(directory, plan.abstract_train_state.params, config)
state = plan.init(make).replace(params=params)


@jax.jit
def forward(state, tokens):
  model = state.model
  return model.logits(model(tokens))


with activation_sharding(plan.mesh, planner.rules):
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  logits = forward(state, jax.make_array_from_callback(tokens.shape, replicated, lambda index: tokens[index]))
total = sum(int(np.prod(t.shape)) for t in hf.SafetensorsDirectory(directory).tensors.values())
mp_harness.write_result(
  {
    "logits": np.asarray(multihost_utils.process_allgather(logits, tiled=True)).tolist(),
    "read": read[0],
    "total": total,
  }
)
