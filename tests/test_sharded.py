"""Runs tests/sharded (the sharded megakernel on 8 simulated devices) in a process of its own:
XLA fixes the CPU device count when it starts (see tests/sharded/conftest.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SHARDED = Path(__file__).resolve().parent / "sharded"


def run_sharded(marker: str, timeout: float) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    env = {**os.environ, "MKRESEARCH_SHARDED": "1", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=8".strip()}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-m", marker, "-p", "no:cacheprovider",
         "--rootdir", str(SHARDED.parent.parent), str(SHARDED)],
        env=env, capture_output=True, text=True, timeout=timeout, check=False)
    print(result.stdout[-30000:])
    assert result.returncode == 0, f"{result.stdout[-8000:]}\n{result.stderr[-8000:]}"


def test_sharded_on_8_simulated_devices():
    """The fast set: every rank count, fewer steps (tests/sharded, not slow)."""
    run_sharded("not slow", timeout=1800)


@pytest.mark.slow
def test_sharded_full_matrix():
    """16 greedy steps at B in {1, 3, 4} on 2, 4 and 8 ranks (tests/sharded, slow)."""
    run_sharded("slow", timeout=6 * 3600)
