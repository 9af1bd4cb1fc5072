"""`mkresearch predict MODEL --ranks N`: the full-size step on N ranks, predicted by the scale-out
timeline model (`mkresearch.prediction.scale_out`), beside the published numbers where there are some.

    mkresearch predict kimi-k3 --ranks 32 --chip tpu7x --batch 1,2,4,8 \\
        [--rank-layout ours|release] [--schedule ours|release] \\
        [--collectives partial-sum|exact|restructured] \\
        [--algorithm two-level|one-shot|ring] [--context C] [--json] \\
        [--speculate K --acceptance 3,6] [--designs [--bounds]]

--explain lists every constant the model uses with its label (MEASURED with its source,
PUBLISHED architecture figure, or ASSUMPTION), then what grows with the batch at each --batch:
the rows' own work (`prediction.row_work`) and each side's bytes per rank; --validate prints the ten published points beside
the predictions, the collective fit's leave-one-out and the sensitivity of each prediction to
every assumption (x0.5, x2); --profile prints the seconds one prediction takes (a benchmark, not
a test); --designs prints what each design of `mkresearch.prediction.designs` buys our step
(`prediction.design_table`), and with --speculate K what each buys a verify step
(`prediction.speculative_designs`); --designs takes only --ranks, --chip, --batch, --context,
--speculate, --acceptance, --bounds and --json; --designs --bounds then prints what the designs'
last row and the release's step (with --speculate K: their verify steps) wait for
(`prediction.step_bounds`: each resource 10x faster alone).

With --speculate K each batch row is a speculative decode: verify steps of B (K + 1) rows, tok/s
at each acceptance length (`mkresearch.prediction.speculative_predict`).

Without --rank-layout both layouts are predicted, each with its own schedule unless --schedule
says.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from mkresearch.cli.common import (
    UsageError,
    at_least,
    context_in_cache,
    known_chip,
    known_model,
    options_of,
    refusals,
)
from mkresearch.cli.options import (
    add_batch,
    add_command,
    add_context,
    add_model,
    add_rank_layout,
    int_list,
)
from mkresearch.hardware import interconnect as links
from mkresearch.hardware.chips import CHIPS
from mkresearch.model.config import EXPERT_MXU_INPUTS
from mkresearch.prediction import (
    calibration,
    design_table,
    designs,
    row_work,
    scale_out,
    speculative_designs,
    step_bounds,
)
from mkresearch.prediction import speculative_predict as speculative
from mkresearch.prediction.full_size import full_size_step
from mkresearch.prediction.timeline_chip import timeline_chip
from mkresearch.sharding import layout

EXAMPLES = ("mkresearch predict kimi-k3 --ranks 32 --batch 1,2,4,8",
            "mkresearch predict kimi-k3 --rank-layout release --batch 1 --context 4096",
            "mkresearch predict kimi-k3 --speculate 7 --acceptance 3,6")


DEFAULT_RANKS = 32  # the release's 16 TPU7x chips


def _acceptances(args: Any) -> tuple[int, ...]:
    if args.acceptance is not None:
        return int_list("--acceptance", args.acceptance)
    return tuple(a for a in (3, 6) if a <= args.speculate + 1) or (args.speculate + 1,)


def add_parser(commands: Any) -> None:
    p = add_command(commands, "predict", "the full-size step on N ranks, predicted (timeline "
                                         "model with the interconnect), beside the published",
                    EXAMPLES)
    add_model(p)
    p.add_argument("--ranks", type=int, default=DEFAULT_RANKS, help="ranks (devices) to shard across "
                                                         "(default 32: the release's 16 TPU7x)")
    p.add_argument("--chip", default="tpu7x",
                   help=f"chip of every rank: one of {', '.join(CHIPS)} (default %(default)s)")
    add_batch(p, (1, 2, 4, 8))
    add_rank_layout(p, "whose layout spreads the model over the ranks (default: both)")
    p.add_argument("--schedule", default=None, choices=scale_out.SCHEDULES,
                   help="whose schedule: ring, expert slots, collectives (default: the layout's)")
    p.add_argument("--algorithm", default=None, choices=links.ALGORITHMS,
                   help="all-reduce algorithm (default: the schedule's at each batch)")
    p.add_argument("--expert-mxu", default=None, choices=EXPERT_MXU_INPUTS,
                   help="what our kernel hands the MXU for a routed expert: its weights decoded "
                        "to bf16 (the preset's) or its fp8 / MXFP4 values as fp8 with the block "
                        "scales after the dot (ModelConfig.expert_mxu)")
    p.add_argument("--collectives", default="partial-sum", choices=layout.COLLECTIVES,
                   help="our kernel's collectives: partial-sum (default), exact (bit-equal "
                        "to one device) or restructured (rho reduce-scattered, W_lu by rows "
                        "beside the shared experts' sum); the release's schedule has its own")
    add_context(p, 0, "tokens already in each sequence's KV cache (default 0, as every "
                      "full-size line `info`, `decode` and `bench` print; the release's benchmark, "
                      "one prompt token and 1,024 generated, averages "
                      f"{calibration.BENCHMARK_CONTEXT}: what --validate uses, and --designs "
                      "unless given another)")
    p.add_argument("--speculate", type=int, default=0,
                   help="drafts per verify step, 1..7 (default 0: plain decoding)")
    p.add_argument("--acceptance", default=None,
                   help="with --speculate K: acceptance lengths (tokens per verify step, 1..K+1), "
                        "comma-separated (default: those of 3,6 — the release's published modes "
                        "— that K allows, else K+1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--explain", action="store_true",
                   help="list every constant of the model: measured (source), published, assumed")
    p.add_argument("--designs", action="store_true",
                   help="ours as built, then each design (experts to the MXU as fp8, expert "
                        "reads first, rho by reduce-scatter: the restructured collectives, the "
                        "router placement, bf16 partial sums) added in turn, beside the "
                        "release's modelled step; with --speculate K each one's verify step and "
                        "tok/s")
    p.add_argument("--bounds", action="store_true",
                   help="with --designs: what the designs' last row and the release's step wait "
                        "for (with --speculate K: their verify steps), each resource (reads, "
                        "MXU, vector unit, collective latency, link bandwidth) 10x faster alone")
    p.add_argument("--validate", action="store_true",
                   help="the published points beside the predictions, leave-one-out, sensitivity")
    p.add_argument("--profile", action="store_true",
                   help="print the seconds one prediction takes (uncached)")


def run(args: Any) -> int:
    cfg = known_model(args.model)
    if args.json and (args.explain or args.validate):
        raise UsageError(f"--json is invalid with {'--explain' if args.explain else '--validate'}"
                         ": it prints text tables (--json goes with the predictions and "
                         "--designs)")
    if not args.speculate:
        options_of("--speculate K > 0", (("--acceptance", args.acceptance, None),),
                   "the acceptance lengths of speculative decoding")
    if args.bounds and not args.designs:
        raise UsageError("--bounds is invalid without --designs: it asks what the designs' "
                         "last row waits for (predict MODEL --designs --bounds)")
    if args.designs:
        _check_designs(args)
    if args.expert_mxu:
        with refusals():  # bf16 experts: refused, naming the field
            cfg = cfg.replace(expert_mxu=args.expert_mxu)
    chip = known_chip(args.chip)
    if args.explain:
        print(format_explain(cfg, args.ranks, chip, args.batch, args.context))
        return 0
    if args.validate:
        print(format_validation())
        return 0
    if args.designs:
        return _run_designs(args, cfg, chip)
    _check_predictions(args, cfg, chip)
    names = (args.rank_layout,) if args.rank_layout else layout.LAYOUTS
    rows, steps = _predictions(args, cfg, chip, names)
    if args.profile:
        print(format_profile(cfg, args.ranks, names[0], args.batch[0], chip))
    if args.json:
        print(json.dumps({"model": cfg.name, "n_ranks": args.ranks, "chip": chip,
                          "predictions": rows,
                          "assumptions": assumptions_of(rows, chip, args.ranks, args.context),
                          "row_work": row_work.table(cfg, args.ranks, args.batch,
                                                     timeline_chip(chip).vpu_flops,
                                                     args.context)}))
    else:
        print(format_speculative(rows) if args.speculate else format_rows(rows))
        print("\n".join(step.line() for step in steps))
    return 0


# what --designs takes (with --speculate K: its verify steps); every other option is refused
DESIGNS_TAKES = ("--ranks", "--chip", "--batch", "--context", "--speculate", "--acceptance",
                 "--bounds", "--json")
# the options --designs does not take, with their defaults (the option given = not its default)
DESIGNS_REFUSES = (("--validate", "validate", False), ("--explain", "explain", False),
                   ("--profile", "profile", False), ("--rank-layout", "rank_layout", None),
                   ("--schedule", "schedule", None), ("--algorithm", "algorithm", None),
                   ("--expert-mxu", "expert_mxu", None),
                   ("--collectives", "collectives", layout.DEFAULT_COLLECTIVES))


def _check_designs(args: Any) -> None:
    """--designs prices ours as built and each design in turn beside the release, under one
    Model: an option that would change either side (or print another table) is refused, named
    with what --designs takes."""
    for option, dest, default in DESIGNS_REFUSES:
        if getattr(args, dest) != default:
            raise UsageError(f"{option} is invalid with --designs (another table, or what "
                             "the designs' rows fix: each side's layout, schedule, collectives, "
                             f"MXU input): --designs takes {', '.join(DESIGNS_TAKES)}")


def _run_designs(args: Any, cfg: Any, chip: str) -> int:
    """predict --designs: ours as built, each design added in turn, the release's step; with
    --speculate K each one's verify steps and tok/s (`speculative_designs`)."""
    ranks_split(cfg, args.ranks)
    context_in_cache(cfg, args.context)
    at_least("--speculate", args.speculate, 0)
    with refusals():
        model = calibration.Model(interconnect=links.interconnect(chip, n_ranks=args.ranks),
                                  timeline_chip=timeline_chip(chip),
                                  context=args.context or calibration.BENCHMARK_CONTEXT)
        if args.speculate:  # every batch and acceptance checked before any prediction
            for batch in args.batch:
                speculative.check_verify(batch, args.speculate)
            speculative.check_acceptances(_acceptances(args), args.speculate)
        table, bounds = [], []
        for batch in _progress(args, args.batch, "designs", "batch"):  # ~25 s a batch here
            if args.speculate:
                table += speculative_designs.speculative_designs(
                    cfg, args.ranks, (batch,), drafts=args.speculate,
                    acceptances=_acceptances(args), model=model)
            else:
                table += design_table.designs_table(cfg, args.ranks, (batch,), model=model)
            if args.bounds:  # the designs' choices are cached: ~3 s more a batch
                rows = batch * (args.speculate + 1)  # a verify step's, with --speculate K
                bounds += step_bounds.step_bounds(cfg, args.ranks, rows, model=model,
                                                  sequences=batch)
    if args.json:
        print(json.dumps({"designs": table, "bounds": bounds} if args.bounds else table))
        return 0
    if args.speculate:
        print(speculative_designs.format_speculative_designs(table, cfg.name, args.ranks,
                                                             model.context))
    else:
        print(design_table.format_designs(table, model.context))
    if args.bounds:
        print(step_bounds.format_step_bounds(bounds, model.context))
    return 0


