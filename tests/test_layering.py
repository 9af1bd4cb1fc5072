"""Imports point down the layers of `mkresearch.layers` (hardware <- model <- sharding <- decoding
<- kernels <- prediction <- measurement <- views <- cli), the imports of all modules form no cycle,
and every subpackage says what it is for and what it may import. (Modules are cut by concept, not
by a line count: no cap is checked.)

Every import is checked, at module level, inside functions and under `if TYPE_CHECKING:` (`import
x`, `from x import y`, relative imports): none of them hides a dependency, so none may close a
cycle. Importing by string (`importlib.import_module`, `__import__`) is refused for the same
reason, and matplotlib belongs to the drawing layers only (views, cli). No allow-list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mkresearch.layers import DRAWING, LAYERS, layer_of, rank

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"mkresearch": ROOT / "mkresearch", "mkresearch.kernels": ROOT / "kernels"}


def module_files() -> dict[str, Path]:
    """Module name -> file, for every module of mkresearch/ and kernels/."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


MODULES = module_files()


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imported_modules(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    """The module names an import statement loads (for `from a import b`: a.b if it is a module
    of this repository, else a)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = (_resolve_relative(importer, is_package, node.level, node.module) if node.level
            else node.module or "")
    return [f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base
            for alias in node.names]


def _is_module(name: str) -> bool:
    """A module of this repository, or one that mkresearch/layers.py names."""
    return name in MODULES or any(name in patterns for patterns in LAYERS.values())


def _function_level(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside a function (or lambda) body."""
    inside = set()
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(func) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def violations(importer: str, source: str, label: str, is_package: bool = False) -> list[str]:
    """Every import of `source` (the module `importer`, shown as `label`) that breaks the layering."""
    tree = ast.parse(source)
    lines = source.splitlines()
    own = layer_of(importer)
    if own is None:
        return [f"{label}: module {importer} is in no layer: add it to mkresearch/layers.py"]
    inside = _function_level(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                found.append(f"{label}:{node.lineno}: imports by string ({name}): import the "
                             "module itself, so the layering test sees the dependency")
            continue
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        where = "inside a function" if id(node) in inside else "at module level"
        for module in imported_modules(node, importer, is_package):
            if module == "kernels" or module.startswith("kernels."):
                found.append(f"{label}:{node.lineno}: imports the top-level `kernels` (a PyPI "
                             "package of that name exists): import mkresearch.kernels")
            elif module.split(".")[0] == "matplotlib" and own not in DRAWING:
                found.append(f"{label}:{node.lineno}: imports matplotlib in the {own} layer: "
                             f"plots belong to {' / '.join(DRAWING)} (mkresearch/views/)")
            elif module == "mkresearch" or module.startswith("mkresearch."):
                theirs = layer_of(module)
                if theirs is None:
                    found.append(f"{label}:{node.lineno}: imports {module}, which is in no layer: "
                                 "add it to mkresearch/layers.py")
                elif rank(theirs) > rank(own):
                    found.append(f"{label}:{node.lineno}: {importer} ({own}) imports {module} "
                                 f"({theirs}) {where}: {own} may import only "
                                 f"{' / '.join(list(LAYERS)[:rank(own) + 1])}")
                elif id(node) in inside and not _commented(lines, node.lineno):
                    found.append(f"{label}:{node.lineno}: {importer} imports {module} inside a "
                                 "function without a comment saying why (no jax before the "
                                 "platform is chosen): import it at the top")
    return found


def _commented(lines: list[str], lineno: int) -> bool:
    """A `#` comment on the import's line, or on a line above it within its group of imports."""
    if "#" in lines[lineno - 1]:
        return True
    for line in reversed(lines[:lineno - 1]):
        stripped = line.strip()
        if stripped.startswith("#"):
            return True
        if not stripped.startswith(("import ", "from ")):
            return False
    return False


def test_every_module_is_in_a_layer():
    assert not [m for m in MODULES if layer_of(m) is None], (
        "modules in no layer (add them to mkresearch/layers.py): "
        f"{[m for m in MODULES if layer_of(m) is None]}")
    stale = [name for patterns in LAYERS.values() for name in patterns
             if "*" not in name and name not in MODULES]
    assert not stale, f"mkresearch/layers.py names modules that do not exist: {stale}"


def test_imports_point_down_the_layers():
    found = []
    for module, path in MODULES.items():
        found += violations(module, path.read_text(), str(path.relative_to(ROOT)),
                            is_package=path.name == "__init__.py")
    assert not found, "imports against the layering (mkresearch/layers.py):\n" + "\n".join(found)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of this repository it imports (anywhere in its source)."""
    graph = {}
    for module, path in MODULES.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in imported_modules(node, module, path.name == "__init__.py"):
                    while name not in MODULES and "." in name:  # a name from a module
                        name = name.rsplit(".", 1)[0]
                    if name in MODULES and name != module:
                        deps.add(name)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) == len(MODULES) > 90  # every module of mkresearch/ and kernels/
    found = cycles(graph)
    assert not found, "import cycles (every import counts, inside functions too):\n" + "\n".join(
        " <-> ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a])
                                           if b in c) for c in found)


def test_every_subpackage_names_its_job_and_what_it_may_import():
    """Each subpackage's __init__.py is a docstring (its job, then `Imports: ...`) and nothing
    else: the tree reads as the architecture, and importing one module loads no other."""
    for module, path in MODULES.items():
        if path.name != "__init__.py" or module in PACKAGES or module == "mkresearch.model.stages":
            continue  # the roots, and the built-in kinds (which register on import)
        tree = ast.parse(path.read_text())
        doc = ast.get_docstring(tree)
        assert doc and "Imports:" in doc, f"{path.relative_to(ROOT)}: a docstring with 'Imports:'"
        assert len(tree.body) == 1, f"{path.relative_to(ROOT)}: only its docstring"


@pytest.mark.parametrize("importer, source, expected", [
    ("mkresearch.kernels.stages.mla", "def f():\n    from mkresearch.measurement import logs\n",
     "mkresearch.kernels.stages.mla (kernels.stages) imports mkresearch.measurement.logs "
     "(measurement) inside a function"),
    ("mkresearch.kernels.stages.mla", "from mkresearch.cli.bench import scale_to_rank\n",
     "(kernels.stages) imports mkresearch.cli.bench (cli) at module level"),
    ("mkresearch.model.config", "import mkresearch.kernels.base.dma\n",
     "imports mkresearch.kernels.base.dma"),
    ("mkresearch.kernels.base.costs", "from ..compose import megakernel_plan\n",
     "imports mkresearch.kernels.compose.megakernel_plan (kernels.compose)"),
    ("mkresearch.prediction.timeline", "import matplotlib.pyplot as plt\n",
     "matplotlib in the prediction"),
    ("mkresearch.cli.figures",
     "import importlib\nimportlib.import_module('mkresearch.views.plots')\n", "imports by string"),
    ("mkresearch.cli.bench", "def f():\n    from mkresearch.measurement import logs\n",
     "without a comment"),
    ("mkresearch.nowhere", "", "in no layer"),
])
def test_the_checker_finds(importer, source, expected):
    found = violations(importer, source, "x.py")
    assert len(found) == 1 and expected in found[0], found


def test_the_checker_allows_downward_and_commented_imports():
    source = ("from mkresearch.model import reference\nfrom mkresearch.kernels.base import dma\n"
              "def f():\n    # inside: no jax before the platform is chosen\n"
              "    from mkresearch.prediction import timeline\n"
              "    from mkresearch.kernels.stages import mla  # the same\n")
    assert violations("mkresearch.measurement.logs", source, "x.py") == []


def test_the_cycle_finder_finds_every_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
