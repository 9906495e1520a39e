"""A new run's weights from elsewhere: ``train.init_from`` (``--init_from``) = ``hf:<dir>`` or ``ckpt:<dir>``.

``check(config, plan)`` reads only headers and metadata (it runs with the
other start-up checks, before the workdir is touched); ``load(config, plan,
state)`` replaces a freshly initialised state's params with the checkpoint's,
read onto the plan's shardings. The optimizer state, step and key stay
fresh: this is fine-tuning, not resuming (a run that has its own checkpoint
resumes from it and ignores ``init_from``).

- ``hf:<dir>``: a Hugging Face directory of a family ``recipes/hf_shape.py``
  reads (``checkpoint/hf.py``); the model's family, shape and variants
  already come from its ``config.json`` (``Config.model_recipe``); the
  local state it holds (DeepSeek-V3's router score correction) is read too.
- ``ckpt:<dir>``: a distrib_train workdir, its ``checkpoints`` directory, or
  one step directory in it; the newest step unless a step is named; the
  params only (the optimizer may differ).

With ``train.objective: dpo`` and a frozen reference copy
(``objectives/dpo.Preference``), ``dpo.reference: hf:<dir>`` or
``ckpt:<run>`` (a run's model: an SFT run's, a DPO run's policy) reads the
copy from that checkpoint instead (checked with the rest). ``init_from:
ckpt:`` of a run of the bare model (SFT) fills the policy, and the reference
too unless ``dpo.reference`` names one: the reference is the starting model.

A run whose frozen weights all come from these sources (a LoRA base, a DPO
reference copy: ``frozen_source``) saves checkpoints without them; their
metadata names the sources and fingerprints their files. Restoring such a
step (``restore_source``, ``with_frozen``) reads the frozen weights from the
sources again, at the recorded path or at ``init_from``'s / ``dpo.reference``'s
where the files have moved, and refuses sources whose files changed.

Not for: resuming a run (``trainer.py``), the formats (``checkpoint/``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any


from distrib_train.checkpoint import hf
from distrib_train.checkpoint.checks import (
  FROZEN_FIELDS,
  MODEL_FIELDS,
  SAVED_FIELDS,
  CheckpointError,
  step_dirs,
  abstract_target,
  check_matches,
  held_fields,
  read_meta,
  saved_shapes,
)
from distrib_train.checkpoint.tree import fill_fields, flatten_fields
from distrib_train.checkpoint.hf_common import fingerprint
from distrib_train.recipes import mtp
from distrib_train.train_state import TrainState
from distrib_train.config.run import Config


def checkpoint_step(path: str) -> tuple[pathlib.Path, int]:
  """``(checkpoints directory, step)`` of a workdir, a checkpoints directory or a step directory."""
  where = pathlib.Path(os.path.expanduser(path))
  if where.name.isdigit() and (where / "meta").exists():
    return where.parent, int(where.name)
  directory = where / "checkpoints" if (where / "checkpoints").is_dir() else where
  steps = step_dirs(directory)
  if not steps:
    raise ValueError(
      f"train.init_from ckpt:{path}: no checkpoint there (a workdir, its checkpoints directory or one step directory)."
    )
  return directory, steps[-1]


def _section(config: Config) -> Any:
  """The objective's section with a reference in the step (``dpo``, ``grpo`` with beta > 0), else None."""
  section = getattr(config, config.train.objective, None)
  return section if getattr(section, "live_reference", False) else None


def _reference(config: Config) -> tuple[str, str]:
  """``dpo.reference`` (``grpo.reference``) as ``(kind, path)`` where the state holds a reference to read it into,
  else empty."""
  section = _section(config)
  kind, _, path = section.reference.partition(":") if section and section.reference else ("", "", "")
  return kind, os.path.expanduser(path)


def _is_preference(abstract: TrainState) -> bool:
  """Whether the state is a preference model's (``objectives.Preference``: its params are the policy's)."""
  return any(keys[:2] == ("params", "policy") for keys in flatten_fields(abstract, ("params",)))


