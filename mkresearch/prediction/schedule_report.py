"""What a step's schedule says (`mkresearch.kernels.compose.schedule`), for `mkresearch plan`: its summary,
its HBM bytes against the roofline's component by component, and the text the CLI prints.

The schedule and `roofline.step_bytes` count the same components, but not always the same bytes:
the kernel moves what the HBM tiling and its own layout make it move. Each such difference has a
name and a reason here (`DIFFERENCES`); a difference without one is reported as unexplained.
"""

from __future__ import annotations

from typing import Any

from mkresearch.kernels.compose import schedule as step_schedule
from mkresearch.kernels.compose.megakernel_plan import MegakernelOptions, make_plan
from mkresearch.model import roofline, spec
from mkresearch.model.config import ModelConfig
from mkresearch.prediction.full_size import stand_in_note

# component -> why the kernel moves other bytes than the roofline counts (when it does)
DIFFERENCES = {
    "embedding_rows": "each token's aligned 16-row block of E is DMA'd (bf16 HBM tiling), the "
                      "roofline counts one row",
    "norms_and_mix": "the per-layer norm gains are DMA'd as f32 rows (megakernel.prepare_weights), "
                     "the roofline counts them as stored (bf16)",
    "kv_cache": "KV rows are read in whole 16-row groups, and each new entry's aligned 16-row "
                "block is read and written back; the roofline counts the context's rows read "
                "and one row written (a sliding window's: its tokens, where the kernel reads "
                "from the start of the window's first tile)",
    "moe_nonrouted": "the router bias is DMA'd only when cfg.router_bias; the roofline counts it",
}


def _why(component: str, cfg: ModelConfig) -> str:
    """The reason a component differs (DIFFERENCES); every kind's cache shares the KV one."""
    caches = {kind.state_component[0] for kind in spec.stages_of(cfg)
              if kind.state_component and roofline.state_bytes(cfg, kind, spec.CACHE)}
    return DIFFERENCES.get("kv_cache" if component in caches else component, "unexplained")


def roofline_comparison(sched: step_schedule.StepSchedule) -> dict[str, Any]:
    """The schedule's HBM bytes per roofline component against `roofline.step_bytes` at the same
    assumptions: context = the rows' (common) position, the experts each routed layer fetches.
    ValueError when the schedule's rows sit at different positions or its layers fetch different
    numbers of experts (the roofline has one context and one count)."""
    plan = sched.plan
    if len(set(sched.positions)) != 1:
        raise ValueError(f"positions={list(sched.positions)} is invalid for a roofline comparison: "
                         "one position for every row (the roofline's context)")
    fetched = set(sched.experts_fetched().values())
    if len(fetched) > 1:
        raise ValueError(f"the schedule's routed layers fetch {sorted(fetched)} experts: the "
                         "roofline compares one count per layer")
    context, unique = sched.positions[0], (fetched.pop() if fetched else 0)
    step = roofline.step_bytes(plan.cfg, plan.batch, context, unique_experts=unique)
    by_component = sched.tally(step_schedule.component)
    unknown = set(by_component) - set(step.components) - {None}
    if unknown:
        raise ValueError(f"the schedule moves bytes of {sorted(unknown)}, which the roofline "
                         "does not count")
    rows = []
    for name, label in step.components.items():
        tally = by_component.get(name, step_schedule.Tally())
        read, written = step.read.get(name, 0), step.written.get(name, 0)
        difference = tally.read + tally.written - read - written
        rows.append({"component": name, "label": label,
                     "schedule": {"read": tally.read, "written": tally.written},
                     "roofline": {"read": read, "written": written}, "difference": difference,
                     "why": (_why(name, plan.cfg) if difference else None)})
    total = sched.total.read + sched.total.written
    return {"context": context, "unique_experts_per_layer": unique, "components": rows,
            "schedule_total": total, "roofline_total": step.total,
            "difference": total - step.total}


def plan_schedule(cfg: ModelConfig, batch: int, chip: str,
                  context: int | None = None) -> step_schedule.StepSchedule:
    """`mkresearch plan`'s schedule: one step of `cfg` built for `chip`, in the worst case or with
    every row at `context`. Shapes only: a full-size preset allocates nothing, and a config over
    one device's HBM or VMEM is planned, not refused (the report says so)."""
    plan = make_plan(cfg, batch, cfg.max_seq_len, MegakernelOptions(chip=chip), check_fits=False)
    return step_schedule.schedule(plan, None if context is None else [context] * batch)


