"""Every notebook is committed with outputs, has its jupytext twin, and starts with the setup cell."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
# Subprocess timeouts only guard against a hang; they are far above any run time, not speed limits.
HANG_GUARD_S = 1800
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
SOURCES = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.py"))
SETUP_FIRST_LINE = ("# Setup: works on Colab, on a TPU VM and on a laptop. "
                    "Installs mkresearch if it is missing")


def load(path):
    return json.loads(path.read_text())


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/NN_name.ipynb"
    assert (NOTEBOOKS_DIR / "nbval_sanitize.cfg").exists()


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_py_twin(notebook):
    twin = notebook.with_suffix(".py")
    assert twin.exists(), f"{notebook.name} has no jupytext twin {twin.name}"
    text = twin.read_text()
    assert "jupytext:" in text and "formats: ipynb,py:percent" in text, (
        f"{twin.name} lacks the jupytext header pairing it with the .ipynb")


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_py_twin_has_notebook(source):
    assert source.with_suffix(".ipynb").exists(), (
        f"{source.name} has no .ipynb: run `make notebooks` and commit it")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_outputs(notebook):
    code = [cell for cell in load(notebook)["cells"] if cell["cell_type"] == "code"]
    assert code, f"{notebook.name} has no code cells"
    unexecuted = [i for i, cell in enumerate(code)
                  if cell["source"] and cell.get("execution_count") is None]
    assert not unexecuted, f"{notebook.name}: code cells {unexecuted} were never executed"
    assert any(cell["outputs"] for cell in code), f"{notebook.name} is committed without outputs"
    errors = [output for cell in code for output in cell["outputs"]
              if output.get("output_type") == "error"]
    assert not errors, f"{notebook.name} was committed with an error output"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_first_cell_installs_and_selects_backend(notebook):
    first = next(cell for cell in load(notebook)["cells"] if cell["cell_type"] == "code")
    source = "".join(first["source"])
    assert source.startswith(SETUP_FIRST_LINE), f"{notebook.name}: first cell is not the setup cell"
    for needed in ("importlib.util.find_spec", '("mkresearch", "matplotlib")', "pip",
                   "import mkresearch", "from mkresearch.hardware import tpu",
                   "tpu.describe_backend()"):
        assert needed in source, f"{notebook.name}: setup cell lacks {needed!r}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_checks_facts_and_asserts(notebook):
    sources = ["".join(cell["source"]) for cell in load(notebook)["cells"]
               if cell["cell_type"] == "code"]
    assert any("# NBVAL_CHECK_OUTPUT" in s for s in sources), (
        f"{notebook.name}: no fact cell marked # NBVAL_CHECK_OUTPUT")
    assert any("assert " in s for s in sources), f"{notebook.name} asserts nothing"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_check_markers_are_lines_of_their_own(notebook):
    """nbval reads a marker only from a line that is the comment alone: `x  # NBVAL_CHECK_OUTPUT`
    at a line's end leaves the cell unchecked."""
    for cell in load(notebook)["cells"]:
        for line in "".join(cell["source"]).splitlines():
            if "NBVAL_" in line:
                assert line.strip().startswith("#"), (
                    f"{notebook.name}: {line.strip()!r}: put the marker on a line of its own")


