"""One way to load a model onto a mesh for use, not training: ``hf:<dir>`` or ``ckpt:<run>``.

``load("hf:/models/qwen3", mesh_config="cpu-8")`` or ``load("ckpt:runs/ft",
step=1000)`` gives a ``RunModel``: the config, the train state with the
model's weights read straight onto the plan's shards (the optimizer's state
is an empty ``sgd(0)``'s), the plan, the mesh and its rules. Export, and
generation on top of it, read a model this way.

- ``hf:<dir>``: a Hugging Face directory of a family ``recipes/hf_shape.py``
  reads; computed in the checkpoint's own dtype (``config.json``'s ``dtype``,
  as transformers' ``dtype="auto"``) unless ``dtype`` names another.
- ``ckpt:<run>``: a distrib_train workdir (its ``config.yaml`` and
  ``checkpoints``); the newest step unless ``step`` names one; its params and
  local state only (with ``--set model.mtp_depth=0``, its multi-token-prediction
  modules left unread). A run that saved no frozen weights (a LoRA base) reads
  them from the sources its checkpoint names (``init_from.restore_source``).

The mesh: ``mesh_config`` (a name in ``mesh_configs/`` or a path), else
every device on ``fsdp``. Its rules, else the config's rule set, lay the
model out.

Not for: a training run's state (``trainer.py`` restores the optimizer too).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax

from distrib_train.common.text import fail
from distrib_train.config.run import Config, ConfigError

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclasses.dataclass
class RunModel:
  """A model loaded onto a mesh: ``config`` (the run's, or one made for a Hugging Face directory), ``state`` (its
  weights sharded), ``plan``, ``rules``, ``source`` (``hf:…`` or ``ckpt:…``), ``step`` (a run's checkpoint step)
  and ``hf_dir`` (the Hugging Face directory the model came from, directly or as the run's ``init_from``:
  its tokenizer and generation config)."""

  config: Config
  state: Any
  plan: Any
  rules: Any
  source: str
  step: int | None
  hf_dir: str | None

  @property
  def mesh(self):
    return self.plan.mesh

  @property
  def model(self):
    """The model to use: a preference run's policy, else the model."""
    from distrib_train.objectives import dpo as objectives

    return objectives.policy_of(self.state.model)

  @property
  def model_config(self):
    return self.config.model_recipe().config


def checkpoint_dtype(directory: str) -> str:
  """The dtype a Hugging Face directory's ``config.json`` names (``dtype``, or the older ``torch_dtype``), as
  transformers' ``dtype="auto"`` loads it; float32 where it names none."""
  path = os.path.join(os.path.expanduser(directory), "config.json")
  try:
    with open(path, encoding="utf-8") as f:
      hf = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"{path}: not readable: {e}") from None
  return _DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), "float32")


@dataclasses.dataclass(frozen=True)
class Source:
  """Where a model comes from, read from its config files alone (no weights): ``init_from``, the ``config``,
  ``hf_dir`` (as ``RunModel``'s) and a run's ``checkpoints`` directory (empty for ``hf:``)."""

  init_from: str
  config: Config
  hf_dir: str | None
  checkpoints: str


def source(init_from: str, *, dtype: str | None = None, overrides: Mapping[str, Any] = ()) -> Source:
  """The ``Source`` ``init_from`` names (``load``'s arguments), checked from its files' headers: a missing
  directory, config or checkpoint is refused here, before any weight is read.

  Raises:
    ConfigError, ValueError: what is not there or not readable (named).
  """
  if dtype is not None and dtype not in _DTYPES:
    raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(_DTYPES)}.")
  config, hf_dir, checkpoints = _config(init_from, dtype, dict(overrides))
  if config.model.name not in ("llama", "moe"):
    raise ConfigError(
      f"{init_from}: the run's model is {config.model.name!r}; only the reference decoders (llama,"
      " moe) load for use here."
    )
  return Source(init_from, config, hf_dir, checkpoints)


