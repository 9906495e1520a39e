"""Small models, losses and a training routine shared by tests and workers.

Workers of the multi-process tests import this too, so it must not assume
pytest or a device count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

import distrib_train as dt

# Logical axes for the MLP below: every weight is (embed, mlp), Megatron-style.
MLP_PARAM_AXES = ((r"\d+/w", ("embed", "mlp")), (r"\d+/b", ("mlp",)))


def init_mlp(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros((b,))}
    for k, a, b in zip(keys, sizes[:-1], sizes[1:])
  ]


def apply_mlp(layers, x):
  for i, layer in enumerate(layers):
    x = x @ layer["w"] + layer["b"]
    if i < len(layers) - 1:
      x = jax.nn.relu(x)
  return x


def classification_loss(*, model, state, rng, inputs, targets):
  """A penzai-style loss: the loss is scaled by 1 + uniform(rng)."""
  logits = apply_mlp(model, inputs)
  scale = 1 + jax.random.uniform(rng, ())
  loss = scale * jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))
  return loss, state + 1, {"loss": loss, "count": state}


SIZES = [16, 64, 64, 8]
BATCH = 32


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
  """The global batch for a step, the same in every process."""
  rng = np.random.default_rng(step)
  x = rng.normal(size=(BATCH, SIZES[0])).astype(np.float32)
  y = (x[:, :8].argmax(-1)).astype(np.int32)
  return x, y


def make_state() -> dt.TrainState:
  return dt.TrainState.initial_state(
    init_mlp(jax.random.key(0), SIZES), optax.adam(1e-2), jax.random.key(42), loss_fn_state=jnp.int32(0)
  )


def to_global(value: np.ndarray, sharding) -> jax.Array:
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def train_small_model(mesh, steps: int = 10) -> tuple[list[float], dict[str, np.ndarray]]:
  """Trains the MLP on ``mesh`` through planner → sharded init → donated step.

  Returns the losses and the final params gathered as numpy arrays.
  """
  planner = dt.MeshPlanner(mesh, dt.AxisRules("fsdp_tensor", param_axes=MLP_PARAM_AXES))
  x, y = batch(0)
  example = {"inputs": jax.ShapeDtypeStruct(x.shape, x.dtype), "targets": jax.ShapeDtypeStruct(y.shape, y.dtype)}
  state, plan = planner.init(make_state, inputs=example, loss_fn=classification_loss)
  step_fn = dt.build_train_step_fn(
    classification_loss,
    donate_params_and_state=True,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
  )
  losses = []
  for i in range(steps):
    x, y = batch(i)
    state, aux = step_fn(
      state,
      inputs=to_global(x, plan.input_kwarg_shardings["inputs"]),
      targets=to_global(y, plan.input_kwarg_shardings["targets"]),
    )
    losses.append(float(aux["loss"]))
  params = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in state.params.items()}
  return losses, params


def post_training_losses(overrides: list[str], mesh, steps: int = 3) -> list[dict[str, float]]:
  """A reference model's steps on ``mesh`` with the config ``tiny`` + ``overrides`` (SFT or DPO), each process
  feeding its rows from the config's ``DataLoader``: each step's loss and its other aux scalars."""
  from distrib_train.config import run as config_lib

  config = config_lib.load(
    "tiny",
    ["model.dtype=float32", "model.attention=xla", "optimizer.name=adamw", "optimizer.learning_rate=1e-2", *overrides],
  )
  return config_steps(config, mesh, steps)[0]


def config_steps(config, mesh, steps: int = 3) -> tuple[list[dict[str, float]], dt.TrainState]:
  """``steps`` of the job ``config`` describes on ``mesh`` (planned, sharded, its ``DataLoader`` feeding each
  process its rows): each step's aux scalars, and the last state."""
  from distrib_train import data
  from distrib_train.sharding.axis_rules import activation_sharding
  from distrib_train.config import job as job_lib

  job = job_lib.job_spec(config)
  planner = dt.MeshPlanner(mesh, config.train.rules)
  plan = job_lib.plan_job(job, planner)
  step = dt.build_train_step_fn(
    job.loss_fn,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    **job_lib.step_options(job, plan, planner.rules),
  )
  state, out = plan.init(job.make_state), []
  with (
    data.DataLoader(config.data_config(), plan.input_kwarg_shardings) as loader,
    activation_sharding(mesh, planner.rules),
  ):
    for _ in range(steps):
      state, aux = step(state, **next(loader))
      out.append({k: float(np.asarray(v.addressable_data(0))) for k, v in aux.items() if np.ndim(v) == 0})
  return out, state