def _run_weights(path: str, abstract: TrainState, role: str | None) -> tuple[pathlib.Path, int, dict]:
  """A distrib_train run's model (a DPO run's policy) as the ``policy`` or ``reference`` of a preference model's
  state, or (``role`` None) as a bare model's: ``(directory, step, {the state's saved path → (the checkpoint's
  path, the state's leaf)})``, checked; LoRA adapters of the state keep their start.

  Raises:
    CheckpointError: a LoRA run's checkpoint (adapters on a base), or arrays missing or of other shapes.
  """
  directory, step = checkpoint_step(path)
  saved = saved_shapes(directory, step)
  if any(keys[0] == "params" and keys[-1].startswith("lora_") for keys in saved):
    raise CheckpointError(
      f"ckpt:{path} (step {step} in {str(directory)!r}) is a LoRA run's: its params are"
      " adapters on a frozen base. Export it merged (distrib-train export) and give hf:<that"
      " directory>."
    )
  inner = ("policy",) if any(keys[:2] == ("params", "policy") for keys in saved) else ()
  wanted = {}
  for keys, leaf in abstract_target(abstract, ("params", "model_without_params", "local_state")).items():
    if (role is None or role in keys[1:3]) and not keys[-1].startswith("lora_"):  # adapters keep their start
      source = "local_state" if keys[0] == "local_state" else "params"
      rest = keys[keys.index(role) + 1 :] if role else keys[2:] if keys[0] == "model_without_params" else keys[1:]
      wanted[keys] = ((source, *inner, *rest), leaf)
  check_matches(directory, step, dict(wanted.values()), partial=True, fields=())
  return directory, step, wanted


def read_run_weights(path: str, abstract: TrainState, state: TrainState, role: str | None = None) -> TrainState:
  """``state`` with ``role``'s weights read from a run's checkpoint (``_run_weights``)."""
  from distrib_train.checkpoint.manager import CheckpointManager

  directory, step, wanted = _run_weights(path, abstract, role)
  with CheckpointManager(directory, async_save=False) as manager:
    arrays = manager.read_arrays(step, dict(wanted.values()))
  fields = ("params", "model_without_params", "local_state")
  values = flatten_fields(state, fields)
  values.update({keys: arrays[source] for keys, (source, _) in wanted.items()})
  return fill_fields(state, fields, values)


def _plain_into_preference(path: str, abstract: TrainState) -> bool:
  """Whether ``init_from: ckpt:<path>`` is a run of the bare model (SFT, pretraining) into a preference model."""
  directory, step = checkpoint_step(path)
  return _is_preference(abstract) and not any(k[:2] == ("params", "policy") for k in saved_shapes(directory, step))


def check(config: Config, abstract: TrainState) -> None:
  """What ``load`` would refuse, from headers and metadata only.

  Raises:
    ValueError: a missing tensor or array, or one of another shape (named).
  """
  kind, _, path = config.train.init_from.partition(":")
  if kind == "hf":  # the weights trained or frozen (LoRA's base) as one model
    hf.check_params(
      os.path.expanduser(path),
      (abstract.params, abstract.model_without_params),
      config.model_recipe().config,
      abstract.local_state,
    )
  elif kind == "ckpt" and _plain_into_preference(path, abstract):  # its weights: the policy (and reference)
    _run_weights(path, abstract, "policy")
    if not _reference(config)[0]:
      _run_weights(path, abstract, "reference")
  elif kind == "ckpt":
    directory, step = checkpoint_step(path)
    meta = read_meta(directory, step)
    restore_source(meta, config, f"Checkpoint step {step} in {str(directory)!r}")
    held = tuple(f for f in MODEL_FIELDS if f in held_fields(meta))
    check_matches(directory, step, abstract_target(abstract, held), partial=True)
  reference, where = _reference(config)  # a preference model's reference, of the policy's shape
  if reference == "hf":
    hf.check_params(where, (abstract.params, abstract.model_without_params), config.model_recipe().config)
  elif reference == "ckpt":
    _run_weights(where, abstract, "reference")