def _config(init_from: str, dtype: str | None, overrides: Mapping[str, Any]) -> tuple[Config, str | None, str]:
  """``(config, hf_dir, checkpoints directory)`` of the source."""
  from distrib_train.config import run as config_lib
  from distrib_train.weights import init_from as init_lib

  kind, sep, path = init_from.partition(":")
  if not sep or kind not in ("hf", "ckpt") or not path:
    raise ConfigError(f"--init_from {init_from!r}: give hf:<Hugging Face directory> or ckpt:<run directory>.")
  path = os.path.expanduser(path)
  if kind == "hf":
    if not os.path.isfile(os.path.join(path, "config.json")):
      raise ConfigError(
        f"--init_from {init_from}: {path!r} holds no config.json (a Hugging Face model directory"
        " is needed; nothing is downloaded)."
      )
    dtype = dtype or checkpoint_dtype(path)
    config = config_lib.load(
      None,
      {"train.init_from": f"hf:{path}", "model.dtype": dtype, "model.param_dtype": dtype, **overrides},
      training=False,
    )
    return config, path, ""
  directory, _ = init_lib.checkpoint_step(path)
  workdir = directory.parent if directory.name == "checkpoints" else directory
  if not (workdir / "config.yaml").is_file():
    raise ConfigError(f"--init_from {init_from}: {str(workdir)!r} is not a distrib_train run (no config.yaml).")
  config = config_lib.load(
    str(workdir / "config.yaml"), {**({"model.dtype": dtype} if dtype else {}), **overrides}, training=False
  )
  source = config.train.init_from
  return config, os.path.expanduser(source[3:]) if source.startswith("hf:") else None, str(directory)


def _mesh(mesh_config: str | None):
  from distrib_train.sharding.mesh import MeshConfig, build_mesh, find_mesh_config

  if mesh_config:
    config = MeshConfig.from_yaml(find_mesh_config(mesh_config))
  else:
    config = MeshConfig(("data", "fsdp", "tensor"), (1, jax.device_count(), 1))
  return config, build_mesh(config)


def load(
  init_from: str | Source,
  *,
  step: int | None = None,
  mesh_config: str | None = None,
  dtype: str | None = None,
  overrides: Mapping[str, Any] = (),
  devices: Any = None,
  frozen: bool = True,
) -> RunModel:
  """The model ``init_from`` names, loaded onto a mesh (module docstring).

  Args:
    init_from: ``hf:<dir>`` or ``ckpt:<run>``, or its ``source`` read before.
    step: a run's checkpoint step (default: the newest).
    mesh_config: a mesh config's name or path (default: every device on ``fsdp``).
    dtype: the compute dtype (default: the checkpoint's for ``hf:``, the run's for ``ckpt:``).
    overrides: config keys to set (``data.tokenizer``, ``model.attention``, …).
    devices: the devices of a one-device mesh (export's), instead of ``mesh_config``.
    frozen: read a run's frozen weights from their sources where its checkpoint left them out (False: they keep
      their initial values, for a caller that reads only the trained params: an adapter's export).

  Raises:
    ConfigError, ValueError: a source that is not there or not readable, a step the run does not hold, a model
      the mesh cannot lay out (named).
  """
  import optax

  from distrib_train.checkpoint.manager import CheckpointManager
  from distrib_train.sharding.mesh import MeshConfig, build_mesh
  from distrib_train.sharding.planner import MeshPlanner
  from distrib_train.train_state import TrainState
  from distrib_train.weights import init_from as init_lib
  from distrib_train.config.job import model_parts, rules_for

  found = init_from if isinstance(init_from, Source) else source(init_from, dtype=dtype, overrides=overrides)
  init_from, config, hf_dir, directory = found.init_from, found.config, found.hf_dir, found.checkpoints
  if devices is not None:
    mesh_spec = MeshConfig(("data", "fsdp", "tensor"), (1, 1, 1))
    mesh = build_mesh(mesh_spec, devices)
  else:
    mesh_spec, mesh = _mesh(mesh_config)
  rules = rules_for(config, mesh_spec)
  parts = model_parts(config)  # LoRA: the base frozen; dpo: the policy with its reference
  make = lambda: TrainState.initial_state(parts.model_fn(0), optax.sgd(0.0), jax.random.key(0), is_param=parts.is_param)
  plan = MeshPlanner(mesh, rules).plan(jax.eval_shape(make))
  state = plan.init(make)
  if not directory:
    state, _ = init_lib.load(config, plan.abstract_train_state, state)
    return RunModel(config, state, plan, rules, init_from, None, hf_dir)
  with CheckpointManager(pathlib.Path(directory), async_save=False) as manager:
    latest = manager.latest_step()
    if latest is None:
      raise ValueError(f"{directory!r} holds no checkpoint.")
    step = latest if step is None else step
    if step not in manager.all_steps():
      raise ValueError(f"{directory!r} holds no step {step} (its steps: {', '.join(map(str, manager.all_steps()))}).")
    # A run that saved no frozen weights (a LoRA base from hf:): they are read from their source (a DPO run's
    # reference copy alone is not written, so not read).
    from distrib_train.checkpoint import hf

    leaves = jax.tree_util.tree_flatten_with_path(plan.abstract_train_state.model_without_params)[0]
    if frozen and any(not hf.is_reference(path) for path, _ in leaves):
      sources = init_lib.restore_source(
        manager.metadata_of(step), config, f"Checkpoint step {step} in {str(manager.directory)!r}"
      )
      if sources is not None:
        state = init_lib.with_frozen(config, sources, plan.abstract_train_state, state)
    state = _model_arrays(manager, step, state, getattr(config.model_recipe().config, "mtp_depth", 0))
  return RunModel(config, state, plan, rules, init_from, step, hf_dir)


