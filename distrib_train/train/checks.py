"""The refusals a run makes at start-up, each with a sentence that says what to do.

- ``check_workdir``: the workdir can be a writable directory (nothing is
  created to find out); ``check_path_components`` for any path.
- ``check_every_axis_is_used``: no mesh axis of size > 1 that no rule maps
  onto (a typo such as ``contxt``).
- ``check_batch_is_split``: the global batch divides over the batch rule's
  mesh axes.
- ``check_same_tokenizer``: a run that resumes tokenizes as the checkpoint's
  run did.
- ``check_token_ids``: the first batch's ids are inside the model's
  vocabulary.
- ``check_step_fits``: the compiled step fits the GPU's memory (after
  compiling, before the first step); ``out_of_memory_message`` says the
  same for an out-of-memory error mid-run.

All but the last run before the workdir is written to; all raise
``ValueError`` (``TrainerSetupError`` for the first batch), which the trainer
reports as a ``TrainerSetupError``.

Not for: config values (``config.py``) or the data source's own checks
(``data/``).
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from distrib_train.microbatches import Pipelining, stages_of

NAME_MAX = 255  # bytes in one path component on Linux, macOS and GCS-fuse alike


class TrainerSetupError(ValueError):
  """The run cannot start (mesh, data or plan problem); raised before the
  workdir is written to, but for token ids outside the vocabulary found in
  the first batch (before any step; ``config.yaml`` and ``plan.txt`` exist)."""


def check_path_components(path: pathlib.Path, what: str) -> None:
  """Refuses a path with a component longer than file systems allow (else
  ``exists()`` itself raises ``File name too long`` deep in the setup)."""
  for component in path.parts:
    size = len(os.fsencode(component))
    if size > NAME_MAX:
      raise ValueError(
        f"{what} {str(path)[:60]!r}…: the path component {component[:40]!r}… is {size} bytes;"
        f" a file or directory name may have at most {NAME_MAX}."
      )


def check_workdir(workdir: pathlib.Path) -> None:
  """Fails, creating nothing, when ``workdir`` cannot be a writable directory."""
  check_path_components(workdir, "Workdir")
  existing = workdir
  while not existing.exists() and existing != existing.parent:
    existing = existing.parent
  if not existing.is_dir():
    where = "is a file" if existing == workdir else f"cannot be created: {str(existing)!r} is a file"
    raise ValueError(f"Workdir {str(workdir)!r} {where}; give a directory.")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"Workdir {str(workdir)!r} cannot be written: no write permission on {str(existing)!r}.")


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


_extremes = jax.jit(lambda x: jnp.stack([jnp.min(x), jnp.max(x)]))


def local_value(x: jax.Array) -> np.ndarray:
  """A replicated array's value from this process's first shard."""
  return np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x)


def check_token_ids(batch: Mapping[str, jax.Array], vocab_size: int | None) -> None:
  """Refuses a first batch whose ids fall outside the model's vocabulary
  (every process computes the same global extremes).

  Raises:
    TrainerSetupError: an id below 0 or at or beyond ``vocab_size``.
  """
  if vocab_size is None:
    return
  for name in ("tokens", "targets"):
    if name not in batch:
      continue
    low, high = (int(v) for v in local_value(_extremes(batch[name])).tolist())
    if high >= vocab_size or low < 0:
      bad = high if high >= vocab_size else low
      raise TrainerSetupError(
        f"The first batch's {name} hold token id {bad}, outside the model's vocabulary of {vocab_size}"
        f" ids (0 to {vocab_size - 1}); use a tokenizer that matches the model or a larger"
        " model.vocab_size."
      )


def tokenizer_fingerprint(data_config) -> dict:
  """What a checkpoint records of the run's tokenizer (``data/tokenizer.py``)."""
  if not isinstance(data_config.tokenizer, str):
    return {"spec": data_config.tokenizer_name()}
  from distrib_train.data import tokenizer as tokenizer_lib

  return tokenizer_lib.load(data_config.tokenizer, data_config.bos_token, data_config.eos_token).fingerprint


