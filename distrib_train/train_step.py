"""The train step: ``build_train_step_fn``, penzai's contract, sharded.

``build_train_step_fn(loss_fn, ...)`` returns ``step(train_state, **inputs)
-> (new_train_state, aux)``. The loss function is called as
``loss_fn(model=, state=, rng=, **inputs)`` and returns ``(loss, new_state,
aux)``; the step's key is ``fold_in(root_rng, step)``. What a step computes
is in ``step_core.py`` (pure functions); this module jits it with the
planned shardings and donation, and checks and places its arguments. Not
for: choosing the shardings (``planner.py``) or running a loop
(``trainer.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding

import distrib_train.microbatches as microbatching
from distrib_train.common.auto_mesh import as_auto_mesh
from distrib_train.step_core import (
  DONATED,
  AuxOutPyTree,
  LossFunction,
  eval_outputs,
  StepArrays,
  StepStatics,
  updated_params_and_states,
)
from distrib_train.step_inputs import check_loss_fn_accepts, distinct_buffers, on_auto_mesh
from distrib_train.train_state import TrainState


class _JittedCore:
  """What the train and eval steps share: a core function, jitted with the
  planned shardings, and the checking and placing of its arguments.

  The core is called as ``core(*arrays, statics)``: ``jax.jit`` takes
  shardings only for positional arguments, so ``StepArrays`` lists them in
  the core's parameter order, while donation and the static argument go by
  name.
  """

  def __init__(
    self,
    core: Any,
    loss_fn: LossFunction,
    *,
    jit: bool,
    donate: bool,
    train_state_shardings: TrainState | None,
    input_kwarg_shardings: dict[str, Any] | None,
    out_shardings: Any,
    microbatches: int = 1,
    microbatch_weight: str | None = None,
    pipeline_repeats: int = 1,
    accumulate: bool = True,
    activation_rules: Any = None,
  ):
    self.loss_fn = loss_fn
    self.input_kwarg_shardings = input_kwarg_shardings
    self.donate = donate
    # The mesh of the planned shardings, entered when the caller's context
    # mesh has Explicit axes (jax.set_mesh(jax.make_mesh(...))).
    self._mesh = next(
      (s.mesh for s in jax.tree_util.tree_leaves(train_state_shardings) if isinstance(s, NamedSharding)), None
    )
    if not isinstance(microbatches, int) or microbatches < 1:
      raise ValueError(f"microbatches must be a positive int, got {microbatches!r}.")
    if not isinstance(pipeline_repeats, int) or pipeline_repeats < 1:
      raise ValueError(f"pipeline_repeats must be a positive int, got {pipeline_repeats!r}.")
    pipelining = None
    if microbatching.stages_of(self._mesh) > 1:
      # The stage axis pipelines the model's layer stack; the microbatches are the pipeline's.
      pipelining = microbatching.Pipelining(self._mesh, microbatches, pipeline_repeats)
      pipelining.check()
    elif pipeline_repeats > 1:
      raise ValueError(
        f"pipeline_repeats is {pipeline_repeats}, but the step's mesh has no stage axis"
        " (give train_state_shardings planned on a mesh with a stage axis of size > 1)."
      )
    self.pipelining = pipelining
    if activation_rules is not None and self._mesh is None:
      raise ValueError(
        "activation_rules lays the activations out on the shardings' mesh: give train_state_shardings too."
      )
    self._options = dict(
      activation=None if activation_rules is None else (self._mesh, activation_rules),
      microbatches=microbatches if accumulate or pipelining is not None else 1,
      microbatch_weight=microbatch_weight,
      pipelining=pipelining,
      input_shardings=tuple(
        (name, sharding)
        for name, sharding in (input_kwarg_shardings or {}).items()
        if isinstance(sharding, NamedSharding)
      ),
    )
    if jit:
      ts = train_state_shardings
      in_shardings = StepArrays(
        params=None if ts is None else ts.params,
        model_leaves=None if ts is None else list(jax.tree_util.tree_leaves(ts.model_without_params)),
        opt_state=None if ts is None else ts.opt_state,
        loss_fn_state=None if ts is None else ts.loss_fn_state,
        local_state=None if ts is None else ts.local_state,
        root_rng=None,  # penzai ignores its sharding, and so do we.
        step=None,
        inputs=None if input_kwarg_shardings is None else dict(input_kwarg_shardings),
      )
      core = jax.jit(
        core,
        static_argnames=("statics",),
        donate_argnames=DONATED if donate else (),
        in_shardings=tuple(in_shardings),
        out_shardings=out_shardings,
      )
    self._core = core
    self._compiled = None
    self._checked_inputs: set[str] | None = None

  def _arguments(self, train_state: TrainState, inputs: Mapping[str, Any]) -> tuple[StepArrays, StepStatics]:
    if not isinstance(train_state, TrainState):
      raise TypeError(f"The train step takes a TrainState first, got {type(train_state).__name__}.")
    if self.input_kwarg_shardings is not None and set(inputs) != set(self.input_kwarg_shardings):
      missing = sorted(set(self.input_kwarg_shardings) - set(inputs))
      extra = sorted(set(inputs) - set(self.input_kwarg_shardings))
      raise ValueError(
        "The step's inputs differ from input_kwarg_shardings:"
        + (f" missing {', '.join(missing)};" if missing else "")
        + (f" not in the shardings {', '.join(extra)};" if extra else "")
        + " give a sharding for every input and pass every input."
      )
    if self._checked_inputs != set(inputs):  # once per set of input names, before the first trace
      check_loss_fn_accepts(self.loss_fn, inputs)
      self._checked_inputs = set(inputs)
    if self.input_kwarg_shardings is None:
      inputs = jax.tree_util.tree_map(on_auto_mesh, dict(inputs))
    else:
      inputs = {
        name: jax.tree_util.tree_map(on_auto_mesh, value, self.input_kwarg_shardings[name])
        if isinstance(self.input_kwarg_shardings[name], NamedSharding) and isinstance(value, jax.Array)
        else jax.tree_util.tree_map(on_auto_mesh, value)
        for name, value in inputs.items()
      }
    model_leaves, model_treedef = jax.tree_util.tree_flatten(train_state.model_without_params)
    donated = tuple(getattr(train_state, name) for name in DONATED)
    if self.donate:
      donated = distinct_buffers(donated)
    arrays = StepArrays(
      model_leaves=model_leaves,
      root_rng=train_state.root_rng,
      step=train_state.step,
      inputs=dict(inputs),
      **dict(zip(DONATED, donated)),
    )
    return arrays, StepStatics(model_treedef, train_state.optimizer_def, self.loss_fn, **self._options)

  def _mesh_context(self):
    context = jax.sharding.get_abstract_mesh()
    if context.empty or context.are_all_axes_auto:
      return contextlib.nullcontext()
    return jax.set_mesh(self._mesh or as_auto_mesh(jax.sharding.get_mesh()))

  def run(self, train_state: TrainState, inputs: Mapping[str, Any]) -> Any:
    """The core's outputs for this state and these inputs."""
    with self._mesh_context():
      arrays, statics = self._arguments(train_state, inputs)
      if self._compiled is not None:
        return self._compiled(*arrays)
      return self._core(*arrays, statics)

  def lower(self, train_state: TrainState, inputs: Mapping[str, Any]) -> jax.stages.Lowered:
    if not hasattr(self._core, "lower"):
      raise ValueError("This step was built with jit=False; there is nothing to lower.")
    with self._mesh_context():
      arrays, statics = self._arguments(train_state, inputs)
      return self._core.lower(*arrays, statics)

  def compile(
    self, train_state: TrainState, compiler_options: Mapping[str, Any] | None, inputs: Mapping[str, Any]
  ) -> jax.stages.Compiled:
    lowered = self.lower(train_state, inputs)
    self._compiled = lowered.compile(dict(compiler_options)) if compiler_options else lowered.compile()
    return self._compiled