def _model_arrays(manager: Any, step: int, state: Any, mtp_depth: int) -> Any:
  """``state`` with the model's params and local state of checkpoint ``step``; a run's multi-token-prediction
  modules (``params/mtp/…``) left unread where the model has none (``--set model.mtp_depth=0``: generation and
  evaluation read the main head only), every other array matched as ``restore(params_only=True)`` matches it."""
  from distrib_train.checkpoint import checks, tree
  from distrib_train.recipes import mtp

  saved = checks.saved_shapes(manager.directory, step)
  if mtp_depth or not any(keys[1:2] == (mtp.NAME,) for keys in saved):
    return manager.restore(state, step, params_only=True)
  fields = tuple(f for f in checks.MODEL_FIELDS if f in checks.held_fields(manager.metadata_of(step)))
  abstract = checks.abstract_target(state, fields)
  checks.check_matches(manager.directory, step, abstract, partial=True, left_out=(mtp.NAME,))
  return tree.fill_fields(state, fields, manager.read_arrays(step, abstract))


def add_flags(parser: Any) -> None:
  """The flags of a command that loads a model for use (``generate``, ``eval``): where the model is and the job
  it runs in (``start``)."""
  parser.add_argument("--init_from", required=True, help="hf:<Hugging Face directory> or ckpt:<run directory>")
  parser.add_argument("--step", type=int, help="a run's checkpoint step (default: the newest)")
  parser.add_argument("--mesh_config", help="a mesh config's name or path (default: every device on fsdp)")
  parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the checkpoint's or the run's)")
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    dest="overrides",
    help="a config key: --set data.tokenizer=hf:DIR (repeatable)",
  )
  parser.add_argument("--cpu_devices", type=int, help="run on CPU, emulating this many devices per process")
  parser.add_argument("--coordinator_address", help="host:port of process 0 (multi-process jobs)")
  parser.add_argument("--num_processes", type=int)
  parser.add_argument("--process_id", type=int)


def start(args: Any) -> tuple[bool, Any]:
  """Joins the job ``add_flags``' flags describe (or emulates the devices), or refuses flags that name no job
  (``fail``): whether this is process 0, and its way to say a line on stderr (None elsewhere)."""
  import sys

  from distrib_train.cluster import distributed

  try:
    distributed.initialize(
      coordinator_address=args.coordinator_address,
      num_processes=args.num_processes,
      process_id=args.process_id,
      cpu_devices=args.cpu_devices,
    )
  except ValueError as e:
    fail(str(e))
  first = jax.process_index() == 0
  return first, (lambda line: print(line, file=sys.stderr, flush=True)) if first else None
