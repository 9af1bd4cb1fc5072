"""pytest setup for nbval over notebooks/*.ipynb: CPU (TPU interpret mode) unless there is a TPU,
and the time budget of each notebook.

The notebook kernels nbval starts inherit this process's environment, so JAX_PLATFORMS is decided
here once, exactly as `import mkresearch` decides it inside each notebook's first cell.

Budget: DEVELOPERS.md allows one notebook ≲ 90 s on 2 cores. The nbval run itself is timed, per
notebook from the setup of its first cell (the kernel starts there) to the end of its last
cell, so no notebook runs twice; the last cell's test fails when the notebook took longer than
NOTEBOOK_BUDGET_S (override with MKRESEARCH_NOTEBOOK_BUDGET_S on a slower machine), and the
terminal summary lists every notebook's time.
"""

import os
import time

import pytest

from mkresearch import tpu as _tpu

_tpu.select_platform()

NOTEBOOK_BUDGET_S = float(os.environ.get("MKRESEARCH_NOTEBOOK_BUDGET_S", "90"))
_started: dict[str, float] = {}  # notebook path -> perf_counter at its first cell's setup
_seconds: dict[str, float] = {}  # notebook path -> wall time of the whole notebook
_last_cells: set[str] = set()  # node ids of each notebook's last cell


def _notebook(item) -> str | None:
    path = str(item.path)
    return path if path.endswith(".ipynb") else None


def pytest_collection_modifyitems(session, config, items):
    last = {}
    for item in items:
        if _notebook(item):
            last[_notebook(item)] = item.nodeid
    _last_cells.update(last.values())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _notebook(item):
        _started.setdefault(_notebook(item), time.perf_counter())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when != "call" or item.nodeid not in _last_cells:
        return
    notebook = _notebook(item)
    seconds = time.perf_counter() - _started[notebook]
    report = outcome.get_result()
    report.user_properties.append(("notebook_seconds", seconds))  # reaches xdist's controller
    if report.passed and seconds > NOTEBOOK_BUDGET_S:
        report.outcome = "failed"
        report.longrepr = (f"{os.path.basename(notebook)} ran for {seconds:.0f} s, over the "
                           f"{NOTEBOOK_BUDGET_S:.0f} s budget of one notebook (DEVELOPERS.md): "
                           "record slow results (see mkresearch.recorded) or shorten the run")


def pytest_runtest_logreport(report):
    """Runs where the terminal is (in this process, or in xdist's controller for its workers)."""
    for name, seconds in report.user_properties:
        if name == "notebook_seconds":
            _seconds[report.fspath] = seconds


def pytest_terminal_summary(terminalreporter):
    if _seconds:
        terminalreporter.section("notebook run times")
        for notebook, seconds in _seconds.items():
            terminalreporter.write_line(f"{os.path.basename(notebook)}: {seconds:.1f} s "
                                        f"({seconds / NOTEBOOK_BUDGET_S:.0%} of the "
                                        f"{NOTEBOOK_BUDGET_S:.0f} s budget)")
