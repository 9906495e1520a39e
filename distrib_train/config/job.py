"""One job's setup: the model, its optimizer, the abstract train state, the batch and the axis rules.

The trainer and ``distrib-train plan`` build the same job from a ``Config``
— one through ``Trainer``, the other for a pod it emulates — so both build
it here::

  job = job_spec(config)                       # nothing is allocated
  planner = MeshPlanner(mesh, rules_for(config, mesh_config))
  plan = plan_job(job, planner)                # shardings for state and batch
  state = plan.init(job.make_state)            # the real, sharded state

The batch is what the data pipeline says it yields (``DataLoader.batch_schema``).

Not for: building the mesh (``sharding/mesh.py``), checking the plan
(``checks.py``) or compiling the step (the trainer; ``podplan``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from distrib_train.data.pipeline import DataLoader
from distrib_train import models, objectives
from distrib_train.recipes.family import Family, family_of
from distrib_train.sharding.axis_rules import AxisRules
from distrib_train.sharding.mesh import MeshConfig
from distrib_train.sharding.plan import Plan, logical_annotations_only
from distrib_train.sharding.planner import MeshPlanner
from distrib_train.train_state import TrainState
from distrib_train.optim import chain as optimizers
from distrib_train.common.yaml_loader import ConfigError
from distrib_train.data.config import DataConfig
from distrib_train.config.run import Config


@dataclasses.dataclass
class JobSpec:
  """What a job trains, abstractly: its state, its batch, its loss.

  Attributes:
    abstract_state: the ``TrainState`` as shapes and dtypes.
    inputs: the batch, by input name, as ``jax.ShapeDtypeStruct``.
    loss_fn: the penzai-style loss.
    input_axes: logical axes per input name.
    model_config: the reference model's config (None for a model given as code).
    family: what the job asks of the model (``recipes/family.py``): FLOPs, vocabulary, capabilities.
    make_state: builds the real state (``plan.init(job.make_state)``).
    optimizer: the optax optimizer in the state.
  """

  abstract_state: TrainState
  inputs: dict[str, jax.ShapeDtypeStruct]
  loss_fn: Callable[..., Any]
  input_axes: Mapping[str, Any]
  model_config: Any
  make_state: Callable[[], TrainState]
  optimizer: optax.GradientTransformation
  family: Family = dataclasses.field(default_factory=lambda: family_of(None))
  microbatches: int = 1
  pipeline_repeats: int = 1
  flops_scale: float = 1.0  # DPO's reference forward: a third more than the policy's forward and backward
  objective: objectives.Objective | None = None  # what it trains for (``objectives.Objective``)

  @property
  def tokens_per_step(self) -> int:
    shape = self.inputs["tokens"].shape if "tokens" in self.inputs else next(iter(self.inputs.values())).shape
    return math.prod(shape[:2])

  def model_flops_per_step(self) -> float | None:
    """Training FLOPs of one step by the model's own count, if it has one."""
    if "tokens" not in self.inputs:
      return None
    per_token = self.family.flops_per_token(self.inputs["tokens"].shape[1])
    return None if per_token is None else float(per_token) * self.tokens_per_step * self.flops_scale

  def param_count(self) -> int:
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(self.abstract_state.params))


@dataclasses.dataclass(frozen=True)
class ModelParts:
  """A job's model as the config or the caller gives it, resolved once: its objective (``objectives.Objective``:
  ``model_fn(seed)``, the loss, the inputs' logical axes, which variables train), the reference model's config
  (None for a model given as code) and its family."""

  objective: objectives.Objective
  model_config: Any
  family: Family

  model_fn = property(lambda self: self.objective.model_fn)
  loss_fn = property(lambda self: self.objective.loss_fn)
  input_axes = property(lambda self: self.objective.input_axes)
  is_param = property(lambda self: self.objective.is_param)
  flops_scale = property(lambda self: self.objective.flops_scale)


def model_parts(
  config: Config,
  *,
  model_fn: Callable[[int], Any] | None = None,
  loss_fn: Callable[..., Any] | None = None,
  input_axes: Mapping[str, Any] | None = None,
) -> ModelParts:
  """``model_fn``, ``loss_fn`` and ``input_axes`` where given, the config's reference model and objective for the
  rest."""
  recipe = config.model_recipe() if model_fn is None or loss_fn is None or input_axes is None else None
  model_config = recipe.config if recipe is not None and model_fn is None else None
  trainable = getattr(model_config, "trainable", None)
  is_param = trainable() if trainable is not None else None
  name = config.train.objective
  try:
    objective = objectives.build(
      name,
      recipe,
      model_config,
      is_param,
      getattr(config, name, None),
      model_fn=model_fn,
      loss_fn=loss_fn,
      input_axes=input_axes,
    )
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return ModelParts(objective, model_config, family_of(model_config))


