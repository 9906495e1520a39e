"""The run configuration: typed sections, YAML files and ``--set`` overrides.

An experiment is a few small sections::

  model:      name: llama, preset: tiny, and any field of the model's config (remat: full, attention: cudnn, …)
  optimizer:  adamw / adam / sgd / muon, learning rate, schedule (wsd too), warmup, clipping
  data:       source, paths, seq_len, global_batch_size, …  (DataConfig)
  train:      steps, seed, intervals, non-finite policy, compilation cache, peak FLOP/s, objective
  dpo, grpo:  an objective's own settings (read with train.objective: dpo / grpo; objectives/)

plus ``mesh_config`` (a file in ``mesh_configs/`` or a path). ``load``
reads a YAML file (or a preset shipped in ``distrib_train/configs/``) over
the defaults, applies ``key=value`` overrides and checks every key and type
before anything runs; mistakes raise ``ConfigError`` naming the key, with
the closest valid keys for a misspelling (a value is parsed into its field's
type in ``config_values.py``).

Not for: building the optimizer (``optimizers.py``) or running (``trainer.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import sys
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from distrib_train.common.yaml_loader import ConfigError, safe_load_yaml
from distrib_train.config.checks import check_config
from distrib_train.config.values import check_model_value, closest_keys, coerce, model_field_types

from distrib_train.data.config import REFERENCE_PENDING
from distrib_train.data.pipeline import DataConfig
from distrib_train.objectives.dpo import DpoConfig
from distrib_train.objectives.grpo import GrpoConfig
from distrib_train.optim.chain import OptimizerConfig

PRESETS_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"  # distrib_train/configs


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The loop.

  Attributes:
    steps: total optimizer steps (a resumed run continues up to it).
    seed: the model-init and step-key seed.
    log_every: steps per metrics line (and per host sync for metrics).
    eval_every: steps between evaluations (0: only at the end).
    eval_batches: batches per evaluation (0: the whole held-out split).
    eval_tasks, eval_tasks_every, eval_include_path, eval_tasks_limit: lm-eval tasks the live model is scored
      on every ``eval_tasks_every`` steps (0: at the end), more task YAMLs, documents per task (``eval_hook.py``).
    checkpoint_every, keep_checkpoints: steps between checkpoints (0: only at the end); newest ones kept.
    local_checkpoint_every: steps between fast-tier checkpoints: every process writes its own shards to
      ``local_checkpoint_dir`` (``checkpoint/local.py``); a restart takes the newest step complete in either
      tier. 0: off.
    local_checkpoint_dir: the fast tier's directory on each host's own disk (``/dev/shm/…`` for memory); each
      process writes under ``process_<i>`` in it. Empty: ``<temp dir>/distrib_train-local/<a hash of the workdir>``.
    async_checkpoint: write checkpoints in the background.
    nonfinite: what a non-finite loss or gradient does: ``skip`` (drop the update and count it), ``halt`` (stop
      with a message, no checkpoint) or ``rollback`` (restore the last checkpoint, move past the batch).
    max_nonfinite: consecutive skipped steps, or rollbacks without a clean checkpoint in between, before the run
      halts anyway.
    compilation_cache_dir: persistent XLA compilation cache ('' disables).
    peak_tflops: per-device peak for MFU (0: look the device kind up; CPU has none).
    rules: axis rules (a rule-set name) when the mesh config names none.
    objective: ``lm`` (next-token cross-entropy: pretraining, SFT), ``dpo`` (preference pairs, the ``dpo``
      section) or ``grpo`` (RL on the policy's completions, the ``grpo`` section); ``objectives/``.
    init_from: a new run's weights: ``hf:<dir>`` (a Hugging Face checkpoint; the model's shape comes from its
      config.json) or ``ckpt:<workdir, checkpoints dir or step dir>`` (the params of a distrib_train run); the
      optimizer starts fresh. Empty: a random init. A run that resumes from its own checkpoint ignores it.
    microbatches: split each step's global batch into this many microbatches inside the step. Without a
      ``stage`` mesh axis: gradient accumulation (float32, one update per step; less activation memory). With
      one: the pipeline's microbatches (more of them, a smaller bubble).
    pipeline_repeats: rounds each microbatch makes through the pipeline stages (1: GPipe; R > 1: the circular
      schedule, bubble ``(S − 1) / (R·M + S − 1)``, needs ``microbatches`` ≥ stages and layers divisible by
      stages × R). Only with a ``stage`` axis.
    layout_compiles: with ``mesh_config: auto``, the candidate layouts the search compiles at most
      (``podplan/auto.py``).
    layout_timed_steps: with ``mesh_config: auto`` on a GPU or TPU, the steps each of the fastest three
      estimates runs, timed, to choose between them (0: the compiler's estimate alone).
    layout_fp8: with ``mesh_config: auto`` on an H100 or H200, the search may also try ``model.fp8: current``,
      ranked by its timed steps (FP8 matmuls change the numerics, so only where the preset allows it; off by
      default).
    hang_timeout_s: the hang watchdog (``watchdog.py``): seconds a step (or
      the wait for its batch) may go without progress before every process
      writes its Python stacks and exits with status 4, naming the phase and
      the silent process. 0: off. Keep it below the launcher's
      ``--heartbeat_timeout``.
    hang_compile_timeout_s: the same for compiling, evaluating and a run's
      first step (0: 10 × ``hang_timeout_s``, at least 600 s).
    hang_checkpoint_timeout_s: the same for start-up, init, restoring and
      the blocking part of a save (0: 10 × ``hang_timeout_s``, at least 600 s).
  """

  steps: int = 200
  seed: int = 0
  log_every: int = 10
  eval_every: int = 0
  eval_batches: int = 0
  eval_tasks: tuple[str, ...] = ()
  eval_tasks_every: int = 0
  eval_include_path: str = ""
  eval_tasks_limit: float = 0.0
  checkpoint_every: int = 0
  keep_checkpoints: int = 3
  local_checkpoint_every: int = 0
  local_checkpoint_dir: str = ""
  async_checkpoint: bool = True
  nonfinite: str = "skip"
  max_nonfinite: int = 10
  compilation_cache_dir: str = "~/.cache/distrib_train/xla"
  peak_tflops: float = 0.0
  rules: str = "fsdp_tensor"
  objective: str = "lm"
  init_from: str = ""
  microbatches: int = 1
  pipeline_repeats: int = 1
  layout_compiles: int = 6
  layout_timed_steps: int = 5
  layout_fp8: bool = False
  hang_timeout_s: float = 0.0
  hang_compile_timeout_s: float = 0.0
  hang_checkpoint_timeout_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """A reference model (``distrib_train.recipes.get``) and field overrides."""

  name: str = "llama"
  preset: str = "tiny"
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Config:
  """A whole experiment."""

  model: ModelSection = ModelSection()
  optimizer: OptimizerConfig = OptimizerConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  dpo: DpoConfig = DpoConfig()
  grpo: GrpoConfig = GrpoConfig()
  mesh_config: str = "cpu-8"

  def to_dict(self) -> dict[str, Any]:
    """Plain, YAML-able values (model overrides inlined into ``model``)."""
    out = dataclasses.asdict(self)
    out["data"]["tokenizer"] = self.data.tokenizer_name()
    for key in _NOT_CONFIG_KEYS:  # set from train.objective and its section
      out["data"].pop(key)
    model = out.pop("model")
    out = {"model": {"name": model["name"], "preset": model["preset"], **dict(model["overrides"])}, **out}
    return {
      section: {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}  # YAML's lists
      if isinstance(values, dict)
      else values
      for section, values in out.items()
    }

  to_yaml = lambda self: yaml.safe_dump(self.to_dict(), sort_keys=False)  # noqa: E731

  def changes_since(self, run: Mapping[str, Any]) -> list[str]:
    """What differs between a checkpoint's config (in its run metadata) and this run's: ``section.key: old → new``."""
    saved, now = run.get("config") or {}, self.to_dict()
    # Of the train section only the seed shapes what a checkpoint holds; steps and intervals may change. A key
    # the checkpoint's release did not have is no change.
    compared = {
      "model": None,
      "optimizer": None,
      "data": None,
      "dpo": None,
      "grpo": None,
      "train": ("seed", "objective"),
    }
    return [
      f"{section}.{key}: {saved[section].get(key)!r} → {value!r}"
      + (" (ignored: the weights and keys continue from the checkpoint)" if section == "train" else "")
      for section, keys in compared.items()
      if isinstance(saved.get(section), dict)
      for key, value in now[section].items()
      if (keys is None or key in keys) and key in saved[section] and saved[section][key] != value
    ]

  def model_recipe(self):
    """The ``ModelRecipe`` this config names (config fields overridden); with ``train.init_from: hf:<dir>``,
    the model's shape is the checkpoint's (``recipes/hf_recipe.py``, once per config:
    the trainer, the job, the checks and ``init_from`` ask this one)."""
    return self._recipe

  @functools.cached_property
  def _recipe(self):
    from distrib_train import recipes

    recipe = recipes.get(self.model.name, self.model.preset, **dict(self.model.overrides))
    if not self.train.init_from.startswith("hf:"):
      return recipe
    from distrib_train.recipes.hf_recipe import shaped_by_checkpoint
    from distrib_train.recipes.hf_shape import HfCheckpointError

    try:
      return shaped_by_checkpoint(recipe, os.path.expanduser(self.train.init_from[3:]), self.model.overrides)
    except HfCheckpointError:  # the checkpoint's own (file and key named)
      raise
    except ValueError as e:  # a preset setting the checkpoint's model cannot take, or a shape set by hand
      raise ConfigError(f"train.init_from {self.train.init_from}: {e}") from None

  def data_config(self) -> DataConfig:
    """This config's ``distrib_train.data.DataConfig`` (the ``data`` section); the trainer's own, rows capped
    for cuDNN's packed attention where it runs, is ``config/job.data_config``); ``dpo``'s reads preference
    pairs, their completions scored; ``grpo``'s prompt records, a completion to a row."""
    objective, records = self.train.objective, dict(loss_on=self.data.loss_on or "completion")
    if objective == "grpo":
      return dataclasses.replace(self.data, packing=False, prompts=True)
    # dpo's precomputed reference: the trainer names its file once its pass has run (reference_pass.py)
    return (
      self.data
      if objective != "dpo"
      else dataclasses.replace(
        self.data,
        pairs=True,
        **records,
        **({"reference_logps": REFERENCE_PENDING} if self.dpo.precompute_reference else {}),
      )
    )


