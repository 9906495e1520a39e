"""A reference model shaped by a Hugging Face checkpoint: ``train.init_from: hf:<dir>``'s model.

The checkpoint's ``config.json`` (read by ``hf_shape.py``) picks the family (dense or mixture) and fixes its shape
and variants; the preset's numerics (dtype, remat, the attention kernel, fp8, loss weights, …) stay the run's.

Not for: reading ``config.json`` (``hf_shape.py``) or the weights (``checkpoint/hf.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from distrib_train.recipes import ModelRecipe, hf_shape


def shaped_by_checkpoint(recipe: ModelRecipe, directory: str, overrides: Mapping[str, Any]) -> ModelRecipe:
  """``recipe`` with the shape of the checkpoint in ``directory``; ``overrides`` are the run's ``model.*``
  settings (``mtp_depth`` may drop or add the MTP modules; any other shape field must match the checkpoint's).

  Raises:
    ValueError: a setting the checkpoint's model cannot take, or a shape field set to another value (named).
  """
  cls, fields = hf_shape.checkpoint_fields(directory)
  kept = {
    f.name: getattr(recipe.config, f.name)
    for f in dataclasses.fields(cls)
    if hasattr(recipe.config, f.name) and f.name not in hf_shape.shape_fields(recipe.config)
  }
  kept.update({k: v for k, v in overrides.items() if k == "mtp_depth"})  # MTP dropped or added
  config = cls(**{**fields, **kept})  # the run's own settings (loss weights too) beat the checkpoint's
  fixed = hf_shape.shape_fields(config)
  clashes = [
    f"model.{k}={v!r} (the checkpoint has {getattr(config, k)!r})"
    for k, v in overrides.items()
    if k in set(fixed) - {"mtp_depth"} and getattr(config, k) != v
  ]
  if clashes:
    raise ValueError(f"{', '.join(clashes)}; leave the model's shape to the checkpoint.")
  name = "moe" if hf_shape.is_moe(config) else "llama"
  return ModelRecipe(f"{name}-{config.hf_model_type}", config, recipe.loss_fn, recipe.input_axes)
