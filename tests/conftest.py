"""Shared test setup: CPU unless a TPU is present, and the `race_checked` fixture for kernel tests.

Keep this generic: fixtures of one kernel live in that kernel's test module.
"""


import gc

import pytest
from tiers import EXHAUSTIVE  # the tier, read once (tests/tiers.py)

from mkresearch.hardware import cheap_compiles
from mkresearch.hardware import tpu as _tpu

# XLA compiles as cheaply as it can (level 0, LLVM's cheap passes, the legacy CPU fusion
# emitters; IEEE semantics kept): interpret-mode kernels take longer to compile than to run. Set
# before the first compile; children (the CLI, the 8-device run) inherit it
# (`cheap_compiles.cheap_cpu_compiles`).
cheap_compiles.cheap_cpu_compiles()

# Before the first compile: CPU (TPU interpret mode) unless this machine has a TPU.
_tpu.select_platform()


def _tpu_tier_only(items) -> None:
    """On a TPU only the tests marked `tpu` run (make test-tpu): the others need TPU interpret
    mode (a simulator on the CPU) or several devices."""
    if not _tpu.on_tpu():
        return
    skip = pytest.mark.skip(reason="a CPU test (interpret mode or several devices): on a TPU "
                                   "make test-tpu runs the tests marked tpu")
    for item in items:
        if "tpu" not in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def race_checked():
    """Interpret kernels with the race detector (vector clocks of 16, which catch overwriting a
    double-buffer slot while its DMA is in flight); fail the test if it found a race. On a TPU
    the kernels are compiled and run as they are: the race detector is a CPU check."""
    if _tpu.on_tpu():
        yield
        return
    previous = _tpu.current_interpret_options()
    _tpu.interpret_options(detect_races=True, vector_clock_size=16)
    _tpu.reset_races()
    try:
        yield
        raced = _tpu.races_found()
    finally:
        # A kernel that raised leaves the simulated TPU dirty: clean it for the next test.
        _tpu.reset_interpret_state()
        _tpu.reset_interpret_options()
        _tpu.interpret_options(**previous)
    assert not raced, "the race detector found a race (see 'RACE DETECTED' above)"


# Linux's default limit of memory mappings per process (vm.max_map_count) is 65,530; JAX's caches
# are dropped well before it: one module of megakernel tests adds up to ~20,000 (measured), and
# the executables kept also hold memory (a worker's peak ~6 GB at 30,000 here).
MAPPINGS_BEFORE_CLEARING = 20_000


def _mappings() -> int | None:
    """This process's number of memory mappings, or None where /proc does not say (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test module, drop JAX's compiled executables when this process holds many memory
    mappings. Each XLA:CPU executable keeps its JIT code in its own mappings, and the interpret-mode
    kernels of one run of tests/ made more than Linux's default 65,530 per process: the next
    compile's mmap failed and the process died of a segmentation fault inside XLA. Below the
    threshold the executables stay, so a later module that builds the same program reuses it."""
    yield
    if nextitem is None or nextitem.module is not item.module:
        mappings = _mappings()
        if mappings is None or mappings > MAPPINGS_BEFORE_CLEARING:
            import jax

            jax.clear_caches()
            gc.collect()


# The modules that take longest (measured with --durations), first: xdist's loadfile hands modules
# to its two workers in collection order, and a long module handed out last leaves one worker idle
# while the other finishes it.
LONGEST_MODULES = (  # measured (--durations=0 over a whole run), longest first, >= ~20 s each
    "test_sharded.py", "test_multihost.py", "test_schedule.py", "test_megakernel.py",
    "test_megakernel_verify.py", "test_speculative.py", "test_cli.py", "test_costs.py",
    "test_families_megakernel.py", "test_attention_kernels.py", "test_batch_invariance.py",
    "test_paged_kv.py", "test_expert_kernel.py", "test_cli_checkpoint.py", "test_scale_out.py",
    "test_browser.py", "test_cli_speculative.py", "test_sampling_kernel.py", "test_families.py",
    "test_partial_sum_claim.py", "test_checkpoint.py", "test_weights.py",
    "test_families_attention_kernels.py", "test_families_moe_kernels.py", "test_full_size.py",
    "test_reference.py", "test_serve.py")


def _module_rank(item) -> int:
    name = item.path.name
    return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)


def pytest_collection_modifyitems(config, items):
    """The longest modules first (a stable sort: each module's tests keep their order). Then
    `exhaustive` tests (every combination of a sweep whose named cases run anyway) are opt-in:
    MKRESEARCH_EXHAUSTIVE=1 (`make test-exhaustive`), so that `make test` runs the named cases
    alone (its budget: DEVELOPERS.md; each run prints its time). On a TPU: `_tpu_tier_only`."""
    _tpu_tier_only(items)
    items.sort(key=_module_rank)
    if EXHAUSTIVE:
        return
    skip = pytest.mark.skip(reason="exhaustive sweep: MKRESEARCH_EXHAUSTIVE=1 (make "
                                   "test-exhaustive) runs it")
    for item in items:
        if "exhaustive" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """MKRESEARCH_TEST_LOG=FILE: one JSON line per test as it ends (id, outcome, seconds, the
    reason's last lines), written at once, so that a run cut by a time limit (a TPU session's
    device time) still says what failed and why; pytest prints its reasons only at the end."""
    import json
    import os

    path = os.environ.get("MKRESEARCH_TEST_LOG")
    if not path or not (report.when == "call" or report.failed or report.skipped):
        return
    outcome = "error" if report.failed and report.when != "call" else report.outcome
    reason = report.longreprtext.strip().splitlines()[-12:] if report.longrepr else []
    with open(path, "a") as log:
        log.write(json.dumps({"test": report.nodeid, "outcome": outcome,
                              "seconds": round(report.duration, 2), "reason": reason}) + "\n")