def ranks_split(cfg: Any, ranks: int) -> None:
    """--ranks: 2 or more ranks that split cfg (the library's line, saying when the count was
    --ranks' default, which a mini model does not split)."""
    at_least("--ranks", ranks, 2)
    try:
        layout.check_ranks(cfg, ranks)
    except ValueError as error:
        default = " (the default)" if ranks == DEFAULT_RANKS else ""
        raise UsageError(f"--ranks {ranks}{default}: {str(error).splitlines()[0]}") from None


def _check_predictions(args: Any, cfg: Any, chip: str) -> None:
    """The checks of a prediction's options before any work: one line, exit status 2."""
    with refusals():
        if not layout.has_rules(cfg):
            raise ValueError(f"{cfg.name} has no sharding rules (its stage kinds do not "
                             "say how they split: spec.Param.shard)")
    ranks_split(cfg, args.ranks)
    context_in_cache(cfg, args.context)
    at_least("--speculate", args.speculate, 0)
    with refusals():
        links.interconnect(chip, n_ranks=args.ranks)  # a known slice of chip with that many ranks


def _predictions(args: Any, cfg: Any, chip: str, names: tuple[str, ...]) -> tuple[list, list]:
    """Each layout's prediction at each batch (a progress bar on a terminal): (the rows, the
    full-size steps; none with --speculate, whose rows are the speculative predictions')."""
    rows, steps = [], []
    todo = [(name, batch) for name in names for batch in args.batch]
    with refusals():
        for name, batch in _progress(args, todo, "predict", "step"):
            common = {"chip": chip, "schedule": args.schedule, "algorithm": args.algorithm,
                      "context": args.context, "collectives": args.collectives}
            if args.speculate:
                rows += speculative.predict_speculative(
                    cfg, args.ranks, name, batch=batch, drafts=args.speculate,
                    acceptances=_acceptances(args), **common)
            else:
                steps.append(full_size_step(cfg, args.ranks, name, batch, **common))
                rows.append(steps[-1].prediction)
    return rows, steps


