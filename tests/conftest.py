"""Test setup: 8 emulated CPU devices, set before jax is imported, and one
persistent XLA compilation cache for the whole run.

The cache is shared by every test, every subprocess a test starts (they
inherit the environment) and every pytest-xdist worker, so a program that
many tests compile — the tiny Llama's step on 8 devices, a worker's
two-process step — compiles once per run. It is used on jax ≥ 0.11 only: on
jax 0.10 on CPU a multi-device step loaded from the cache can deadlock
(BUILD_NOTES.md), so there each process compiles for itself, as the trainer
does. ``DT_TEST_XLA_CACHE`` names another directory ('' turns it off).
"""

import fcntl
import importlib.metadata
import os
import pathlib
import pickle

os.environ["JAX_PLATFORMS"] = "cpu"
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import xla_test_flags  # noqa: E402  (tests/ is on sys.path: pytest puts a conftest's folder there)

xla_test_flags.add_to_environment()


def _suite_cache_dir() -> str:
  if "DT_TEST_XLA_CACHE" in os.environ:
    return os.environ["DT_TEST_XLA_CACHE"]
  major_minor = tuple(int(p) for p in importlib.metadata.version("jax").split(".")[:2])
  if major_minor < (0, 11):
    return ""
  return str(pathlib.Path(__file__).resolve().parents[1] / ".pytest-xla-cache")


_CACHE = _suite_cache_dir()
if _CACHE and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  # Every program, however quick to compile: a subprocess pays each compile again otherwise.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def xla_cache(tmp_path_factory):
  """The persistent compilation cache for tests that run the trainer (``train.compilation_cache_dir``): the
  run's shared cache where there is one, else a directory of this session's."""
  return _CACHE or str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory):
  """``once_per_run(name, compute)``: ``compute()``'s value, computed once in the whole test run.

  For the expensive fixtures that several tests read (a trained workdir, dozens of refused CLI runs). As module
  fixtures they ran again whenever a pytest-xdist worker left their module and came back, or when both workers
  ran some of their tests: one stolen test re-ran test_bad_inputs' 63 CLI cases, 109 s. Under xdist the first
  worker to ask computes the value under a lock and leaves it pickled beside the workers' temporary folders (that
  folder is this run's own); the other reads it. Values are plain data: paths, text, arrays.
  """
  shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None
  values = {}

  def get(name, compute):
    if name not in values:
      if shared is None:
        values[name] = compute()
      else:
        path = shared / f"once-{name}.pickle"
        with open(shared / f"once-{name}.lock", "w") as lock:
          fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
          if not path.exists():
            partial = path.with_suffix(".partial")
            partial.write_bytes(pickle.dumps(compute()))
            partial.rename(path)
          values[name] = pickle.loads(path.read_bytes())
    return values[name]

  return get


# The compat job (Python 3.11 + jax 0.10, .ci/run) runs these: the core contract, penzai, the planner, checkpoints,
# data resume, several processes, Hugging Face against transformers, chat templates and conversations, and the
# trainer CLI end to end.
COMPAT_FILES = {
  "test_train_state.py",
  "test_train_step.py",
  "test_penzai.py",
  "test_planner.py",
  "test_axis_rules.py",
  "test_mesh.py",
  "test_checkpoint.py",
  "test_hf.py",
  "test_multiprocess.py",
  "test_data_resume.py",
  "test_config.py",
  "test_architecture.py",
  "test_versions.py",
  "test_chat.py",
  "test_sft.py",
  "test_state_fields.py",
}
COMPAT_TESTS = {
  "test_cli.py::test_end_to_end_files_metrics_profile_and_cache",
  "test_cli.py::test_resume_matches_a_straight_run",
  "test_trainer.py::test_rollback_restores_the_last_checkpoint_and_moves_past_the_batch",
  "test_mtp.py::test_deepseek_v3_mtp_layer_imports_and_exports_bit_for_bit",
  "test_lock.py::test_this_environment_holds_exactly_its_lock",
}


# Seconds each file took in a serial run (Python 3.12, jax 0.12, 2 cores, 2026-11-26). The heaviest run first, so
# that two xdist workers end on short tests instead of one waiting for the other's last libtpu compile. Only the
# order depends on these figures; a new file runs after them.
FILE_SECONDS = {
  "test_fp8.py": 463,
  "test_kill_matrix.py": 370,
  "test_podplan_tpu.py": 366,
  "test_context.py": 248,
  "test_podplan_gpu.py": 200,
  "test_local_checkpoints.py": 180,
  "test_moe.py": 145,
  "test_elastic_resume.py": 144,
  "test_pipeline.py": 143,
  "test_trainer.py": 128,
  "test_cli.py": 128,
  "test_bad_inputs.py": 107,
  "test_models.py": 91,
  "test_slurm.py": 74,
  "test_faults.py": 63,
  "test_launchers.py": 60,
  "test_disk_full.py": 54,
  "test_watchdog.py": 45,
  "test_tokenizer.py": 41,
  "test_init_from.py": 36,
  "test_readme.py": 34,
  "test_checkpoint.py": 32,
  "test_train_step.py": 28,
  "test_auto_layout.py": 45,
}


def pytest_collection_modifyitems(items):
  for item in items:
    file = item.path.name
    if file in COMPAT_FILES or f"{file}::{item.originalname}" in COMPAT_TESTS:
      item.add_marker(pytest.mark.compat)
  items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: a file's own order is kept


# The suite's serial test time, the figure each issue's growth is measured by (at most 5 % an issue): the sum of
# every test's call phase, as pytest's --durations=0 lists them, printed at the end of a run. Under pytest-xdist
# the controller receives every worker's reports, so the sum covers the whole run.
_CALL_SECONDS = []


def pytest_runtest_logreport(report):
  if report.when == "call":
    _CALL_SECONDS.append(report.duration)


def pytest_terminal_summary(terminalreporter):
  if _CALL_SECONDS and not os.environ.get("PYTEST_XDIST_WORKER"):
    terminalreporter.write_line(
      f"serial test time: {sum(_CALL_SECONDS):.0f} s in the call phases of {len(_CALL_SECONDS)} tests"
    )
