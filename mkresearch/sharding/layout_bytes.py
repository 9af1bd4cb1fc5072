"""Per-rank HBM bytes of one decode step under a layout (`mkresearch.sharding.layout`), sharded vs replicated.

`rank_bytes(layout, batch, context)` counts, by roofline component (`spec.components`, the same
names `roofline.step_bytes` and `mkresearch info` use), what one rank reads and writes in one
step, from the per-rank shapes of the layout; `compare(cfg, n_ranks, ...)` puts ours beside the
release's with each chip's per-rank floor (what `mkresearch info MODEL --ranks N` prints).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from mkresearch.hardware.chips import CHIPS, get_chip
from mkresearch.model import roofline, spec
from mkresearch.model.config import ModelConfig
from mkresearch.sharding import layout_split
from mkresearch.sharding.layout import (
    LAYOUTS,
    PARTIAL_SUM,
    Layout,
    active_shard,
    count_format,
    is_param,
    layout,
    leaves_with_path,
    local_shape,
    param_shard,
    rank_params,
    storage,
)


# ---- per-rank bytes of one step --------------------------------------------------------------
@dataclass(frozen=True)
class RankBytes:
    """HBM bytes one rank reads and writes in one decode step, by roofline component
    (`spec.components`), split into the bytes of sharded leaves (each rank its slice) and of
    replicated ones (every rank the whole leaf)."""

    layout: str
    model: str
    n_ranks: int
    batch: int
    context: int
    sharded: dict
    replicated: dict
    components: dict  # name -> label, display order
    state_components: tuple[str, ...]

    def component(self, name: str) -> int:
        return self.sharded.get(name, 0) + self.replicated.get(name, 0)

    @property
    def weights(self) -> int:
        """Weight bytes (states and caches left out): the release's '≈ 6.97 GB per rank'."""
        return sum(self.component(n) for n in self.components if n not in self.state_components)

    @property
    def replicated_weights(self) -> int:
        return sum(v for n, v in self.replicated.items() if n not in self.state_components)

    @property
    def total(self) -> int:
        return sum(self.component(n) for n in self.components)

    def floor_s(self, chip: Any) -> float:
        """The rank's HBM floor: its bytes over one device's bandwidth (a rank is one device)."""
        return self.total / get_chip(chip).hbm_bandwidth


def _bytes(struct_tree: Any) -> int:
    return roofline.tree_bytes(struct_tree)


def rank_bytes(lay: Layout, batch: int = 1, context: int = 0,
               collectives: str = "exact", rank: int | None = None,
               sequences: int | None = None) -> RankBytes:
    """One rank's bytes of one step (see `roofline.step_bytes` for what a step reads): weights
    once, the routed experts of its expert group (the expected share of the batch's distinct
    experts, `roofline.expected_unique_experts` / EP, each its ETP slice), one embedding row per
    sequence (the owner's), its states and caches (read at `context` tokens, written once).
    collectives "partial-sum": the shapes the partial-sum kernel streams
    (`layout_split.partial_sum_shape`: the same count as for a partial-sum layout). rank: that
    rank's bytes, where partial-sum mode skips the slices that are only padding
    (`layout_split.zero_only`); None: the most any rank reads (the lowest such rank's bytes;
    exact mode: every rank's, each streaming all its slices). sequences (default batch): the
    sequences the rows belong to (a verify step: one sequence's rows), whose states and cached
    tokens are read once per sequence and written once per row."""
    if collectives not in ("exact", "partial-sum"):
        raise ValueError(f"collectives={collectives!r} is invalid: exact or partial-sum")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                             or not 0 <= rank < lay.n_ranks):
        raise ValueError(f"rank={rank!r} is invalid: None or an int in [0, {lay.n_ranks})")
    skips = PARTIAL_SUM in (collectives, lay.collectives)
    if rank is None and skips:  # the first of the most (ties: the lowest rank), each a copy
        most = _busiest_rank(lay, batch, context, collectives, sequences)
        return dataclasses.replace(most, sharded=dict(most.sharded),
                                   replicated=dict(most.replicated))
    cfg = lay.cfg
    tally = _Tally(lay)
    _weights(tally, lay, batch, collectives, rank if skips else None)
    states = _states(tally, lay, batch, context, batch if sequences is None else sequences)
    return RankBytes(layout=lay.name, model=cfg.name, n_ranks=lay.n_ranks, batch=batch,
                     context=context, sharded=tally.sharded, replicated=tally.replicated,
                     components=dict(spec.components(cfg)), state_components=tuple(states))