def _progress(args: Any, items: list, desc: str, unit: str) -> Any:
    """items, with a progress bar on stderr where it is a terminal, the output is not JSON and
    there is more than one item."""
    if args.json or not sys.stderr.isatty() or len(items) < 2:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit=unit, file=sys.stderr)


def assumptions_of(rows: list[dict], chip: str, n_ranks: int, context: int) -> dict:
    """Every assumption behind `rows`: the ones both sides share, once (the links, the chip's
    timeline figures, the streaming rule, the context, the routing: `calibration.Model`), and
    each side's own (its schedule: ring, expert slots and reads, the MXU's input, its
    collectives), by layout."""
    model = calibration.Model(interconnect=links.interconnect(chip, n_ranks=n_ranks),
                              timeline_chip=timeline_chip(chip), context=context)
    sides = {}
    for r in rows:
        sides.setdefault(r["layout"], {})[str(r["batch"])] = r.get("schedule")
    return {"shared": model.describe(), "sides": sides}


def format_speculative(rows: list[dict]) -> str:
    """Speculative predictions as a table: verify rows and step, tok/s, beside the published."""
    first = rows[0]
    lines = [(f"{first['model']} on {first['n_ranks']} ranks, speculative decoding with "
             f"{first['drafts']} drafts per verify step: {first['label']}"),
             (f"  {'layout':8s} {'B':>2s} {'rows':>4s} {'accept':>6s} {'verify ms':>9s} "
             f"{'tok/s':>6s} {'plain':>6s} {'speedup':>7s} {'published':>9s}")]
    for r in rows:
        pub = f"{r['published_tok_s']:5d}/s" if r["published_tok_s"] else "-"
        lines.append(f"  {r['layout']:8s} {r['batch']:2d} {r['verify_rows']:4d} "
                     f"{r['acceptance']:6d} {r['verify_step_s'] * 1e3:9.2f} "
                     f"{r['tokens_per_s']:6.0f} {r['plain_tokens_per_s']:6.0f} "
                     f"{r['speedup']:6.2f}x {pub:>9s}")
    lines.append("  acceptance: tokens emitted per verify step (accepted drafts and the bonus "
                 "token); rows: B x (drafts + 1) verify rows through one weight pass")
    return "\n".join(lines)