class TrainStep:
  """A built train step; call it as ``step(train_state, **inputs)``.

  Also offers ``lower(train_state, **inputs)`` for ahead-of-time compilation
  (abstract ``jax.ShapeDtypeStruct`` leaves are fine there).
  """

  def __init__(
    self,
    loss_fn,
    jit,
    donate,
    train_state_shardings,
    input_kwarg_shardings,
    aux_output_shardings,
    microbatches=1,
    microbatch_weight=None,
    pipeline_repeats=1,
    activation_rules=None,
  ):
    ts = train_state_shardings
    out_shardings = (
      None if ts is None else ts.params,
      None if ts is None else ts.opt_state,
      None if ts is None else ts.loss_fn_state,
      None if ts is None else ts.local_state,
      aux_output_shardings,
      None,  # step + 1: where the step counter's arguments put it
    )
    self._core = _JittedCore(
      updated_params_and_states,
      loss_fn,
      jit=jit,
      donate=donate,
      train_state_shardings=train_state_shardings,
      input_kwarg_shardings=input_kwarg_shardings,
      out_shardings=out_shardings,
      microbatches=microbatches,
      microbatch_weight=microbatch_weight,
      pipeline_repeats=pipeline_repeats,
      activation_rules=activation_rules,
    )
    self.microbatches = microbatches

  @property
  def loss_fn(self) -> LossFunction:
    return self._core.loss_fn

  @property
  def pipelining(self) -> microbatching.Pipelining | None:
    """The pipeline the step runs (its mesh has a stage axis of size > 1), else None."""
    return self._core.pipelining

  @property
  def input_kwarg_shardings(self) -> dict[str, Any] | None:
    return self._core.input_kwarg_shardings

  @property
  def donate(self) -> bool:
    return self._core.donate

  def __call__(self, train_state: TrainState, **inputs: Any) -> tuple[TrainState, AuxOutPyTree]:
    params, opt_state, loss_fn_state, local_state, aux, next_step = self._core.run(train_state, inputs)
    # A Python int counter stays a Python int (penzai's); a device counter
    # takes the step's own output.
    step = train_state.step
    new_state = train_state.replace(
      step=step + 1 if isinstance(step, int) else next_step,
      params=params,
      opt_state=opt_state,
      loss_fn_state=loss_fn_state,
      local_state=local_state,
    )
    return new_state, aux

  def lower(self, train_state: TrainState, **inputs: Any) -> jax.stages.Lowered:
    """Lowers the jitted step for these (possibly abstract) arguments."""
    return self._core.lower(train_state, inputs)

  def compile(
    self, train_state: TrainState, *, compiler_options: Mapping[str, Any] | None = None, **inputs: Any
  ) -> jax.stages.Compiled:
    """Compiles ahead of time for these (possibly abstract) arguments.

    Later calls run the compiled executable directly (no tracing); they must
    then match these shapes, dtypes and shardings exactly. Returns the
    ``jax.stages.Compiled`` (``memory_analysis()``, ``cost_analysis()``).

    Args:
      train_state: a concrete or abstract state.
      compiler_options: XLA options for this executable only (e.g.
        ``{"xla_gpu_enable_latency_hiding_scheduler": True}``).
      **inputs: the step's inputs (arrays or ``jax.ShapeDtypeStruct``).
    """
    return self._core.compile(train_state, compiler_options, inputs)


