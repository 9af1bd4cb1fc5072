"""Static tools follow every import of mkresearch, `mkresearch.kernels` included.

kernels/ installs as mkresearch.kernels (pyproject.toml's package-dir). setuptools' editable
install serves that name through an import hook, which no static tool runs, so editors and type
checkers stopped at every kernel import. `.static-imports/mkresearch` names the two directories
under the names they are imported by (a link to mkresearch/__init__.py and one to kernels/), and
the checkers' configurations point at it: mypy.ini (`mypy_path`) and pyrightconfig.json
(`extraPaths`, for pyright and Pylance). Nothing at run time reads it, and it holds no top-level
`kernels`.

The checks run mypy itself (pinned in the dev extra), offline, in a few seconds: its import
resolution from the repository's root finds every module of mkresearch/ and kernels/ by its
installed name, at its own file.
"""

import configparser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from test_layering import MODULES

ROOT = Path(__file__).resolve().parent.parent
STATIC = ".static-imports"


def test_the_static_path_names_kernels_as_installed_and_nothing_else():
    static = ROOT / STATIC
    assert [p.name for p in static.iterdir()] == ["mkresearch"]
    links = {p.name: p for p in (static / "mkresearch").iterdir()}
    assert sorted(links) == ["__init__.py", "kernels"]
    assert all(p.is_symlink() for p in links.values())  # links, never copies that drift
    assert links["kernels"].resolve() == ROOT / "kernels"
    assert links["__init__.py"].resolve() == ROOT / "mkresearch" / "__init__.py"


def test_both_checkers_are_pointed_at_it():
    mypy = configparser.ConfigParser()
    mypy.read(ROOT / "mypy.ini")
    assert mypy["mypy"]["mypy_path"] == STATIC
    text = (ROOT / "pyrightconfig.json").read_text()
    pyright = json.loads(re.sub(r"^\s*//.*$", "", text, flags=re.MULTILINE))  # with comments
    assert pyright["extraPaths"] == [STATIC]


def test_mypy_resolves_every_module_from_the_repository_root(tmp_path):
    """`mypy` run at the root (reading mypy.ini) over a program importing every module:
    imports are resolved, not followed, so nothing is type-checked but the resolution."""
    program = "\n".join(f"import {name}" for name in MODULES)
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    done = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=skip",
                           f"--cache-dir={tmp_path}", "-c", program], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("Success"), done.stdout


def test_mypys_resolution_finds_each_module_at_its_own_file(monkeypatch):
    """mypy's module finder (the code `mypy` resolves imports with), configured by mypy.ini:
    every module name leads to the file it is built from, kernels/ for mkresearch.kernels.*."""
    from mypy.config_parser import parse_config_file
    from mypy.fscache import FileSystemCache
    from mypy.modulefinder import FindModuleCache, compute_search_paths
    from mypy.options import Options

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("MYPYPATH", raising=False)
    options = Options()
    parse_config_file(options, lambda: None, str(ROOT / "mypy.ini"), sys.stdout, sys.stderr)
    finder = FindModuleCache(compute_search_paths([], options, str(ROOT)), FileSystemCache(),
                             options)
    wrong = {}
    for name, path in MODULES.items():
        found = finder.find_module(name)
        if not isinstance(found, str) or Path(found).resolve() != path.resolve():
            wrong[name] = found
    assert not wrong, wrong
    assert sum(name.startswith("mkresearch.kernels") for name in MODULES) > 20
