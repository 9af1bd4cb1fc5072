# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %%
# Setup: works on Colab, on a TPU VM and on a laptop. Installs mkresearch if it is missing, and
# only what this runtime lacks: mkresearch[plots] (the library with JAX; matplotlib and ipywidgets 8
# unless here; on a TPU also the tpu extra), never Jupyter, ipykernel or a notebook server, which a
# hosted runtime brings and depends on. The runtime's own jax and numpy stay if recent enough.
# From this checkout, else the git URL in MKRESEARCH_REPO. If the install replaces a package this
# kernel has imported, the kernel must restart: on Colab this cell restarts it, elsewhere it stops
# and says so; then run the notebook again.
import glob
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import subprocess
import sys


class _SetupStop(Exception):  # ends the cell with one line instead of a traceback
    def _render_traceback_(self):
        return [f"setup: {self}"]


def _versions():
    return {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version
            for d in importlib.metadata.distributions()}


_had = _versions()
_lacking = [name for name in ("mkresearch", "matplotlib") if importlib.util.find_spec(name) is None]
if int(_had.get("ipywidgets", "0").split(".")[0]) < 8:  # the explorers' controls are ipywidgets 8
    _lacking.append("ipywidgets 8")
if _lacking:
    _root = pathlib.Path("..").resolve()
    _local = (_root / "pyproject.toml").is_file() and \
        'name = "mkresearch"' in (_root / "pyproject.toml").read_text()
    _repo = os.environ.get("MKRESEARCH_REPO", "https://github.com/mkresearch/mkresearch")
    _extras = "plots,tpu" if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") else "plots"
    _source = _root.as_uri() if _local else f"git+{_repo}"
    _pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                           f"mkresearch[{_extras}] @ {_source}"],
                          capture_output=True, text=True, check=False)
    if _pip.returncode:
        _errors = [line for line in _pip.stderr.splitlines() if line.startswith("ERROR")]
        raise _SetupStop(f"pip could not install mkresearch[{_extras}]: "
                         f"{(_errors or _pip.stderr.splitlines() or ['no message'])[0]}")
    importlib.invalidate_caches()
    _now = _versions()
    _new = [f"{name} {version}" for name, version in sorted(_now.items()) if name not in _had]
    _replaced = {name: f"{name} {_had[name]} -> {version}" for name, version in sorted(_now.items())
                 if _had.get(name, version) != version}
    for _name in _replaced:  # why: the floor mkresearch (or its tpu extra) asks of it
        _asks = [r.split(";")[0].replace(" ", "") for r in importlib.metadata.requires("mkresearch")
                 or () if re.match(rf"{_name}(\[[^]]*\])?\s*[<>=!~]",
                                   re.sub(r"[-_.]+", "-", r), re.I)]
        _replaced[_name] += f" (mkresearch asks {' and '.join(_asks)})" if _asks else ""
    _kept = [f"{name} {_had[name]}" for name in ("jax", "numpy") if name in _had and name in _now
             and name not in _replaced]
    print(f"setup: {', '.join(_lacking)} lacking; installed from "
          f"{'this checkout' if _local else _repo}: {', '.join(_new) or 'nothing new'}"
          + (f"; replaced {', '.join(_replaced.values())}" if _replaced else "")
          + (f"; kept this runtime's {', '.join(_kept)}" if _kept else ""))
    _imported = {re.sub(r"[-_.]+", "-", dist).lower() for module, dists
                 in importlib.metadata.packages_distributions().items()
                 if module in sys.modules for dist in dists}
    _stale = [_replaced[name] for name in _replaced if name in _imported]
    if _stale:  # only a new kernel imports the new versions
        _colab = "google.colab" in sys.modules
        if _colab:  # Colab brings a kernel that shut down this way back by itself
            import IPython

            IPython.Application.instance().kernel.do_shutdown(True)
        raise _SetupStop(f"{', '.join(_stale)} replaced a package this kernel had imported: "
                         f"{'restarting' if _colab else 'restart'} the kernel, then run the "
                         "notebook again")
else:
    print("setup: nothing to install (mkresearch, matplotlib and ipywidgets are here)")
if "google.colab" in sys.modules:  # Colab draws ipywidgets 8 through its custom widget manager
    from google.colab import output as _colab_output
    _colab_output.enable_custom_widget_manager()
import mkresearch  # sets JAX_PLATFORMS=cpu when this machine has no TPU
from mkresearch.hardware import tpu

print(tpu.describe_backend())  # compiled on a TPU, TPU interpret mode elsewhere