def frozen_source(config: Config) -> dict[str, Any] | None:
  """The sources of every frozen weight of ``config``'s state where they are named: ``init_from: hf:`` for a
  LoRA base or a DPO reference copy (``dpo.reference`` for the copy, where set), with their files'
  fingerprints; None where the frozen weights (if any) must be saved."""
  kind, _, path = config.train.init_from.partition(":")
  adapters = getattr(config.model_recipe().config, "lora_rank", 0)
  copy = _section(config) is not None
  if kind != "hf" or not (adapters or copy):
    return None
  reference, where = _reference(config)
  if reference == "ckpt":  # a run's checkpoint has no fingerprint: the copy is saved
    return None
  named = {"init_from": path, **({"reference": where} if reference else {})}
  return {
    role: {"path": os.path.abspath(os.path.expanduser(where)), "files": fingerprint(os.path.expanduser(where))}
    for role, where in named.items()
  }


def saved_fields(source: Mapping[str, Any] | None) -> tuple[str, ...]:
  """The fields a run's checkpoints hold: all but the frozen weights where ``frozen_source`` names them."""
  return tuple(f for f in SAVED_FIELDS if not (source and f in FROZEN_FIELDS))


def restore_source(meta: Mapping[str, Any], config: Config, where: str) -> dict[str, Any] | None:
  """For a checkpoint step without its frozen weights (``meta``, the step at ``where``): its record of their
  sources (``frozen_source``'s form), each at the recorded path or else ``config``'s own for the role, whichever
  holds the same files. None where the step holds them.

  Raises:
    CheckpointError: neither holds the recorded files (each place named, and what differs there).
  """
  if all(f in held_fields(meta) for f in FROZEN_FIELDS):
    return None
  recorded = (meta.get("run") or {}).get("frozen_source") or {}
  given = {"init_from": config.train.init_from, "reference": getattr(_section(config), "reference", "")}
  out = {}
  for role, record in recorded.items():
    candidates = [record["path"]] + [os.path.abspath(os.path.expanduser(given[role][3:]))] * (
      given[role].startswith("hf:") and os.path.abspath(os.path.expanduser(given[role][3:])) != record["path"]
    )
    seen = {c: fingerprint(c) if os.path.isdir(c) else None for c in candidates}
    found = [c for c in candidates if seen[c] == record["files"]]
    if not found:
      differ = lambda c: sorted(
        n for n in set(seen[c]) | set(record["files"]) if seen[c].get(n) != record["files"].get(n)
      )
      places = "; ".join(
        f"{c} {'is missing' if seen[c] is None else 'differs: ' + ', '.join(differ(c)[:3])}" for c in candidates
      )
      raise CheckpointError(
        f"{where} holds the trained weights only; its frozen weights ({role}) are read from their source, and"
        f" {places}. Put those files back, or name where they are now"
        f" ({config.train.objective + '.reference' if role == 'reference' else 'train.init_from'}: hf:<dir>)."
      )
    out[role] = {**record, "path": found[0]}
  return out


def with_frozen(config: Config, source: Mapping[str, Any], abstract: TrainState, state: TrainState) -> TrainState:
  """``state`` with its frozen weights read from ``source`` (a ``frozen_source`` record)."""
  train = dataclasses.replace(config.train, init_from=f"hf:{source['init_from']['path']}")
  name = config.train.objective
  section = (
    {
      name: dataclasses.replace(
        getattr(config, name), reference=f"hf:{source['reference']['path']}" if "reference" in source else ""
      )
    }
    if _section(config)
    else {}
  )
  return load(dataclasses.replace(config, train=train, **section), abstract, state)[0]


