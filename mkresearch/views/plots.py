"""The figures drawn from the lower layers: the decode roofline (`mkresearch.model.roofline`), the
routed-expert bytes by batch and the MLA KV bytes by context (recorded DMA logs,
`mkresearch.measurement.logs`). `mkresearch.cli.figures` registers them; notebooks call them too.

matplotlib is imported inside each function: importing this module stays cheap.
"""

from __future__ import annotations

import numpy as np

from mkresearch.measurement.logs import (
    FIGURE_POSITIONS,
    expert_bytes_by_batch,
    record_kv_logs,
    tokens_read,
)
from mkresearch.model import roofline, weights
from mkresearch.model.config import MLA_CACHE_LAYOUTS, ModelConfig, get_config
from mkresearch.model.kv_cache import KV_ROW_GROUP, kv_bytes_per_token
from mkresearch.model.roofline import (
    PUBLISHED_TPU7X_16_CHIPS,
    ROOFLINE_BATCHES,
    ROOFLINE_CHIPS,
    ROOFLINE_CONTEXT,
    ROOFLINE_N_CHIPS,
    roofline_table,
    step_bytes,
)


def _save(fig, path, dpi: int = 120) -> None:
    """Write a figure drawn under the Agg backend and let it go."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def _agg():
    """pyplot under the Agg backend (a figure written to a file, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_roofline(path, cfg: ModelConfig | None = None, context: int = ROOFLINE_CONTEXT,
                  n_chips: int = ROOFLINE_N_CHIPS) -> None:
    """figures/roofline.png: `roofline_figure`."""
    _agg()
    _save(roofline_figure(cfg, context, n_chips), path)


def roofline_figure(cfg: ModelConfig | None = None, context: int = ROOFLINE_CONTEXT,
                    n_chips: int = ROOFLINE_N_CHIPS):
    """Floor tokens/s vs batch per chip, and step bytes by component (from shapes alone)."""
    import matplotlib.pyplot as plt

    cfg = cfg or get_config("kimi-k3")
    fig, (ax_rate, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in ROOFLINE_CHIPS:
        rows = roofline_table(cfg, (name,), ROOFLINE_BATCHES, context, n_chips=n_chips)
        ax_rate.plot([r["batch"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o",
                     label=f"{n_chips}× {name} floor")
    published = sorted(PUBLISHED_TPU7X_16_CHIPS.items())
    ax_rate.plot(*zip(*published), "k*", markersize=10, label="published, 16× TPU7x")
    ax_rate.set(xscale="log", yscale="log", xlabel="batch (sequences)", ylabel="tokens/s",
                title=f"{cfg.name} decode floor, context {context}, weights split evenly")
    ax_rate.set_xticks(ROOFLINE_BATCHES, [str(b) for b in ROOFLINE_BATCHES])
    ax_rate.grid(True, which="both", alpha=0.3)
    ax_rate.legend(fontsize=8)

    steps = [step_bytes(cfg, batch, context) for batch in ROOFLINE_BATCHES]
    bottom = np.zeros(len(steps))
    for name, label in steps[0].components.items():
        values = np.array([(s.read[name] + s.written.get(name, 0)) / 1e9 for s in steps])
        if values.max() < 0.005 * max(s.total for s in steps) / 1e9:
            continue  # too thin to see
        ax_bytes.bar(range(len(steps)), values, bottom=bottom, label=label)
        bottom += values
    ax_bytes.set_xticks(range(len(steps)), [str(b) for b in ROOFLINE_BATCHES])
    ax_bytes.set(xlabel="batch (sequences)", ylabel="GB per step (read + written)",
                 title=f"bytes per step by component ({cfg.expert_format} experts)")
    ax_bytes.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_expert_bytes(path, cfg: ModelConfig | None = None, batches=(1, 2, 4, 8, 16)) -> None:
    """figures/expert_bytes.png: `expert_bytes_figure` of the mini model's DMA logs."""
    _agg()
    cfg = cfg or get_config("kimi-k3-mini")
    _save(expert_bytes_figure(expert_bytes_by_batch(cfg, batches), cfg), path)


def expert_bytes_figure(rows, cfg: ModelConfig):
    """Routed-expert bytes per MoE layer vs batch (rows of `logs.expert_bytes_by_batch`), against
    fetching every (row, k) choice and fetching all experts, and the uniform-routing estimate.
    The estimate is a wide pale band under the measured line: where they agree both show."""
    import matplotlib.pyplot as plt

    one = weights.expert_nbytes(cfg)
    b = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.8), layout="constrained")
    ax.plot(b, [roofline.expected_unique_experts(cfg.n_experts, cfg.top_k, x) * one / 1e6
                for x in b], "-", color="0.6", lw=7, alpha=0.45, solid_capstyle="round",
            label="uniform-routing estimate", zorder=1)
    ax.plot(b, [r["expert_bytes"] / 1e6 for r in rows], "o-", zorder=3,
            label="unique experts (DMA log)")
    ax.plot(b, [r["choices"] * one / 1e6 for r in rows], "s--", zorder=2,
            label="every (row, k) choice")
    ax.plot(b, [cfg.n_experts * one / 1e6] * len(b), ":", zorder=2,
            label=f"all {cfg.n_experts} experts")
    ax.set_xscale("log", base=2)
    ax.set_xticks(b, [str(x) for x in b])
    ax.minorticks_off()
    ax.set_xlabel("batch B")
    ax.set_ylabel("expert MB per MoE layer")
    ax.set_title(f"{cfg.name}: routed-expert bytes per layer ({cfg.expert_format}, "
                 f"top-{cfg.top_k} of {cfg.n_experts})", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def plot_kv_bytes(path=None, logs: dict | None = None, recorded: ModelConfig | None = None,
                  positions=FIGURE_POSITIONS):
    """KV bytes read per MLA layer per step against context, both layouts, at Kimi K3 shapes.

    Dots: the tokens each row of a recorded mini run read (from its DMA log), priced at Kimi K3's
    bytes per token. Solid lines: the rule ⌈p / 16⌉ · 16 tokens (16-row HBM tiles) out to 32768;
    dashed: whole KV tiles of Kimi K3's 256 tokens, what reading the last tile whole would cost.
    """
    if path is not None:
        _agg()
    recorded = recorded or get_config("kimi-k3-mini")
    logs = logs or record_kv_logs(recorded, positions)
    tokens = {layout: [(positions[r], tokens_read(logs[layout],
                                                  recorded.replace(mla_cache_layout=layout), r))
                       for r in range(len(positions))] for layout in MLA_CACHE_LAYOUTS}
    fig = kv_bytes_figure(tokens)
    if path is not None:
        _save(fig, path)
    return fig


def kv_bytes_figure(tokens: dict):
    """`plot_kv_bytes` drawn from `tokens`: layout -> [(position, tokens read)] of a recorded
    run (position 0 reads nothing and is left out of the log axes)."""
    import matplotlib.pyplot as plt

    full = get_config("kimi-k3")
    context = np.unique(np.geomspace(1, full.max_seq_len, 400).astype(int))
    fig, ax = plt.subplots(figsize=(7, 4))
    for layout, color in zip(MLA_CACHE_LAYOUTS, ("tab:red", "tab:blue")):
        per_token = kv_bytes_per_token(full.replace(mla_cache_layout=layout))
        # the rule read is a wide pale band, whole tiles a thin dashed line over it: past a few
        # tiles the two meet, and both stay visible
        for tile, style, rule in ((KV_ROW_GROUP, {"ls": "-", "lw": 3.5, "alpha": 0.35},
                                   "16-row groups (read)"),
                                  (full.kv_tile, {"ls": "--", "lw": 1},
                                   f"whole tiles of {full.kv_tile}")):
            ax.plot(context, -(-context // tile) * tile * per_token, color=color, **style,
                    label=f"{layout}: {per_token:,} B/token, {rule}")
        xs, ys = zip(*[(pos, n * per_token) for pos, n in tokens[layout] if pos > 0])
        ax.scatter(xs, ys, color=color, zorder=3, s=18,
                   label=f"{layout}: DMA log of a mini run, priced at Kimi K3")
    ax.set(xscale="log", yscale="log", xlabel="context (cached tokens)",
           ylabel="KV bytes read per MLA layer per step",
           title="MLA KV traffic at Kimi K3 shapes (96 heads): latent reads 64x less")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
