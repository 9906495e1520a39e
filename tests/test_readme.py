"""The README as a new user reads it: its Python runs, its commands exist.

Every ```python block of README.md runs as it is, in a fresh interpreter on
8 emulated CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
``JAX_PLATFORMS=cpu``) with a hard timeout, unless the line right before it
is an HTML comment saying why it cannot::

  <!-- not run: uses placeholders my_apply/my_batches -->

(a fragment with placeholders, or a block that needs a GPU, TPU or pod). A
block of another language marked ``<!-- run -->`` runs as Python too. Also
checked: every ``distrib-train …`` / ``python -m distrib_train…`` command the
README names answers ``--help`` with exit status 0, the flags its flag tables
list are the commands' own, and the config block labelled as the tiny preset
holds the tiny preset's values.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).parents[1]
README = ROOT / "README.md"
TIMEOUT_S = 240  # per block; the slowest (the Trainer example) takes ~10 s on an idle 2-core machine

_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->$")
_RUN = re.compile(r"^<!--\s*run\s*-->$")


def _blocks(text):
  """``(line, language, code, marker)`` per fenced block; marker is the HTML
  comment on the last non-blank line before the fence, or None."""
  blocks = []
  for match in _FENCE.finditer(text):
    before = [line.strip() for line in text[:match.start()].splitlines() if line.strip()]
    marker = before[-1] if before and before[-1].startswith("<!--") else None
    blocks.append((text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2), marker))
  return blocks


def _runnable(text):
  """``(line, code)`` of the blocks to run, and ``(line, reason)`` of those not run."""
  run, not_run = [], []
  for line, language, code, marker in _blocks(text):
    skip = _NOT_RUN.match(marker) if marker else None
    if skip:
      not_run.append((line, skip.group(1)))
    elif language in ("python", "py") or (marker and _RUN.match(marker)):
      run.append((line, code))
  return run, not_run


_TEXT = README.read_text()
_RUN_BLOCKS, _NOT_RUN_BLOCKS = _runnable(_TEXT)


def test_every_python_block_is_run_or_says_why_not():
  problems = []
  for line, language, _, marker in _blocks(_TEXT):
    skip = _NOT_RUN.match(marker) if marker else None
    if skip and not skip.group(1):
      problems.append(f"README.md:{line}: a 'not run' marker without a reason")
    if marker and not skip and not _RUN.match(marker):
      problems.append(f"README.md:{line}: an HTML comment before a block that is neither"
                      f" '<!-- not run: REASON -->' nor '<!-- run -->': {marker}")
    if skip and language not in ("python", "py"):
      problems.append(f"README.md:{line}: 'not run' marks a {language or 'plain'} block (only Python blocks run)")
  # A marker must sit right before a fence, not drift away from the block it was for.
  for number, text_line in enumerate(_TEXT.splitlines(), 1):
    if _NOT_RUN.match(text_line.strip()) or _RUN.match(text_line.strip()):
      following = [line for line in _TEXT.splitlines()[number:] if line.strip()]
      if not following or not following[0].startswith("```"):
        problems.append(f"README.md:{number}: a run marker not followed by a code block")
  assert not problems, "\n".join(problems)
  assert _RUN_BLOCKS, "no runnable Python block found in README.md"


def _env(tmp_path):
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  env["TMPDIR"] = str(tmp_path)  # what a block writes with tempfile stays in the test's directory
  env["HOME"] = str(tmp_path)    # the trainer's default compilation cache (~/.cache) too
  return env


@pytest.mark.parametrize("line,code", _RUN_BLOCKS, ids=[f"README.md:{line}" for line, _ in _RUN_BLOCKS])
def test_python_block_runs(line, code, tmp_path):
  script = tmp_path / f"readme_block_{line}.py"
  script.write_text(code)
  try:
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                         text=True, timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"README.md:{line}: the block did not finish in {TIMEOUT_S} s:\n{(e.stderr or '')[-3000:]}")
  assert out.returncode == 0, f"README.md:{line}: exit status {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
  if "trainer.Trainer(" in code:  # the Trainer example trains to its last step and evaluates, not only exits 0
    status, step, eval_loss = out.stdout.split()[-3:]
    assert (status, step) == ("finished", "100"), out.stdout[-2000:]
    assert 0 < float(eval_loss) < 5.545, out.stdout[-2000:]  # better than a uniform guess over bytes (ln 256)


def test_the_trainer_example_is_among_the_blocks_run():
  assert any("trainer.Trainer(" in code for _, code in _RUN_BLOCKS)


# --- commands --------------------------------------------------------------------------------------------

_COMMAND = re.compile(r"(distrib-train|python -m distrib_train(?:\.[A-Za-z_][\w.]*)?)(?=[\s`]|$)(?:[ \t]+([a-z]\w*))?")


def _commands(text):
  """The distinct ``(program, subcommand or None)`` pairs the README names: a
  lower-case word right after the program is taken as its subcommand (write
  the name in backquotes, `distrib-train`, to mention it in prose)."""
  found = {(match.group(1), match.group(2)) for match in _COMMAND.finditer(text)}
  return sorted(found, key=lambda c: (c[0], c[1] or ""))


def _argv(program):
  if program == "distrib-train":
    script = shutil.which("distrib-train") or shutil.which("distrib-train", path=str(pathlib.Path(sys.executable).parent))
    assert script, "the distrib-train console script is not installed (pip install -e .)"
    return [script]
  return [sys.executable, "-m", program.removeprefix("python -m ")]


_COMMANDS = _commands(_TEXT)


def test_the_readme_names_the_commands_it_should():
  assert ("distrib-train", None) in _COMMANDS and ("distrib-train", "plan") in _COMMANDS, _COMMANDS


@pytest.mark.parametrize("program,sub", _COMMANDS, ids=[f"{p} {s or ''}".strip() for p, s in _COMMANDS])
def test_command_exists(program, sub, tmp_path):
  argv = _argv(program) + ([sub] if sub else []) + ["--help"]
  out = subprocess.run(argv, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, f"{' '.join(argv)}: exit status {out.returncode}\n{out.stderr[-2000:]}"
  if sub:  # the trainer's flag parser ignores a word it does not know: the help must be the subcommand's
    assert f" {sub}" in (out.stdout + out.stderr).splitlines()[0], (out.stdout + out.stderr)[:500]


def _section(text, heading):
  start = text.index(f"\n## {heading}\n")
  end = text.find("\n## ", start + 1)
  return text[start:end if end > 0 else len(text)]


@pytest.mark.parametrize("heading,sub", [("Training from the command line", None),
                                         ("Planning a pod from a laptop", "plan")])
def test_flag_tables_list_real_flags(heading, sub, tmp_path):
  rows = [line for line in _section(_TEXT, heading).splitlines() if line.startswith("| `--")]
  listed = {flag for row in rows for flag in re.findall(r"`(--[a-z_]+)", row.split("|")[1])}
  assert listed, f"no flag table under '## {heading}'"
  argv = _argv("distrib-train") + ([sub] if sub else []) + ["--help"]
  out = subprocess.run(argv, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
  known = set(re.findall(r"--[a-z_]+", out.stdout + out.stderr))
  assert listed <= known, f"README lists flags that {' '.join(argv[:-1])} does not have: {sorted(listed - known)}"


def test_config_block_is_the_tiny_preset():
  from distrib_train import recipes
  from distrib_train.training import config

  [(_, _, code, _)] = [b for b in _blocks(_TEXT) if b[1] == "yaml" and "the tiny preset" in b[2]]
  shown = yaml.safe_load(code)
  preset = config.load("tiny").to_dict()
  model = dict(shown["model"])
  assert {k: model.pop(k) for k in ("name", "preset")} == preset["model"]
  recipe = recipes.get(preset["model"]["name"], preset=preset["model"]["preset"])
  for field, value in model.items():  # the model's own fields, at the preset's values
    assert getattr(recipe.config, field) == value, field
  for section in ("optimizer", "data", "train"):
    for key, value in shown[section].items():
      assert preset[section][key] == value, f"{section}.{key}: README {value!r}, tiny preset {preset[section][key]!r}"
  assert shown["mesh_config"] == preset["mesh_config"]