def format_rows(rows: list[dict]) -> str:
    """The predictions as a table: step and tok/s, the slowest rank's parts, the published."""
    first = rows[0]
    algorithm = "each collective as its kernel sends it (ours: its sharding plan, " \
        "kernels.sharded.plan; the release's: its program)" \
        if first["algorithm"] == "auto" else f"{first['algorithm']} collectives"
    lines = [(f"{first['model']} on {first['n_ranks']} ranks of {first['chip']} "
             f"({algorithm}): {first['label']}"),
             (f"  {'layout':8s} {'schedule':8s} {'B':>2s} {'step ms':>8s} {'tok/s':>7s} "
             f"{'floor':>6s} {'peers':>6s} {'coll.':>6s} {'comp.':>6s} {'bubble':>6s} "
             f"{'colls':>5s} {'published':>14s} {'16xGB200':>9s}")]
    for r in rows:
        parts = r["parts_s"]
        published = r.get("published_step_s")
        pub = (f"{published * 1e3:5.2f} ms {r['batch'] / published:4.0f}/s" if published
               else "-")
        gb200 = f"{r['gb200_tok_s']:5d}/s" if r.get("gb200_tok_s") else "-"
        lines.append(
            f"  {r['layout']:8s} {_schedule_name(r['schedule']):8s} {r['batch']:2d} "
            f"{r['step_s'] * 1e3:8.2f} {r['tokens_per_s']:7.0f} "
            + " ".join(f"{parts[k] * 1e3:6.2f}" for k in scale_out.PARTS)
            + f" {r['collectives_per_rank']:5d} {pub:>14s} {gb200:>9s}")
    lines += [f"  {r['layout']} B={r['batch']}: {r['schedule']['ring']}" for r in rows
              if r["schedule"].get("ring")]  # our kernel's ring: its depth at each batch and why
    lines.append("  parts (ms, the slowest rank): HBM busy, waiting for peers, collective "
                 "messages, compute, bubbles; colls: collectives per rank per step, every one "
                 "counted (gathers and sibling swaps too: the ~188 of docs/collectives.md count "
                 "only the release's two reductions per layer)")
    step = {(r["layout"], r["batch"]): r["step_s"] for r in rows}
    both = [b for (name, b) in step if name == "ours" and ("release", b) in step]
    if both:
        lines.append("  ours / the release's modelled step, the same assumptions (`predict "
                     "--json`: assumptions): " + ", ".join(
                         f"B={b} {step['ours', b] / step['release', b]:.2f}" for b in both))
    return "\n".join(lines)


