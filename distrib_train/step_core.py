"""One train step and one evaluation as pure functions of the arrays they read.

``updated_params_and_states`` is a whole train step (loss, gradient — by
microbatches when asked — and the optimizer's update) and ``eval_outputs``
the loss function's aux with nothing updated; both take the state's parts
as separate arguments (``StepArrays``) and one static argument
(``StepStatics``). They are split from the wrapper that handles the
``TrainState`` (``train_step.py``) because that wrapper jits them: every
part of the state must be its own argument to be donated and sharded.
They keep their private names from before the split: the jitted executable
is named after its function (``jit__updated_params_and_states`` in logs,
profiles and out-of-memory errors), and only ``train_step.py`` calls them.

Not for: jit, donation, shardings or checking a step's arguments
(``train_step.py``, ``step_inputs.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import optax
from flax import nnx

import distrib_train.microbatches as microbatching
from distrib_train import models
from distrib_train.train_state import LossStatePyTree, ModelPyTree, PRNGKeyArray, apply_optimizer, state_fields

AuxOutPyTree = Any


class LossFunction(Protocol):
  """What ``build_train_step_fn`` expects of a loss function."""

  def __call__(
    self, *, model: ModelPyTree, state: LossStatePyTree, rng: PRNGKeyArray, **inputs: Any
  ) -> tuple[jax.Array, LossStatePyTree, AuxOutPyTree]:
    """Returns ``(scalar loss, new state like ``state``, aux outputs)``."""


class StepArrays(NamedTuple):
  """The step core's dynamic arguments, by name, in the order of its parameters.

  Every part of the state is its own argument so that ``jax.jit`` can donate
  exactly ``DONATED`` and shard each part. The non-param model arrays come
  as a flat leaf list (their structure is static) so that shardings planned
  on an equal-but-rebuilt model still line up.
  """

  params: Any
  model_leaves: list[Any]
  opt_state: Any
  loss_fn_state: Any
  local_state: Any
  root_rng: PRNGKeyArray | None
  step: int | jax.Array
  inputs: dict[str, Any]


class StepStatics(NamedTuple):
  """The step core's one static argument, ``statics``: jit compiles once per distinct value."""

  model_treedef: Any
  optimizer_def: optax.GradientTransformation
  loss_fn: LossFunction
  microbatches: int = 1
  microbatch_weight: str | None = None
  pipelining: microbatching.Pipelining | None = None  # set when the mesh has a stage axis of size > 1
  input_shardings: tuple[tuple[str, Any], ...] = ()
  # The (mesh, rules) the model's activations are laid out by while the step is traced (``constrain``, and the
  # parallel paths that read it: ring attention, expert dispatch, the pipeline); part of jit's cache key.
  activation: tuple[Any, Any] | None = None


def _activations(statics: StepStatics) -> Any:
  """The trace's activation layout: the rules' ``on(mesh)`` (``AxisRules.on``: ``activation_sharding``)."""
  if statics.activation is None:
    return contextlib.nullcontext()
  mesh, rules = statics.activation
  return rules.on(mesh)


# The arguments a donating train step gives up: the state it returns anew.
DONATED = state_fields(donated=True)


def updated_params_and_states(
  params: Any,
  model_leaves: list[Any],
  opt_state: Any,
  loss_fn_state: Any,
  local_state: Any,
  root_rng: PRNGKeyArray | None,
  step: int | jax.Array,
  inputs: dict[str, Any],
  statics: StepStatics,
) -> tuple[Any, Any, Any, Any, AuxOutPyTree, Any]:
  """One step as a pure function of the arrays it reads (``StepArrays``), traced in its activation layout."""
  with _activations(statics):
    return _train(params, model_leaves, opt_state, loss_fn_state, local_state, root_rng, step, inputs, statics)