# %% [markdown]
# # 13 · Serving: a paged KV cache, rows joining and leaving between steps
#
# A batch that starts and ends together wastes the slots of rows that finished early and sizes
# every cache for the longest row. A serving engine keeps the cache in **pages** of P tokens
# with a **page table** per row, and runs **continuous batching**: before each decode step the
# requests that have arrived join (a slot empty, the pages of their cache free), are prefilled
# alone, and then share every step with the rows already running, whatever their lengths; a row
# leaves at its output length and its slot and pages go to the next request.
#
# `mkresearch.serve` does this over the paged decode step (`mkresearch.model.paged_kv`, the
# reference here; `step="megakernel"` runs the paged megakernel, one `pallas_call` per step).
#
# 1. a small arrival trace served with paged caches: the table of every step;
# 2. the page table (who owns which page, over time) and the occupancy;
# 3. batch invariance: every row's tokens equal the row decoded alone;
# 4. freed pages reused without leaking: they are poisoned when freed and nothing reads them.
#
# The terms this notebook uses, from the glossary (notebook 00 shows all of it):

# %%
from mkresearch.views import guide

guide.glossary_view("Paged KV, page table", "Continuous batching", "Slot", "Occupancy",
                    "Prefill", "Poison", "Batch invariance", "KDA", "MLA", "Megakernel",
                    "Reference", "Modelled", "Full-size step")

# %%
import matplotlib.pyplot as plt
from mkresearch.cli.workload import total_lines
from mkresearch.model import paged_kv, weights
from mkresearch.model.config import get_config
from mkresearch.serve import loop, trace, workload
from mkresearch.views import serve_plots
from mkresearch.views.label_plots import label_problems
from mkresearch.views.widgets import TableView, show_figure

# kimi-k3-mini cut to its first 2 layers (a KDA + dense layer, an MLA + MoE layer): every kind
# of state a slot and a page hold, in two cheap compiles (the prefill and the paged step)
cfg = get_config("kimi-k3-mini").replace(name="kimi-k3-mini-2l", n_layers=2, mla_first=1,
                                         attn_res_block=1)
params = weights.init_params(cfg, 0)
# 6 pages of 16 tokens, tables of 2 pages (rows of up to 32 tokens), 3 slots
pages = paged_kv.PagedKVConfig(page_size=16, n_pages=6, max_pages_per_row=2)
BATCH = 3

# %% [markdown]
# ## 1 · A trace, served
#
# Six requests: prompt and output lengths, the decode step they arrive at, one sampled at
# temperature 1 (its own counter seed). The same JSON `mkresearch bench --workload FILE` reads.
# A request takes, when it joins, every page its cache will need (prompt + output - 1 tokens), so
# a running row never waits mid-decode; one that does not fit the free pages waits, and so do
# the ones behind it. Freed pages are filled with a poison value (`poison_freed`) before the next
# request may take them.

# %%
TRACE_JSON = """{"requests": [
  {"prompt_len": 6, "output_len": 14, "arrival": 0},
  {"prompt_len": 6, "output_len": 4, "arrival": 0},
  {"prompt_len": 6, "output_len": 12, "arrival": 1, "temperature": 1.0},
  {"prompt_len": 20, "output_len": 6, "arrival": 2},
  {"prompt_len": 6, "output_len": 5, "arrival": 4},
  {"prompt_len": 12, "output_len": 6, "arrival": 5}]}"""
requests = trace.parse_trace(TRACE_JSON)
data = workload.run_workload(params, requests, cfg, pages, batch=BATCH, full_size="kimi-k3",
                             poison_freed=True, progress=True)
print("\n".join(total_lines(data["summary"])))  # seconds here vary: not a checked output
TableView([{"step": s["step"], "slots": f"{s['occupied']}/{BATCH}",
            "pages held": f"{s['pages_held']}/{pages.n_pages}", "filled": s["pages_filled"],
            "joined": ",".join(map(str, s["joined"])) or "-",
            "left": ",".join(map(str, s["left"])) or "-", "s here": s["seconds"],
            "modelled TPU ms": "-" if s["predicted_step_s"] is None
            else f"{s['predicted_step_s'] * 1e3:.2f}"} for s in data["steps"]],
          ["step", "slots", "pages held", "filled", "joined", "left", "s here",
           "modelled TPU ms"])

