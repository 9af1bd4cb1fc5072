"""Tests on simulated devices (`jax.shard_map` over a mesh of CPU devices, TPU interpret mode).

XLA fixes the number of CPU devices when its first backend starts, so these tests run in their
own process: `tests/test_sharded.py` starts `pytest tests/sharded` with MKRESEARCH_SHARDED=1 and
XLA_FLAGS=--xla_force_host_platform_device_count=8 (beside the project's
--xla_allow_excess_precision=false, `mkresearch.hardware.tpu.select_platform`). Collected in the main
test run they are ignored (one device there). The `race_checked` fixture is the one of
tests/conftest.py.
"""

import os

DEVICES = 8
ENV = "MKRESEARCH_SHARDED"

if os.environ.get(ENV) == "1":
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:  # before JAX starts
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}"
    collect_ignore_glob: list[str] = []
else:
    collect_ignore_glob = ["test_*.py"]
