"""Framework overhead on CPU: ``build_train_step_fn``'s step against a raw ``jax.jit``.

Run from the repository root:

  python bench/overhead.py                 # 1 CPU device
  python bench/overhead.py --devices 8     # 8 emulated CPU devices, batch split over them

The tiny Llama (d 64, 2 layers, byte vocabulary, float32) trains on one
fixed batch three ways, in one process:
- framework, jit: planner → sharded init → ``build_train_step_fn`` with
  donation and the plan's shardings, called as ``step(state, **batch)``;
- framework, AOT: the same step after ``step.compile(...)``, as the trainer
  runs it;
- raw: the same computation — the model merged from its params, the same
  loss function, ``jax.grad``, the same ``optax.adamw`` update, the step key
  folded in — under one ``jax.jit`` with the same shardings and donation,
  called directly with the state's arrays.
Each round times ``--window`` steps of each, in an order that rotates every
round; blocked every step (``window 1``: the wrapper's Python time is fully
exposed) and in windows of 10 dispatched back to back (the wrapper overlaps
the previous step). The figure is the ratio framework / raw
(target ≤ 1.02), taken round by round (each round's ratio, then the median
over rounds) so that load on the host, which drifts, cancels. Not for: GPU
throughput (``bench/train_throughput.py``).
"""

import argparse
import os
import statistics
import sys
import time

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
  sys.path.insert(0, _REPO_ROOT)


def _parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=1, help="emulated CPU devices (the mesh's data axis)")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq_len", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=100, help="timed rounds per mode (median over rounds)")
  parser.add_argument("--windows", default="1,10", help="steps per timed sample, one mode each")
  return parser.parse_args()


ARGS = _parse_args()
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.devices}"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import distrib_train as dt  # noqa: E402


class FrameworkStep:
  """The framework's step and its state; ``aot`` compiles it ahead of time first."""

  def __init__(self, recipe, planner, make_state, batch_shapes, tokens, targets, aot):
    self.name = "framework (AOT)" if aot else "framework (jit)"
    self.state, self.plan = planner.init(
      make_state, loss_fn=recipe.loss_fn, inputs=batch_shapes, input_axes=recipe.input_axes
    )
    self.batch = {
      "tokens": jax.device_put(tokens, self.plan.input_kwarg_shardings["tokens"]),
      "targets": jax.device_put(targets, self.plan.input_kwarg_shardings["targets"]),
    }
    self.step_fn = dt.build_train_step_fn(
      recipe.loss_fn,
      donate_params_and_state=True,
      train_state_shardings=self.plan.train_state_shardings,
      input_kwarg_shardings=self.plan.input_kwarg_shardings,
      aux_output_shardings=self.plan.aux_output_shardings,
    )
    if aot:
      self.step_fn.compile(self.state, **self.batch)
    self.aux = None

  def step(self):
    self.state, self.aux = self.step_fn(self.state, **self.batch)

  def block(self):
    jax.block_until_ready((self.state.params, self.state.opt_state, self.aux))


class RawStep:
  """The same step as one hand-made ``jax.jit``: no TrainState, no wrapper."""

  name = "raw jax.jit"

  def __init__(self, recipe, optimizer, framework: FrameworkStep):
    graphdef, _, rest = nnx.split(recipe.config.build(0), nnx.Param, ...)
    loss_fn = recipe.loss_fn

    def raw_step(params, opt_state, root_rng, step, tokens, targets):
      step_rng = jax.random.fold_in(root_rng, step)

      def loss_of(current):
        loss, _, aux = loss_fn(
          model=nnx.merge(graphdef, current, rest), state=None, rng=step_rng, tokens=tokens, targets=targets
        )
        return loss, aux

      grads, aux = jax.grad(loss_of, has_aux=True)(params)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, aux

    shardings = framework.plan.train_state_shardings
    inputs = framework.plan.input_kwarg_shardings
    self._jitted = jax.jit(
      raw_step,
      donate_argnums=(0, 1),
      in_shardings=(shardings.params, shardings.opt_state, None, None, inputs["tokens"], inputs["targets"]),
      out_shardings=(shardings.params, shardings.opt_state, framework.plan.aux_output_shardings),
    )
    # Start from the framework's initial values (copies: the framework donates its own).
    self.params = jax.tree_util.tree_map(jnp.copy, framework.state.params)
    self.opt_state = jax.tree_util.tree_map(jnp.copy, framework.state.opt_state)
    self.root_rng, self.step_count = framework.state.root_rng, 0
    self.tokens, self.targets = framework.batch["tokens"], framework.batch["targets"]
    self.aux = None

  def step(self):
    self.params, self.opt_state, self.aux = self._jitted(
      self.params, self.opt_state, self.root_rng, self.step_count, self.tokens, self.targets
    )
    self.step_count += 1

  def block(self):
    jax.block_until_ready((self.params, self.opt_state, self.aux))


