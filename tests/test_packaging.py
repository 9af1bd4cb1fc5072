"""The wheel holds every module, and the notebooks install only what a hosted runtime lacks.

An editable install reads the source tree and hides a package missing from the wheel (issue 23:
`mkresearch.model.stages` was); here the wheel is built from a copy of the repository with the pinned
build backend (offline: `--no-build-isolation --no-index`) and its file list is compared with
the source tree. New subpackages are added to the copy first: they must land in the wheel
without an edit of pyproject.toml. `.ci/wheel-check` installs the wheel itself (clean virtualenvs,
Python 3.11 and 3.12) and runs notebook 00 from it.
"""

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# subpackages that do not exist in the repository: the copy the wheel is built from gets them
PROBES = ("kernels/probe_pkg/__init__.py", "kernels/probe_pkg/deeper/probe_mod.py",
          "mkresearch/probe_sub/probe_mod.py")
# what a hosted runtime brings and depends on: the notebooks' first cell must not install them
RUNTIME_OWN = ("jupyterlab", "ipykernel", "notebook", "jupyter-server", "jupyter_server")


def source_files(tree: Path) -> set[str]:
    """The wheel paths the source tree asks for: every .py of mkresearch/ and of kernels/ (as
    mkresearch/kernels/...), the recorded compiles and the documentation pages (docs/ as
    mkresearch/docs/: notebook 00 shows the map of the notebooks and the glossary from them)."""
    wanted = {f"mkresearch/{p.relative_to(tree / 'mkresearch')}"
              for p in (tree / "mkresearch").rglob("*.py")}
    wanted |= {f"mkresearch/kernels/{p.relative_to(tree / 'kernels')}"
               for p in (tree / "kernels").rglob("*.py")}
    wanted |= {f"mkresearch/{p.relative_to(tree / 'mkresearch')}"
               for p in (tree / "mkresearch" / "measurement" / "recorded").glob("*.json")}
    wanted |= {f"mkresearch/docs/{p.name}" for p in (tree / "docs").iterdir()
               if p.suffix in (".md", ".py")}
    return wanted


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(wheel file names, the source tree it was built from): a copy of the repository's build
    inputs plus the PROBES, so the build leaves the real tree alone."""
    tree = tmp_path_factory.mktemp("source")
    for name in ("mkresearch", "kernels", "docs"):
        shutil.copytree(ROOT / name, tree / name)  # __pycache__ too: none of it may ship
    for path in ROOT.iterdir():  # pyproject.toml, README.md and any other top-level build input
        if path.is_file() and not path.name.startswith("."):
            shutil.copy(path, tree / path.name)
    for probe in PROBES:
        (tree / probe).parent.mkdir(parents=True, exist_ok=True)
        (tree / probe).write_text('"""A subpackage pyproject.toml does not name."""\n')
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "--no-index", "-w", str(out), str(tree)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("mkresearch-*.whl")
    return zipfile.ZipFile(wheel).namelist(), tree


def test_the_build_backend_here_is_the_pinned_one():
    """The offline build uses .venv's setuptools: it must be the one [build-system] pins."""
    for requirement in PYPROJECT["build-system"]["requires"]:
        name, pinned = requirement.split("==")
        assert importlib.metadata.version(name) == pinned, (
            f"{name} {importlib.metadata.version(name)} installed, [build-system] pins {pinned}:"
            " run make venv")


def test_wheel_holds_every_module_and_the_recorded_compiles(built):
    names, tree = built
    installed = {n for n in names if not n.startswith("mkresearch-0.1.0.dist-info/")}
    wanted = source_files(tree)
    assert len(wanted) > 90 and any(n.startswith("mkresearch/model/stages/") for n in wanted)
    assert {"mkresearch/docs/glossary.md", "mkresearch/docs/notebooks.md"} <= wanted
    assert not wanted - installed, f"missing from the wheel: {sorted(wanted - installed)}"
    assert not installed - wanted, f"in the wheel, not in the source tree: {sorted(installed - wanted)}"


def test_new_subpackages_land_without_editing_pyproject(built):
    names, _ = built
    for probe in PROBES:
        assert re.sub(r"^kernels/", "mkresearch/kernels/", probe) in names, probe


def test_kernels_install_only_as_mkresearch_kernels(built):
    """A top-level `kernels` exists on PyPI: ours must never shadow it (nor be shadowed)."""
    names, _ = built
    assert not [n for n in names if n.startswith("kernels/")]
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert top_level.startswith("mkresearch-")


def test_python_311_and_312_and_the_extras():
    project = PYPROJECT["project"]
    assert project["requires-python"] == ">=3.11,<3.13"
    extras = project["optional-dependencies"]
    plots = " ".join(extras["plots"])
    assert "matplotlib" in plots and "ipywidgets" in plots
    assert not [r for r in extras["plots"] if re.split(r"[<>=!~ ;\[]", r)[0] in RUNTIME_OWN]
    assert "mkresearch[plots]" in extras["notebooks"]  # a local JupyterLab gets the plots too
    constraints = (ROOT / "requirements" / "constraints.txt").read_text().split()
    for requirement in PYPROJECT["build-system"]["requires"]:
        assert requirement in constraints, f"{requirement} of [build-system] not pinned alike"


def setup_cell(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "code")["source"]).splitlines()


def test_every_notebook_installs_alike_and_only_what_a_runtime_lacks():
    """One setup cell everywhere (notebook 08 sets its CPU device count between the install and
    `import mkresearch`: before JAX starts), installing mkresearch[plots], never Jupyter."""
    reference = setup_cell(NOTEBOOKS[0])
    split = reference.index("import mkresearch  # sets JAX_PLATFORMS=cpu when this machine has no TPU")
    install, imports = reference[:split], reference[split:]
    assert any('"pip", "install"' in line for line in install)
    assert any("mkresearch[plots] @ {_source}" in line for line in install)
    assert not [line for line in install if not line.startswith("#")
                and re.search(r"\[notebooks\]|jupyterlab|ipykernel|jupyter.server", line)]
    for notebook in NOTEBOOKS:
        cell = setup_cell(notebook)
        assert cell[:len(install)] == install, f"{notebook.name}: the install differs from 00's"
        assert cell[-len(imports):] == imports, f"{notebook.name}: the imports differ from 00's"
        twin = notebook.with_suffix(".py").read_text()
        assert "\n".join(install) in twin, f"{notebook.name}: its .py twin's setup cell differs"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_setup_cell_output_says_what_it_installed_and_names_no_path(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    first = next(c for c in cells if c["cell_type"] == "code")
    said = "".join("".join(o.get("text", "")) for o in first["outputs"])
    assert said.startswith("setup: "), f"{notebook.name}: the first line says what was installed"
    assert not re.search(r"file://|/work/|/root/|/home/", said), f"{notebook.name}: {said!r}"
