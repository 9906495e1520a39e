"""The package's layers: lower layers never import higher ones (ARCHITECTURE.md).

Every ``distrib_train`` import in every module — at the top or inside a
function — is read from the source (nothing is imported) and checked against
the layer table below, which is the one ARCHITECTURE.md draws.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "distrib_train"

# Low to high; a module may import its own layer and the layers below it.
LAYERS = (
    ("common",),
    ("models",),
    ("train_state", "train_step", "step_core", "step_inputs", "microbatches"),
    ("sharding",),
    ("kernels", "parallel"),
    ("recipes",),
    ("objectives",),
    ("generation",),
    ("checkpoint", "data", "cluster"),
    ("optim",),
    ("config",),
    ("weights",),
    ("inference",),
    ("evaluation",),
    ("posttrain",),
    ("train",),
    ("podplan",),
    ("cli", "__main__", "__init__"),
)
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
# Upward imports kept on purpose, each with its reason (none today).
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}
# No module past this many lines (STYLE.md: one concept per module): a signal of two concepts in one module,
# met by splitting along a seam, never by rewrapping or joining statements.
MAX_MODULE_LINES = 500


def _unit(module: str) -> str:
  """``distrib_train.sharding.mesh`` → ``sharding``; ``distrib_train`` → ``__init__``."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


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
  units = {_unit(name) for name, _ in _modules()}
  assert units <= set(RANK), f"not in the layer table (add it to LAYERS and ARCHITECTURE.md): {units - set(RANK)}"


def test_no_module_imports_a_higher_layer():
  upward = []
  for name, path in _modules():
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
  module.write_text("def f():\n  from distrib_train.train import trainer\n")
  (line, imported), = list(_imports(module, "distrib_train.common.bad"))
  assert RANK[_unit(imported)] > RANK[_unit("distrib_train.common.bad")] and line == 2


def test_no_module_reaches_into_the_package_root_for_a_name():
  # ``from distrib_train import X`` inside the package would import the whole
  # public API (every layer) first; only subpackages may be named that way.
  subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
  offenders = []
  for name, path in _modules():
    if name == "distrib_train":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module == "distrib_train" and not node.level:
        offenders += [f"{name}: {a.name}" for a in node.names if a.name not in subpackages | {"cli"}]
  assert not offenders, offenders


# The only modules at the top of the package; everything else lives in a subpackage.
TOP_LEVEL_MODULES = {"__init__", "__main__", "cli", "train_state", "train_step", "step_core", "step_inputs",
                     "microbatches"}


def _import_graph(top_level_only: bool = False) -> dict[str, set[str]]:
  """module → the package modules it imports (a ``from pkg import name`` edge goes to ``pkg.name`` when that
  is a module, else to ``pkg``)."""
  modules = dict(_modules())
  graph = {}
  for name, path in modules.items():
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    edges = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in nodes:
      if isinstance(node, ast.Import):
        edges |= {a.name for a in node.names if a.name in modules}
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = package.split(".")[: len(package.split(".")) - node.level + 1]
          base = ".".join(parts + ([base] if base else []))
        for alias in node.names:
          target = f"{base}.{alias.name}"
          edges.add(target if target in modules else base)
    graph[name] = {e for e in edges if e in modules and e != name}
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, on_stack, stack, found = {}, {}, set(), [], []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for nxt in sorted(graph[node]):
      if nxt not in index:
        visit(nxt)
        low[node] = min(low[node], low[nxt])
      elif nxt in on_stack:
        low[node] = min(low[node], index[nxt])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


def test_no_import_circles_between_modules():
  # Every import counts, at the top or inside a function: a deferred import that only dodges a circle is
  # still a circle in the design. A subpackage's __init__ re-exporting its own modules is not counted.
  graph = _import_graph()
  for name in graph:
    if dict(_modules())[name].name == "__init__.py":
      graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
  assert not _cycles(graph), f"import circles: {_cycles(graph)}"


def test_the_circle_finder_sees_a_circle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_is_longer_than_the_limit():
  long = {str(path.relative_to(PACKAGE.parent)): n for _, path in _modules()
          if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
  assert not long, f"modules past {MAX_MODULE_LINES} lines (split them along their seams): {long}"


def test_no_shim_modules_and_nothing_loose_at_the_top_of_the_package():
  # A module that only re-points an old name (sys.modules[__name__] = ..., "moved to ..." warnings) hides the
  # layout; the version has never been released, so there are no old names to keep.
  loose = {p.stem for p in PACKAGE.glob("*.py")} - TOP_LEVEL_MODULES
  assert not loose, f"modules at the top of distrib_train/ (put them in the subpackage that owns them): {loose}"
  shims = []
  for _, path in _modules():
    source = path.read_text()
    docstring = ast.get_docstring(ast.parse(source)) or ""
    if "sys.modules[__name__]" in source or docstring.lower().startswith("moved to"):
      shims.append(str(path.relative_to(PACKAGE.parent)))
  assert not shims, f"alias modules: {shims}"