def build_train_step_fn(
  loss_fn: LossFunction,
  jit: bool = True,
  donate_params_and_state: bool = False,
  train_state_shardings: TrainState | None = None,
  input_kwarg_shardings: dict[str, Any] | None = None,
  aux_output_shardings: AuxOutPyTree | None = None,
  *,
  microbatches: int = 1,
  microbatch_weight: str | None = None,
  pipeline_repeats: int = 1,
  activation_rules: Any = None,
) -> TrainStep:
  """Builds a train step function, with penzai's signature and semantics.

  The step returns ``(new_train_state, aux)`` where ``aux`` is the loss
  function's third output (return the loss in ``aux`` too to see it).

  Args:
    loss_fn: ``loss_fn(*, model, state, rng, **inputs) -> (loss, new_state,
      aux)``.
    jit: whether to compile the step with ``jax.jit``.
    donate_params_and_state: donate the old params, opt_state,
      loss_fn_state and local_state buffers (earlier references to them
      break). The rest of the model, ``root_rng`` and the inputs are not
      donated.
    train_state_shardings: a ``TrainState`` whose leaves are shardings (e.g.
      ``Plan.train_state_shardings``); the step's inputs and outputs follow
      it. Shardings for ``step`` and ``root_rng`` are ignored.
    input_kwarg_shardings: input name → sharding; then every call must pass
      exactly these inputs.
    aux_output_shardings: a pytree of shardings for ``aux``.
    microbatches: split the batch into this many microbatches inside the
      step (``microbatches.py``). Without a stage axis: gradient
      accumulation, float32, one optimizer update; the loss function's
      state and local state are threaded through the microbatches; float
      aux leaves are averaged, integer ones summed. With a stage axis of
      size > 1 in the shardings' mesh: the pipeline's microbatches.
    microbatch_weight: the name of a scalar in aux (e.g. ``"tokens"``)
      that weights each microbatch's loss, gradient and aux (and is itself
      summed), so that a per-token mean equals the whole batch's; None
      weighs microbatches equally.
    pipeline_repeats: the pipeline's rounds through the stages (1: GPipe;
      more: the circular schedule, a smaller bubble; needs a stage axis).
    activation_rules: an ``AxisRules`` (the plan's; anything with ``on(mesh)``): the step is traced in
      ``activation_sharding(mesh, activation_rules)`` on the shardings'
      mesh, so the model's activation constraints and the paths that read
      them (ring attention on a context axis, expert dispatch, the
      pipeline) are the step's own input, wherever it is traced; None: the
      caller's ``activation_sharding``, if any, applies.

  Returns:
    The step, a ``TrainStep`` (callable; ``.lower`` for ahead-of-time use).

  Raises:
    ValueError: ``donate_params_and_state`` without ``jit``.
  """
  if donate_params_and_state and not jit:
    raise ValueError("Cannot donate params and state unless jit=True; pass jit=True or donate_params_and_state=False.")
  return TrainStep(
    loss_fn,
    jit,
    donate_params_and_state,
    train_state_shardings,
    input_kwarg_shardings,
    aux_output_shardings,
    microbatches=microbatches,
    microbatch_weight=microbatch_weight,
    pipeline_repeats=pipeline_repeats,
    activation_rules=activation_rules,
  )


