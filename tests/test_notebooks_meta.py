"""Every notebook is committed with outputs, has its jupytext twin, and starts with the setup cell."""

import json
from pathlib import Path

import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
SOURCES = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.py"))
SETUP_FIRST_LINE = ("# Setup: works on Colab, on a TPU VM and on a laptop. "
                    "Installs mkresearch if it is missing.")


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
    for needed in ('find_spec("mkresearch")', "pip", "import mkresearch",
                   "from mkresearch import tpu", "tpu.describe_backend()"):
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
