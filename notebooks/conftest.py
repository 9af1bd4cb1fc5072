"""pytest setup for nbval over notebooks/*.ipynb: CPU (TPU interpret mode) unless there is a TPU,
and each notebook's run time, measured and reported (never asserted).

The notebook kernels nbval starts inherit this process's environment, so JAX_PLATFORMS is decided
here once, exactly as `import mkresearch` decides it inside each notebook's first cell.

Run times: DEVELOPERS.md aims at one notebook ≲ NOTEBOOK_BUDGET_S on 2 cores. Each notebook is timed
in the nbval run itself (from the setup of its first cell, where its kernel starts, to the end of
its last cell: no notebook runs twice), and so is each cell. The terminal summary lists every
notebook's time, and a notebook over the budget gets a warning naming it and its slowest cells.
A wall-clock limit on a shared machine is a coin toss, so the run never fails on time.
`MKRESEARCH_NOTEBOOK_TIMES=FILE` also writes the table as Markdown (`make bench-notebooks`).

XLA compiles as cheaply as it can (`cheap_compiles.cheap_cpu_compiles`: XLA's optimisation level 0
with LLVM's cheap passes, and XLA:CPU's legacy fusion emitters, as tests/conftest.py sets them for
pytest): the notebooks' interpret-mode kernels take longer to compile than to run. IEEE semantics
are kept, and a checked fact must not depend on how XLA compiles anyway: the committed outputs come
from a run as users run them (default compiles), and nbval checks them here with these switches, in
`make test` with the Makefile's second XLA:CPU configuration on top for the notebooks whose facts
come from floats (OTHER_XLA_FLAGS_VARIABLE below). The notebook kernels nbval starts inherit this
process's environment.
"""

import os
import time

import pytest

from mkresearch.hardware import cheap_compiles
from mkresearch.hardware import tpu as _tpu

cheap_compiles.cheap_cpu_compiles()  # the notebook kernels nbval starts inherit it
_tpu.select_platform()

# A second XLA:CPU configuration (the Makefile's OTHER_XLA_FLAGS, passed in this variable): the
# notebooks whose checked facts come from XLA's float results (kernels, the reference) run under
# it, so each such fact is checked under another way of summing than the one that wrote the
# committed outputs (a run as users run them). The host-independent notebooks below check shapes,
# byte counts, DMA logs and pure-Python predictions, which no summation order of XLA changes: they
# run under the switches above alone. Unset (`make bench-notebooks`, `make test-exhaustive`'s pass
# under this machine's switches, a plain pytest): every notebook runs under the switches above.
OTHER_XLA_FLAGS_VARIABLE = "MKRESEARCH_NBVAL_OTHER_XLA_FLAGS"
HOST_INDEPENDENT_NOTEBOOKS = ("00_megakernels_on_tpu", "07_profiling", "09_predicting_the_release")
_BASE_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")

NOTEBOOK_BUDGET_S = float(os.environ.get("MKRESEARCH_NOTEBOOK_BUDGET_S", "90"))
SLOWEST_CELLS = 3  # named in an over-budget warning
_started: dict[str, float] = {}  # notebook path -> perf_counter at its first cell's setup
_seconds: dict[str, float] = {}  # notebook path -> wall time of the whole notebook
_cells: dict[str, dict[str, float]] = {}  # notebook path -> cell name -> seconds (all phases)
_last_cells: set[str] = set()  # node ids of each notebook's last cell


def _notebook(item) -> str | None:
    path = str(item.path)
    return path if path.endswith(".ipynb") else None


# The longest notebooks first (measured by `make bench-notebooks`), so the two xdist workers
# (`--dist loadfile`, each notebook in one worker) do not end on a long notebook started last.
LONGEST_NOTEBOOKS = ("06_megakernel", "08_scale_out", "02_attention", "04_expert_gemm",
                     "10_other_families", "11_speculative", "09_predicting_the_release",
                     "07_profiling", "05_sampling", "12_checkpoints", "13_serving")


def _notebook_rank(item) -> int:
    stem = item.path.stem
    return LONGEST_NOTEBOOKS.index(stem) if stem in LONGEST_NOTEBOOKS else len(LONGEST_NOTEBOOKS)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_notebook_rank)  # stable: each notebook's cells keep their order
    last = {}
    for item in items:
        if _notebook(item):
            last[_notebook(item)] = item.nodeid
    _last_cells.update(last.values())


