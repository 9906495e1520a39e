"""One job per workdir: a lock that a dead job cannot leave behind.

``WorkdirLock(workdir).acquire()`` takes a POSIX record lock
(``fcntl.lockf``) on ``workdir/.distrib_train.lock`` and writes the holder's
pid, host and start time into it. The kernel drops the lock when the holding
process ends, however it ends (SIGKILL included), so a relaunch after a crash
is never refused; a second job started while the first still runs is refused
before it touches anything else in the workdir (it would otherwise delete the
first's in-progress orbax temporary directories).

In a multi-process job only process 0 holds the lock; ``acquire_for_job``
tells the other processes whether it got it, through JAX's coordination
service, so every process of a refused job stops with the same message.
``check_free_for_job`` asks the same, holding the lock only while it
probes it: a run calls it before it reads the workdir's checkpoints, which
a running job is deleting as it saves new ones.

Record locks rather than ``flock``: they are not shared with forked children
(grain's worker processes), which would otherwise keep a dead trainer's lock,
and NFS carries them between hosts. A filesystem that cannot lock (some FUSE
mounts) gets a warning and no lock; an object-store URL (``gs://…``) is not a
path this module can lock at all.

Not for: what a run writes in its workdir (``trainer.py``).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import itertools
import os
import pathlib
import socket
import time

LOCK_NAME = ".distrib_train.lock"
_KEY = "distrib_train/workdir_lock"
_calls = itertools.count()  # a coordination-service key per call (one job may run several trainers)
_PROBE_S = 0.5
# Record locks belong to a process: a second lock of the same file in this
# process would succeed, and closing it would drop the first. Held paths are
# remembered to refuse that too.
_held: set[str] = set()


class WorkdirInUseError(ValueError):
  """Another job holds the workdir; the message names it and the holder."""


class WorkdirLock:
  """An exclusive, process-lifetime lock on a workdir.

  Args:
    workdir: an existing local (or NFS) directory.
  """

  def __init__(self, workdir: str | os.PathLike):
    self.workdir = pathlib.Path(workdir)
    self.path = self.workdir / LOCK_NAME
    self._fd: int | None = None
    self.warning: str | None = None  # set when the filesystem cannot lock

  def acquire(self) -> None:
    """Takes the lock, or raises (within ``_PROBE_S``: a probe by ``check_free`` holds it that briefly).

    Raises:
      WorkdirInUseError: another process (this one included) holds it.
    """
    fd = self._locked(create=True)
    if fd is None:
      return
    os.ftruncate(fd, 0)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since {started}\n".encode())
    self._fd = fd
    _held.add(str(self.path.resolve()))

  def probe(self) -> None:
    """Raises as ``acquire`` would, creating nothing and holding the lock only while it probes it."""
    fd = self._locked(create=False)
    if fd is not None:
      os.close(fd)  # drops the probe's lock (this process holds no other on the file: not in _held)

  def _locked(self, create: bool) -> int | None:
    """A descriptor of the lock file holding the lock; None where it cannot be locked (``warning``) or, without
    ``create``, where there is no lock file to open."""
    if str(self.path.resolve()) in _held:
      raise WorkdirInUseError(
        f"Workdir {str(self.workdir)!r} is in use by another run in this process"
        f" (pid {os.getpid()}); close it first or use another workdir."
      )
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o644)
    except OSError:
      if create:
        raise
      return None  # no job has locked it yet, or it cannot be opened: acquire() decides
    try:
      _lock(fd)
    except OSError as e:
      holder = _read_holder(fd)
      os.close(fd)
      if e.errno in (errno.EACCES, errno.EAGAIN):
        raise WorkdirInUseError(
          f"Workdir {str(self.workdir)!r} is in use by another job ({holder or 'holder unknown'}); wait for it"
          " to end, stop it, or give another --workdir."
        ) from None
      self.warning = (
        f"Workdir {str(self.workdir)!r} cannot be locked ({e.strerror}): nothing stops a second"
        " job from using it at the same time."
      )
      return None
    return fd

  def release(self) -> None:
    """Drops the lock (the holder line stays: it names the last holder)."""
    if self._fd is None:
      return
    _held.discard(str(self.path.resolve()))
    os.close(self._fd)  # closing the descriptor releases the record lock
    self._fd = None


def _lock(fd: int) -> None:
  """``lockf`` at once, tried again for up to ``_PROBE_S``: another job's ``check_free`` holds it that briefly."""
  deadline = time.monotonic() + _PROBE_S
  while True:
    try:
      fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return
    except OSError as e:
      if e.errno not in (errno.EACCES, errno.EAGAIN) or time.monotonic() > deadline:
        raise
      time.sleep(0.01)


def _read_holder(fd: int) -> str:
  try:
    return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
  except OSError:
    return ""


def check_free(workdir: str | os.PathLike) -> None:
  """Raises when another job holds ``workdir`` now (``WorkdirLock.probe``).

  For a run's checks before it reads the workdir's checkpoints: a running
  job deletes its old steps meanwhile, and the refusal must name that job,
  not a step it is deleting.

  Raises:
    WorkdirInUseError: another process (this one included) holds it.
  """
  WorkdirLock(workdir).probe()


def check_free_for_job(workdir: str | os.PathLike, timeout_s: int = 600) -> None:
  """``check_free`` by process 0; every process of the job raises with its message."""
  _for_job("free", lambda: check_free(workdir), timeout_s)


def acquire_for_job(workdir: str | os.PathLike, timeout_s: int = 600) -> WorkdirLock:
  """Process 0 takes the lock; every process of the job learns the outcome.

  Raises:
    WorkdirInUseError: in every process, when process 0 was refused.
  """
  lock = WorkdirLock(workdir)
  _for_job("acquired", lock.acquire, timeout_s)
  return lock


def _for_job(what: str, decide, timeout_s: int) -> None:
  """Process 0 runs ``decide`` and tells the others, through JAX's coordination service, whether it raised
  ``WorkdirInUseError``; every process then raises it with the same message. A key is set once in a job: each
  call has its own (every process makes the same calls in the same order, as for the trainer's barriers)."""
  import jax

  if jax.process_count() == 1:
    decide()
    return
  from jax._src import distributed

  client = distributed.global_state.client
  key = f"{_KEY}/{what}/{next(_calls)}"
  if jax.process_index() == 0:
    refusal = ""
    try:
      decide()
    except WorkdirInUseError as e:
      refusal = str(e)
    client.key_value_set(key, refusal or "ok")
    if refusal:
      raise WorkdirInUseError(refusal)
    return
  answer = client.blocking_key_value_get(key, timeout_s * 1000)
  if answer != "ok":
    raise WorkdirInUseError(answer)
