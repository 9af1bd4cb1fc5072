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

At one row the MXU's time is its weight push (2 x weights x 256 / peak, however few rows).
`one_row_rates` asks whether a vector unit could take a one-row product faster, priced from the
only public figure of a TPU vector unit (v5p's, docs/tpu.md §1), and `vector_unit_step` prices
our step with every bf16 product at the rate it would win at.
"""

from __future__ import annotations

from typing import Any

from mkresearch.model.config import ModelConfig
from mkresearch.prediction import calibration, design_table
from mkresearch.prediction import timeline_chip as tchip

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


# A one-row product x[K] W[K, N] on the vector unit: W's K rows on the sublanes and N on the lanes,
# x[k] broadcast along the lanes once per row of vregs, the sum over k added elementwise into an
# accumulator. Operations per weight: a multiply and an add; an fp8 value converted first; an MXFP4
# code shifted out of its word, masked and converted first. (A decode done on whole words, several
# codes at once, could cost less; fp8 and MXFP4 lose to the MXU even at two operations a weight.)
VPU_OPS_PER_WEIGHT = {"bf16": 2, "fp8": 3, "mxfp4": 5}


def one_row_rates(model: calibration.Model = design_table.SAME_ASSUMPTIONS) -> dict[str, dict]:
    """Weights one TensorCore multiplies per second on one row, per stored format: the MXU's
    (its weight push at the peak of what it is handed: bf16 as bf16, fp8 and MXFP4 as fp8, as
    our kernel hands them) and a vector unit's of v5p's published width and clock
    (`VPU_OPS_PER_WEIGHT` operations each); {"mxu", "vpu", "vpu_over_mxu"}."""
    chip = model.timeline_chip or tchip.timeline_chip("tpu7x")
    vpu_ops_per_s = tchip.V5P_VPU_OPS_PER_CYCLE * tchip.V5P_CLOCK_HZ
    rates = {}
    for fmt, ops in VPU_OPS_PER_WEIGHT.items():
        peak = chip.mxu_flops if fmt == "bf16" else (chip.fp8_flops or chip.mxu_flops)
        mxu = peak / (2.0 * chip.mxu_rows)
        vpu = vpu_ops_per_s / ops
        rates[fmt] = {"mxu": mxu, "vpu": vpu, "vpu_over_mxu": vpu / mxu}
    return rates


def vector_unit_step(cfg: ModelConfig, n_ranks: int = 32, batch: int = 1, *,
                     model: calibration.Model = design_table.SAME_ASSUMPTIONS) -> dict[str, float]:
    """Our step (the designs' last row) as modelled, and with every bf16 product on `batch` rows
    taken at the vector unit's rate where that is faster than the MXU's (`one_row_rates`, the
    vector unit's time growing with the rows, the MXU's flat below its 256), fp8 and MXFP4
    products left on the MXU: {"step_ms", "vector_step_ms", "bf16_speedup"}. A what-if: it
    rests on TPU7x's vector unit being at least v5p's."""
    speedup = max(1.0, one_row_rates(model)["bf16"]["vpu_over_mxu"] / batch)
    _, ours = _last_design(cfg, n_ranks, batch, model)
    moved = model.scaled("timeline_chip", {"mxu_flops": speedup}, n_ranks)
    return {"step_ms": ours(model)["step_s"] * 1e3, "vector_step_ms": ours(moved)["step_s"] * 1e3,
            "bf16_speedup": speedup}


def _last_design(cfg: ModelConfig, n_ranks: int, batch: int, model: calibration.Model,
                 sequences: int | None = None):
    """The designs' last row at `batch` rows: its label, and its step under a given Model."""
    label, variant, fields = design_table.design_steps(cfg, n_ranks, batch, model=model)[-1]
    return label, lambda m: design_table.predict_design(variant, n_ranks, batch, m,
                                                        sequences=sequences, **fields)


def step_bounds(cfg: ModelConfig, n_ranks: int = 32, batch: int = 1, *,
                model: calibration.Model = design_table.SAME_ASSUMPTIONS,
                factor: float = FASTER, sequences: int | None = None) -> list[dict[str, Any]]:
    """One row per side (ours: the designs' last row at `batch` rows; the release's where it is
    modelled) and resource: {"batch", "sequences", "side", "resource", "step_ms", "saved_ms"},
    the first of each side's rows "as modelled" (saved 0). `sequences` (default `batch`): the
    sequences the rows belong to, as `scale_out.predict`'s (a verify step of B (k + 1) rows:
    B sequences, the designs chosen at its rows as `speculative_designs` prices them)."""
    label, ours = _last_design(cfg, n_ranks, batch, model, sequences)
    sides = [(f"ours ({label.removeprefix('+ ')})", ours)]
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