_SECTIONS = {
  "optimizer": OptimizerConfig,
  "data": DataConfig,
  "train": TrainConfig,
  "dpo": DpoConfig,
  "grpo": GrpoConfig,
}
# Fields set from code, not from a config file.
_NOT_CONFIG_KEYS: tuple[str, ...] = ("pairs", "reference_logps", "prompts")


def _field_types(cls: type) -> dict[str, Any]:
  hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
  return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in _NOT_CONFIG_KEYS}


def valid_keys(model_fields: Sequence[str] = ()) -> list[str]:
  """Every ``section.key`` a config or ``--set`` accepts."""
  keys = ["mesh_config", "model.name", "model.preset"] + [f"model.{f}" for f in model_fields]
  keys += [f"model.lora.{f[5:]}" for f in model_fields if f.startswith("lora_")]  # model.lora: {rank, …}
  keys += [f"optimizer.muon.{f.name[5:]}" for f in dataclasses.fields(OptimizerConfig) if f.name.startswith("muon_")]
  for section, cls in _SECTIONS.items():
    keys += [f"{section}.{name}" for name in _field_types(cls)]
  return keys


def _flat(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
  """``{"train": {"steps": 5}}`` → ``{"train.steps": 5}``."""
  out = {}
  for key, value in raw.items():
    key = str(key)
    if key in ("model",) + tuple(_SECTIONS):
      if value is None:
        continue
      if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: section {key!r} must be a mapping, got {value!r}.")
      for sub, v in value.items():
        if key in ("model", "optimizer") and isinstance(v, Mapping):  # model.lora: {rank: 8} → model.lora.rank
          out.update({f"{key}.{sub}.{k}": item for k, item in v.items()})
        else:
          out[f"{key}.{sub}"] = v
    else:
      out[key] = value
  return out


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
  """One YAML file as a mapping (``ConfigError`` names the file)."""
  raw = safe_load_yaml(path)
  if raw is None:
    return {}
  if not isinstance(raw, Mapping):
    raise ConfigError(f"Config {str(path)!r} must be a mapping of sections, got {type(raw).__name__}.")
  return dict(raw)


def preset_names() -> list[str]:
  return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def config_path(name_or_path: str) -> pathlib.Path:
  """A preset name (``tiny``, ``llama-1b-gpu``) or a YAML path, as a path."""
  path = pathlib.Path(name_or_path).expanduser()
  if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
    if not path.is_file():
      what = "is not a file" if path.exists() else "does not exist"
      raise ConfigError(f"Config file {name_or_path!r} {what}.")
    return path
  preset = PRESETS_DIR / f"{name_or_path}.yaml"
  if not preset.is_file():
    raise ConfigError(
      f"No config preset {name_or_path!r}; presets: {', '.join(preset_names())} (or give a .yaml path)."
    )
  return preset


def parse_overrides(assignments: Sequence[str]) -> dict[str, str]:
  """``["train.steps=5", …]`` → ``{"train.steps": "5", …}``."""
  out = {}
  for item in assignments:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
      raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set train.steps=100.")
    out[key.strip()] = value.strip()
  return out


def build(
  raw: Mapping[str, Any], overrides: Mapping[str, Any] = (), where: str = "config", training: bool = True
) -> Config:
  """A checked ``Config`` from nested YAML-like values and flat overrides (``training``: as ``check_config``).

  Raises:
    ConfigError: an unknown key (with the closest valid ones), a value of the
      wrong type, or an invalid value.
  """
  values = _flat(raw, where)
  for key, value in dict(overrides).items():
    values[key] = value
  name = coerce(values.pop("model.name", "llama"), str, "model.name")
  preset = coerce(values.pop("model.preset", "tiny"), str, "model.preset")
  model_types = model_field_types(name, preset)
  known = valid_keys(sorted(model_types))
  sections: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
  model_overrides: dict[str, Any] = {}
  mesh_config = Config.mesh_config
  for key, value in values.items():
    if key == "mesh_config":
      mesh_config = coerce(value, str, key)
      continue
    section, _, field = key.partition(".")
    if section in ("model", "optimizer") and field.replace(".", "_") in (
      model_types if section == "model" else _field_types(OptimizerConfig)
    ):
      field = field.replace(".", "_")
    if section == "model" and field in model_types:
      model_overrides[field] = check_model_value(key, coerce(value, model_types[field], key), field)
    elif section in _SECTIONS and field in (types_ := _field_types(_SECTIONS[section])):
      sections[section][field] = coerce(value, types_[field], key)
    else:
      raise ConfigError(f"Unknown config key {key!r} ({where}); {closest_keys(key, known)}")
  try:
    config = Config(
      model=ModelSection(name, preset, model_overrides),
      optimizer=OptimizerConfig(**sections["optimizer"]),
      data=DataConfig(**sections["data"]),
      train=TrainConfig(**sections["train"]),
      **{name: _SECTIONS[name](**sections[name]) for name in ("dpo", "grpo")},
      mesh_config=mesh_config,
    )
  except ValueError as e:  # a value the section itself refuses (DataConfig checks its own)
    raise ConfigError(str(e)) from None
  check_config(config, training)
  return config


def load(
  config: str | None = None, overrides: Sequence[str] | Mapping[str, Any] = (), *, training: bool = True
) -> Config:
  """A config from a preset name or YAML path (or the defaults), overridden.

  Args:
    config: a preset name (see ``preset_names()``) or a YAML path.
    overrides: ``key=value`` strings (``--set``) or a mapping.
    training: check its data against its model too (False: a model loaded for use, ``weights/load.py``).
  """
  raw = read_yaml(config_path(config)) if config else {}
  where = f"config {config!r}" if config else "config"
  if not isinstance(overrides, Mapping):
    overrides = parse_overrides(overrides)
  return build(raw, overrides, where, training)
