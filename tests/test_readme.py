"""The README and the guides in docs/ as a new user reads them: their Python
runs, their commands, flags, config keys and links exist.

Every ```python block of README.md and docs/*.md runs as it is, in a fresh
interpreter on 8 emulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``, ``JAX_PLATFORMS=cpu``)
with a hard timeout, unless the line right before it is an HTML comment saying
why it cannot::

  <!-- not run: uses placeholders my_apply/my_batches -->

(a fragment with placeholders, or a block that needs a GPU, TPU or pod). A
block of another language marked ``<!-- run -->`` runs as Python too.

Every command block (```bash, ```console: its ``$`` lines) runs too, unless
marked the same way, in a virtualenv built as the README's set-up builds it
(``launch/local.sh --install-only``: the ``base`` lock, no extras), so a
demo that needs a package the set-up does not install fails here. Each command
runs as written with two changes: ``/tmp/`` becomes the test's own folder, and
a training run gets ``--steps 2`` and the suite's compilation cache (it
starts, trains and checkpoints; the full runs' figures are the docs' own). A
block of commands must say it is one (```bash), not be left unlabelled. Also
checked, over the same files: every ``distrib-train …`` / ``python -m
distrib_train…`` command they name answers ``--help`` with exit status 0; the
flags their flag tables list are the commands' own; every config key they
name (``--set train.steps=…``, `` `model.fp8` ``) is one the config accepts;
every relative link points at a file that exists (and, for a ``#section``
of a Markdown file, a heading that exists). The config block labelled as the
tiny preset holds the tiny preset's values. README.md stays at most 300
lines, and its table of guides names exactly the files in docs/.
"""

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300
TIMEOUT_S = 240  # per block; the slowest (the Trainer example) takes ~10 s on an idle 2-core machine

_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->$")
_RUN = re.compile(r"^<!--\s*run\s*-->$")


def _name(path):
  return path.relative_to(ROOT).as_posix()


# The files a reader is sent to: the README, then every guide.
_FILES = [README] + sorted(DOCS.glob("*.md"))
_TEXTS = {_name(path): path.read_text() for path in _FILES}


def _blocks(text):
  """``(line, language, code, marker)`` per fenced block; marker is the HTML
  comment on the last non-blank line before the fence, or None."""
  blocks = []
  for match in _FENCE.finditer(text):
    before = [line.strip() for line in text[: match.start()].splitlines() if line.strip()]
    marker = before[-1] if before and before[-1].startswith("<!--") else None
    blocks.append((text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2), marker))
  return blocks


_SHELL = ("bash", "sh", "shell", "console")
_LOOKS_LIKE_COMMANDS = re.compile(r"^(\$ |distrib-train |python3? |bash |pip |\.venv/)", re.MULTILINE)


def _runnable(text):
  """``(line, code)`` of the blocks to run, and ``(line, reason)`` of those not run."""
  run, not_run = [], []
  for line, language, code, marker in _blocks(text):
    skip = _NOT_RUN.match(marker) if marker else None
    if skip:
      not_run.append((line, skip.group(1)))
    elif language in ("python", "py") or (marker and _RUN.match(marker) and language not in _SHELL):
      run.append((line, code))
  return run, not_run


_RUN_BLOCKS = [(name, line, code) for name, text in _TEXTS.items() for line, code in _runnable(text)[0]]


def test_the_guides_are_read():
  assert len(_FILES) > 1, "no docs/*.md found"


@pytest.mark.parametrize("name", list(_TEXTS))
def test_every_python_and_command_block_is_run_or_says_why_not(name):
  text = _TEXTS[name]
  problems = []
  for line, language, code, marker in _blocks(text):
    skip = _NOT_RUN.match(marker) if marker else None
    if skip and not skip.group(1):
      problems.append(f"{name}:{line}: a 'not run' marker without a reason")
    if marker and not skip and not _RUN.match(marker):
      problems.append(
        f"{name}:{line}: an HTML comment before a block that is neither"
        f" '<!-- not run: REASON -->' nor '<!-- run -->': {marker}"
      )
    if skip and language not in ("python", "py", *_SHELL):
      problems.append(
        f"{name}:{line}: 'not run' marks a {language or 'plain'} block (only Python and command blocks run)"
      )
    if not language and _LOOKS_LIKE_COMMANDS.search(code):
      problems.append(
        f"{name}:{line}: an unlabelled block of commands: label it ```bash (```console for a"
        " transcript) so that it runs; one that cannot run then says why: '<!-- not run: REASON -->'"
      )
  # A marker must sit right before a fence, not drift away from the block it was for.
  lines = text.splitlines()
  for number, text_line in enumerate(lines, 1):
    if _NOT_RUN.match(text_line.strip()) or _RUN.match(text_line.strip()):
      following = [line for line in lines[number:] if line.strip()]
      if not following or not following[0].startswith("```"):
        problems.append(f"{name}:{number}: a run marker not followed by a code block")
  assert not problems, "\n".join(problems)


