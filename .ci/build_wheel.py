"""Builds mkresearch's wheel from a clean copy of a source tree; prints the wheel's path.

    python .ci/build_wheel.py SOURCE_TREE OUT_DIR     (.ci/wheel-check: .venv's python)

setuptools stages a build in SOURCE_TREE/build/lib and reuses what is there, so after `pip wheel .`
a module deleted from the tree would still ship in the next wheel. The copy holds only what the
build reads (the top-level files: pyproject.toml, README.md, LICENSE, ...; the directories of
pyproject.toml's package-dir: mkresearch/, kernels/, docs/), never a build/ or an egg-info. Built offline by this Python's setuptools, the version
[build-system] pins (`--no-build-isolation --no-index`; tests/test_packaging.py checks the pin).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path


def package_dirs(source: Path) -> list[str]:
    """The directories pyproject.toml's [tool.setuptools] package-dir maps to packages."""
    setuptools = tomllib.loads((source / "pyproject.toml").read_text())["tool"]["setuptools"]
    return sorted(set(setuptools["package-dir"].values()))


def build(source: Path, out: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="mkresearch-build-") as scratch:
        tree = Path(scratch) / "mkresearch"
        tree.mkdir()
        for path in source.iterdir():
            if path.is_file() and not path.name.startswith("."):
                shutil.copy2(path, tree / path.name)
        for name in package_dirs(source):
            shutil.copytree(source / name, tree / name)
        out.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                               "--no-build-isolation", "--no-index", "-w", str(out), str(tree)],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            sys.stderr.write(done.stderr)
            raise SystemExit(f"build_wheel: pip wheel failed (exit {done.returncode})")
    (wheel,) = out.glob("mkresearch-*.whl")
    return wheel


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.split("\n\n")[1])
    print(build(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()))
