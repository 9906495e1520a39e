"""The fast checkpoint tier: every process writes its own shards to its own local disk.

``LocalCheckpoints(directory, run_id)`` beside the persistent
``CheckpointManager``: ``save(step, state, data_iterator)`` copies this
process's addressable shards of the train state to host memory and writes
them as ``.npy`` files under ``directory/<step>/`` (a local disk or
``/dev/shm``, no shared filesystem, no coordination with other processes but
the data position's gather), committed by renaming a temporary directory.
The newest two steps are kept.

A restart asks ``complete_step(persistent_step)``: the newest local step that
every process holds committed, written by this run (``run_id``) on this
job's layout (process count, mesh, devices), and newer than the persistent
step — or None, and the persistent tier restores. The step is agreed with
one tiny all-gather, so all processes restore the same one or none does.
``restore`` reads the shards straight back onto the same devices.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import shutil
import time
from typing import Any

from absl import logging

import jax
import numpy as np

from distrib_train.checkpoint.checks import SAVED_FIELDS, abstract_target
from distrib_train.checkpoint.tree import fill_fields, flatten_fields, is_prng_key

_KEEP = 2
_WRITERS = 8
_MANIFEST = "manifest.json"


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
  return ",".join(f"{start}:{stop}" for start, stop, _ in (sl.indices(n) for sl, n in zip(index, shape)))


def _layout(abstract: dict[tuple[str, ...], jax.ShapeDtypeStruct]) -> dict[str, Any]:
  """What a local checkpoint can only be read back onto: the process count and this process's shard blocks."""
  mine = lambda leaf: sorted(
    {
      _index_key(index, leaf.shape): d.id
      for d, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items()
    }
  )
  return {
    "process_count": jax.process_count(),
    "process_index": jax.process_index(),
    "leaves": {"/".join(keys): [list(leaf.shape), mine(leaf)] for keys, leaf in abstract.items()},
  }


def _read(path: pathlib.Path) -> np.ndarray:
  """One shard file: the .npy format, never a pickle."""
  with open(path, "rb") as f:
    return np.lib.format.read_array(f, allow_pickle=False)


class LocalCheckpoints:
  """This process's fast tier (module docstring)."""

  def __init__(self, directory: str | os.PathLike, run_id: str, fields: tuple[str, ...] = SAVED_FIELDS):
    self.directory = pathlib.Path(directory)
    self.run_id = run_id
    self.fields = fields  # the saved fields (the persistent tier's: a named source's frozen weights are not)
    self.directory.mkdir(parents=True, exist_ok=True)
    for stale in self.directory.glob("*.tmp*"):  # what a killed save left
      shutil.rmtree(stale, ignore_errors=True)

  def steps(self) -> list[int]:
    """This process's committed local steps, oldest first."""
    return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and (p / _MANIFEST).is_file())

  def save(self, step: int, state: Any, data_iterator: Any = None) -> None:
    """Writes this process's shards of ``state`` as ``step`` (blocking; every process calls it at the step)."""
    position = getattr(data_iterator, "data_position", lambda: None)()  # a collective: before any early return
    final = self.directory / str(step)
    started = time.perf_counter()
    logging.info("Local checkpoint: writing step %d to %s", step, self.directory)
    tmp = self.directory / f"{step}.tmp{os.getpid()}"
    tmp.mkdir(parents=True)
    files, key_impls, writes = {}, {}, []
    for keys, leaf in flatten_fields(state, self.fields).items():
      name = "/".join(keys)
      if is_prng_key(leaf):
        key_impls[name] = str(jax.random.key_impl(leaf))
        leaf = jax.random.key_data(leaf)
      blocks, array = files.setdefault(name, {}), jax.numpy.asarray(leaf)
      for shard in array.addressable_shards:
        block = _index_key(shard.index, array.shape)
        if block not in blocks:  # a block replicated over this process's devices is written once
          blocks[block] = f"{sum(map(len, files.values())):05d}.npy"
          writes.append((tmp / blocks[block], shard.data))
    # Device → host copies and file writes overlap, several at a time (numpy releases the GIL while writing).
    with concurrent.futures.ThreadPoolExecutor(_WRITERS) as pool:
      list(pool.map(lambda job: np.save(job[0], np.asarray(job[1])), writes))
    manifest = {
      "step": int(step),
      "run_id": self.run_id,
      "layout": _layout(abstract_target(state, self.fields)),
      "files": files,
      "key_impls": key_impls,
      "data_position": position,
    }
    (tmp / _MANIFEST).write_text(json.dumps(manifest))
    if final.exists():  # a step of an earlier run or layout (a restart on another shape trains it again)
      shutil.rmtree(final)
    os.replace(tmp, final)
    for old in self.steps()[:-_KEEP]:
      shutil.rmtree(self.directory / str(old), ignore_errors=True)
    logging.info("Local checkpoint: committed step %d in %.3f s", step, time.perf_counter() - started)

  def _usable(self, step: int, target: Any) -> bool:
    try:
      manifest = json.loads((self.directory / str(step) / _MANIFEST).read_text())
    except (OSError, ValueError):
      return False
    return manifest.get("run_id") == self.run_id and manifest.get("layout") == _layout(
      abstract_target(target, self.fields)
    )

  def complete_step(self, target: Any, newer_than: int | None) -> int | None:
    """The newest step every process holds, usable on ``target``'s layout and newer than ``newer_than``."""
    mine = [s for s in self.steps() if self._usable(s, target)][-_KEEP:]
    row = np.full(_KEEP, -1, np.int64)
    row[: len(mine)] = mine
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      rows = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, _KEEP)
    else:
      rows = row[None]
    common = set.intersection(*(set(int(s) for s in r if s >= 0) for r in rows))
    best = max(common, default=None)
    return best if best is not None and (newer_than is None or best > newer_than) else None

  def restore(self, target: Any, step: int, data_iterator: Any = None) -> Any:
    """``target`` (with shardings, as ``plan.abstract_train_state``) filled from local ``step``."""
    folder = self.directory / str(step)
    manifest = json.loads((folder / _MANIFEST).read_text())
    values = {}
    for keys, leaf in abstract_target(target, self.fields).items():
      name = "/".join(keys)
      blocks = manifest["files"][name]
      shards = [
        jax.device_put(_read(folder / blocks[_index_key(index, leaf.shape)]), device)
        for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items()
      ]
      value = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)
      if name in manifest["key_impls"]:
        value = jax.random.wrap_key_data(value, impl=manifest["key_impls"][name])
      values[keys] = value
    if data_iterator is not None and manifest.get("data_position") is not None:
      data_iterator.set_data_position(manifest["data_position"])
    return fill_fields(target, self.fields, values)
