"""Designs of our step beyond the kernel as built by default, priced by the same scale-out model:
each one a change to our rank's program, named here once (issue 46). Two are kernel options too
(rho by reduce-scatter: `decode --collectives restructured`; expert reads first:
`MegakernelOptions.expert_reads_first`), priced here as changes to the partial-sum program; the
router placements are the model's only.

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
                      path) or on every rank ("replicated": no gather before top-k). Each rank
                      then reads the router's columns over g ranks
                      (padded to whole lanes as the layout pads them: Kimi K3's 896 experts in
                      chunks of 28 padded to 128 on 32 ranks, so a host's 112 cost nothing); the latent's gather over every
                      rank no longer gates top-k and runs beside the routed experts' reads
                      (ASSUMPTION: done before the first expert lands, `first_expert_lands_s`).
  expert reads first  `Schedule.expert_order = "first"` (`timeline.FETCH_ORDERS`): once routing is
                      known, the routed experts' DMAs go ahead of the ring's blocks not yet moving.

`apply(...)` changes one stage's collectives (a schedule whose kernel mode is already
"restructured" is left as the kernel sends it); `scale_out` adds a placement's router bytes. The
prediction runs them when `Schedule.designs` names them (`scale_out.predict(schedule=...)`);
`design_table.designs_table` and `design_table.router_placements` print what each buys.
"""

from __future__ import annotations

import dataclasses

from mkresearch.kernels.sharded import plan as sharding
from mkresearch.kernels.sharded.collective_ops import EXPERTS
from mkresearch.kernels.stages.experts import LATENT_DOWN
from mkresearch.kernels.stages.router import W_ROUTER
from mkresearch.prediction.program import ONE_SHOT, Collective
from mkresearch.sharding.layout import RESTRUCTURED

# the kernel's collectives mode of that name (`layouts.KERNEL_COLLECTIVES`), priced here as a
# change to the partial-sum program: the interconnect model has no price for the kernel's
# one-phase reduce-scatter yet, so `layouts.COLLECTIVES` (the modes the prediction runs) lacks it
SPLIT, HOST, SIBLING, REPLICATED = "split", "host", "sibling", "replicated"
ROUTER_PLACEMENTS = (SPLIT, HOST, SIBLING, REPLICATED)  # as built first
ROUTER_DESIGNS = tuple(f"router-{p}" for p in ROUTER_PLACEMENTS[1:])
DESIGNS = (RESTRUCTURED, *ROUTER_DESIGNS)
FUSED_ROUTER_GATHER = f"{W_ROUTER}+{LATENT_DOWN}"  # the kernel's one gather of both
F32 = 4


def check(designs: tuple[str, ...]) -> None:
    """Refuse unknown designs and more than one router placement."""
    for d in designs:
        if d not in DESIGNS:
            raise ValueError(f"design {d!r} is invalid: one of {DESIGNS}")
    if sum(d in ROUTER_DESIGNS for d in designs) > 1:
        raise ValueError(f"designs={designs!r} is invalid: at most one router placement")


def router_placement(designs: tuple[str, ...]) -> str:
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


def apply(designs: tuple[str, ...], actions: list[tuple[str, float]], collectives: tuple,
          *, rank: int, n_ranks: int, ranks_per_host: int, batch: int, n_experts: int,
          d_model: int, wire_bytes: int) -> tuple:
    """One stage's collectives under `designs` (the actions are unchanged: same order)."""
    out = []
    names = [a for a, _ in actions]
    placement = router_placement(designs)
    for c in collectives:
        if RESTRUCTURED in designs and c.name.startswith(sharding.EXPERT_SUM):
            # one phase: each member sends each peer its 1/n piece (priced as a one-shot
            # all-gather of that piece)
            out.append(dataclasses.replace(c, op="all_gather", algorithm=ONE_SHOT,
                                           nbytes=c.nbytes / n_ranks))
        elif RESTRUCTURED in designs and c.name.startswith(sharding.SHARED_DOWN):
            out.append(dataclasses.replace(c, nbytes=batch * d_model * wire_bytes))
        elif placement != SPLIT and c.name.startswith(FUSED_ROUTER_GATHER):
            out += _router_collectives(c, placement, names, rank=rank, n_ranks=n_ranks,
                                       ranks_per_host=ranks_per_host, batch=batch,
                                       n_experts=n_experts)
        else:
            out.append(c)
    return tuple(out)


def _router_collectives(fused: Collective, placement: str, names: list[str], *, rank: int,
                        n_ranks: int, ranks_per_host: int, batch: int, n_experts: int
                        ) -> list[Collective]:
    """The fused scores + latent gather, split: the scores among the router's group before the
    experts (none if replicated), the latent over every rank waited after the experts' reads."""
    scores = scores_bytes(batch, n_experts, n_ranks)  # a member's piece, as built
    group = router_group(placement, rank, n_ranks, ranks_per_host)
    out = []
    if len(group) > 1:
        piece = scores_bytes(batch, n_experts, len(group))
        out.append(Collective(f"{W_ROUTER}/scores", "all_gather", group, piece, W_ROUTER,
                              EXPERTS, ONE_SHOT, count=fused.count,
                              group=(rank,) if placement == SIBLING else None))
    after = names[names.index(EXPERTS) + 1] if EXPERTS in names[:-1] else fused.wait_before
    out.append(dataclasses.replace(fused, name=f"{LATENT_DOWN}/gather",
                                   nbytes=fused.nbytes - scores, wait_before=after))
    return out
