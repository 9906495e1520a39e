"""distrib_train: sharded, resumable JAX training from logical-axis rules.

Public API:
  TrainState, build_train_step_fn      penzai-compatible state and step (flax habits too)
  build_eval_step_fn                   the same, aux only, no update
  models                               nnx / linen / penzai / pytree adapters
  recipes                              reference models by name (Llama, BatchNorm MLP)
  data                                 the grain input pipeline
  parallel                             layer_stack: a model's repeated layers, pipelined on a stage axis
  AxisRules                            logical axis names → PartitionSpec
  activation_sharding, constrain       activation constraints by logical axes
  MeshConfig, build_mesh               ICI × DCN device meshes
  MeshPlanner, Plan                    the step's sharding trees, sharded init
  CheckpointManager                    sharded async checkpoints (orbax), any-mesh restore
  CheckpointError, check_restorable    a checkpoint that cannot be restored; the read-only check
  CheckpointWriteError                 a save that failed (full disk, read-only directory)
  generate                             completions from a run's model or a Hugging Face one (KV cache, sampling)
  load_config, Config, ConfigError     the run config: a preset or YAML file with ``key=value`` overrides, checked
  Trainer, RunResult                   a run: plan, init or restore, compile, the loop with its hooks

The run's config is ``distrib_train.config``, its loop ``distrib_train.train``;
joining processes is ``distrib_train.cluster``; the ``plan`` command is
``distrib_train.podplan``. ``ARCHITECTURE.md`` says what lives where.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any

# Each public name and the module that defines it, imported on first use (PEP 562): ``import distrib_train``
# costs nothing, so a process that needs one corner of the package (a data worker process reads documents
# and never touches jax) does not pay for the rest.
_SUBPACKAGES = ("data", "models", "parallel", "recipes")
_EXPORTS = {
  "CheckpointError": "distrib_train.checkpoint",
  "CheckpointManager": "distrib_train.checkpoint",
  "CheckpointWriteError": "distrib_train.checkpoint",
  "check_restorable": "distrib_train.checkpoint",
  "as_auto_mesh": "distrib_train.common.auto_mesh",
  "AxisRules": "distrib_train.sharding.axis_rules",
  "RuleSkip": "distrib_train.sharding.axis_rules",
  "activation_sharding": "distrib_train.sharding.axis_rules",
  "constrain": "distrib_train.sharding.axis_rules",
  "MeshConfig": "distrib_train.sharding.mesh",
  "build_mesh": "distrib_train.sharding.mesh",
  "Plan": "distrib_train.sharding.plan",
  "PlanEntry": "distrib_train.sharding.plan",
  "MeshPlanner": "distrib_train.sharding.planner",
  "Hyperparams": "distrib_train.train_state",
  "TrainState": "distrib_train.train_state",
  "EvalStep": "distrib_train.train_step",
  "LossFunction": "distrib_train.train_step",
  "TrainStep": "distrib_train.train_step",
  "build_eval_step_fn": "distrib_train.train_step",
  "build_train_step_fn": "distrib_train.train_step",
  "generate": "distrib_train.inference.generate",
  "Config": "distrib_train.config.run",
  "ConfigError": "distrib_train.config.run",
  "load_config": "distrib_train.config.run:load",
  "RunResult": "distrib_train.train.trainer",
  "Trainer": "distrib_train.train.trainer",
}

# ``distrib_train.training`` held nine concepts; each now has its package (ARCHITECTURE.md). An import of an old
# path fails with the new one named, rather than loading a second copy under the old name.
MOVED = {
  "config": "config.run",
  "config_values": "config.values",
  "config_checks": "config.checks",
  "job": "config.job",
  "optimizers": "optim.chain",
  "muon": "optim.muon",
  "init_from": "weights.init_from",
  "run_model": "weights.load",
  "export": "weights.export",
  "generate": "inference.generate",
  "generate_text": "inference.text",
  "harness": "evaluation.harness",
  "eval_tasks": "evaluation.tasks",
  "demo_tasks": "evaluation.demo_tasks",
  "eval_hook": "evaluation.hook",
  "rollouts": "posttrain.rollouts",
  "rollout_records": "posttrain.records",
  "rewards": "posttrain.rewards",
  "reference_pass": "posttrain.reference_pass",
  "trainer": "train.trainer",
  "loop": "train.loop",
  "hooks": "train.hooks",
  "window": "train.window",
  "goodput": "train.goodput",
  "watchdog": "train.watchdog",
  "nonfinite": "train.nonfinite",
  "checks": "train.checks",
  "compilation": "train.compilation",
  "metrics": "train.metrics",
  "workdir_lock": "train.workdir_lock",
  "layout_choice": "podplan.layout_choice",
  "wsd": "train.wsd",
  "evaluation": "train.eval_pass",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Answers ``distrib_train.training`` with an empty package whose every module and name is refused with an
  ImportError naming where it went."""

  def find_spec(self, name, path=None, target=None):
    if name == "distrib_train.training":
      return importlib.machinery.ModuleSpec(name, self, is_package=True)
    if name.startswith("distrib_train.training."):
      raise ImportError(_moved(name.removeprefix("distrib_train.training.")), name=name)
    return None

  def exec_module(self, module):
    def refuse(attribute):
      if attribute.startswith("__"):
        raise AttributeError(attribute)
      raise ImportError(_moved(attribute), name=f"distrib_train.training.{attribute}")

    module.__getattr__ = refuse


def _moved(module: str) -> str:
  if module in MOVED:
    return f"distrib_train.training.{module} moved to distrib_train.{MOVED[module]} (ARCHITECTURE.md)"
  where = "; ".join(f"{old} → distrib_train.{new}" for old, new in MOVED.items())
  return f"distrib_train.training was split by concern (ARCHITECTURE.md): {where}"


if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
  sys.meta_path.insert(0, _MovedFinder())


def __getattr__(name: str) -> Any:
  if name in _SUBPACKAGES or (not name.startswith("_") and importlib.util.find_spec(f"distrib_train.{name}")):
    return importlib.import_module(f"distrib_train.{name}")  # any subpackage or module: dt.sharding, dt.train
  if name in _EXPORTS:
    module, _, attribute = _EXPORTS[name].partition(":")
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value  # the next lookup finds it directly
    return value
  raise AttributeError(f"module 'distrib_train' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
  "AxisRules",
  "CheckpointError",
  "CheckpointManager",
  "CheckpointWriteError",
  "Config",
  "ConfigError",
  "EvalStep",
  "Hyperparams",
  "LossFunction",
  "MeshConfig",
  "MeshPlanner",
  "Plan",
  "PlanEntry",
  "RuleSkip",
  "RunResult",
  "TrainState",
  "TrainStep",
  "Trainer",
  "activation_sharding",
  "as_auto_mesh",
  "build_eval_step_fn",
  "build_mesh",
  "build_train_step_fn",
  "check_restorable",
  "constrain",
  "data",
  "generate",
  "load_config",
  "models",
  "parallel",
  "recipes",
]
