"""What a checkpoint directory holds, checked without writing anything.

The on-disk layout of a distrib_train checkpoint (format version, the saved
TrainState fields, the files orbax writes before it commits a step) and the
read-only checks on it: a step is complete, its metadata readable and of this
format version, and every array's path and shape matches a target state.
``check_restorable`` runs them before a run touches its directory;
``CheckpointManager.restore`` runs them before it reads any array.
``step_meta`` is what a step's ``meta`` JSON holds; ``read_meta`` reads it
back.

Nothing here unpickles or evaluates: metadata is read as JSON text, array
shapes from orbax's metadata files.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
from collections.abc import Collection, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec

from distrib_train.checkpoint.tree import flatten_fields, is_prng_key, unnest
from distrib_train.train_state import TrainState, state_fields

FORMAT_VERSION = 1
# The TrainState fields whose arrays a checkpoint holds (train_state.STATE_FIELDS),
# and those a params-only restore reads: the model's.
SAVED_FIELDS = state_fields(checkpointed=True)
MODEL_FIELDS = state_fields(checkpointed=True, roles=("trainable", "frozen", "model_state"))
# A run whose frozen weights all come from a named source (a LoRA base, a DPO reference read from ``hf:``)
# saves the rest; its steps' metadata lists the fields they hold and names the source.
FROZEN_FIELDS = state_fields(checkpointed=True, roles=("frozen",))

_VERSIONED_PACKAGES = ("distrib_train", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore")


def shape_of(x: Any) -> tuple[int, ...]:
  return tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)


class CheckpointError(ValueError):
  """A checkpoint that cannot be restored: missing, incomplete, unreadable,
  of another format version, or of another model. The message names the
  step directory (and the array or file) and what to do."""


# What every committed step holds: orbax writes them all before it commits
# (the data item is optional). One missing means a copy cut short or a
# directory that distrib_train did not write.
_STEP_FILES = ("commit_success.txt", "_CHECKPOINT_METADATA", "meta/metadata", "state/_METADATA")


def _check_complete(directory: epath.Path, step: int) -> None:
  step_dir = directory / str(step)
  missing = [name for name in _STEP_FILES if not (step_dir / name).exists()]
  if missing:
    raise CheckpointError(
      f"Checkpoint {str(step_dir)!r} is incomplete (no {', '.join(missing)}): a copy cut short, or a directory"
      " distrib_train did not write. Move it out of the way to resume from the step before it."
    )


def step_dirs(directory: str | os.PathLike) -> list[int]:
  """The steps a checkpoints directory lists (its folders named by a number), oldest first; none where it is
  missing. Read-only: no manager opened, nothing created."""
  directory = pathlib.Path(directory)
  return (
    sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir()) if directory.is_dir() else []
  )


def read_meta(directory: epath.Path, step: int) -> dict[str, Any]:
  """A step's ``meta`` JSON, read as text: nothing in it is ever run."""
  _check_complete(directory, step)
  try:
    meta = json.loads((directory / str(step) / "meta" / "metadata").read_text())
  except (OSError, ValueError) as e:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
    raise CheckpointError(f"Checkpoint step {step} in {str(directory)!r} has unreadable metadata: {e}") from None
  if not isinstance(meta, Mapping):
    raise CheckpointError(f"Checkpoint step {step} in {str(directory)!r} has metadata that is not a JSON object.")
  if meta.get("format_version") != FORMAT_VERSION:
    raise CheckpointError(
      f"Checkpoint {str(directory / str(step))!r} has format version {meta.get('format_version')!r};"
      f" this distrib_train reads version {FORMAT_VERSION}."
    )
  return dict(meta)


def held_fields(meta: Mapping[str, Any]) -> tuple[str, ...]:
  """The fields a step's arrays hold (every saved field in a step written before the list was kept)."""
  return tuple(f for f in SAVED_FIELDS if f in meta.get("fields", SAVED_FIELDS))


def step_meta(
  step: int,
  state: TrainState,
  prng_impls: Mapping[str, str],
  run: Mapping[str, Any],
  fields: tuple[str, ...] = SAVED_FIELDS,
) -> dict[str, Any]:
  """A step's ``meta`` JSON (what ``read_meta`` reads back), less the data iterator's part (``data_state.py``).

  Args:
    step: the step being saved.
    state: the train state being saved (its params' mesh is recorded).
    prng_impls: the PRNG key implementation of each typed key, by saved path.
    run: the caller's JSON-able run metadata (config, tokenizer, the frozen weights' source).
    fields: the fields whose arrays the step holds.
  """
  return {
    "format_version": FORMAT_VERSION,
    "step": int(step),
    "fields": list(fields),
    "prng_impls": prng_impls,
    "mesh": _mesh_of(state),
    "process_count": jax.process_count(),
    "versions": _package_versions(),
    "run": run,
  }


def _package_versions() -> dict[str, str]:
  versions = {}
  for name in _VERSIONED_PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return versions


def _mesh_of(state: TrainState) -> dict[str, int] | None:
  for leaf in jax.tree_util.tree_leaves(state.params):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return {str(k): int(v) for k, v in sharding.mesh.shape.items()}
  return None


