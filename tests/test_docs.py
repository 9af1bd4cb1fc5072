"""The README is a front page and every citation resolves.

* README.md is at most README_LIMIT characters; its set-up commands are the two `.ci/run` runs,
  in the same order; its quick-start commands parse with the CLI they name.
* Every `docs/<page>.md` cited anywhere in the repository (code, tests, notebooks with their
  outputs, Markdown) exists, and so does every section it cites (`docs/kimi-k3.md §5`, `§6.2`:
  a heading of that page numbered so). A bare `§N` resolves in a page the same file cites
  (`§N` of a paper or of a notebook is named so: "paper §2.2", "notebook 08 §6").
* No citation of the internal spec files is left (they are not in the repository).
* Every relative link of the Markdown pages (README.md, DEVELOPERS.md, docs/*.md) points at a file
  that exists.
"""

from __future__ import annotations

import json
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT = 8000
TEXT_SUFFIXES = {".py", ".md", ".ipynb", ".cfg", ".toml", ".txt"}
SKIP_DIRS = {".git", ".venv", "build", "__pycache__", ".pytest_cache", ".ruff_cache",
             ".ipynb_checkpoints", ".hypothesis", "traces", "bench", "figures"}

DOCS_CITATION = re.compile(r"\bdocs/([A-Za-z0-9_-]+\.md)((?:\s*§\s*\d+(?:\.\d+)*)?)")
SECTION = re.compile(r"§\s*(\d+(?:\.\d+)*)")
NAMED_ELSEWHERE = re.compile(r"(?:paper|report|notebook \d\d)\s*$")
# the old forms, spelled in pieces so that no rewrite of them touches this file
OLD_FORMS = re.compile(r"\b[Ss]pec" + r" §" + r"|\bspec" + r"/[a-z0-9-]+\.md|shared" + r"/spec")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING_NUMBER = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s")


def repository_files() -> list[Path]:
    """Every text file of the repository that can cite something (not .venv, build, caches)."""
    out = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name in ("Makefile", "run")):
            out.append(path)
    return sorted(out)


@cache
def sections(page: str) -> frozenset[str]:
    """The section numbers docs/<page> defines: headings "## 5. MLA", "### 6.1 Router"."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    return frozenset(m.group(1) for line in text.splitlines()
                     if (m := HEADING_NUMBER.match(line)))


def citation_problems(rel: str, text: str) -> list[str]:
    """What in one file's text cites a missing docs page or section."""
    problems, cited = [], set()
    spans = []
    for m in DOCS_CITATION.finditer(text):
        page = m.group(1)
        spans.append((m.start(), m.end()))
        if not (ROOT / "docs" / page).is_file():
            problems.append(f"{rel}: docs/{page} does not exist")
            continue
        cited.add(page)
        if m.group(2):
            number = SECTION.search(m.group(2)).group(1)
            if number not in sections(page):
                problems.append(f"{rel}: docs/{page} has no §{number}")
    if rel.startswith("docs/"):
        cited.add(rel.removeprefix("docs/"))
    for m in SECTION.finditer(text):
        if any(start <= m.start() < end for start, end in spans):
            continue
        line_start = text.rfind("\n", 0, m.start()) + 1
        if NAMED_ELSEWHERE.search(text[line_start:m.start()]):
            continue
        number = m.group(1)
        if not any(number in sections(page) for page in cited):
            problems.append(f"{rel}: §{number} is in none of the pages it cites "
                            f"({', '.join(sorted(cited)) or 'none'})")
    return problems


def test_every_docs_citation_resolves():
    problems, citations = [], 0
    for path in repository_files():
        if path == Path(__file__).resolve():  # its examples of broken citations
            continue
        text = path.read_text(encoding="utf-8")
        citations += len(DOCS_CITATION.findall(text))
        problems += citation_problems(str(path.relative_to(ROOT)), text)
    assert citations > 100  # the check reads the tree (code, tests, notebooks, Markdown)
    assert not problems, "\n".join(problems)


def test_no_citation_of_the_internal_spec_files():
    left = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in repository_files() if path != Path(__file__).resolve()
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if OLD_FORMS.search(line)]
    assert not left, "\n".join(left)


def test_citation_check_catches_missing_pages_and_sections():
    assert citation_problems("x.py", "docs/kimi-k3.md §5 and §6.1") == []
    assert citation_problems("x.py", "see docs/no-such-page.md") == [
        "x.py: docs/no-such-page.md does not exist"]
    assert citation_problems("x.py", "docs/kimi-k3.md §12") == ["x.py: docs/kimi-k3.md has no §12"]
    assert citation_problems("x.py", "(§4)") == ["x.py: §4 is in none of the pages it cites (none)"]
    assert citation_problems("x.py", "the DeepSeek-V3 paper §2.2; notebook 08 §6") == []
    assert OLD_FORMS.search("spec" + " §9") and OLD_FORMS.search("spec" + "/tpu.md")


