"""`mkresearch plan MODEL --ranks N`: every collective of one sharded step, listed
(`mkresearch.prediction.collective_plan`): kind, group, bytes, phases, algorithm and why, what it overlaps,
and their count; in partial-sum mode also what fewer collectives would cost by replication
(`mkresearch.prediction.replication_floor`) and, for a model with a router, the bytes, latency and
predicted step of each router placement (`mkresearch.prediction.design_table`)."""

from __future__ import annotations

import json
from typing import Any

from mkresearch.cli.common import (
    at_least,
    known_chip,
    known_model,
    options_of,
    refusals,
    wire_with_partial_sums,
)
from mkresearch.hardware import interconnect as links
from mkresearch.kernels.sharded import plan as sharding
from mkresearch.kernels.stages.router import W_ROUTER
from mkresearch.prediction import calibration, collective_plan, design_table, replication_floor
from mkresearch.prediction.timeline_chip import timeline_chip
from mkresearch.sharding import layout


def add_arguments(p: Any) -> None:
    p.add_argument("--ranks", type=int, default=None,
                   help="list the collectives of one step on N ranks (our layout) instead")
    p.add_argument("--collectives", default="partial-sum", choices=layout.COLLECTIVES,
                   help="with --ranks: the kernel's collectives (default partial-sum; exact, "
                        "restructured)")
    p.add_argument("--wire", default="f32", choices=sharding.WIRES,
                   help="with --ranks: partial sums on the wire (default f32)")


def check_without_ranks(args: Any) -> None:
    """--collectives or --wire given without --ranks: a UsageError (the one-device plan has no
    collectives), not an option silently dropped."""
    options_of("--ranks N", (("--collectives", args.collectives, layout.PARTIAL_SUM),
                             ("--wire", args.wire, "f32")), "one device's plan has no collectives")


def run(args: Any) -> int:
    cfg = known_model(args.model)
    chip = known_chip(args.chip)
    at_least("--ranks", args.ranks, 2)
    wire_with_partial_sums(args.wire, args.collectives)
    at_least("--batch", args.batch, 1)
    with refusals():
        layout.check_ranks(cfg, args.ranks)
        plan = collective_plan.collective_plan(cfg, args.ranks, args.batch,
                                               mode=args.collectives, wire=args.wire, chip=chip)
        front = best = router = splits = None
        if args.collectives == layout.PARTIAL_SUM:
            front = replication_floor.frontier(cfg, args.ranks, args.batch, chip)
            best = replication_floor.fastest(cfg, args.ranks, args.batch, chip)
            if any(row["name"].startswith(W_ROUTER) for row in plan["rows"]):
                model = calibration.Model(
                    interconnect=links.interconnect(chip, n_ranks=args.ranks),
                    timeline_chip=timeline_chip(chip))
                router = design_table.router_placements(cfg, args.ranks, args.batch, model=model)
                splits = design_table.expert_splits(
                    cfg, args.ranks, args.batch, model=model, collectives=layout.RESTRUCTURED,
                    expert_order="first")
    if args.json:
        print(json.dumps({**plan, "frontier": front, "fastest": best, "router": router,
                          "expert_splits": splits}))
        return 0
    print(collective_plan.format_plan(plan))
    if front is not None:
        print(replication_floor.format_frontier(front))
        print(replication_floor.format_fastest(best))
    if router is not None:
        print(design_table.format_router_placements(router))
        print(design_table.format_expert_splits(splits, cfg.name, args.ranks, args.batch))
    return 0
