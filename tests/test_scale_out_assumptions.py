"""The scale-out model's assumptions, both sides under one set: where a weight stream runs past a
collective (each program's own, or a switch for both), how the routed experts' reads meet the
ring (queued, first, held; one or two DMA queues), what a weight tile costs the MXU, the DMA
rate, and `mkresearch predict --json` exposing every assumption of both sides."""

import dataclasses
import json

import pytest

from mkresearch.cli import main as cli
from mkresearch.hardware import interconnect as links
from mkresearch.model import formats
from mkresearch.model.config import get_config
from mkresearch.prediction import calibration, program, scale_out
from mkresearch.prediction import timeline as tl
from mkresearch.prediction.timeline_chip import timeline_chip
from mkresearch.prediction.timeline_ranks import simulate_programs
from mkresearch.sharding import layout as layouts

MIB = 2**20
LABELS = ("MEASURED", "PUBLISHED", "ASSUMPTION", "mkresearch.hardware.chips", "None:", "the ")


def _step(ops, blocks, banks=4, chip="tpu7x", **kwargs) -> float:
    sim = tl.RankSimulation(ops, chip, blocks=blocks, banks=banks, batch=1, **kwargs)
    for request in sim.run():  # a program without collectives yields none
        raise AssertionError(request)
    return sim.total


def test_a_collective_holds_the_ring_where_its_program_says():
    """`streams` False holds the ring's horizon at the collective (the blocks after it are
    issued once the rank is past it); the prediction's switch overrides every collective."""
    inter = links.interconnect("tpu7x", slice="tpu7x:2x2x1")
    blocks = [2 * MIB] * 40
    start = ("start", "sum", "all_reduce", (0,), tuple(range(8)), 2**16, True, "rs-ag")
    steps = {}
    for streams in (True, False):
        ops = [("blocks", 20), start + (streams,), ("blocks", 20)]
        for across in (None, True, False):
            ranks = simulate_programs([ops], blocks, 4, 1, (0,), inter, "auto",
                                      prefetch_across=across)
            steps[streams, across] = ranks.total_s
    assert steps[True, None] == steps[True, True] == steps[False, True]
    assert steps[False, None] == steps[False, False] == steps[True, False] > steps[True, None]


def test_a_held_collective_still_moves_the_blocks_issued_ahead_of_it():
    """`ahead` k: a collective that holds the ring still lets its next k blocks move while it is
    waited (its kernel issued them earlier); all of them is the same as streaming past it."""
    inter = links.interconnect("tpu7x", slice="tpu7x:2x2x1")
    blocks = [2 * MIB] * 40
    start = ("start", "sum", "all_reduce", (0,), tuple(range(8)), 2**16, True, "rs-ag")
    steps = {}
    for ahead in (0, 1, 3, 40):
        ops = [("blocks", 20), start + (False, ahead), ("blocks", 20)]
        steps[ahead] = simulate_programs([ops], blocks, 4, 1, (0,), inter, "auto").total_s
    streaming = simulate_programs([[("blocks", 20), start + (True,), ("blocks", 20)]], blocks, 4,
                                  1, (0,), inter, "auto").total_s
    assert steps[0] > steps[1] > steps[3] and steps[40] == streaming


@pytest.mark.parametrize("order", tl.FETCH_ORDERS)
def test_a_prefetch_issues_the_fetch_where_it_stands(order):
    """("prefetch",) issues the next fetch's first DMAs (its slots) at its point: the fetch,
    after other work, finds them landed; the same bytes move."""
    chip = timeline_chip("tpu7x")
    blocks = [2 * MIB] * 40
    fetch = ("fetch", 4 * MIB, 3, 2, (), order)
    totals = {}
    for early in (False, True):
        ops = [("blocks", 5), *([("prefetch",)] if early else []), ("compute", 1e9),
               ("blocks", 2), fetch, ("blocks", 5)]
        sim = tl.RankSimulation(ops, chip, blocks=blocks, banks=4, batch=1)
        for _ in sim.run():
            pass
        totals[early] = (sim.t, sim.dma_bytes)
    assert totals[True][0] < totals[False][0] and totals[True][1] == totals[False][1]
    with pytest.raises(ValueError, match="a prefetch with no fetch after it"):
        for _ in tl.RankSimulation([("blocks", 1), ("prefetch",)], chip, blocks=blocks,
                                   banks=4, batch=1).run():
            pass


