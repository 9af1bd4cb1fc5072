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
(the release's verify is its decode kernel at 8 rows with its 8-row options, one sequence's rows:
its kimi/demo's `make_decode(batch_size=8, sequence_rows=8, ...)`), but reads each sequence's
states and cached tokens once (`scale_out.predict(..., sequences=B)`), and every verify step also
runs the drafter: the release's DSpark draft (`draft_step`), a 5-layer transformer of width
7,168 split 32 ways (its kimi/dspark.py: `DraftConfig`, `_shard_weights`), one pass over its
weights per step for the k + 1 block rows of each of the B sequences, its partial sums
all-reduced after W_o, the MLP's down-projection and the context projection (11 per pass), and
its vocabulary shards' candidates gathered once. The same drafter stands beside either side's verify step (ASSUMPTION for ours,
which has no Kimi K3 drafter of its own at full size); other models' verify steps stand alone.
"""

from __future__ import annotations

from typing import Any

from mkresearch.decoding import speculative
from mkresearch.hardware import interconnect as links
from mkresearch.model.config import ModelConfig
from mkresearch.prediction import scale_out
from mkresearch.prediction.timeline_ranks import simulate_programs
from mkresearch.sharding import layout as layouts

MAX_DRAFTS = speculative.MAX_DRAFTS  # the verify call's limits (one source: the reference's)
MAX_VERIFY_ROWS = speculative.MAX_ROWS
RELEASE_DRAFTS = 7  # ASSUMPTION (see the module docstring)
# the release's DSpark drafter (kimi/dspark.py `DraftConfig` defaults): per rank of 32, bf16
DRAFT = {"layers": 5, "hidden": 7168, "q_width": 96 * 64, "kv_head_dim": 64,
         "intermediate": 14336, "vocab": 163840, "aux_layers": 5, "markov_rank": 256}
MIB = 2**20
DRAFTED = ("kimi-k3",)  # the models whose drafter is known (others: the verify step alone)


def draft_bytes(n_ranks: int = 32) -> list[float]:
    """The drafter's weights one rank streams per pass, in order: the context projection, per
    layer q, k, v, o, gate, up, down, then its LM head and Markov head (`_shard_weights`: q by
    its heads, k and v one KV head, o and down by their inputs, gate and up by their rows, the
    vocabulary by rows)."""
    d = DRAFT
    h, per = d["hidden"], 2  # bf16
    layer = [d["q_width"] // n_ranks * h, d["kv_head_dim"] * h, d["kv_head_dim"] * h,
             h * d["q_width"] // n_ranks, *(d["intermediate"] // n_ranks * h for _ in range(3))]
    return ([h * d["aux_layers"] * h // n_ranks * per]
            + [w * per for _ in range(d["layers"]) for w in layer]
            + [d["vocab"] // n_ranks * h * per, d["vocab"] // n_ranks * d["markov_rank"] * per])


def draft_step(rows: int, *, n_ranks: int = 32, interconnect: links.Interconnect | None = None,
               timeline_chip: Any = None, prefetch_across: bool | None = None) -> Any:
    """The drafter's pass for a block of `rows` (a `timeline_ranks.RanksTimeline`): its weights
    through a ring of 2 MiB blocks (the release's schedule's), its all-reduces of [rows, d]
    bf16 partial sums, two-level, and the candidates' all-gather."""
    sched = scale_out.RELEASE_SCHEDULE
    matrices = draft_bytes(n_ranks)
    parts = [scale_out.weight_blocks(nbytes, sched.block_bytes) for nbytes in matrices]
    prog = scale_out.Program([b for part in parts for b in part], rows)
    everyone = tuple(range(n_ranks))
    vector = rows * DRAFT["hidden"] * scale_out.PARTIAL_SUM_BYTES
    reduced_after = {0} | {1 + 7 * i + j for i in range(DRAFT["layers"]) for j in (3, 6)}
    for i, part in enumerate(parts):
        prog.block(len(part))
        if i in reduced_after:
            prog.collective(f"draft/sum{i}", "all_reduce", (0,), vector, everyone,
                            algorithm="two-level")
    prog.collective("draft/candidates", "all_gather", (0,), rows * 16 * 2 * scale_out.F32,
                    everyone, algorithm="one-shot")
    inter = interconnect or links.interconnect("tpu7x", n_ranks=n_ranks)
    return simulate_programs([prog.ops], prog.blocks, sched.banks, rows, (0,), inter, "auto",
                             timeline_chip or "tpu7x", prefetch_across=prefetch_across)


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


def check_acceptances(acceptances: tuple[int, ...], drafts: int) -> None:
    """Each acceptance length (tokens per verify step) in 1..drafts + 1 (ValueError naming it)."""
    for acceptance in acceptances:
        _int_in("acceptance", acceptance, 1, drafts + 1)


def drafter_s(cfg: ModelConfig, drafts: int, batch: int = 1, *, n_ranks: int = 32,
              interconnect: links.Interconnect | None = None, timeline_chip: Any = None,
              prefetch_across: bool | None = None) -> float:
    """The drafter's pass beside every verify step of `batch` sequences with `drafts` drafts
    each (`draft_step` of their B (k + 1) block rows: one pass over its weights for every
    sequence's block), in seconds; 0 for a model whose drafter is not known (`DRAFTED`)."""
    if cfg.name not in DRAFTED:
        return 0.0
    return draft_step(batch * (drafts + 1), n_ranks=n_ranks, interconnect=interconnect,
                      timeline_chip=timeline_chip, prefetch_across=prefetch_across).total_s


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
    check_acceptances(acceptances, drafts)
    common = {"chip": chip, "interconnect": interconnect, "algorithm": algorithm,
              "schedule": schedule, "context": context, "timeline_chip": timeline_chip,
              "collectives": collectives, "prefetch_across": prefetch_across}
    verify = scale_out.predict(cfg, n_ranks, name, rows, sequences=batch, **common)
    plain = scale_out.predict(cfg, n_ranks, name, batch, **common)
    drafting = drafter_s(cfg, drafts, batch, n_ranks=n_ranks, interconnect=interconnect,
                         timeline_chip=timeline_chip, prefetch_across=prefetch_across)
    step_s = verify["step_s"] + drafting
    published = scale_out.PUBLISHED.get(cfg.name, {})
    out = []
    for acceptance in acceptances:
        tok_s = batch * acceptance / step_s
        pub = published.get("speculative_tok_s", {}).get(acceptance) \
            if batch == 1 and published.get("n_ranks") == n_ranks and \
            published.get("chip") == chip else None
        out.append({"model": cfg.name, "n_ranks": n_ranks, "layout": name, "batch": batch,
                    "drafts": drafts, "verify_rows": rows, "acceptance": acceptance,
                    "verify_step_s": verify["step_s"], "draft_step_s": drafting,
                    "step_s": step_s, "tokens_per_step": batch * acceptance,
                    "tokens_per_s": tok_s, "plain_step_s": plain["step_s"],
                    "plain_tokens_per_s": plain["tokens_per_s"],
                    "speedup": tok_s / plain["tokens_per_s"], "published_tok_s": pub,
                    "ratio": tok_s / pub if pub else None,
                    "parts_s": verify["parts_s"], "interconnect": verify["interconnect"],
                    "schedule": verify["schedule"], "rank_bytes": verify["rank_bytes"],
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