# Calls that compile for a TPU with libtpu's Mosaic compiler (a hosted CPU runtime, Colab's, lacks it)
TPU_COMPILES = ("tpu.compile_for(", "megakernel.compile_step(")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_a_cell_that_compiles_for_a_tpu_asks_for_libtpu_first(notebook):
    """On a CPU runtime without libtpu (Colab's) the notebook runs on: each cell that compiles
    for a TPU asks `tpu.can_compile()` and says what it skipped, instead of stopping there."""
    for cell in load(notebook)["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and any(call in source for call in TPU_COMPILES):
            assert "tpu.can_compile()" in source, (
                f"{notebook.name}: a cell compiles for a TPU without asking tpu.can_compile():\n"
                + source[:300])


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_every_widget_cell_also_holds_its_figure_as_png(notebook):
    """Where a widget cannot render (GitHub, nbviewer, an untrusted or reopened notebook) its
    cell must still show a figure: a widget output comes with an image/png output, and its text
    says what it is rather than `VBox(children=...`."""
    for index, cell in enumerate(load(notebook)["cells"]):
        outputs = cell.get("outputs", [])
        widgets = [o for o in outputs if WIDGET_VIEW in o.get("data", {})]
        if not widgets:
            continue
        assert any("image/png" in o.get("data", {}) for o in outputs), (
            f"{notebook.name} cell {index}: a widget output without an image/png figure")
        for output in widgets:
            text = "".join(output["data"].get("text/plain", ""))
            assert not text.startswith(("VBox(", "HBox(")), (
                f"{notebook.name} cell {index}: the widget's text is its raw repr {text[:40]!r}")


TINY_NOTEBOOK = {"cells": [{"cell_type": "code", "execution_count": None, "id": "a1",
                            "metadata": {}, "outputs": [], "source": "print(6 * 7)"}],
                 "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                             "name": "python3"}},
                 "nbformat": 4, "nbformat_minor": 5}


@pytest.mark.slow
@pytest.mark.parametrize("budget, over", [("1000", False), ("0.001", True)])
def test_nbval_run_reports_notebook_times_and_never_fails_on_time(tmp_path, budget, over):
    """notebooks/conftest.py times each notebook's nbval run (no second run) and its cells; a
    notebook over the budget gets a warning naming it and its slowest cells, and the run still
    passes (a wall-clock limit on a shared machine is a coin toss). The table can go to a file."""
    shutil.copy(NOTEBOOKS_DIR / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "tiny.ipynb").write_text(json.dumps(TINY_NOTEBOOK))
    table = tmp_path / "times.md"
    done = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "tiny.ipynb")],
                          check=False, capture_output=True, text=True, timeout=HANG_GUARD_S,
                          cwd=tmp_path, env=os.environ | {"MKRESEARCH_NOTEBOOK_BUDGET_S": budget,
                                                          "MKRESEARCH_NOTEBOOK_TIMES": str(table)})
    assert done.returncode == 0, done.stdout[-2000:]
    assert "notebook run times" in done.stdout and "tiny.ipynb:" in done.stdout
    assert ("WARNING: tiny.ipynb ran for" in done.stdout) == over
    if over:
        assert "over the 0 s budget of one notebook" in done.stdout
        assert "slowest cells: Cell 0" in done.stdout
    assert table.read_text().splitlines()[2].startswith("| tiny.ipynb |")


def _notebook_asserting(source: str) -> dict:
    cell = dict(TINY_NOTEBOOK["cells"][0], source=source)
    return dict(TINY_NOTEBOOK, cells=[cell])


@pytest.mark.slow
def test_float_fact_notebooks_run_under_the_second_xla_configuration(tmp_path):
    """`make test` passes the Makefile's OTHER_XLA_FLAGS in MKRESEARCH_NBVAL_OTHER_XLA_FLAGS: the
    kernel of a notebook whose facts come from floats runs under them (beside the cheap-compile
    switches), a host-independent notebook's (00, 07, 09) under the switches alone; the summary
    says which."""
    shutil.copy(NOTEBOOKS_DIR / "conftest.py", tmp_path / "conftest.py")
    other = "--xla_cpu_multi_thread_eigen=false"
    flags = "import os; flags = os.environ['XLA_FLAGS']; "
    (tmp_path / "05_floats.ipynb").write_text(json.dumps(_notebook_asserting(
        f"{flags}assert '{other}' in flags and 'fusion_emitters=false' in flags, flags")))
    (tmp_path / "09_predicting_the_release.ipynb").write_text(json.dumps(_notebook_asserting(
        f"{flags}assert '{other}' not in flags and 'fusion_emitters=false' in flags, flags")))
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=HANG_GUARD_S,
                          cwd=tmp_path, env=env | {"MKRESEARCH_NBVAL_OTHER_XLA_FLAGS": other})
    assert done.returncode == 0, done.stdout[-3000:]
    assert "05_floats.ipynb: " in done.stdout and "2 passed" in done.stdout
    assert "checked under the second XLA:CPU configuration" in done.stdout
    assert "checked under this machine's switches" in done.stdout
