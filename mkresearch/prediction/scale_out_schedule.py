"""The schedules of the scale-out model (`scale_out`): how a rank streams and combines. The
release's is hand-kept from docs/collectives.md §1 (`RELEASE_SCHEDULE`); ours is read from the megakernel's plan
(`our_schedule`): its global ring's depth, chosen per layout and batch by
`megakernel_sharded.ring_depth` (the kernel's plan reads the same function), its expert slots and
its collective schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from mkresearch.hardware import interconnect as links
from mkresearch.kernels.compose import megakernel_sharded
from mkresearch.model.config import ModelConfig
from mkresearch.prediction import designs, program
from mkresearch.prediction.timeline import FETCH_ORDERS, FIRST, QUEUED
from mkresearch.sharding import layout as layouts

MIB = 2**20
COMBINES = layouts.COLLECTIVES  # ours: its kernel's mode; the release's: "partial-sum"
# docs/collectives.md: "At B = 6 and 8 it switches to reduce-scatter + gather variants"
RS_FROM_BATCH = program.RS_FROM_BATCH


@dataclass(frozen=True)
class Schedule:
    """How a rank streams and combines: block size, blocks and expert DMAs in flight, collectives."""

    name: str
    block_bytes: int
    banks: int  # weight blocks in flight ahead of the one multiplied
    expert_slots: int  # routed-expert DMAs in flight, the first issued right after routing
    combine: str  # one of COMBINES
    source: str
    # whether the ring runs ahead past a blocking collective (as far as its banks; else the
    # blocks after it are issued once the rank is past it): None, as each collective of the
    # program says (`program.Collective.streams`: how that kernel issues its weights around it);
    # True / False, every collective alike (a what-if, the same for both sides). Collectives
    # started early overlap either way, and blocks a kernel issued earlier still move
    # (`program.Collective.ahead`, `Program.prefetch`).
    prefetch_across: bool | None = None
    all_reduce: str = "two-level"  # below RS_FROM_BATCH rows
    all_reduce_large: str = "two-level"  # from RS_FROM_BATCH rows
    gather_algorithm: str = "two-level"
    # our kernel's collectives (`kernels/sharded/collective_ops.py`: "partial-sum", "exact" or
    # "restructured", `layouts.COLLECTIVES`), each priced as the sharding plan sends it; None: the
    # release's program (`release_program`)
    collectives: str | None = None
    wire: str = "f32"  # partial sums on the wire (the contract's `wire`)
    ring: str = ""  # why `banks` (ours: `megakernel_sharded.RingDepth.describe`)
    # ours: how the kernel sends its reductions (`MegakernelOptions.reductions`, chosen by its
    # sharding plan, `kernels.sharded.plan.sharding_plan`) and the hosts whose partials it adds first
    reductions: tuple = ()
    ranks_per_host: int = 0
    # the kernel hands the MXU its routed experts as fp8 (else decoded to bf16): what a weight tile
    # costs the MXU (`program.expert_mix`); ours: its config's `expert_mxu`
    mxu_fp8: bool = False
    # how the routed experts' reads meet the ring's blocks already issued
    # (`timeline.FETCH_ORDERS`): ours, its kernel's `MegakernelOptions.expert_reads_first`; the
    # release's "held"
    expert_order: str = "queued"
    # ours: designs naming the kernel's router placement (`designs.DESIGNS`), priced as the kernel
    # runs it
    designs: tuple[str, ...] = ()
    # ours: where its kernel places the router (`MegakernelOptions.router_placement`, priced from
    # the kernel's own collectives and bytes); a router design naming it adds nothing more
    router: str = layouts.ROUTER_SPLIT
    # ours: the routed experts' expert-tensor ways (`layout.layout(..., etp=)`: each expert's
    # hidden split over etp ranks, EP = n_ranks / etp groups); None: the layout's default
    # (`partition.default_etp`, the release's 4 where it fits)
    etp: int | None = None
    # ours: whether the kernel plans this step (False: over VMEM, or more rows than it plans;
    # priced anyway: `megakernel_sharded.RingDepth.planned`)
    kernel_plans: bool = True

    def algorithm(self, batch: int) -> str:
        return self.all_reduce_large if batch >= RS_FROM_BATCH else self.all_reduce

    def __post_init__(self) -> None:
        for name in ("block_bytes", "banks", "expert_slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Schedule.{name}={value!r} is invalid: an int >= 1")
        if self.expert_order not in FETCH_ORDERS:
            raise ValueError(f"Schedule.expert_order={self.expert_order!r} is invalid: one of "
                             f"{FETCH_ORDERS}")
        designs.check(self.designs)
        if self.router not in layouts.ROUTER_PLACEMENTS:
            raise ValueError(f"Schedule.router={self.router!r} is invalid: one of "
                             f"{layouts.ROUTER_PLACEMENTS}")
        named = designs.router_placement(self.designs)
        if self.router != layouts.ROUTER_SPLIT and named not in (layouts.ROUTER_SPLIT, self.router):
            raise ValueError(f"Schedule.designs={self.designs!r} is invalid with router="
                             f"{self.router!r}: the kernel places the router already")
        if self.router != layouts.ROUTER_SPLIT and not self.collectives:
            raise ValueError(f"Schedule.router={self.router!r} is invalid: only our kernel's "
                             "program places its router (a schedule with collectives)")
        if self.designs and not self.collectives:
            raise ValueError(f"Schedule.designs={self.designs!r} is invalid: only our kernel's "
                             "program takes designs (a schedule with collectives)")
        if self.combine not in COMBINES:
            raise ValueError(f"Schedule.combine={self.combine!r} is invalid: one of {COMBINES}")
        for name in ("all_reduce", "all_reduce_large", "gather_algorithm"):
            if getattr(self, name) not in links.ALGORITHMS:
                raise ValueError(f"Schedule.{name}={getattr(self, name)!r} is invalid: one of "
                                 f"{links.ALGORITHMS}")


RELEASE_SCHEDULE = Schedule(
    "release", block_bytes=2 * MIB, banks=12, expert_slots=4, combine="partial-sum",
    source="docs/tpu.md: 12 x 2 MiB VMEM weight banks in flight and 4 expert DMA slots issued "
           "right after routing (PUBLISHED for the release's second model; ASSUMPTION: the same "
           "for Kimi K3); docs/collectives.md: one-shot collectives, two-level all-reduces of "
           "bf16 partial sums, reduce-scatter + gather from B = 6, the latent gather and the "
           "shared expert's sum overlapped; its kernel (kimi/decode_megakernel.py): its stream "
           "runs past the MoE's collectives and the attended features' swap (W_o prefetched), "
           "past the attention's output collectives only with the next router (issued a layer "
           "ahead), its experts' first reads issued inside top-k, W_lu read beside the routed "
           "sum (`program.release_collectives`)",
    all_reduce="two-level", all_reduce_large="rs-ag",
    gather_algorithm="one-shot", mxu_fp8=program.RELEASE_MXU_TAKES_FP8,
    expert_order=program.RELEASE_EXPERT_ORDER)


def our_schedule(cfg: ModelConfig, collectives: str = "partial-sum", n_ranks: int = 1,
                 batch: int = 1, chip: str = "tpu7x",
                 router: str = layouts.ROUTER_SPLIT, wire: str = "f32",
                 etp: int | None = None, expert_slots: int | None = None) -> Schedule:
    """Our megakernel's on n_ranks at `batch` on `chip`: its ring's slots of cfg.ring_block_bytes
    (depth - 1 blocks fly ahead; `megakernel_sharded.ring_depth`: in a partial-sum mode the
    deepest that fits the chip's VMEM at this batch), MegakernelOptions.expert_slots, the
    collectives its own schedule issues in mode `collectives` (`layouts.COLLECTIVES`), its router
    placed as `router` says (`MegakernelOptions.router_placement`, the hosts of its chip's
    slice), its partial sums on the wire as `wire` (the kernel built with it: its reductions'
    algorithms and ring depth for that wire), its experts split `etp` ways (the layout's;
    None: its default), `expert_slots` VMEM slots per expert matrix
    (`MegakernelOptions.expert_slots`: the ring as deep as VMEM still allows beside them; None:
    the option's default)."""
    if collectives not in layouts.COLLECTIVES:
        raise ValueError(f"collectives={collectives!r} is invalid: one of {layouts.COLLECTIVES}")
    lay = layouts.layout(cfg, n_ranks, layouts.OURS, collectives=collectives, etp=etp)
    fields = ({} if router == layouts.ROUTER_SPLIT else {"router_placement": router}) \
        | ({} if expert_slots is None else {"expert_slots": expert_slots})
    options = megakernel_sharded.kernel_options(lay, batch, chip, wire, **fields)  # the CLI's
    ring = megakernel_sharded.RingDepth(cfg.ring_depth, "the config's ring_depth (one device)") \
        if n_ranks == 1 else megakernel_sharded.ring_depth(lay, batch, options=options, wire=wire)
    return Schedule("ours", block_bytes=cfg.ring_block_bytes, banks=ring.depth - 1,
                    expert_slots=options.expert_slots, combine=collectives,
                    source="the megakernel's plan (its ring depth, cfg.ring_block_bytes, Megakernel"
                           "Options.expert_slots, its reductions' algorithms) and its schedule",
                    collectives=collectives, wire=wire, ring=ring.describe(),
                    reductions=options.reductions,
                    ranks_per_host=options.ranks_per_host, mxu_fp8=cfg.expert_mxu == "fp8",
                    expert_order=FIRST if options.expert_reads_first else QUEUED,
                    router=options.router_placement, etp=etp, kernel_plans=ring.planned)


SCHEDULES = ("release", "ours")


def schedule_for(cfg: ModelConfig, name: str | Schedule, collectives: str = "partial-sum",
                 n_ranks: int = 1, batch: int = 1, chip: str = "tpu7x") -> Schedule:
    """A schedule by name ("release", "ours": our megakernel's on n_ranks in mode `collectives`
    at `batch` on `chip`), or as given."""
    if isinstance(name, Schedule):
        return name
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is invalid: one of {SCHEDULES} or a Schedule")
    return RELEASE_SCHEDULE if name == "release" else our_schedule(cfg, collectives, n_ranks, batch, chip)