def under_other_configuration(notebook_stem: str, other: str) -> bool:
    """Whether a notebook runs under the second configuration `other`: there is one, and the
    notebook's facts are not host-independent (HOST_INDEPENDENT_NOTEBOOKS)."""
    return bool(other.strip()) and notebook_stem not in HOST_INDEPENDENT_NOTEBOOKS


def kernel_xla_flags(notebook_stem: str, base: str, other: str) -> str:
    """XLA_FLAGS for a notebook's kernel: `base`, plus `other` where it applies."""
    if not under_other_configuration(notebook_stem, other):
        return base
    return f"{base} {other}".strip()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the first cell's setup starts the notebook's kernel (nbval's collector setup),
    which inherits this process's environment: the notebook's XLA:CPU configuration."""
    if _notebook(item):
        _started.setdefault(_notebook(item), time.perf_counter())
        os.environ["XLA_FLAGS"] = kernel_xla_flags(
            item.path.stem, _BASE_XLA_FLAGS, os.environ.get(OTHER_XLA_FLAGS_VARIABLE, ""))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when != "call" or item.nodeid not in _last_cells:
        return
    seconds = time.perf_counter() - _started[_notebook(item)]
    outcome.get_result().user_properties.append(("notebook_seconds", seconds))  # reaches xdist


def pytest_runtest_logreport(report):
    """Runs where the terminal is (in this process, or in xdist's controller for its workers)."""
    if not str(report.fspath).endswith(".ipynb"):
        return
    cell = report.nodeid.split("::", 1)[-1]
    cells = _cells.setdefault(report.fspath, {})
    cells[cell] = cells.get(cell, 0.0) + report.duration
    for name, seconds in report.user_properties:
        if name == "notebook_seconds":
            _seconds[report.fspath] = seconds


def timing_rows(seconds: dict[str, float], cells: dict[str, dict[str, float]],
                budget: float) -> list[dict]:
    """One row per notebook, slowest first: its time, the share of the budget, its slowest
    cells, and whether it is over the budget (a warning, never a failure)."""
    rows = []
    for notebook, total in sorted(seconds.items(), key=lambda kv: -kv[1]):
        slowest = sorted(cells.get(notebook, {}).items(), key=lambda kv: -kv[1])[:SLOWEST_CELLS]
        rows.append({"notebook": os.path.basename(notebook), "seconds": total,
                     "share": total / budget, "over": total > budget, "slowest": slowest})
    return rows


def _slowest_text(row) -> str:
    return ", ".join(f"{cell} {seconds:.1f} s" for cell, seconds in row["slowest"])


def markdown_table(rows: list[dict], budget: float) -> str:
    lines = [f"| notebook | seconds | share of the {budget:.0f} s budget | slowest cells |",
             "|---|---:|---:|---|"]
    lines += [f"| {r['notebook']} | {r['seconds']:.1f} | {r['share']:.0%} | {_slowest_text(r)} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter):
    if not _seconds:
        return
    rows = timing_rows(_seconds, _cells, NOTEBOOK_BUDGET_S)
    terminalreporter.section("notebook run times")
    other = os.environ.get(OTHER_XLA_FLAGS_VARIABLE, "").strip()
    for row in rows:
        stem = os.path.splitext(row["notebook"])[0]
        under = ("the second XLA:CPU configuration" if under_other_configuration(stem, other)
                 else "this machine's switches")
        terminalreporter.write_line(f"{row['notebook']}: {row['seconds']:.1f} s "
                                    f"({row['share']:.0%} of the {NOTEBOOK_BUDGET_S:.0f} s budget; "
                                    f"checked under {under})")
    for row in (r for r in rows if r["over"]):
        terminalreporter.write_line(
            f"WARNING: {row['notebook']} ran for {row['seconds']:.0f} s, over the "
            f"{NOTEBOOK_BUDGET_S:.0f} s budget of one notebook (DEVELOPERS.md); its slowest "
            f"cells: {_slowest_text(row)}. Record slow results (mkresearch.measurement.recorded) or shorten "
            "the run; this is a warning, not a failure", yellow=True)
    path = os.environ.get("MKRESEARCH_NOTEBOOK_TIMES")
    if path:
        with open(path, "w") as table:
            table.write(markdown_table(rows, NOTEBOOK_BUDGET_S))
        terminalreporter.write_line(f"notebook timing table written to {path}")