class EvalStep:
  """A built eval step; ``eval_step(train_state, **inputs)`` returns aux.

  Checks and places its arguments as the train step does; nothing is
  donated or updated. ``lower`` and ``compile`` work as on ``TrainStep``.
  """

  def __init__(
    self,
    loss_fn,
    jit,
    train_state_shardings,
    input_kwarg_shardings,
    aux_output_shardings,
    microbatches=1,
    pipeline_repeats=1,
    activation_rules=None,
  ):
    # Microbatches matter to eval only as a pipeline's; without one the whole batch runs at once.
    self._core = _JittedCore(
      eval_outputs,
      loss_fn,
      jit=jit,
      donate=False,
      train_state_shardings=train_state_shardings,
      input_kwarg_shardings=input_kwarg_shardings,
      out_shardings=aux_output_shardings,
      microbatches=microbatches,
      pipeline_repeats=pipeline_repeats,
      accumulate=False,
      activation_rules=activation_rules,
    )

  @property
  def loss_fn(self) -> LossFunction:
    return self._core.loss_fn

  @property
  def input_kwarg_shardings(self) -> dict[str, Any] | None:
    return self._core.input_kwarg_shardings

  def __call__(self, train_state: TrainState, **inputs: Any) -> AuxOutPyTree:
    return self._core.run(train_state, inputs)

  def lower(self, train_state: TrainState, **inputs: Any) -> jax.stages.Lowered:
    """Lowers the jitted eval step for these (possibly abstract) arguments."""
    return self._core.lower(train_state, inputs)

  def compile(
    self, train_state: TrainState, *, compiler_options: Mapping[str, Any] | None = None, **inputs: Any
  ) -> jax.stages.Compiled:
    """Compiles ahead of time, as ``TrainStep.compile`` does."""
    return self._core.compile(train_state, compiler_options, inputs)


def build_eval_step_fn(
  loss_fn: LossFunction,
  jit: bool = True,
  train_state_shardings: TrainState | None = None,
  input_kwarg_shardings: dict[str, Any] | None = None,
  aux_output_shardings: AuxOutPyTree | None = None,
  *,
  microbatches: int = 1,
  pipeline_repeats: int = 1,
  activation_rules: Any = None,
) -> EvalStep:
  """Builds an eval step: the loss function's aux, with nothing updated.

  Built like the train step (same loss function, same shardings). nnx
  modules run in eval mode (``model.eval()``); for linen, pass a loss
  function that calls the module in its eval mode. Nothing is donated.
  ``microbatches`` and ``pipeline_repeats`` apply only to a pipeline (a
  stage axis in the shardings' mesh); otherwise the whole batch is
  evaluated at once. ``activation_rules`` as the train step's.

  Returns:
    ``eval_step(train_state, **inputs) -> aux``.
  """
  return EvalStep(
    loss_fn,
    jit,
    train_state_shardings,
    input_kwarg_shardings,
    aux_output_shardings,
    microbatches=microbatches,
    pipeline_repeats=pipeline_repeats,
    activation_rules=activation_rules,
  )