def _schedule_name(schedule: dict) -> str:
    """"release", or ours with its collectives: "ours/ps" (partial-sum), "ours/ex" (exact),
    "ours/rs" (restructured)."""
    mode = schedule.get("collectives")
    return schedule["name"] + ({"partial-sum": "/ps", "exact": "/ex",
                                "restructured": "/rs"}.get(mode, ""))


def format_explain(cfg: Any, n_ranks: int, chip: str, batches=(1, 2, 4, 8),
                   context: int = 0) -> str:
    """Every constant the prediction uses, with its label and source; the rows' own work
    (`row_work`) per batch."""
    inter = links.interconnect(chip, n_ranks=n_ranks)
    tl = timeline_chip(chip)
    lines = [(f"constants of the scale-out model ({chip}, slice {inter.slice.name}); labels: "
              "MEASURED (source), PUBLISHED architecture figure, ASSUMPTION")]
    for name, value, source in inter.explain():
        lines.append(f"  interconnect.{name:20s} {value:12.4g}  {source}")
    for name in calibration.TIMELINE_FIELDS:
        lines.append(f"  timeline_chip.{name:19s} {float(getattr(tl, name)):12.4g}  "
                     f"{tl.sources.get(name, '')}")
    for sched in (scale_out.RELEASE_SCHEDULE, scale_out.our_schedule(cfg, n_ranks=n_ranks)):
        algorithms = "each collective's algorithm from the sharding plan" if sched.collectives \
            else ("each collective as its kernel sends it (program.release_collectives: sums "
                  f"{sched.all_reduce}, from B = {scale_out.RS_FROM_BATCH} {sched.all_reduce_large})")
        streams = {None: "where its program issues the weights after a collective before its "
                         "wait", True: "every collective", False: "no collective"}
        lines.append(f"  schedule {sched.name}: {sched.block_bytes} B blocks, {sched.banks} banks, "
                     f"{sched.expert_slots} expert slots, expert reads {sched.expert_order}, "
                     f"MXU takes experts as {'fp8' if sched.mxu_fp8 else 'bf16'}, "
                     f"{sched.combine}, {algorithms}, its stream runs past "
                     f"{streams[sched.prefetch_across]}; {sched.source}"
                     + (f"; B = 1: {sched.ring}" if sched.ring else ""))
    lines.append("  routing: ASSUMPTION uniform (seeded), as roofline's expected distinct experts")
    lines.append(f"  designs beyond the kernel's defaults (none assumed; `--designs` prices them): "
                 f"{', '.join(designs.DESIGNS)}, expert reads first, rho by reduce-scatter "
                 "(--collectives restructured)")
    lines.append(f"  context: the release's benchmark averages {calibration.BENCHMARK_CONTEXT} "
                 "cached tokens (one prompt token, 1,024 generated): --validate and --designs "
                 "predict at it; the table at --context (default 0, as every full-size line)")
    lines.append("  no constant is set from a published step time (calibration.validation)")
    lines.append(f"work per row on a rank (row_work; element-wise f32 at timeline_chip.vpu_flops, "
                 f"context {context}), us per step at B = {', '.join(map(str, batches))}:")
    for t in row_work.table(cfg, n_ranks, batches, tl.vpu_flops, context):
        lines.append(f"  {t['term']:13s} {t['kind']:12s} {t['flops_per_row'] / 1e6:7.2f} MFLOP/row "
                     + " ".join(f"{s * 1e6:7.2f}" for s in t["seconds"].values())
                     + f"  ({t['formula']})")
    lines.append(f"bytes that grow with the batch, GB per rank per step at B = "
                 f"{', '.join(map(str, batches))} (scale_out.rank_bytes; distinct experts: uniform "
                 "routing):")
    lines += _growing_bytes(cfg, n_ranks, chip, batches, context)
    return "\n".join(lines)