@pytest.mark.parametrize("page", ["README.md", "DEVELOPERS.md",
                                  *[f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))]])
def test_markdown_links_resolve(page):
    text = (ROOT / page).read_text(encoding="utf-8")
    missing = []
    for target in MD_LINK.findall(text):
        if re.match(r"[a-z]+://|#|mailto:", target):
            continue
        if not ((ROOT / page).parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{page} links to missing files: {missing}"


# ---- every link of a notebook or a page resolves, its #anchor too -----------------------------
NOTEBOOK_FILES = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PAGES = [ROOT / "README.md", ROOT / "DEVELOPERS.md", *sorted((ROOT / "docs").glob("*.md"))]
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")


def _plain(heading: str) -> str:
    """A heading's text as rendered: no `code` marks, emphasis or link targets."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[`*_]", "", heading).strip()


def anchors(path: Path) -> set[str]:
    """The #anchors a file's headings define: in a notebook JupyterLab's (the text, spaces as
    '-'), in a Markdown page GitHub's (lower case, punctuation dropped, spaces as '-')."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        lines = [line for c in cells if c["cell_type"] == "markdown"
                 for line in "".join(c["source"]).splitlines()]
        return {_plain(m.group(1)).replace(" ", "-") for line in lines
                if (m := HEADING.match(line))}
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        if not fenced:
            lines.append(line)
    return {re.sub(r"[^\w\- ]", "", _plain(m.group(1)).lower()).replace(" ", "-")
            for line in lines if (m := HEADING.match(line))}


def link_problems(path: Path, text: str) -> list[str]:
    """Each relative link of `text` (in `path`) whose file or #anchor does not exist."""
    problems = []
    for target in MD_LINK.findall(text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        name, _, anchor = target.partition("#")
        linked = (path.parent / name).resolve() if name else path
        if not linked.exists():
            problems.append(f"{path.relative_to(ROOT)}: {target}: no such file")
        elif anchor and linked.suffix in (".ipynb", ".md") and anchor not in anchors(linked):
            problems.append(f"{path.relative_to(ROOT)}: {target}: no heading #{anchor} in "
                            f"{linked.name}")
    return problems


def _markdown_of(path: Path) -> str:
    if path.suffix != ".ipynb":
        return path.read_text(encoding="utf-8")
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


@pytest.mark.parametrize("path", NOTEBOOK_FILES + PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_of_the_notebooks_and_pages_resolves(path):
    problems = link_problems(path, _markdown_of(path))
    assert not problems, "\n".join(problems)


def test_the_link_check_sees_a_missing_anchor():
    notebook = ROOT / "notebooks" / "01_vmem_pipelining.ipynb"
    assert "The-glossary" in anchors(ROOT / "notebooks" / "00_megakernels_on_tpu.ipynb")
    assert link_problems(notebook, "[g](00_megakernels_on_tpu.ipynb#Glossary)") == [(
        "notebooks/01_vmem_pipelining.ipynb: 00_megakernels_on_tpu.ipynb#Glossary: no heading "
        "#Glossary in 00_megakernels_on_tpu.ipynb")]
    assert link_problems(notebook, "[x](nowhere.ipynb)")
    assert {"quick-start", "what-is-measured-and-what-is-predicted"} <= anchors(ROOT / "README.md")
    assert not link_problems(ROOT / "docs" / "x.md", "[q](../README.md#quick-start)")


# ---- the README as a front page ------------------------------------------------------------

def _readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def _section_block(text: str, heading: str) -> list[str]:
    """The commands of the first fenced code block under `## heading` (comments dropped)."""
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1].split("\n", 1)[1]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    return [line.split(" #", 1)[0].strip() for line in lines
            if line.strip() and not line.lstrip().startswith("#")]


def test_readme_is_a_front_page():
    assert len(_readme()) <= README_LIMIT, f"README.md is {len(_readme())} characters"


def test_readme_setup_commands_are_what_ci_runs():
    setup = _section_block(_readme(), "Set up")
    ci = _ci_commands()
    assert len(setup) == 2, setup
    assert [c for c in ci if c in setup] == setup, f"README {setup} vs .ci/run {ci}"


def test_readme_quick_start_commands_parse():
    from mkresearch.cli import main, options

    commands = _section_block(_readme(), "Quick start")
    assert len(commands) <= 5, commands
    cli = [shlex.split(c)[1:] for c in commands if c.startswith(".venv/bin/mkresearch ")]
    assert cli, commands
    for argv in cli:
        args = main._parser().parse_args(argv)  # SystemExit (2) on a flag the CLI does not take
        assert not getattr(args, options.NOTICES, None), f"{argv}: an old spelling"
    make = [c for c in commands if c.startswith("make ")]
    targets = (ROOT / "Makefile").read_text(encoding="utf-8")
    for c in make:
        assert re.search(rf"^{re.escape(c.split()[1])}:", targets, re.M), c
