"""Every collective of one sharded decode step, listed (`mkresearch plan MODEL --ranks N`): the
kernel's own collectives (`kernels/sharded/collective_ops.py`, from the step's sharding plan) with
each collective's algorithm, its price and why (`interconnect.choose`), and what it overlaps.

`collective_plan(cfg, n_ranks, batch, ...)` returns the rows (JSON-able) and the count;
`format_plan` prints them. The count is the schedule's (an op run `count` times counts that often),
the number `mkresearch predict` reports as collectives per rank per step. For notebook 08:
`modes_table` (exact vs partial-sum: collectives, bytes, predicted step, parts) and `overlap`
(HBM busy while a collective is outstanding, from the predicted timeline).
"""

from __future__ import annotations

import itertools
from typing import Any

from mkresearch.hardware import interconnect as links
from mkresearch.kernels.compose import megakernel_sharded
from mkresearch.kernels.sharded import collective_ops as step_collectives
from mkresearch.kernels.sharded import plan as sharding
from mkresearch.model.config import ModelConfig
from mkresearch.prediction import scale_out
from mkresearch.prediction.timeline import merge_intervals
from mkresearch.sharding import layout as layouts

US = 1e-6


def describe_group(group: tuple[int, ...], n_ranks: int) -> str:
    """A group in words: every rank, or its size and first and last rank (and stride)."""
    if len(group) == n_ranks:
        return f"all {n_ranks}"
    stride = group[1] - group[0] if len(group) > 1 else 1
    if all(b - a == stride for a, b in itertools.pairwise(group)):
        step = f" step {stride}" if stride > 1 else ""
        return f"{len(group)}: {group[0]}..{group[-1]}{step}"
    return f"{len(group)}: {','.join(map(str, group))}"


def collective_plan(cfg: ModelConfig, n_ranks: int, batch: int = 1, *,
                    mode: str = "partial-sum", wire: str = "f32", chip: str = "tpu7x",
                    rank: int = 0) -> dict[str, Any]:
    """Rank `rank`'s collectives of one step of our layout, in issue order, each with its
    algorithm, phases, price and reason, and what it overlaps."""
    lay = layouts.layout(cfg, n_ranks, layouts.OURS, collectives=mode)
    inter = links.interconnect(chip, n_ranks=n_ranks)
    plan = sharding.sharding_plan(lay, batch, wire, chip)
    ops = step_collectives.collective_ops(plan, rank=rank)
    rows = [_row(inter, op, n_ranks) for op in ops]
    summary = step_collectives.summary(ops)
    by_algorithm: dict[str, int] = {}
    for row in rows:
        by_algorithm[row["algorithm"]] = by_algorithm.get(row["algorithm"], 0) + row["count"]
    # the weight blocks in flight while a collective is waited for: the kernel's ring at this batch
    ring = megakernel_sharded.ring_depth(
        lay, batch, options=megakernel_sharded.kernel_options(lay, batch, chip, wire), wire=wire)
    return {"model": cfg.name, "n_ranks": n_ranks, "batch": batch, "mode": mode, "wire": wire,
            "chip": chip, "slice": inter.slice.name, "rank": rank, "rows": rows,
            "ranks_per_host": plan.ranks_per_host, "reductions": dict(plan.algorithms),
            "ring_depth": ring.depth, "ring": ring.describe(),
            "count": sum(row["count"] for row in rows), "summary": summary,
            "by_algorithm": by_algorithm,
            "priced_us": sum(row["us"] * row["count"] for row in rows),
            "critical_us": sum(row["us"] * row["count"] for row in rows if row["critical"])}


def _row(inter: links.Interconnect, op: step_collectives.CollectiveOp, n_ranks: int) -> dict:
    """One collective's listing: as the kernel sends it, its price and why."""
    c = links.choose(inter, op.kind, tuple(op.group), float(op.payload_bytes))
    overlaps = (f"issued after {op.issue_after}, waited before {op.wait_before}"
                + ("" if op.critical else " (overlapped)")
                + (f"; carries the column chunks of {', '.join(op.carries)}" if op.carries else ""))
    how = op.sent_algorithm  # what the kernel sends
    if op.kind == "chain" or how == c.algorithm:
        how, price, reason = c.algorithm, c, c.reason
    else:  # an all-gather: the kernel sends them one-shot
        price = links.price_algorithm(inter, op.kind, how, tuple(op.group), op.payload_bytes)
        reason = (f"{how} {price.seconds / US:.3g} us in {price.phases} phase"
                  f"{'s' if price.phases != 1 else ''}: the kernel sends every all-gather "
                  f"{how}; {c.algorithm} would take {c.seconds / US:.3g} us")
    return {"layer": op.layer, "stage": op.stage, "name": op.name, "kind": op.kind,
            "group": describe_group(op.group, n_ranks), "group_size": len(op.group),
            "payload_bytes": op.payload_bytes, "dtype": op.dtype, "count": op.count,
            "algorithm": how, "phases": price.phases, "messages": price.messages,
            "us": price.seconds / US, "critical": op.critical,
            "reason": f"{reason}; {op.why}" if op.why else reason, "overlaps": overlaps}


