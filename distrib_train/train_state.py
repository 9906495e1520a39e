"""``TrainState``: everything a training step reads and writes.

The fields and ``initial_state`` / ``.model`` follow penzai's v1
``TrainState``, so penzai-style loss functions and loops run unchanged; the
flax-style ``create`` / ``apply_gradients`` / ``replace`` live on the same
class for users coming from ``flax.training.train_state``. Not for: building
the step (``train_step.py``) or choosing shardings (``planner.py``).

Subclass ``TrainState`` (it is a ``flax.struct.PyTreeNode``) to carry extra
fields such as an EMA of the params or linen ``batch_stats`` — a field with
no default is fine, as in flax, since the base fields are keyword-only; fork
it only if the penzai fields themselves must change, since
``build_train_step_fn`` relies on them. Constructing and replacing take
flax's ``tx=`` as the name of ``optimizer_def``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import dataclasses
import functools

import jax
import optax
from flax import struct
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

from distrib_train import models
from distrib_train.common.naming import key_name
from distrib_train.models.pytree import IsParam

ModelPyTree = Any
LossStatePyTree = Any
OptimizerStatePyTree = Any
PRNGKeyArray = jax.Array


@dataclasses.dataclass(frozen=True)
class StateField:
  """One field of ``TrainState``: what a step, the planner and a checkpoint do with it.

  Attributes:
    name: the field's name on ``TrainState``.
    role: ``"counter"`` (the step), ``"rng"``, ``"trainable"`` (the optimizer
      updates it from its gradient), ``"frozen"`` (read by the step, never
      updated), ``"optimizer"`` (the optimizer's own state), ``"model_state"``
      (written by the forward pass: BatchNorm statistics, FP8 scales) or
      ``"loss_state"`` (the loss function's own); neither is differentiated.
    donated: a donating train step gives up its buffers and returns it anew.
    checkpointed: a checkpoint holds its arrays.
    layout: how the planner lays it out: ``"logical"`` (each leaf by its
      logical axes), ``"mirrors_params"`` (each leaf like the param it
      mirrors) or ``"replicated"``.
  """

  name: str
  role: str
  donated: bool
  checkpointed: bool
  layout: str


# The one list of TrainState's array fields. The step core, the planner, the
# plan's report, the memory check and the checkpoints read their field lists
# from here; a field a subclass adds (an EMA, say) is replicated, and only
# these fields are saved.
STATE_FIELDS = (
  StateField("step", "counter", donated=False, checkpointed=True, layout="replicated"),
  StateField("root_rng", "rng", donated=False, checkpointed=True, layout="replicated"),
  StateField("params", "trainable", donated=True, checkpointed=True, layout="logical"),
  # The rest of the model: frozen weights cannot be rebuilt from code, so
  # they are saved and an abstract target restores to a runnable state;
  # a run that reads them from a named source (a LoRA base from hf:)
  # saves that source instead (weights/init_from.py).
  # They are laid out by their logical axes, as params are (a frozen base
  # replicated on every chip would not fit); never in the optimizer.
  StateField("model_without_params", "frozen", donated=False, checkpointed=True, layout="logical"),
  StateField("opt_state", "optimizer", donated=True, checkpointed=True, layout="mirrors_params"),
  StateField("loss_fn_state", "loss_state", donated=True, checkpointed=True, layout="replicated"),
  StateField("local_state", "model_state", donated=True, checkpointed=True, layout="logical"),
)
_FIELDS_BY_NAME = {f.name: f for f in STATE_FIELDS}


def state_fields(
  *, donated: bool | None = None, checkpointed: bool | None = None, roles: tuple[str, ...] | None = None
) -> tuple[str, ...]:
  """The names of ``STATE_FIELDS`` that match every given filter, in the table's order."""
  return tuple(
    f.name
    for f in STATE_FIELDS
    if (donated is None or f.donated == donated)
    and (checkpointed is None or f.checkpointed == checkpointed)
    and (roles is None or f.role in roles)
  )


def state_field(name: str) -> StateField:
  """The table's row for ``name``; a field only a subclass has is replicated, not donated and not saved."""
  return _FIELDS_BY_NAME.get(name) or StateField(
    name, "loss_state", donated=False, checkpointed=False, layout="replicated"
  )


class Hyperparams(Mapping):
  """Read-only view of the hyperparameters ``optax.inject_hyperparams`` keeps.

  Found anywhere in the optimizer state, including inside ``optax.chain``.
  A name injected in two places is ambiguous: it is not listed, and reading
  it raises ``KeyError`` naming both places.
  """

  def __init__(self, found: Mapping[str, list[tuple[str, Any]]]):
    self._found = found

  def __getitem__(self, name: str) -> Any:
    if name not in self._found:
      known = ", ".join(map(repr, self._found)) or "none"
      raise KeyError(
        f"No injected hyperparameter {name!r} in the optimizer state;"
        f" injected: {known}. Wrap the optimizer in optax.inject_hyperparams"
        " to expose one."
      )
    places = self._found[name]
    if len(places) > 1:
      where = ", ".join(path for path, _ in places)
      raise KeyError(f"Hyperparameter {name!r} is injected in several places ({where}); read it from opt_state.")
    return places[0][1]

  def __contains__(self, name: object) -> bool:
    return len(self._found.get(name, ())) == 1

  def __iter__(self) -> Iterator[str]:
    # Names injected in several places are ambiguous: not listed.
    return (name for name, places in self._found.items() if len(places) == 1)

  def __len__(self) -> int:
    return sum(1 for _ in self)

  def __repr__(self) -> str:
    return f"Hyperparams({sorted(self._found)})"


def _has_hyperparams(node: Any) -> bool:
  return isinstance(getattr(node, "hyperparams", None), Mapping) and hasattr(node, "inner_state")


def _collect_hyperparams(tree: Any, prefix: str, found: dict[str, list[tuple[str, Any]]]) -> None:
  nodes, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_has_hyperparams)
  for path, node in nodes:
    if not _has_hyperparams(node):
      continue
    where = prefix + "".join(f"[{key_name(e)}]" for e in path)
    for name, value in node.hyperparams.items():
      found.setdefault(name, []).append((f"opt_state{where}.hyperparams", value))
    _collect_hyperparams(node.inner_state, f"{where}.inner_state", found)


def _tx_as_optimizer_def(kwargs: dict[str, Any]) -> dict[str, Any]:
  if "tx" in kwargs:
    if "optimizer_def" in kwargs:
      raise TypeError("Give the optimizer as tx= or as optimizer_def=, not both.")
    kwargs["optimizer_def"] = kwargs.pop("tx")
  return kwargs


def _accepting_tx(init: Callable[..., None]) -> Callable[..., None]:
  """Wraps a generated ``__init__`` so that flax's ``tx=`` names ``optimizer_def``."""
  if getattr(init, "_accepts_tx", False):
    return init

  @functools.wraps(init)
  def __init__(self, *args: Any, **kwargs: Any) -> None:
    init(self, *args, **_tx_as_optimizer_def(kwargs))

  __init__._accepts_tx = True
  return __init__


def _replace(self, **updates: Any):
  """A copy with some fields replaced; ``tx=`` is ``optimizer_def=``."""
  return dataclasses.replace(self, **_tx_as_optimizer_def(updates))


def optimized_part(tree: Any) -> Any:
  """The part of ``params`` (or of its gradients) the optimizer updates.

  flax's fp8 layers keep their scales and amax histories in an
  ``OVERWRITE_WITH_GRADIENT`` collection beside ``params``: the "gradient"
  of those is their next value, so they are overwritten, not optimized
  (flax's own ``TrainState`` does the same).
  """
  if isinstance(tree, Mapping) and OVERWRITE_WITH_GRADIENT in tree:
    return tree["params"]
  return tree


def apply_optimizer(
  optimizer_def: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any
) -> tuple[Any, Any]:
  """One optimizer update: ``(new_params, new_opt_state)``.

  An ``OVERWRITE_WITH_GRADIENT`` collection in ``params`` takes its value
  from ``grads``; the optimizer sees only ``params["params"]`` then.
  """
  with jax.named_scope("optimizer"):  # the plan counts the collectives of this scope apart (Muon's Newton–Schulz)
    updates, new_opt_state = optimizer_def.update(optimized_part(grads), opt_state, optimized_part(params))
    new_params = optax.apply_updates(optimized_part(params), updates)
  if isinstance(grads, Mapping) and OVERWRITE_WITH_GRADIENT in grads:
    new_params = {**params, "params": new_params, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
  return new_params, new_opt_state


class TrainState(struct.PyTreeNode, kw_only=True):
  """Collection of state for training, in penzai's v1 layout.

  The parameters are kept apart from the rest of the model so that the step
  differentiates, donates and checkpoints only them; ``.model`` rebuilds the
  whole model.

  Example (a one-matrix model as a plain pytree; run by the test suite):

    >>> import jax, jax.numpy as jnp, optax
    >>> from distrib_train import TrainState, build_train_step_fn
    >>> def loss_fn(*, model, state, rng, x, y):
    ...   loss = jnp.mean((x @ model["w"] - y) ** 2)
    ...   return loss, state, {"loss": loss}
    >>> state = TrainState.initial_state(
    ...     model={"w": jnp.zeros((3, 1))}, optimizer_def=optax.sgd(0.1), root_rng=jax.random.key(0))
    >>> step_fn = build_train_step_fn(loss_fn)
    >>> state, aux = step_fn(state, x=jnp.ones((4, 3)), y=jnp.ones((4, 1)))
    >>> state.step, float(aux["loss"])
    (1, 1.0)
    >>> state.params["w"].ravel().tolist()
    [0.2..., 0.2..., 0.2...]

  Attributes:
    step: current step; a Python int or a jax integer scalar.
    root_rng: base key; the step's key is ``fold_in(root_rng, step)``.
    params: the learned values (for plain pytree models a flat dict keyed by
      ``/``-joined path).
    model_without_params: the rest of the model, with ``ParamSlot`` markers
      where the params were; None for states made by ``create``.
    opt_state: the optimizer state of ``params``.
    loss_fn_state: state owned by the loss function (e.g. counters or
      batch statistics); never seen by the optimizer.
    optimizer_def: the optax optimizer (static).
    apply_fn: optional function kept for flax-style code (static).
    local_state: model state updated by the forward pass but not learned
      (nnx ``BatchStat`` variables, linen ``batch_stats``); the step carries,
      donates and shards it like ``loss_fn_state``. None for plain pytrees.
  """

  step: int | jax.Array
  root_rng: PRNGKeyArray | None = None
  params: Any = None
  model_without_params: ModelPyTree = None
  opt_state: OptimizerStatePyTree = None
  loss_fn_state: LossStatePyTree = None
  optimizer_def: optax.GradientTransformation = struct.field(pytree_node=False, default=None)
  apply_fn: Callable[..., Any] | None = struct.field(pytree_node=False, default=None)
  local_state: Any = None

  def __init_subclass__(cls, **kwargs: Any):
    # flax makes each subclass a dataclass here, with a generated __init__
    # and its own ``replace``; both must keep taking flax's name ``tx``.
    own_replace = "replace" in cls.__dict__
    super().__init_subclass__(**kwargs)
    cls.__init__ = _accepting_tx(cls.__init__)
    if not own_replace:
      cls.replace = _replace

  @classmethod
  def initial_state(
    cls,
    model: ModelPyTree,
    optimizer_def: optax.GradientTransformation,
    root_rng: PRNGKeyArray,
    loss_fn_state: LossStatePyTree = None,
    *,
    is_param: IsParam | None = None,
  ) -> TrainState:
    """Constructs the initial training state (step 0).

    Args:
      model: the model being optimized: an ``nnx.Module``, a
        ``models.LinenModel`` or any pytree.
      optimizer_def: the optax optimizer.
      root_rng: base key for per-step randomness.
      loss_fn_state: optional initial state for the loss function.
      is_param: optional choice of the parameters: for pytrees a
        ``(path, leaf) -> bool`` (default: every inexact-dtype array leaf),
        for nnx a filter (default ``nnx.Param``).

    Returns:
      The initial state, with ``opt_state = optimizer_def.init(params)``.
    """
    params, model_without_params, local_state = models.split_model(model, is_param)
    return cls(
      step=0,
      root_rng=root_rng,
      params=params,
      model_without_params=model_without_params,
      opt_state=optimizer_def.init(optimized_part(params)),
      loss_fn_state=loss_fn_state,
      optimizer_def=optimizer_def,
      local_state=local_state,
    )

  @classmethod
  def create(
    cls,
    *,
    apply_fn: Callable[..., Any] | None,
    params: Any,
    tx: optax.GradientTransformation,
    **kwargs: Any,
  ) -> TrainState:
    """flax-style constructor: step 0 and ``opt_state = tx.init(params)``.

    Other fields (``root_rng``, ``loss_fn_state``, ``model_without_params``,
    a subclass's own fields) may be given as keyword arguments. With no
    ``model_without_params``, ``.model`` is ``params`` itself, so a loss
    function receives the params and calls ``apply_fn`` on them. As in
    flax, an ``OVERWRITE_WITH_GRADIENT`` collection gets no optimizer state.

    Raises:
      TypeError: a keyword that names no field.
    """
    unknown = sorted(set(kwargs) - set(cls.__dataclass_fields__))
    if unknown:
      raise TypeError(f"{cls.__name__}.create got unknown field(s) {', '.join(unknown)}.")
    return cls(
      step=0, params=params, opt_state=tx.init(optimized_part(params)), optimizer_def=tx, apply_fn=apply_fn, **kwargs
    )

  @property
  def tx(self) -> optax.GradientTransformation:
    """The optimizer, under flax's name for it."""
    return self.optimizer_def

  @property
  def model(self) -> ModelPyTree:
    """The full model, including parameters and nonlearnable parts.

    For nnx this is a live module holding the current params and local
    state; for linen a ``LinenModel``.
    """
    return models.merge_model(self.model_without_params, self.params, self.local_state)

  @property
  def hyperparams(self) -> Hyperparams:
    """Hyperparameters injected by ``optax.inject_hyperparams``, by name.

    Example: ``state.hyperparams["learning_rate"]``, also when the injected
    optimizer sits inside ``optax.chain``.
    """
    found: dict[str, list[tuple[str, Any]]] = {}
    _collect_hyperparams(self.opt_state, "", found)
    return Hyperparams(found)

  def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
    """Applies one optimizer update; ``step`` goes up by one.

    As in flax, an ``OVERWRITE_WITH_GRADIENT`` collection (fp8 scales and
    amax histories) is overwritten by its gradient, not optimized.

    Args:
      grads: gradients with the structure of ``params``.
      **kwargs: other fields to replace at the same time (``tx=`` too).
    """
    params, opt_state = apply_optimizer(self.optimizer_def, grads, self.opt_state, self.params)
    return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)


# flax's dataclass gave TrainState a generated __init__ and its own replace.
TrainState.__init__ = _accepting_tx(TrainState.__init__)
TrainState.replace = _replace