def test_the_release_streams_as_its_kernel_issues_its_weights():
    """The release's program from its kernel (kimi/decode_megakernel.py, docs/prediction.md §4):
    W_o is prefetched, so the attended features' swap lets the stream run; the attention's output
    collectives hold it but for the next MoE's router, issued a layer ahead (`after_experts`);
    the routed experts' first reads are issued right after routing, inside top-k; W_lu's read
    runs beside the routed sum, waited before W_lu; the MoE's other collectives stream."""
    cfg = get_config("kimi-k3")
    lay = layouts.layout(cfg, 32, layouts.RELEASE)
    stage = scale_out._stage_bytes(lay, scale_out.rank_bytes(lay, scale_out.RELEASE_SCHEDULE, 1,
                                                             0))
    for kind, routed, streams in (("kda", False, False), ("mla", False, False),
                                  ("moe", True, True)):
        actions = program.release_actions(stage[kind].matrices, routed)
        ours = program.release_collectives(lay, kind, actions, 0, 1, routed)
        blocking = [c for c in ours if c.issue_after == f"{kind} end"]
        assert blocking and all(c.streams is streams for c in blocking), kind
        by_name = {c.name: c for c in ours}
        if not routed:
            assert by_name[f"{kind}/features"].streams
            # the MoE's router, 12.85 MB per rank, is 7 blocks of 2 MiB
            ahead = program.release_router_ahead(ours, stage["moe"].matrices, 2 * MIB)
            assert [c.ahead for c in ahead] == [0 if c.streams else 7 for c in ours]
            assert program.release_experts_issued_after(actions) is None
        else:
            routed_sum = by_name["moe_sum"]
            assert routed_sum.issue_after == program.EXPERTS and routed_sum.streams
            assert routed_sum.wait_before.endswith("w_lu")
            assert program.release_experts_issued_after(actions).endswith("w_router")
    one = scale_out.predict(cfg, 32, layouts.RELEASE, 1, context=512)
    # its kernel's count at B = 1: 93 attention stages x 3, 92 MoE x 5, the dense FFN's sum, the
    # embedding's and sampling's
    assert one["collectives_per_rank"] == 93 * 3 + 92 * 5 + 3 == 742
    ours = program.our_collectives(scale_out.sharding.sharding_plan(
        layouts.layout(cfg, 32, collectives="partial-sum")), 0, None)
    assert all(c.streams for stage in ours[1].values() for c in stage)  # one global ring


@pytest.mark.parametrize("queues", [1, 2])
def test_expert_reads_first_held_or_queued(queues):
    """Fetched DMAs behind a ring with blocks in flight: queued waits for them (one queue) or
    shares the bandwidth (two); first goes ahead of those not yet moving; held keeps the ring
    from issuing past the fetch. Every byte moves either way."""
    chip = timeline_chip("tpu7x", n_dma_engines=queues)
    blocks = [2 * MIB] * 40
    landed = {}  # when the experts are multiplied: the program's clock after the fetch
    for order in tl.FETCH_ORDERS:
        ops = [("blocks", 5), ("fetch", 4 * MIB, 3, 2, (), order)]
        sim = tl.RankSimulation(ops, chip, blocks=blocks, banks=22, batch=1)
        for _ in sim.run():
            pass
        landed[order] = sim.t
        moved = sum(b - a for a, b in sim.dma)
        assert moved == pytest.approx((sim.issued * 2 * MIB + 12 * MIB)
                                      / chip.weight_dma_bandwidth, rel=1e-9)
    print(queues, {k: round(v * 1e6, 2) for k, v in landed.items()})
    assert landed["first"] < landed["queued"] and landed["held"] < landed["queued"]


def test_a_weight_tile_costs_the_mxu_its_rows():
    """2 x weights x max(rows, 256) / peak: the release's measured int8 dense phase (39.8 M
    weights pushed as bf16 in 17.4 us) within 2 %; fp8 at twice the rate; MXFP4 decoded to
    bf16 four times its fp8 cost per stored byte."""
    chip = timeline_chip("tpu7x")
    assert chip.mxu_rows == 256 and chip.fp8_flops == pytest.approx(2 * chip.mxu_flops, rel=0.01)
    weights = 34 * MIB + 8 * MIB / 2
    phase = weights * 2 * chip.mxu_seconds_per_byte(1, 0.5, False)  # bf16: 2 bytes a weight
    assert phase == pytest.approx(17.4e-6, rel=0.02)
    assert chip.mxu_seconds_per_byte(8, 1.0, True) == pytest.approx(
        chip.mxu_seconds_per_byte(8, 0.5, False), rel=0.01)
    assert chip.mxu_seconds_per_byte(1, 2.0, False) == pytest.approx(
        4 * chip.mxu_seconds_per_byte(1, 1.0, True), rel=0.01)
    assert chip.mxu_seconds_per_byte(512, 0.5, False) == pytest.approx(
        2 * chip.mxu_seconds_per_byte(1, 0.5, False))  # past the array's rows, rows count
    assert "MEASURED" in chip.sources["dma_bandwidth"] and chip.dma_bandwidth < chip.hbm_bandwidth
    mix = program.expert_mix(layouts.layout(get_config("kimi-k3"), 32, layouts.RELEASE), True,
                             True, 1)
    assert sum(share for share, *_ in mix) == pytest.approx(1) and all(f for _, _, f, _ in mix)


