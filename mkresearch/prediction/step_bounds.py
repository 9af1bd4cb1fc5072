"""What a predicted step waits for: the step again with one resource made `FASTER` times faster,
everything else held, for ours (the designs' last row: every design of `design_table` added,
the router placement, expert split and slots chosen under the shared assumptions) and for the
release's modelled step, under one `calibration.Model`.

The parts a prediction reports (`timeline_ranks.PARTS`) count the HBM floor first: a copy moving
while the MXU works is "HBM busy", whether or not the step waits for it. This asks the other
question: which resource, made faster, shortens the step. The kernel stays the same (its ring
depth, slots, placement and split, priced as the shared assumptions chose them); only the
figure moves:

    weight and expert reads   the DMA rate (TimelineChip.dma_bandwidth)
    the MXU                   its bf16 and fp8 peaks (mxu_flops, fp8_flops)
    the vector unit           the rows' own work (vpu_flops, an ASSUMPTION)
    collective latency        a phase's latency, a hop's, the sibling path's
    link bandwidth            the ICI links, a core's injection, the sibling path

    rows = step_bounds(cfg, 32, batch=1)    # one row per side and resource (and "as modelled")
    print(format_step_bounds(rows, context=512))
    step_bounds(cfg, 32, batch=8, sequences=1)  # a verify step: 7 drafts and the last token

`mkresearch predict MODEL --designs --bounds` prints it after the designs' table, and with
`--speculate K` for each verify step of B (K + 1) rows.
"""

from __future__ import annotations

from typing import Any

from mkresearch.model.config import ModelConfig
from mkresearch.prediction import calibration, design_table

FASTER = 10.0
AS_MODELLED = "as modelled"
# (resource, the Model's field it lives in, its figures, whether a faster resource is a larger
# figure (a rate) or a smaller one (a latency))
RESOURCES = (
    ("weight and expert reads", "timeline_chip", ("dma_bandwidth",), True),
    ("the MXU", "timeline_chip", ("mxu_flops", "fp8_flops"), True),
    ("the vector unit", "timeline_chip", ("vpu_flops",), True),
    ("collective latency", "interconnect", ("ici_latency", "hop_latency", "sibling_latency"),
     False),
    ("link bandwidth", "interconnect", ("ici_bandwidth", "injection_bandwidth",
                                        "sibling_bandwidth"), True),
)


def faster(model: calibration.Model, resource: str, n_ranks: int,
           factor: float = FASTER) -> calibration.Model:
    """`model` with `resource` (one of RESOURCES) `factor` times faster, the rest held
    (`Model.scaled`; its links, where it names none, those of n_ranks)."""
    for name, where, figures, rate in RESOURCES:
        if name == resource:
            return model.scaled(where, dict.fromkeys(figures, factor if rate else 1 / factor),
                                n_ranks)
    raise ValueError(f"resource={resource!r} is invalid: one of "
                     f"{', '.join(repr(r[0]) for r in RESOURCES)}")


def step_bounds(cfg: ModelConfig, n_ranks: int = 32, batch: int = 1, *,
                model: calibration.Model = design_table.SAME_ASSUMPTIONS,
                factor: float = FASTER, sequences: int | None = None) -> list[dict[str, Any]]:
    """One row per side (ours: the designs' last row at `batch` rows; the release's where it is
    modelled) and resource: {"batch", "sequences", "side", "resource", "step_ms", "saved_ms"},
    the first of each side's rows "as modelled" (saved 0). `sequences` (default `batch`): the
    sequences the rows belong to, as `scale_out.predict`'s (a verify step of B (k + 1) rows:
    B sequences, the designs chosen at its rows as `speculative_designs` prices them)."""
    label, variant, fields = design_table.design_steps(cfg, n_ranks, batch, model=model)[-1]
    sides = [(f"ours ({label.removeprefix('+ ')})",
              lambda m: design_table.predict_design(variant, n_ranks, batch, m,
                                                    sequences=sequences, **fields))]
    if design_table.release_modelled(cfg, n_ranks):
        sides.append(("the release (modelled)",
                      lambda m: m.predict(cfg, batch, sequences=sequences)))
    rows = []
    for side, predict in sides:
        base_s = predict(model)["step_s"]
        for resource in (AS_MODELLED, *(r[0] for r in RESOURCES)):
            step_s = base_s if resource == AS_MODELLED else \
                predict(faster(model, resource, n_ranks, factor))["step_s"]
            rows.append({"batch": batch, "sequences": sequences or batch, "side": side,
                         "resource": resource, "step_ms": step_s * 1e3,
                         "saved_ms": (base_s - step_s) * 1e3})
    return rows


def format_step_bounds(rows: list[dict[str, Any]], context: int,
                       factor: float = FASTER) -> str:
    """The rows of `step_bounds` (any batches) as a table: a column per side; a verify step's
    rows named with the sequences they belong to."""
    lines = [(f"what the step waits for (scale-out model, context {context}): the step with "
              f"one resource {factor:g}x faster, everything else held (the same kernel); ms, "
              "and the ms it saves:")]
    for batch, sequences in dict.fromkeys((r["batch"], r["sequences"]) for r in rows):
        at = [r for r in rows if (r["batch"], r["sequences"]) == (batch, sequences)]
        sides = list(dict.fromkeys(r["side"] for r in at))
        step = f"B = {batch}" if sequences == batch else \
            f"the verify step of B = {sequences}: {batch} rows"
        lines.append(f"  {step}")
        lines.append(f"  {'resource':32s}" + "".join(f" {s:>36s}" for s in sides))
        for resource in dict.fromkeys(r["resource"] for r in at):
            cells = []
            for side in sides:
                r = next(r for r in at if r["side"] == side and r["resource"] == resource)
                saved = f"(-{r['saved_ms']:.2f})" if resource != AS_MODELLED else ""
                cells.append(f" {r['step_ms']:27.2f} {saved:>8s}")
            lines.append((f"  {resource:32s}" + "".join(cells)).rstrip())
    return "\n".join(lines)