# %%
# NBVAL_CHECK_OUTPUT
# Checks · each request's life in the trace: when it joined, its slot and pages, its tokens;
# someone waited for a slot
for row in data["requests"]:
    print(f"request {row['index']}: arrived {row['arrival']}, joined {row['joined']} (waited "
          f"{row['wait']}), left after step {row['left']}, slot {row['slot']}, pages "
          f"{row['pages']}, {len(row['tokens'])} tokens")
summary = data["summary"]
print(f"{summary['decode_steps']} steps; mean occupancy: slots "
      f"{summary['mean_slot_occupancy']:.0%}, pages {summary['mean_page_occupancy']:.0%}")
assert [len(row["tokens"]) for row in data["requests"]] == [r.output_len for r in requests]
assert any(row["wait"] > 0 for row in data["requests"])  # the batch was full: someone waited

# %% [markdown]
# ## 2 · The page table and the occupancy over time
#
# Each column is a decode step, each row a page of the pool, coloured by the request that owns it
# (its index where its holding starts). A finished request's pages are the next one's: the
# lowest free page is taken first.

# %%
fig, (table_ax, occupancy_ax) = plt.subplots(2, 1, figsize=(10, 6.5), layout="constrained")
serve_plots.plot_page_table(data, table_ax)
serve_plots.plot_occupancy(data, occupancy_ax)
pages_figure = fig
show_figure(fig)  # described: an HTML export gives the picture its title

# %% [markdown]
# The predicted TPU step of the full model at each step's occupancy (`full_size.full_size_step`,
# the one full-size prediction: Kimi K3 on 32 TPU7x ranks at the batch of occupied slots and the
# rows' mean context in whole pages): a step with more rows costs more, but less than one step
# per row.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · a modelled step with more rows costs more, but less than a step per row; the page
# table's labels read
assert not label_problems(pages_figure)  # no label runs into another, none is cut
by_batch = {}
for step in data["steps"]:
    by_batch.setdefault(step["occupied"], set()).add(round(step["predicted_step_s"] * 1e3, 2))
for occupied, steps_ms in sorted(by_batch.items()):
    print(f"{occupied} rows: modelled {sorted(steps_ms)} ms per step (not measured)")
print(f"the trace's {summary['decode_steps']} steps: {summary['predicted_seconds'] * 1e3:.1f} ms "
      f"modelled, {summary['predicted_tokens_per_s']:,.0f} tokens/s")
smallest, largest = min(by_batch), max(by_batch)
assert largest > smallest and min(by_batch[largest]) > max(by_batch[smallest])  # more rows: more
assert max(by_batch[largest]) < largest / smallest * min(by_batch[smallest])  # < a step per row

# %% [markdown]
# ## 3 · Batch invariance: each row as if it were alone
#
# Every request served again by itself (arriving at step 0, in slot 0, on the lowest pages of a
# fresh pool): its tokens must be the same bits. The decode step is batch-invariant, the prefill
# sees the row alone, and each row draws with its own seed and positions, never its slot.

# %%
def alone(request):
    single = trace.Request(request.index, request.prompt_len, request.output_len, 0,
                           request.temperature, request.seed)
    return loop.serve(params, [single], cfg, pages, batch=BATCH).tokens[request.index]


equal = [row["tokens"] == alone(r) for row, r in zip(data["requests"], requests, strict=True)]
joined_late = [row["index"] for row in data["requests"] if row["joined"] > 0]

# %%
# NBVAL_CHECK_OUTPUT
# Checks · every row's tokens are the row's decoded alone, those that joined late included
print(f"rows equal to the row decoded alone: {sum(equal)}/{len(equal)} (joined a running batch "
      f"at step > 0: requests {joined_late})")
assert all(equal) and joined_late

# %% [markdown]
# ## 4 · Freed pages are reused, and nothing leaks
#
# A page held by two requests over the trace was freed by the first (and filled with the poison
# value), then taken by the second. The second still decodes exactly as alone (section 3, where
# its pages were fresh zeros): the paged step reads a row's pages only below its length, and a
# row writes each position before any step reads it.

# %%
holders = {}
for step in data["steps"]:
    for page, owner in enumerate(step["page_owner"]):
        if owner >= 0 and owner not in holders.setdefault(page, []):
            holders[page].append(owner)
reused = {page: owners for page, owners in sorted(holders.items()) if len(owners) > 1}

# %%
# NBVAL_CHECK_OUTPUT
# Checks · freed pages were taken again, and their new holders decode as alone
print(f"pages held by more than one request, in order: {reused}")
print(f"poison value written into each freed page: {loop.POISON}")
assert reused and all(equal)
