"""Speculative decoding at full size, predicted: tok/s of verify steps beside the release's
published 350 and 709 tok/s (Kimi K3, 32 TPU7x cores, forced acceptance lengths 3 and 6).

A verify step scores, for each of B rows, the last accepted token and k drafts: B (k + 1) verify
rows through one weight pass. It is predicted as the decode step of B (k + 1) rows
(`scale_out.predict` at that batch): the weights once, the routing and the experts of every verify
row, per-row compute and per-row collective messages, and the recurrent state of every verify row
(the per-position KDA states a verify step keeps for rollback). With acceptance length a the step
emits B a tokens, so tok/s = B a / step.

Reading the published numbers (docs/tpu.md gives "forced acceptance length 6: 709 tok/s; at
acceptance 3: 350"), with B = 1 (ASSUMPTION: the release's headline batch):
  * acceptance length = tokens emitted per verify step (accepted drafts and the bonus token): the
    two published numbers then imply the same step, 3 / 350 = 8.57 ms and 6 / 709 = 8.46 ms, as
    forced acceptance with one fixed draft length should (the verify work does not depend on how
    many drafts are accepted);
  * the other reading (a drafts accepted, plus the bonus: a + 1 tokens) implies 11.43 vs 9.87 ms,
    a step that shrinks as more is accepted, which forced acceptance cannot explain.
So: a = tokens per verify step, and one draft length for both, k = 7 (ASSUMPTION: the largest
our verify call takes, 8 verify rows; the implied 8.5 ms sits beside the release's own 9.25 ms
plain step at B = 8 rows). A verify step of 8 rows runs the schedule's collectives for 8 rows
(the release's reduce-scatter variant from 6: ASSUMPTION, rows rather than sequences decide).
"""

from __future__ import annotations

from typing import Any

from mkresearch.decoding import speculative
from mkresearch.hardware import interconnect as links
from mkresearch.model.config import ModelConfig
from mkresearch.prediction import scale_out
from mkresearch.sharding import layout as layouts

MAX_DRAFTS = speculative.MAX_DRAFTS  # the verify call's limits (one source: the reference's)
MAX_VERIFY_ROWS = speculative.MAX_ROWS
RELEASE_DRAFTS = 7  # ASSUMPTION (see the module docstring)


def _int_in(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} is invalid: an int in [{low}, {high}]")
    return value


def check_verify(batch: int, drafts: int) -> int:
    """The verify rows B (k + 1) of `batch` rows with `drafts` drafts each (ValueError naming the
    parameter: drafts in 1..7, batch >= 1, at most 64 verify rows)."""
    _int_in("drafts", drafts, 1, MAX_DRAFTS)
    _int_in("batch", batch, 1, MAX_VERIFY_ROWS)
    rows = batch * (drafts + 1)
    if rows > MAX_VERIFY_ROWS:
        raise ValueError(f"batch={batch} with drafts={drafts} is invalid: {rows} verify rows, "
                         f"at most {MAX_VERIFY_ROWS} (batch <= {MAX_VERIFY_ROWS // (drafts + 1)})")
    return rows


def implied_steps_s(tok_s: float, acceptance: int, batch: int = 1) -> dict[str, float]:
    """The verify step a published speculative tok/s implies under each reading of "acceptance
    length a": a tokens per step, or a accepted drafts plus the bonus token (a + 1)."""
    return {"tokens_per_step": batch * acceptance / tok_s,
            "drafts_plus_bonus": batch * (acceptance + 1) / tok_s}


def predict_speculative(cfg: ModelConfig, n_ranks: int, name: str = layouts.RELEASE, *,
                        batch: int = 1, drafts: int = RELEASE_DRAFTS,
                        acceptances: tuple[int, ...] = (3, 6), chip: str = "tpu7x",
                        interconnect: links.Interconnect | None = None,
                        algorithm: str | None = None, schedule: Any = None,
                        context: int = 0, timeline_chip: Any = None,
                        collectives: str = "partial-sum",
                        prefetch_across: bool | None = None) -> list[dict]:
    """One row per acceptance length a (1 <= a <= drafts + 1): the verify step of B (k + 1) rows,
    tok/s = B a / step, beside the plain step at `batch` and the published tok/s where there is
    one (JSON-able dicts)."""
    rows = check_verify(batch, drafts)
    for acceptance in acceptances:
        _int_in("acceptance", acceptance, 1, drafts + 1)
    common = {"chip": chip, "interconnect": interconnect, "algorithm": algorithm,
              "schedule": schedule, "context": context, "timeline_chip": timeline_chip,
              "collectives": collectives, "prefetch_across": prefetch_across}
    verify = scale_out.predict(cfg, n_ranks, name, rows, **common)
    plain = scale_out.predict(cfg, n_ranks, name, batch, **common)
    published = scale_out.PUBLISHED.get(cfg.name, {})
    out = []
    for acceptance in acceptances:
        tok_s = batch * acceptance / verify["step_s"]
        pub = published.get("speculative_tok_s", {}).get(acceptance) \
            if batch == 1 and published.get("n_ranks") == n_ranks and \
            published.get("chip") == chip else None
        out.append({"model": cfg.name, "n_ranks": n_ranks, "layout": name, "batch": batch,
                    "drafts": drafts, "verify_rows": rows, "acceptance": acceptance,
                    "verify_step_s": verify["step_s"], "tokens_per_step": batch * acceptance,
                    "tokens_per_s": tok_s, "plain_step_s": plain["step_s"],
                    "plain_tokens_per_s": plain["tokens_per_s"],
                    "speedup": tok_s / plain["tokens_per_s"], "published_tok_s": pub,
                    "ratio": tok_s / pub if pub else None,
                    "parts_s": verify["parts_s"], "interconnect": verify["interconnect"],
                    "label": "timeline model prediction (mkresearch.prediction.speculative_predict), "
                             "not measured"})
    return out


def release_rows(cfg: ModelConfig, *, chip: str = "tpu7x") -> list[dict]:
    """The release's layout and schedule at acceptance 3 and 6 (k = 7, B = 1)."""
    return predict_speculative(cfg, 32, layouts.RELEASE, chip=chip)


def acceptance_curve(cfg: ModelConfig, n_ranks: int, name: str = layouts.RELEASE, *,
                     batch: int = 1, chip: str = "tpu7x",
                     interconnect: links.Interconnect | None = None,
                     acceptances: tuple[int, ...] = tuple(range(1, MAX_DRAFTS + 2))) -> list[dict]:
    """tok/s against acceptance length a (default 1 .. 8) under two draft policies: k = 7 drafts
    always (the release's forced-acceptance benchmark), and k = a - 1 (draft only what is
    accepted: the fewest verify rows; a = 1 is plain decoding)."""
    points = []
    fixed = predict_speculative(cfg, n_ranks, name, batch=batch, drafts=MAX_DRAFTS,
                                acceptances=acceptances, chip=chip, interconnect=interconnect)
    for row in fixed:
        a = row["acceptance"]
        if a == 1:
            exact = {"tokens_per_s": row["plain_tokens_per_s"], "verify_rows": batch}
        else:
            exact = predict_speculative(cfg, n_ranks, name, batch=batch, drafts=a - 1,
                                        acceptances=(a,), chip=chip, interconnect=interconnect)[0]
        points.append({"acceptance": a, "k7_tokens_per_s": row["tokens_per_s"],
                       "k7_verify_rows": row["verify_rows"],
                       "exact_tokens_per_s": exact["tokens_per_s"],
                       "exact_verify_rows": exact["verify_rows"],
                       "published_tok_s": row["published_tok_s"]})
    return points
