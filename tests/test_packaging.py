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
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
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
    """(wheel file names, the source tree it was built from, the wheel): a copy of the
    repository's build inputs plus the PROBES, so the build leaves the real tree alone."""
    tree = tmp_path_factory.mktemp("source")
    for name in sorted(set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())):
        shutil.copytree(ROOT / name, tree / name)  # __pycache__ too: none of it may ship
    for path in ROOT.iterdir():  # pyproject.toml, README.md and any other top-level build input
        if path.is_file() and not path.name.startswith("."):
            shutil.copy(path, tree / path.name)
    for probe in PROBES:
        (tree / probe).parent.mkdir(parents=True, exist_ok=True)
        (tree / probe).write_text('"""A subpackage pyproject.toml does not name."""\n')
    out = tmp_path_factory.mktemp("dist")
    # in place, as `pip wheel .` builds: setuptools leaves tree/build/lib (used by the next test)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "--no-index", "-w", str(out), str(tree)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("mkresearch-*.whl")
    return zipfile.ZipFile(wheel).namelist(), tree, wheel


def test_the_build_backend_here_is_the_pinned_one():
    """The offline build uses .venv's setuptools: it must be the one [build-system] pins."""
    for requirement in PYPROJECT["build-system"]["requires"]:
        name, pinned = requirement.split("==")
        assert importlib.metadata.version(name) == pinned, (
            f"{name} {importlib.metadata.version(name)} installed, [build-system] pins {pinned}:"
            " run make venv")


def test_wheel_holds_every_module_and_the_recorded_compiles(built):
    names, tree, _ = built
    installed = {n for n in names if not n.startswith("mkresearch-0.1.0.dist-info/")}
    wanted = source_files(tree)
    assert len(wanted) > 90 and any(n.startswith("mkresearch/model/stages/") for n in wanted)
    assert {"mkresearch/docs/glossary.md", "mkresearch/docs/notebooks.md"} <= wanted
    assert not wanted - installed, f"missing from the wheel: {sorted(wanted - installed)}"
    assert not installed - wanted, f"in the wheel, not in the source tree: {sorted(installed - wanted)}"


def test_new_subpackages_land_without_editing_pyproject(built):
    names, _, _ = built
    for probe in PROBES:
        assert re.sub(r"^kernels/", "mkresearch/kernels/", probe) in names, probe


def test_kernels_install_only_as_mkresearch_kernels(built):
    """A top-level `kernels` exists on PyPI: ours must never shadow it (nor be shadowed)."""
    names, _, _ = built
    assert not [n for n in names if n.startswith("kernels/")]
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert top_level.startswith("mkresearch-")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ ;\[]", requirement)[0].lower().replace("_", "-")


def test_runtime_dependencies_are_ranges_pinned_by_the_constraints():
    """Ranges with floors (a runtime's own jax and numpy stay when recent enough), no libtpu and no
    tokenizers among them; requirements/constraints.txt pins each, within its range."""
    from packaging.requirements import Requirement

    project = PYPROJECT["project"]
    assert project["requires-python"] == ">=3.11"
    pins = {_name(line): line.split("==")[1]
            for line in (ROOT / "requirements" / "constraints.txt").read_text().split()}
    runtime = [Requirement(r) for r in project["dependencies"]]
    assert {r.name for r in runtime} >= {"jax", "numpy", "ml_dtypes", "tqdm"}
    for requirement in runtime:
        assert not requirement.extras, f"{requirement}: libtpu is the tpu extra's"
        floors = [s for s in requirement.specifier if s.operator == ">="]
        assert floors and not [s for s in requirement.specifier if s.operator in ("==", "===")], (
            f"{requirement}: a range with a floor, not a pin")
        assert requirement.specifier.contains(pins[_name(requirement.name)]), (
            f"constraints.txt pins {requirement.name} {pins[_name(requirement.name)]}, outside "
            f"{requirement}")
    for requirement in PYPROJECT["build-system"]["requires"]:
        name, pinned = requirement.split("==")
        assert pins[_name(name)] == pinned, f"{requirement} of [build-system] not pinned alike"


def test_the_extras():
    extras = PYPROJECT["project"]["optional-dependencies"]
    plots = " ".join(extras["plots"])
    assert "matplotlib" in plots and "ipywidgets" in plots
    assert not [r for r in extras["plots"] if _name(r) in RUNTIME_OWN]
    assert "mkresearch[plots]" in extras["notebooks"]  # a local JupyterLab gets the plots too
    assert extras["tpu"] == ["jax[tpu]>=0.10.1"]  # libtpu: Linux x86-64 only, never a laptop's
    assert [_name(r) for r in extras["checkpoints"]] == ["tokenizers"]
    everything = [_name(r) for extra in extras.values() for r in extra]
    assert "tensorboard-plugin-profile" not in everything  # an empty package requiring xprof
    assert "mkresearch[notebooks,tpu,checkpoints]" in extras["dev"]  # our own venv has it all