def saved_shapes(directory: epath.Path, step: int) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Path → shape of every saved array, from the metadata files alone."""
  handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)
  try:
    metadata = handler.metadata(directory / str(step) / "state")
    tree = metadata.tree if hasattr(metadata, "tree") else metadata
    return {k: tuple(v.shape) for k, v in unnest(tree).items()}
  except Exception as e:  # orbax and tensorstore raise many kinds for a damaged file
    raise CheckpointError(
      f"Checkpoint step {step} in {str(directory)!r} has unreadable array metadata: {first_line(e)}"
    ) from None
  finally:
    handler.close()


def first_line(error: BaseException) -> str:
  """The innermost cause of an error, in one line (tensorstore's names the array)."""
  while error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__):
    error = error.__cause__ or error.__context__
  text = " ".join(str(error).split()) or type(error).__name__
  text = re.sub(r"\s*\[tensorstore_spec=.*$", "", text)  # a page of JSON that names nothing new
  # The array and file come first, the OS's reason ("No space left on device") last: keep both.
  return text if len(text) <= 500 else text[:300] + " … " + text[-200:]


def abstract_target(target: TrainState, fields: tuple[str, ...]) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
  """The saved form of ``target``'s fields: key data for typed keys, shardings kept."""
  fallback = replicated_sharding(target)
  abstract = {}
  for keys, leaf in flatten_fields(target, fields).items():
    sharding = getattr(leaf, "sharding", None) or fallback
    if is_prng_key(leaf):
      data_shape = jax.eval_shape(jax.random.key_data, leaf)
      abstract[keys] = jax.ShapeDtypeStruct(data_shape.shape, data_shape.dtype, sharding=sharding)
    else:
      dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
      abstract[keys] = jax.ShapeDtypeStruct(shape_of(leaf), dtype, sharding=sharding)
  return abstract


def check_matches(
  directory: epath.Path,
  step: int,
  abstract: Mapping[tuple[str, ...], Any],
  partial: bool,
  fields: tuple[str, ...] | None = None,
  left_out: Collection[str] = (),
) -> None:
  """Refuses ``abstract`` (saved paths → leaves) where the step lacks a path or holds it with another shape, or
  holds a path of ``fields`` (default: the model's with ``partial``, else every saved field) that it lacks, but
  for the model's top-level subtrees named in ``left_out`` (``mtp``: a model restored without its
  multi-token-prediction modules)."""
  saved = saved_shapes(directory, step)
  problems = []
  for keys, leaf in abstract.items():
    name = "/".join(keys)
    if keys not in saved:
      problems.append(f"{name}: in the target {list(leaf.shape)}, not in the checkpoint")
    elif saved[keys] != tuple(leaf.shape):
      problems.append(f"{name}: checkpoint {list(saved[keys])}, target {list(leaf.shape)}")
  restored_fields = fields if fields is not None else MODEL_FIELDS if partial else SAVED_FIELDS
  for keys, shape in saved.items():
    if keys[0] in restored_fields and keys not in abstract and not (len(keys) > 1 and keys[1] in left_out):
      problems.append(f"{'/'.join(keys)}: in the checkpoint {list(shape)}, not in the target")
  if problems:
    shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    missing = [keys for keys in abstract if keys not in saved]
    new_local_state = len(missing) == len(problems) and all(keys[0] == "local_state" for keys in missing)
    hint = (
      "Only local state is new: this run's model keeps state the checkpoint's run did not have (a setting"
      " that adds some, such as model.fp8=delayed's amax histories); resume with the settings it was"
      " written with."
      if new_local_state
      else "Was it written for another model or config?"
    )
    raise CheckpointError(
      f"Checkpoint step {step} in {str(directory)!r} does not fit the target state"
      f" ({len(problems)} difference(s)): {shown}. {hint}"
    )


def check_restorable(directory: str | epath.PathLike, target: TrainState) -> int | None:
  """Checks that the newest checkpoint in ``directory`` restores into ``target``,
  reading only metadata files and writing nothing.

  For a run to refuse a bad checkpoint before it touches its directory: the
  step directory is complete, its metadata readable and of this format
  version, and every array's path and shape match ``target``'s.

  Returns:
    The newest step, or None when there is no checkpoint (or no directory).

  Raises:
    CheckpointError: what ``CheckpointManager.restore`` would refuse.
  """
  directory = epath.Path(directory)
  if not directory.exists():
    return None
  if not directory.is_dir():
    raise CheckpointError(f"Checkpoint directory {str(directory)!r} is a file, not a directory.")
  names = {p.name: int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir()}
  for name, step in names.items():
    if name != str(step):  # orbax would read it as step N and then look for a directory named N
      raise CheckpointError(
        f"Checkpoint directory {str(directory / name)!r} is not named by its step number ({str(step)!r}):"
        f" rename it to {str(directory / str(step))!r} or move it out of the way."
      )
  steps = sorted(names.values())
  if not steps:
    return None
  held = held_fields(read_meta(directory, steps[-1]))
  check_matches(directory, steps[-1], abstract_target(target, held), partial=False)
  return steps[-1]


def replicated_sharding(target: TrainState) -> NamedSharding | None:
  """For target leaves with no sharding (Python scalars): replicate them."""
  for leaf in jax.tree_util.tree_leaves(target):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return NamedSharding(sharding.mesh, PartitionSpec())
  return None
