"""Multi-token prediction's loss, aux and gradients on a mesh: shared by tests/test_mtp.py and its worker.

Workers of the multi-process tests import this too, so it must not assume pytest or a device count.
"""

from __future__ import annotations

import jax
import numpy as np

import distrib_train as dt
import pipeline_helpers as ph

BATCH, LENGTH = 8, 32


def batch(packed: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
  """Rows of random tokens; ``packed``: up to three documents a row then padding (segment 0), and an SFT-like loss
  mask (``weights``: 0 across a document's end, on the padding and on a fifth of the rest)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 256, (BATCH, LENGTH)).astype(np.int32)
  out = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1)}
  if not packed:
    return out
  col = np.arange(LENGTH)[None, :]
  first, second = rng.integers(3, 12, BATCH), rng.integers(14, 24, BATCH)
  end = rng.integers(LENGTH - 6, LENGTH + 1, BATCH)
  segments = (1 + (col >= first[:, None]) + (col >= second[:, None])) * (col < end[:, None])
  starts = np.where(col >= second[:, None], second[:, None], np.where(col >= first[:, None], first[:, None], 0))
  same = np.concatenate([segments[:, 1:] == segments[:, :-1], np.zeros((BATCH, 1), bool)], axis=1) & (segments > 0)
  out.update(
    segment_ids=segments.astype(np.int32),
    positions=((col - starts) * (segments > 0)).astype(np.int32),
    weights=(same & (rng.random((BATCH, LENGTH)) < 0.8)).astype(np.float32),
  )
  return out


def loss_and_gradients(mesh, packed: bool = True, **config) -> tuple[dict[str, float], dict[str, np.ndarray]]:
  """The tiny model's (``ph.tiny_config(**config)``) aux scalars and gradients on ``batch(packed)``, on ``mesh``
  (each process feeding its own shards)."""
  cfg = ph.tiny_config(**config)
  data = batch(packed)
  rules, plan, state = ph._plan(cfg, mesh, data)
  model_without_params, loss_fn = state.model_without_params, ph._loss_of(cfg)

  def loss(params, inputs):
    model = dt.models.merge_model(model_without_params, params, state.local_state)
    value, _, aux = loss_fn(model=model, state=None, rng=None, **inputs)
    return value, aux

  step = jax.jit(
    jax.value_and_grad(loss, has_aux=True), in_shardings=(plan.train_state_shardings.params, plan.input_kwarg_shardings)
  )
  placed = {
    k: jax.make_array_from_callback(v.shape, plan.input_kwarg_shardings[k], lambda i, v=v: v[i])
    for k, v in data.items()
  }
  with dt.activation_sharding(mesh, rules):
    (_, aux), grads = step(state.params, placed)
  figures = {k: float(np.asarray(v.addressable_data(0))) for k, v in aux.items() if np.ndim(v) == 0}
  return figures, ph._numpy(grads)
