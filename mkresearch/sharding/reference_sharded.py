"""The sharded reference: the plain-JAX decode step as the partial-sum sharded megakernel
computes it (`kernels/sharded/plan.py`, modes "partial-sum" and "restructured"), to the bit.

It is `reference.decode_step` with the weights that the partial-sum layout splits by their rows
(`layout.param_shard`: W_o over the heads, W_down over the FFN hidden) given as
`numerics.Partials`, and the routed experts as `numerics.ExpertGroups` (on the full d with shared
experts: each rank's routed and shared partial sums added first, `layout.merges_shared_sum`,
one reduction for both, as the kernel sends it): the same partial products
(each rank's slice of the contraction, its zero padding included) added in the same fixed order
(one rank per slice, slice 0 first; the expert groups in rank order; with the kernel's hosts,
`ranks_per_host`, a host's partials first, then the hosts' sums: `numerics.host_ordered_sum`),
each rounded to bf16 first with a bf16 wire (and each host's sum and the total after them: the
values the wire carries, `numerics.host_ordered_sum`).
Everything else of the sharded step is exact and needs nothing here: the column
gathers move whole values, the embedding's all-reduce adds zeros to one row, the vocab shards'
sampling states fold to the unsharded choice.

What a user can rely on (the partial-sum claim):
- The partial-sum kernel's logits, tokens and every rank's state slice equal this reference's to
  the bit, the same bits on every rank, whatever the reduction algorithm or hosts, run after run,
  a row's whatever the other rows (tests/sharded/test_partial_sum.py).
- Against the single-device reference (`reference.decode_step`) the only differences are those
  sums' association, and with a bf16 wire the roundings of each partial and of each sum. Their
  logits are NOT within a fixed bound of each other: a re-associated sum that changes a MoE
  layer's top-k choice for a row (its routing differs) moves that row's logits by whole units
  (up to 3.7 measured) and may change its greedy token, at that step and later (its caches
  differ since).
- Until a row's routing has differed from the single device's, its logits stay within
  `SAME_ROUTING_BOUND[wire]` of them (`within_claim`), so its greedy token is the single
  device's unless the single device's best two logits are within twice that.
- With the f32 wire (the default) routing differs no more often than between the single-device
  reference and itself with its sums in another order (`partial_sum_sweep.reordered_params`):
  it comes with any summation order, not with sharding. The bf16 wire makes it ~3x as frequent.
Measured by `python -m mkresearch.sharding.partial_sum_sweep` over `partial_sum_sweep.SWEEP`
(48 seed pairs of kimi-k3-mini and deepseek-v3-mini, both MLA cache layouts, 2/4/8 ranks, B 1-5,
bf16/fp8/mxfp4 experts, 11 steps per row), tested over it (tests/test_partial_sum_claim.py):
of 132 rows, routing differed at some step in 28 with the f32 wire, 35 with the other order, 90
with the bf16 wire; 63 % of the f32 row-steps are bit-equal to the single device's (the other
order: 54 %; the single device on another XLA:CPU configuration: 69 rows, 0 %). The minis'
random weights put router scores within rounding of a tie often (in Kimi K3's mini 24 of 66
rows, DeepSeek-V3's 4 of 66); a trained model's margins are its own.
The restructured mode (`layout.RESTRUCTURED`, docs/sharding.md §4b) is the same with W_lu
as `numerics.NormedRows`: each rank's latent rows times its chunk of bf(ρ)·γ, those partial
products and the chunks' Σ ρ² summed as the shared experts' partials are (beside them, in the
same order), RMSNorm's scale applied after the sum. Its kernel equals this to the bit; against
the single device the same bounds hold while a row's routing agrees, but routing differs more
often than with any order of the same sums (the latent norm's rounding moved: 18 of 22 rows
with the f32 wire, partial-sum 8, over `partial_sum_sweep --restructured --seeds 1`; tested in
tests/test_partial_sum_claim.py).
Experts split by ETP too (EP x ETP ranks, each expert's hidden split over the ETP ranks of its
group) add every rank's partial instead, each expert's partial output over the rank's hidden
slice rounded to bf16 before the sum (`numerics.ExpertGroups.ranks`): the kernel's sum, equal to
the bit (tests/sharded/test_partial_sum.py, ETP 2 on 8 ranks).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mkresearch.model import reference, spec
from mkresearch.model.numerics import ExpertGroups, NormedRows, Partials
from mkresearch.sharding import layout as layouts

# max |logits - single-device reference logits| of a row at a step, while the row's routing has
# not differed from the single device's. Measured over partial_sum_sweep.SWEEP (1,452 row-steps
# per wire): f32 0.166 (p99 0.074; the single device with its sums in another order: 0.178, p99
# 0.099), bf16 wire 0.262 (p99 0.18; 0.324 on --quick's other seed pairs; each sum rounded as
# the wire carries it). Once routing differs: up to 3.7 (f32) and 5.8 (bf16). The single device on another XLA:CPU configuration
# (the Makefile's OTHER_XLA_FLAGS, measured once over the same sweep) differs from itself by up
# to 0.255, its routing in 69 of 132 rows: the bounds leave room for another machine's sums
SAME_ROUTING_BOUND = {"f32": 0.3, "bf16": 0.5}


def routing_differs(expert_ids: Any, single_expert_ids: Any) -> np.ndarray:
    """[B] bool: some MoE layer chose other experts for the row (expert_ids [n_moe, B, k], the
    `aux["expert_ids"]` of a step, in any order within a row's k)."""
    a, b = np.sort(np.asarray(expert_ids), -1), np.sort(np.asarray(single_expert_ids), -1)
    return (a != b).any(-1).any(0)


def within_claim(logits: Any, single_logits: Any, routing_differed: Any,
                 wire: str = "f32") -> np.ndarray:
    """[B] bool: each row's logits [B, V] as the partial-sum claim allows against the
    single-device reference's: within SAME_ROUTING_BOUND[wire], or anything once the row's
    routing has differed (at this step or an earlier one: `routing_differs`, accumulated)."""
    diff = np.abs(np.asarray(logits, np.float32) - np.asarray(single_logits, np.float32))
    return np.asarray(routing_differed, bool) | (diff.max(-1) <= SAME_ROUTING_BOUND[wire])


def row_split(lay: layouts.Layout, p: spec.Param) -> str | None:
    """The group a parameter's rows split by in the partial-sum layout, else None."""
    rows = len(p.shape) - 2
    shard = layouts.param_shard(lay, p)
    return next((g for axis, g in layouts.active_shard(lay, shard, p.shape) if axis == rows
                 and g == p.gather), None) if rows >= 0 else None


def check_hosts(lay: layouts.Layout, ranks_per_host: int = 0) -> int:
    """The ranks of one host (ranks_per_host, 0: all of them) of a layout with partial sums
    (partial-sum or restructured), checked:
    ValueError naming what is invalid."""
    if not lay.partial_sums:
        raise ValueError(f"lay.collectives={lay.collectives!r} is invalid: one of "
                         f"{layouts.PARTIAL_SUM_MODES}")
    per_host = ranks_per_host or lay.n_ranks
    if isinstance(per_host, bool) or not isinstance(per_host, int) or per_host < 1 \
            or lay.n_ranks % per_host:
        raise ValueError(f"ranks_per_host={ranks_per_host!r} is invalid: 0 or an int >= 1 that "
                         f"divides the {lay.n_ranks} ranks")
    return per_host


def sharded_params(params: dict, lay: layouts.Layout, wire: str = "f32",
                   ranks_per_host: int = 0) -> dict:
    """params with every row-split matrix as `Partials` (one piece per slice of its group, in
    slice order, each a rank's rows zero-padded as the layout pads them) and the routed experts
    as `ExpertGroups` (lay.ep groups). ranks_per_host: the kernel's hosts (consecutive ranks;
    0: every rank one host), whose partials each reduction adds first
    (`numerics.host_ordered_sum`, `MegakernelOptions.ranks_per_host`)."""
    per_host = check_hosts(lay, ranks_per_host)
    table = spec.param_table(lay.cfg)
    out = dict(params)
    for kind, entries in table.items():
        if not isinstance(entries, dict):
            continue
        stack = dict(params[kind])
        for key, p in entries.items():
            if key == "experts":
                stack[key] = _expert_groups(lay, params[kind][key], kind, wire, per_host)
            elif isinstance(p, spec.Param) and (group := row_split(lay, p)) is not None:
                stack[key] = _partials(lay, params[kind][key], p, group, wire, per_host)
            elif isinstance(p, spec.Param) and scattered_rows(lay, p):  # restructured: W_lu
                stack[key] = _normed_rows(lay, params[kind][key], p, entries, wire, per_host)
        out[kind] = stack
    return out


def _expert_groups(lay: layouts.Layout, experts: Any, kind: str, wire: str,
                   per_host: int) -> ExpertGroups:
    """The routed experts as the kernel sums them: one partial per expert group (ETP = 1: rank
    g holds group g), or with ETP > 1 one per rank (its group and hidden slice, in rank order)."""
    merged = layouts.merges_shared_sum(lay, kind)
    if lay.etp == 1:
        return ExpertGroups(experts, lay.ep, wire, tuple(g // per_host for g in range(lay.ep)),
                            merged)
    groups, pieces = lay.split(spec.EXPERTS), lay.split(spec.EXPERT_TP)
    ranks = tuple((groups.index(r), pieces.index(r)) for r in range(lay.n_ranks))
    return ExpertGroups(experts, lay.ep, wire, tuple(r // per_host for r in range(lay.n_ranks)),
                        merged, ranks)


def scattered_rows(lay: layouts.Layout, p: spec.Param) -> bool:
    """Whether the restructured layout splits p by the rows its input is reduce-scattered by."""
    rows = len(p.shape) - 2
    return (lay.collectives == layouts.RESTRUCTURED and p.scattered is not None and rows >= 0
            and (rows, p.scattered) in layouts.active_shard(lay, layouts.param_shard(lay, p),
                                                            p.shape))


def _normed_rows(lay: layouts.Layout, w: Any, p: spec.Param, entries: dict, wire: str,
                 per_host: int) -> NormedRows:
    """W_lu [..., Lat, N] as each rank's latent rows, in the order the reduction it travels
    beside adds the ranks (`Param.beside`, the stage's shared experts' W_down: one rank per slice
    of its group, as the kernel's `kernels.sharded.plan.Rule.beside`)."""
    pieces, bounds, hosts = _row_pieces(lay, w, p, p.scattered,
                                        lay.slice_firsts(entries[p.beside].gather), per_host)
    return NormedRows(pieces, bounds, wire, hosts)


def _partials(lay: layouts.Layout, w: Any, p: spec.Param, group: str, wire: str,
              per_host: int) -> Partials:
    """w [..., K, N] as one piece per slice of `group` (the ranks adding them: slice 0 first)."""
    pieces, bounds, hosts = _row_pieces(lay, w, p, group, lay.slice_firsts(group), per_host)
    return Partials(pieces, bounds, wire, hosts)


def _row_pieces(lay: layouts.Layout, w: Any, p: spec.Param, group: str, ranks: tuple,
                per_host: int) -> tuple[tuple, tuple, tuple]:
    """(pieces, bounds, hosts): each of `ranks`' rows of w [..., K, N] by `group`, zero-padded
    to its slice's length, the input columns it multiplies, and its host."""
    rows = len(p.shape) - 2
    pieces, bounds, hosts = [], [], []
    for rank in ranks:
        start, stop, local = lay.bounds(group, p.shape[rows], rank)
        piece = np.asarray(w)[..., start:stop, :]
        pad = [(0, 0)] * piece.ndim
        pad[rows] = (0, local - (stop - start))
        pieces.append(np.pad(piece, pad))
        bounds.append((start, stop))
        hosts.append(rank // per_host)
    return tuple(pieces), tuple(bounds), tuple(hosts)


def decode_step(params: dict, state: dict, tokens: Any, positions: Any, lay: layouts.Layout,
                wire: str = "f32", ranks_per_host: int = 0) -> tuple:
    """`reference.decode_step` as the partial-sum sharded step computes it -> (logits [B, V] f32,
    state, aux). ranks_per_host: the kernel's (`MegakernelOptions.ranks_per_host`)."""
    return reference.decode_step(sharded_params(params, lay, wire, ranks_per_host), state,
                                 tokens, positions, lay.cfg)
