"""The lock of tested versions: resolve it, install from it, check an environment against it.

`requirements/sets.toml` names the install kinds the project documents (the test set of each CI job, `[tpu]`,
`[cuda12]`, the plain install); `resolve` locks each for every interpreter into `requirements/py<X.Y>/<set>.txt`
with `uv pip compile`, holding one package (jax) back while any set cannot follow its newest release.
`install` builds a virtualenv from one lock (`.ci/run`, `launch/local.sh`), `check` compares an environment
with the lock it was built from (the suite's `tests/test_lock.py`). `bash .ci/upgrade` is resolve, the suite, and
the new lock written only if the suite is green.

This file is a tool of the repository, not part of the package: it needs the standard library only, and runs
under the interpreter it installs for. Every install and resolve reads the same sources pip does (its
configuration files and `PIP_*` variables: index, extra indexes, find-links, constraints), since uv reads none
of pip's configuration.

Not a place for ranges: those stay in `setup.py`, for people who install the package into their own
environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
MARKER = "distrib_train-lock.json"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


class LockError(Exception):
  """A lock that cannot be used, said in one line."""


@dataclasses.dataclass(frozen=True)
class Set:
  """One install kind: the project with some extras, plus requirements, for one interpreter."""

  name: str
  project: bool
  project_extras: tuple[str, ...]
  requirements: tuple[str, ...]
  constrained_by: tuple[str, ...]
  no_deps: bool
  pin_to_hold: bool


@dataclasses.dataclass(frozen=True)
class Spec:
  """`sets.toml`, read."""

  pythons: tuple[str, ...]
  platform: str
  hold: str
  tools: tuple[str, ...]
  raw_sets: dict

  def sets(self, python: str) -> list[Set]:
    """The sets in resolve order, with the requirements `python` adds."""
    out = []
    for name, body in self.raw_sets.items():
      extra = body.get("python", {}).get(python, {})
      out.append(
        Set(
          name=name,
          project=body.get("project", True),
          project_extras=tuple(body.get("project_extras", ())),
          requirements=tuple(body.get("requirements", ())) + tuple(extra.get("requirements", ())),
          constrained_by=tuple(body.get("constrained_by", ())),
          no_deps=body.get("no_deps", False),
          pin_to_hold=body.get("pin_to_hold", False),
        )
      )
    return out


def read_spec(path: pathlib.Path) -> Spec:
  with open(path, "rb") as f:
    raw = tomllib.load(f)
  return Spec(
    pythons=tuple(raw["pythons"]),
    platform=raw["platform"],
    hold=raw["hold"],
    tools=tuple(raw.get("tools", ())),
    raw_sets=raw["sets"],
  )


def pins(lock: pathlib.Path) -> dict[str, str]:
  """`{normalized name: version}` of a lock file's `name==version` lines."""
  out = {}
  for line in lock.read_text(encoding="utf-8").splitlines():
    match = _PIN.match(line.strip())
    if match:
      out[normalize(match.group(1))] = match.group(2)
  return out


