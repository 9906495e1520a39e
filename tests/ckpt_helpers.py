"""A small nnx model with integer-keyed layers and BatchNorm, for checkpoints."""

import jax
import numpy as np
import optax
from flax import nnx

import distrib_train as dt


class LayeredNet(nnx.Module):
  """nnx.List of layers (integer keys) plus BatchNorm (local state)."""

  def __init__(self, rngs, width=64, depth=2):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    self.layers = nnx.List([nnx.Linear(width, width, kernel_init=init, rngs=rngs) for _ in range(depth)])
    self.norm = nnx.BatchNorm(width, rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = jax.nn.relu(layer(x))
    return self.norm(x)


def loss_fn(*, model, state, rng, x):
  loss = ((model(x) - 1.0) ** 2).mean()
  return loss, state + 1, {"loss": loss}


def make_state(width=64, depth=2):
  with nnx.use_eager_sharding(False):
    model = LayeredNet(nnx.Rngs(0), width, depth)
  return dt.TrainState.initial_state(model, optax.adam(1e-2), jax.random.key(7), loss_fn_state=np.int32(0))


def batch(step, width=64):
  return {"x": np.random.default_rng(step).normal(size=(16, width)).astype(np.float32)}


def planned(mesh, width=64, depth=2):
  planner = dt.MeshPlanner(mesh, "fsdp_tensor")
  make = lambda: make_state(width, depth)
  plan = planner.plan(jax.eval_shape(make), loss_fn=loss_fn, inputs=batch(0, width))
  step_fn = dt.build_train_step_fn(
    loss_fn,
    donate_params_and_state=True,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
  )
  return plan, make, step_fn


def train(state, step_fn, start, stop, plan, width=64):
  for i in range(start, stop):
    inputs = {k: jax.device_put(v, plan.input_kwarg_shardings[k]) for k, v in batch(i, width).items()}
    state, _ = step_fn(state, **inputs)
  return state


def saved_arrays(state):
  """Every saved leaf as host numpy (keys as raw data), gathered across hosts."""
  from jax.experimental import multihost_utils

  out = {}
  for field in ("step", "root_rng", "params", "opt_state", "loss_fn_state", "local_state"):
    for path, leaf in jax.tree_util.tree_flatten_with_path(getattr(state, field))[0]:
      if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
      if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        leaf = multihost_utils.process_allgather(leaf, tiled=True)
      out[field + jax.tree_util.keystr(path)] = np.asarray(leaf)
  return out