class _Tally:
    """A rank's bytes by component, sharded or replicated (by the leaf's rule in the layout)."""

    def __init__(self, lay: Layout) -> None:
        self.lay = lay
        self.sharded: dict[str, int] = {}
        self.replicated: dict[str, int] = {}

    def add(self, component: str, leaf: Any, value: float) -> None:
        # the router's split as the layout places it (`layout.place_router`: replicated, whole)
        shard = param_shard(self.lay, leaf) if getattr(leaf, "router", False) else leaf.shard
        target = self.sharded if active_shard(self.lay, shard, leaf.shape) else self.replicated
        target[component] = target.get(component, 0) + int(value)


def _weights(tally: _Tally, lay: Layout, batch: int, collectives: str,
             skipping: int | None) -> None:
    """Every weight once, the routed experts the expected share of the batch's (skipping: the
    rank whose padding-only slices are skipped, partial-sum mode)."""
    cfg = lay.cfg
    table = spec.param_table(cfg)
    local = rank_params(lay) if collectives == "exact" else jax.tree.map(
        lambda p: dataclasses.replace(p, shape=layout_split.partial_sum_shape(lay, p)), table,
        is_leaf=is_param)
    kinds = spec.stages_of(cfg)
    unique = roofline.expected_unique_experts(cfg.n_experts, cfg.top_k, batch)
    for kind in kinds:
        for key, sub in table[kind.name].items():
            pairs = zip(leaves_with_path(sub), jax.tree.leaves(local[kind.name][key],
                                                                is_leaf=is_param))
            for (path, param), mine in pairs:
                stored = _bytes(storage(cfg, mine, count_format(lay, path)))
                if key in kind.routed:  # the expected experts of this rank's expert group
                    # [layers, local experts, ...]: unique / EP of the group's experts per layer
                    tally.add(kind.routed_component[0], param,
                              stored / mine.shape[1] * unique / lay.ep)
                elif kind.component is not None:
                    skipped = skipping is not None and layout_split.zero_only(lay, param, skipping)
                    tally.add(kind.component[0], param, 0 if skipped else stored)
    tally.add("lm_head", table["lm_head"], _bytes(storage(cfg, local["lm_head"])))
    embed = local["embed"]
    tally.add("embedding_rows", table["embed"],
              batch * embed.shape[1] * np.dtype(embed.dtype).itemsize)
    trunk = {"embed", "lm_head", *(kind.name for kind in kinds)}
    for key in table:
        if key not in trunk:
            tally.add("norms_and_mix", table[key], _bytes(storage(cfg, local[key])))


def _states(tally: _Tally, lay: Layout, batch: int, context: int, sequences: int) -> list[str]:
    """The states and caches (read once per sequence, a cache at `context` tokens; written once
    per row) -> their components."""
    states = []
    for kind in spec.stages_of(lay.cfg):
        if kind.state_component is None:
            continue
        name = kind.state_component[0]
        states.append(name)
        for leaf in spec.state_table(lay.cfg, 1, 1).get(kind.name, {}).values():
            shape = local_shape(lay, leaf.shape, leaf.shard)
            one = math.prod(shape) * np.dtype(leaf.dtype).itemsize  # one row, one token if cache
            read = sequences * (context * one if leaf.kind == spec.CACHE else one)
            moved = read + batch * (2 * one if leaf.kind == spec.CACHE else one)
            tally.add(name, leaf, moved)
    return states