def job_spec(
  config: Config,
  *,
  model_fn: Callable[[int], Any] | None = None,
  loss_fn: Callable[..., Any] | None = None,
  input_axes: Mapping[str, Any] | None = None,
  parts: ModelParts | None = None,
) -> JobSpec:
  """The job ``config`` describes; ``model_fn``, ``loss_fn`` and ``input_axes``
  replace the config's reference model (all three, or the recipe fills in), or ``parts`` resolved before."""
  parts = parts or model_parts(config, model_fn=model_fn, loss_fn=loss_fn, input_axes=input_axes)
  t = config.train
  optimizer = optimizers.build(
    config.optimizer,
    t.steps,
    t.nonfinite,
    param_axes=param_axes(parts, t.seed) if config.optimizer.name == "muon" else None,
  )

  def make_state() -> TrainState:
    return TrainState.initial_state(parts.model_fn(t.seed), optimizer, jax.random.key(t.seed), is_param=parts.is_param)

  with logical_annotations_only():
    abstract = jax.eval_shape(make_state)
  inputs = DataLoader.batch_schema(config.data_config())
  shape = inputs["tokens"].shape
  inputs.update({name: jax.ShapeDtypeStruct(shape, dtype) for name, dtype in parts.objective.extra_inputs.items()})
  return JobSpec(
    abstract,
    inputs,
    parts.loss_fn,
    parts.input_axes,
    parts.model_config,
    make_state,
    optimizer,
    family=parts.family,
    microbatches=t.microbatches,
    pipeline_repeats=t.pipeline_repeats,
    flops_scale=parts.flops_scale,
    objective=parts.objective,
  )


def param_axes(parts: ModelParts, seed: int = 0) -> dict[str, tuple[str | None, ...]]:
  """Each param's logical axes by ``/``-path, from the model built abstractly (Muon's matrices: ``muon.py``)."""
  with logical_annotations_only():
    state = jax.eval_shape(
      lambda: TrainState.initial_state(
        parts.model_fn(seed), optax.set_to_zero(), jax.random.key(seed), is_param=parts.is_param
      )
    )
  return dict(models.annotated_axes(state.model_without_params, state.params))


def packed_attention(family: Family, mesh: Any) -> bool:
  """Whether the model runs packed rows through cuDNN's packed layout on ``mesh``: a Hopper or newer
  GPU, ``model.attention`` auto or cudnn, ``model.max_segments`` > 0, no context axis (ring attention)."""
  from distrib_train.kernels.attention.cudnn import packs_rows

  caps = family.capabilities()
  return dict(mesh.shape).get("context", 1) == 1 and packs_rows(
    caps.max_segments, caps.attention, caps.dtype, mesh.devices.flat[0]
  )


def data_config(config: Config, family: Family, mesh: Any = None, *, packed: bool | None = None) -> DataConfig:
  """The run's data config: where the model runs cuDNN's packed attention on ``mesh`` (or where ``packed``
  says so), with packing and ``data.max_documents_per_row`` 0, rows hold what it takes: ``model.max_segments``
  - 1 documents.

  Raises:
    ConfigError: a larger ``data.max_documents_per_row`` than that.
  """
  packed = packed_attention(family, mesh) if packed is None else packed
  data, segments = config.data_config(), family.capabilities().max_segments if packed else 0
  if not (data.packing and segments):
    return data
  per_document = 2 if data.pairs else 1  # a preference pair is two segments
  if data.pairs and segments < 3:
    raise ConfigError(
      f"model.max_segments={segments} runs a row in cuDNN's packed attention, the padding included:"
      " too few for a preference pair's two segments; raise it to 3 at least."
    )
  if not data.max_documents_per_row:
    return dataclasses.replace(data, max_documents_per_row=(segments - 1) // per_document)
  if data.max_segments_per_row > segments - 1:
    raise ConfigError(
      f"data.max_documents_per_row={data.max_documents_per_row} is more than the model's packed"
      f" attention takes: model.max_segments={segments} runs a row, the padding included"
      f"{', and a preference pair takes two' if data.pairs else ''}; raise model.max_segments to"
      f" {data.max_segments_per_row + 1} or lower the data's."
    )
  return data


def step_options(job: JobSpec, plan: Plan, rules: AxisRules | None = None) -> dict[str, Any]:
  """``build_train_step_fn``'s options for the job: its microbatches and pipeline repeats, microbatches
  weighted by the objective's aux count (``Objective.weight``: a mean over pairs or tokens stays exact), and the
  plan's ``rules`` as the step's activation layout."""
  aux = dict(plan.aux_output_shardings) if isinstance(plan.aux_output_shardings, Mapping) else None
  weight = objectives.weight_in(aux, job.objective.weight if job.objective else None)
  return {
    "microbatches": job.microbatches,
    "pipeline_repeats": job.pipeline_repeats,
    "microbatch_weight": weight,
    "activation_rules": rules,
  }


def eval_step_options(job: JobSpec, rules: AxisRules | None = None) -> dict[str, Any]:
  """``build_eval_step_fn``'s: the pipeline's microbatches and repeats (they matter only with a stage axis), and
  the activation layout."""
  return {"microbatches": job.microbatches, "pipeline_repeats": job.pipeline_repeats, "activation_rules": rules}


def rules_for(config: Config, mesh_config: MeshConfig) -> AxisRules:
  """The mesh config's rules, else the config's rule set (``train.rules``)."""
  return mesh_config.rules if mesh_config.rules is not None else AxisRules(config.train.rules)


def rule_set_name(config: Config, mesh_config: MeshConfig) -> str:
  """Where ``rules_for`` took the rules from, for messages."""
  if mesh_config.rules is not None:
    return f"the rules of {mesh_config.source}"
  return f"rule set {config.train.rules!r} (train.rules)"


def plan_job(job: JobSpec, planner: MeshPlanner) -> Plan:
  """The shardings of the job's state, batch and aux outputs on the planner's mesh."""
  return planner.plan(job.abstract_state, loss_fn=job.loss_fn, inputs=job.inputs, input_axes=job.input_axes)
