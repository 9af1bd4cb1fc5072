"""The reader's guide (`mkresearch.views.guide`): one map of the notebooks and one glossary, read
from the documentation pages the package installs, and everything else derived from them.

* The map (docs/notebooks.md) lists every notebook of notebooks/, in order, once; the README's
  table is the one `guide.readme_table` derives from it.
* The glossary (docs/glossary.md) parses into its entries; a term is found by any name its entry
  defines; an unknown term is a ValueError naming it.
* Every term a notebook asks the glossary for (`guide.glossary_view("KDA", ...)`) is in it.
* A table shows as HTML in a notebook and as `format_table`'s text elsewhere.
"""

import ast
import importlib.resources
import json
import re
from pathlib import Path

import pytest

from mkresearch.views import guide, widgets

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_the_installed_pages_are_the_repository_pages():
    for name in (guide.MAP_PAGE, guide.GLOSSARY_PAGE):
        installed = importlib.resources.files(guide.DOCS_PACKAGE) / name
        assert installed.read_text(encoding="utf-8") == (ROOT / "docs" / name).read_text(
            encoding="utf-8")


def test_the_map_lists_every_notebook_once_in_order():
    entries = guide.notebook_map()
    assert [e.stem for e in entries] == [p.stem for p in NOTEBOOKS]
    assert [e.number for e in entries] == [f"{i:02d}" for i in range(len(entries))]
    assert all(e.teaches and e.you_write for e in entries)


def test_the_readme_table_is_derived_from_the_map():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    expected = guide.readme_table()
    assert expected in readme, ("README.md's notebooks table is not the one docs/notebooks.md "
                                f"gives; paste this in its place:\n{expected}")
    assert readme.count("| notebook |") == 1


def test_the_map_refuses_other_columns():
    with pytest.raises(ValueError, match="columns"):
        guide.notebook_map("| notebook | what |\n|---|---|\n| 00_x | y |\n")


GLOSSARY_SAMPLE = """# Glossary

Intro text that is not an entry.

**HBM, VMEM, SMEM**: a TPU core's memories: large high-bandwidth memory,
the vector memory. docs/tpu.md §1.

**Correction bias (`noaux_tc`)**: a per-expert bias.

**bf(x)**: rounding to bf16.
"""


def test_glossary_entries_and_their_names():
    entries = guide.glossary(GLOSSARY_SAMPLE)
    assert [e.term for e in entries] == ["HBM, VMEM, SMEM", "Correction bias (`noaux_tc`)",
                                         "bf(x)"]
    assert entries[0].text == ("a TPU core's memories: large high-bandwidth memory, the vector "
                               "memory. docs/tpu.md §1.")
    assert entries[0].names == ("HBM, VMEM, SMEM", "HBM", "VMEM", "SMEM")
    assert entries[1].names == ("Correction bias (noaux_tc)", "Correction bias", "noaux_tc")
    assert "bf(x)" in entries[2].names


def test_lookup_by_any_name_once_each_and_refusing_unknown_terms():
    entries = guide.glossary(GLOSSARY_SAMPLE)
    found = guide.lookup("vmem", "HBM", "noaux_tc", entries=entries)
    assert [e.term for e in found] == ["HBM, VMEM, SMEM", "Correction bias (`noaux_tc`)"]
    with pytest.raises(ValueError, match=r"terms=\['warp', 'SM'\] are not in docs/glossary.md"):
        guide.lookup("HBM", "warp", "SM", entries=entries)


def test_the_real_glossary_parses_and_defines_what_the_notebooks_ask_for():
    entries = guide.glossary()
    assert len(entries) > 70 and all(e.text for e in entries)
    assert [e.term for e in guide.lookup("W_o", entries=entries)] == [
        "W_q, W_k, W_v, W_g, W_b, W_fa, W_fb, W_o", "W_qa, W_qb, W_kva, W_kvb, W_g, W_o"]
    asked = {term for notebook in NOTEBOOKS for term in glossary_terms(notebook)}
    assert len(asked) > 20  # the notebooks do ask (00 shows it whole)
    guide.lookup(*sorted(asked))  # ValueError naming the terms the glossary lacks


def glossary_terms(notebook: Path) -> set[str]:
    """The string arguments of every `glossary_view(...)` call in a notebook's code cells."""
    terms = set()
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        source = "\n".join(line for line in source.splitlines()
                           if not re.match(r"\s*(%|!(?!=))", line))  # magics, not a `!=` line
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)
                    and getattr(node.func, "attr", getattr(node.func, "id", "")) == "glossary_view"):
                terms |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return terms