@functools.lru_cache(maxsize=256)
def _busiest_rank(lay: Layout, batch: int, context: int, collectives: str,
                  sequences: int | None = None) -> RankBytes:
    """`rank_bytes` of the rank that reads the most (computed once per layout and batch: every
    prediction asks for it)."""
    return max((rank_bytes(lay, batch, context, collectives, r, sequences)
                for r in range(lay.n_ranks)),
               key=lambda counted: counted.total)


def compare(cfg: ModelConfig, n_ranks: int, batch: int = 1, context: int = 0) -> dict:
    """Per-rank bytes of one step under every layout (LAYOUTS: ours first, the release's) with
    each chip's per-rank floor: a JSON-able report. Ours in the shapes our sharded megakernel
    streams by default (partial sums: W_o, W_down, the experts' W2 split by rows), as the
    full-size step counts them (`prediction.full_size`)."""
    report = {"model": cfg.name, "n_ranks": n_ranks, "batch": batch, "context": context,
              "layouts": {}}
    for name in LAYOUTS:
        lay = layout(cfg, n_ranks, name, collectives="partial-sum" if name == LAYOUTS[0]
                     else "exact")
        counted = rank_bytes(lay, batch, context)
        report["layouts"][name] = {
            "describe": lay.describe(), "expert_format": lay.expert_format,
            "components": counted.components,
            "sharded": counted.sharded, "replicated": counted.replicated,
            "weights": counted.weights, "replicated_weights": counted.replicated_weights,
            "total": counted.total,
            "floor_ms": {chip: counted.floor_s(chip) * 1e3 for chip in CHIPS}}
    ours, release = (report["layouts"][name]["weights"] for name in LAYOUTS)
    report["ours_saves_bytes"] = release - ours
    report["ours_saves_fraction"] = (release - ours) / release if release else 0.0
    return report


def _gb(n: float) -> str:
    return f"{n / 1e9:8.3f} GB"


def format_table(report: dict) -> str:
    """The per-rank byte table of `compare`: each component's sharded and replicated bytes under
    ours, beside the release's, then the totals and each chip's per-rank floor."""
    ours, release = (report["layouts"][name] for name in LAYOUTS)
    lines = [(f"{report['model']} on {report['n_ranks']} ranks, per rank and step (batch "
             f"{report['batch']}, context {report['context']}):"),
             f"  {ours['describe']}", f"  {release['describe']}",
             (f"  experts counted in: ours {ours['expert_format']}, release "
             f"{release['expert_format']} (FP8 gate/up + MXFP4 down, docs/kimi-k3.md §7)"),
             (f"  {'component':42s} {'ours sharded':>13} {'replicated':>12} {'ours total':>12} "
             f"{'release':>12}")]
    for name, label in ours["components"].items():
        sharded, whole = ours["sharded"].get(name, 0), ours["replicated"].get(name, 0)
        theirs = release["sharded"].get(name, 0) + release["replicated"].get(name, 0)
        lines.append(f"  {label:42s} {_gb(sharded):>13} {_gb(whole):>12} "
                     f"{_gb(sharded + whole):>12} {_gb(theirs):>12}")
    lines.append(f"  {'weights (states left out)':42s} {'':>13} "
                 f"{_gb(ours['replicated_weights']):>12} {_gb(ours['weights']):>12} "
                 f"{_gb(release['weights']):>12}")
    lines.append(f"  {'total read + written':42s} {'':>13} {'':>12} {_gb(ours['total']):>12} "
                 f"{_gb(release['total']):>12}")
    lines.append(f"ours reads {report['ours_saves_bytes'] / 1e9:.3f} GB of weights per rank less "
                 f"than the release's layout ({report['ours_saves_fraction']:.1%} fewer)")
    lines.append("per-rank HBM floor (a rank's bytes / one device's bandwidth):")
    for chip in ours["floor_ms"]:
        lines.append(f"  {chip:6s} ours {ours['floor_ms'][chip]:8.3f} ms/step   release "
                     f"{release['floor_ms'][chip]:8.3f} ms/step")
    return "\n".join(lines)
