"""Pictures of speculative decoding: predicted tok/s against the acceptance length
(`speculative_predict.acceptance_curve`), beside the published points."""

from __future__ import annotations

from collections.abc import Sequence

from mkresearch.views.timeline_plots import modelled

SERIES = {"k7_tokens_per_s": ("7 drafts always (8 verify rows)", "#4C72B0"),
          "exact_tokens_per_s": ("drafts = acceptance - 1 (fewest verify rows)", "#55A868")}


def curve_rows(points: Sequence[dict]) -> list[dict]:
    """One row per (series, acceptance): tok/s, and the published tok/s where there is one."""
    return [{"series": key, "acceptance": p["acceptance"], "tokens_per_s": p[key],
             "published_tok_s": p["published_tok_s"]} for key in SERIES for p in points]


def plot_acceptance(points: Sequence[dict], ax, *, plain_tok_s: float | None = None,
                    title: str = "") -> None:
    """tok/s against acceptance length for both draft policies (predicted: the title says so),
    the published points as stars and the plain decode step as a dashed line."""
    rows = curve_rows(points)
    for key, (label, color) in SERIES.items():
        mine = [r for r in rows if r["series"] == key]
        ax.plot([r["acceptance"] for r in mine], [r["tokens_per_s"] for r in mine], "o-",
                color=color, label=label)
    published = [p for p in points if p["published_tok_s"]]
    if published:
        ax.plot([p["acceptance"] for p in published], [p["published_tok_s"] for p in published],
                "*", color="#C44E52", markersize=14, label="published (the release)")
    if plain_tok_s:
        ax.axhline(plain_tok_s, color="#8C8C8C", linestyle="--", label="plain decoding")
    ax.set_xlabel("acceptance length (tokens per verify step)")
    ax.set_ylabel("tok/s")
    ax.set_title(modelled(title or "tok/s against acceptance length"))
    ax.legend(fontsize=8)
