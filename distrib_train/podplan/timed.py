"""A layout's measured step: the trainer's step run on the job's own devices, a few times, and timed.

``mesh_config: auto`` on an accelerator (``auto.py``) ranks its compiled finalists by ``measure``: the train
state initialised on the candidate's mesh (real memory), a batch of random tokens shaped as the data pipeline
yields (``DataLoader.batch_schema``), the step built as the trainer builds it (donation, the plan's
shardings, the job's microbatches; compiled in the first step), ``warmup`` steps run and then ``steps`` steps
timed one by one with ``block_until_ready``. The figure is the median. Every process runs the same steps (the
step's collectives span them); each measures its own clock, and the search takes process 0's.

A step the device cannot hold (out of memory at run time, though it compiled) is an ``OutOfMemory``: the
search drops that candidate.

Not for: estimates without running (``estimate.py``, ``timing.py``); throughput benchmarks (``bench/``).
"""

from __future__ import annotations

import gc
import statistics
import time

import jax
import numpy as np

from distrib_train.podplan.estimate import plan_state, step_spec
from distrib_train.sharding.mesh import MeshConfig, build_mesh
from distrib_train.config.run import Config
from distrib_train.train_step import build_train_step_fn
from distrib_train.cluster.device_memory import out_of_memory_message
from distrib_train.config.job import rules_for, step_options


class OutOfMemory(RuntimeError):
  """The candidate's step ran out of device memory when it ran."""


def _batch(spec, plan, vocab: int, seed: int = 0) -> dict[str, jax.Array]:
  """Random tokens (the same on every process), whole documents, in the plan's input shardings."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, x in spec.inputs.items():
    if name in ("tokens", "targets"):
      value = rng.integers(0, vocab, x.shape, dtype=np.int64).astype(x.dtype)
    elif name == "positions":
      value = np.broadcast_to(np.arange(x.shape[-1], dtype=x.dtype), x.shape)
    elif name == "reference_logps":
      value = np.zeros(x.shape, x.dtype)
    else:  # weights, segment_ids: one document per row, every target counted
      value = np.ones(x.shape, x.dtype)
    sharding = plan.input_kwarg_shardings[name]
    out[name] = jax.make_array_from_callback(x.shape, sharding, lambda index, v=value: v[index])
  return out


def measure(config: Config, mesh_config: MeshConfig, *, steps: int = 5, warmup: int = 2) -> float:
  """Seconds per step (the median of ``steps``) of ``config``'s train step on ``mesh_config`` over this job's
  devices.

  Raises:
    OutOfMemory: the device could not hold the state or the step's temporaries.
  """
  platform = jax.devices()[0].platform
  spec = step_spec(config, platform)
  rules = rules_for(config, mesh_config)
  state = batch = None
  refusal = ""
  try:
    plan = plan_state(spec, build_mesh(mesh_config), rules)
    step = build_train_step_fn(
      spec.loss_fn,
      donate_params_and_state=True,
      train_state_shardings=plan.train_state_shardings,
      input_kwarg_shardings=plan.input_kwarg_shardings,
      aux_output_shardings=plan.aux_output_shardings,
      **step_options(spec, plan, rules),
    )
    vocab = spec.family.vocab_size or 256
    state = plan.init(spec.make_state)
    batch = _batch(spec, plan, vocab)
    seconds = []
    for number in range(warmup + steps):
      start = time.perf_counter()
      state, _ = step(state, **batch)
      jax.block_until_ready(state)
      if number >= warmup:
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)
  except Exception as e:  # jax's XlaRuntimeError / JaxRuntimeError
    if out_of_memory_message(e, None) is None:
      raise
    refusal = f"{mesh_config.source}: {str(e).splitlines()[0][:300]}"  # raised below, once the arrays are freed
  finally:
    state = batch = step = None
    gc.collect()
    jax.clear_caches()
  gc.collect()  # the refused step's traceback is gone now, and the arrays its frames held with it
  raise OutOfMemory(refusal)