def test_runnable_python_blocks_are_found():
  assert any(name == "README.md" for name, _, _ in _RUN_BLOCKS), "no runnable Python block found in README.md"
  assert any(name.startswith("docs/") for name, _, _ in _RUN_BLOCKS), "no runnable Python block found in docs/"


def _env(tmp_path):
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  env["TMPDIR"] = str(tmp_path)  # what a block writes with tempfile stays in the test's directory
  env["HOME"] = str(tmp_path)  # the trainer's default compilation cache (~/.cache) too
  return env


@pytest.mark.parametrize("name,line,code", _RUN_BLOCKS, ids=[f"{name}:{line}" for name, line, _ in _RUN_BLOCKS])
def test_python_block_runs(name, line, code, tmp_path):
  script = tmp_path / f"block_{line}.py"
  script.write_text(code)
  try:
    out = subprocess.run(
      [sys.executable, str(script)], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S
    )
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"{name}:{line}: the block did not finish in {TIMEOUT_S} s:\n{(e.stderr or '')[-3000:]}")
  assert out.returncode == 0, f"{name}:{line}: exit status {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
  if "trainer.Trainer(" in code:  # the Trainer example trains to its last step and evaluates, not only exits 0
    status, step, eval_loss = out.stdout.split()[-3:]
    assert (status, step) == ("finished", "100"), out.stdout[-2000:]
    assert 0 < float(eval_loss) < 5.545, out.stdout[-2000:]  # better than a uniform guess over bytes (ln 256)


def test_the_trainer_example_is_among_the_blocks_run():
  assert any("dt.Trainer(" in code for name, _, code in _RUN_BLOCKS if name == "README.md")


# --- command blocks, in the set-up's own virtualenv ---------------------------------------------------------

STEPS = 2  # of each training run a block starts
COMMAND_TIMEOUT_S = 300  # per command; a 2-step run of the tiny presets takes 20-40 s on a busy 2-core machine


def _shell_commands(language, code):
  """A command block's commands, as argv lists: continuation lines joined, comments dropped; of a ``console``
  transcript, its ``$`` lines only."""
  logical, current = [], ""
  for line in code.splitlines():
    if line.rstrip().endswith("\\"):
      current += line.rstrip()[:-1] + " "
      continue
    logical.append(current + line)
    current = ""
  if language == "console":
    logical = [line[2:] for line in logical if line.startswith("$ ")]
  return [argv for argv in (shlex.split(line, comments=True) for line in logical) if argv]


def _shell_blocks(text):
  """``(line, language, code)`` of the command blocks to run."""
  return [
    (line, language, code)
    for line, language, code, marker in _blocks(text)
    if language in _SHELL and not (marker and _NOT_RUN.match(marker))
  ]


_SHELL_BLOCKS = [
  (name, line, language, code) for name, text in _TEXTS.items() for line, language, code in _shell_blocks(text)
]


def _is_training_run(argv):
  """``distrib-train …`` / ``python -m distrib_train …`` without a subcommand: the trainer."""
  if argv[0] == "distrib-train":
    rest = argv[1:]
  elif argv[:3] in (["python", "-m", "distrib_train"], ["python3", "-m", "distrib_train"]):
    rest = argv[3:]
  else:
    return False
  return not rest or rest[0].startswith("-")


def _workdir(argv):
  for i, arg in enumerate(argv):
    if arg == "--workdir":
      return argv[i + 1]
    if arg.startswith("--workdir="):
      return arg.partition("=")[2]
  return None


