"""The checks across a run config's fields: ranges, names, and what the sections need of each other.

``config.build`` runs ``check_config`` on every ``Config`` it makes, before
anything runs.

Not for: parsing a value into its field's type (``config_values.py``) or
the sections and their defaults (``config.py``).
"""

from __future__ import annotations

import os
from typing import Any

from distrib_train.common.text import short_repr
from distrib_train.common.yaml_loader import ConfigError
from distrib_train.recipes.family import family_of
from distrib_train.objectives import OBJECTIVES

NONFINITE_POLICIES = ("skip", "halt", "rollback")


def check_config(config: Any, training: bool = True) -> None:
  """Checks across a built ``Config``'s fields and sections (``training``: also those of its data against its
  model; False for a config that only loads a model for use, ``weights/load.py``).

  Raises:
    ConfigError: a value out of range or a combination that cannot run (named by its key).
  """
  o, t = config.optimizer, config.train
  if o.name not in ("adamw", "adam", "sgd", "muon"):
    raise ConfigError(f"optimizer.name must be adamw, adam, sgd or muon, got {o.name!r}.")
  if o.schedule not in ("constant", "cosine", "linear", "wsd"):
    raise ConfigError(f"optimizer.schedule must be constant, cosine, linear or wsd, got {o.schedule!r}.")
  for key, value, ok, what in (
    ("decay_fraction", o.decay_fraction, 0.0 < o.decay_fraction <= 1.0, "in (0, 1]"),
    ("decay_shape", o.decay_shape, o.decay_shape in ("linear", "1-sqrt"), "linear or 1-sqrt"),
    ("muon.ns_steps", o.muon_ns_steps, o.muon_ns_steps >= 1, "at least 1"),
    ("muon.beta", o.muon_beta, 0.0 <= o.muon_beta < 1.0, "in [0, 1)"),
    ("muon.consistent_rms", o.muon_consistent_rms, o.muon_consistent_rms >= 0, "0 (off) or more"),
    ("muon.adam_lr", o.muon_adam_lr, o.muon_adam_lr >= 0, "0 (learning_rate) or more"),
  ):
    if not ok:
      raise ConfigError(f"optimizer.{key} must be {what}, got {value!r}.")
  if o.learning_rate <= 0:
    raise ConfigError(f"optimizer.learning_rate must be positive, got {o.learning_rate!r}.")
  for key in ("warmup_steps", "decay_steps"):
    if getattr(o, key) < 0:
      raise ConfigError(f"optimizer.{key} must be 0 or more, got {getattr(o, key)!r}.")
  if not 0.0 <= o.min_lr_ratio <= 1.0:
    raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio!r}.")
  if t.steps < 1:
    raise ConfigError(f"train.steps must be at least 1, got {t.steps!r}.")
  for key in ("log_every", "keep_checkpoints", "max_nonfinite", "microbatches", "pipeline_repeats", "layout_compiles"):
    if getattr(t, key) < 1:
      raise ConfigError(f"train.{key} must be at least 1, got {getattr(t, key)!r}.")
  for key in (
    "eval_every",
    "eval_batches",
    "eval_tasks_every",
    "eval_tasks_limit",
    "checkpoint_every",
    "local_checkpoint_every",
    "hang_timeout_s",
    "hang_compile_timeout_s",
    "hang_checkpoint_timeout_s",
    "layout_timed_steps",
  ):
    if getattr(t, key) < 0:
      raise ConfigError(f"train.{key} must be 0 or more, got {getattr(t, key)!r}.")
  for key in ("hang_compile_timeout_s", "hang_checkpoint_timeout_s"):
    if getattr(t, key) and not t.hang_timeout_s:
      raise ConfigError(
        f"train.{key} is set but the hang watchdog is off (train.hang_timeout_s=0); set train.hang_timeout_s too."
      )
  from distrib_train.sharding.axis_rules import RULE_SETS

  if t.rules not in RULE_SETS:
    raise ConfigError(f"train.rules must be one of {', '.join(sorted(RULE_SETS))}, got {t.rules!r}.")
  if t.objective not in OBJECTIVES:
    raise ConfigError(f"train.objective must be one of {', '.join(OBJECTIVES)}, got {t.objective!r}.")
  for section in OBJECTIVES[1:]:  # each objective's own section (dpo, grpo) is read with it alone
    if t.objective != section and getattr(config, section) != type(getattr(config, section))():
      raise ConfigError(
        f"The {section} section is read with train.objective: {section}; this run's objective is {t.objective}."
      )
  if t.objective != "lm" and config.model.name not in ("llama", "moe"):
    raise ConfigError(
      f"train.objective={t.objective} trains the reference decoders (model.name llama or moe), not"
      f" {config.model.name!r}."
    )
  reference = getattr(getattr(config, t.objective, None), "reference", "")
  if reference:
    where = reference.partition(":")[2]
    if not os.path.isdir(os.path.expanduser(where)):
      raise ConfigError(f"{t.objective}.reference {reference}: {where!r} is not a directory.")
    if not t.init_from:
      raise ConfigError(
        f"{t.objective}.reference {reference} is the reference of a policy that starts from"
        " trained weights: set train.init_from too (empty, the policy would start random)."
      )
  if t.eval_tasks and config.model.name not in ("llama", "moe"):
    raise ConfigError(
      f"train.eval_tasks scores the reference decoders (model.name llama or moe), not {config.model.name!r}."
    )
  if t.nonfinite not in NONFINITE_POLICIES:
    raise ConfigError(f"train.nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {t.nonfinite!r}.")
  if t.init_from:
    kind, _, path = t.init_from.partition(":")
    if kind not in ("hf", "ckpt") or not path:
      raise ConfigError(
        f"train.init_from must be hf:<Hugging Face dir> or ckpt:<workdir or step dir>, got {short_repr(t.init_from)}."
      )
    if not os.path.isdir(os.path.expanduser(path)):
      raise ConfigError(f"train.init_from {t.init_from}: {path!r} is not a directory.")
  try:
    config.data_config()
    config.model_recipe()
  except (ValueError, TypeError, ArithmeticError) as e:  # values the model's own config refuses
    raise ConfigError(f"model: {e}" if not isinstance(e, ValueError) else str(e)) from None
  vocab = family_of(config.model_recipe().config).vocab_size
  if training and vocab is not None and vocab < 256 and config.data.tokenizer == "bytes":
    raise ConfigError(f"model.vocab_size {vocab} is below 256, the byte-level vocabulary of the data sources.")
