"""requirements/lock.py: the lock of tested versions — what each environment holds, how it moves, how it refuses.

The resolve tests run uv against a small local package index the test makes (wheels of a fake jax, libtpu and
CUDA plugin), never against what the registry serves that day; the refusals run `launch/local.sh` offline.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOCK_TOOL = ROOT / "requirements" / "lock.py"
PYTHON = "%d.%d" % sys.version_info[:2]
# The locks in use: requirements/, or the new ones bash .ci/upgrade runs the suite on.
LOCKS = pathlib.Path(os.environ.get("DT_LOCK_DIR", ROOT / "requirements"))

_spec = importlib.util.spec_from_file_location("lock_tool", LOCK_TOOL)
lock_tool = importlib.util.module_from_spec(_spec)
sys.modules["lock_tool"] = lock_tool  # dataclasses look their module up while the class is made
_spec.loader.exec_module(lock_tool)


def _uv():
  uv = pathlib.Path(sys.prefix) / "bin" / "uv"
  if not uv.exists():
    pytest.skip("no uv in this environment (the locks install it; pip install uv for a hand-made one)")
  return uv


def wheel(folder, name, version, requires=(), extras=()):
  """A minimal pure-Python wheel of `name` `version` with `requires` (Requires-Dist lines) in `folder`."""
  dist = f"{name.replace('-', '_')}-{version}"
  metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
  metadata += [f"Provides-Extra: {extra}" for extra in extras] + [f"Requires-Dist: {r}" for r in requires]
  files = {
    f"{dist}.dist-info/METADATA": "\n".join(metadata) + "\n",
    f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    f"{name.replace('-', '_')}/__init__.py": "",
  }
  files[f"{dist}.dist-info/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{dist}.dist-info/RECORD,,\n"
  with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as archive:
    for path, text in files.items():
      archive.writestr(path, text)


SPEC = """
pythons = ["3.12"]
platform = "x86_64-manylinux_2_35"
hold = "jax"
tools = []
[sets.test]
project = false
requirements = ["jax[tpu]"]
[sets.cuda-plugin]
project = false
requirements = ["jax-cuda12-plugin"]
no_deps = true
pin_to_hold = true
[sets.base]
project = false
requirements = ["jax"]
constrained_by = ["test"]
"""


@pytest.fixture
def index(tmp_path):
  """A local index: jax 1.0 (libtpu 0.1) and 1.1 (libtpu 0.2), each with its CUDA plugin; libtpu 0.1 only."""
  wheels = tmp_path / "wheels"
  wheels.mkdir()
  for version, libtpu in (("1.0", "0.1"), ("1.1", "0.2")):
    wheel(wheels, "jax", version, requires=[f'libtpu=={libtpu}.*; extra == "tpu"'], extras=["tpu"])
    wheel(wheels, "jax-cuda12-plugin", version)
  wheel(wheels, "libtpu", "0.1.0")
  (tmp_path / "sets.toml").write_text(SPEC, encoding="utf-8")
  (tmp_path / "before").mkdir()
  return tmp_path


def resolve(index):
  out = index / "out"
  done = subprocess.run(
    [
      sys.executable,
      str(LOCK_TOOL),
      "resolve",
      "--out",
      str(out),
      "--spec",
      str(index / "sets.toml"),
      "--against",
      str(index / "before"),
      "--uv",
      str(_uv()),
      "--sources",
      f"--no-index --find-links {index / 'wheels'}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  return done.stdout, {path.stem: lock_tool.pins(path) for path in (out / "py3.12").glob("*.txt")}


def test_upgrade_holds_jax_back_while_the_libtpu_it_needs_is_missing(index):
  report, locks = resolve(index)
  assert "held back: jax held at 1.0 on Python 3.12 (1.1 is served)" in report
  assert "libtpu" in report.split("held back:")[1].splitlines()[0]  # the reason names what is missing
  assert locks["test"] == {"jax": "1.0", "libtpu": "0.1.0"}
  assert locks["base"] == {"jax": "1.0"}  # the plain set takes the tested jax, not the newest
  assert locks["cuda-plugin"] == {"jax-cuda12-plugin": "1.0"}  # the plugin paired with the held jax


def test_upgrade_takes_the_newest_jax_once_its_libtpu_is_served(index):
  wheel(index / "wheels", "libtpu", "0.2.0")
  report, locks = resolve(index)
  assert "held back" not in report
  assert locks["test"] == {"jax": "1.1", "libtpu": "0.2.0"} and locks["base"] == {"jax": "1.1"}
  assert locks["cuda-plugin"] == {"jax-cuda12-plugin": "1.1"}
  assert "py3.12/test: jax (none) -> 1.1" in report


def test_every_lock_is_generated_and_pins_pip_uv_and_jax_for_each_interpreter():
  spec = lock_tool.read_spec(ROOT / "requirements" / "sets.toml")
  for python in spec.pythons:
    for chosen in spec.sets(python):
      path = LOCKS / f"py{python}" / f"{chosen.name}.txt"
      text = path.read_text(encoding="utf-8")
      assert text.startswith(f"# The {chosen.name} set for Python {python}"), path
      pinned = lock_tool.pins(path)
      if chosen.no_deps:
        continue
      assert {"pip", "uv", "jax", "jaxlib"} <= set(pinned), path
      # Every line is a pin: the lock names versions, never ranges.
      assert all(lock_tool._PIN.match(line) for line in text.splitlines() if line and not line.startswith("#"))
  for python in spec.pythons:
    sets = {p.stem: lock_tool.pins(p) for p in (LOCKS / f"py{python}").glob("*.txt")}
    assert sets["cuda-plugin"]["jax-cuda12-plugin"] == sets["test"]["jax"] == sets["cuda12"]["jax"]
    assert "libtpu" in sets["test"] and "libtpu" in sets["tpu"] and "jax-cuda12-plugin" in sets["cuda12"]


def test_this_environment_holds_exactly_its_lock():
  marker = pathlib.Path(sys.prefix) / lock_tool.MARKER
  if not marker.exists():
    if os.environ.get("DT_REQUIRE_LOCK") == "1":
      pytest.fail(f"{sys.prefix} was not built from a lock (no {lock_tool.MARKER}); .ci/run builds it so")
    pytest.skip(f"{sys.prefix} was not built from a lock (requirements/lock.py install makes one that is)")
  lock = pathlib.Path(json.loads(marker.read_text(encoding="utf-8"))["lock"])
  assert lock_tool.mismatches(lock, lock_tool.installed()) == []


def test_the_check_names_each_package_off_the_lock(tmp_path):
  lock = tmp_path / "test.txt"
  lock.write_text("jax==0.12.0.1\nnumpy==2.5.5\n", encoding="utf-8")
  have = {"jax": "0.12.1", "numpy": "2.5.5", "stray": "1.0", "distrib-train": "0.1.0"}
  assert lock_tool.mismatches(lock, have) == [
    "jax: lock 0.12.0.1, installed 0.12.1",
    "stray: installed 1.0, not in the lock",
  ]


def _local_sh(tmp_path, lock_dir, venv, **extra):
  env = {key: value for key, value in os.environ.items() if not key.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
  env.update(VENV=str(venv), WORKDIR=str(tmp_path / "work"), DT_LOCK_DIR=str(lock_dir), **extra)
  env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
  return subprocess.run(
    ["bash", str(ROOT / "launch" / "local.sh"), "--install-only"], env=env, capture_output=True, text=True, timeout=300
  )


def test_local_sh_refuses_an_interpreter_the_lock_lacks_in_one_line_before_making_the_venv(tmp_path):
  locks = tmp_path / "locks"
  (locks / "py3.99").mkdir(parents=True)
  (locks / "py3.99" / "base.txt").write_text("jax==0.12.0.1\n", encoding="utf-8")
  done = _local_sh(tmp_path, locks, tmp_path / "venv")
  assert done.returncode == 2
  assert done.stderr.strip().splitlines() == [
    f"lock: no lock for Python {PYTHON} in {locks} (locked: 3.99): use one of those interpreters, or add "
    f"{PYTHON} to requirements/sets.toml and run bash .ci/upgrade"
  ]
  assert not (tmp_path / "venv").exists() and not (tmp_path / "work").exists()


def test_local_sh_refuses_a_withdrawn_wheel_in_one_line_naming_it(tmp_path):
  uv = _uv()
  version = lock_tool._version_of(uv)
  wheels = tmp_path / "wheels"
  wheels.mkdir()
  wheel(wheels, "uv", version)  # the pinned uv is served; the other pin is not (withdrawn)
  locks = tmp_path / "locks" / f"py{PYTHON}"
  locks.mkdir(parents=True)
  (locks / "base.txt").write_text(f"uv=={version}\nwithdrawn-package==1.0\n", encoding="utf-8")
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
  (venv / "bin" / "uv").symlink_to(uv)
  done = _local_sh(tmp_path, locks.parent, venv, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels))
  assert done.returncode == 2, done.stdout + done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"lock: {locks / 'base.txt'} cannot be installed: "), lines
  assert "withdrawn-package==1.0" in lines[0] and "bash .ci/upgrade" in lines[0]
  assert not (tmp_path / "work").exists()


@pytest.mark.parametrize(
  "stderr,line",
  [
    (
      "error: No solution found when resolving dependencies\n  cause: Because there is no version of libtpu==0.0.53"
      " and you require libtpu==0.0.53, we can conclude that your requirements are unsatisfiable.\n",
      "Because there is no version of libtpu==0.0.53 and you require libtpu==0.0.53",
    ),
    (
      "ERROR: Could not find a version that satisfies the requirement uv==9.9 (from versions: 0.1, 0.2)\n"
      "ERROR: No matching distribution found for uv==9.9\n",
      "no distribution of uv==9.9 is served",
    ),
  ],
)
def test_an_install_failure_is_said_in_one_line(stderr, line):
  assert lock_tool.reason(stderr) == line