# What a notebook's code writes -> the glossary term that explains it. A notebook that writes any
# of these shows the term's entry near its top (`guide.glossary_view(...)`, before its first
# section): the reader meets the words before the code.
PALLAS_TERMS = {
    r"\bpallas_call\(": "Ref",
    r"\.at\[": ".at[...]",
    r"\bpl\.ds\(": "pl.ds",
    r"\bpl\.multiple_of\(": "pl.multiple_of",
    r"\bpl\.when\(": "pl.when",
    r"\bBlockSpec\(": "BlockSpec",
    r"\bmemory_space=": "Memory space",
    r"\bscratch_shapes=|\bpl\.run_scoped\(": "scratch_shapes",
    r"memory_space=pltpu\.SMEM": "SMEM operand",
    r"\bPrefetchScalarGridSpec\(|\bnum_scalar_prefetch=": "Scalar prefetch",
    r"\bmake_async_copy\(": "make_async_copy",
    r"\bSemaphoreType\.DMA\b": "DMA semaphore",
    r"\bmake_async_remote_copy\(": "Remote copy",
    r"\bsemaphore_signal\(|\bget_barrier_semaphore\(": "Barrier semaphore",
    r"\bdimension_semantics=": "Dimension semantics",
    r"\braces_found\(": "Race detector",
    r"\blax\.fori_loop\(|\blax\.switch\(": "lax.fori_loop",
}


def code_and_headings(notebook: Path) -> tuple[str, list[tuple[int, str]]]:
    """A notebook's code (every code cell but the setup cell, joined) and its cells' kinds in
    order: ("heading", text) for a Markdown cell with a section heading, ("code", source)."""
    cells = json.loads(notebook.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells[1:] if c["cell_type"] == "code")
    return code, [(i, "".join(c["source"])) for i, c in enumerate(cells)]


def pallas_terms(code: str) -> set[str]:
    return {term for pattern, term in PALLAS_TERMS.items() if re.search(pattern, code)}


def test_the_pallas_terms_are_in_the_glossary():
    names = {name.casefold() for entry in guide.glossary() for name in entry.names}
    assert not {term.casefold() for term in PALLAS_TERMS.values()} - names
    assert "ring slot" in names and "batch slot" in names  # two different slots


@pytest.mark.parametrize("notebook", NOTEBOOKS[1:], ids=lambda p: p.stem)
def test_each_notebook_shows_the_entries_of_its_terms_near_its_top(notebook):
    """Notebook 00 shows the whole glossary; every later one shows, before its first section
    (`## ...`), the entries of the terms it uses, among them every Pallas term its code writes."""
    code, cells = code_and_headings(notebook)
    first_section = next(i for i, source in cells if source.lstrip().startswith("## "))
    top = [i for i, source in cells if i < first_section and "glossary_view(" in source]
    assert top, f"{notebook.stem}: no glossary_view(...) cell before its first section"
    shown = {name.casefold() for entry in guide.lookup(*glossary_terms(notebook))
             for name in entry.names}
    missing = sorted(t for t in pallas_terms(code) if t.casefold() not in shown)
    assert not missing, f"{notebook.stem} writes code of {missing} without showing their entries"


def test_views_show_html_and_text():
    view = guide.glossary_view("noaux_tc", entries=guide.glossary(GLOSSARY_SAMPLE))
    assert "<code>noaux_tc</code>" in view._repr_html_()
    assert str(view).splitlines()[1].startswith("Correction bias (`noaux_tc`)  a per-expert")
    folded = guide.glossary_view(entries=guide.glossary(GLOSSARY_SAMPLE), folded=True)
    assert folded._repr_html_().startswith(
        "<details><summary>the glossary: 3 entries (click to open)</summary><table")
    html_map = guide.map_view()._repr_html_()
    assert html_map.count("<tr>") == len(NOTEBOOKS) + 1
    assert "<code>make_async_copy</code>" in html_map and "09_predicting_the_release" in html_map


def test_table_view_escapes_and_keeps_numbers_on_one_line():
    rows = [{"name": "a<b", "µs": 1234.5678, "ratio": 0.123456}]
    view = widgets.TableView(rows, ["name", "µs", "ratio"])
    assert str(view) == widgets.format_table(rows, ["name", "µs", "ratio"])
    page = view._repr_html_()
    assert "a&lt;b" in page and ">1235<" in page and ">0.123<" in page
    assert "white-space:nowrap" in page
    assert "white-space:normal" in widgets.TableView(rows, ["name"], align="left")._repr_html_()
    with pytest.raises(ValueError, match="align='middle' is invalid"):
        widgets.TableView(rows, ["name"], align="middle")
