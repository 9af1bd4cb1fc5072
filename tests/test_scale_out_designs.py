"""Designs beyond the kernel's defaults, priced by the scale-out model (`prediction.designs`,
`prediction.design_table`): rho by a one-phase reduce-scatter (the kernel's restructured mode),
the router's placement, expert reads first; `plan` prints each router placement, `predict
--designs` each design in turn."""

import dataclasses
import json

import pytest
from mkresearch.kernels.sharded import plan as sharding
from mkresearch.kernels.stages.experts import LATENT_DOWN
from mkresearch.kernels.stages.router import W_ROUTER

from mkresearch.cli import main as cli
from mkresearch.hardware import interconnect as links
from mkresearch.hardware.chips import get_chip
from mkresearch.model import partition
from mkresearch.model.config import get_config
from mkresearch.prediction import (
    calibration,
    design_table,
    designs,
    microbatches,
    scale_out,
    step_bounds,
)
from mkresearch.prediction import timeline_chip as tchip
from mkresearch.prediction.timeline_chip import timeline_chip
from mkresearch.sharding import layout as layouts
from mkresearch.sharding import layout_bytes


def _ours(batch=1, mode="partial-sum", **fields):
    cfg = get_config("kimi-k3")
    sched = dataclasses.replace(scale_out.our_schedule(cfg, mode, 32, batch), **fields)
    return scale_out.predict(cfg, 32, layouts.OURS, batch, schedule=sched, keep_timeline=True)


def _runs(p, prefix):
    return [run for run in p["timeline"].collectives if 0 in run.group
            and run.name.startswith(prefix)]


def test_rho_by_reduce_scatter_is_the_kernels_restructured_mode():
    """"+ rho by reduce-scatter" is the kernel's restructured mode as it runs: its layout's
    bytes per rank (W_lu split by its latent rows), its own collectives: rho a one-phase
    reduce-scatter of 128-column chunks priced by the interconnect model, the shared experts'
    reduction at its real width [B, d | d | 128] (W_lu's partial products and rho's sums of
    squares beside the shared experts' partial sums)."""
    cfg = get_config("kimi-k3")
    built, rho = _ours(), _ours(mode=layouts.RESTRUCTURED)
    assert rho["schedule"]["collectives"] == layouts.RESTRUCTURED and not rho["schedule"]["designs"]
    before, after = _runs(built, sharding.EXPERT_SUM), _runs(rho, sharding.EXPERT_SUM)
    assert len(before) == len(after) == 92
    assert {run.op for run in after} == {"reduce_scatter"} and after[0].nbytes == 128 * 4
    inter = links.interconnect("tpu7x", n_ranks=32)
    assert after[0].price == links.price(inter, "reduce_scatter", "one-shot", tuple(range(32)),
                                         128 * 4)
    assert after[0].price.phases == 1 < before[0].price.phases
    assert after[0].price.seconds < before[0].price.seconds
    d = cfg.d_model
    assert {run.nbytes for run in _runs(rho, sharding.SHARED_DOWN)} == {(d + d + 128) * 4}
    assert {run.nbytes for run in _runs(built, sharding.SHARED_DOWN)} == {(d + 256) * 4}  # W_lu's chunk
    # the restructured layout's bytes: W_lu's latent rows rotate with W_ld's latent columns, so
    # the busiest rank reads one more 128-row chunk of W_lu per MoE layer than in partial-sum
    lay = layouts.layout(cfg, 32, collectives=layouts.RESTRUCTURED)
    assert rho["rank_bytes"] == layout_bytes.rank_bytes(lay, 1).total
    assert rho["rank_bytes"] - built["rank_bytes"] == 92 * 128 * d * 2
    assert rho["serial_chain_s"] < built["serial_chain_s"] and rho["step_s"] < built["step_s"]