def load(config: Config, abstract: TrainState, state: TrainState) -> tuple[TrainState, str]:
  """``state`` with ``init_from``'s params (and ``dpo.reference``'s reference), and a line saying what was
  loaded."""
  state, line = _load(config, abstract, state)
  reference, where = _reference(config)
  if reference == "ckpt":
    return read_run_weights(where, abstract, state, "reference"), f"{line} The reference: {_section(config).reference}."
  if not reference:
    return state, line
  # A preference model's reference (its weights and the local state its checkpoint holds) from its own
  # checkpoint; the other frozen weights (LoRA's base) as loaded.
  model, others = config.model_recipe().config, lambda p: not hf.is_reference(p)
  frozen = hf.load_params(where, abstract.model_without_params, model, fresh=state.model_without_params, skip=others)
  local_state = hf.load_params(where, abstract.local_state, model, fresh=state.local_state, skip=others)
  return (
    state.replace(model_without_params=frozen, local_state=local_state),
    f"{line} The reference: {_section(config).reference}.",
  )


def _load(config: Config, abstract: TrainState, state: TrainState) -> tuple[TrainState, str]:
  kind, _, path = config.train.init_from.partition(":")
  if kind == "hf":
    directory, model = os.path.expanduser(path), config.model_recipe().config
    adapters = getattr(model, "lora_rank", 0)
    # With LoRA the params are the adapters (they keep their fresh values) and the base is frozen; MTP modules
    # (model.mtp_depth) on a checkpoint without them keep theirs too.
    depth, held = (
      getattr(model, "mtp_depth", 0),
      mtp.checkpoint_depth(
        json.loads((pathlib.Path(directory) / "config.json").read_text()), directory, model.num_layers
      ),
    )
    if 0 < held < depth:
      raise hf.HfCheckpointError(
        f"model.mtp_depth={depth}: {directory} holds {held} MTP layer(s); set"
        f" model.mtp_depth to 0 or {held}, or start fresh ones from a checkpoint without"
      )
    new_mtp = depth and not held
    fresh_mtp = (lambda path: any(getattr(k, "key", None) == "mtp" for k in path)) if new_mtp else None
    if new_mtp and not adapters:  # the rest as strictly checked as ever (fresh below for the MTP leaves alone)
      hf.check_params(directory, abstract.params, model, skip=fresh_mtp)
    reference = _reference(config)[0]
    params = hf.load_params(
      directory, abstract.params, model, fresh=state.params if adapters or new_mtp else None, skip=fresh_mtp
    )
    frozen = hf.load_params(
      directory,
      abstract.model_without_params,
      model,
      fresh=state.model_without_params,
      skip=lambda path: bool(
        reference
        and hf.is_reference(path)  # read from dpo.reference
        or fresh_mtp
        and fresh_mtp(path)
      ),
    )
    local_state = hf.load_params(directory, abstract.local_state, model, fresh=state.local_state, skip=fresh_mtp)
    return (
      state.replace(params=params, model_without_params=frozen, local_state=local_state),
      f"Initialised the {'frozen base' if adapters else 'params'} from Hugging Face checkpoint {path}.",
    )
  from distrib_train.checkpoint.manager import CheckpointManager

  directory, step = checkpoint_step(path)
  if _plain_into_preference(path, abstract):  # an SFT run's model: the policy and, by default, the reference
    state = read_run_weights(path, abstract, state, "policy")
    both = not _reference(config)[0]
    if both:
      state = read_run_weights(path, abstract, state, "reference")
    return state, f"Initialised the policy{' and its reference' * both} from step {step} of {directory}."
  source = restore_source(read_meta(directory, step), config, f"Checkpoint step {step} in {str(directory)!r}")
  if source is not None:  # a run that saved no frozen weights: read them from where it did
    state = with_frozen(config, source, abstract, state)
  with CheckpointManager(directory, async_save=False) as manager:
    restored = manager.restore(state, step, params_only=True)
  return restored.replace(step=state.step), f"Initialised the params from step {step} of {directory}."