def test_wheel_metadata_names_license_urls_and_classifiers(built):
    names, _, wheel = built
    metadata = zipfile.ZipFile(wheel).read("mkresearch-0.1.0.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "mkresearch-0.1.0.dist-info/licenses/LICENSE" in names
    urls = [line for line in metadata.splitlines() if line.startswith("Project-URL: ")]
    assert any("Repository, https://github.com/mkresearch/mkresearch" in url for url in urls), urls
    for version in ("3.11", "3.12"):
        assert f"Classifier: Programming Language :: Python :: {version}" in metadata
    always = [line for line in metadata.splitlines()
              if line.startswith("Requires-Dist: ") and "extra ==" not in line]
    assert not [line for line in always if "tpu" in line or "tokenizers" in line], always
    assert 'Requires-Dist: jax[tpu]>=0.10.1; extra == "tpu"' in metadata


@pytest.mark.slow
def test_a_module_deleted_from_the_tree_does_not_ship(built, tmp_path):
    """setuptools stages a build in build/lib and reuses it: `pip wheel .` after deleting a module
    ships it still. .ci/build_wheel.py (what .ci/wheel-check builds with) builds a clean copy."""
    _, tree, _ = built
    copy = tmp_path / "tree"
    shutil.copytree(tree, copy)  # with the build/lib that building `built` in place left
    gone = "mkresearch/probe_sub/probe_mod.py"
    assert (copy / "build" / "lib" / gone).exists(), "the stale staging directory this is about"
    (copy / gone).unlink()
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "build_wheel.py"), str(copy),
                           str(tmp_path / "dist")], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    names = zipfile.ZipFile(done.stdout.strip()).namelist()
    assert gone not in names
    assert "mkresearch/kernels/probe_pkg/deeper/probe_mod.py" in names  # the others still ship


def setup_cell(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "code")["source"]).splitlines()


def test_every_notebook_installs_alike_and_only_what_a_runtime_lacks():
    """One setup cell everywhere (notebook 08 sets its CPU device count between the install and
    `import mkresearch`: before JAX starts), installing mkresearch[plots], never Jupyter. How it
    behaves in a runtime (what it keeps, replaces, when it restarts) .ci/wheel-check runs."""
    reference = setup_cell(NOTEBOOKS[0])
    split = reference.index("import mkresearch  # sets JAX_PLATFORMS=cpu when this machine has no TPU")
    install, imports = reference[:split], reference[split:]
    assert any('"pip", "install"' in line for line in install)
    assert any('f"mkresearch[{_extras}] @ {_source}"' in line for line in install)
    assert any('_extras = "plots,tpu" if' in line for line in install)  # tpu only on a TPU
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


def test_without_the_extras_the_cli_runs_and_names_each_extra(tmp_path):
    """Only jax, numpy, ml_dtypes, tqdm and absl-py are always installed (`make demo` installs
    just those): without matplotlib, ipywidgets and tokenizers every command still imports, and
    what needs one of them says in one line which extra brings it."""
    script = f"""
import sys
for name in ("matplotlib", "ipywidgets", "tokenizers"):
    sys.modules[name] = None  # as if not installed: importing it raises ModuleNotFoundError
from mkresearch.checkpoint.tokenizer import load_tokenizer
from mkresearch.cli.main import main
from mkresearch.model.hf_config import CheckpointError
try:
    load_tokenizer({str(tmp_path)!r})
except CheckpointError as error:
    print(error)
sys.exit(main(["figures", "--out", {str(tmp_path / "figures")!r}]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=False, env=os.environ | {"JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stdout == ("a checkpoint's tokenizer.json needs the `tokenizers` package, the "
                           '`checkpoints` extra: pip install "mkresearch[checkpoints]"\n')
    assert done.stderr == ("mkresearch figures draws with matplotlib, which is not installed "
                           'here: pip install "mkresearch[plots]"\n')
    assert not (tmp_path / "figures").exists()


@pytest.mark.slow
def test_make_lab_starts_as_root(tmp_path):
    """A TPU VM's or a container's user is root, where Jupyter refuses to start unless told
    --allow-root: `make lab` tells it (CI runs as root). Started on a free port, it answers /lab
    with HTTP 200, then it is stopped by its PID (the process group `make` leads)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = "wheelcheck"
    lab_args = (f"--no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port={port} "
                f"--ServerApp.port_retries=0 --IdentityProvider.token={token} "
                "--LabApp.extension_manager=readonly")
    env = os.environ | {"JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
                        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    log = (tmp_path / "lab.log").open("w")
    # -o: .venv is the one these tests run in; `make lab` must not reinstall it here
    lab = subprocess.Popen(["make", "-C", str(ROOT), "-o", ".venv/bin/.installed", "lab",
                            f"LAB_ARGS={lab_args}"], stdout=log, stderr=subprocess.STDOUT,
                           env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120  # a hang guard, far above JupyterLab's start
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}",
                                            timeout=5) as answer:
                    status = answer.status
                break
            except OSError:
                if lab.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"make lab did not start:\n{(tmp_path / 'lab.log').read_text()}")
                time.sleep(0.5)
        assert status == 200
        if os.geteuid() == 0:
            assert "--allow-root" in (tmp_path / "lab.log").read_text()  # make echoes its command
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        try:
            lab.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(lab.pid, signal.SIGKILL)
            lab.wait()
        log.close()