def test_the_serial_chain_is_every_collective_of_rank_0_in_sequence():
    """As built every collective of rank 0 is waited for as it is issued: the chain is their
    prices' sum. With the router on every rank the latent's gather is issued after routing and
    waited for before the first expert is computed: the chain counts only what the expert reads
    did not hide of it (none at B = 1), every other collective at its price."""
    p = _ours()
    runs = [run for run in p["timeline"].collectives if 0 in run.group]
    assert len(runs) == p["collectives_per_rank"]
    assert p["serial_chain_s"] == pytest.approx(sum(run.price.seconds for run in runs))
    assert p["serial_chain_s"] > p["parts_s"]["collective_messages"]  # some of it is hidden
    placed = _ours(designs=("router-replicated",))
    runs = [run for run in placed["timeline"].collectives if 0 in run.group]
    overlapped = [run for run in runs if run.chain_seconds(0) < run.price.seconds]
    assert overlapped and {run.name.split("#")[0] for run in overlapped} == {"latent/w_ld"}
    assert all(run.wait_from(0) > run.arrivals[run.group.index(0)] for run in overlapped)
    assert placed["serial_chain_s"] == pytest.approx(
        sum(run.price.seconds for run in runs)
        - sum(run.price.seconds - run.chain_seconds(0) for run in overlapped))
    print(f"chain as built {p['serial_chain_s'] * 1e3:.3f} ms; router on every rank "
          f"{placed['serial_chain_s'] * 1e3:.3f} ms, of which the latent's gathers "
          f"{sum(run.chain_seconds(0) for run in overlapped) * 1e3:.3f} of their "
          f"{sum(run.price.seconds for run in overlapped) * 1e3:.3f} ms")


@pytest.mark.parametrize("placement", designs.ROUTER_PLACEMENTS[1:])
def test_a_router_placement_splits_the_fused_gather(placement):
    """A router design is priced as the kernel runs it (`MegakernelOptions.router_placement`):
    its own collectives, the scores among the router's group, the latent over every rank."""
    p = _ours(designs=(f"router-{placement}",))
    scores = _runs(p, W_ROUTER)  # not the split kernel's fused gather (checked below)
    latent = _runs(p, LATENT_DOWN)
    assert {run.name for run in scores + latent} <= {W_ROUTER, LATENT_DOWN}
    assert len(latent) == 92 and not _runs(p, designs.FUSED_ROUTER_GATHER)
    assert len(scores) == (0 if placement == designs.REPLICATED else 92)
    group = 2 if placement == designs.SIBLING else 8
    for run in scores:  # priced over the group; simulated among its stand-ins
        assert run.price.messages == group - 1 and set(run.group) <= set(range(group))
    # the same program as the kernel's option's: no design applied twice
    cfg = get_config("kimi-k3")
    kernel = scale_out.our_schedule(cfg, "partial-sum", 32, 1, router=placement)
    assert kernel.router == placement
    both = scale_out.predict(cfg, 32, layouts.OURS, 1, schedule=dataclasses.replace(
        kernel, designs=(f"router-{placement}",)))
    alone = scale_out.predict(cfg, 32, layouts.OURS, 1, schedule=kernel)
    assert both["step_s"] == alone["step_s"] == p["step_s"]
    assert both["rank_bytes"] == alone["rank_bytes"] == p["rank_bytes"]


def test_the_kernels_placement_and_another_design_clash():
    kernel = scale_out.our_schedule(get_config("kimi-k3-mini"), "partial-sum", 2,
                                    router=designs.HOST)
    with pytest.raises(ValueError, match="the kernel places the router already"):
        dataclasses.replace(kernel, designs=("router-sibling",))
    with pytest.raises(ValueError, match="Schedule.router='nowhere' is invalid"):
        dataclasses.replace(kernel, router="nowhere")


