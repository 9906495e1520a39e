"""How old checkpoint steps leave: by one rename, then removed out of sight.

orbax's ``CheckpointManager`` deletes the steps its preservation policy drops
(``max_to_keep``, ``keep_every_n_steps``). By default it deletes them file by
file where they lie, and a kill in between left a step that orbax still
lists, without its commit marker. With ``todelete_subdir=DELETED`` it renames
each into ``directory/.deleted/`` instead (one atomic rename on a local, NFS
or Lustre file system), and ``DeletedSteps`` removes what is there: in a
thread of process 0 after each save, and at ``close`` in the caller's
thread. A kill in between leaves files there that no listing sees, removed
at the next start. On GCS orbax ignores the option and deletes in place.

Not for: which steps are kept (``manager.py``).
"""

from __future__ import annotations

import threading

import jax
from etils import epath

DELETED = ".deleted"  # not a step name: orbax and the checks never list it


class DeletedSteps:
  """The old steps orbax renamed into ``directory/DELETED``, and their removal (process 0 only)."""

  def __init__(self, directory: epath.Path):
    self.folder = directory / DELETED
    self.active = jax.process_index() == 0 and not str(directory).startswith("gs://")
    self._thread: threading.Thread | None = None

  def empty(self, here: bool = False) -> None:
    """Removes what is there, while orbax is idle: in a thread, one at a time, or ``here`` after that thread."""
    if not self.active:
      return
    if self._thread is not None:
      if self._thread.is_alive() and not here:
        return  # the next call takes what was renamed meanwhile
      self._thread.join()
      self._thread = None
    try:  # the folder itself stays: orbax renames the next old step into it
      doomed = list(self.folder.iterdir()) if self.folder.is_dir() else []
    except OSError:
      return  # unreadable now: the next call or start tries again
    if doomed and here:
      _remove(doomed)
    elif doomed:
      self._thread = threading.Thread(
        target=_remove, args=(doomed,), name="distrib_train-delete-old-steps", daemon=True
      )
      self._thread.start()

  def join(self, timeout: float | None = None) -> None:
    """Waits for the removal under way, if any, up to ``timeout`` seconds (removes nothing else)."""
    if self._thread is not None:
      self._thread.join(timeout)


def _remove(paths: list[epath.Path]) -> None:
  for path in paths:
    try:
      path.rmtree() if path.is_dir() else path.unlink()
    except OSError:
      pass  # a read-only or vanished folder: the next start tries again
