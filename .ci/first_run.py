"""Runs a notebook once, as a reader's first run does, and checks how its first cell ended.

    python first_run.py NOTEBOOK --expect end|stop|restart [--keep NAME ...] [--says TEXT ...]

Executes NOTEBOOK in place with nbclient (the kernel inherits this environment: PYTHONPATH,
IPYTHONDIR, MKRESEARCH_REPO, PIP_CONSTRAINT), prints the first cell's output and checks it:
  end      every cell ran; the first cell installed mkresearch and says so in its line, and none
           of the --keep packages is among what it installed or replaced (the runtime's stay)
  stop     the run stopped in the first cell with one line (no traceback) telling the reader to
           restart the kernel, which is still running
  restart  the same, but the cell shut its kernel down for the runtime (Colab) to start a new one
--says TEXT: the first cell's output must contain TEXT. Used by .ci/wheel-check.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, DeadKernelError
from nbclient.util import run_sync


def first_cell_output(nb) -> tuple[str, list[dict]]:
    cell = next(c for c in nb.cells if c.cell_type == "code")
    stdout = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")
    return stdout, [o for o in cell.outputs if o.output_type == "error"]


def listed(said: str, label: str) -> list[str]:
    """The package names of one part of the setup line: 'installed from ...: a 1, b 2' or
    'replaced a 1 -> 2, b 3 -> 4'."""
    found = re.search(rf"{label}[^;]*?: ([^;]*)" if label == "installed from" else
                      rf"{label} ([^;]*)", said)
    return [item.split()[0] for item in found[1].split(", ")] if found else []


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("notebook")
    parser.add_argument("--expect", choices=("end", "stop", "restart"), required=True)
    parser.add_argument("--keep", nargs="*", default=[])
    parser.add_argument("--says", action="append", default=[])
    args = parser.parse_args()

    nb = nbformat.read(args.notebook, as_version=4)
    for cell in nb.cells:  # a first run: nothing of the committed run's counts and outputs
        if cell.cell_type == "code":
            cell.execution_count, cell.outputs = None, []
    folder = str(Path(args.notebook).resolve().parent)  # the kernel's working directory
    client = NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": folder}})
    started = time.monotonic()
    stopped = None
    try:
        with client.setup_kernel():
            try:
                for index, cell in enumerate(nb.cells):
                    client.execute_cell(cell, index)
            except (CellExecutionError, DeadKernelError) as error:
                stopped = error
            time.sleep(2)  # a kernel told to shut down exits once its reply is sent
            alive = run_sync(client.km.is_alive)()
    finally:
        nbformat.write(nb, args.notebook)
    said, errors = first_cell_output(nb)
    error_lines = [line for e in errors for line in e.get("traceback", [])]
    print(f"  {Path(args.notebook).name}: {time.monotonic() - started:.0f} s; first cell:")
    for line in said.splitlines() + error_lines:
        print(f"    {line[:400]}")
    failures = [f"the first cell does not say {text!r}" for text in args.says if text not in said
                + "\n".join(error_lines)]
    ran = [c for c in nb.cells if c.cell_type == "code" and c.get("execution_count")]
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    if args.expect == "end":
        if stopped is not None:
            failures.append(f"the run stopped: {str(stopped)[-1500:]}")
        if len(ran) != len(code_cells):
            failures.append(f"{len(ran)} of {len(code_cells)} code cells ran")
        if not said.startswith("setup: mkresearch"):
            failures.append("the first cell did not install mkresearch")
        changed = listed(said, "installed from") + listed(said, "replaced")
        failures += [f"the first cell installed or replaced the runtime's {name}"
                     for name in args.keep if name in changed]
    else:
        if stopped is None or len(ran) != 1:
            failures.append(f"the run did not stop in the first cell ({len(ran)} cells ran)")
        if len(error_lines) != 1 or not error_lines[0].startswith("setup: ") \
                or "run the notebook again" not in error_lines[0]:
            failures.append(f"the first cell did not end with one line to restart: {error_lines}")
        if args.expect == "restart" and alive:
            failures.append("the kernel was not shut down for a restart")
        if args.expect == "stop" and not alive:
            failures.append("the kernel died")
    for failure in failures:
        print(f"  FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