def _train(params, model_leaves, opt_state, loss_fn_state, local_state, root_rng, step, inputs, statics):
  # States made by TrainState.create may have no key; the loss gets None then.
  step_rng = None if root_rng is None else jax.random.fold_in(root_rng, step)
  model_without_params = jax.tree_util.tree_unflatten(statics.model_treedef, model_leaves)

  def loss_and_outputs(current_params, loss_fn_state, local_state, rng, inputs):
    model = models.merge_model(model_without_params, current_params, local_state, rng=rng)
    out = _call_loss(statics, model, loss_fn_state, rng, inputs)
    if not isinstance(out, tuple) or len(out) != 3:
      raise TypeError(
        f"The loss function must return (loss, new_state, aux); it returned a"
        f" {type(out).__name__}{f' of length {len(out)}' if isinstance(out, tuple) else ''}."
      )
    loss, new_state, aux = out
    if getattr(loss, "shape", None) != ():
      raise TypeError(f"The loss must be a scalar; the loss function returned shape {getattr(loss, 'shape', None)}.")
    # Local state (e.g. BatchNorm statistics) the forward pass updated.
    new_local_state = models.local_state_of(model_without_params, model, local_state)
    return loss, (new_state, new_local_state, aux)

  grad_fn = jax.grad(loss_and_outputs, has_aux=True)
  overwritten = models.overwritten_by_gradient(model_without_params, local_state)
  if overwritten is not None:
    grad_fn = _overwriting_with_gradient(loss_and_outputs, overwritten)
  if statics.microbatches > 1 and statics.pipelining is None:
    grads, new_loss_fn_state, new_local_state, aux = microbatching.accumulate(
      grad_fn,
      params,
      loss_fn_state,
      local_state,
      step_rng,
      inputs,
      statics.microbatches,
      statics.microbatch_weight,
      dict(statics.input_shardings),
    )
  else:
    grads, (new_loss_fn_state, new_local_state, aux) = grad_fn(params, loss_fn_state, local_state, step_rng, inputs)
  new_params, new_opt_state = apply_optimizer(statics.optimizer_def, grads, opt_state, params)
  # The next step counter comes out of the step itself: an eager ``step + 1``
  # on a device counter would be one more dispatch per step, queued behind it.
  return new_params, new_opt_state, new_loss_fn_state, new_local_state, aux, step + 1


def _overwriting_with_gradient(loss_and_outputs: Callable[..., Any], marks: tuple[bool, ...]) -> Callable[..., Any]:
  """``jax.grad(loss_and_outputs)`` that also differentiates the marked local-state leaves and returns their
  gradients as their next values (nnx ``OverwriteWithGradient``: FP8 amax histories written by the backward
  pass); the params' gradients are unchanged."""

  def with_marked(current_params, marked, loss_fn_state, local_state, rng, inputs):
    leaves, treedef = jax.tree_util.tree_flatten(local_state)
    values = iter(marked)
    local_state = treedef.unflatten([next(values) if m else leaf for leaf, m in zip(leaves, marks)])
    return loss_and_outputs(current_params, loss_fn_state, local_state, rng, inputs)

  both = jax.grad(with_marked, argnums=(0, 1), has_aux=True)

  def grad_fn(current_params, loss_fn_state, local_state, rng, inputs):
    marked = [leaf for leaf, m in zip(jax.tree_util.tree_leaves(local_state), marks) if m]
    (grads, written), (new_loss_fn_state, new_local_state, aux) = both(
      current_params, marked, loss_fn_state, local_state, rng, inputs
    )
    leaves, treedef = jax.tree_util.tree_flatten(new_local_state)
    written = iter(written)
    new_local_state = treedef.unflatten(
      [next(written).astype(leaf.dtype) if m else leaf for leaf, m in zip(leaves, marks)]
    )
    return grads, (new_loss_fn_state, new_local_state, aux)

  return grad_fn


def _call_loss(statics: StepStatics, model: Any, loss_fn_state: Any, rng: Any, inputs: dict[str, Any]) -> Any:
  """The loss function on ``model``; through the pipeline when the step has one."""
  if statics.pipelining is None:
    return statics.loss_fn(model=model, state=loss_fn_state, rng=rng, **inputs)
  with microbatching.pipelining(statics.pipelining) as use:
    out = statics.loss_fn(model=model, state=loss_fn_state, rng=rng, **inputs)
  microbatching.check_used(use, model)
  return out


def eval_outputs(
  params: Any,
  model_leaves: list[Any],
  opt_state: Any,
  loss_fn_state: Any,
  local_state: Any,
  root_rng: PRNGKeyArray | None,
  step: int | jax.Array,
  inputs: dict[str, Any],
  statics: StepStatics,
) -> AuxOutPyTree:
  """The loss function's aux on the current state: no gradient, no update.

  nnx modules are switched to eval mode first (BatchNorm reads its running
  statistics, Dropout is off); the local state is read, never written.
  """
  del opt_state
  step_rng = None if root_rng is None else jax.random.fold_in(root_rng, step)
  model_without_params = jax.tree_util.tree_unflatten(statics.model_treedef, model_leaves)
  model = models.merge_model(model_without_params, params, local_state, rng=step_rng)
  if isinstance(model, nnx.Module):
    model.eval()
  with _activations(statics):
    return _call_loss(statics, model, loss_fn_state, step_rng, inputs)[2]
