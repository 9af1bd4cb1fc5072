"""Designs of our step beyond the kernel as built by default, priced by the same scale-out model:
each one a change to our rank's program, named here once (issue 46). Two are kernel options too
(rho by reduce-scatter: `decode --collectives restructured`; expert reads first:
`MegakernelOptions.expert_reads_first`), priced here as changes to the partial-sum program; so are
the router placements (`MegakernelOptions.router_placement`, `decode --ranks N --router P`),
each priced as the kernel runs it.

  restructured        the routed experts' latent sum rho ([B, latent]) reduced by a one-phase
                      reduce-scatter (each rank sends each peer the 1/n of rho that peer owns)
                      instead of an all-reduce; W_lu split by rows takes a rank's slice of rho,
                      and its [B, d] partial sums ride in the shared experts' reduction (added to
                      theirs: the reduction no longer carries W_lu's column chunks), the latent
                      norm's scale applied per row of W_lu after the sum (RMSNorm's scale is a
                      per-channel factor: it commutes with the row split). Same bytes per rank.
  router placement    where the router's columns live: split over every rank as built ("split":
                      one gather of scores and latent over n ranks before top-k), within a host
                      ("host"), between sibling cores ("sibling": a swap over the chip's own
                      path) or on every rank ("replicated": no gather before top-k). The kernel
                      runs each (`MegakernelOptions.router_placement`, `decode --ranks N --router
                      P`, `layout.place_router`); a design naming one prices our program as the
                      kernel runs it (`Schedule.router`, `scale_out.placed_layout`): its
                      layout's bytes per rank (the router's columns over g ranks in whole lane
                      tiles: Kimi K3's 896 experts 128 per rank on a host of 8, 512 on a sibling
                      pair, every rank all 896; the busiest rank's bytes, so a host's chunks, not
                      rotated onto ranks with padding of other matrices as the split's are, add
                      to it) and its collectives (`collective_ops`): the scores gathered among
                      the group before top-k (waited before W_ld's product), the latent's gather
                      over every rank no longer gating top-k: issued after routing and the first
                      experts' DMAs, waited for before the first expert is computed, priced as
                      beside the experts' reads (ASSUMPTION: done before the first expert lands,
                      `program.FIRST_EXPERT_WAIT`).
  expert reads first  `Schedule.expert_order = "first"` (`timeline.FETCH_ORDERS`): once routing is
                      known, the routed experts' DMAs go ahead of the ring's blocks not yet moving.

`apply(...)` changes one stage's collectives (a schedule whose kernel mode is already
"restructured" is left as the kernel sends it); a router placement is the kernel's own layout and
collectives (`scale_out.placed_layout`). The prediction runs them when `Schedule.designs` names them (`scale_out.predict(schedule=...)`);
`design_table.designs_table` and `design_table.router_placements` print what each buys.
"""

from __future__ import annotations

import dataclasses

from mkresearch.kernels.sharded import plan as sharding
from mkresearch.kernels.stages.experts import LATENT_DOWN
from mkresearch.kernels.stages.router import W_ROUTER
from mkresearch.prediction.program import ONE_SHOT
from mkresearch.sharding import layout as layouts
from mkresearch.sharding.layout import RESTRUCTURED

# the router's placements: the kernel's names (`MegakernelOptions.router_placement`,
# `layout.ROUTER_PLACEMENTS`), as built first
SPLIT, HOST, SIBLING, REPLICATED = ROUTER_PLACEMENTS = layouts.ROUTER_PLACEMENTS
ROUTER_DESIGNS = tuple(f"router-{p}" for p in ROUTER_PLACEMENTS[1:])
# the kernel's collectives mode of that name (`layouts.KERNEL_COLLECTIVES`), priced here as a
# change to the partial-sum program: the interconnect model has no price for the kernel's
# one-phase reduce-scatter yet, so `layouts.COLLECTIVES` (the modes the prediction runs) lacks it
DESIGNS = (RESTRUCTURED, *ROUTER_DESIGNS)
FUSED_ROUTER_GATHER = f"{W_ROUTER}+{LATENT_DOWN}"  # the split kernel's one gather of both
F32 = 4


def check(designs: tuple[str, ...]) -> None:
    """Refuse unknown designs and more than one router placement."""
    for d in designs:
        if d not in DESIGNS:
            raise ValueError(f"design {d!r} is invalid: one of {DESIGNS}")
    if sum(d in ROUTER_DESIGNS for d in designs) > 1:
        raise ValueError(f"designs={designs!r} is invalid: at most one router placement")


def router_placement(designs: tuple[str, ...]) -> str:
    """The router placement the designs name ("split" if none)."""
    return next((d.removeprefix("router-") for d in designs if d in ROUTER_DESIGNS), SPLIT)


def scores_bytes(batch: int, n_experts: int, members: int) -> int:
    """One member's piece of the router's scores split over `members` ranks: f32, its columns
    padded to whole lanes as the layout pads them."""
    return batch * sharding.lanes(-(-n_experts // members)) * F32


def router_group(placement: str, rank: int, n_ranks: int, ranks_per_host: int
                 ) -> tuple[int, ...]:
    """The ranks that split the router's columns with `rank` under `placement`."""
    if placement == REPLICATED:
        return (rank,)
    if placement == SIBLING:
        return (rank & ~1, rank | 1)
    if placement == HOST:
        first = rank // ranks_per_host * ranks_per_host
        return tuple(range(first, first + ranks_per_host))
    return tuple(range(n_ranks))


def apply(designs: tuple[str, ...], collectives: tuple, *, n_ranks: int, batch: int,
          d_model: int, wire_bytes: int) -> tuple:
    """One stage's collectives under `designs` (the actions are unchanged: same order). A router
    placement changes none here: the program is the kernel's with its router placed
    (`scale_out.placed_layout`: its layout's bytes, its own collectives)."""
    out = []
    for c in collectives:
        if RESTRUCTURED in designs and c.name.startswith(sharding.EXPERT_SUM):
            # one phase: each member sends each peer its 1/n piece (priced as a one-shot
            # all-gather of that piece)
            out.append(dataclasses.replace(c, op="all_gather", algorithm=ONE_SHOT,
                                           nbytes=c.nbytes / n_ranks))
        elif RESTRUCTURED in designs and c.name.startswith(sharding.SHARED_DOWN):
            out.append(dataclasses.replace(c, nbytes=batch * d_model * wire_bytes))
        else:
            out.append(c)
    return tuple(out)
