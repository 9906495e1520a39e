"""Starts, watches and SIGKILLs multi-process ``distrib_train.cli`` jobs.

The kill matrix (``test_kill_matrix.py``) runs the real CLI as a 2-process
job on 127.0.0.1, kills it at chosen moments and restarts it. This module
holds what that needs and nothing about the assertions:

- ``Job``: one launch of N processes (a fresh coordinator port, one log file
  per process, each process in its own process group so a SIGKILL takes its
  threads and children with it), with a hard deadline on every wait.
- ``phase_of(log)``: where process 0 was when its log ends, from the trainer's
  own lines and orbax's INFO lines (the job runs with ``--verbosity 0``):
  ``startup``, ``restore``, ``compile``, ``steps``, ``save_blocking`` (inside
  ``save()``: barrier, device→host copy), ``save_background`` (the write and
  commit thread, before the rename that commits the step) and
  ``save_finalize`` (committed; old steps being deleted, hosts syncing).
- ``step_dirs(directory)``: what a checkpoint directory holds on disk
  (committed steps, whether each is complete, temporary directories), and
  ``orbax_steps`` what orbax lists there.
- ``saved_arrays(step_dir)``: a checkpoint's arrays as numpy, read in this
  process whatever the job's process count was.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from mp_harness import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]

_RESTORED = re.compile(r"Restored step (\d+) from")
_STEP = re.compile(r"^\[[\d:]+\] step (\d+)  loss", re.M)
_SAVING = re.compile(r"Saving checkpoint at step (\d+)")


class Job:
  """One launch of ``python -m distrib_train`` in ``num_processes`` processes.

  Args:
    args: the CLI flags every process gets (``--process_id`` and the
      coordinator are added).
    log_prefix: process ``i`` logs to ``{log_prefix}_p{i}.log``.
    env: the processes' environment.
  """

  def __init__(self, args: Sequence[str], log_prefix: pathlib.Path, env: dict[str, str], num_processes: int = 2):
    port = free_port()
    self.log_paths = [pathlib.Path(f"{log_prefix}_p{i}.log") for i in range(num_processes)]
    self.started = time.monotonic()
    self.procs = []
    self._offsets = [0] * num_processes
    self._texts = [""] * num_processes
    for i, path in enumerate(self.log_paths):
      with open(path, "w") as log:
        self.procs.append(
          subprocess.Popen(
            [
              sys.executable,
              "-m",
              "distrib_train",
              *args,
              "--coordinator_address",
              f"127.0.0.1:{port}",
              "--num_processes",
              str(num_processes),
              "--process_id",
              str(i),
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
          )
        )

  def text(self, i: int = 0) -> str:
    """Process ``i``'s log so far (complete lines only)."""
    with open(self.log_paths[i], "rb") as f:
      f.seek(self._offsets[i])
      chunk = f.read()
    end = chunk.rfind(b"\n") + 1
    self._offsets[i] += end
    self._texts[i] += chunk[:end].decode(errors="replace")
    return self._texts[i]

  def codes(self) -> list[int | None]:
    return [p.poll() for p in self.procs]

  def kill(self, i: int) -> None:
    if self.procs[i].poll() is None:
      try:
        os.killpg(self.procs[i].pid, signal.SIGKILL)
      except ProcessLookupError:
        pass

  def kill_all(self) -> None:
    for i in range(len(self.procs)):
      self.kill(i)
    for p in self.procs:
      p.wait()

  def wait(self, timeout: float) -> list[int]:
    """Waits for every process to exit; kills them all past ``timeout``."""
    deadline = time.monotonic() + timeout
    try:
      for p in self.procs:
        p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      self.kill_all()
      raise AssertionError(f"the job did not exit within {timeout:.0f} s\n{self.tails()}") from None
    return [p.returncode for p in self.procs]

  def tails(self, lines: int = 25) -> str:
    out = []
    for i, path in enumerate(self.log_paths):
      text = path.read_text(errors="replace") if path.exists() else ""
      out.append(f"--- {path.name} (exit {self.procs[i].poll()}) ---\n" + "\n".join(text.splitlines()[-lines:]))
    return "\n".join(out)


def restored_step(log: str) -> int | None:
  found = _RESTORED.search(log)
  return int(found.group(1)) if found else None


def last_step(log: str) -> int | None:
  steps = _STEP.findall(log)
  return int(steps[-1]) if steps else None


def open_save(log: str) -> tuple[int, str] | None:
  """The save process 0 is inside at the end of ``log``: (step, part) or None."""
  saves = _SAVING.findall(log)
  if not saves:
    return None
  step = saves[-1]
  if not re.search(rf"Finished blocking save in [\d.]+ seconds\. Continuing save @ \S*/{step}\.", log):
    return int(step), "save_blocking"
  if not re.search(rf"Finished saving checkpoint \(finalized tmp dir\) to `\S*/{step}`", log):
    return int(step), "save_background"
  if f"[step={step}] CheckpointManager Save Finalize is done on all hosts" not in log:
    return int(step), "save_finalize"
  return None


