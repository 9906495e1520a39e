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

The run's config and loop are ``distrib_train.training``; joining processes
is ``distrib_train.cluster``; the ``plan`` command is
``distrib_train.podplan``. ``ARCHITECTURE.md`` says what lives where.
"""

import importlib
import importlib.util
from typing import Any

# Each public name and the module that defines it, imported on first use (PEP 562): ``import distrib_train``
# costs nothing, so a process that needs one corner of the package (a data worker process reads documents
# and never touches jax) does not pay for the rest.
_SUBPACKAGES = ("data", "models", "parallel", "recipes")
_EXPORTS = {
    "CheckpointError": "distrib_train.checkpoint", "CheckpointManager": "distrib_train.checkpoint",
    "CheckpointWriteError": "distrib_train.checkpoint", "check_restorable": "distrib_train.checkpoint",
    "as_auto_mesh": "distrib_train.common.auto_mesh",
    "AxisRules": "distrib_train.sharding.axis_rules", "RuleSkip": "distrib_train.sharding.axis_rules",
    "activation_sharding": "distrib_train.sharding.axis_rules", "constrain": "distrib_train.sharding.axis_rules",
    "MeshConfig": "distrib_train.sharding.mesh", "build_mesh": "distrib_train.sharding.mesh",
    "Plan": "distrib_train.sharding.plan", "PlanEntry": "distrib_train.sharding.plan",
    "MeshPlanner": "distrib_train.sharding.planner",
    "Hyperparams": "distrib_train.train_state", "TrainState": "distrib_train.train_state",
    "EvalStep": "distrib_train.train_step", "LossFunction": "distrib_train.train_step",
    "TrainStep": "distrib_train.train_step", "build_eval_step_fn": "distrib_train.train_step",
    "build_train_step_fn": "distrib_train.train_step",
    "generate": "distrib_train.training.generate",
}


def __getattr__(name: str) -> Any:
  if name in _SUBPACKAGES or (not name.startswith("_") and importlib.util.find_spec(f"distrib_train.{name}")):
    return importlib.import_module(f"distrib_train.{name}")  # any subpackage or module: dt.sharding, dt.training
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
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
    "EvalStep",
    "Hyperparams",
    "LossFunction",
    "MeshConfig",
    "MeshPlanner",
    "Plan",
    "PlanEntry",
    "RuleSkip",
    "TrainState",
    "TrainStep",
    "activation_sharding",
    "as_auto_mesh",
    "build_eval_step_fn",
    "build_mesh",
    "build_train_step_fn",
    "check_restorable",
    "constrain",
    "data",
    "generate",
    "models",
    "parallel",
    "recipes",
]
