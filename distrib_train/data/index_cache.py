"""Indexes of data files, built once and kept: beside the data, or in a cache directory.

Opening a corpus must cost O(files), not O(bytes): a reader that needs an
index of a file (where each document starts, how many a block holds) builds
it once, with ``load_or_build``, and every later open, by any process of
this or a later run, maps the kept arrays instead.

An index is kept as ``.<file name>.<kind>.dtindex`` beside the data file,
or, where that directory is not writable (or refuses the write: EACCES,
EPERM, EROFS) or ``cache_dir`` is given, under
``cache_dir`` (default ``$XDG_CACHE_HOME/distrib_train/indexes``, else
``~/.cache/…``) as ``<hash of the path>-<file name>.<kind>.dtindex``. It
is keyed by the file's absolute path, size, modification and change times
and a hash of its first and last 64 KiB: a file that changed, was replaced
or was moved gets a new index, never a stale one (a copy that keeps the
size, mtime, head and tail still has a new change time). A file name over
160 bytes is kept under its hash. The format is a magic line, a JSON
header (the key and each array's dtype, shape and offset) and the arrays'
raw bytes, mapped read-only when loaded: no pickle.

Processes of one host that open the same file at once take a lock
(``fcntl.flock`` on ``<index>.lock``): one builds, the others wait and map
what it wrote. The index is written to a temporary name and renamed, so a
reader never sees half of one.

Not for: reading documents (``text_files.py`` and the readers beside it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import mmap
import os
import struct
import tempfile
from collections.abc import Callable, Iterator

import numpy as np

VERSION = 1
_MAGIC = b"distrib_train index\n"
_LENGTH = struct.Struct("<Q")
_EDGE = 1 << 16  # bytes hashed at each end of the file
_ALIGN = 64
_NAME_BYTES = 160  # longer file names are kept under their hash


def default_cache_dir() -> str:
  """``$XDG_CACHE_HOME/distrib_train/indexes``, else ``~/.cache/distrib_train/indexes``."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "distrib_train", "indexes")


def file_key(path: str, kind: str) -> dict:
  """What an index of ``path`` is valid for: its path, size, mtime and a hash of its head and tail."""
  path = os.path.abspath(path)
  stat = os.stat(path)
  digest = hashlib.blake2b(digest_size=16)
  with open(path, "rb") as f:
    digest.update(f.read(_EDGE))
    if stat.st_size > _EDGE:
      f.seek(max(_EDGE, stat.st_size - _EDGE))
      digest.update(f.read(_EDGE))
  # ctime too: a copy that keeps the size, mtime, head and tail (``cp -p``, ``rsync -a``, ``tar x`` of an edited
  # file) still sets it, and no tool can set it back.
  return {
    "version": VERSION,
    "kind": kind,
    "path": path,
    "size": stat.st_size,
    "mtime_ns": stat.st_mtime_ns,
    "ctime_ns": stat.st_ctime_ns,
    "edges": digest.hexdigest(),
  }


def _places(path: str, kind: str, cache_dir: str) -> list[str]:
  """Where the index of ``path`` may be kept, in order: beside it (no ``cache_dir`` given, and its directory
  writable as far as ``os.access`` knows), then the cache directory."""
  path = os.path.abspath(path)
  folder, name = os.path.split(path)
  tag = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]  # a name's bytes, whatever their encoding
  # A name near the file system's 255 bytes leaves no room for the index's prefix and suffixes: its hash
  # stands in for it (``.lock`` and a temporary name's suffix are added to these).
  short = name if len(os.fsencode(name)) <= _NAME_BYTES else hashlib.sha256(os.fsencode(name)).hexdigest()[:32]
  cached = os.path.join(cache_dir or default_cache_dir(), f"{tag}-{short}.{kind}.dtindex")
  if not cache_dir and os.access(folder, os.W_OK):
    return [os.path.join(folder, f".{short}.{kind}.dtindex"), cached]
  return [cached]


# A directory that refuses writes whatever os.access said (a read-only mount, root squashed over NFS): the
# index goes to the next place.
_REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS)