def test_router_placements_bytes_latency_and_the_choice():
    table = design_table.router_placements(get_config("kimi-k3"), 32, 1)
    rows = {r["placement"]: r for r in table["rows"]}
    assert list(rows) == list(designs.ROUTER_PLACEMENTS)
    # in the kernel's restructured mode (the table's); Kimi K3's 896 experts over 32 ranks:
    # chunks of 28 columns padded to 128 lanes, a host's 112 too, on every rank of the host: the
    # busiest rank reads at most one chunk per MoE layer more (in the restructured layout every
    # rank reads the same bytes, so none more; in partial-sum 0.12 GB: the split's chunks sit on
    # ranks with padding of W_ld, W_qa, W_kva); two siblings read 512 lanes, every rank 896
    assert table["with"] == [layouts.RESTRUCTURED, "expert reads first"]
    assert rows["split"]["rank_gb"] * 1e9 == pytest.approx(scale_out.predict(
        get_config("kimi-k3"), 32, layouts.OURS, 1, collectives=layouts.RESTRUCTURED,
        context=design_table.SAME_ASSUMPTIONS.context)["rank_bytes"], rel=1e-12)
    chunk = 92 * 7168 * 128 * 2  # one bf16 chunk of the router's columns in every MoE layer
    assert 0 <= (rows["host"]["rank_gb"] - rows["split"]["rank_gb"]) * 1e9 <= chunk
    assert rows["split"]["rank_gb"] < rows["sibling"]["rank_gb"] < rows["replicated"]["rank_gb"]
    extra = (rows["replicated"]["rank_gb"] - rows["split"]["rank_gb"]) * 1e9
    # bf16 router columns: all 896 instead of the one 128-lane chunk every rank of the
    # restructured split reads
    assert extra == pytest.approx(92 * 7168 * (896 - 128) * 2, rel=1e-9)
    assert rows["replicated"]["before_top_k_us"] == 0
    assert rows["sibling"]["before_top_k_us"] < rows["split"]["before_top_k_us"]
    assert table["chosen"] == min(rows.values(), key=lambda r: r["step_ms"])["placement"]
    assert table["kernel_default"] == designs.SPLIT and table["ranks_per_host"] == 8
    assert "the kernel runs each" in design_table.format_router_placements(table)
    print(design_table.format_router_placements(table))


def test_a_schedule_refuses_unknown_or_clashing_designs():
    sched = scale_out.our_schedule(get_config("kimi-k3-mini"), "partial-sum", 2)
    with pytest.raises(ValueError, match="design 'soon' is invalid"):
        dataclasses.replace(sched, designs=("soon",))
    with pytest.raises(ValueError, match="at most one router placement"):
        dataclasses.replace(sched, designs=("router-host", "router-sibling"))
    with pytest.raises(ValueError, match="only our kernel's program takes designs"):
        dataclasses.replace(scale_out.RELEASE_SCHEDULE, designs=("router-host",))


