"""A data iterator's state in a checkpoint: the lanes' position in ``meta``, or grain's own ``data`` item.

A ``DataLoader`` reads each batch row from its own lane, so its whole
position is a small JSON value (``data_position()``) that
``CheckpointManager.save`` puts in the step's ``meta`` and that restores on
any process count. Any other iterator (and every checkpoint of an earlier
release) keeps grain's per-process state in a ``data`` item instead, which
restores only on the process count that wrote it. What a step holds and what
the iterator being restored into reads are checked against each other here,
before any array is read.

Not for: the train state's arrays (``manager.py``, ``tree.py``).
"""

from __future__ import annotations

from typing import Any

import jax
from etils import epath

from distrib_train.checkpoint.checks import CheckpointError


def save_items(data_iterator: Any) -> tuple[dict[str, Any], dict[str, Any]]:
  """The ``meta`` fields and the orbax items that hold ``data_iterator``'s state at a save.

  Every process must call it (a ``DataLoader``'s position is gathered from all of them).

  Returns:
    ``({"data_position": …}, {})`` for an iterator with a data position,
    ``({}, {"data": grain's save args})`` for another iterator, ``({}, {})``
    for none.
  """
  position = getattr(data_iterator, "data_position", lambda: None)()  # every row's, for any process count
  if position is not None:
    return {"data_position": position}, {}
  if data_iterator is not None:
    return {}, {"data": grain().checkpoint.CheckpointSave(data_iterator)}
  return {}, {}


def check_restorable_into(data_iterator: Any, meta: dict[str, Any], step: int, directory: epath.Path) -> None:
  """Whether step ``step``'s data state (``meta``) restores into ``data_iterator``; nothing is read yet.

  Raises:
    ValueError: a data position for an iterator that cannot take one, or
      grain's per-process state written by another process count.
    CheckpointError: grain's per-process state (an earlier release) for a
      ``DataLoader`` that reads lanes.
  """
  if data_iterator is None:
    return
  position = meta.get("data_position")
  if position is not None and not hasattr(data_iterator, "set_data_position"):
    raise ValueError(
      f"Checkpoint step {step} holds the data position of a DataLoader's lanes; restore it into a"
      " DataLoader, or without data_iterator."
    )
  if position is None and getattr(data_iterator, "endless", False):
    raise CheckpointError(
      f"Checkpoint step {step} in {str(directory)!r} holds grain's per-process data state (an earlier"
      " release); this DataLoader reads lanes, whose position it lacks. Restore without data_iterator (the"
      " data restarts from its beginning)."
    )
  if position is None and meta.get("process_count") != jax.process_count():
    raise ValueError(
      f"Checkpoint step {step} holds the data-iterator state of {meta.get('process_count')} process(es); this"
      f" job has {jax.process_count()}. Restore without data_iterator (the data restarts from its beginning)."
    )


def restore_items(data_iterator: Any, meta: dict[str, Any], step: int, directory: epath.Path) -> dict[str, Any]:
  """Sets ``data_iterator``'s position from ``meta``, or returns the orbax item that restores grain's state.

  Raises:
    CheckpointError: a position the iterator refuses (another data config),
      or a step without the data item grain's state needs.
  """
  if data_iterator is None:
    return {}
  position = meta.get("data_position")
  if position is not None:  # checked before any array is read
    try:
      data_iterator.set_data_position(position)
    except ValueError as e:
      raise CheckpointError(f"Checkpoint step {step} in {str(directory)!r}: {e}") from None
    return {}
  if not (directory / str(step) / "data").is_dir():
    raise CheckpointError(f"Checkpoint step {step} in {str(directory)!r} holds no data-iterator state.")
  return {"data": grain().checkpoint.CheckpointRestore(data_iterator)}


def grain():
  """The ``grain`` module, whose handler saves and restores a per-process iterator state.

  Raises:
    ValueError: grain is not installed.
  """
  try:
    import grain
  except ImportError:
    raise ValueError("Saving or restoring a data iterator needs grain: pip install grain.") from None
  return grain
