"""Figures of a sharded step (notebook 08): every rank's timeline with its collectives.

`rank_timelines(log, chip)` runs the timeline model on each rank's events of one recorded sharded
step (`timeline_ranks.rank_events`: one device's model, what a rank receives taken as ready, its remote
copies priced as DMAs); `plot_rank_timelines` draws them one lane per rank: compute, the rank's
HBM DMAs, and its remote copies coloured by collective (the suffix of the DMA name:
all_gather, reduce_scatter, chain, ...).
"""

from __future__ import annotations

from typing import Any

from mkresearch.kernels.base import dma
from mkresearch.prediction import timeline
from mkresearch.prediction.timeline_ranks import rank_events
from mkresearch.views.timeline_plots import modelled

COLLECTIVE_COLORS = {"all_gather": "tab:red", "reduce_scatter": "tab:purple",
                     "chain": "tab:orange"}
OTHER_COLLECTIVE = "tab:brown"


def collective_of(name: str) -> str:
    """The collective a remote copy's DMA name belongs to ('mla.w_o/all_gather' -> 'all_gather')."""
    return name.rsplit("/", 1)[-1]


def rank_timelines(log: dma.DmaLog, chip: str = "tpu7x") -> dict[int, Any]:
    """rank -> timeline.Timeline of that rank's events (`rank_events`)."""
    return {rank: timeline.simulate(rank_events(log, rank), chip) for rank in log.ranks}


def remote_names(log: dma.DmaLog, rank: int) -> set[str]:
    """Names of the remote copies a rank starts (to tell them from its HBM DMAs on the plot)."""
    return {e.name for e in log.of_rank(rank).select("dma_start") if e.remote}


def plot_rank_timelines(log: dma.DmaLog, timelines: dict[int, Any], title: str = "",
                        ax: Any = None) -> Any:
    """One row per rank, time in µs: compute (blue), HBM DMAs (grey), remote copies by collective,
    titled as modelled. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 0.55 * len(timelines) + 1.6))
    else:
        fig = ax.figure
    seen = set()
    for row, (rank, tl) in enumerate(sorted(timelines.items())):
        remote = remote_names(log, rank)
        lanes = {"compute": [], "hbm": [], **{c: [] for c in COLLECTIVE_COLORS}, "other": []}
        for span in tl.spans:
            interval = (span.start * 1e6, max(span.duration * 1e6, 1e-3))
            if span.kind == "compute":
                lanes["compute"].append(interval)
            elif span.name in remote:
                collective = collective_of(span.name)
                lanes[collective if collective in COLLECTIVE_COLORS else "other"].append(interval)
            else:
                lanes["hbm"].append(interval)
        y = len(timelines) - 1 - row
        ax.broken_barh(lanes["hbm"], (y - 0.4, 0.25), color="0.65")
        ax.broken_barh(lanes["compute"], (y - 0.12, 0.25), color="tab:blue")
        for collective, color in (*COLLECTIVE_COLORS.items(), ("other", OTHER_COLLECTIVE)):
            if lanes[collective]:
                ax.broken_barh(lanes[collective], (y + 0.16, 0.25), color=color)
                seen.add(collective)
    ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in sorted(timelines, reverse=True)])
    ax.set_xlabel("µs from the start of the step (timeline model, one rank at a time)")
    ax.set_title(modelled(title or "every rank's step"))
    handles = [Patch(color="tab:blue", label="compute"), Patch(color="0.65", label="HBM DMA")]
    handles += [Patch(color=COLLECTIVE_COLORS.get(c, OTHER_COLLECTIVE), label=f"remote: {c}")
                for c in (*COLLECTIVE_COLORS, "other") if c in seen]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    return fig
