"""The refusals a run makes at start-up, each with a sentence that says what to do.

- ``check_workdir``: the workdir can be a writable directory (nothing is
  created to find out); ``check_path_components`` for any path.
- ``check_same_tokenizer``: a run that resumes tokenizes as the checkpoint's
  run did.
- ``check_token_ids``: the first batch's ids are inside the model's
  vocabulary.
- ``check_step_fits``: the compiled step fits the GPU's memory (after
  compiling, before the first step).

All but the last run before the workdir is written to; all raise
``ValueError`` (``TrainerSetupError`` for the first batch), which the trainer
reports as a ``TrainerSetupError``.

Not for: config values (``config/checks.py``), a config against its mesh plan
(``config/plan_checks.py``), a step's memory figures (``cluster/device_memory.py``)
or the data source's own checks (``data/``).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from distrib_train.cluster.device_memory import MEMORY_LEVERS, step_memory_need

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
