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

The run's config and loop are ``distrib_train.training``; joining processes
is ``distrib_train.cluster``; the ``plan`` command is
``distrib_train.podplan``. ``ARCHITECTURE.md`` says what lives where.
"""

from distrib_train import data, models, parallel, recipes
from distrib_train.checkpoint import CheckpointError, CheckpointManager, CheckpointWriteError, check_restorable
from distrib_train.common.auto_mesh import as_auto_mesh
from distrib_train.sharding.axis_rules import AxisRules, RuleSkip, activation_sharding, constrain
from distrib_train.sharding.mesh import MeshConfig, build_mesh
from distrib_train.sharding.plan import Plan, PlanEntry
from distrib_train.sharding.planner import MeshPlanner
from distrib_train.train_state import Hyperparams, TrainState
from distrib_train.train_step import EvalStep, LossFunction, TrainStep, build_eval_step_fn, build_train_step_fn

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
    "models",
    "parallel",
    "recipes",
]