def check_same_tokenizer(meta: Mapping, fingerprint: Mapping, where: str) -> None:
  """Refuses to resume a run whose checkpoint was trained on other token ids.

  A checkpoint from before tokenizers were recorded was trained on bytes.
  """
  saved = meta.get("run", {}).get("tokenizer") or {
    "spec": "bytes",
    "sha256": "",
    "vocab_size": 256,
    "bos_id": None,
    "eos_id": None,
  }
  keys = ("spec", "sha256", "bos_id", "eos_id")
  if all(saved.get(k) == fingerprint.get(k) for k in keys if k in saved or k in fingerprint):
    return
  what = lambda f: (
    f"{f.get('spec')}"
    + (f" (sha256 {str(f.get('sha256'))[:12]}…)" if f.get("sha256") else "")
    + (
      f", BOS {f.get('bos_id')}, EOS {f.get('eos_id')}"
      if f.get("bos_id") is not None or f.get("eos_id") is not None
      else ""
    )
  )
  raise ValueError(
    f"{where} was trained with tokenizer {what(saved)}; this run names {what(fingerprint)}. Resume"
    " with the checkpoint's tokenizer, or start in a new workdir (fine-tuning from its weights)."
  )


# Memory a GPU step needs beyond its compiled figures: cuDNN's workspace (sized when a kernel first runs) and
# the autotuner's scratch, both taken from the same pool.
CUDNN_ALLOWANCE_BYTES = 1 << 30
CUDNN_ALLOWANCE_FRACTION = 0.03
MEMORY_LEVERS = (
  "lower data.global_batch_size, raise train.microbatches, set model.remat (dots_saveable or full),"
  " or shard the state over more devices (an fsdp axis in the mesh config)"
)


def step_memory_need(analysis, limit: int) -> tuple[int, int]:
  """``(need, allowance)``: the bytes a compiled step holds at its peak on one device (arguments, outputs
  that do not reuse them, temporaries) plus the allowance for cuDNN and autotuning, against a pool of
  ``limit`` bytes."""
  allowance = max(CUDNN_ALLOWANCE_BYTES, int(CUDNN_ALLOWANCE_FRACTION * limit))
  need = (
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
    + analysis.temp_size_in_bytes
  )
  return need + allowance, allowance


def check_step_fits(compiled, device) -> None:
  """Refuses a step that cannot fit ``device``'s memory pool (a GPU's ``bytes_limit``).

  Raises:
    TrainerSetupError: one sentence with the figures and the levers.
  """
  try:  # this process's device; some backends have no figures
    stats = device.memory_stats() if device.platform == "gpu" else None
    analysis = compiled.memory_analysis()
  except Exception:  # noqa: BLE001
    return
  if not stats or "bytes_limit" not in stats or analysis is None:
    return
  limit = int(stats["bytes_limit"])
  need, allowance = step_memory_need(analysis, limit)
  if need > limit:
    from distrib_train.common.text import human_bytes as size

    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75, JAX's default")
    raise TrainerSetupError(
      f"The train step does not fit {device.device_kind}: it needs {size(need)} per device (arguments"
      f" {size(analysis.argument_size_in_bytes)}, temporaries {size(analysis.temp_size_in_bytes)}, cuDNN and"
      f" autotuning {size(allowance)}) of the {size(limit)} JAX may use (XLA_PYTHON_CLIENT_MEM_FRACTION"
      f" {fraction}); {MEMORY_LEVERS}."
    )


def out_of_memory_message(error: BaseException, step: int | None) -> str | None:
  """One line for an out-of-memory error of a step (``None`` for any other error)."""
  text = str(error)
  if type(error).__name__ not in ("JaxRuntimeError", "XlaRuntimeError") or (
    "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower()
  ):
    return None  # not the device's (a storage service's RESOURCE_EXHAUSTED is not an out-of-memory)
  first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
  at = f" at step {step}" if step is not None else ""
  return f"the device ran out of memory{at} ({first[:200]}); the last checkpoint is intact. To fit: {MEMORY_LEVERS}."
