"""Pictures of a served workload (`serve.workload.run_workload`'s data): which request owned each
KV page at each step, and how full the slots and the pool were. Thin over the data: the matrix
and the series come straight from its "steps"."""

from __future__ import annotations

import numpy as np

FREE_COLOR = "#F2F2F2"


def owner_matrix(data: dict) -> np.ndarray:
    """[n_steps, n_pages] int: the request owning each page during each decode step (-1 free)."""
    return np.asarray([step["page_owner"] for step in data["steps"]], np.int64)


def occupancy_series(data: dict) -> dict[str, list]:
    """Per step: the step index, slots occupied, pages held and pages holding tokens."""
    steps = data["steps"]
    return {"step": [s["step"] for s in steps], "slots": [s["occupied"] for s in steps],
            "pages_held": [s["pages_held"] for s in steps],
            "pages_filled": [s["pages_filled"] for s in steps]}


def plot_page_table(data: dict, ax) -> None:
    """Pages (rows) over decode steps (columns), each cell coloured by the request owning it and
    labelled with its index at the start of each holding; free pages pale."""
    from matplotlib.colors import ListedColormap

    owners = owner_matrix(data).T  # [n_pages, n_steps]
    n_requests = len(data["requests"])
    palette = [FREE_COLOR] + [f"C{i % 10}" for i in range(n_requests)]
    steps = [s["step"] for s in data["steps"]]
    ax.imshow(owners + 1, cmap=ListedColormap(palette), vmin=0, vmax=n_requests, aspect="auto",
              interpolation="nearest", origin="lower")
    for page, row in enumerate(owners):
        for column, owner in enumerate(row):
            if owner >= 0 and (column == 0 or row[column - 1] != owner):
                ax.text(column, page, str(owner), ha="center", va="center", fontsize=8)
    ticks = range(0, len(steps), max(1, len(steps) // 10))
    ax.set_xticks(list(ticks), [str(steps[i]) for i in ticks])
    ax.set_yticks(range(owners.shape[0]))
    ax.set_xlabel("decode step")
    ax.set_ylabel("KV page")
    ax.set_title("the page table: which request owns each page (number: request, pale: free)")


def plot_occupancy(data: dict, ax) -> None:
    """Slots occupied and pages held / holding tokens per step, against the batch and the pool."""
    series = occupancy_series(data)
    ax.step(series["step"], series["slots"], where="mid", label="slots occupied")
    ax.step(series["step"], series["pages_held"], where="mid", label="pages held")
    ax.step(series["step"], series["pages_filled"], where="mid", linestyle="--",
            label="pages holding tokens")
    ax.axhline(data["batch"], color="C0", linestyle=":", label=f"slots ({data['batch']})")
    ax.axhline(data["pages"]["n_pages"], color="C1", linestyle=":",
               label=f"pages in the pool ({data['pages']['n_pages']})")
    ax.set_xlabel("decode step")
    ax.set_ylabel("count")
    ax.set_ylim(0, max(data["batch"], data["pages"]["n_pages"]) + 1)
    ax.set_title("occupancy per step")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
