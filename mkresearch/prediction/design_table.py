"""What each design of `prediction.designs` buys our step, priced by the scale-out model under the
same assumptions as the release's (`calibration.Model`): nothing fitted to a step time.

`router_placements(cfg, n_ranks, batch)`: each router placement with its bytes per rank, the
collective it needs before top-k (its latency as priced) and the predicted step, each as the
kernel runs it (`MegakernelOptions.router_placement`, `decode --ranks N --router P`: its layout's
bytes, its collectives; in the kernel's restructured mode); the chosen one is the fastest
predicted (per model and batch), the kernel's default "split" (as built). `designs_table(cfg,
batches)`: ours as built, then each design added in turn (experts to the MXU as fp8, expert reads
first, rho by reduce-scatter: the kernel's restructured mode, the chosen router placement, bf16
partial sums: the kernel built with a bf16 wire, the chosen expert-tensor split: its layout's
`etp` chosen together with the count of expert slots, `MegakernelOptions.expert_slots`), beside
the release's modelled step. `expert_layouts(cfg, n_ranks, batch, ...)`: each expert-tensor split
the partial-sum modes take with each count of expert slots the kernel takes, the step each
predicts; the fastest chosen. `expert_splits`: its rows at the default slots (`plan` prints
them).
`mkresearch plan MODEL --ranks N` prints the first, `mkresearch predict MODEL --ranks N --designs`
the second. `design_steps` is the one list of designs (`predict_design` prices one): the plain
table prices it at B rows, `speculative_designs` at a verify step's B (k + 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mkresearch.hardware import interconnect as links
from mkresearch.kernels.compose import megakernel_plan as mplan
from mkresearch.model import partition
from mkresearch.model.config import ModelConfig
from mkresearch.prediction import calibration, designs, scale_out
from mkresearch.sharding import layout as layouts

SAME_ASSUMPTIONS = calibration.Model()  # the default: ours and the release's shared defaults


def predict_design(cfg: ModelConfig, n_ranks: int, batch: int, model: calibration.Model, *,
                   collectives: str = layouts.PARTIAL_SUM, wire: str = "f32",
                   sequences: int | None = None, **fields: Any) -> dict:
    """Our step at `batch` under `model` as the kernel in mode `collectives` with `wire` runs it
    (`our_schedule`), with `fields` of its schedule set (`Schedule.designs`, `expert_order`);
    `sequences`: as `scale_out.predict`'s; `etp` among the fields: the kernel built with its
    experts split so (its layout, bytes and ring depth); `expert_slots`: the kernel built with
    that many VMEM slots per expert matrix (its ring as deep as VMEM still allows)."""
    sched = design_schedule(cfg, n_ranks, batch, collectives=collectives, wire=wire, **fields)
    return scale_out.predict(cfg, n_ranks, layouts.OURS, batch, schedule=sched,
                             interconnect=model.interconnect, timeline_chip=model.timeline_chip,
                             context=model.context, prefetch_across=model.prefetch_across,
                             sequences=sequences)


def design_schedule(cfg: ModelConfig, n_ranks: int, batch: int, *,
                    collectives: str = layouts.PARTIAL_SUM, wire: str = "f32",
                    **fields: Any) -> scale_out.Schedule:
    """Our kernel's Schedule at `batch` in mode `collectives` with `wire`, built with `fields`
    (`predict_design`'s): its ring as deep as VMEM allows beside them."""
    base = scale_out.our_schedule(
        cfg, collectives, n_ranks, batch, wire=wire, etp=fields.pop("etp", None),
        router=designs.router_placement(fields.get("designs", ())),
        expert_slots=fields.pop("expert_slots", None))
    return dataclasses.replace(base, **fields)


def router_placements(cfg: ModelConfig, n_ranks: int, batch: int = 1, *,
                      model: calibration.Model = SAME_ASSUMPTIONS,
                      collectives: str = layouts.RESTRUCTURED,
                      expert_order: str = "first") -> dict[str, Any]:
    """Each placement (in the kernel's mode `collectives`, with `expert_order`): group size, GB
    per rank, the scores' collective before top-k (us per layer, as priced; 0 replicated),
    predicted step; "chosen": the fastest. JSON-able."""
    inter = model.interconnect or links.interconnect("tpu7x", n_ranks=n_ranks)
    per_host = scale_out.our_schedule(cfg, "partial-sum", n_ranks, batch).ranks_per_host \
        or n_ranks
    rows = []
    for placement in designs.ROUTER_PLACEMENTS:
        group = designs.router_group(placement, 0, n_ranks, per_host)
        chosen = () if placement == designs.SPLIT else (f"router-{placement}",)
        p = predict_design(cfg, n_ranks, batch, model, collectives=collectives, designs=chosen,
                           expert_order=expert_order)
        piece = designs.scores_bytes(batch, cfg.n_experts, len(group))
        if placement == designs.SPLIT:  # as built: scores and latent in one gather
            piece += designs.scores_bytes(batch, cfg.moe_latent, n_ranks)  # the latent's piece
        us = 0.0 if len(group) == 1 else links.price(inter, "all_gather", "one-shot", group,
                                                     piece).seconds * 1e6
        rows.append({"placement": placement, "group": len(group),
                     "rank_gb": p["rank_bytes"] / 1e9, "before_top_k_us": us,
                     "step_ms": p["step_s"] * 1e3, "collectives_per_rank":
                     p["collectives_per_rank"]})
    best = min(rows, key=lambda r: r["step_ms"])
    return {"model": cfg.name, "n_ranks": n_ranks, "batch": batch, "rows": rows,
            "with": [collectives, f"expert reads {expert_order}"],
            "chosen": best["placement"], "kernel_default": designs.SPLIT,
            "ranks_per_host": per_host}


def format_router_placements(table: dict[str, Any]) -> str:
    lines = [(f"router placements ({table['model']} on {table['n_ranks']} ranks, B = "
              f"{table['batch']}, with {', '.join(table['with'])}; predicted by the scale-out "
              "model, the same assumptions as the release's):"),
             (f"  the kernel runs each (decode --ranks {table['n_ranks']} --router P: "
              "MegakernelOptions.router_placement, on hosts of "
              f"{table['ranks_per_host']} ranks); as built: {table['kernel_default']}"),
             (f"  {'placement':10s} {'group':>5s} {'GB/rank':>8s} {'before top-k us':>15s} "
              f"{'step ms':>8s}")]
    for r in table["rows"]:
        marks = [m for m, on in (("as built", r["placement"] == table["kernel_default"]),
                                 ("chosen (fastest predicted)", r["placement"] == table["chosen"]))
                 if on]
        mark = f"  <- {', '.join(marks)}" if marks else ""
        lines.append(f"  {r['placement']:10s} {r['group']:5d} {r['rank_gb']:8.2f} "
                     f"{r['before_top_k_us']:15.2f} {r['step_ms']:8.2f}{mark}")
    return "\n".join(lines)


def designs_table(cfg: ModelConfig, n_ranks: int = 32, batches=calibration.BATCHES, *,
                  model: calibration.Model = SAME_ASSUMPTIONS) -> list[dict]:
    """Per batch: ours as built, then each design added in turn, and the release's modelled
    step, all under `model`; each with its step, GB per rank, the serial chain of collective
    latencies (rank 0's collectives' prices in sequence, `scale_out.predict`'s
    serial_chain_s), the exposed collective messages and its ratio to the release's."""
    out = []
    for batch in batches:
        release = model.predict(cfg, batch) if release_modelled(cfg, n_ranks) else None
        for label, p in design_predictions(cfg, n_ranks, batch, model=model):
            out.append(_row(batch, label, p, release))
        if release is not None:
            out.append(_row(batch, "the release (modelled)", release, release))
    return out


def expert_layouts(cfg: ModelConfig, n_ranks: int, batch: int, *,
                   model: calibration.Model = SAME_ASSUMPTIONS,
                   slot_counts: tuple[int, ...] = mplan.EXPERT_SLOTS,
                   **fields: Any) -> dict[str, Any]:
    """Each expert-tensor split the kernel's partial-sum modes take (`partition.expert_tp_ways`:
    each expert's hidden over etp ranks, EP = n_ranks / etp groups; `layout.layout(etp=)`) with
    each count of VMEM slots per expert matrix in `slot_counts` (`MegakernelOptions.expert_slots`:
    item i's reads go to slot i mod n, so n - 1 experts' reads move while one is multiplied), our
    step with `fields` of its schedule (the designs before it) predicted for each, its ring as
    deep as VMEM still allows beside the slots: rows of etp, EP, slots, ring slots, step ms and
    whether the kernel plans it ("planned": False, over VMEM, priced but not chosen while
    another is planned); "chosen": the fastest planned (etp, slots) (fewer slots, then fewer
    ways, of equal steps; of all when none is planned: more rows than the kernel plans),
    "as_built": the layout's split and the option's default. The two are chosen together: a
    split's groups
    fetch more experts each as etp falls, a count of slots hides an expert's MXU time behind the
    next reads, so the best count depends on the split."""
    rows = []
    for etp in partition.expert_tp_ways(cfg, n_ranks, columns=False):
        for slots in slot_counts:
            p = predict_design(cfg, n_ranks, batch, model, etp=etp, expert_slots=slots, **fields)
            rows.append({"etp": etp, "ep": n_ranks // etp, "slots": slots,
                         "ring": p["schedule"]["banks"] + 1, "step_ms": p["step_s"] * 1e3,
                         "planned": p["schedule"]["kernel_plans"]})
    best = min([r for r in rows if r["planned"]] or rows,
               key=lambda r: (r["step_ms"], r["slots"], r["etp"]))
    return {"rows": rows, "chosen": {"etp": best["etp"], "slots": best["slots"]},
            "as_built": {"etp": partition.default_etp(cfg, n_ranks),
                         "slots": mplan.MegakernelOptions().expert_slots}}


def expert_splits(cfg: ModelConfig, n_ranks: int, batch: int, *,
                  model: calibration.Model = SAME_ASSUMPTIONS, **fields: Any) -> dict[str, Any]:
    """`expert_layouts` at the kernel's default expert slots (what `plan` prints): rows of etp,
    EP, step ms and "planned"; "chosen": the fastest planned split (the routed experts' uniform
    routing spreads over fewer, larger groups as etp grows, so the slowest group waits less),
    "as_built": the layout's default."""
    table = expert_layouts(cfg, n_ranks, batch, model=model,
                           slot_counts=(mplan.MegakernelOptions().expert_slots,), **fields)
    kept = ("etp", "ep", "step_ms", "planned")
    return {"rows": [{k: r[k] for k in kept} for r in table["rows"]],
            "chosen": table["chosen"]["etp"], "as_built": table["as_built"]["etp"]}


def format_expert_splits(table: dict[str, Any], model: str, n_ranks: int, batch: int) -> str:
    lines = [(f"expert-tensor splits ({model} on {n_ranks} ranks, B = {batch}, in the "
              "restructured mode with expert reads first; predicted by the scale-out model, the "
              "same assumptions as the release's):"),
             (f"  the kernel runs each it plans (decode --ranks {n_ranks} --etp N: "
              f"each expert's hidden over N ranks, W2 by its rows); as built: "
              f"{table['as_built']}"),
             f"  {'ETP':>5s} {'EP groups':>9s} {'step ms':>8s}"]
    for r in table["rows"]:
        marks = [m for m, on in (("as built", r["etp"] == table["as_built"]),
                                 ("chosen (fastest predicted)", r["etp"] == table["chosen"]),
                                 ("no kernel plan: over VMEM", not r["planned"]))
                 if on]
        mark = f"  <- {', '.join(marks)}" if marks else ""
        lines.append(f"  {r['etp']:5d} {r['ep']:9d} {r['step_ms']:8.2f}{mark}")
    return "\n".join(lines)


def release_modelled(cfg: ModelConfig, n_ranks: int) -> bool:
    """Whether the release's step is modelled beside ours (its program: Kimi K3 on 32 ranks)."""
    return cfg.name == "kimi-k3" and n_ranks == 32


def design_steps(cfg: ModelConfig, n_ranks: int, batch: int, *,
                 model: calibration.Model = SAME_ASSUMPTIONS) -> list[tuple[str, ModelConfig,
                                                                            dict]]:
    """Ours as built, then each design added in turn, at `batch` rows (the router placement
    chosen at them): (label, the config, the fields of our Schedule it sets). The one list every
    table of designs prices: `designs_table` (the plain step) and
    `speculative_designs` (the verify step of B (k + 1) rows)."""
    placement = router_placements(cfg, n_ranks, batch, model=model)["chosen"]
    router = () if placement == designs.SPLIT else (f"router-{placement}",)
    # experts handed to the MXU as fp8 (ModelConfig.expert_mxu) where they are stored so
    fp8 = cfg.replace(expert_mxu="fp8") if cfg.expert_format != "bf16" else None
    rho = layouts.RESTRUCTURED  # the kernel's mode: rho by a one-phase reduce-scatter
    wire = {"expert_order": "first", "wire": "bf16", "collectives": rho, "designs": router}
    experts = expert_layouts(fp8 or cfg, n_ranks, batch, model=model, **wire)["chosen"]
    return [("as built", cfg, {}),
            *([("+ experts to the MXU as fp8", fp8, {})] if fp8 else []),
            ("+ expert reads first", fp8 or cfg, {"expert_order": "first"}),
            ("+ rho by reduce-scatter", fp8 or cfg, {"expert_order": "first",
                                                     "collectives": rho}),
            (f"+ router {placement}", fp8 or cfg, {
                "expert_order": "first", "collectives": rho, "designs": router}),
            ("+ bf16 partial sums", fp8 or cfg, wire),
            (f"+ experts {experts['etp']} ways, {experts['slots']} slots", fp8 or cfg,
             {**wire, "etp": experts["etp"], "expert_slots": experts["slots"]})]


def design_predictions(cfg: ModelConfig, n_ranks: int, batch: int, *,
                       model: calibration.Model = SAME_ASSUMPTIONS,
                       sequences: int | None = None) -> list[tuple[str, dict]]:
    """(label, `scale_out.predict`'s row) of each of `design_steps` at `batch` rows, under
    `model`; `sequences` (default `batch`): the sequences the rows belong to (a verify step)."""
    return [(label, predict_design(variant, n_ranks, batch, model, sequences=sequences,
                                   **fields))
            for label, variant, fields in design_steps(cfg, n_ranks, batch, model=model)]


def _row(batch: int, label: str, p: dict, release: dict | None) -> dict:
    parts = p["parts_s"]
    return {"batch": batch, "design": label, "step_ms": p["step_s"] * 1e3,
            "rank_gb": p["rank_bytes"] / 1e9,
            "chain_ms": p["serial_chain_s"] * 1e3,
            "collective_ms": parts["collective_messages"] * 1e3,
            "over_release": p["step_s"] / release["step_s"] if release else None,
            "published_ms": (p["published_step_s"] or 0) * 1e3 or None,
            "kernel_plans": p["schedule"]["kernel_plans"]}


UNPLANNED = " *"  # after a design no kernel plans
UNPLANNED_NOTE = ("  * no kernel plans this step (over the core's VMEM, or more rows than it "
                  "plans): priced anyway")


def design_label(label: str, kernel_plans: bool) -> str:
    """A design's label in a table, marked when no kernel plans it (`UNPLANNED_NOTE`)."""
    return label if kernel_plans else label + UNPLANNED


def format_designs(rows: list[dict], context: int) -> str:
    """The designs table; `context`: the cached positions per sequence it was priced at (the
    Model's), named so that its as-built row reads beside `full_size`'s line at context 0."""
    lines = [("designs of our step, each added in turn (scale-out model; ours and the release "
              f"under the same assumptions, `predict --json`: assumptions; context {context}); "
              "coll = the slowest "
              "rank's exposed collective messages; chain = rank 0's collectives' latencies in "
              "sequence, one issued early counting only what its overlap left:"),
             (f"  {'B':>2s} {'design':30s} {'step ms':>8s} {'GB/rank':>8s} {'coll ms':>8s} "
              f"{'chain ms':>8s} {'/release':>8s}")]
    for r in rows:
        ratio = f"{r['over_release']:8.2f}" if r["over_release"] else f"{'':8s}"
        label = design_label(r["design"], r["kernel_plans"])
        lines.append(f"  {r['batch']:2d} {label:30s} {r['step_ms']:8.2f} "
                     f"{r['rank_gb']:8.2f} {r['collective_ms']:8.2f} {r['chain_ms']:8.2f} "
                     f"{ratio}")
    if not all(r["kernel_plans"] for r in rows):
        lines.append(UNPLANNED_NOTE)
    return "\n".join(lines)
