"""Sharded, async, atomic checkpoints of a ``TrainState`` on orbax.

``CheckpointManager(directory)`` wraps ``orbax.checkpoint.CheckpointManager``
with three items per step:

- ``state``: step, root_rng, params, opt_state, loss_fn_state, local_state
  and the arrays among the model's non-learned parts (frozen weights, integer
  tables, RNG-stream keys) as a nested dict of arrays, written through
  tensorstore (OCDBT), each process writing its own shards;
- ``data``: the data iterators' state (grain's handler, one file per process),
  when an iterator is given;
- ``meta``: JSON — format version, mesh axes and shape, package versions, the
  PRNG key implementations, and whatever run metadata the caller passes.

Old steps past ``max_to_keep`` leave by one rename into ``directory/.deleted/`` and are removed there
(``retention.py``), so a kill mid-deletion never leaves half a step among the listed ones.

The static parts (the model's structure and config, ``optimizer_def``) are not saved: they are rebuilt from code
and config, and ``restore`` fills a target state (concrete or ``jax.eval_shape``-abstract, leaves carrying the
shardings to restore onto) — so a checkpoint restores onto any mesh or device count. Nothing is pickled;
restoring runs no code from the checkpoint.

The on-disk layout and the read-only checks (``check_restorable``, the errors a damaged or foreign checkpoint
gets) are in ``checks.py``; what a storage fault (a full disk) raises and silences is in ``faults.py``; how a
data iterator's state is kept and what it restores from, in ``data_state.py``.

Not for: choosing what to save when (``trainer.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.checkpoint_managers import preservation_policy as preservation

from distrib_train.checkpoint import data_state, retention
from distrib_train.common.exit_hooks import register_early
from distrib_train.checkpoint.checks import check_restorable  # noqa: F401 (public here too)
from distrib_train.checkpoint.checks import (
  MODEL_FIELDS,
  SAVED_FIELDS,
  CheckpointError,
  abstract_target,
  check_matches,
  first_line,
  held_fields,
  read_meta,
  step_meta,
)
from distrib_train.checkpoint.faults import (
  CheckpointWriteError,
  finish_at_exit,
  is_storage_failure,
  finish_event_loops_before_closing,
  write_error,
)
from distrib_train.checkpoint.tree import fill_fields, flatten_fields, is_prng_key, nest, unnest
from distrib_train.train_state import TrainState


class CheckpointManager:
  """Saves and restores ``TrainState``s (and data-iterator state) with orbax.

  Every process of a job constructs it and calls ``save`` / ``restore``;
  orbax coordinates them. ``directory`` must be storage all hosts see (GCS,
  NFS, Lustre) and may be a local path or any URL orbax accepts (``gs://…``).

  Example::

    with CheckpointManager(workdir / "checkpoints", max_to_keep=3) as ckpt:
      if ckpt.latest_step() is not None:
        state = ckpt.restore(plan.abstract_train_state)
      ...
      ckpt.save(int(state.step), state)

  Args:
    directory: where the step directories go.
    max_to_keep: keep the newest N checkpoints (None: all).
    keep_every_n_steps: also keep every checkpoint whose step is a multiple
      of N, forever.
    keep_steps: also keep these steps (a ``wsd`` run's last stable step).
    save_interval_steps: ``save`` writes only steps that are multiples of it
      (unless ``force=True``).
    async_save: return from ``save`` once the arrays are copied to host
      memory and write in the background.
    metadata: JSON-able run metadata (config, model name) saved in ``meta``.
    saved_fields: the ``TrainState`` fields saved (default all of
      ``SAVED_FIELDS``); a run whose frozen weights come from a source it
      names in ``metadata`` leaves them out, and a restore then takes them
      from its concrete target.

  Raises:
    ValueError: bad retention numbers, or a directory that cannot be
      created or written — checked here, not at the first save.
  """

  def __init__(
    self,
    directory: str | epath.PathLike,
    *,
    max_to_keep: int | None = 3,
    keep_every_n_steps: int | None = None,
    keep_steps: tuple[int, ...] = (),
    save_interval_steps: int = 1,
    async_save: bool = True,
    metadata: Mapping[str, Any] | None = None,
    saved_fields: tuple[str, ...] = SAVED_FIELDS,
  ):
    if not set(saved_fields) <= set(SAVED_FIELDS) or not saved_fields:
      raise ValueError(f"saved_fields must be some of {', '.join(SAVED_FIELDS)}, got {saved_fields!r}.")
    self.saved_fields = tuple(f for f in SAVED_FIELDS if f in saved_fields)
    for name, value in (("max_to_keep", max_to_keep), ("keep_every_n_steps", keep_every_n_steps)):
      if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}.")
    if isinstance(save_interval_steps, bool) or not isinstance(save_interval_steps, int) or save_interval_steps < 1:
      raise ValueError(f"save_interval_steps must be a positive integer, got {save_interval_steps!r}.")
    self.directory = epath.Path(directory)
    self._check_writable()
    self._remove_stale_tmp()
    self.metadata = dict(metadata or {})
    policies = [preservation.LatestN(max_to_keep)]
    if keep_every_n_steps is not None:
      policies.append(preservation.EveryNSteps(keep_every_n_steps))
    if keep_steps:
      policies.append(preservation.CustomSteps(list(keep_steps)))
    self.save_interval_steps = save_interval_steps
    options = ocp.CheckpointManagerOptions(
      # The interval is applied in save(): orbax would also save the first
      # step whatever it is.
      preservation_policy=preservation.AnyPreservationPolicy(policies),
      enable_async_checkpointing=async_save,
      # Stale temporary directories are removed in _remove_stale_tmp below:
      # orbax's own cleanup runs in a background thread that close() does
      # not wait for, and it failed noisily at interpreter exit.
      cleanup_tmp_directories=False,
      # Old steps leave by one rename, not file by file in place (retention.py).
      todelete_subdir=retention.DELETED,
      # A step directory that cannot be created (a read-only or full disk)
      # then fails save() at once; created in the background, the failure
      # left orbax waiting for its "directory created" signal for 20 minutes.
      async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
      create=True,
    )
    handlers = {
      "state": ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=False),
      "meta": ocp.JsonCheckpointHandler(),
    }
    try:  # the data pipeline's own handler; grain is optional for the core
      import grain

      handlers["data"] = grain.checkpoint.CheckpointHandler()
    except ImportError:
      pass
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    self._closed = False
    finish_event_loops_before_closing()
    self._pending_step: int | None = None  # the step an unfinished async save is writing
    self._deleted = retention.DeletedSteps(self.directory)
    self._deleted.empty()  # what a killed run left there too
    self._failed = False  # a CheckpointWriteError was raised
    # Registered with threading's exit hooks, which run before the thread
    # pools that orbax's background write needs are shut down (plain atexit
    # runs after, and the pending checkpoint was lost). Later registrations
    # run first, so this precedes concurrent.futures' own hook.
    register_early(finish_at_exit, self)  # held: a dropped manager's save still lands

  def _remove_stale_tmp(self) -> None:
    """Deletes what an interrupted save left (never a committed step)."""
    if jax.process_index() != 0:
      return
    for path in self.directory.glob("*.orbax-checkpoint-tmp*"):
      path.rmtree() if path.is_dir() else path.unlink()

  def _check_writable(self) -> None:
    probe = self.directory / f".write_probe_{jax.process_index()}"
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
      probe.write_text("ok")
      probe.unlink()
    except OSError as e:
      raise ValueError(f"Checkpoint directory {str(self.directory)!r} cannot be written: {e}") from None

  # --- what is on disk -------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Committed checkpoint steps, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest committed step, or None."""
    return self._manager.latest_step()

  def metadata_of(self, step: int | None = None) -> dict[str, Any]:
    """The ``meta`` JSON of a step (default: the latest)."""
    step = self._existing_step(step)
    self._manager.wait_until_finished()  # the step may be one whose save is still being written
    return read_meta(self.directory, step)

  def _existing_step(self, step: int | None) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise ValueError(f"No checkpoint in {str(self.directory)!r} to restore.")
      return steps[-1]
    if step not in steps:
      raise ValueError(
        f"No checkpoint for step {step} in {str(self.directory)!r}; steps there:"
        f" {', '.join(map(str, steps)) or 'none'}."
      )
    return step

  # --- save --------------------------------------------------------------------

  def save(self, step: int, train_state: TrainState, data_iterator: Any = None, *, force: bool = False) -> bool:
    """Saves ``train_state`` (and ``data_iterator``'s state) as ``step``.

    Returns:
      Whether a checkpoint was started (False when ``step`` is not on the
      save interval and not ``force``). With ``async_save`` the write goes on
      in the background; ``wait_until_finished`` or ``close`` waits for it.

    Raises:
      ValueError: ``step`` is not after the latest checkpoint there.
      CheckpointWriteError: this step, or the previous one still being
        written in the background, could not be written (disk full,
        read-only directory); the message names the step and the cause.
    """
    self._check_open()
    if not force and step % self.save_interval_steps:
      return False
    self.wait_until_finished()  # a failed background write is reported under its own step
    self._deleted.empty()
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise ValueError(
        f"Cannot save step {step}: {str(self.directory)!r} already holds step {latest}. After restoring an"
        " earlier step, delete the later checkpoints or save to another directory."
      )
    flat = flatten_fields(train_state, self.saved_fields)
    prng_impls = {}
    for keys, leaf in list(flat.items()):
      if is_prng_key(leaf):
        prng_impls["/".join(keys)] = str(jax.random.key_impl(leaf))
        flat[keys] = jax.random.key_data(leaf)
      elif not isinstance(leaf, jax.Array):
        flat[keys] = np.asarray(leaf)
    data_meta, data_items = data_state.save_items(data_iterator)  # every process: a DataLoader gathers it
    meta = {**step_meta(step, train_state, prng_impls, self.metadata, self.saved_fields), **data_meta}
    items = {"state": ocp.args.PyTreeSave(nest(flat)), "meta": ocp.args.JsonSave(meta), **data_items}
    try:
      saved = self._manager.save(int(step), args=ocp.args.Composite(**items), force=force)
    except Exception as e:
      if not is_storage_failure(e):
        raise
      raise self._write_error(step, e) from e
    self._pending_step = int(step) if saved else self._pending_step
    return saved

  def _write_error(self, step: int | None, error: BaseException) -> CheckpointWriteError:
    self._failed = True
    return write_error(step, str(self.directory), self._manager.all_steps(), error)

  # --- restore -----------------------------------------------------------------

  def restore(
    self,
    target: TrainState,
    step: int | None = None,
    data_iterator: Any = None,
    *,
    params_only: bool = False,
  ) -> TrainState:
    """Restores a checkpoint into the structure and shardings of ``target``.

    Args:
      target: a concrete or abstract ``TrainState`` (e.g.
        ``plan.abstract_train_state``); each array leaf's sharding says
        where its restored value goes, so any mesh works.
      step: the step to restore (default: the latest).
      data_iterator: an iterator whose position is restored in place.
      params_only: restore the model only (params, local state, the
        non-learned arrays); the optimizer state, step and key are taken from
        ``target`` — for fine-tuning or evaluation from a training
        checkpoint.

    Returns:
      ``target`` with the checkpoint's values.

    Raises:
      ValueError: no such step (the message lists those there).
      CheckpointError: (a ValueError) before any array is read: a step
        directory that is incomplete, unreadable metadata, a format version
        this code does not read, or a target whose tree or shapes differ from
        the checkpoint's (the first differing paths, both shapes); while
        reading: a damaged or truncated array file (the array named).
    """
    self._check_open()
    step = self._existing_step(step)
    meta = self.metadata_of(step)
    data_state.check_restorable_into(data_iterator, meta, step, self.directory)
    fields = tuple(f for f in (MODEL_FIELDS if params_only else SAVED_FIELDS) if f in held_fields(meta))
    kept = tuple(f for f in SAVED_FIELDS if f not in fields)  # the target's own values stay
    abstract_rest = [
      keys for keys, leaf in flatten_fields(target, kept).items() if isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    if abstract_rest:
      sources = ", ".join(f"{k} {v.get('path')}" for k, v in (meta["run"].get("frozen_source") or {}).items())
      why = (
        f"step {step} holds no {abstract_rest[0][0]} (read from {sources or 'their source'})"
        if abstract_rest[0][0] not in held_fields(meta)
        else "a params_only restore keeps the target's optimizer state, step and key"
      )
      raise ValueError(
        f"{why}, but {'/'.join(abstract_rest[0])} is abstract; pass a concrete state (e.g."
        " plan.init(make_state), with those weights in it)."
      )
    wanted = flatten_fields(target, fields)
    prng_impls = meta.get("prng_impls", {})
    abstract = abstract_target(target, fields)
    check_matches(self.directory, step, abstract, partial=params_only)

    restored = self._read(
      step, abstract, params_only, data_state.restore_items(data_iterator, meta, step, self.directory)
    )
    values = {}
    for keys, leaf in wanted.items():
      value = restored[keys]
      if is_prng_key(leaf):
        value = jax.random.wrap_key_data(value, impl=prng_impls.get("/".join(keys), "threefry2x32"))
      values[keys] = value
    return fill_fields(target, fields, values)

  def read_arrays(self, step: int, abstract: Mapping[tuple[str, ...], Any]) -> dict[tuple[str, ...], Any]:
    """Some arrays of ``step`` by their saved paths (``("params", "embed")``), onto the given shardings: another
    model's weights (a DPO reference from a run's checkpoint). Paths and shapes are checked first.

    Raises:
      CheckpointError: a path the step lacks or holds with another shape (named); a damaged file.
    """
    self._check_open()
    step = self._existing_step(step)
    self._manager.wait_until_finished()
    check_matches(self.directory, step, abstract, partial=True, fields=())
    return self._read(step, abstract, True)

  def _read(self, step: int, abstract: Mapping[tuple[str, ...], Any], partial: bool, more: Any = None) -> dict:
    items = {
      "state": ocp.args.PyTreeRestore(
        item=nest(abstract),
        restore_args=ocp.checkpoint_utils.construct_restore_args(nest(abstract)),
        partial_restore=partial,
      ),
      **(more or {}),
    }
    try:
      return unnest(self._manager.restore(step, args=ocp.args.Composite(**items))["state"])
    except Exception as e:  # a truncated or damaged array file: tensorstore's message names the array
      raise CheckpointError(
        f"Checkpoint {str(self.directory / str(step))!r} cannot be read (a damaged or truncated file?): {first_line(e)}"
      ) from e

  # --- lifecycle -----------------------------------------------------------------

  def wait_until_finished(self) -> None:
    """Blocks until a background save has committed.

    Raises:
      CheckpointWriteError: the background write failed (the step is not
        committed; the earlier ones are intact).
    """
    step, self._pending_step = self._pending_step, None
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      if not is_storage_failure(e):
        raise
      raise self._write_error(step, e) from e

  def check_background_save(self) -> None:
    """Raises a background save's error as soon as it has failed; never waits.

    For a training loop to call every step: a full disk then stops the run a
    step after the failed write, not a whole checkpoint interval later.

    Raises:
      CheckpointWriteError: the background write has failed.
    """
    if self._pending_step is not None and not self._manager.is_saving_in_progress():
      self.wait_until_finished()  # finished: returns at once, raising its error if it failed

  def close(self) -> None:
    """Waits for a pending save, then releases orbax's resources.

    Raises:
      CheckpointWriteError: the pending save failed, unless a write error
        was raised already (orbax then repeats it on close).
    """
    if self._closed:
      return
    self._closed = True
    reported, error = self._failed, None
    try:
      self.wait_until_finished()
    except CheckpointWriteError as e:
      error = e
    try:
      self._manager.close()
    except Exception as e:
      if not (self._failed and is_storage_failure(e)):  # orbax repeats a failed write's error here
        raise
    self._deleted.empty(here=True)
    if error is not None and not reported:
      raise error

  def _check_open(self) -> None:
    if self._closed:
      raise ValueError(f"CheckpointManager for {str(self.directory)!r} is closed.")

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()
