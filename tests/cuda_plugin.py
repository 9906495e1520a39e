"""JAX's CUDA plugin in the tests: where it is, the skip without it (a failure under CI), and a program run by
XLA's CUDA compiler in a subprocess.

The plugin is two wheels (``jax-cuda12-plugin``, ``jax-cuda12-pjrt``, about
180 MB, no NVIDIA libraries needed to compile). ``.ci/run`` installs them into
``.ci-venv/cuda-plugin`` (``DISTRIB_TRAIN_CUDA_PLUGIN`` names another folder)
— beside the test environment, not in it: loaded into every process, the
plugin prints a line about missing CUDA drivers on each ``import jax``. Tests
run what needs it in a process that has it on ``PYTHONPATH``.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLUGIN = pathlib.Path(os.environ.get("DISTRIB_TRAIN_CUDA_PLUGIN", ROOT / ".ci-venv" / "cuda-plugin"))


def require(module_level: bool = False) -> None:
  """Skips the test (or the module) when the plugin is missing; fails under CI, where ``.ci/run`` installs it."""
  if not (PLUGIN / "jax_plugins" / "xla_cuda12").is_dir():
    if os.environ.get("CI"):
      pytest.fail(f"JAX's CUDA plugin is not in {PLUGIN}; .ci/run installs it there", pytrace=False)
    pytest.skip(
      f"JAX's CUDA plugin is not in {PLUGIN} (set DISTRIB_TRAIN_CUDA_PLUGIN)", allow_module_level=module_level
    )


def environment(xla_flags: str | None = None) -> dict[str, str]:
  """A subprocess's environment: CPU as JAX's platform, the plugin and the repository importable, and only
  ``xla_flags`` (none of the test process's CPU flags)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([str(PLUGIN), str(ROOT)])}
  env.pop("XLA_FLAGS", None)
  if xla_flags:
    env["XLA_FLAGS"] = xla_flags
  return env


def run_program(source: str, xla_flags: str | None = None) -> dict:
  """Runs ``source`` with the plugin and returns the JSON its last printed line holds (asserting it ran)."""
  run = subprocess.run(
    [sys.executable, "-c", source], cwd=ROOT, env=environment(xla_flags), capture_output=True, text=True, timeout=600
  )
  assert run.returncode == 0, run.stderr[-3000:]
  return json.loads(run.stdout.strip().splitlines()[-1])
