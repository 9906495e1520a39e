"""The command line: ``python -m distrib_train.cli`` / ``distrib-train``.

  distrib-train --config tiny --workdir /tmp/run --cpu_devices 8
  distrib-train --config llama-1b-gpu --mesh_config gpu-1x8xh100 \\
      --workdir gs://bucket/run --set optimizer.learning_rate=2e-4

``--config`` is a preset name (``distrib_train/configs/``) or a YAML file;
``--set section.key=value`` overrides one key (repeatable, typed);
``--mesh_config`` a name in ``mesh_configs/``, a path, or ``auto`` (the layout
chosen at start for the devices the job has, ``podplan/auto.py``). A mistake in the
flags or the config, a workdir that cannot be written or a checkpoint that
does not fit (another model, incomplete, damaged) prints one ``error:`` line
and exits with status 2 before anything is written. Exit status: 0 finished,
preempted (after the checkpoint) or already done; 2 bad flags, config,
workdir, checkpoint or a workdir another job holds; 3 stopped by the
non-finite guard; 4 ended by the hang watchdog (``train.hang_timeout_s``:
stacks, then one ``error:`` line naming the phase and the silent process);
143 (130) SIGTERM (SIGINT) outside the step loop or a
second one, stopping at once; 1 a checkpoint
that could not be written mid-run (a full or read-only disk: one ``error:``
line naming the step, the directory and the cause), a step out of device memory mid-run (one
``error:`` line with the levers; a step that cannot fit is refused before the first step, status 2) or a
failed process.
"""

from __future__ import annotations

import functools
import logging as std_logging
import os
import signal
import sys
from collections.abc import Sequence

from absl import app, flags, logging

from distrib_train.common.text import fail

_CONFIG = flags.DEFINE_string("config", None, "Experiment preset name or YAML path (default: the built-in defaults).")
_MESH = flags.DEFINE_string(
  "mesh_config",
  None,
  "Mesh config: a name in mesh_configs/, a YAML path, or auto (the trainer chooses the layout for the devices it has).",
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: config, metrics, checkpoints (resumed from).")
_SET = flags.DEFINE_multi_string("set", [], "Override a config key: --set train.steps=100 (repeatable).")
_STEPS = flags.DEFINE_integer("steps", None, "Total train steps (same as --set train.steps=N).")
_INIT_FROM = flags.DEFINE_string(
  "init_from",
  None,
  "Start a new run from these weights with a fresh optimizer: hf:<Hugging Face dir> or"
  " ckpt:<workdir or checkpoint step dir> (same as --set train.init_from=...).",
)
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None, "Run on CPU, emulating this many devices per process.")
_PROFILE = flags.DEFINE_string("profile_steps", None, "Trace steps A:B with the jax profiler into workdir/profile.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process jobs).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in the job.")
_LOCAL_DEVICE_IDS = flags.DEFINE_string(
  "local_device_ids",
  None,
  "GPUs this process uses: 'all' (one process per node) or ids '0,1'; default: JAX's"
  " choice (SLURM: one process per GPU).",
)
_INIT_TIMEOUT = flags.DEFINE_integer("initialization_timeout", 300, "Seconds to wait for every process to join.")
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
  "heartbeat_timeout", 100, "Seconds without a heartbeat before a process counts as dead and the job stops."
)


class UsageError(Exception):
  pass


def _profile_steps(text: str | None) -> tuple[int, int] | None:
  if not text:
    return None
  first, sep, last = text.partition(":")
  try:
    a, b = int(first), int(last if sep else first)
  except ValueError:
    raise UsageError(f"--profile_steps {text!r}: expected A:B (step numbers), e.g. --profile_steps 10:12.") from None
  if a < 1 or b < a:
    raise UsageError(f"--profile_steps {text!r}: need 1 ≤ A ≤ B.")
  return a, b


def _parse_flags(argv: Sequence[str]) -> list[str]:
  if any(arg in ("-h", "--help", "-help", "--helpshort") for arg in argv[1:]):
    # absl's own --help exits 1 and, from the console script, lists no flags.
    print(__doc__.strip() + "\n\nFlags:\n" + flags.FLAGS.module_help(__name__))
    sys.exit(0)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e))


