"""Imports point down the layers of `mkresearch.layers` (hardware <- model <- sharding <- decoding
<- kernels <- prediction <- measurement <- views <- cli), the imports of all modules form no cycle,
every subpackage says what it is for and what it may import, and building a sharded kernel
imports nothing of the prediction layer (its algorithms come from the sharding plan, passed in).
Modules are cut by concept, not by a line count: no cap here.

Every import is checked, at module level, inside functions and under `if TYPE_CHECKING:` (`import
x`, `from x import y`, relative imports): none of them hides a dependency, so none may close a
cycle. Importing by string (`importlib.import_module`, `__import__`) is refused for the same
reason, and matplotlib belongs to the drawing layers only (views, cli). No allow-list.

A module's private (underscored) names are its own: no module imports another's
(`from m import _name`) or reaches one through an imported name (`alias._name`); the few
underscored names that are public API (a NamedTuple's `_replace`, ...) and the one private name
of JAX we call are listed with their reasons (`PUBLIC_UNDERSCORED`, `ALLOWED_PRIVATE_USES`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
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


# the modules that build the sharded megakernel: the plan (which reductions, which algorithm),
# the kernel's options from it, the kernel (`megakernel_sharded.kernel_options`, `make_sharded_plan`)
KERNEL_BUILD = ("mkresearch.kernels.compose.megakernel_sharded", "mkresearch.kernels.sharded.plan",
                "mkresearch.kernels.sharded.collective_ops")


def closure(graph: dict[str, set[str]], roots: tuple[str, ...]) -> set[str]:
    """Every module `roots` import, directly or not (every import counts)."""
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += sorted(graph.get(module, ()))
    return seen


def test_building_the_kernel_imports_no_prediction():
    """The kernel build path reaches no module of mkresearch.prediction, by any import: the
    algorithm of each reduction is chosen by the sharding plan (the interconnect model sits in
    mkresearch.hardware) and passed to the kernel as an option."""
    reached = closure(import_graph(), KERNEL_BUILD)
    assert set(KERNEL_BUILD) <= reached
    assert "mkresearch.hardware.interconnect" in reached
    assert not sorted(m for m in reached if m.startswith("mkresearch.prediction"))


@pytest.mark.slow
def test_a_kernel_built_for_a_slice_loads_no_prediction():
    """Run as the CLI builds it: the options chosen for tpu7x's slice, the sharded plan made;
    mkresearch.prediction never loaded."""
    code = ("import sys\nfrom mkresearch.kernels.compose import megakernel_sharded as ms\n"
            "from mkresearch.model.config import get_config\n"
            "from mkresearch.sharding import layout\n"
            "lay = layout.layout(get_config('kimi-k3-mini'), 8, collectives='partial-sum')\n"
            "options = ms.kernel_options(lay, 1)\n"
            "plan = ms.make_sharded_plan(lay, 1, options=options)\n"
            "assert plan.shard.algorithms == options.reductions\n"
            "print(sorted(m for m in sys.modules if m.startswith('mkresearch.prediction')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    assert out.strip() == "[]"


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


# ---- a module's private names stay in it -------------------------------------------------------
# Underscored attribute names that are public API wherever they appear, with the reason.
PUBLIC_UNDERSCORED = {
    "_replace": "a NamedTuple's API (underscored so it cannot clash with a field's name)",
    "_asdict": "a NamedTuple's API",
    "_fields": "a NamedTuple's API",
    "_make": "a NamedTuple's API",
}
# (module, the use as written) -> why another package's private name is used there.
ALLOWED_PRIVATE_USES = {
    ("mkresearch.kernels.base.shape_run", "tpu_primitives._dma_unflatten"):
        "JAX has no public call that unflattens a dma_start's operands; its own helper knows how "
        "each supported JAX version flattens them",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _import_bindings(tree: ast.AST, importer: str, is_package: bool) -> dict[str, str]:
    """Each name an import binds (anywhere in the module) -> what it names (a module, or a name
    of a module: `from a import b` binds b -> a.b; `import a.b` binds a -> a)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(importer, is_package, node.level, node.module) if node.level
                    else node.module or "")
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    return bound


def private_uses(importer: str, source: str, label: str, is_package: bool = False) -> list[str]:
    """Every use in `source` (the module `importer`) of another module's private name: `from m
    import _name` and `alias._name` (or `alias.x._name`) where an import bound `alias` (to a
    module, ours or another package's, or to a name of one), but for PUBLIC_UNDERSCORED names and
    ALLOWED_PRIVATE_USES. A module's own private names (and `self._x`, `cls._x`) are its own."""
    tree = ast.parse(source)
    bound = _import_bindings(tree, importer, is_package)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(importer, is_package, node.level, node.module) if node.level
                    else node.module or "")
            found += [f"{label}:{node.lineno}: from {base} import {alias.name}"
                      for alias in node.names if _private(alias.name)]
        elif (isinstance(node, ast.Attribute) and _private(node.attr)
              and node.attr not in PUBLIC_UNDERSCORED):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            use = ast.unparse(node)
            if (isinstance(root, ast.Name) and root.id in bound
                    and (importer, use) not in ALLOWED_PRIVATE_USES):
                found.append(f"{label}:{node.lineno}: {use} ({root.id}: {bound[root.id]})")
    return found


def test_no_module_uses_another_modules_private_names():
    """A name with a leading underscore is its module's own: another module that needs it gets
    a public name (a function, a method, a module without the underscore), so what a module
    offers is what it names publicly, and a private name can change without a search."""
    found = []
    for module, path in MODULES.items():
        found += private_uses(module, path.read_text(), str(path.relative_to(ROOT)),
                              is_package=path.name == "__init__.py")
    assert not found, ("private names used outside their module (give them a public name, or "
                       "add the use to ALLOWED_PRIVATE_USES with the reason):\n" + "\n".join(found))


@pytest.mark.parametrize("source, expected", [
    ("from mkresearch.cli.common import _refusals\n", "from mkresearch.cli.common import _refusals"),
    ("from .common import _chip\n", "from mkresearch.cli.common import _chip"),
    ("from mkresearch.hardware import _fast_interpret\n", "import _fast_interpret"),
    ("from mkresearch.cli import bench\nbench._time_steps(f, 3)\n", "bench._time_steps"),
    ("import mkresearch.hardware\nmkresearch.hardware._flag\n", "mkresearch.hardware._flag"),
    (("from mkresearch.prediction.timeline import RankSimulation\n"
      "RankSimulation._holds_ring(op, None)\n"), "RankSimulation._holds_ring"),
    ("def f():\n    import numpy as np\n    return np._NoValue\n", "np._NoValue"),
])
def test_the_private_name_checker_finds(source, expected):
    found = private_uses("mkresearch.cli.predict", source, "x.py")
    assert len(found) == 1 and expected in found[0], found


def test_the_private_name_checker_allows_own_and_public_names():
    source = ("from __future__ import annotations\nimport collections\n"
              "from mkresearch.model import sampling\n"
              "_LOCAL = 1\ndef _helper(x):\n    return x._replace(a=1), x._asdict(), _LOCAL\n"
              "class A:\n    def f(self):\n        return self._g(), sampling.__name__\n"
              "    @classmethod\n    def h(cls):\n        return cls._g()\n"
              "P = collections.namedtuple('P', 'a')\nP._fields, P._make([1])\n")
    assert private_uses("mkresearch.cli.predict", source, "x.py") == []
