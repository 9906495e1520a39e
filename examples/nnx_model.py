"""Your own flax nnx model, sharded by its own annotations, on 8 CPU devices.

Run from the repository root:

  python examples/nnx_model.py

The model annotates its weights with logical axes (nnx.with_partitioning);
its BatchNorm statistics are local state that the step carries; Dropout
draws from the step's key. The loss function has penzai's contract.
"""

import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import distrib_train as dt  # noqa: E402

MESH_CONFIG = pathlib.Path(__file__).resolve().parents[1] / "mesh_configs" / "cpu-8.yaml"


class Classifier(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.hidden = nnx.Linear(32, 256, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
    self.norm = nnx.BatchNorm(256, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)
    self.out = nnx.Linear(256, 10, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(jax.nn.relu(self.norm(self.hidden(x)))))


def loss_fn(*, model, state, rng, images, labels):
  logits = model(images)  # BatchNorm statistics update; the step keeps them
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss, state, {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def make_state():
  return dt.TrainState.initial_state(
    model=Classifier(nnx.Rngs(params=0, dropout=1)),
    optimizer_def=optax.adamw(1e-3),
    root_rng=jax.random.key(42),
  )


def main():
  config = dt.MeshConfig.from_yaml(MESH_CONFIG)
  planner = dt.MeshPlanner(dt.build_mesh(config), config.rules)
  batch = {"images": jax.ShapeDtypeStruct((128, 32), jnp.float32), "labels": jax.ShapeDtypeStruct((128,), jnp.int32)}
  # planner.init builds the state under jit with the planned shardings; the
  # logical annotations are not applied eagerly while it does.
  state, plan = planner.init(make_state, loss_fn=loss_fn, inputs=batch)
  print(plan.report())
  shardings = dict(
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
  )
  train_step = dt.build_train_step_fn(loss_fn, donate_params_and_state=True, **shardings)
  eval_step = dt.build_eval_step_fn(loss_fn, **shardings)  # model.eval(): running stats, no dropout

  rng = np.random.default_rng(0)
  centers = rng.normal(size=(10, 32)).astype(np.float32)

  def batch_of(n):
    labels = rng.integers(0, 10, size=n).astype(np.int32)
    return {"images": centers[labels] + rng.normal(size=(n, 32)).astype(np.float32), "labels": labels}

  held_out = batch_of(128)
  for step in range(40):
    state, aux = train_step(state, **batch_of(128))
    if step % 10 == 9:
      evaluation = eval_step(state, **held_out)
      print(
        f"step {step + 1:2d}  train loss {float(aux['loss']):.4f}  eval accuracy {float(evaluation['accuracy']):.3f}"
      )
  mean = jax.tree_util.tree_leaves(state.local_state["norm"]["mean"])[0]
  kernel = jax.tree_util.tree_leaves(state.params["hidden"]["kernel"])[0]
  print(
    f"hidden/kernel {kernel.shape} split over {tuple(kernel.sharding.spec)}; "
    f"BatchNorm running mean (local state) starts {', '.join(f'{v:.3f}' for v in np.asarray(mean)[:3])}"
  )


if __name__ == "__main__":
  main()