def _hide_orbax_errors(record: std_logging.LogRecord) -> bool:
  """orbax logs a failed save with its traceback, then raises; the run reports
  that in one line (``CheckpointWriteError``). ``-v 0`` shows it all."""
  return record.levelno < std_logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    fail(f"unexpected arguments {' '.join(argv[1:])!r} (flags take the form --name=value).")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO; -v 0 brings it back
    logging.get_absl_handler().addFilter(_hide_orbax_errors)
  from distrib_train.config import run as config_lib

  try:
    if not _WORKDIR.value:
      raise UsageError("--workdir is required.")
    profile = _profile_steps(_PROFILE.value)
    overrides = config_lib.parse_overrides(_SET.value)
    if _STEPS.value is not None:
      overrides["train.steps"] = str(_STEPS.value)
    if _INIT_FROM.value is not None:
      overrides["train.init_from"] = _INIT_FROM.value
    if _MESH.value:
      overrides["mesh_config"] = _MESH.value
    config = config_lib.load(_CONFIG.value, overrides)
  except (UsageError, config_lib.ConfigError) as e:
    fail(str(e))

  from distrib_train.cluster import distributed

  try:
    distributed.initialize(
      coordinator_address=_COORDINATOR.value,
      num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value,
      local_device_ids=_LOCAL_DEVICE_IDS.value,
      cpu_devices=_CPU_DEVICES.value,
      initialization_timeout=_INIT_TIMEOUT.value,
      heartbeat_timeout=_HEARTBEAT_TIMEOUT.value,
    )
  except ValueError as e:
    fail(str(e))
  from distrib_train.checkpoint import CheckpointWriteError
  from distrib_train.data.jsonl import BadRecordError
  from distrib_train.posttrain.rewards import RewardError
  from distrib_train.train.trainer import EXIT_HALTED, Trainer, TrainerSetupError

  layout_search = None
  if config.mesh_config == "auto":  # the trainer chooses the layout at start, with podplan's compile-based search
    import jax

    from distrib_train.podplan import auto

    say = (lambda line: print(line, file=sys.stderr, flush=True)) if jax.process_index() == 0 else None
    layout_search = functools.partial(auto.search, say=say)
  try:
    trainer = Trainer(config, _WORKDIR.value, profile_steps=profile, layout_search=layout_search)
    result = trainer.run()
  except TrainerSetupError as e:
    fail(str(e))
  except (CheckpointWriteError, BadRecordError, RewardError) as e:  # a full disk, a malformed line, a reward, mid-run
    # Its first line: grain's prefetch thread appends a note on its own traceback filtering.
    print(f"distrib-train: error: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
    if distributed.is_multiprocess():
      os._exit(1)  # the other processes may wait for this one in the save's barrier
    sys.exit(1)
  except (distributed.Terminated, KeyboardInterrupt) as e:  # a signal outside the step loop, or a second one
    signum = e.signum if isinstance(e, distributed.Terminated) else 2
    print(
      f"distrib-train: stopped by {signal.Signals(signum).name} before a step boundary; the checkpoints"
      " committed before it are kept.",
      file=sys.stderr,
      flush=True,
    )
    if distributed.is_multiprocess():
      os._exit(128 + signum)
    sys.exit(128 + signum)
  except Exception as e:
    from distrib_train.cluster.device_memory import out_of_memory_message

    if (oom := out_of_memory_message(e, None)) is not None:  # one line with the levers, not the allocator's
      print(f"distrib-train: error: {oom}", file=sys.stderr, flush=True)
      os._exit(1) if distributed.is_multiprocess() else sys.exit(1)
    if not distributed.is_multiprocess():
      from distrib_train.checkpoint import CheckpointError

      if isinstance(e, CheckpointError):  # found damaged while its arrays were read
        fail(str(e))
      raise
    # Another process has most likely died; cleaning up would wait for it in
    # a collective or barrier. Say so and leave at once.
    import jax

    print(
      f"distrib-train: error: process {jax.process_index()} of {jax.process_count()} stopped:"
      f" {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} — if another process died, its log"
      " has the cause.",
      file=sys.stderr,
      flush=True,
    )
    os._exit(1)
  if result.status == "halted":
    sys.exit(EXIT_HALTED)


def run() -> None:
  """The ``distrib-train`` console script; ``distrib-train plan ...`` is ``plan_cli``, ``distrib-train export
  ...`` is ``weights/export.py``, ``distrib-train generate ...`` is ``inference/generate.py``, ``distrib-train
  eval ...`` is ``evaluation/tasks.py``."""
  if len(sys.argv) > 1 and sys.argv[1] == "plan":
    from distrib_train.podplan import cli as plan_cli

    sys.exit(plan_cli.main(sys.argv[2:]))
  if len(sys.argv) > 1 and sys.argv[1] == "generate":
    from distrib_train.inference import generate

    sys.exit(generate.main(sys.argv[2:]))
  if len(sys.argv) > 1 and sys.argv[1] == "eval":
    from distrib_train.evaluation import tasks as eval_tasks

    sys.exit(eval_tasks.main(sys.argv[2:]))
  if len(sys.argv) > 1 and sys.argv[1] == "export":
    from distrib_train.weights import export

    sys.exit(export.main(sys.argv[2:]))
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