def format_plan(plan: dict[str, Any]) -> str:
    """The listing: one line per collective (and its reason), then the count."""
    lines = [(f"{plan['model']} on {plan['n_ranks']} ranks ({plan['slice']}), B = "
              f"{plan['batch']}, {plan['mode']} collectives, partial sums as {plan['wire']}: "
              f"rank {plan['rank']}'s collectives of one step, in issue order"),
             (f"  {'layer':>5s} {'stage':8s} {'name':34s} {'kind':10s} {'group':16s} "
              f"{'bytes':>8s} {'x':>2s} {'algorithm':9s} {'ph':>2s} {'us':>6s}  overlaps / why")]
    for r in plan["rows"]:
        lines.append(f"  {r['layer']:5d} {r['stage']:8s} {r['name'][:34]:34s} {r['kind']:10s} "
                     f"{r['group'][:16]:16s} {r['payload_bytes']:8d} {r['count']:2d} "
                     f"{r['algorithm']:9s} {r['phases']:2d} {r['us']:6.2f}  {r['overlaps']}")
        lines.append(f"  {'':>5s} {'':8s} why: {r['reason']}")
    s = plan["summary"]
    lines.append(f"{plan['count']} collectives per rank per step ({', '.join(f'{k} {v}' for k, v in s['by_kind'].items())}; "
                 f"by algorithm: {', '.join(f'{k} {v}' for k, v in plan['by_algorithm'].items())}); "
                 f"at most {s['reductions_critical_max']} reductions per layer on the critical "
                 f"path; every collective counted (the release's ~188 of docs/collectives.md "
                 f"count only its two reductions per layer, not its gathers and sibling swaps: "
                 f"`predict` counts those too, its colls column); priced {plan['priced_us'] / 1e3:.2f} ms in all, "
                 f"{plan['critical_us'] / 1e3:.2f} ms of it not overlapped by the schedule")
    lines.append(f"{plan['ring']}; {plan['ring_depth'] - 1} weight blocks stay in flight while a "
                 "collective is waited for")
    if plan["mode"] == "partial-sum":
        hosts = (f"hosts of {plan['ranks_per_host']} ranks" if plan["ranks_per_host"]
                 else "one host")
        levels = ", ".join(f"{n} {a}" for n, a in plan["reductions"].items()) or "none"
        lines.append(f"the kernel as built for {plan['chip']} (its sharding "
                     f"plan, `kernels.sharded.plan`): reductions in levels over {hosts}: {levels}; the "
                     "rest one-shot; every algorithm adds a host's partials first, then the "
                     "hosts' sums (the same bits)")
    return "\n".join(lines)


# ---- exact vs partial-sum, side by side (notebook 08) ------------------------------------------
def modes_table(cfg: ModelConfig, n_ranks: int = 32, batches=(1, 2, 4, 8), *,
                chip: str = "tpu7x") -> list[dict[str, Any]]:
    """One row per collectives mode and batch: collectives per rank, per-rank bytes, the
    predicted step and its parts (ms, the slowest rank), the release's published step."""
    rows = []
    for mode in step_collectives.MODES:
        for batch in batches:
            p = scale_out.predict(cfg, n_ranks, layouts.OURS, batch, chip=chip, collectives=mode)
            published = p["published_step_s"]
            rows.append({"mode": mode, "batch": batch, "collectives": p["collectives_per_rank"],
                         "rank_gb": p["rank_bytes"] / 1e9, "step_ms": p["step_s"] * 1e3,
                         "published_ms": published * 1e3 if published else None,
                         "parts_ms": {k: v * 1e3 for k, v in p["parts_s"].items()}})
    return rows


def _overlap_s(xs, ys) -> float:
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += min(b, ys[k][1]) - max(a, ys[k][0])
            k += 1
    return total


def overlap(cfg: ModelConfig, n_ranks: int = 32, batch: int = 1, mode: str = "partial-sum", *,
            chip: str = "tpu7x", window_us: tuple[float, float] | None = None) -> dict[str, Any]:
    """Rank 0's predicted step: when HBM streams and when a collective is outstanding (issued,
    not yet complete), and how much of the outstanding time HBM stays busy (the whole step);
    `rows` are the intervals inside `window_us` (default 100 us from the step's middle)."""
    p = scale_out.predict(cfg, n_ranks, layouts.OURS, batch, chip=chip, collectives=mode,
                          keep_timeline=True)
    t = p["timeline"]
    hbm = merge_intervals((s.start, s.end) for s in t.timelines[0].spans if s.kind == "dma")
    rank = t.ranks[0]
    outstanding = [(run.arrivals[run.group.index(rank)], run.end, run.name)
                   for run in t.collectives if rank in run.group]
    pending = merge_intervals((a, b) for a, b, _ in outstanding)
    busy = _overlap_s(pending, hbm)
    lo, hi = window_us or (p["step_s"] * 0.5e6, p["step_s"] * 0.5e6 + 100)
    rows = [{"lane": "HBM", "name": "weights", "start_us": a * 1e6, "end_us": b * 1e6}
            for a, b in hbm if b * 1e6 > lo and a * 1e6 < hi]
    rows += [{"lane": "collective", "name": name, "start_us": a * 1e6, "end_us": b * 1e6}
             for a, b, name in outstanding if b * 1e6 > lo and a * 1e6 < hi]
    outstanding_s = sum(b - a for a, b in pending)
    return {"mode": mode, "batch": batch, "step_ms": p["step_s"] * 1e3,
            "outstanding_ms": outstanding_s * 1e3, "hbm_busy_ms": busy * 1e3,
            "hbm_busy_fraction": busy / outstanding_s if outstanding_s else 0.0,
            "window_us": (lo, hi), "rows": rows}