def normalize(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


# --- sources: what pip reads, passed to uv -------------------------------------------------------------------


def pip_sources(python: str = sys.executable) -> list[str]:
  """uv's flags for the sources pip's configuration names (files and `PIP_*` variables)."""
  out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
  values: dict[str, list[str]] = {}
  for line in out.stdout.splitlines():
    key, _, value = line.partition("=")
    option = key.rsplit(".", 1)[-1]
    value = value.strip().strip("'\"")
    if option in ("index-url", "extra-index-url", "find-links", "constraint", "no-index") and value:
      items = value.split() if option != "no-index" else [value]
      for item in items:
        if item not in values.setdefault(option, []):
          values[option].append(item)
  flags = []
  for option, items in values.items():
    if option == "no-index":
      if items[-1].lower() in ("1", "true", "yes", "on"):
        flags.append("--no-index")
      continue
    if option == "index-url":
      items = items[-1:]  # one index; the variable (read last) wins over the files, as in pip
    if option == "constraint":
      items = [i for i in items if os.path.isfile(i)]
    for item in items:
      flags += [f"--{option}", item]
  return flags


def uv_flags(sources: list[str]) -> list[str]:
  # pip takes the best version across every index; uv, unless told, stops at the first index that has a name.
  return ["--no-config", "--index-strategy", "unsafe-best-match", *sources]


# --- resolve ----------------------------------------------------------------------------------------------------


def _compile(
  uv: str,
  spec: Spec,
  python: str,
  chosen: Set,
  constraints: list[str],
  out: pathlib.Path,
  sources: list[str],
  project: pathlib.Path,
  work: pathlib.Path,
) -> tuple[bool, str]:
  """`uv pip compile` of one set into `out`; (ok, uv's reason when not)."""
  inputs = work / f"{chosen.name}.in"
  lines = list(chosen.requirements)
  if not chosen.no_deps:
    lines += list(spec.tools)
  inputs.write_text("\n".join(lines) + "\n", encoding="utf-8")
  constraint_file = work / f"{chosen.name}.constraints.txt"
  constraint_file.write_text("\n".join(constraints) + "\n", encoding="utf-8")
  # --python: builds run on this interpreter; uv's own search for one of `python` is slow behind pyenv's shims.
  args = [
    uv,
    "pip",
    "compile",
    "--quiet",
    "--upgrade",
    "--no-header",
    "--no-annotate",
    "--python",
    sys.executable,
    "--python-version",
    python,
    "--python-platform",
    spec.platform,
    *uv_flags(sources),
    "-c",
    str(constraint_file),
    "-o",
    str(out),
  ]
  if chosen.no_deps:
    args.append("--no-deps")
  if chosen.project:
    args.append(str(project / "setup.py"))
    for extra in chosen.project_extras:
      args += ["--extra", extra]
  args.append(str(inputs))
  done = subprocess.run(args, capture_output=True, text=True, check=False, cwd=work)
  return done.returncode == 0, reason(done.stderr)


def reason(stderr: str) -> str:
  """What a failed uv or pip said, in one line: uv's first cause, pip's missing distribution, else its last line."""
  text = " ".join(stderr.split())
  uv_cause = re.search(r"cause: (.*?)(?:, we can conclude|$)", text)
  if uv_cause:
    return uv_cause.group(1)[:400]
  pip_missing = re.search(r"No matching distribution found for (\S+)", text)
  if pip_missing:
    return f"no distribution of {pip_missing.group(1)} is served"
  lines = [line.strip() for line in stderr.splitlines() if line.strip()]
  return lines[-1][:400] if lines else "no message"


def _header(name: str, python: str, spec: Spec) -> str:
  return (
    f"# The {name} set for Python {python} on {spec.platform}, resolved by requirements/lock.py with uv.\n"
    "# Generated: never edit by hand; `bash .ci/upgrade` moves it (requirements/README.md).\n"
  )


def resolve_python(
  uv: str, spec: Spec, python: str, out_dir: pathlib.Path, sources: list[str], project: pathlib.Path, log=print
) -> str | None:
  """Locks every set of `python` into `out_dir`; returns the hold-back line, or None when nothing was held."""
  out_dir.mkdir(parents=True, exist_ok=True)
  sets = spec.sets(python)
  held: list[str] = []
  newest: str | None = None
  ceiling: list[str] = []
  with tempfile.TemporaryDirectory() as tmp:
    work = pathlib.Path(tmp)
    for _ in range(8):
      # The newest release of the held package that the least constrained set admits under the ceiling.
      probe = work / "probe.txt"
      ok, why = _compile(uv, spec, python, _probe(spec, sets), ceiling, probe, sources, project, work)
      if not ok:
        raise LockError(f"Python {python}: {spec.hold} does not resolve: {why}")
      version = pins(probe)[normalize(spec.hold)]
      newest = newest or version
      failure = _resolve_all(uv, spec, python, sets, version, out_dir, sources, project, work)
      if failure is None:
        if held:
          return f"{spec.hold} held at {version} on Python {python} ({newest} is served): " + "; ".join(held)
        return None
      held.append(f"{spec.hold} {version}: {failure}")
      log(f"lock: Python {python}: {spec.hold} {version} does not lock every set ({failure}); trying older")
      ceiling = [f"{spec.hold}<{version}"]
  raise LockError(f"Python {python}: no {spec.hold} release locks every set: " + "; ".join(held))


def _probe(spec: Spec, sets: list[Set]) -> Set:
  """The held package alone (with the project's own range, where a set has the project): its newest release."""
  return Set(
    name="probe",
    project=any(s.project for s in sets),
    project_extras=(),
    requirements=(spec.hold,),
    constrained_by=(),
    no_deps=False,
    pin_to_hold=False,
  )


def _resolve_all(uv, spec, python, sets, version, out_dir, sources, project, work) -> str | None:
  """Every set with the held package at `version`; the first failure as 'set: reason', else None."""
  for chosen in sets:
    constraints = [f"{spec.hold}=={version}"]
    for earlier in chosen.constrained_by:
      constraints += [f"{name}=={v}" for name, v in pins(out_dir / f"{earlier}.txt").items()]
    if chosen.pin_to_hold:
      chosen = dataclasses.replace(chosen, requirements=tuple(f"{r}=={version}" for r in chosen.requirements))
    target = out_dir / f"{chosen.name}.txt"
    ok, why = _compile(uv, spec, python, chosen, constraints, target, sources, project, work)
    if not ok:
      return f"the {chosen.name} set: {why}"
    target.write_text(_header(chosen.name, python, spec) + target.read_text(encoding="utf-8"), encoding="utf-8")
  return None


def compare(old_dir: pathlib.Path, new_dir: pathlib.Path) -> list[str]:
  """What moved between two lock directories, a line per package and set."""
  lines = []
  for new in sorted(new_dir.glob("py*/*.txt")):
    old = old_dir / new.parent.name / new.name
    before, after = (pins(old) if old.exists() else {}), pins(new)
    where = f"{new.parent.name}/{new.stem}"
    for name in sorted(set(before) | set(after)):
      if before.get(name) != after.get(name):
        lines.append(f"{where}: {name} {before.get(name, '(none)')} -> {after.get(name, '(none)')}")
  return lines


# --- install and check -----------------------------------------------------------------------------------------


def lock_for(set_name: str, python_version: str, lock_dir: pathlib.Path) -> pathlib.Path:
  """The lock of `set_name` for `python_version`; a one-line LockError naming what is missing."""
  lock = lock_dir / f"py{python_version}" / f"{set_name}.txt"
  if lock.is_file():
    return lock
  names = sorted({p.stem for p in lock_dir.glob("py*/*.txt")})
  if set_name not in names:
    raise LockError(f"no set named '{set_name}' in {lock_dir} (sets: {', '.join(names) or 'none'})")
  have = sorted(p.name[2:] for p in lock_dir.glob("py*") if (p / f"{set_name}.txt").is_file())
  raise LockError(
    f"no lock for Python {python_version} in {lock_dir} (locked: {', '.join(have)}): use one of "
    f"those interpreters, or add {python_version} to requirements/sets.toml and run bash .ci/upgrade"
  )


def _run_install(args: list[str], lock: pathlib.Path) -> None:
  done = subprocess.run(args, capture_output=True, text=True, check=False)
  if done.returncode:
    raise LockError(
      f"{lock.relative_to(ROOT) if lock.is_relative_to(ROOT) else lock} cannot be installed: "
      f"{reason(done.stderr)}; bash .ci/upgrade moves the lock to what the registry serves"
    )


def install(
  set_name: str,
  venv: pathlib.Path,
  lock_dir: pathlib.Path = HERE,
  editable: str | None = None,
  target: pathlib.Path | None = None,
) -> pathlib.Path:
  """Makes (or reuses) `venv` and installs `set_name`'s lock for the venv's interpreter into it, exactly.

  A new venv is made with the interpreter running this file. With `target`, the lock goes into that folder
  instead (`--target`, no dependencies), beside the venv, whose uv installs it.
  """
  python = venv / "bin" / "python"
  # The lock is chosen, or refused, before anything is written.
  interpreter = python if python.exists() else pathlib.Path(sys.executable)
  version = subprocess.run(
    [str(interpreter), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  lock = lock_for(set_name, version, lock_dir)
  if not python.exists():
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
  sources = pip_sources(str(python))
  pinned = pins(lock)
  uv = venv / "bin" / "uv"
  if target is not None:
    if _version_of(uv) is None:
      raise LockError(f"{venv} has no uv to install {lock} with: install a set into it first")
  elif "uv" not in pinned:
    raise LockError(f"{lock} pins no uv, which installs it")
  elif _version_of(uv) != pinned["uv"]:
    tools = [f"{name}=={pinned[name]}" for name in ("pip", "uv") if name in pinned]
    _run_install([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *tools], lock)
  # Bytecode compiled at install, as pip does: this machine sets PYTHONDONTWRITEBYTECODE, so without it every
  # process of the suite would compile jax, transformers and the rest from source on each import.
  flags = ["--python", str(python), "--compile-bytecode", *uv_flags(sources)]
  if target is not None:
    _run_install(
      [str(uv), "pip", "install", "--quiet", "--no-deps", "--target", str(target), *flags, "-r", str(lock)], lock
    )
    return lock
  _run_install([str(uv), "pip", "sync", "--quiet", *flags, str(lock)], lock)
  if editable is not None and "[" in str(editable):
    # Extras on top of the set (`.[eval]`): their packages at the versions of this interpreter's test set, which
    # holds every extra the suite uses.
    _run_install(
      [str(uv), "pip", "install", "--quiet", *flags, "-c", str(lock.parent / "test.txt"), "-e", str(editable)], lock
    )
  elif editable is not None:
    _run_install([str(uv), "pip", "install", "--quiet", "--no-deps", *flags, "-e", str(editable)], lock)
  (venv / MARKER).write_text(
    json.dumps({"lock": str(lock), "set": set_name, "python": version}) + "\n", encoding="utf-8"
  )
  return lock


def _version_of(uv: pathlib.Path) -> str | None:
  """The version a uv executable says it is (`uv 0.13.10 (…)`), or None."""
  if not uv.exists():
    return None
  done = subprocess.run([str(uv), "--version"], capture_output=True, text=True, check=False)
  words = done.stdout.split()
  return words[1] if done.returncode == 0 and len(words) > 1 else None


def installed() -> dict[str, str]:
  """`{normalized name: version}` of the distributions this interpreter sees."""
  from importlib import metadata

  return {normalize(d.metadata["Name"]): d.version for d in metadata.distributions()}


def mismatches(lock: pathlib.Path, have: dict[str, str], ignore: tuple[str, ...] = ("distrib-train",)) -> list[str]:
  """Lines naming each pinned package whose installed version differs, and each unpinned one installed."""
  want = pins(lock)
  out = [
    f"{name}: lock {version}, installed {have.get(name, '(none)')}"
    for name, version in sorted(want.items())
    if have.get(name) != version
  ]
  out += [f"{name}: installed {have[name]}, not in the lock" for name in sorted(set(have) - set(want) - set(ignore))]
  return out


# --- command line ----------------------------------------------------------------------------------------------


def _uv_of_tools(lock_dir: pathlib.Path, tools_venv: pathlib.Path) -> str:
  """uv from a small venv of the pinned pip and uv (the newest lock of this interpreter's test set)."""
  version = f"{sys.version_info[0]}.{sys.version_info[1]}"
  python = tools_venv / "bin" / "python"
  if not python.exists():
    subprocess.run([sys.executable, "-m", "venv", str(tools_venv)], check=True)
  lock = lock_dir / f"py{version}" / "test.txt"
  pinned = pins(lock) if lock.is_file() else {}
  spec = f"uv=={pinned['uv']}" if "uv" in pinned else "uv"
  subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", spec], check=True)
  return str(tools_venv / "bin" / "uv")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="requirements/lock.py", description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  r = sub.add_parser("resolve", help="lock every set for every interpreter into --out; print what moved")
  r.add_argument("--out", type=pathlib.Path, required=True)
  r.add_argument("--spec", type=pathlib.Path, default=HERE / "sets.toml")
  r.add_argument("--project", type=pathlib.Path, default=ROOT)
  r.add_argument("--against", type=pathlib.Path, default=HERE, help="the locks to compare with")
  r.add_argument("--uv", help="the uv to run (default: a pinned one in .ci-tools/)")
  r.add_argument(
    "--sources", help="uv's source flags instead of pip's configuration, e.g. '--no-index --find-links DIR'"
  )
  i = sub.add_parser("install", help="make a virtualenv from one lock of this interpreter")
  i.add_argument("set")
  i.add_argument("--venv", type=pathlib.Path, required=True)
  i.add_argument("--lock-dir", type=pathlib.Path, default=pathlib.Path(os.environ.get("DT_LOCK_DIR", HERE)))
  i.add_argument(
    "--editable",
    help="the project to install, without dependencies; with extras ('.[eval]'), theirs at the test set's versions",
  )
  i.add_argument("--target", type=pathlib.Path, help="install into this folder beside --venv, no dependencies")
  c = sub.add_parser("check", help="this interpreter's distributions equal the lock its venv was built from")
  c.add_argument("--venv", type=pathlib.Path, default=pathlib.Path(sys.prefix))
  args = parser.parse_args(argv)
  try:
    if args.command == "install":
      lock = install(args.set, args.venv.absolute(), args.lock_dir.absolute(), args.editable, args.target)
      print(f"lock: {args.venv} holds {lock}" + (f" (in {args.target})" if args.target else ""))
    elif args.command == "check":
      marker = json.loads((args.venv / MARKER).read_text(encoding="utf-8"))
      bad = mismatches(pathlib.Path(marker["lock"]), installed())
      for line in bad:
        print(line)
      return 1 if bad else 0
    else:
      spec = read_spec(args.spec)
      args.out, args.against = args.out.absolute(), args.against.absolute()  # uv runs in a temporary folder
      uv = args.uv or _uv_of_tools(args.against, ROOT / ".ci-tools")
      sources = shlex.split(args.sources) if args.sources is not None else pip_sources()
      held = []
      for python in spec.pythons:
        line = resolve_python(uv, spec, python, args.out / f"py{python}", sources, args.project.absolute())
        if line:
          held.append(line)
      moved = compare(args.against, args.out)
      report = [
        "held back:",
        *(f"  {line}" for line in held or ["nothing"]),
        "moved:",
        *(f"  {line}" for line in moved or ["nothing"]),
      ]
      (args.out / "REPORT").write_text("\n".join(report) + "\n", encoding="utf-8")
      (args.out / "MOVED").write_text("".join(f"{line}\n" for line in moved), encoding="utf-8")
      for line in held:
        print(f"held back: {line}")
      print(f"moved: {len(moved)} pins" if moved else "moved: nothing")
      for line in moved:
        print(f"  {line}")
  except LockError as error:
    print(f"lock: {error}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
