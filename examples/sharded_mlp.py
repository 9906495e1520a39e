"""A sharded training run on 8 emulated CPU devices, using only the public API.

Run from the repository root:

  python examples/sharded_mlp.py

Steps: a mesh from mesh_configs/cpu-8.yaml (data 2 × fsdp 2 × tensor 2) →
a penzai-style loss → MeshPlanner → sharded init → donated, sharded step.
"""

import os
import pathlib

# Emulated devices must be requested before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import distrib_train as dt  # noqa: E402

MESH_CONFIG = pathlib.Path(__file__).resolve().parents[1] / "mesh_configs" / "cpu-8.yaml"


def init_model(key):
  """A 3-layer MLP as a plain pytree: a list of {"w", "b"} dicts."""
  sizes = [32, 128, 128, 10]
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)} for k, a, b in zip(keys, sizes[:-1], sizes[1:])
  ]


def loss_fn(*, model, state, rng, images, labels):
  """penzai's loss contract: returns (loss, new_state, aux)."""
  x = images
  for i, layer in enumerate(model):
    x = x @ layer["w"] + layer["b"]
    if i < len(model) - 1:
      x = jax.nn.relu(jax.random.bernoulli(jax.random.fold_in(rng, i), 0.9, x.shape) * x / 0.9)  # dropout
  loss = optax.softmax_cross_entropy_with_integer_labels(x, labels).mean()
  return loss, state + 1, {"loss": loss, "steps_seen": state}


def make_state():
  return dt.TrainState.initial_state(
    model=init_model(jax.random.key(0)),
    optimizer_def=optax.adamw(3e-3),
    root_rng=jax.random.key(42),
    loss_fn_state=jnp.int32(0),
  )


def main():
  config = dt.MeshConfig.from_yaml(MESH_CONFIG)
  mesh = dt.build_mesh(config)
  # Name the weights' dimensions; config.rules map the names onto the mesh.
  rules = config.rules.with_param_axes([(r"\d+/w", ("embed", "mlp")), (r"\d+/b", ("mlp",))])
  planner = dt.MeshPlanner(mesh, rules)

  batch = {"images": jax.ShapeDtypeStruct((64, 32), jnp.float32), "labels": jax.ShapeDtypeStruct((64,), jnp.int32)}
  state, plan = planner.init(make_state, loss_fn=loss_fn, inputs=batch)
  print(plan.report())

  train_step = dt.build_train_step_fn(
    loss_fn,
    donate_params_and_state=True,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
  )
  rng = np.random.default_rng(0)
  centers = rng.normal(size=(10, 32)).astype(np.float32)
  for step in range(30):
    labels = rng.integers(0, 10, size=64).astype(np.int32)
    images = centers[labels] + 0.5 * rng.normal(size=(64, 32)).astype(np.float32)
    images = jax.device_put(images, plan.input_kwarg_shardings["images"])
    labels = jax.device_put(labels, plan.input_kwarg_shardings["labels"])
    state, aux = train_step(state, images=images, labels=labels)
    if step % 10 == 0 or step == 29:
      print(f"step {step:2d}  loss {float(aux['loss']):.4f}")
  w = state.params["1/w"]
  print(f"1/w {w.shape} is split over {tuple(w.sharding.spec)}; each device holds {w.addressable_shards[0].data.shape}")


if __name__ == "__main__":
  main()
