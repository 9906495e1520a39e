"""From logical axis names to shardings on a device mesh.

- ``axis_rules``: ``AxisRules`` (logical name → mesh axes, in priority
  order), ``activation_sharding`` / ``constrain`` for activations.
- ``mesh``: ``MeshConfig`` (ICI × DCN axes, from ``mesh_configs/*.yaml``)
  and ``build_mesh``.
- ``planner``: ``MeshPlanner`` turns rules into the step's three sharding
  trees; ``plan``: the ``Plan`` it returns (report, sharded init).
"""

from distrib_train.sharding.axis_rules import AxisRules, RuleSkip, activation_sharding, constrain
from distrib_train.sharding.mesh import MeshConfig, build_mesh
from distrib_train.sharding.plan import Plan, PlanEntry
from distrib_train.sharding.planner import MeshPlanner

__all__ = [
  "AxisRules",
  "MeshConfig",
  "MeshPlanner",
  "Plan",
  "PlanEntry",
  "RuleSkip",
  "activation_sharding",
  "build_mesh",
  "constrain",
]
