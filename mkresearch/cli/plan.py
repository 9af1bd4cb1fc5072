"""`mkresearch plan MODEL`: the schedule of one megakernel step from shapes, without running it:
DMAs and bytes per stage and layer kind, the weight ring, the VMEM plan, HBM bytes against the
roofline (`mkresearch.prediction.schedule_report`). With `--ranks N` every collective of one
sharded step instead (`cli.plan_ranks`)."""

from __future__ import annotations

import json
from typing import Any

from mkresearch.cli import plan_ranks as cli_plan_ranks
from mkresearch.cli.common import (
    CHIP_DEFAULT_HELP,
    cache_layout_applies,
    context_in_cache,
    known_chip,
    known_model,
    megakernel_batch,
    refusals,
    with_formats,
)
from mkresearch.cli.options import (
    add_batch,
    add_cache_layout,
    add_command,
    add_context,
    add_expert_format,
    add_model,
    each_batch,
)
from mkresearch.hardware.chips import CHIPS
from mkresearch.prediction import schedule_report

EXAMPLES = ("mkresearch plan kimi-k3",
            ("mkresearch plan kimi-k3-mini --batch 1,4 --cache-layout latent --format fp8 "
            "--context 40"),
            "mkresearch plan kimi-k3 --ranks 32 --collectives exact   # every collective")


def add_parser(commands: Any) -> None:
    p = add_command(commands, "plan", "the schedule of one megakernel step from shapes: DMAs and "
                                      "bytes per stage and layer kind, the ring, the VMEM plan, "
                                      "HBM bytes against the roofline", EXAMPLES)
    add_model(p)
    add_batch(p)
    p.add_argument("--chip", default=None,
                   help=f"TPU chip the step is built for (VMEM plan): one of "
                        f"{', '.join(CHIPS)} ({CHIP_DEFAULT_HELP})")
    add_cache_layout(p)
    add_expert_format(p)
    add_context(p, None, "every row's position (default: the last one, the worst case)")
    p.add_argument("--json", action="store_true", help="print one JSON object (per batch)")
    cli_plan_ranks.add_arguments(p)


def run(args: Any) -> int:
    cfg = known_model(args.model)
    chip = known_chip(args.chip)
    cache_layout_applies(cfg, args.cache_layout)
    if args.ranks is not None:  # every collective of a sharded step
        return each_batch(args, cli_plan_ranks.run)
    cli_plan_ranks.check_without_ranks(args)
    for batch in args.batch:
        megakernel_batch("--batch", batch)
    if args.context is not None:
        context_in_cache(cfg, args.context)
    cfg = with_formats(cfg, args)
    return each_batch(args, lambda one: _run_one(cfg, chip, one))


def _run_one(cfg: Any, chip: str, args: Any) -> int:
    with refusals():
        sched = schedule_report.plan_schedule(cfg, args.batch, chip, args.context)
        report = schedule_report.report(sched)
    print(json.dumps(report) if args.json else schedule_report.format_report(sched, report))
    return 0
