"""Training the tiny Llama on a mesh, with microbatches or a pipeline: shared by tests and workers.

Workers of the multi-process tests import this too, so it must not assume
pytest or a device count.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax

import distrib_train as dt
from distrib_train import microbatches as microbatching
from distrib_train.recipes import llama, moe

BATCH, LENGTH = 16, 64


def tiny_config(**overrides) -> llama.LlamaConfig:
  """The tiny Llama, or with ``family="moe"`` the tiny mixture of experts, with fields overridden."""
  family = overrides.pop("family", "llama")
  return dataclasses.replace((moe.PRESETS if family == "moe" else llama.PRESETS)["tiny"], **overrides)


def _loss_of(config):
  return moe.loss_fn if isinstance(config, moe.MoEConfig) else llama.loss_fn


def mesh_of(axes: dict, devices=None, dcn: dict | None = None) -> jax.sharding.Mesh:
  """A mesh with data, fsdp and tensor axes (size 1 unless given) and any others in ``axes``."""
  sizes = {"data": 1, "fsdp": 1, "tensor": 1, **axes}
  n = int(np.prod(list(sizes.values())))
  spec = {
    name: ({"ici": size // (dcn or {}).get(name, 1), "dcn": (dcn or {}).get(name, 1)}) for name, size in sizes.items()
  }
  config = dt.MeshConfig.from_dict(
    {
      "axes": spec,
      "rules": "fsdp_tensor",
      "devices": n,
      **({"granules": int(np.prod(list(dcn.values())))} if dcn else {}),
    }
  )
  return dt.build_mesh(config, list(jax.devices())[:n] if devices is None else devices)


def batches(steps: int, packed: bool = False, seed: int = 0) -> list[dict[str, np.ndarray]]:
  """Deterministic token batches; ``packed``: two documents per row and padding (segment 0)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    tokens = rng.integers(0, 256, (BATCH, LENGTH)).astype(np.int32)
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1)}
    if packed:
      cut = rng.integers(8, LENGTH - 8, BATCH)
      pad = rng.integers(LENGTH - 16, LENGTH + 1, BATCH)  # rows hold different token counts
      col = np.arange(LENGTH)[None, :]
      segments = np.where(col < cut[:, None], 1, 2) * (col < pad[:, None])
      positions = np.where(col < cut[:, None], col, col - cut[:, None]) * (col < pad[:, None])
      batch.update(segment_ids=segments.astype(np.int32), positions=positions.astype(np.int32))
    out.append(batch)
  return out


def _plan(config, mesh, inputs, edit=None):
  rules = dt.AxisRules("fsdp_tensor")

  def make():
    model = config.build(0)
    if edit is not None:
      edit(model)
    return dt.TrainState.initial_state(model, optax.sgd(0.5, momentum=0.9), jax.random.key(0))

  input_axes = {k: llama.INPUT_AXES[k] for k in inputs}
  plan = dt.MeshPlanner(mesh, rules).plan(
    jax.eval_shape(make), loss_fn=_loss_of(config), inputs=inputs, input_axes=input_axes
  )
  return rules, plan, plan.init(make)


def train(
  mesh,
  steps: int = 10,
  microbatches: int = 1,
  repeats: int = 1,
  packed: bool = False,
  weight: str | None = "tokens",
  aux: list | None = None,
  final: list | None = None,
  edit=None,
  local_states: list | None = None,
  **config,
) -> tuple[list[float], dict]:
  """Losses of ``steps`` steps of the tiny Llama (fp32, SGD with momentum: linear in the gradients, so float
  noise stays noise) and its final params as numpy (``final`` gets the last train state, ``local_states`` each
  step's local state as numpy; ``edit(model)`` changes the model before its state is made)."""
  cfg = tiny_config(**config)
  data = batches(steps, packed)
  rules, plan, state = _plan(cfg, mesh, data[0], edit)
  step = dt.build_train_step_fn(
    _loss_of(cfg),
    donate_params_and_state=True,
    train_state_shardings=plan.train_state_shardings,
    input_kwarg_shardings=plan.input_kwarg_shardings,
    aux_output_shardings=plan.aux_output_shardings,
    microbatches=microbatches,
    pipeline_repeats=repeats,
    microbatch_weight=weight,
  )
  losses = []
  with dt.activation_sharding(mesh, rules):
    for batch in data:
      placed = {
        k: jax.make_array_from_callback(v.shape, plan.input_kwarg_shardings[k], lambda i, v=v: v[i])
        for k, v in batch.items()
      }
      state, out = step(state, **placed)
      losses.append(float(out["loss"]))
      if aux is not None:
        aux.append({k: float(v) for k, v in out.items()})
      if local_states is not None:
        local_states.append(_numpy(state.local_state))
  if final is not None:
    final.append(state)
  return losses, _numpy(state.params)


def _numpy(tree) -> dict:
  from jax.experimental import multihost_utils

  gathered = multihost_utils.process_allgather(tree, tiled=True) if jax.process_count() > 1 else tree
  return {
    "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
    for path, v in jax.tree_util.tree_leaves_with_path(dt.models.to_pure_dict(gathered))
  }


def gradients(mesh, microbatches: int = 1, repeats: int = 1, packed: bool = False, **config) -> dict:
  """The loss's gradient for every parameter on ``mesh`` (through the pipeline when it has a stage axis)."""
  cfg = tiny_config(**config)
  batch = batches(1, packed)[0]
  rules, plan, state = _plan(cfg, mesh, batch)
  model_without_params = state.model_without_params

  def loss(params, inputs):
    model = dt.models.merge_model(model_without_params, params, state.local_state)
    return _loss_of(cfg)(model=model, state=None, rng=None, **inputs)[0]

  context = (
    microbatching.pipelining(microbatching.Pipelining(mesh, microbatches, repeats))
    if microbatching.stages_of(mesh) > 1
    else dt.activation_sharding(mesh, rules)
  )
  grad = jax.jit(jax.grad(loss), in_shardings=(plan.train_state_shardings.params, plan.input_kwarg_shardings))
  placed = {
    k: jax.make_array_from_callback(v.shape, plan.input_kwarg_shardings[k], lambda i, v=v: v[i])
    for k, v in batch.items()
  }  # each process its own shards (a mesh across processes too)
  with dt.activation_sharding(mesh, rules), context:
    return _numpy(grad(state.params, placed))
