"""The package's layers: lower layers never import higher ones (ARCHITECTURE.md).

Every ``distrib_train`` import in every module — at the top or inside a
function — is read from the source (nothing is imported) and checked against
the layer table below, which is the one ARCHITECTURE.md draws.
"""

import ast
import pathlib


PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "distrib_train"

# Low to high: a unit (a subpackage or a module at the top of the package) imports only the units before it.
LAYERS = (
  ("common",),
  ("models",),
  ("train_state",),
  ("microbatches",),
  ("step_inputs",),
  ("step_core",),
  ("train_step",),
  ("sharding",),
  ("kernels",),
  ("parallel",),
  ("recipes",),
  ("objectives",),
  ("generation",),
  ("cluster",),
  ("data",),
  ("checkpoint",),
  ("optim",),
  ("config",),
  ("weights",),
  ("inference",),
  ("evaluation",),
  ("posttrain",),
  ("podplan",),
  ("train",),
  ("cli", "__main__", "__init__"),
)
# Inside each package, low to high: a module imports only the modules and subpackages of its package listed
# before it (``__init__`` is the package's own module). A new module gets its place here.
PACKAGE_ORDER = {
  "checkpoint": (
    "retention",
    "tree",
    "hf_common",
    "checks",
    "hf",
    "data_state",
    "faults",
    "local",
    "peft_adapter",
    "manager",
    "__init__",
    "tiers",
  ),
  "cluster": (
    "hardware",
    "device_memory",
    "__init__",
    "preemption",
    "xla_flags_check",
    "gpu_environment",
    "distributed",
  ),
  "common": ("text", "__init__", "exit_hooks", "versions", "extras", "auto_mesh", "naming", "yaml_loader"),
  "config": ("__init__", "values", "checks", "run", "plan_checks", "job"),
  "data": (
    "batch_source",
    "index_cache",
    "block_order",
    "tokenizer",
    "frames",
    "lanes",
    "sequences",
    "__init__",
    "arrow_text",
    "jsonl",
    "config",
    "chat",
    "endless",
    "compressed",
    "finite",
    "preference",
    "text_files",
    "convert_workers",
    "record_shards",
    "__main__",
    "sources",
    "splits",
    "lane_process",
    "pipeline",
  ),
  "evaluation": ("harness", "__init__", "demo_tasks", "tasks", "hook"),
  "generation": ("cache", "sampling", "__init__", "engine", "scoring"),
  "inference": ("__init__", "text", "generate"),
  "kernels": ("fp8", "__init__", "cross_entropy", "gmm_triton", "attention", "grouped"),
  "kernels.attention": ("xla", "cudnn", "work", "__init__", "ring", "splash", "dispatch"),
  "models": ("penzai_model", "pytree", "linen_model", "nnx_model", "__init__"),
  "objectives": ("record", "dpo", "grpo", "__init__"),
  "optim": ("__init__", "muon", "chain"),
  "parallel": ("pipeline", "experts", "__init__"),
  "podplan": (
    "layout_choice",
    "memory",
    "hlo",
    "__init__",
    "gpu",
    "layout",
    "timing",
    "cpu_attention",
    "tpu",
    "replica_groups",
    "collectives",
    "report",
    "estimate",
    "timed",
    "search",
    "auto",
    "cli",
  ),
  "posttrain": ("reference_pass", "__init__", "rewards", "records", "rollouts"),
  "recipes": (
    "mlp",
    "routing",
    "lora",
    "family",
    "rope",
    "parts",
    "attention",
    "blocks",
    "mtp",
    "decoder",
    "llama",
    "moe",
    "hf_shape",
    "__init__",
    "hf_tables",
    "hf_recipe",
  ),
  "sharding": ("axis_rules", "topology", "context", "plan", "mesh", "planner", "__init__"),
  "train": (
    "checks",
    "nonfinite",
    "compilation",
    "wsd",
    "__init__",
    "workdir_lock",
    "metrics",
    "window",
    "hooks",
    "goodput",
    "loop",
    "watchdog",
    "eval_pass",
    "trainer",
  ),
  "weights": ("__init__", "init_from", "load", "export"),
}
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
# Upward imports kept on purpose, each with its reason (none today).
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}
# No module past this many lines (STYLE.md: one concept per module): a signal of two concepts in one module,
# met by splitting along a seam, never by rewrapping or joining statements (the formatter sets the layout:
# ruff.toml). Set where the formatter's output of the code of 2026-12-07 landed (recipes/hf_shape.py: 526).
MAX_MODULE_LINES = 530


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


def _children(package: str) -> set[str]:
  """The modules and subpackages directly in ``distrib_train.<package>``, ``__init__`` among them."""
  folder = PACKAGE.joinpath(*package.split("."))
  return {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}


def _sibling_edge(source: str, source_is_init: bool, target: str, target_is_init: bool) -> tuple[str, str, str] | None:
  """For an import of ``target`` by ``source`` (each flagged when it is a package's ``__init__``) inside one
  package: (that package, the importing child, the imported child); None across top-level units (the layer
  table's) or within one module."""
  src = source.split(".") + (["__init__"] if source_is_init else [])
  dst = target.split(".") + (["__init__"] if target_is_init else [])
  common = 0
  while common < min(len(src), len(dst)) and src[common] == dst[common]:
    common += 1
  if common < 2 or common >= min(len(src), len(dst)):
    return None
  return ".".join(src[1:common]), src[common], dst[common]