def report(sched: step_schedule.StepSchedule) -> dict[str, Any]:
    """The schedule's summary, its HBM footprint against one device of its chip and the roofline
    comparison (JSON-able)."""
    plan = sched.plan
    footprint = roofline.hbm_footprint(plan.cfg, plan.options.chip, plan.batch, plan.seq_len)
    return {**sched.summary(),
            "hbm_footprint": {"needed": footprint.needed, "available": footprint.available,
                              "fits": footprint.fits()},
            "roofline": roofline_comparison(sched)}


def _mb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e10 else f"{n / 1e6:,.2f} MB"


def _table(title: str, rows: dict, with_layers: bool = False) -> list[str]:
    head = f"  {title:24s} {'layers':>6s} " if with_layers else f"  {title:31s} "
    lines = [head + f"{'DMAs':>9s} {'HBM read':>16s} {'HBM written':>14s}"]
    for name, row in rows.items():
        layers = f"{row.get('layers', ''):>6} " if with_layers else ""
        label = f"    {name:22s} {layers}" if with_layers else f"    {name:29s} "
        lines.append(f"{label}{row['dmas']:>9,d} {_mb(row['read']):>16s} "
                     f"{_mb(row['written']):>14s}")
    return lines


def format_report(sched: step_schedule.StepSchedule, report: dict) -> str:
    """The text `mkresearch plan` prints (report: `report(sched)`)."""
    r = report
    fit = r["hbm_footprint"]
    lines = [f"{r['model']} on {r['chip']}, B={r['batch']}, MLA cache {r['mla_cache_layout']}, "
             f"experts {r['expert_format']}: one megakernel step, {r['dmas']:,d} DMAs "
             f"({r['events']:,d} start/wait events)",
             ("  exact (positions and routing given)" if r["exact"]
              else "  assumed: " + "; ".join(r["assumptions"])),
             f"  HBM {_mb(r['hbm_bytes']['read'])} read + {_mb(r['hbm_bytes']['written'])} "
             f"written = {_mb(r['hbm_bytes']['total'])}"]
    if stand_in_note(r["model"]):  # one device's bytes, not a rank's of the sharded step
        lines.insert(1, f"  {stand_in_note(r['model'])}")
    if not fit["fits"]:
        lines.append(f"  weights, caches and states need {fit['needed'] / 1e9:,.1f} GB, more than "
                     f"one {r['chip']} device's {fit['available'] / 1e9:,.1f} GB: this is the "
                     "schedule of one device holding the whole model (shard it: kimi-k3-rank)")
    ring = r["ring"]
    if ring:
        per_stage = ", ".join(f"{k} {v}" for k, v in ring["blocks_per_stage"].items())
        lines.append(f"weight ring: {ring['depth']} slots of {ring['slot_shape']} bf16 "
                     f"({ring['slot_bytes'] / 2**20:.2f} MiB each); blocks per layer: {per_stage}")
    fetched = sorted(set(r["experts_fetched"].values()))
    lines.append(f"expert slots: {r['expert_slots']} per matrix (plan {r['expert_plan']}), experts "
                 f"fetched per routed layer: {', '.join(map(str, fetched)) or '-'}; KV tile "
                 f"{r['kv_tile']} tokens; LM head tile {r['vocab_tile']} columns")
    lines += _table("by stage", r["by_stage"])
    lines += _table("by layer kind", r["by_layer_kind"], with_layers=True)
    lines += _table("by buffer", r["by_buffer"])
    cmp = r["roofline"]
    lines.append(f"HBM bytes against roofline.step_bytes (context {cmp['context']}, "
                 f"{cmp['unique_experts_per_layer']} unique experts per MoE layer):")
    lines.append(f"    {'component':40s} {'schedule':>16s} {'roofline':>16s} {'difference':>14s}")
    for row in cmp["components"]:
        ours = row["schedule"]["read"] + row["schedule"]["written"]
        theirs = row["roofline"]["read"] + row["roofline"]["written"]
        lines.append(f"    {row['label']:40s} {_mb(ours):>16s} {_mb(theirs):>16s} "
                     f"{row['difference']:>+14,d}" + (f"  ({row['why']})" if row["why"] else ""))
    lines.append(f"    {'total':40s} {_mb(cmp['schedule_total']):>16s} "
                 f"{_mb(cmp['roofline_total']):>16s} {cmp['difference']:>+14,d}")
    late = r["late_prefetches"]
    lines.append("prefetch: " + ("the FFN's first weight block starts before attention's last is "
                                 "waited for, the next layer's before the FFN ends, the first "
                                 "expert right after routing, in every layer"
                                 if not any(late.values()) else f"late: {late}"))
    if not sched.vmem.fits():
        lines.append(f"the VMEM plan does not fit {sched.vmem.chip}: make_plan refuses to build "
                     "this step (shown here to see what does not fit)")
    return "\n".join(lines + [sched.vmem.table()])
