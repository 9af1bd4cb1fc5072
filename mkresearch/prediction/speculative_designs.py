"""Speculative decoding with each design of our step, predicted (`mkresearch predict MODEL
--speculate K --designs`): per batch B, ours as built, then each design added in turn
(`design_table.design_steps`: the one list the plain table prices too), then the release as
modelled; each with its verify step, the drafter's pass, tok/s at each acceptance length and its
time per token over the release's. Both sides under one `calibration.Model` (the same
assumptions as `predict --designs` and `--validate`: the benchmark's mean context unless told).

A verify step of B rows with k drafts is the decode step of B (k + 1) rows with each sequence's
states and cache read once (`speculative_predict`: `scale_out.predict(..., sequences=B)`). A
design's verify step is priced exactly as the plain designs table prices that design at
B (k + 1) rows: the same config, our kernel's schedule at those rows with the same fields (the
router placement the plain table chooses at those rows), the same Model; only `sequences`
differs. The release's row is `speculative_predict.predict_speculative` of its layout under the
Model, the same call `calibration.validation` makes for the published 350 and 709 tok/s. The
drafter (the release's DSpark pass, `speculative_predict.drafter_s`) stands beside every row.
"""

from __future__ import annotations

from mkresearch.model.config import ModelConfig
from mkresearch.prediction import calibration, design_table
from mkresearch.prediction import speculative_predict as speculative
from mkresearch.sharding import layout as layouts

RELEASE_LABEL = "the release (modelled)"


def speculative_designs(cfg: ModelConfig, n_ranks: int = 32, batches=(1,), *,
                        drafts: int = speculative.RELEASE_DRAFTS,
                        acceptances: tuple[int, ...] = (3, 6),
                        model: calibration.Model = design_table.SAME_ASSUMPTIONS) -> list[dict]:
    """One row per (batch, design), JSON-able: the verify step of B (k + 1) rows, the drafter's
    pass, their sum (the step), tok/s = B a / step at each acceptance length a (keyed by str(a)),
    GB per rank of the verify step, its time per token over the release's (None where the
    release is not modelled) and, on the release's row, the published tok/s. Every argument is
    checked before any prediction (ValueError naming it)."""
    verify_rows = {batch: speculative.check_verify(batch, drafts) for batch in batches}
    speculative.check_acceptances(acceptances, drafts)
    out = []
    for batch, rows in verify_rows.items():
        drafting = speculative.drafter_s(cfg, drafts, batch, n_ranks=n_ranks,
                                         interconnect=model.interconnect,
                                         timeline_chip=model.timeline_chip,
                                         prefetch_across=model.prefetch_across)
        release = speculative.predict_speculative(
            cfg, n_ranks, layouts.RELEASE, batch=batch, drafts=drafts, acceptances=acceptances,
            interconnect=model.interconnect, timeline_chip=model.timeline_chip,
            schedule=model.schedule, context=model.context,
            prefetch_across=model.prefetch_across) \
            if design_table.release_modelled(cfg, n_ranks) else None
        release_step = release[0]["step_s"] if release else None
        for label, verify in design_table.design_predictions(cfg, n_ranks, rows, model=model,
                                                             sequences=batch):
            out.append(_row(batch, drafts, label, verify, drafting, acceptances, release_step))
        if release:
            published = {str(r["acceptance"]): r["published_tok_s"] for r in release}
            out.append(_row(batch, drafts, RELEASE_LABEL,
                            {"step_s": release[0]["verify_step_s"],
                             "rank_bytes": release[0]["rank_bytes"],
                             "schedule": release[0]["schedule"]},
                            release[0]["draft_step_s"], acceptances, release_step,
                            published if any(published.values()) else None))
    return out


def _row(batch: int, drafts: int, label: str, verify: dict, drafting: float,
         acceptances: tuple[int, ...], release_step: float | None,
         published: dict | None = None) -> dict:
    step = verify["step_s"] + drafting
    return {"batch": batch, "drafts": drafts, "verify_rows": batch * (drafts + 1),
            "design": label, "verify_ms": verify["step_s"] * 1e3, "draft_ms": drafting * 1e3,
            "step_ms": step * 1e3,
            "rank_gb": verify["rank_bytes"] / 1e9,
            "tokens_per_s": {str(a): batch * a / step for a in acceptances},
            "over_release": step / release_step if release_step else None,
            "published_tok_s": published, "schedule": verify["schedule"]}


def format_speculative_designs(rows: list[dict], model: str, n_ranks: int, context: int) -> str:
    """The table: per batch and design, verify and drafter ms, tok/s at each acceptance, the
    time per token over the release's; the published tok/s beside the release's rows."""
    first = rows[0]
    accepted = list(first["tokens_per_s"])
    release = any(r["design"] == RELEASE_LABEL for r in rows)
    lines = [(f"speculative decoding with each design of our step ({model} on {n_ranks} ranks, "
              f"k = {first['drafts']} drafts per verify step: B x {first['drafts'] + 1} verify "
              "rows through one weight pass, each sequence's states read once; context "
              f"{context}; scale-out model"
              + (", ours and the release under the same assumptions" if release else "")
              + "; timeline model prediction, not measured):"),
             (f"  {'B':>2s} {'rows':>4s} {'design':30s} {'verify ms':>9s} {'draft ms':>8s} "
              f"{'GB/rank':>7s} "
              + " ".join(f"{'tok/s a=' + a:>10s}" for a in accepted) + f" {'/release':>8s}")]
    for r in rows:
        ratio = f"{r['over_release']:8.2f}" if r["over_release"] else f"{'-':>8s}"
        label = design_table.design_label(r["design"], r["schedule"]["kernel_plans"])
        lines.append(f"  {r['batch']:2d} {r['verify_rows']:4d} {label:30s} "
                     f"{r['verify_ms']:9.2f} {r['draft_ms']:8.2f} {r['rank_gb']:7.2f} "
                     + " ".join(f"{r['tokens_per_s'][a]:10.0f}" for a in accepted)
                     + f" {ratio}")
        if r["published_tok_s"]:
            lines.append(f"  {'':2s} {'':4s} {'  published':30s} {'':9s} {'':8s} {'':7s} "
                         + " ".join(f"{r['published_tok_s'][a] or '-':>10}" for a in accepted))
    drafter = ("the drafter (the release's DSpark pass over every sequence's block) beside "
               "either side's verify step" if first["draft_ms"] else
               f"no drafter known for {model}: the verify step alone")
    ratio = ("/release: time per token over the release's modelled" if release else
             "/release: - (the release is modelled for Kimi K3 on 32 ranks only)")
    lines.append("  a: tokens emitted per verify step (accepted drafts and the bonus token); "
                 f"tok/s = B a / (verify + draft), over B sequences; {ratio}; {drafter}")
    if not all(r["schedule"]["kernel_plans"] for r in rows):
        lines.append(design_table.UNPLANNED_NOTE)
    return "\n".join(lines)