def test_every_package_orders_its_modules():
  packages = {name.removeprefix("distrib_train.") for name, path in _modules() if path.name == "__init__.py"}
  packages.discard("distrib_train")
  assert packages == set(PACKAGE_ORDER), f"packages without an order: {packages - set(PACKAGE_ORDER)}"
  for package, order in PACKAGE_ORDER.items():
    assert len(set(order)) == len(order) and set(order) == _children(package), (
      f"{package}: PACKAGE_ORDER lists {sorted(set(order) ^ _children(package))} wrongly"
    )


def test_no_module_imports_a_later_sibling():
  # Every import, at the top or inside a function, between two modules of one package: the imported one comes
  # first in the package's order. A package's __init__ re-exporting its own modules is above them.
  later = []
  modules = dict(_modules())
  graph = _import_graph()
  for name, targets in graph.items():
    for target in targets:
      edge = _sibling_edge(name, modules[name].name == "__init__.py", target, modules[target].name == "__init__.py")
      if edge is None:
        continue
      package, child, imported = edge
      order = PACKAGE_ORDER[package]
      if order.index(imported) > order.index(child):
        later.append(f"{package}: {child} imports {imported}, listed after it")
  assert not later, "modules import later siblings (move one, or split the concept they share):\n" + "\n".join(
    sorted(later)
  )


def test_the_sibling_checker_sees_a_later_sibling():
  assert _sibling_edge("distrib_train.train.loop", False, "distrib_train.train.trainer", False) == (
    "train",
    "loop",
    "trainer",
  )
  assert _sibling_edge("distrib_train.kernels.attention.dispatch", False, "distrib_train.kernels.fp8", False) == (
    "kernels",
    "attention",
    "fp8",
  )
  assert _sibling_edge("distrib_train.objectives.dpo", False, "distrib_train.objectives", True) == (
    "objectives",
    "dpo",
    "__init__",
  )
  assert _sibling_edge("distrib_train.train.loop", False, "distrib_train.config.run", False) is None
  order = PACKAGE_ORDER["train"]
  assert order.index("trainer") > order.index("loop")


# The names a batch source, the run it may ask things of, and the trainer go by where they are used.
_CONTRACT_NAMES = ("source", "loader", "run", "trainer")


def _duck_typed(tree: ast.AST) -> list[tuple[int, str]]:
  """``getattr`` / ``hasattr`` on a batch source or a run: (line, the call)."""
  found = []
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Call)
      and isinstance(node.func, ast.Name)
      and node.func.id in ("getattr", "hasattr")
      and node.args
      and ast.unparse(node.args[0]).split(".")[-1] in _CONTRACT_NAMES
    ):
      found.append((node.lineno, ast.unparse(node)))
  return found


def test_no_getattr_on_a_batch_source_or_run():
  # The loop, its batch sources and the run meet through data/batch_source.py's Protocols (BatchSource,
  # RunContext): a getattr there is a contract the layer test and a reader cannot see.
  offenders = [
    f"{path.relative_to(PACKAGE.parent)}:{line}: {call}"
    for _, path in _modules()
    for line, call in _duck_typed(ast.parse(path.read_text()))
  ]
  assert not offenders, "duck-typed seams (add the method to the Protocol instead):\n" + "\n".join(offenders)


def test_the_duck_typing_finder_sees_a_getattr():
  tree = ast.parse("def f(self):\n  return getattr(self.source, 'take_figures', dict)(), getattr(x, 'y', 0)\n")
  assert [line for line, _ in _duck_typed(tree)] == [2]


def _private_reaches(tree: ast.AST, module: str, modules: set[str]) -> list[tuple[int, str]]:
  """Another distrib_train module's private name used here (``from m import _x``, ``m._x``): (line, the name)."""
  found, aliases = [], {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distrib_train"):
      for alias in node.names:
        if f"{node.module}.{alias.name}" in modules:
          aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif alias.name.startswith("_") and not alias.name.startswith("__"):
          found.append((node.lineno, f"{node.module}.{alias.name}"))
    elif isinstance(node, ast.Import):
      aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("distrib_train")})
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and aliases.get(node.value.id, module) != module
      and node.attr.startswith("_")
      and not node.attr.startswith("__")
    ):
      found.append((node.lineno, f"{aliases[node.value.id]}.{node.attr}"))
  return found


def test_no_module_uses_another_modules_private_names():
  # A name one module shares with another is public: it drops its underscore (and gets a docstring).
  modules = {name for name, _ in _modules()}
  offenders = [
    f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
    for module, path in _modules()
    for line, name in _private_reaches(ast.parse(path.read_text()), module, modules)
  ]
  assert not offenders, "private names used across modules:\n" + "\n".join(offenders)


def test_the_private_name_finder_sees_both_spellings():
  tree = ast.parse("from distrib_train.checkpoint import hf\nfrom distrib_train.data.chat import _check\nhf._host(1)\n")
  modules = {"distrib_train.checkpoint.hf", "distrib_train.data.chat"}
  assert _private_reaches(tree, "distrib_train.weights.export", modules) == [
    (2, "distrib_train.data.chat._check"),
    (3, "distrib_train.checkpoint.hf._host"),
  ]


def test_the_checker_sees_an_upward_import(tmp_path):
  # The checker itself: a common module importing the trainer is reported.
  module = tmp_path / "bad.py"
  module.write_text("def f():\n  from distrib_train.train import trainer\n")
  ((line, imported),) = list(_imports(module, "distrib_train.common.bad"))
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
TOP_LEVEL_MODULES = {
  "__init__",
  "__main__",
  "cli",
  "train_state",
  "train_step",
  "step_core",
  "step_inputs",
  "microbatches",
}


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
  long = {
    str(path.relative_to(PACKAGE.parent)): n
    for _, path in _modules()
    if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
  }
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
