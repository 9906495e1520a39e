"""The package's layers: lower layers never import higher ones (ARCHITECTURE.md).

Every ``distrib_train`` import in every module — at the top or inside a
function — is read from the source (nothing is imported) and checked against
the layer table below, which is the one ARCHITECTURE.md draws.
"""

import ast
import pathlib
import warnings

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "distrib_train"

# Low to high; a module may import its own layer and the layers below it.
LAYERS = (
    ("common",),
    ("models",),
    ("train_state", "train_step", "step_inputs", "microbatches"),
    ("sharding",),
    ("parallel", "recipes"),
    ("checkpoint", "data", "cluster"),
    ("training",),
    ("podplan",),
    ("cli", "__main__", "__init__"),
)
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
# Upward imports kept on purpose, each with its reason.
ALLOWED_UPWARD = {
    ("distrib_train.models", "distrib_train.recipes"): "models.get / models.ModelRecipe: aliases for one release",
}


def _unit(module: str) -> str:
  """``distrib_train.sharding.mesh`` → ``sharding``; ``distrib_train`` → ``__init__``."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def _is_moved_alias(path: pathlib.Path) -> bool:
  """The one-release aliases at the old module paths (they import upwards on purpose)."""
  docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
  return docstring.startswith("Moved to ")


def _modules():
  for path in sorted(PACKAGE.rglob("*.py")):
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    name = ".".join(relative.parts).removesuffix(".__init__")
    yield name, path


def _imports(path: pathlib.Path, module: str):
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
      for alias in node.names:
        # ``from distrib_train import data`` imports the subpackage ``data``.
        yield node.lineno, f"{base}.{alias.name}" if base == "distrib_train" else base


def test_every_top_level_module_or_subpackage_has_a_layer():
  units = {_unit(name) for name, path in _modules() if not _is_moved_alias(path)}
  assert units <= set(RANK), f"not in the layer table (add it to LAYERS and ARCHITECTURE.md): {units - set(RANK)}"


def test_no_module_imports_a_higher_layer():
  upward = []
  for name, path in _modules():
    if _is_moved_alias(path):
      continue
    for line, imported in _imports(path, name):
      if not imported.startswith("distrib_train"):
        continue
      source, target = _unit(name), _unit(imported)
      if target != "__init__" and RANK[target] > RANK[source] and (name, imported) not in ALLOWED_UPWARD:
        upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({source}) imports {imported} ({target})")
  assert not upward, "lower layers import higher ones:\n" + "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path):
  # The checker itself: a common module importing the trainer is reported.
  module = tmp_path / "bad.py"
  module.write_text("def f():\n  from distrib_train.training import trainer\n")
  (line, imported), = list(_imports(module, "distrib_train.common.bad"))
  assert RANK[_unit(imported)] > RANK[_unit("distrib_train.common.bad")] and line == 2


def test_no_module_reaches_into_the_package_root_for_a_name():
  # ``from distrib_train import X`` inside the package would import the whole
  # public API (every layer) first; only subpackages may be named that way.
  subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
  offenders = []
  for name, path in _modules():
    if _is_moved_alias(path) or name == "distrib_train":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module == "distrib_train" and not node.level:
        offenders += [f"{name}: {a.name}" for a in node.names if a.name not in subpackages | {"cli"}]
  assert not offenders, offenders


@pytest.mark.parametrize("old, new", [
    ("distrib_train.axis_rules", "distrib_train.sharding.axis_rules"),
    ("distrib_train.trainer", "distrib_train.training.trainer"),
    ("distrib_train.podplan_report", "distrib_train.podplan.report"),
    ("distrib_train.models.llama", "distrib_train.recipes.llama"),
])
def test_old_module_paths_still_import_with_a_deprecation_warning(old, new):
  import importlib
  import sys

  sys.modules.pop(old, None)
  with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
    module = importlib.import_module(old)
  assert module is importlib.import_module(new)


def test_models_get_still_answers_with_a_deprecation_warning():
  import distrib_train as dt

  with pytest.warns(DeprecationWarning, match="distrib_train.recipes.get"):
    get = dt.models.get
  assert get is dt.recipes.get
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert dt.recipes.get("llama").name == "llama-tiny"
