"""The sharded reference: the plain-JAX decode step as the partial-sum sharded megakernel
computes it (`kernels/sharded/plan.py`, mode "partial-sum"), to the bit.

It is `reference.decode_step` with the weights that the partial-sum layout splits by their rows
(`layout.param_shard`: W_o over the heads, W_down over the FFN hidden) given as
`numerics.Partials`, and the routed experts as `numerics.ExpertGroups` (on the full d with shared
experts: each rank's routed and shared partial sums added first, `layout.merges_shared_sum`,
one reduction for both, as the kernel sends it): the same partial products
(each rank's slice of the contraction, its zero padding included) added in the same fixed order
(one rank per slice, slice 0 first; the expert groups in rank order; with the kernel's hosts,
`ranks_per_host`, a host's partials first, then the hosts' sums: `numerics.host_ordered_sum`),
each rounded to bf16 first with a bf16 wire. Everything else of the sharded step is exact and needs nothing here: the column
gathers move whole values, the embedding's all-reduce adds zeros to one row, the vocab shards'
sampling states fold to the unsharded choice.

Against the single-device reference the only differences are those sums' association, and with
a bf16 wire one more rounding of each partial: `BOUND` states how far the logits may move.
Experts split by ETP too (EP x ETP > 1 on a rank group) round each partial expert output to bf16
before the sum, which this reference does not model (the tests run ETP = 1: 8 ranks of a mini).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mkresearch.model import reference, spec
from mkresearch.model.numerics import ExpertGroups, Partials
from mkresearch.sharding import layout as layouts

# |logits - single-device reference logits| (max over a row). f32 wire: the docs/kimi-k3.md §11 whole-step
# tolerance: partial sums re-associate f32 adds (~1e-7 relative) and a flipped bf16 rounding
# downstream moves a mini model's logits by up to ~0.04 (measured 0 on the minis at 8 ranks).
# bf16 wire: each partial rounded (2^-9 relative) flips many bf16 roundings, which the mini's
# random weights amplify: measured 1.72 on kimi-k3-mini, B = 1, 8 ranks (the greedy token
# changed), far outside 5e-2: f32 stays the default
BOUND = {"f32": 5e-2, "bf16": 2.0}


def _row_split(lay: layouts.Layout, p: spec.Param) -> str | None:
    """The group a parameter's rows split by in the partial-sum layout, else None."""
    rows = len(p.shape) - 2
    shard = layouts.param_shard(lay, p)
    return next((g for axis, g in layouts.active_shard(lay, shard, p.shape) if axis == rows
                 and g == p.gather), None) if rows >= 0 else None


def sharded_params(params: dict, lay: layouts.Layout, wire: str = "f32",
                   ranks_per_host: int = 0) -> dict:
    """params with every row-split matrix as `Partials` (one piece per slice of its group, in
    slice order, each a rank's rows zero-padded as the layout pads them) and the routed experts
    as `ExpertGroups` (lay.ep groups). ranks_per_host: the kernel's hosts (consecutive ranks;
    0: every rank one host), whose partials each reduction adds first
    (`numerics.host_ordered_sum`, `MegakernelOptions.ranks_per_host`)."""
    if lay.collectives != layouts.PARTIAL_SUM:
        raise ValueError(f"lay.collectives={lay.collectives!r} is invalid: 'partial-sum'")
    per_host = ranks_per_host or lay.n_ranks
    if isinstance(per_host, bool) or not isinstance(per_host, int) or per_host < 1 \
            or lay.n_ranks % per_host:
        raise ValueError(f"ranks_per_host={ranks_per_host!r} is invalid: 0 or an int >= 1 that "
                         f"divides the {lay.n_ranks} ranks")
    table = spec.param_table(lay.cfg)
    out = dict(params)
    for kind, entries in table.items():
        if not isinstance(entries, dict):
            continue
        stack = dict(params[kind])
        for key, p in entries.items():
            if key == "experts":  # group g: ranks g * ETP on (ETP = 1 here: rank g)
                hosts = tuple(g * lay.etp // per_host for g in range(lay.ep))
                stack[key] = ExpertGroups(params[kind][key], lay.ep, wire, hosts,
                                          layouts.merges_shared_sum(lay, kind))
            elif isinstance(p, spec.Param) and (group := _row_split(lay, p)) is not None:
                stack[key] = _partials(lay, params[kind][key], p, group, wire, per_host)
        out[kind] = stack
    return out


def _partials(lay: layouts.Layout, w: Any, p: spec.Param, group: str, wire: str,
              per_host: int) -> Partials:
    """w [..., K, N] as one piece per slice of `group` (the ranks adding them: slice 0 first)."""
    rows = len(p.shape) - 2
    pieces, bounds, hosts = [], [], []
    for rank in lay.slice_firsts(group):
        start, stop, local = lay.bounds(group, p.shape[rows], rank)
        piece = np.asarray(w)[..., start:stop, :]
        pad = [(0, 0)] * piece.ndim
        pad[rows] = (0, local - (stop - start))
        pieces.append(np.pad(piece, pad))
        bounds.append((start, stop))
        hosts.append(rank // per_host)
    return Partials(tuple(pieces), tuple(bounds), wire, tuple(hosts))


def decode_step(params: dict, state: dict, tokens: Any, positions: Any, lay: layouts.Layout,
                wire: str = "f32", ranks_per_host: int = 0) -> tuple:
    """`reference.decode_step` as the partial-sum sharded step computes it -> (logits [B, V] f32,
    state, aux). ranks_per_host: the kernel's (`MegakernelOptions.ranks_per_host`)."""
    return reference.decode_step(sharded_params(params, lay, wire, ranks_per_host), state,
                                 tokens, positions, lay.cfg)