def phase_of(log: str) -> str:
  """Where process 0 was at the end of its log (see the module docstring)."""
  if _RESTORED.search(log) is None and "Initialised a new train state" not in log:
    return "restore" if "Started load checkpoint" in log else "startup"
  if open_local_save(log) is not None:
    return "local_save"
  save = open_save(log)
  if save is not None:
    return save[1]
  return "steps" if "First step done" in log else "compile"


def step_dirs(directory: pathlib.Path, num_processes: int = 2) -> dict:
  """What ``directory`` holds: ``{"committed": {step: complete?}, "tmp": [names]}``.

  A committed step is a directory named by its number; it is complete when
  every file a restore reads is there and its commit timestamp is set.
  """
  committed, tmp = {}, []
  if directory.is_dir():
    for path in directory.iterdir():
      if "orbax-checkpoint-tmp" in path.name:
        tmp.append(path.name)
      elif path.name.isdigit():
        committed[int(path.name)] = _complete(path, num_processes)
  return {"committed": dict(sorted(committed.items())), "tmp": sorted(tmp)}


def _complete(step_dir: pathlib.Path, num_processes: int) -> bool:
  needed = ["commit_success.txt", "state/_METADATA", "state/manifest.ocdbt", "meta/metadata"]
  needed += [f"state/ocdbt.process_{i}" for i in range(num_processes)]
  if not all((step_dir / name).exists() for name in needed):
    return False
  try:  # the data position of every row is in the metadata (data/lanes.py)
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    committed = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text()).get("commit_timestamp_nsecs")
    return committed is not None and meta.get("data_position") is not None
  except (OSError, ValueError):
    return False


def orbax_steps(directory: pathlib.Path) -> list[int]:
  """The steps orbax's own (read-only) CheckpointManager lists in ``directory``."""
  import orbax.checkpoint as ocp

  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
  try:
    return sorted(manager.all_steps())
  finally:
    manager.close()


def saved_arrays(step_dir: pathlib.Path) -> dict:
  """The ``state`` item of a checkpoint as ``{"a/b/c": numpy array}``."""
  import numpy as np
  import orbax.checkpoint as ocp

  checkpointer = ocp.PyTreeCheckpointer()
  metadata = checkpointer.metadata(step_dir / "state").item_metadata
  tree = metadata.tree if hasattr(metadata, "tree") else metadata

  def as_numpy(node):  # restore every leaf as numpy: the job's devices are not this process's
    if isinstance(node, dict):
      return {k: as_numpy(v) for k, v in node.items()}
    return ocp.RestoreArgs(restore_type=np.ndarray)

  restored = checkpointer.restore(step_dir / "state", args=ocp.args.PyTreeRestore(restore_args=as_numpy(tree)))
  flat = {}

  def walk(prefix, node):
    if isinstance(node, dict):
      for k, v in node.items():
        walk(f"{prefix}/{k}" if prefix else k, v)
    else:
      flat[prefix] = np.asarray(node)

  walk("", restored)
  return flat


def data_positions(step_dir: pathlib.Path) -> dict:
  """Every row's data position saved in a checkpoint (the metadata's ``data_position``)."""
  return json.loads((step_dir / "meta" / "metadata").read_text())["data_position"]


def open_local_save(log: str) -> int | None:
  """The local-tier save process 0 is inside at the end of ``log``, or None."""
  writing = re.findall(r"Local checkpoint: writing step (\d+)", log)
  if writing and f"Local checkpoint: committed step {writing[-1]} in" not in log:
    return int(writing[-1])
  return None


def local_steps(local_dir: pathlib.Path, num_processes: int = 2) -> list[int]:
  """The local-tier steps every process holds committed (a manifest in the step directory)."""
  held = [
    {int(p.parent.name) for p in (local_dir / f"process_{i}").glob("*/manifest.json") if p.parent.name.isdigit()}
    for i in range(num_processes)
  ]
  return sorted(set.intersection(*held)) if held else []


def step_losses(workdir: pathlib.Path) -> tuple[dict[int, list[float]], list[str]]:
  """Every training loss in ``metrics.jsonl`` per step, replays included, in
  log order; and the lines that are not JSON (a write cut by a kill)."""
  out: dict[int, list[float]] = {}
  broken = []
  path = workdir / "metrics.jsonl"
  for line in path.read_text().splitlines() if path.exists() else []:
    try:
      m = json.loads(line)
    except ValueError:
      broken.append(line)
      continue
    if "loss" in m and "eval/loss" not in m:
      out.setdefault(m["step"], []).append(m["loss"])
  return out, broken