@pytest.mark.parametrize("batch", [1, 8, 9, 16, 32, 64])
def test_a_block_scaled_product_costs_the_mxu_its_spread_rows(batch):
    """Handed as fp8, an MXFP4 matrix's rows are spread over its scale blocks (`numerics.
    block_scaled_matmul`): ours over a K chunk's, the kernel's and the reference's rule
    (`formats.mxu_spread`: chunks of 256, 8 blocks, at every batch: Kimi K3's W1 / W3 K = 3584,
    W2 K = 3072), the release's down-projection over its tile's (K = 768: 24 blocks, 8 from 8
    rows), its FP8 gate / up not at all. Ours stays within the MXU's 256 rows up to B = 32; the
    decoded bf16 product is one row per row."""
    cfg = get_config("kimi-k3")
    lay = layouts.layout(cfg, 32, layouts.OURS)
    ours = program.expert_mix(lay, True, False, batch)
    ks = [cfg.moe_latent, cfg.expert_hidden, cfg.moe_latent]  # W1, W2, W3 (the mix's order)
    assert [s for *_, s in ours] == [formats.mxu_spread("mxfp4", k) for k in ks] == [8, 8, 8]
    assert (max(s for *_, s in ours) * batch <= timeline_chip("tpu7x").mxu_rows) == (batch <= 32)
    if batch <= 8:
        theirs = program.expert_mix(layouts.layout(cfg, 32, layouts.RELEASE), True, True, batch)
        assert [spread for *_, spread in theirs] == [1, 24 if batch < 8 else 8, 1]
    assert [s for *_, s in program.expert_mix(lay, False, False, batch)] == [1, 1, 1]


def test_one_model_for_both_sides():
    """A comparison holds every shared assumption equal: `Model` predicts both sides, each
    with its own program and schedule."""
    cfg = get_config("kimi-k3")
    model = calibration.Model(prefetch_across=False, context=16)
    ours = model.predict(cfg, 1, layouts.OURS, collectives="partial-sum")
    theirs = model.predict(cfg, 1, layouts.RELEASE)
    for p in (ours, theirs):
        assert p["schedule"]["prefetch_across"] is False
    assert ours["schedule"]["name"] == "ours" and theirs["schedule"]["name"] == "release"
    described = model.describe()
    assert described["prefetch_across"]["value"] is False and described["context"]["value"] == 16


def test_predict_json_exposes_every_assumption_of_both_sides(capsys):
    assert cli.main(["predict", "kimi-k3-mini", "--ranks", "4", "--batch", "1,2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    shared, sides = out["assumptions"]["shared"], out["assumptions"]["sides"]
    for name in links.FIGURES:
        assert f"interconnect.{name}" in shared
    for name in calibration.TIMELINE_FIELDS:
        assert f"timeline_chip.{name}" in shared
    for name in ("prefetch_across", "context", "routing"):
        assert name in shared
    for name, entry in shared.items():  # every shared figure says where it comes from
        assert any(label in entry["source"] for label in LABELS), (name, entry["source"])
    assert set(sides) == {"ours", "release"}
    for side in sides.values():
        for schedule in side.values():
            for field in ("banks", "expert_slots", "expert_order", "mxu_fp8", "prefetch_across",
                          "source"):
                assert field in schedule, field
    assert out["assumptions"]["shared"]["context"]["value"] == 0  # as info's lines (--context)


def test_the_schedule_refuses_an_unknown_expert_order():
    with pytest.raises(ValueError, match="Schedule.expert_order='soon' is invalid"):
        dataclasses.replace(scale_out.RELEASE_SCHEDULE, expert_order="soon")
