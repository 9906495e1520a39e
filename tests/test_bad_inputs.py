"""A catalogue of bad inputs: each is refused early, with one line naming the
culprit, no traceback, and nothing on disk touched.

Four tables:

- ``CLI_CASES``: ``python -m distrib_train`` with a bad flag, config,
  ``--set``, mesh config, axis rules, workdir or data path. Exit status 2,
  one ``error:`` line, no traceback, the case's directory unchanged (a
  workdir that did not exist is not created).
- ``CHECKPOINT_CASES``: the same run pointed at a copy of a trained workdir
  whose checkpoint was damaged, or was written for another model.
- ``LAUNCHER_CASES``: ``launch/local.sh`` and ``launch/slurm_gpu.sbatch``
  with bad values (dry runs and real ones: nothing may start).
- ``API_CASES``: the same kinds of mistakes through the Python API: the
  exception type and its message.

The subprocesses of a table run in parallel (they fail before compiling);
the security checks (safe YAML, pickles in checkpoints, the coordinator's
bind address, no unsafe loaders in the code) are at the end.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import hashlib
import json
import os
import pathlib
import pickle
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import xla_test_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARALLEL = 4
# A 2-step tiny run on synthetic data; every CLI case starts from these. The
# shapes and schedule are test_cli's, so the step compiled here for the
# trained workdir comes from the session's compilation cache there.
FAST = [
  "--cpu_devices",
  "8",
  "--steps",
  "2",
  "--set",
  "data.seq_len=32",
  "--set",
  "data.global_batch_size=8",
  "--set",
  "data.source=synthetic",
  "--set",
  "data.synthetic_documents=64",
  "--set",
  "train.eval_every=0",
  "--set",
  "train.eval_batches=1",
  "--set",
  "train.log_every=1",
  "--set",
  "optimizer.warmup_steps=0",
  "--set",
  "optimizer.decay_steps=10",
]
MARKER = "EXPLOITED"  # what the payloads below would create in the case directory


class _Bomb:
  """Unpickling it runs a shell command that creates a marker file."""

  def __init__(self, marker: pathlib.Path):
    self.marker = marker

  def __reduce__(self):
    return (os.system, (f"touch {self.marker}",))


def _python_tag(marker: str) -> str:
  return f"!!python/object/apply:os.system ['touch {marker}']\n"


# --- running a case ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
  """One bad input.

  Attributes:
    args: extra trainer flags; ``{dir}`` is the case's own directory.
    message: text the one error line must hold (each of them).
    files: files to create in the case directory first (``None``: a
      directory); ``{dir}`` and ``{marker}`` in their text are filled in.
    workdir: the ``--workdir`` (relative to the case directory); None: no flag.
    damage: for checkpoint cases, applied to the copy of the trained workdir.
    hide: packages the run's interpreter cannot import, as if not installed (``hide_packages/``).
  """

  args: tuple[str, ...] = ()
  message: str | tuple[str, ...] = ()
  files: Mapping[str, str | bytes | None] = dataclasses.field(default_factory=dict)
  workdir: str | None = "run"
  damage: Callable[[pathlib.Path], None] | None = None
  hide: tuple[str, ...] = ()


@dataclasses.dataclass
class Outcome:
  returncode: int
  stderr: str
  before: dict[str, Any]
  after: dict[str, Any]
  directory: pathlib.Path
  workdir_existed: bool


def snapshot(root: pathlib.Path) -> dict[str, Any]:
  """Every file under ``root`` by relative path: size, mtime and content hash
  (directories by name)."""
  out = {}
  for path in sorted(root.rglob("*")):
    rel = str(path.relative_to(root))
    if path.name == ".distrib_train.lock":
      # Names the last job that held the workdir; a job that got the lock and then found a damaged array
      # rewrote it. A job refused the lock never writes it (test_cli_refuses_a_workdir_another_job_holds).
      continue
    if path.name.endswith((".dtindex", ".dtindex.lock")):
      continue  # the kept index of a data file (data/index_cache.py): valid whatever the run went on to do
    if path.is_dir():
      out[rel] = "dir"
    else:
      stat = path.stat()
      out[rel] = (stat.st_size, stat.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
  return out


def fill(text: str, directory: pathlib.Path) -> str:
  """``text`` with ``{dir}`` (the case directory) and ``{marker}`` filled in."""
  return text.replace("{dir}", str(directory)).replace("{marker}", str(directory / MARKER))


def _write_files(directory: pathlib.Path, files: Mapping[str, str | bytes | None]) -> None:
  for rel, content in files.items():
    path = directory / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if content is None:
      path.mkdir()
    elif isinstance(content, bytes):
      path.write_bytes(content)
    else:
      path.write_text(fill(content, directory))


def _env(hide: tuple[str, ...] = ()) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = xla_test_flags.FAST_COMPILE  # --cpu_devices sets the device count
  if hide:
    env["DT_TEST_HIDE"] = ",".join(hide)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests" / "hide_packages"), env.get("PYTHONPATH")]))
  return env


def run_case(name: str, case: Case, base: pathlib.Path, cache: str, trained: pathlib.Path | None = None) -> Outcome:
  directory = base / name
  directory.mkdir()
  _write_files(directory, case.files)
  if trained is not None:
    shutil.copytree(trained, directory / "run")
    if case.damage is not None:
      case.damage(directory / "run")
  # os.path.exists, not Path.exists: the latter raises on a name too long for the file system.
  workdir_existed = case.workdir is not None and os.path.exists(directory / case.workdir)
  before = snapshot(directory)
  cmd = [sys.executable, "-m", "distrib_train", "--config", "tiny"]
  if case.workdir is not None:
    cmd += ["--workdir", str(directory / case.workdir)]
  cmd += [*FAST, "--set", f"train.compilation_cache_dir={cache}", *(fill(a, directory) for a in case.args)]
  proc = subprocess.run(cmd, cwd=ROOT, env=_env(case.hide), capture_output=True, text=True, timeout=240)
  return Outcome(proc.returncode, proc.stderr, before, snapshot(directory), directory, workdir_existed)


def run_all(cases: Mapping[str, Case], base: pathlib.Path, cache: str, trained=None) -> dict[str, Outcome]:
  with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
    futures = {name: pool.submit(run_case, name, case, base, cache, trained) for name, case in cases.items()}
    return {name: future.result() for name, future in futures.items()}


# What asyncio and tensorstore print of failed reads and writes left unfinished (none may appear).
ECHOES = ("never retrieved", "Exception ignored", "Event loop is closed", "destroyed but it is pending")


def assert_refused(outcome: Outcome, case: Case, prefix: str = "distrib-train: error: ") -> None:
  """Exit 2, one error line naming the culprit, no traceback, nothing touched."""
  stderr = outcome.stderr
  assert outcome.returncode == 2, stderr[-3000:]
  assert "Traceback" not in stderr, stderr[-3000:]
  errors = [line for line in stderr.splitlines() if "error" in line.lower()]
  assert len(errors) == 1 and errors[0].startswith(prefix), stderr[-3000:]
  for echo in ECHOES:  # what a failed read's abandoned futures would print (checkpoint/faults.py)
    assert echo not in stderr, stderr[-3000:]
  assert len(errors[0]) < 3000, errors[0][:3000]  # values repeated in a message are cut
  for text in (case.message,) if isinstance(case.message, str) else case.message:
    assert text in errors[0], f"{text!r} not in {errors[0]!r}"
  assert outcome.after == outcome.before, "files changed in the case directory"
  if case.workdir is not None and not outcome.workdir_existed:
    assert not os.path.exists(outcome.directory / case.workdir), "the workdir was created"
  assert not (outcome.directory / MARKER).exists()


# --- CLI: flags, configs, --set, mesh configs, axis rules, workdirs, data -------------

_MESH_AXES = "devices: 8\naxes: {data: 2, fsdp: 2, tensor: 2}\n"
# Nine levels of nine aliases, 306 bytes: 490 million values once expanded.
_ALIAS_BOMB = "".join(
  f"{c}: &{c} [{','.join([f'*{p}' if p else '1'] * 9)}]\n" for p, c in zip(["", *"abcdefgh"], "abcdefghi")
)

CLI_CASES: dict[str, Case] = {
  # YAML config files
  "yaml-syntax-error": Case(
    ("--config", "{dir}/c.yaml"), ("is not valid YAML", "c.yaml", "line 2"), {"c.yaml": "train: [1, 2\n"}
  ),
  "yaml-duplicate-key": Case(
    ("--config", "{dir}/c.yaml"),
    ("found the key 'train' twice", "c.yaml"),
    {"c.yaml": "train: {steps: 3}\ntrain: {steps: 5}\n"},
  ),
  "yaml-python-tag": Case(
    ("--config", "{dir}/c.yaml"), ("c.yaml", "could not determine a constructor"), {"c.yaml": _python_tag("{marker}")}
  ),
  "yaml-not-utf8": Case(
    ("--config", "{dir}/c.yaml"), ("c.yaml", "is not UTF-8 text (byte 15)"), {"c.yaml": b"train: {steps: \xff\xfe}\n"}
  ),
  "yaml-nested-20000-levels": Case(
    ("--config", "{dir}/c.yaml"),
    ("c.yaml", "nests deeper than 64 levels"),
    {"c.yaml": "train: " + "[" * 20000 + "]" * 20000 + "\n"},
  ),
  "yaml-alias-bomb": Case(
    ("--config", "{dir}/c.yaml"), ("c.yaml", "expands to more than 100,000 values"), {"c.yaml": _ALIAS_BOMB}
  ),
  "yaml-recursive-alias": Case(
    ("--config", "{dir}/c.yaml"), ("c.yaml", "alias inside its own anchor"), {"c.yaml": "train: &a [*a]\n"}
  ),
  "config-huge-value-is-cut": Case(
    ("--config", "{dir}/c.yaml"),
    ("train.keep_checkpoints must be an integer, got 'xxx", "xxx...xxx"),
    {"c.yaml": "train: {keep_checkpoints: " + "x" * 200000 + "}\n"},
  ),
  "config-unknown-key": Case(
    ("--config", "{dir}/c.yaml"),
    ("Unknown config key 'train.stpes'", "train.steps"),
    {"c.yaml": "train:\n  stpes: 3\n"},
  ),
  "config-zero-model-size": Case(
    ("--config", "{dir}/c.yaml"),
    "model.num_layers must be at least 1, got 0",
    {"c.yaml": "model: {preset: tiny, num_layers: 0}\n"},
  ),
  "config-unknown-preset": Case(
    ("--config", "{dir}/c.yaml"), "Unknown preset 'huge'", {"c.yaml": "model: {name: llama, preset: huge}\n"}
  ),
  "config-missing-file": Case(("--config", "{dir}/missing.yaml"), ("missing.yaml", "does not exist")),
  # --set overrides
  "set-unknown-key": Case(("--set", "train.step=3"), ("Unknown config key 'train.step'", "did you mean train.steps")),
  "set-bad-value": Case(("--set", "train.log_every=abc"), "train.log_every must be an integer, got 'abc'"),
  "set-missing-equals": Case(("--set", "steps"), "--set 'steps': expected key=value"),
  # flags
  "flag-unknown": Case(
    (
      "--stepz",
      "3",
    ),
    "Unknown command line flag 'stepz'",
  ),
  "flag-bad-integer": Case(("--steps", "many"), "flag --steps=many"),
  "flag-negative-steps": Case(("--steps=-5",), "train.steps must be at least 1, got -5"),
  "flag-extra-argument": Case(("extra",), "unexpected arguments 'extra'"),
  "flag-bad-profile-steps": Case(("--profile_steps", "5:2"), "--profile_steps '5:2': need 1 ≤ A ≤ B"),
  "flag-profile-steps-not-numbers": Case(("--profile_steps", "x:y"), "--profile_steps 'x:y': expected A:B"),
  "flag-zero-cpu-devices": Case(("--cpu_devices", "0"), "cpu_devices must be at least 1, got 0"),
  "flag-incomplete-job": Case(("--num_processes", "2"), "missing coordinator_address, process_id"),
  "flag-bad-coordinator": Case(
    ("--coordinator_address", "nohost", "--num_processes", "2", "--process_id", "0"),
    "coordinator_address 'nohost' must be host:port",
  ),
  "flag-no-workdir": Case(workdir=None, message="--workdir is required."),
  "workdir-is-a-file": Case((), ("Workdir", "is a file; give a directory"), {"run": "a file\n"}),
  "workdir-component-too-long": Case(
    (), ("the path component 'wwww", "is 300 bytes", "at most 255"), workdir="w" * 300 + "/run"
  ),
  "workdir-under-a-file": Case((), ("cannot be created", "f' is a file"), {"f": "a file\n"}, workdir="f/run"),
  "cache-dir-under-a-file": Case(
    ("--set", "train.compilation_cache_dir={dir}/f/cache"),
    ("train.compilation_cache_dir", "f/cache", "cannot be created"),
    {"f": "x\n"},
  ),
  # mesh configs
  "mesh-unknown-name": Case(
    ("--mesh_config", "cpu-9"), "No mesh config named 'cpu-9'; known: cpu-2proc, cpu-2proc-pipeline, cpu-8,"
  ),
  "mesh-device-count": Case(("--mesh_config", "tpu-v4-32"), "tpu-v4-32.yaml is for 16 devices; this job has 8"),
  "mesh-axes-product": Case(
    ("--mesh_config", "{dir}/m.yaml"),
    "m.yaml: ici sizes data=3 × fsdp=2 = 6 do not match the 8 devices found",
    {"m.yaml": "axes: {data: 3, fsdp: 2}\n"},
  ),
  "mesh-bad-yaml": Case(
    ("--mesh_config", "{dir}/m.yaml"), ("Mesh config", "m.yaml", "is not valid YAML"), {"m.yaml": "axes: {data: 8\n"}
  ),
  # axis rules
  "rules-unknown-mesh-axis": Case(
    ("--mesh_config", "{dir}/m.yaml"),
    ("names mesh axis 'model'", "m.yaml"),
    {"m.yaml": _MESH_AXES + "rules: [[batch, data], [mlp, model]]\n"},
  ),
  "rules-default-set-uses-no-mesh-axis": Case(
    ("--mesh_config", "{dir}/m.yaml"),
    "Mesh axis x (size 8) is used by no axis rule in rule set 'fsdp_tensor'",
    {"m.yaml": "devices: 8\naxes: {x: 8}\n"},
  ),
  "rules-logical-name-twice": Case(
    ("--mesh_config", "{dir}/m.yaml"),
    "axis rule #2 ('embed', 'fsdp') repeats rule #1",
    {"m.yaml": _MESH_AXES + "rules: [[batch, data], [embed, fsdp], [embed, fsdp]]\n"},
  ),
  "rules-unknown-set": Case(("--set", "train.rules=fsdp"), "train.rules must be one of data_parallel, fsdp_tensor"),
  "rules-map-nothing-onto-an-axis": Case(
    ("--mesh_config", "{dir}/m.yaml"),
    ("Mesh axis contxt (size 2) is used by no axis rule in the rules of", "m.yaml"),
    {"m.yaml": "devices: 8\naxes: {data: 2, fsdp: 2, contxt: 2}\nrules: [[batch, [data, fsdp]], [embed, fsdp]]\n"},
  ),
  "rules-shipped-set-misses-an-axis": Case(
    ("--mesh_config", "{dir}/m.yaml"),
    ("Mesh axis sequence (size 2) is used by no axis rule in rule set 'fsdp_tensor'"),
    {"m.yaml": "devices: 8\naxes: {data: 2, fsdp: 2, tensor: 1, sequence: 2}\n"},
  ),
  "data-batch-not-divisible-by-the-mesh": Case(
    ("--set", "data.global_batch_size=6"),
    (
      "data.global_batch_size 6 does not divide over the mesh's batch axes data=2 × fsdp=2 = 4",
      "data.allow_replicated_batch=true",
    ),
  ),
  # data paths
  "data-missing-file": Case(
    ("--set", "data.source=text", "--set", "data.paths={dir}/none/*.txt"),
    "Data path '{dir}/none/*.txt' matches no file",
  ),
  "data-empty-file": Case(
    ("--set", "data.source=text", "--set", "data.paths={dir}/e.txt"), "holds no documents", {"e.txt": ""}
  ),
  "data-not-utf8": Case(
    ("--set", "data.source=text", "--set", "data.paths={dir}/b.txt"),
    "b.txt' is not UTF-8 text (byte 0)",
    {"b.txt": b"\xff\xfe\x00binary"},
  ),
  "data-unreadable-directory": Case(
    ("--set", "data.source=text", "--set", "data.paths={dir}/d.txt"),
    ("Cannot read data file", "d.txt", "Is a directory"),
    {"d.txt": None},
  ),
  "data-bad-jsonl": Case(
    ("--set", "data.source=text", "--set", "data.paths={dir}/x.jsonl", "--set", "data.bad_records=error"),
    ("x.jsonl' line ", "is not JSON", "data.bad_records=skip would"),
    {"x.jsonl": '{"text": "a"}\n' + "{text\n" * 40},
  ),
  "data-too-few-documents": Case(
    ("--set", "data.source=text", "--set", "data.paths={dir}/one.txt"),
    ("The train split has 0 document(s)", "data.eval_fraction=0.05"),
    {"one.txt": "one document\n"},
  ),
  "data-jsonl-only-empty-texts": Case(
    ("--set", "data.source=text", "--set", "data.paths={dir}/e.jsonl"),
    ("holds no tokens", "e.jsonl"),
    {"e.jsonl": '{"text": ""}\n' * 40},
  ),
  "eval-asked-without-eval-split": Case(
    ("--set", "data.eval_fraction=0", "--set", "train.eval_every=1"),
    ("train.eval_every=1 asks for evaluations", "eval_fraction is 0"),
  ),
}


@pytest.fixture(scope="session")
def cli_outcomes(tmp_path_factory, xla_cache, once_per_run):
  return once_per_run("bad_inputs_cli", lambda: run_all(CLI_CASES, tmp_path_factory.mktemp("cli"), xla_cache))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_refuses_bad_input_with_one_line_and_touches_nothing(cli_outcomes, name):
  case = CLI_CASES[name]
  outcome = cli_outcomes[name]
  messages = (case.message,) if isinstance(case.message, str) else case.message
  case = dataclasses.replace(case, message=tuple(fill(m, outcome.directory) for m in messages))
  assert_refused(outcome, case)


# --- CLI: checkpoints ----------------------------------------------------------------------


def _step(workdir: pathlib.Path) -> pathlib.Path:
  return workdir / "checkpoints" / "2"


def _truncate_arrays(workdir):
  for path in (_step(workdir) / "state").glob("ocdbt.process_*/d/*"):
    with open(path, "r+b") as f:
      f.truncate(10)


def _remove(rel):
  return lambda workdir: (_step(workdir) / rel).unlink()


def _remove_all(pattern):
  def damage(workdir):
    paths = list(_step(workdir).glob(pattern))
    assert paths, pattern
    for path in paths:
      path.unlink()

  return damage


def _write(rel, content):
  def damage(workdir):
    path = _step(workdir) / rel
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)

  return damage


def _format_version(workdir):
  path = _step(workdir) / "meta" / "metadata"
  meta = json.loads(path.read_text())
  meta["format_version"] = 99
  path.write_text(json.dumps(meta))


def _checkpoints_as_file(workdir):
  shutil.rmtree(workdir / "checkpoints")
  (workdir / "checkpoints").write_text("not a directory\n")


def _pickle_as_metadata(workdir):
  (_step(workdir) / "meta" / "metadata").write_bytes(pickle.dumps(_Bomb(workdir.parent / MARKER)))


CHECKPOINT_CASES: dict[str, Case] = {
  "ckpt-other-model": Case(
    ("--set", "model.d_model=32"),
    ("Checkpoint step 2", "does not fit the target state", "params/embed: checkpoint [256, 64], target [256, 32]"),
  ),
  "ckpt-other-preset": Case(
    ("--set", "model.preset=124m"),
    ("does not fit the target state", "params/embed: checkpoint [256, 64], target [32000, 768]"),
  ),
  "ckpt-truncated-arrays": Case(
    (),
    ("checkpoints/2' cannot be read (a damaged or truncated file?)", "Requested byte range"),
    damage=_truncate_arrays,
  ),
  "ckpt-no-commit-marker": Case(
    (), "checkpoints/2' is incomplete (no commit_success.txt)", damage=_remove("commit_success.txt")
  ),
  "ckpt-no-step-metadata": Case((), "is incomplete (no _CHECKPOINT_METADATA)", damage=_remove("_CHECKPOINT_METADATA")),
  "ckpt-no-array-metadata": Case((), "is incomplete (no state/_METADATA)", damage=_remove("state/_METADATA")),
  "ckpt-garbage-array-metadata": Case(
    (),
    "Checkpoint step 2 in '{dir}/run/checkpoints' has unreadable array metadata",
    damage=_write("state/_METADATA", "garbage{"),
  ),
  "ckpt-empty-newer-step-dir": Case(
    (),
    "checkpoints/5' is incomplete (no commit_success.txt, _CHECKPOINT_METADATA",
    damage=lambda w: (w / "checkpoints" / "5").mkdir(),
  ),
  "ckpt-bad-metadata-json": Case(
    (), "Checkpoint step 2 in '{dir}/run/checkpoints' has unreadable metadata", damage=_write("meta/metadata", "{bad")
  ),
  "ckpt-format-version": Case((), "has format version 99; this distrib_train reads version 1", damage=_format_version),
  "ckpt-dir-is-a-file": Case((), "run/checkpoints' is a file, not a directory", damage=_checkpoints_as_file),
  "ckpt-pickle-as-metadata": Case((), "has unreadable metadata", damage=_pickle_as_metadata),
  "ckpt-step-dir-zero-padded": Case(
    (),
    "checkpoints/00002' is not named by its step number ('2')",
    damage=lambda w: _step(w).rename(w / "checkpoints" / "00002"),
  ),
  "ckpt-array-file-deleted": Case(
    (), "checkpoints/2' cannot be read (a damaged or truncated file?)", damage=_remove_all("state/ocdbt.process_*/d/*")
  ),
  "ckpt-ocdbt-index-deleted": Case((), "has unreadable array metadata", damage=_remove_all("state/d/*")),
}


def _as_if_a_job_were_saving(held: list):
  """Damage that holds the workdir's lock in this process and leaves an
  in-progress orbax directory and an old step half deleted, as a running job
  would (it deletes the steps past ``train.keep_checkpoints`` as it saves)."""

  def damage(workdir):
    from distrib_train.train.workdir_lock import WorkdirLock

    (workdir / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir()
    (_step(workdir) / "commit_success.txt").unlink()
    lock = WorkdirLock(workdir)
    lock.acquire()
    held.append(lock)

  return damage


@pytest.mark.timeout(300)
def test_cli_refuses_a_workdir_another_job_holds(tmp_path, xla_cache, trained_workdir):
  """A second job on a running job's workdir stops before it deletes or
  writes anything (the first's in-progress checkpoint included), naming the
  job, not a step the job is deleting."""
  held = []
  case = Case((), damage=_as_if_a_job_were_saving(held))
  try:
    outcome = run_case("held", case, tmp_path, xla_cache, trained=trained_workdir)
  finally:
    for lock in held:
      lock.release()
  workdir = outcome.directory / "run"
  assert_refused(
    outcome,
    dataclasses.replace(case, message=f"Workdir {str(workdir)!r} is in use by another job (pid {os.getpid()} on host"),
  )
  assert (workdir / "checkpoints" / "4.orbax-checkpoint-tmp-1").is_dir()
  assert (workdir / ".distrib_train.lock").read_text().startswith(f"pid {os.getpid()} on host")


def _train(tmp_path_factory, xla_cache) -> pathlib.Path:
  workdir = tmp_path_factory.mktemp("trained") / "run"
  cmd = [
    sys.executable,
    "-m",
    "distrib_train",
    "--config",
    "tiny",
    "--workdir",
    str(workdir),
    *FAST,
    "--set",
    f"train.compilation_cache_dir={xla_cache}",
  ]
  out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
  assert out.returncode == 0, out.stderr[-3000:]
  assert (workdir / "checkpoints" / "2" / "commit_success.txt").is_file()
  return workdir


@pytest.fixture(scope="session")
def trained_workdir(tmp_path_factory, xla_cache, once_per_run):
  """A 2-step tiny run with its checkpoint at step 2 (read only: a case copies it)."""
  return once_per_run("bad_inputs_trained", lambda: _train(tmp_path_factory, xla_cache))


@pytest.fixture(scope="session")
def checkpoint_outcomes(tmp_path_factory, xla_cache, trained_workdir, once_per_run):
  return once_per_run(
    "bad_inputs_checkpoints",
    lambda: run_all(CHECKPOINT_CASES, tmp_path_factory.mktemp("ckpt"), xla_cache, trained=trained_workdir),
  )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CHECKPOINT_CASES))
def test_cli_refuses_a_bad_checkpoint_before_touching_the_workdir(checkpoint_outcomes, name):
  case = CHECKPOINT_CASES[name]
  outcome = checkpoint_outcomes[name]
  messages = (case.message,) if isinstance(case.message, str) else case.message
  case = dataclasses.replace(case, message=tuple(fill(m, outcome.directory) for m in messages))
  assert_refused(outcome, case)


@pytest.mark.timeout(600)
def test_foreign_files_and_pickles_in_the_checkpoint_dir_are_ignored(tmp_path, xla_cache, trained_workdir):
  """Files orbax did not write (notes, a stray directory, pickles next to and
  inside the step) change nothing: the step restores and no pickle is run."""

  def damage(workdir):
    bomb = pickle.dumps(_Bomb(workdir.parent / MARKER))
    (workdir / "checkpoints" / "notes.txt").write_text("hello\n")
    (workdir / "checkpoints" / "junk").mkdir()
    (workdir / "checkpoints" / "evil.pkl").write_bytes(bomb)
    (_step(workdir) / "evil.pkl").write_bytes(bomb)
    (_step(workdir) / "state" / "pickle").write_bytes(bomb)

  outcome = run_case("foreign", Case(damage=damage), tmp_path, xla_cache, trained=trained_workdir)
  assert outcome.returncode == 0, outcome.stderr[-3000:]
  assert "Restored step 2" in outcome.stderr and "Step 2 of 2 is already done" in outcome.stderr
  rewritten = {"run/config.yaml", "run/plan.txt"}  # an already-done run writes these again
  assert {k: v for k, v in outcome.after.items() if k not in rewritten} == {
    k: v for k, v in outcome.before.items() if k not in rewritten
  }
  assert not (tmp_path / "foreign" / MARKER).exists()


# --- optional packages ---------------------------------------------------------------

# Each optional package a config can ask for, hidden in turn: one line naming the feature, the package and the
# extra, before anything is written (common/extras.py). jinja2 is a core dependency too (a broken environment).
# safetensors and transformers are not imported by distrib_train (it reads and writes safetensors itself), and
# penzai only for a penzai model the caller built with it; libtpu is `plan`'s (the test after this one).
MISSING_PACKAGE_CASES: dict[str, Case] = {
  "no-jinja2": Case(
    ("--set", "data.source=pydoc", "--set", "data.loss_on=assistant"),
    "data.loss_on needs jinja2: pip install 'distrib_train[text]'",
    hide=("jinja2",),
  ),
  "no-tokenizers": Case(
    ("--set", "data.tokenizer=hf:{dir}/tokenizer.json"),
    "data.tokenizer hf: needs tokenizers: pip install 'distrib_train[text]'",
    {"tokenizer.json": "{}"},
    hide=("tokenizers",),
  ),
  "no-sentencepiece": Case(
    ("--set", "data.tokenizer=sentencepiece:{dir}/m.model"),
    "data.tokenizer sentencepiece: needs sentencepiece: pip install 'distrib_train[text]'",
    {"m.model": "x"},
    hide=("sentencepiece",),
  ),
  "no-tiktoken": Case(
    ("--set", "data.tokenizer=tiktoken:{dir}/t.tiktoken"),
    "data.tokenizer tiktoken: needs tiktoken: pip install 'distrib_train[text]'",
    {"t.tiktoken": "x"},
    hide=("tiktoken",),
  ),
  "no-pyarrow": Case(
    ("--set", "data.source=text", "--set", "data.paths={dir}/d.parquet"),
    ("Parquet data ('{dir}/d.parquet') needs pyarrow: pip install 'distrib_train[text]'",),
    {"d.parquet": "x"},
    hide=("pyarrow",),
  ),
  "no-zstandard": Case(
    ("--set", "data.source=text", "--set", "data.paths={dir}/d.jsonl.zst"),
    "zstd-compressed data ('{dir}/d.jsonl.zst') needs zstandard: pip install 'distrib_train[text]'",
    {"d.jsonl.zst": "x"},
    hide=("zstandard",),
  ),
  "no-datasets": Case(
    ("--set", "data.source=text", "--set", "data.paths={dir}/ds"),
    "Hugging Face datasets folder as data ('{dir}/ds') needs datasets: pip install 'distrib_train[datasets]'",
    {"ds/state.json": "{}"},
    hide=("datasets",),
  ),
}


@pytest.fixture(scope="session")
def missing_package_outcomes(tmp_path_factory, xla_cache):
  return run_all(MISSING_PACKAGE_CASES, tmp_path_factory.mktemp("missing"), xla_cache)


@pytest.mark.parametrize("name", list(MISSING_PACKAGE_CASES))
def test_a_missing_optional_package_is_one_line_naming_the_feature_and_its_extra(missing_package_outcomes, name):
  case = MISSING_PACKAGE_CASES[name]
  outcome = missing_package_outcomes[name]
  messages = (case.message,) if isinstance(case.message, str) else case.message
  assert_refused(outcome, dataclasses.replace(case, message=tuple(fill(m, outcome.directory) for m in messages)))


def test_plan_for_a_tpu_without_libtpu_is_one_line_naming_what_to_install(tmp_path):
  out = subprocess.run(
    [sys.executable, "-m", "distrib_train", "plan", "--config", "llama-124m-tpu"],
    cwd=ROOT,
    env=_env(("libtpu",)),
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
  (line,) = [line for line in out.stderr.splitlines() if "error" in line.lower()]
  assert "pip install 'jax[tpu]==" in line, out.stderr


# --- launchers -----------------------------------------------------------------------------

LOCAL, SLURM = ROOT / "launch" / "local.sh", ROOT / "launch" / "slurm_gpu.sbatch"
_TRAINER_ARGS = ("--config", "tiny", "--workdir", "{dir}/run")

LAUNCHER_CASES: dict[str, tuple[pathlib.Path, tuple[str, ...], dict[str, str], str]] = {
  "local-nproc-not-a-number": (LOCAL, (), {"NPROC": "two"}, "NPROC must be a positive integer, got 'two'"),
  "local-nproc-zero": (LOCAL, (), {"NPROC": "0"}, "NPROC must be a positive integer, got '0'"),
  "local-devices-negative": (LOCAL, ("--dry-run",), {"DEVICES": "-4"}, "DEVICES must be a positive integer"),
  "local-timeout-not-a-number": (
    LOCAL,
    ("--steps", "3", "--dry-run"),
    {"TIMEOUT": "10m"},
    "TIMEOUT must be a positive integer, got '10m'",
  ),
  "slurm-no-arguments": (SLURM, (), {}, "no trainer arguments"),
  "slurm-dry-run-no-arguments": (SLURM, ("--dry-run",), {}, "no trainer arguments"),
  "slurm-no-workdir": (SLURM, ("--dry-run", "--config", "tiny"), {}, "--workdir is required"),
  "slurm-cpu-devices-zero": (
    SLURM,
    ("--dry-run", *_TRAINER_ARGS),
    {"CPU_DEVICES": "0"},
    "CPU_DEVICES must be a number of at least 1, got '0'",
  ),
  "slurm-per-node-not-0-or-1": (
    SLURM,
    ("--dry-run", *_TRAINER_ARGS),
    {"PER_NODE": "8"},
    "PER_NODE must be 0 or 1, got '8'",
  ),
  "slurm-dry-run-not-0-or-1": (SLURM, _TRAINER_ARGS, {"DRY_RUN": "yes"}, "DRY_RUN must be 0 or 1, got 'yes'"),
  "slurm-missing-venv": (
    SLURM,
    ("--dry-run", *_TRAINER_ARGS),
    {"VENV": "{dir}/no-venv"},
    "VENV={dir}/no-venv has no bin/activate",
  ),
  "slurm-outside-a-job": (SLURM, _TRAINER_ARGS, {}, "not inside a SLURM job"),
}


@pytest.mark.parametrize("name", list(LAUNCHER_CASES))
def test_launcher_refuses_bad_values_with_one_line_and_starts_nothing(tmp_path, name):
  script, args, env, message = LAUNCHER_CASES[name]
  environment = {
    "PATH": os.environ["PATH"],
    "HOME": str(tmp_path),
    "VENV": sys.prefix,
    "WORKDIR": str(tmp_path / "run"),
    **{k: fill(v, tmp_path) for k, v in env.items()},
  }
  out = subprocess.run(
    ["bash", str(script), *(fill(a, tmp_path) for a in args)],
    env=environment,
    capture_output=True,
    text=True,
    timeout=60,
  )
  prefix = f"{script.name}: error: "
  assert out.returncode == 2, out.stdout + out.stderr
  assert out.stderr.count("\n") == 1 and out.stderr.startswith(prefix), out.stderr
  assert fill(message, tmp_path) in out.stderr, out.stderr
  assert out.stdout == "" and "Traceback" not in out.stderr
  assert sorted(p.name for p in tmp_path.iterdir()) == []  # no workdir, no logs, no venv


def test_local_dry_run_anywhere_in_the_arguments_runs_nothing(tmp_path):
  env = {"PATH": os.environ["PATH"], "VENV": sys.prefix, "WORKDIR": str(tmp_path / "run")}
  out = subprocess.run(
    ["bash", str(LOCAL), "--steps", "3", "--dry-run"], env=env, capture_output=True, text=True, timeout=60
  )
  assert out.returncode == 0, out.stderr
  assert "--dry-run" not in out.stdout and "--steps 3 --coordinator_address" in out.stdout
  assert not (tmp_path / "run").exists()


# --- the Python API: exception types and messages -------------------------------------------


def _config_file(tmp_path, text):
  from distrib_train.config import run as config

  path = tmp_path / "c.yaml"
  path.write_text(text)
  return lambda: config.load(str(path))


def _mesh_file(tmp_path, text):
  import distrib_train as dt

  path = tmp_path / "m.yaml"
  path.write_text(text)
  return lambda: dt.MeshConfig.from_yaml(path)


def _overrides(*items):
  from distrib_train.config import run as config

  return lambda tmp_path: lambda: config.load("tiny", list(items))


def _rules(*args, **kwargs):
  import distrib_train as dt

  return lambda tmp_path: lambda: dt.AxisRules(*args, **kwargs)


def _documents(files: Mapping[str, str | bytes], **config):
  def make(tmp_path):
    from distrib_train import data
    from distrib_train.data import sources

    _write_files(tmp_path, files)
    paths = tuple(str(tmp_path / name) for name in files) or ("x",)
    return lambda: sources.Documents(data.DataConfig(**{"source": "text", "paths": paths, **config}))

  return make


def _saved_small_state(tmp_path):
  import jax
  import jax.numpy as jnp
  import optax

  import distrib_train as dt

  # Large enough that tensorstore keeps the values in data files, not inline in its b-tree.
  state = dt.TrainState.initial_state({"w": jnp.ones((256, 64))}, optax.adam(0.1), jax.random.key(0))
  with dt.CheckpointManager(tmp_path / "ckpt", async_save=False) as checkpoints:
    checkpoints.save(1, state)
  return state


def _restore_other_shape(tmp_path):
  import jax
  import jax.numpy as jnp
  import optax

  import distrib_train as dt

  _saved_small_state(tmp_path)
  other = dt.TrainState.initial_state({"w": jnp.ones((256, 32))}, optax.adam(0.1), jax.random.key(0))
  return lambda: dt.check_restorable(tmp_path / "ckpt", other)


def _restore_truncated(tmp_path):
  import distrib_train as dt

  state = _saved_small_state(tmp_path)
  for path in (tmp_path / "ckpt" / "1" / "state").glob("ocdbt.process_*/d/*"):
    path.write_bytes(path.read_bytes()[:10])

  def restore():
    with dt.CheckpointManager(tmp_path / "ckpt") as checkpoints:
      checkpoints.restore(state)

  return restore


def _load(name):
  from distrib_train.config import run as config

  return config.load(name)


def _mkdir(path):
  path.mkdir()
  return path


def _c(text):
  return lambda tmp_path: _config_file(tmp_path, text)


def _m(text):
  return lambda tmp_path: _mesh_file(tmp_path, text)


API_CASES: dict[str, tuple[Callable[[pathlib.Path], Callable[[], Any]], str, str]] = {
  # (make the call, the exception's class name, text in its message)
  "config-not-a-mapping": (_c("- train\n- data\n"), "ConfigError", "must be a mapping of sections, got list"),
  "config-wrong-type": (
    _c("data: {packing: maybe}\n"),
    "ConfigError",
    "data.packing must be true or false, got 'maybe'",
  ),
  "config-negative-value": (
    _c("train: {log_every: -1}\n"),
    "ConfigError",
    "train.log_every must be at least 1, got -1",
  ),
  "config-nan-learning-rate": (
    _c("optimizer: {learning_rate: .nan}\n"),
    "ConfigError",
    "optimizer.learning_rate must be finite, got nan",
  ),
  "config-unknown-named-preset": (
    lambda tmp_path: lambda: _load("nope"),
    "ConfigError",
    "No config preset 'nope'; presets: ",
  ),
  "config-is-a-directory": (
    lambda tmp_path: functools.partial(_load, str(_mkdir(tmp_path / "d.yaml"))),
    "ConfigError",
    "d.yaml' is not a file",
  ),
  "set-zero-kv-heads": (_overrides("model.num_kv_heads=0"), "ConfigError", "model.num_kv_heads must be at least 1"),
  "set-bad-dtype": (_overrides("model.dtype=floaty"), "ConfigError", "model.dtype must name a float dtype"),
  "set-empty-key": (_overrides("=5"), "ConfigError", "--set '=5': expected key=value"),
  "set-bad-bool": (
    _overrides("data.packing=perhaps"),
    "ConfigError",
    "data.packing must be true or false, got 'perhaps'",
  ),
  "mesh-unknown-key": (_m("axes: {data: 8}\nrule: fsdp_tensor\n"), "ValueError", "m.yaml: unknown key(s) 'rule'"),
  "config-tab-indent": (_c("train:\n\tsteps: 3\n"), "ConfigError", "found character '\\t' that cannot start"),
  "config-section-not-a-mapping": (_c("train: 3\n"), "ConfigError", "section 'train' must be a mapping, got 3"),
  "config-unknown-section": (_c("trian: {steps: 3}\n"), "ConfigError", "Unknown config key 'trian'"),
  "config-list-of-ints-for-paths": (
    _c("data: {paths: [1, 2]}\n"),
    "ConfigError",
    "data.paths must be a list of strings",
  ),
  "config-bool-for-int": (_c("train: {steps: true}\n"), "ConfigError", "train.steps must be an integer, got True"),
  "config-date-for-int": (_c("train: {steps: 2024-01-01}\n"), "ConfigError", "train.steps must be an integer"),
  "config-eval-fraction-out-of-range": (
    _c("data: {eval_fraction: 1.5}\n"),
    "ConfigError",
    "eval_fraction must be in [0, 1), got 1.5",
  ),
  "config-zero-keep-checkpoints": (
    _c("train: {keep_checkpoints: 0}\n"),
    "ConfigError",
    "train.keep_checkpoints must be at least 1, got 0",
  ),
  "config-unknown-model": (_c("model: {name: gpt}\n"), "ConfigError", "Unknown model 'gpt'; known: llama, mlp"),
  "config-huge-int-for-float": (
    _c("optimizer: {learning_rate: " + "9" * 400 + "}\n"),
    "ConfigError",
    "optimizer.learning_rate must be a number",
  ),
  "set-infinite-value": (
    _overrides("optimizer.learning_rate=inf"),
    "ConfigError",
    "optimizer.learning_rate must be finite, got 'inf'",
  ),
  "set-unknown-model-field": (_overrides("model.d_modle=8"), "ConfigError", "did you mean model.d_model"),
  "mesh-axis-size-not-a-number": (
    _m("axes: {data: two}\n"),
    "ValueError",
    "m.yaml: ici size of axis 'data' must be an integer, got 'two'",
  ),
  "mesh-duplicate-axis": (_m("axes: {data: 2, data: 4}\n"), "ConfigError", "found the key 'data' twice"),
  "mesh-two-auto-fill": (_m("axes: {data: -1, fsdp: -1}\n"), "ValueError", "are all -1; at most one ici size"),
  "mesh-zero-devices": (_m("devices: 0\naxes: {data: -1}\n"), "ValueError", "'devices' must be a positive integer"),
  "mesh-granules-without-devices": (_m("granules: 2\naxes: {data: -1}\n"), "ValueError", "give both or neither"),
  "mesh-declared-devices-do-not-fit": (
    _m("devices: 8\naxes: {data: 3}\n"),
    "ValueError",
    "ici sizes data=3 = 3 do not match the 8 devices found",
  ),
  "mesh-unknown-axis-level": (_m("axes: {data: {icy: 8}}\n"), "ValueError", "axis 'data' has unknown key(s) 'icy'"),
  "mesh-non-string-keys": (_m("axes: {data: 8}\n1: 2\nrule: x\n"), "ValueError", "unknown key(s) 1, 'rule'"),
  "mesh-python-tag": (
    lambda tmp_path: _mesh_file(tmp_path, _python_tag(tmp_path / MARKER)),
    "ConfigError",
    "could not determine a constructor",
  ),
  "rules-unknown-set": (
    _m("axes: {data: 8}\nrules: fsdp_tenser\n"),
    "ValueError",
    "Unknown axis rule set 'fsdp_tenser'",
  ),
  "rules-param-axes-without-rules": (
    _m("axes: {data: 8}\nparam_axes: [['.*', [embed]]]\n"),
    "ValueError",
    "'param_axes' needs 'rules' beside it",
  ),
  "rules-not-a-pair": (_rules([("embed",)]), "ValueError", "axis rule #0 ('embed',): a rule is a pair"),
  "rules-mesh-axis-twice": (
    _rules([("batch", ("data", "data"))]),
    "ValueError",
    "mesh axes ('data', 'data') repeat an axis",
  ),
  "rules-bad-regex": (_rules([], param_axes=[("(", ("embed",))]), "ValueError", "bad regex '('"),
  "rules-logical-name-twice-in-param-axes": (
    _rules([], param_axes=[(".*", ("embed", "embed"))]),
    "ValueError",
    "'embed' appear more than once",
  ),
  "rules-param-axes-not-a-list": (_rules([], param_axes=5), "ValueError", "param_axes must be a list of"),
  "rules-unknown-mesh-axis-in-spec": (lambda tmp_path: _rule_on_mesh(), "ValueError", "names mesh axis 'model'"),
  "data-jsonl-without-text": (
    _documents({"x.jsonl": '{"body": "a"}\n'}),
    "ValueError",
    "x.jsonl' line 1 has no string field 'text'",
  ),
  "data-unknown-source": (lambda tmp_path: _data_config(source="web"), "ValueError", "unknown source 'web'"),
  "data-text-without-paths": (lambda tmp_path: _data_config(source="text"), "ValueError", "source 'text' needs paths"),
  "data-mixed-record-and-text": (
    _documents({"a.txt": "x", "b.array_record": "junk"}),
    "ValueError",
    "mix .array_record shards and text files",
  ),
  "data-bad-array-record": (
    _documents({"b.array_record": b"not an array record"}),
    "ValueError",
    "b.array_record' is not a readable ArrayRecord file",
  ),
  "ckpt-restore-other-shape": (
    _restore_other_shape,
    "CheckpointError",
    "params/w: checkpoint [256, 64], target [256, 32]",
  ),
  "ckpt-restore-truncated": (_restore_truncated, "CheckpointError", "cannot be read (a damaged or truncated file?)"),
}


def _rule_on_mesh():
  import jax

  import distrib_train as dt

  mesh = dt.build_mesh(dt.MeshConfig(("data",), (-1,)), devices=jax.devices()[:1])
  return lambda: dt.MeshPlanner(mesh, dt.AxisRules([("mlp", "model")]))


def _data_config(**kwargs):
  from distrib_train import data

  return lambda: data.DataConfig(**kwargs)


# orbax leaves the reads of a damaged checkpoint's other shards unawaited when one fails.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("name", list(API_CASES))
def test_api_refuses_bad_input_with_its_own_error(tmp_path, name):
  make, error, message = API_CASES[name]
  call = make(tmp_path)
  before = snapshot(tmp_path)
  with pytest.raises(ValueError) as info:  # every error of the contract is a ValueError
    call()
  gc.collect()  # orbax's abandoned reads warn here, under the filter above, not in a later test
  assert type(info.value).__name__ == error, repr(info.value)
  assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
  assert snapshot(tmp_path) == before
  assert not (tmp_path / MARKER).exists()


def test_the_catalogue_has_at_least_30_cases_in_every_category():
  total = len(CLI_CASES) + len(CHECKPOINT_CASES) + len(LAUNCHER_CASES) + len(API_CASES)
  assert total >= 30
  kinds = {name.split("-")[0] for name in [*CLI_CASES, *CHECKPOINT_CASES, *LAUNCHER_CASES, *API_CASES]}
  assert {"yaml", "config", "set", "flag", "mesh", "rules", "data", "ckpt", "local", "slurm"} <= kinds


# --- security ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "payload",
  [
    "!!python/object/apply:os.system ['touch {marker}']\n",
    "!!python/object/new:os.system ['touch {marker}']\n",
    "train: !!python/object/apply:subprocess.check_call [['touch', '{marker}']]\n",
    "axes: !!python/name:os.system\n",
  ],
  ids=["apply", "new", "nested-apply", "name"],
)
def test_yaml_with_python_tags_is_refused_and_never_run(tmp_path, payload):
  import distrib_train as dt
  from distrib_train.config import run as config

  path = tmp_path / "evil.yaml"
  path.write_text(fill(payload, tmp_path))
  with pytest.raises(config.ConfigError, match="could not determine a constructor"):
    config.load(str(path))
  with pytest.raises(ValueError, match="could not determine a constructor"):
    dt.MeshConfig.from_yaml(path)
  assert not (tmp_path / MARKER).exists()


def test_pickles_in_a_checkpoint_directory_are_never_loaded(tmp_path):
  """Next to the steps, inside a step and in place of its metadata: restore
  reads arrays and JSON only, so the bombs stay inert."""
  import distrib_train as dt

  state = _saved_small_state(tmp_path)
  bomb = pickle.dumps(_Bomb(tmp_path / MARKER))
  step = tmp_path / "ckpt" / "1"
  for path in (
    tmp_path / "ckpt" / "evil.pkl",
    step / "evil.pkl",
    step / "state" / "pickle",
    step / "meta" / "metadata.pkl",
  ):
    path.write_bytes(bomb)
  with dt.CheckpointManager(tmp_path / "ckpt") as checkpoints:
    restored = checkpoints.restore(state)
  assert restored.params["w"].shape == (256, 64)
  (step / "meta" / "metadata").write_bytes(bomb)
  with pytest.raises(dt.CheckpointError, match="unreadable metadata"):
    dt.check_restorable(tmp_path / "ckpt", state)
  assert not (tmp_path / MARKER).exists()


# Code that would run or unpickle what it reads. yaml.load is allowed only
# with the config module's SafeLoader subclass.
_UNSAFE = {
  "pickle": re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|shelve|marshal)\b", re.M),
  "eval/exec": re.compile(r"(?<![\w.])(eval|exec)\("),
  "yaml.load": re.compile(r"yaml\.(load|unsafe_load|full_load|load_all)\((?![^)]*Loader=_UniqueKeyLoader)"),
  "yaml Loader": re.compile(r"yaml\.(Unsafe|Full)?Loader\b"),
  "allow_pickle": re.compile(r"allow_pickle\s*=\s*True"),
  "np.load": re.compile(r"\bnp\.load\("),
}


def test_the_package_has_no_unsafe_loaders():
  found = []
  for path in sorted((ROOT / "distrib_train").rglob("*.py")):
    text = path.read_text()
    for what, pattern in _UNSAFE.items():
      for match in pattern.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        found.append(f"{path.relative_to(ROOT)}:{line}: {what}")
  assert found == []


def test_a_loopback_coordinator_listens_on_loopback_only():
  """``initialize`` passes a loopback coordinator address as the bind
  address (JAX's default binds every interface); checked on the socket."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  script = f"""
import json
from distrib_train.cluster import distributed
distributed.initialize(coordinator_address="127.0.0.1:{port}", num_processes=1, process_id=0, cpu_devices=1)
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
  for line in open(table).read().splitlines()[1:]:
    local, state = line.split()[1], line.split()[3]
    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == {port}:
      listening.append(local.rsplit(":", 1)[0])
print(json.dumps(listening))
"""
  out = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  listening = json.loads(out.stdout.strip().splitlines()[-1])
  assert listening, "the coordinator is not listening"
  # 127.0.0.1 as /proc writes it: 0100007F, or IPv4-mapped ::ffff:127.0.0.1 in tcp6.
  assert all(address in ("0100007F", "0000000000000000FFFF00000100007F") for address in listening), listening


_LISTENING_SOCKETS = """
import json, os
from jax.experimental import multihost_utils
import numpy as np
from distrib_train.cluster import distributed
distributed.initialize(coordinator_address="127.0.0.1:{port}", num_processes=2, process_id={process_id}, cpu_devices=2)
multihost_utils.process_allgather(np.ones(4))  # gloo connects its pairs
inodes = set()
for fd in os.listdir("/proc/self/fd"):
  try:
    target = os.readlink(f"/proc/self/fd/{{fd}}")
  except OSError:  # the listing's own descriptor, closed by now
    continue
  if target.startswith("socket:["):
    inodes.add(target[8:-1])
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
  for line in open(table).read().splitlines()[1:]:
    fields = line.split()
    if fields[3] == "0A" and fields[9] in inodes:
      listening.append(fields[1])
multihost_utils.sync_global_devices("read")
print(json.dumps(listening))
"""


@pytest.mark.timeout(300)
def test_a_local_job_listens_on_loopback_only_gloo_included():
  """Every socket either process of a 2-process CPU job listens on (the
  coordinator, gloo's collective pairs) is on 127.0.0.1, whatever the host
  name resolves to."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", _LISTENING_SOCKETS.format(port=port, process_id=i)],
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  try:
    outputs = [proc.communicate(timeout=240) for proc in procs]
  finally:
    for proc in procs:
      proc.kill()
  for proc, (out, err) in zip(procs, outputs):
    assert proc.returncode == 0, err[-2000:]
  listening = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
  assert len(listening[0]) >= 2 and listening[1], listening  # process 0: the coordinator and gloo
  loopback = ("0100007F", "0000000000000000FFFF00000100007F")
  assert all(local.rsplit(":", 1)[0] in loopback for sockets in listening for local in sockets), listening


@pytest.mark.parametrize(
  "address, bind",
  [
    ("127.0.0.1:1234", "127.0.0.1:1234"),
    ("localhost:1234", "localhost:1234"),
    ("10.0.0.7:1234", None),  # another host must reach it: JAX's default (JAX_COORDINATOR_BIND_ADDRESS narrows it)
  ],
)
def test_the_coordinator_bind_address_follows_the_coordinator_address(monkeypatch, address, bind):
  import jax

  from distrib_train.cluster import distributed

  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
  distributed.initialize(coordinator_address=address, num_processes=2, process_id=0)
  assert calls[0]["coordinator_bind_address"] == bind


def test_tests_and_launchers_bind_nothing_to_every_interface():
  found = []
  for folder in ("tests", "launch", "examples", "bench"):
    for path in sorted((ROOT / folder).rglob("*")):
      if path.is_file() and path.suffix in (".py", ".sh", ".sbatch", ".yaml", "") and path != pathlib.Path(__file__):
        text = path.read_text(errors="ignore")
        for pattern in ("0.0.0.0", "[::]", "INADDR_ANY", 'bind(("", '):
          if pattern in text:
            found.append(f"{path.relative_to(ROOT)}: {pattern}")
  assert found == []