def main():
  recipe = dt.recipes.get("llama", "tiny", loss_chunk_size=ARGS.seq_len)
  optimizer = optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)
  mesh = dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (-1, 1, 1)))
  planner = dt.MeshPlanner(mesh, "fsdp_tensor")
  make_state = lambda: dt.TrainState.initial_state(recipe.config.build(0), optimizer, jax.random.key(0))
  rng = np.random.default_rng(0)
  data = rng.integers(0, recipe.config.vocab_size, (ARGS.batch, ARGS.seq_len + 1), dtype=np.int32)
  tokens, targets = data[:, :-1], data[:, 1:]
  shapes = {
    "tokens": jax.ShapeDtypeStruct(tokens.shape, jnp.int32),
    "targets": jax.ShapeDtypeStruct(targets.shape, jnp.int32),
  }
  framework_jit = FrameworkStep(recipe, planner, make_state, shapes, tokens, targets, aot=False)
  framework_aot = FrameworkStep(recipe, planner, make_state, shapes, tokens, targets, aot=True)
  raw = RawStep(recipe, optimizer, framework_jit)
  variants = [framework_jit, framework_aot, raw]

  losses = {}
  for variant in variants:  # compile (where not done) and warm up
    for _ in range(3):
      variant.step()
      variant.block()
    losses[variant.name] = float(variant.aux["loss"])
  print(
    f"{jax.device_count()} CPU device(s) ({'emulated, ' if jax.device_count() > 1 else ''}data axis), "
    f"{os.cpu_count()} cores; tiny Llama {recipe.config.num_params():,} params, batch {ARGS.batch} × "
    f"{ARGS.seq_len}; jax {jax.__version__}; loss after 3 steps: "
    + ", ".join(f"{name} {loss:.4f}" for name, loss in losses.items()),
    flush=True,
  )

  for window in (int(w) for w in ARGS.windows.split(",")):
    seconds = {variant.name: [] for variant in variants}
    dispatch = {variant.name: [] for variant in variants}  # until the call returns, before the result is ready
    for i in range(ARGS.rounds):
      for variant in variants[i % 3 :] + variants[: i % 3]:
        start = time.perf_counter()
        for _ in range(window):
          variant.step()
        dispatched = time.perf_counter()
        variant.block()
        seconds[variant.name].append((time.perf_counter() - start) / window)
        dispatch[variant.name].append((dispatched - start) / window)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    mode = "blocked every step" if window == 1 else f"windows of {window} steps, blocked at the end"
    print(f"{mode} ({ARGS.rounds} rounds; median ms/step; call: until the call returns):", flush=True)
    for variant in variants:
      name = variant.name
      ratio = ""
      if variant is not raw:
        # Each round times the variants back to back: the ratio within a round
        # cancels the load drift that the medians of separate series do not.
        paired = sorted(a / b for a, b in zip(seconds[name], seconds[raw.name]))
        quartiles = statistics.quantiles(paired, n=4)
        # Load only ever adds time: the fastest decile is the least disturbed.
        fast = statistics.quantiles(seconds[name], n=10)[0] / statistics.quantiles(seconds[raw.name], n=10)[0]
        ratio = (
          f"  ratio {statistics.median(paired):.3f} (paired median; quartiles {quartiles[0]:.3f}–"
          f"{quartiles[2]:.3f}; of medians {median[name] / median[raw.name]:.3f}; of fastest deciles"
          f" {fast:.3f}; target ≤ 1.02)"
        )
      print(
        f"  {name:<16} {median[name] * 1e3:8.3f} ms  call {statistics.median(dispatch[name]) * 1e6:6.0f} µs{ratio}",
        flush=True,
      )


if __name__ == "__main__":
  main()