@pytest.mark.slow  # the designs of Kimi K3 at B = 1 (~30 s)
def test_designs_table_and_the_command(capsys):
    cfg = get_config("kimi-k3")
    rows = design_table.designs_table(cfg, 32, (1,))
    assert [r["design"] for r in rows][:4] == ["as built", "+ experts to the MXU as fp8",
                                               "+ expert reads first", "+ rho by reduce-scatter"]
    assert rows[-1]["design"] == "the release (modelled)" and rows[-1]["over_release"] == 1
    # rho by reduce-scatter and what follows it: the restructured layout's bytes per rank
    restructured = scale_out.rank_bytes(
        layouts.layout(cfg, 32), scale_out.our_schedule(cfg, layouts.RESTRUCTURED, 32, 1), 1,
        design_table.SAME_ASSUMPTIONS.context).total / 1e9
    assert rows[3]["rank_gb"] == pytest.approx(restructured, rel=1e-12)
    assert rows[3]["rank_gb"] > rows[2]["rank_gb"]
    for r in rows:
        print(f"{r['design']:28s} {r['step_ms']:.2f} ms {r['rank_gb']:.2f} GB "
              f"chain {r['chain_ms']:.2f} ms x{r['over_release']:.2f}")
    capsys.readouterr()
    assert cli.main(["predict", "kimi-k3", "--designs", "--batch", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == rows  # the same Model: cached, identical
    assert cli.main(["predict", "kimi-k3", "--designs", "--batch", "1"]) == 0
    text = capsys.readouterr().out  # its context named: the as-built row is not full_size's
    assert f"context {design_table.SAME_ASSUMPTIONS.context})" in text
    assert f"{rows[0]['step_ms']:8.2f}" in text.splitlines()[2]
    assert cli.main(["plan", "kimi-k3", "--ranks", "32", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["router"]["chosen"] in designs.ROUTER_PLACEMENTS
    splits = planned["expert_splits"]
    assert [r["etp"] for r in splits["rows"]] == [1, 2, 4, 8] and splits["as_built"] == 4
    assert splits["chosen"] == min(splits["rows"], key=lambda r: r["step_ms"])["etp"]


@pytest.mark.slow  # the designs at B = 1 (cached from the table's test when in one process)
def test_expert_layouts_the_fastest_split_and_slots_together():
    """The designs' last step: the expert-tensor split the partial-sum modes take on Kimi K3 / 32
    (W2 by its rows: 8 ways too, which the exact mode's W2 columns refuse) together with the
    count of VMEM slots per expert matrix (`MegakernelOptions.expert_slots`), the fastest pair
    predicted with the designs before it, each priced with its ring as deep as VMEM still allows
    beside the slots (more slots, never a deeper ring). `expert_splits` (what `plan` prints) is
    its rows at the default two slots. Same bytes per rank at every pair."""
    from mkresearch.kernels.compose import megakernel_plan as mplan

    cfg = get_config("kimi-k3")
    assert partition.expert_tp_ways(cfg, 32, columns=False) == [1, 2, 4, 8]
    assert partition.expert_tp_ways(cfg, 32) == [1, 2, 4]  # the exact mode's
    steps = design_table.design_steps(cfg, 32, 1)
    (before, variant, fields), (label, _, last) = steps[-2], steps[-1]
    assert before == "+ bf16 partial sums"
    table = design_table.expert_layouts(variant, 32, 1, **fields)
    step = {(r["etp"], r["slots"]): r["step_ms"] for r in table["rows"]}
    assert sorted(step) == [(e, n) for e in (1, 2, 4, 8) for n in mplan.EXPERT_SLOTS]
    assert table["as_built"] == {"etp": 4, "slots": 2}
    fits = {(r["etp"], r["slots"]): r["planned"] for r in table["rows"]}
    # W2 whole: two slots fit at B = 1, more are over VMEM
    assert fits[1, 2] and not any(fits[1, n] for n in mplan.EXPERT_SLOTS if n > 2)
    assert all(fits[8, n] for n in mplan.EXPERT_SLOTS)
    best = min((k for k in step if fits[k]), key=lambda k: (step[k], k[1], k[0]))
    assert (table["chosen"]["etp"], table["chosen"]["slots"]) == best
    assert last == {**fields, "etp": best[0], "expert_slots": best[1]}
    assert label == f"+ experts {best[0]} ways, {best[1]} slots"
    print(f"Kimi K3 / 32, B = 1, every design before it: chosen {best}, {step[best]:.3f} ms; "
          f"at 2 slots by ETP { {e: round(step[e, 2], 3) for e in (1, 2, 4, 8)} }")
    for etp in (2, 4, 8):  # the plans that fit: more slots, never a deeper ring
        rings = [r["ring"] for r in table["rows"] if r["etp"] == etp and r["planned"]]
        assert rings == sorted(rings, reverse=True) and rings[0] > rings[-1]
    splits = design_table.expert_splits(variant, 32, 1, **fields)
    assert splits["rows"] == [{"etp": e, "ep": 32 // e, "step_ms": step[e, 2],
                               "planned": fits[e, 2]} for e in (1, 2, 4, 8)]
    assert splits["as_built"] == 4 and splits["chosen"] == 8
    assert step[8, 2] < step[4, 2] < step[2, 2] < step[1, 2]
    rows = design_table.designs_table(cfg, 32, (1,))
    assert rows[-2]["design"] == label and rows[-2]["step_ms"] == pytest.approx(step[best])
    assert rows[-2]["rank_gb"] == pytest.approx(rows[-3]["rank_gb"], rel=1e-12)


def _bounds(rows, side_prefix):
    return {r["resource"]: r for r in rows if r["side"].startswith(side_prefix)}


@pytest.mark.slow  # the designs at B = 1 (cached from the table's test when in one process)
def test_what_the_designs_last_step_waits_for(capsys):
    """`step_bounds`: each side's step with one resource 10x faster, the same kernel. At B = 1
    the designs' last row waits on collective latency most, then on the MXU; its reads and the
    vector unit barely move it (docs/prediction.md §8), and so for the release's."""
    cfg = get_config("kimi-k3")
    rows = step_bounds.step_bounds(cfg, 32, 1)
    table = design_table.designs_table(cfg, 32, (1,))
    ours, release = _bounds(rows, "ours ("), _bounds(rows, "the release")
    assert rows[0]["side"] == f"ours ({table[-2]['design'].removeprefix('+ ')})"
    for side, row in ((ours, table[-2]), (release, table[-1])):
        assert list(side) == [step_bounds.AS_MODELLED, *(r[0] for r in step_bounds.RESOURCES)]
        base = side[step_bounds.AS_MODELLED]["step_ms"]
        assert base == pytest.approx(row["step_ms"], rel=1e-12)  # the table's step, unmoved
        for r in side.values():
            assert r["saved_ms"] == pytest.approx(base - r["step_ms"], abs=1e-9)
            assert r["saved_ms"] >= 0  # a faster resource never slows the step
        saved = {k: r["saved_ms"] / base for k, r in side.items()}
        assert saved["collective latency"] > saved["the MXU"] > saved["link bandwidth"]
        assert saved["the MXU"] > 0.15 and saved["weight and expert reads"] < 0.05
        assert saved["the vector unit"] < 0.001
    capsys.readouterr()
    assert cli.main(["predict", "kimi-k3", "--designs", "--bounds", "--batch", "1",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"designs": table, "bounds": rows}
    assert cli.main(["predict", "kimi-k3", "--bounds"]) == 2
    assert "--bounds is invalid without --designs" in capsys.readouterr().err


def test_a_vector_unit_of_v5p_width_loses_to_the_mxu_on_fp8_and_mxfp4_at_one_row():
    """docs/prediction.md §8: at one row the MXU takes weights at 256 per push of its peak; a
    vector unit of v5p's published width and clock takes bf16 weights 1.59x faster, fp8 and
    MXFP4 slower (even at two operations a weight, with no conversion)."""
    rates = step_bounds.one_row_rates()
    chip = timeline_chip("tpu7x")
    vpu_ops = tchip.V5P_VPU_OPS_PER_CYCLE * tchip.V5P_CLOCK_HZ  # per TensorCore
    assert rates["bf16"]["mxu"] == pytest.approx(chip.mxu_flops / 512)
    assert rates["fp8"]["mxu"] == rates["mxfp4"]["mxu"] == pytest.approx(chip.fp8_flops / 512)
    for fmt, r in rates.items():
        assert r["vpu"] == pytest.approx(vpu_ops / step_bounds.VPU_OPS_PER_WEIGHT[fmt])
        assert r["vpu_over_mxu"] == pytest.approx(r["vpu"] / r["mxu"])
    assert 1.55 < rates["bf16"]["vpu_over_mxu"] < 1.65
    assert vpu_ops / 2 < rates["fp8"]["mxu"]  # fp8 and MXFP4 lose even at 2 operations
    assert rates["bf16"]["mxu"] * 1.05 < vpu_ops / 3 < rates["bf16"]["mxu"] * 1.07  # converted
    # such a vector unit is a tenth of the vector rate ASSUMPTION, as far as the sensitivity goes
    assert 0.095 < vpu_ops / chip.vpu_flops < 0.105
    assert any(f == "vpu_flops" and 0.1 in v for _, _, f, v in calibration.ASSUMPTIONS)


@pytest.mark.slow  # the designs at B = 1 (cached from the table's test in one process)
def test_bf16_products_on_the_vector_unit_would_shorten_only_the_one_row_step():
    """The what-if of docs/prediction.md §8: every bf16 product at the vector unit's rate where
    it wins takes our B = 1 step from 3.50 to 3.26 ms (0.79 of the release's 4.11); from B = 2
    the vector unit's time (twice one row's) is longer than the MXU's, which keeps them all."""
    cfg = get_config("kimi-k3")
    table = design_table.designs_table(cfg, 32, (1,))
    one = step_bounds.vector_unit_step(cfg, 32, 1)
    assert one["step_ms"] == pytest.approx(table[-2]["step_ms"], rel=1e-12)
    assert 3.45 < one["step_ms"] < 3.55 and 3.2 < one["vector_step_ms"] < 3.3
    assert 0.78 < one["vector_step_ms"] / table[-1]["step_ms"] < 0.80  # the release at B = 1
    assert one["bf16_speedup"] == step_bounds.one_row_rates()["bf16"]["vpu_over_mxu"] < 2


@pytest.mark.slow  # the designs at B = 1 (cached from the table's test) and one more program
def test_two_microbatches_of_one_row_push_the_shared_blocks_twice():
    """The what-if of docs/prediction.md §8 at B = 2: two one-row microbatches interleaved. Alone,
    one is the designs' B = 1 step to the bit; together they take 4.47 ms, 0.85 ms of it the
    MXU's second push on the weight blocks both multiply, and keep up to 70 MiB of blocks beside
    a 40 MiB ring (VMEM the what-if does not charge)."""
    cfg = get_config("kimi-k3")
    table = design_table.designs_table(cfg, 32, (1,))
    two = microbatches.two_microbatch_step(cfg, 32, 2)
    assert two["one_microbatch_s"] * 1e3 == pytest.approx(table[-2]["step_ms"], rel=1e-12)
    assert table[-2]["design"] == "+ " + two["design"]
    assert 4.40e-3 < two["two_microbatches_s"] < 4.55e-3
    assert 0.80e-3 < two["second_push_s"] < 0.90e-3
    assert two["ring_bytes"] < two["held_vmem_bytes"] <= 70 * 2**20  # beside the ring
    assert two["held_vmem_bytes"] + two["ring_bytes"] > get_chip("tpu7x").vmem_bytes


@pytest.mark.exhaustive  # the designs at B = 2, 4 and 8 (~2 min)
def test_two_microbatches_do_not_beat_one_stream_at_any_batch():
    """docs/prediction.md §8: interleaving two microbatches of B / 2 rows is 4 to 9 % slower
    than the designs' one stream at B = 2 and 4, and within 1 % of it at B = 8; the second push
    outweighs the collectives it hides (B = 1 cannot be split)."""
    cfg = get_config("kimi-k3")
    ratios = {}
    for batch in (2, 4, 8):
        two = microbatches.two_microbatch_step(cfg, 32, batch)
        one = design_table.design_predictions(cfg, 32, batch)[-1][1]["step_s"]
        ratios[batch] = two["two_microbatches_s"] / one
    assert 1.04 < ratios[4] < ratios[2] < 1.10, ratios
    assert 0.99 < ratios[8] < 1.01, ratios


@pytest.mark.exhaustive  # the designs at B = 8 (~35 s)
def test_at_b8_our_step_waits_on_the_mxu_where_the_releases_waits_on_its_reads():
    """docs/prediction.md §8: at B = 8 our MXFP4 experts' MXU time is on the path (almost as
    long as the collective latencies), the release's (FP8 gate and up) a third as long."""
    rows = step_bounds.step_bounds(get_config("kimi-k3"), 32, 8)
    ours, release = _bounds(rows, "ours ("), _bounds(rows, "the release")
    mxu, latency = "the MXU", "collective latency"
    assert ours[mxu]["saved_ms"] > 0.8 * ours[latency]["saved_ms"]
    assert release[mxu]["saved_ms"] < 0.4 * ours[mxu]["saved_ms"]
    reads = "weight and expert reads"
    assert release[reads]["saved_ms"] > 2 * ours[reads]["saved_ms"]


def test_a_faster_resource_moves_only_its_figures():
    model = design_table.SAME_ASSUMPTIONS
    chip, inter = timeline_chip("tpu7x"), links.interconnect("tpu7x", n_ranks=32)
    for resource, field, figures, rate in step_bounds.RESOURCES:
        moved = getattr(step_bounds.faster(model, resource, 32, 4.0), field)
        base = chip if field == "timeline_chip" else inter
        for name in type(base).__dataclass_fields__:
            if name == "sources":
                continue
            want = getattr(base, name)
            if name in figures:
                want = want * 4.0 if rate else want / 4.0
            assert getattr(moved, name) == want, (resource, name)
    with pytest.raises(ValueError, match="resource='disk' is invalid: one of"):
        step_bounds.faster(model, "disk", 32)


@pytest.mark.slow  # two full-size predictions at B = 8 (~5 s)
def test_a_third_expert_slot_hides_the_experts_mxu_time_at_b8():
    """At B = 8 (Kimi K3 / 32, restructured, experts to the MXU as fp8, expert reads first, the
    router on each host, the bf16 wire, experts split 8 ways) two slots leave the MXU's work on
    the routed experts exposed: the next expert's read waits for the slot the multiplied one
    holds. A third slot keeps the reads moving while one is multiplied: compute exposed falls by
    more than a fifth, the step by more than 4 %, at the same bytes and ring depth."""
    cfg = get_config("kimi-k3", expert_mxu="fp8")
    fields = {"collectives": layouts.RESTRUCTURED, "wire": "bf16", "expert_order": "first",
              "designs": ("router-host",), "etp": 8}
    two, three = (design_table.predict_design(cfg, 32, 8, design_table.SAME_ASSUMPTIONS,
                                              expert_slots=n, **fields) for n in (2, 3))
    print(f"B = 8: step {two['step_s'] * 1e3:.3f} -> {three['step_s'] * 1e3:.3f} ms, compute "
          f"exposed {two['parts_s']['compute'] * 1e3:.3f} -> "
          f"{three['parts_s']['compute'] * 1e3:.3f} ms")
    assert two["schedule"]["expert_slots"] == 2 and three["schedule"]["expert_slots"] == 3
    assert three["schedule"]["banks"] == two["schedule"]["banks"]
    assert three["parts_s"]["compute"] < 0.8 * two["parts_s"]["compute"]
    assert three["step_s"] < 0.96 * two["step_s"]
    assert three["rank_bytes"] == two["rank_bytes"]


def test_bf16_partial_sums_are_the_kernel_built_with_a_bf16_wire():
    """The designs' last step is the kernel built with a bf16 wire (`our_schedule(wire=...)`):
    its reductions' algorithms and ring depth for that wire, every partial sum on the wire as
    bf16 (restructured's reduce-scatter and the widened shared sum too, `collective_ops`)."""
    from mkresearch.kernels.compose import megakernel_sharded

    cfg = get_config("kimi-k3")
    lay = layouts.layout(cfg, 32, collectives=layouts.RESTRUCTURED)
    sched = scale_out.our_schedule(cfg, layouts.RESTRUCTURED, 32, 1, wire="bf16")
    options = megakernel_sharded.kernel_options(lay, 1, "tpu7x", "bf16")
    assert sched.wire == "bf16" and sched.reductions == options.reductions
    assert sched.reductions != scale_out.our_schedule(cfg, layouts.RESTRUCTURED, 32, 1).reductions
    assert sched.banks + 1 == megakernel_sharded.ring_depth(lay, 1, options=options,
                                                            wire="bf16").depth
    p = _ours(mode=layouts.RESTRUCTURED, wire="bf16")  # the wire alone: the f32 kernel's choices
    assert {run.nbytes for run in _runs(p, sharding.EXPERT_SUM)} == {128 * 2}
    # [d | d | 128] at 2 bytes a value, two to an f32 slot, in whole lanes: 7,232 slots -> 7,296
    slots = sharding.lanes((2 * cfg.d_model + 128) // 2)
    assert {run.nbytes for run in _runs(p, sharding.SHARED_DOWN)} == {slots * 4} == {29184}


@pytest.mark.slow  # full-size predictions of both sides (~8 s)
def test_one_model_prices_both_sides_links():
    """The design table's release row is the release under the same Model as ours."""
    model = calibration.Model(interconnect=links.interconnect("tpu7x", hop_latency=1e-6))
    rows = design_table.designs_table(get_config("kimi-k3"), 32, (1,), model=model)
    assert rows[-1]["step_ms"] == pytest.approx(
        model.predict(get_config("kimi-k3"), 1)["step_s"] * 1e3)


@pytest.mark.slow  # four full-size predictions (~7 s)
def test_experts_handed_to_the_mxu_as_fp8(capsys):
    """ModelConfig.expert_mxu = "fp8" (the kernel's block-scaled product, priced at the fp8
    peak): faster than as built at every batch, the same bytes per rank; `predict --expert-mxu`
    names it in the step's line and refuses bf16 experts, naming the field."""
    cfg = get_config("kimi-k3")
    for batch in (1, 8):
        built = scale_out.predict(cfg, 32, layouts.OURS, batch)
        fp8 = scale_out.predict(cfg.replace(expert_mxu="fp8"), 32, layouts.OURS, batch)
        assert fp8["schedule"]["mxu_fp8"] and not built["schedule"]["mxu_fp8"]
        assert fp8["step_s"] < built["step_s"] and fp8["rank_bytes"] == built["rank_bytes"]
    assert cli.main(["predict", "kimi-k3", "--batch", "1", "--rank-layout", "ours",
                     "--expert-mxu", "fp8"]) == 0
    assert "B=1, experts to the MXU as fp8)" in capsys.readouterr().out
    assert cli.main(["predict", "glm-4.5", "--expert-mxu", "fp8"]) == 2
    assert "expert_mxu='fp8' is invalid" in capsys.readouterr().err


@pytest.mark.slow  # two full-size predictions and plans at 16 rows (~15 s)
def test_a_step_no_kernel_plans_is_marked_and_never_chosen():
    """At 16 rows (B = 2 with 7 drafts) Kimi K3's restructured bf16 step with the experts split 2
    ways and 4 VMEM slots per expert matrix is over the core's VMEM: `make_sharded_plan`
    refuses it, and its predicted schedule says so (`kernel_plans`); 3 slots are planned. The
    tables mark the step no kernel plans; `expert_layouts` chooses among the planned."""
    from mkresearch.kernels.compose import megakernel_sharded as ms

    cfg = get_config("kimi-k3", expert_mxu="fp8")
    fields = {"collectives": layouts.RESTRUCTURED, "wire": "bf16", "expert_order": "first",
              "designs": ("router-replicated",)}
    lay = layouts.layout(cfg, 32, collectives=layouts.RESTRUCTURED, etp=2)
    for slots, planned in ((4, False), (3, True)):
        p = design_table.predict_design(cfg, 32, 16, design_table.SAME_ASSUMPTIONS,
                                        sequences=2, etp=2, expert_slots=slots, **fields)
        assert p["schedule"]["kernel_plans"] is planned
        options = ms.kernel_options(lay, 16, "tpu7x", "bf16", router_placement="replicated",
                                    expert_slots=slots)
        if planned:
            ms.make_sharded_plan(lay, 16, options=options, wire="bf16")
        else:
            with pytest.raises(ValueError, match="VMEM plan needs"):
                ms.make_sharded_plan(lay, 16, options=options, wire="bf16")
    assert design_table.design_label("+ x", False) == "+ x" + design_table.UNPLANNED
    assert design_table.design_label("+ x", True) == "+ x"
