"""The refusals of a config against the mesh plan it runs on, each with a sentence that says what to do.

- ``check_every_axis_is_used``: no mesh axis of size > 1 that no rule maps onto (a typo such as ``contxt``).
- ``check_batch_is_split``: the global batch divides over the batch rule's mesh axes.
- ``check_microbatches``: the microbatches and the pipeline's repeats the batch and the stage axis can make.
- ``check_context``: the sequence splits into the context axis's load-balanced chunks.
- ``check_fp8``: FP8's delayed scaling is not asked of a pipeline.

The trainer runs them before its workdir is written to; ``mesh_config: auto``'s search runs the last three on each
candidate. Each raises ``ValueError``.

Not for: checks across a config's own fields (``checks.py``).
"""

from __future__ import annotations

import math

import jax

from distrib_train.microbatches import Pipelining, stages_of


def check_every_axis_is_used(mesh: jax.sharding.Mesh, rules, rule_set: str) -> None:
  """Refuses a mesh axis of size > 1 that no rule maps anything onto (a typo
  such as ``contxt``): the job would run replicated along it."""
  unused = [
    f"{name} (size {size})" for name, size in mesh.shape.items() if size > 1 and name not in rules.mesh_axis_names
  ]
  if unused:
    raise ValueError(
      f"Mesh axis {', '.join(unused)} is used by no axis rule in {rule_set}, so every array would be replicated"
      f" along it; rules map onto {', '.join(sorted(rules.mesh_axis_names)) or 'no axis'}. Fix the axis name,"
      " add a rule for it, or give it size 1."
    )


def check_batch_is_split(plan, rules, global_batch_size: int) -> None:
  """Refuses a global batch the batch rule's mesh axes do not divide (the
  planner would replicate the batch, each device computing all of it)."""
  sizes = plan.mesh.shape
  wanted = next((axes for logical, axes in rules.rules if logical == "batch"), None) or ()
  wanted = [a for a in wanted if a in sizes]
  ways = math.prod(sizes[a] for a in wanted)
  spec = plan.input_kwarg_shardings["tokens"].spec
  got = spec[0] if len(spec) else None
  got_ways = math.prod(sizes[a] for a in ((got,) if isinstance(got, str) else tuple(got or ())))
  if got_ways < ways and global_batch_size % ways:
    split = " × ".join(f"{a}={sizes[a]}" for a in wanted)
    raise ValueError(
      f"data.global_batch_size {global_batch_size} does not divide over the mesh's batch axes {split} = {ways};"
      f" the batch would be {'replicated' if got_ways == 1 else f'split only {got_ways} ways'}, every device"
      f" computing {'all' if got_ways == 1 else 'more'} of it. Use a multiple of {ways}, or set"
      " data.allow_replicated_batch=true."
    )


def check_microbatches(plan, global_batch_size: int, microbatches: int, pipeline_repeats: int) -> None:
  """Refuses microbatches the global batch, or its split over the batch axes, cannot make: a microbatch's
  rows must come evenly from every device holding part of the batch (``microbatches.split``)."""
  sizes = plan.mesh.shape
  if stages_of(plan.mesh) > 1:
    Pipelining(plan.mesh, microbatches, pipeline_repeats).check()
  elif pipeline_repeats > 1:
    raise ValueError(
      f"train.pipeline_repeats is {pipeline_repeats}, but the mesh has no stage axis of size > 1"
      " (mesh " + " × ".join(f"{k}={v}" for k, v in sizes.items()) + "); set it to 1 or add a"
      " stage axis to the mesh config."
    )
  if microbatches == 1:
    return
  if global_batch_size % microbatches:
    raise ValueError(
      f"data.global_batch_size {global_batch_size} does not split into train.microbatches"
      f" {microbatches} equal microbatches; use a multiple of {microbatches}."
    )
  spec = plan.input_kwarg_shardings["tokens"].spec
  got = spec[0] if len(spec) else None
  axes = (got,) if isinstance(got, str) else tuple(got or ())
  ways = math.prod(sizes[a] for a in axes)
  rows = global_batch_size // microbatches
  if rows % ways:
    split = " × ".join(f"{a}={sizes[a]}" for a in axes)
    raise ValueError(
      f"A microbatch of data.global_batch_size {global_batch_size} / train.microbatches"
      f" {microbatches} = {rows} rows does not divide over the batch axes {split} = {ways}; use a"
      f" global batch that is a multiple of {microbatches * ways} or fewer microbatches."
    )


def check_context(plan, seq_len: int) -> None:
  """Refuses a sequence length the context axis cannot split into its load-balanced chunks
  (``sharding/context.py``: 2 × context chunks)."""
  size = int(dict(plan.mesh.shape).get("context", 1))
  if size > 1 and seq_len % (2 * size):
    raise ValueError(
      f"data.seq_len {seq_len} does not split over the context axis ({size}): it must be a multiple"
      f" of 2 × context = {2 * size} (each device holds a front and a back chunk of every sequence)."
    )


def check_fp8(plan, fp8_mode: str) -> None:
  """Refuses ``model.fp8=delayed`` on a mesh with a stage axis: a pipeline runs each layer once per
  microbatch (and in bubble slots), so a layer's amax history would be written several times in one step."""
  stages = stages_of(plan.mesh)
  if fp8_mode == "delayed" and stages > 1:
    raise ValueError(
      f"model.fp8=delayed does not run with a stage axis ({stages} stages): the pipeline runs every"
      " layer once per microbatch, and each run would write the layer's amax history. Use"
      " model.fp8=current with a pipeline."
    )