def load_or_build(
  path: str, kind: str, build: Callable[[], dict[str, np.ndarray]], cache_dir: str = ""
) -> tuple[dict[str, np.ndarray], bool]:
  """The index ``build()`` makes of ``path``: kept from an earlier call where it is still valid, else built
  (by one process of this host at a time) and kept.

  Args:
    path: the data file.
    kind: the index's name (a reader may keep several of one file).
    build: makes the index: array name → numpy array.
    cache_dir: where indexes are kept when not beside the data ('' : beside
      it where writable, else ``default_cache_dir()``).

  Returns:
    The arrays (read-only, mapped from the kept file) and whether they were built now.

  Raises:
    ValueError: the data file cannot be read, or the index can be written
      neither beside it nor in the cache directory (named).
  """
  try:
    key = file_key(path, kind)
  except OSError as e:
    raise ValueError(f"Cannot read data file {path!r}: {e.strerror}.") from None
  places = _places(path, kind, cache_dir)
  for where in places:
    kept = _read(where, key)
    if kept is not None:
      return kept, False
  for i, where in enumerate(places):
    try:
      return _build_at(where, path, kind, key, build)
    except OSError as e:
      if e.errno in _REFUSED and i + 1 < len(places):
        continue
      raise ValueError(
        f"Cannot keep the index of data file {path!r} at {where!r}: {e.strerror}; set"
        " data.index_cache_dir to a writable directory."
      ) from None
  raise AssertionError("unreachable")  # pragma: no cover - the last place returns or raises


def _build_at(
  where: str, path: str, kind: str, key: dict, build: Callable[[], dict[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], bool]:
  """Builds and keeps the index at ``where`` under its lock (or maps the one another process kept there
  meanwhile). OSError: ``where`` cannot be written."""
  os.makedirs(os.path.dirname(where), exist_ok=True)
  with _locked(where + ".lock"):
    kept = _read(where, key)  # another process may have built it while this one waited
    if kept is not None:
      return kept, False
    arrays = build()
    if file_key(path, kind) != key:
      raise ValueError(f"Data file {path!r} changed while it was being indexed; open it again once it is written.")
    _write(where, key, arrays)
  kept = _read(where, key)
  if kept is None:
    raise ValueError(f"The index of data file {path!r} written at {where!r} cannot be read back.")
  return kept, True


@contextlib.contextmanager
def _locked(lock_path: str) -> Iterator[None]:
  with open(lock_path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _read(where: str, key: dict) -> dict[str, np.ndarray] | None:
  """The kept arrays if ``where`` holds a whole index for ``key``; None if absent, stale or damaged."""
  try:
    with open(where, "rb") as f:
      if f.read(len(_MAGIC)) != _MAGIC:
        return None
      (size,) = _LENGTH.unpack(f.read(_LENGTH.size))
      header = json.loads(f.read(size))
      total = os.fstat(f.fileno()).st_size
      if not isinstance(header, dict) or header.get("key") != key:
        return None
      # One map of the file this header was read from (not of the path again: another process may have
      # renamed a new index over it meanwhile), one descriptor for all the arrays.
      mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if total else None
  except (OSError, ValueError, struct.error):
    return None
  arrays = {}
  for name, (dtype, shape, offset) in header.get("arrays", {}).items():
    dtype, count = np.dtype(dtype), int(np.prod(shape))
    if offset + count * dtype.itemsize > total:
      return None
    arrays[name] = np.zeros(shape, dtype) if count == 0 else np.frombuffer(mapped, dtype, count, offset).reshape(shape)
  return arrays


def _write(where: str, key: dict, arrays: dict[str, np.ndarray]) -> None:
  arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
  layout, offset = {}, 0
  for name, a in arrays.items():
    layout[name] = [a.dtype.str, list(a.shape), offset]
    offset += -(-a.nbytes // _ALIGN) * _ALIGN
  # The offsets above are relative to the data's start, which follows the header; 256 bytes of room let the
  # header's offsets grow by that start without moving it.
  start = len(_MAGIC) + _LENGTH.size + len(json.dumps({"key": key, "arrays": layout})) + 256
  start = -(-start // _ALIGN) * _ALIGN
  for entry in layout.values():
    entry[2] += start
  header = json.dumps({"key": key, "arrays": layout}).encode()
  prefix = _MAGIC + _LENGTH.pack(len(header)) + header
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(where), prefix=".tmp-", suffix=".dtindex")
  try:
    os.fchmod(fd, os.stat(key["path"]).st_mode & 0o444 | 0o200)  # readable by whoever may read the data
    with os.fdopen(fd, "wb") as f:
      f.write(prefix + b"\0" * (start - len(prefix)))
      for name, a in arrays.items():
        f.seek(layout[name][2])
        f.write(a.tobytes())
      f.truncate(max([start] + [layout[n][2] + -(-a.nbytes // _ALIGN) * _ALIGN for n, a in arrays.items()]))
    os.replace(tmp, where)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise
