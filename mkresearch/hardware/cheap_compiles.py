"""Compiling for the CPU as cheaply as XLA allows, for test runs (pytest and nbval).

The conftests call `cheap_cpu_compiles()` before anything is compiled.
"""

import os
import sys

from mkresearch.hardware.tpu import add_xla_flag

# XLA:CPU's legacy fusion emitters instead of its MLIR ones: the same HLO, compiled a quarter to a
# third faster (measured on the interpret-mode kernel tests: tests/test_attention_kernels.py 63 -> 41 s,
# tests/test_megakernel.py 113 -> 85 s).
_LEGACY_CPU_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"


def cheap_cpu_compiles() -> None:
    """Before the first compile: compile for the CPU as cheaply as XLA allows, for test runs.

    Interpret-mode kernels are large programs whose run time is the interpreter's Python callbacks,
    so compiling is most of a kernel test's time (half of the pytest workers' CPU time here) and
    XLA's optimisations buy nothing. Two switches, each keeping IEEE semantics (no fast-math): jax's
    `JAX_DISABLE_MOST_OPTIMIZATIONS` (XLA's optimisation level 0 and LLVM's cheap passes) and
    XLA:CPU's legacy fusion emitters. Level 0 makes programs that run many times slower (the
    reference's kimi-k3-mini step at B = 4: 0.18 s per call, 0.023 s at level 1), but level 1 made
    the whole pytest run slower (interpret-mode kernels compile longer), and the reference must
    compile as the kernels it is compared with bit for bit do. Set by tests/conftest.py and
    notebooks/conftest.py; processes they start inherit them. A checked result must not depend on
    how XLA compiles: the committed notebook outputs come from runs as users run them, and `make
    test` checks them under these switches, with a second XLA:CPU configuration on top for the
    notebooks whose facts come from floats (Makefile). Explicit settings are kept.
    """
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    if "jax" in sys.modules:  # jax read the variable at import: set its flag too (no compile yet)
        disable = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() not in ("0", "false", "")
        sys.modules["jax"].config.update("jax_disable_most_optimizations", disable)
    add_xla_flag(_LEGACY_CPU_EMITTERS_FLAG)
