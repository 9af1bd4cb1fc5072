"""Designs of our step beyond the kernel as built by default, priced by the same scale-out model
(issue 46). Each is a kernel option or mode, and the prediction prices each as the kernel runs it:

  rho by reduce-scatter  the kernel's restructured mode (`decode --collectives restructured`,
                      `layout.RESTRUCTURED`, docs/sharding.md §4b): a schedule of that mode
                      (`scale_out.our_schedule(cfg, "restructured", ...)`), its layout's bytes
                      per rank (W_lu split by its latent rows) and its own collectives
                      (`collective_ops`: rho a one-phase reduce-scatter, priced by the
                      interconnect model's "reduce_scatter"; the shared experts' reduction
                      carrying W_lu's partial products and rho's partial sums of squares beside
                      its own, [B, d | d | 128]). Nothing of it is named here.
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
  expert reads first  `Schedule.expert_order = "first"` (`timeline.FETCH_ORDERS`;
                      `MegakernelOptions.expert_reads_first`): once routing is known, the routed
                      experts' DMAs go ahead of the ring's blocks not yet moving.

The prediction runs a router placement when `Schedule.designs` names it
(`scale_out.predict(schedule=...)`); `design_table.designs_table` and
`design_table.router_placements` print what each design buys.
"""

from __future__ import annotations

from mkresearch.kernels.sharded import plan as sharding
from mkresearch.kernels.stages.experts import LATENT_DOWN
from mkresearch.kernels.stages.router import W_ROUTER
from mkresearch.sharding import layout as layouts

# the router's placements: the kernel's names (`MegakernelOptions.router_placement`,
# `layout.ROUTER_PLACEMENTS`), as built first
SPLIT, HOST, SIBLING, REPLICATED = ROUTER_PLACEMENTS = layouts.ROUTER_PLACEMENTS
ROUTER_DESIGNS = tuple(f"router-{p}" for p in ROUTER_PLACEMENTS[1:])
DESIGNS = ROUTER_DESIGNS  # what `Schedule.designs` may name
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