def test_command_blocks_are_found_and_parsed():
  runs = [
    argv
    for name, _, language, code in _SHELL_BLOCKS
    if name.startswith("docs/")
    for argv in _shell_commands(language, code)
    if _is_training_run(argv)
  ]
  assert len(runs) >= 4, runs  # the SFT and DPO demos, the pipeline, MoE and long-context runs
  assert _shell_commands("bash", "a b \\\n  'c d'  # note\n# only a comment\n\ne") == [["a", "b", "c d"], ["e"]]
  assert _shell_commands("console", "$ distrib-train x\nan output line\n") == [["distrib-train", "x"]]
  assert _is_training_run(["python", "-m", "distrib_train", "--config", "tiny"])
  assert not _is_training_run(["distrib-train", "plan", "--config", "tiny"])
  # an unlabelled block is taken for commands when a line starts like one, not for output or data
  assert _LOOKS_LIKE_COMMANDS.search("# a comment\npython -m distrib_train --config sft-tiny\n")
  assert not _LOOKS_LIKE_COMMANDS.search('{"prompt": "python is"}\ncheckpoints/1000/\nPlan: llama-7b-tpu\n')


def _without_the_suites_variables():
  """This process's environment less what the suite and its virtualenv set (a user's shell has none of it)."""
  return {
    key: value
    for key, value in os.environ.items()
    if not key.startswith(("JAX_", "XLA_", "DT_", "PYTEST_"))
    and key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")
  }


@pytest.fixture(scope="session")
def setup_venv(tmp_path_factory, once_per_run):
  """A virtualenv built by ``launch/local.sh --install-only``, as the README's set-up builds it, once per run."""

  def build():
    venv = tmp_path_factory.mktemp("setup-venv") / "venv"
    env = _without_the_suites_variables()
    env["VENV"] = str(venv)
    # launch/local.sh creates it with `python3 -m venv`: this run's interpreter, under that name.
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    out = subprocess.run(
      ["bash", str(ROOT / "launch" / "local.sh"), "--install-only"],
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
    )
    assert out.returncode == 0, (
      f"launch/local.sh --install-only: exit {out.returncode}\n{(out.stdout + out.stderr)[-3000:]}"
    )
    return str(venv)

  return pathlib.Path(once_per_run("setup-venv", build))


def _setup_env(venv, tmp_path):
  """What a user's shell holds after the set-up: the venv first on PATH, none of the suite's variables (the
  fast-compile XLA flags aside, which change only compile speed)."""
  import xla_test_flags

  env = _without_the_suites_variables()
  env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
  env["VIRTUAL_ENV"] = str(venv)
  env["HOME"] = env["TMPDIR"] = str(tmp_path)
  env["XLA_FLAGS"] = xla_test_flags.FAST_COMPILE
  return env


@pytest.mark.parametrize(
  "name,line,language,code", _SHELL_BLOCKS, ids=[f"{name}:{line}" for name, line, _, _ in _SHELL_BLOCKS]
)
def test_command_block_runs_after_the_setup(name, line, language, code, setup_venv, xla_cache, tmp_path):
  env = _setup_env(setup_venv, tmp_path)
  for argv in _shell_commands(language, code):
    argv = [arg.replace("/tmp/", f"{tmp_path}/") for arg in argv]
    training = _is_training_run(argv)
    if training:
      argv += ["--steps", str(STEPS), "--set", f"train.compilation_cache_dir={xla_cache}"]
    program = shutil.which(argv[0], path=env["PATH"])
    assert program, f"{name}:{line}: {argv[0]} is not on the set-up's PATH"
    try:
      out = subprocess.run(
        [program, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
      )
    except subprocess.TimeoutExpired as e:
      pytest.fail(
        f"{name}:{line}: {shlex.join(argv)} did not finish in {COMMAND_TIMEOUT_S} s:\n{(e.stderr or '')[-3000:]}"
      )
    said = f"{name}:{line}: {shlex.join(argv)}: exit status {out.returncode}\n{out.stderr[-4000:]}"
    assert out.returncode == 0, said
    assert "Traceback" not in out.stderr, said
    if training:
      workdir = pathlib.Path(_workdir(argv))
      assert (workdir / "checkpoints" / str(STEPS)).is_dir(), f"{said}\nno checkpoint of step {STEPS} in {workdir}"


# --- the README's size and its table of guides ------------------------------------------------------------


def test_the_readme_is_short():
  lines = len(_TEXTS["README.md"].splitlines())
  assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES} (move text to docs/)"


