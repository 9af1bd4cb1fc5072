"""The reader's guide: the map of the notebooks and the glossary, read from the pages the package
ships.

docs/notebooks.md (the map) and docs/glossary.md are installed with the package as
`mkresearch.docs` (pyproject.toml), so a notebook on Colab, which installs the package from git
and has no docs/ folder, shows the very text of the repository's pages. Each is described once,
there; the rest is derived:

    notebook_map()              -> [NotebookEntry]    one per notebook, from docs/notebooks.md
    glossary()                  -> [GlossaryEntry]    one per entry of docs/glossary.md
    lookup(*terms)              -> [GlossaryEntry]    the entries naming those terms (ValueError
                                                      naming a term the glossary lacks)
    readme_table(entries)       -> str                the README's notebooks table
    map_view(), glossary_view(*terms)                 HTML tables for a notebook cell
"""

from __future__ import annotations

import dataclasses
import html
import importlib.resources
import re

from mkresearch.views.widgets import TableView

DOCS_PACKAGE = "mkresearch.docs"
MAP_PAGE, GLOSSARY_PAGE = "notebooks.md", "glossary.md"
MAP_COLUMNS = ("notebook", "what it teaches", "what you write or change")
_ENTRY = re.compile(r"\*\*(?P<term>[^*]+)\*\*:\s*(?P<text>.*)", re.DOTALL)
_PARENTHESIS = re.compile(r"\s*\([^)]*\)")


def page(name: str) -> str:
    """The text of docs/<name> as the package installed it."""
    return (importlib.resources.files(DOCS_PACKAGE) / name).read_text(encoding="utf-8")


@dataclasses.dataclass(frozen=True)
class NotebookEntry:
    stem: str  # "00_megakernels_on_tpu"
    teaches: str
    you_write: str

    @property
    def number(self) -> str:
        return self.stem[:2]


@dataclasses.dataclass(frozen=True)
class GlossaryEntry:
    term: str  # as the glossary writes it: "HBM, VMEM, SMEM"
    text: str  # the definition, with where it is explained in depth

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the entry defines: the term as written, each name
        apart and each in parentheses: "HBM, VMEM, SMEM" -> (the term, "HBM", "VMEM", "SMEM");
        "Correction bias (`noaux_tc`)" -> (the term, "Correction bias", "noaux_tc"); "Memory
        space (`pl.ANY`, `pltpu.VMEM`)" -> (the term, "Memory space", "pl.ANY", "pltpu.VMEM")."""
        inside = [p.strip("` ") for group in re.findall(r"\(([^)]*)\)", self.term)
                  for p in group.split(",")]
        outside = _PARENTHESIS.sub("", self.term).replace("`", "")
        parts = [p.strip() for p in [self.term.replace("`", "")] + re.split(r",|;", outside)
                 + inside]
        return tuple(dict.fromkeys(p for p in parts if p))


def markdown_table(text: str) -> list[list[str]]:
    """The rows of the first Markdown table in `text` (header first, the |---| line dropped)."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return [row for row in rows if not all(set(cell) <= set("-: ") for cell in row)]


def notebook_map(text: str | None = None) -> list[NotebookEntry]:
    """docs/notebooks.md's table, one entry per notebook in order."""
    header, *rows = markdown_table(page(MAP_PAGE) if text is None else text)
    if tuple(header) != MAP_COLUMNS:
        raise ValueError(f"{MAP_PAGE}: the map's columns are {header}, expected {MAP_COLUMNS}")
    return [NotebookEntry(*row) for row in rows]


def glossary(text: str | None = None) -> list[GlossaryEntry]:
    """docs/glossary.md's entries ("**Term**: definition" paragraphs), in its order."""
    paragraphs = re.split(r"\n\s*\n", page(GLOSSARY_PAGE) if text is None else text)
    entries = []
    for paragraph in paragraphs:
        match = _ENTRY.match(paragraph.strip())
        if match:
            entries.append(GlossaryEntry(match["term"].strip(),
                                         " ".join(match["text"].split())))
    return entries


def lookup(*terms: str, entries: list[GlossaryEntry] | None = None) -> list[GlossaryEntry]:
    """The glossary entries that define `terms` (every entry naming a term: W_o is KDA's and
    MLA's; one entry once, in the order asked), matched on any name an entry defines, case
    apart; ValueError naming the terms it has no entry for."""
    entries = glossary() if entries is None else entries
    by_name: dict[str, list[GlossaryEntry]] = {}
    for entry in entries:
        for name in dict.fromkeys(n.casefold() for n in entry.names):
            by_name.setdefault(name, []).append(entry)
    missing = [term for term in terms if term.casefold() not in by_name]
    if missing:
        raise ValueError(f"terms={missing!r} are not in docs/{GLOSSARY_PAGE}: add them there "
                         "(each entry '**Term**: definition')")
    return list(dict.fromkeys(e for term in terms for e in by_name[term.casefold()]))


def readme_table(entries: list[NotebookEntry] | None = None) -> str:
    """The README's notebooks table: each notebook linked, with what it teaches."""
    entries = notebook_map() if entries is None else entries
    lines = ["| notebook | what it teaches |", "|---|---|"]
    lines += [f"| [{e.stem}](notebooks/{e.stem}.ipynb) | {e.teaches} |" for e in entries]
    return "\n".join(lines)


def _inline(markdown: str) -> str:
    """A cell's Markdown as HTML: `code` and [text](link) (as text: a notebook's links to
    repository files do not resolve on Colab)."""
    text = html.escape(re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", markdown))
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)


def map_view(entries: list[NotebookEntry] | None = None) -> TableView:
    """The map of the notebooks as a table (HTML in a notebook, text elsewhere)."""
    entries = notebook_map() if entries is None else entries
    rows = [dict(zip(MAP_COLUMNS, (e.stem, e.teaches, e.you_write), strict=True))
            for e in entries]
    return TableView(rows, MAP_COLUMNS, html_cell=_inline, align="left")


def glossary_view(*terms: str, entries: list[GlossaryEntry] | None = None,
                  folded: bool = False) -> TableView:
    """The glossary's entries as a table: all of them, or those defining `terms`; `folded`:
    shut until the reader opens it."""
    chosen = lookup(*terms, entries=entries) if terms else (
        glossary() if entries is None else entries)
    rows = [{"term": e.term, "meaning": e.text} for e in chosen]
    fold = f"the glossary: {len(rows)} entries (click to open)" if folded else None
    return TableView(rows, ("term", "meaning"), html_cell=_inline, align="left", folded=fold)