GROWING_BYTES = (("routed_experts", "routed experts"), ("kda_state", "KDA state"),
                 ("mla_cache", "MLA cache"))


def _growing_bytes(cfg: Any, n_ranks: int, chip: str, batches, context: int) -> list[str]:
    """Per side, the bytes per rank that grow with the batch (the model's own counts)."""
    lines = []
    for name in layout.LAYOUTS:
        lay = layout.layout(cfg, n_ranks, name)
        counts = [scale_out.rank_bytes(lay, scale_out.schedule_for(
            cfg, name, n_ranks=n_ranks, batch=batch, chip=chip), batch, context)
            for batch in batches]
        for component, label in GROWING_BYTES:
            if component in counts[0].components:
                lines.append(f"  {name:8s} {label:16s} " + " ".join(
                    f"{c.component(component) / 1e9:7.3f}" for c in counts))
    return lines


def format_validation() -> str:
    """The validation table, the leave-one-out of the collective fit, the sensitivity."""
    sens = calibration.sensitivity()
    loo = calibration.leave_one_out()
    lines = [(f"validation: every published point, predicted out of sample (within "
              f"{calibration.TOLERANCE:.0%}? goal {calibration.GOAL:.0%}); range: every "
              "assumption moved (numbers x0.5 and x2, the vector rate x0.1 and x2, switches to "
              "their other values); LOO: the collective fit without each measurement"),
             (f"  {'point':26s} {'published':>10s} {'predicted':>10s} {'ratio':>6s} "
              f"{'within':>6s} {'range':>13s} {'LOO range':>13s}")]
    for r in sens["base"]:
        low, high = sens["ranges"][r["point"]]
        llow, lhigh = loo["ranges"][r["point"]]
        lines.append(f"  {r['point']:26s} {r['published']:7.2f} {r['unit']:>2s} "
                     f"{r['predicted']:7.2f} {r['unit']:>2s} {r['ratio']:6.2f} "
                     f"{'yes' if r['within'] else 'NO':>6s}   {low:4.2f} .. {high:4.2f}"
                     f"   {llow:4.2f} .. {lhigh:4.2f}")
    lines.append("  ratio: predicted / published time per token (step; 1 / tok/s)")
    lines.append("collective fit, leave-one-out (rs-ag on 8 cores):")
    for h in loo["held_out"]:
        lines.append(f"  {h['nbytes']:8d} B: measured {h['measured_us']:5.1f} us, predicted "
                     f"{h['predicted_us']:5.1f} us from the other three")
    points = [r["point"] for r in sens["base"]]
    lines.append("sensitivity (ratio per point, in the order above):")
    for row in sens["rows"]:
        variant = row["variant"]
        label = f"= {variant}" if isinstance(variant, bool) or isinstance(variant, int) \
            and variant > 1 else f"x{variant:g}"
        lines.append(f"  {row['assumption'][:44]:44s} {label:7s}" + " ".join(
            f"{row['ratios'][p]:5.2f}" for p in points))
    return "\n".join(lines)


def format_profile(cfg: Any, n_ranks: int, name: str, batch: int, chip: str) -> str:
    """Seconds (CPU and wall) of one uncached prediction: the programs and their simulation."""
    scale_out.clear_caches()
    cpu, wall = time.process_time(), time.perf_counter()
    scale_out.predict(cfg, n_ranks, name, batch, chip=chip)
    return (f"profile: one {n_ranks}-rank prediction ({name} layout, B = {batch}, uncached) "
            f"took {time.process_time() - cpu:.3f} s CPU, {time.perf_counter() - wall:.3f} s "
            "wall (a benchmark: never asserted)")