def _section(text, heading):
  """The text under a Markdown heading (any level), up to the next heading of the same or a higher level."""
  match = re.search(rf"^(#+) {re.escape(heading)}[ \t]*$", text, re.MULTILINE)
  assert match, f"no heading '{heading}'"
  level = len(match.group(1))
  end = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(text, match.end())
  return text[match.end() : end.start() if end else len(text)]


def test_the_guides_table_names_every_guide_and_only_guides_that_exist():
  rows = [line for line in _section(_TEXTS["README.md"], "Guides").splitlines() if line.startswith("| [")]
  named = [re.match(r"\| \[[^\]]*\]\(([^)#]+)\)", row).group(1) for row in rows]
  assert named, "no table of guides under '## Guides' in README.md"
  missing = [path for path in named if not (ROOT / path).is_file()]
  assert not missing, f"README.md's table of guides names files that do not exist: {missing}"
  on_disk = {_name(path) for path in DOCS.glob("*.md")}
  assert not on_disk - set(named), (
    f"guides in docs/ that README.md's table does not name: {sorted(on_disk - set(named))}"
  )
  assert len(named) == len(set(named)), f"a guide named twice in README.md's table: {named}"


def test_the_readme_states_the_test_command_that_ci_runs():
  match = re.search(r"^Test command: `([^`]+)`", _TEXTS["README.md"], re.M)
  assert match, "README.md has no line 'Test command: `...`'"
  ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
  assert match.group(1) in ci_lines, f"README's test command {match.group(1)!r} is not a line of .ci/run"


# --- links ------------------------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text):
  """The text outside fenced blocks and inline code, where a link is a link."""
  text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
  return re.sub(r"`[^`\n]*`", "", text)


def _anchors(text):
  """GitHub's anchors for a Markdown file's headings."""
  anchors, seen = set(), {}
  for heading in re.findall(r"^#+ (.+?)[ \t]*#*$", _FENCE.sub("", text), re.MULTILINE):
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    anchors.add(slug if count == 0 else f"{slug}-{count}")
  return anchors


@pytest.mark.parametrize("name", list(_TEXTS))
def test_relative_links_point_at_files_that_exist(name):
  source = ROOT / name
  problems = []
  for target in _LINK.findall(_prose(_TEXTS[name])):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, …: not checked here
      continue
    path, _, anchor = target.partition("#")
    resolved = (source.parent / path).resolve() if path else source
    if not resolved.exists():
      problems.append(f"{name}: a link to {target}: {path} does not exist")
    elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved.read_text()):
      problems.append(f"{name}: a link to {target}: {_name(resolved)} has no heading for #{anchor}")
  assert not problems, "\n".join(problems)


# --- commands ---------------------------------------------------------------------------------------------

_COMMAND = re.compile(r"(distrib-train|python -m distrib_train(?:\.[A-Za-z_][\w.]*)?)(?=[\s`]|$)(?:[ \t]+([a-z]\w*))?")


def _commands(text):
  """The distinct ``(program, subcommand or None)`` pairs a text names: a
  lower-case word right after the program is taken as its subcommand (write
  the name in backquotes, `distrib-train`, to mention it in prose)."""
  found = {(match.group(1), match.group(2)) for match in _COMMAND.finditer(text)}
  return sorted(found, key=lambda c: (c[0], c[1] or ""))


def _argv(program):
  if program == "distrib-train":
    script = shutil.which("distrib-train") or shutil.which(
      "distrib-train", path=str(pathlib.Path(sys.executable).parent)
    )
    assert script, "the distrib-train console script is not installed (pip install -e .)"
    return [script]
  return [sys.executable, "-m", program.removeprefix("python -m ")]


_COMMANDS = _commands("\n".join(_TEXTS.values()))


def test_the_readme_names_the_commands_it_should():
  named = _commands(_TEXTS["README.md"])
  assert ("distrib-train", None) in named and ("distrib-train", "plan") in named, named


@pytest.mark.parametrize("program,sub", _COMMANDS, ids=[f"{p} {s or ''}".strip() for p, s in _COMMANDS])
def test_command_exists(program, sub, tmp_path):
  argv = _argv(program) + ([sub] if sub else []) + ["--help"]
  out = subprocess.run(argv, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, f"{' '.join(argv)}: exit status {out.returncode}\n{out.stderr[-2000:]}"
  if sub:  # the trainer's flag parser ignores a word it does not know: the help must be the subcommand's
    assert f" {sub}" in (out.stdout + out.stderr).splitlines()[0], (out.stdout + out.stderr)[:500]


# Every flag table, by the file and heading it sits under, and the command whose flags it lists.
_FLAG_TABLES = [
  ("README.md", "The command line", None),
  ("docs/planning.md", "Flags", "plan"),
  ("docs/generation.md", "Sampling", "generate"),
  ("docs/evaluation.md", "A released model, your tasks", "eval"),
  ("docs/launching.md", "Multi-host", None),
]


def _flag_rows(text):
  return [line for line in text.splitlines() if line.startswith("| `--")]


@pytest.mark.parametrize("name,heading,sub", _FLAG_TABLES)
def test_flag_tables_list_real_flags(name, heading, sub, tmp_path):
  rows = _flag_rows(_section(_TEXTS[name], heading))
  listed = {flag for row in rows for flag in re.findall(r"`(--[a-z_]+)", row.split("|")[1])}
  assert listed, f"no flag table under '{heading}' in {name}"
  argv = _argv("distrib-train") + ([sub] if sub else []) + ["--help"]
  out = subprocess.run(argv, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
  known = set(re.findall(r"--[a-z_]+", out.stdout + out.stderr))
  assert listed <= known, f"{name} lists flags that {' '.join(argv[:-1])} does not have: {sorted(listed - known)}"


def test_every_flag_table_is_checked():
  checked = {(name, row) for name, heading, _ in _FLAG_TABLES for row in _flag_rows(_section(_TEXTS[name], heading))}
  unchecked = [
    f"{name}: {row[:60]}" for name, text in _TEXTS.items() for row in _flag_rows(text) if (name, row) not in checked
  ]
  assert not unchecked, "flag tables not in _FLAG_TABLES (add them with their command):\n" + "\n".join(unchecked)


# --- config keys ------------------------------------------------------------------------------------------

_SECTIONS = ("model", "optimizer", "data", "train")
# `--set key=value` / `--set "key=value"`, anywhere; and a config key alone in inline code, or leading it:
# `train.steps`, `model.fp8=current`, `train.pipeline_repeats: 1` (not `data.DataLoader(...)`, `model.eval()`).
_SET_KEY = re.compile(r"--set[ \t]+[\"']?([a-z_][a-z0-9_.]*)=")
_CODE_KEY = re.compile(rf"`((?:{'|'.join(_SECTIONS)})\.[a-z_][a-z0-9_]*)(?:`|[=:\s][^`]*`)")


_PLACEHOLDER_KEYS = {"key"}  # `--set key=value` in the flag table


def _config_keys(text):
  return (set(_SET_KEY.findall(text)) | set(_CODE_KEY.findall(text))) - _PLACEHOLDER_KEYS


def _valid_keys():
  import dataclasses

  from distrib_train import recipes
  from distrib_train.config import run as config

  fields = set()
  for name in ("llama", "moe", "mlp"):
    recipe = recipes.get(name, preset="tiny")
    fields |= {f.name for f in dataclasses.fields(recipe.config)}
  return set(config.valid_keys(sorted(fields)))


@pytest.mark.parametrize("name", list(_TEXTS))
def test_config_keys_named_exist(name):
  named = _config_keys(_TEXTS[name])
  unknown = sorted(named - _valid_keys())
  assert not unknown, f"{name} names config keys the config does not accept: {unknown}"


def test_config_keys_are_found():
  assert {"train.steps", "model.fp8", "data.tokenizer", "train.hang_timeout_s"} <= set().union(
    *map(_config_keys, _TEXTS.values())
  )


def test_config_block_is_the_tiny_preset():
  from distrib_train import recipes
  from distrib_train.config import run as config

  [(_, _, code, _)] = [b for b in _blocks(_TEXTS["README.md"]) if b[1] == "yaml" and "the tiny preset" in b[2]]
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
