"""The scale-out model: collective pricing against closed forms, the timeline over many ranks,
every rank's program from a layout, the calibration against the release's published steps, our
prediction beside them, `mkresearch predict` and figures/scale_out.png's data."""

import copy
import json

import pytest

from mkresearch.cli import main as cli
from mkresearch.hardware import interconnect as links
from mkresearch.hardware import topology
from mkresearch.model.config import get_config
from mkresearch.prediction import calibration, scale_out, second_model
from mkresearch.prediction.timeline_chip import timeline_chip
from mkresearch.prediction.timeline_events import CollectiveEvent, LogEvent
from mkresearch.prediction.timeline_ranks import PARTS, simulate_programs, simulate_ranks
from mkresearch.sharding import layout as layouts
from mkresearch.sharding import layout_bytes
from mkresearch.views.scale_out_plots import KINDS, figure_rows, parts_rows, ranks_rows

US = 1e-6


@pytest.fixture(scope="module", autouse=True)
def validations_computed_once():
    """Each distinct validation (one per Model: the base, each assumption moved, each refit of the
    collective line) is computed once in this module: the sensitivity and the leave-one-out are
    computed in full by the first test that asks, and the progress bars' runs and `predict
    --validate` then assemble and print the same validations (the module's other predictions
    push them out of `scale_out._predict`'s cache: --validate took ~22 s more without this).
    Copies: no caller can change a cached row."""
    computed, validation = {}, calibration.validation

    def once(model=None, cfg=None):
        model = calibration.Model() if model is None else model
        if (model, cfg) not in computed:
            computed[model, cfg] = validation(model, cfg)
        return copy.deepcopy(computed[model, cfg])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibration, "validation", once)
        yield


def _links(slice_name: str, latency: float, bandwidth: float) -> links.Interconnect:
    # one latency for the sibling path and ICI, per-link bandwidth; injection never the limit
    return links.interconnect(slice_name.split(":")[0], slice=slice_name, ici_latency=latency,
                              sibling_latency=latency, ici_bandwidth=bandwidth,
                              sibling_bandwidth=bandwidth, injection_bandwidth=1e18,
                              hop_latency=0.0)


# (slice, group, busiest-link bytes per one-shot message of m, counted by hand)
# v5p:2x2x2, one core per chip, x fastest: ranks 0-3 are the z = 0 plane. One-shot in the plane:
# chip 0's +x link carries its messages to chips 1 and 3 (x first), its +y link its own to 2 and
# chip 1's to 2 (forwarded after 1 -> 0): 2 m on the busiest link.
# tpu7x:2x2x1, two cores per chip: ranks 0, 2 are core 0 of chips 0 and 1 (one x hop);
# ranks 0..3: chips 0 and 1 whole: 2 cores x 2 peers cross the one x link each way, 4 m.
ONE_SHOT_CASES = [("v5p:2x2x2", (0, 1), 1), ("v5p:2x2x2", (0, 1, 2, 3), 2),
                  ("tpu7x:2x2x1", (0, 2), 1), ("tpu7x:2x2x1", (0, 1, 2, 3), 4)]


@pytest.mark.parametrize("slice_name, group, per_message", ONE_SHOT_CASES)
@pytest.mark.parametrize("nbytes, latency, bandwidth", [
    (1024, 1 * US, 10e9), (14336, 2.2 * US, 45e9), (229376, 0.5 * US, 100e9)])
def test_collective_prices_match_their_closed_forms(slice_name, group, per_message, nbytes,
                                                    latency, bandwidth):
    inter, n = _links(slice_name, latency, bandwidth), len(group)
    siblings_only = all(inter.chip_of(r) == inter.chip_of(group[0]) for r in group)
    assert not siblings_only
    for op in ("all_gather", "all_reduce"):
        price = links.price(inter, op, "one-shot", group, nbytes)
        assert (price.phases, price.messages) == (1, n - 1)
        assert price.link_bytes == per_message * nbytes
        assert price.seconds == pytest.approx(latency + per_message * nbytes / bandwidth,
                                              rel=1e-12)
    # rs-ag: two one-shot phases of m / n (one host: the second model's 2 (n - 1) messages)
    rs = links.price(inter, "all_reduce", "rs-ag", group, nbytes)
    assert (rs.phases, rs.messages) == (2, 2 * (n - 1))
    assert rs.seconds == pytest.approx(2 * (latency + per_message * nbytes / n / bandwidth),
                                       rel=1e-12)
    if n == 2:  # a ring of two: one neighbour, one link
        gather = links.price(inter, "all_gather", "ring", group, nbytes)
        assert gather.seconds == pytest.approx(latency + nbytes / bandwidth, rel=1e-12)
        reduce = links.price(inter, "all_reduce", "ring", group, nbytes)
        assert reduce.phases == 2
        assert reduce.seconds == pytest.approx(2 * (latency + nbytes / 2 / bandwidth), rel=1e-12)
    chain = links.price(inter, "chain", "one-shot", (0, 1), nbytes)
    route = len(inter.slice.route(0, 1))
    assert chain.seconds == pytest.approx(latency + nbytes / bandwidth, rel=1e-12) and route <= 1


def test_the_sibling_path_is_its_own():
    inter = links.interconnect("tpu7x", slice="tpu7x:2x2x1")
    sib = inter.sibling
    price = links.price(inter, "all_gather", "one-shot", (4, 5), 4096)
    assert price.link_bytes == 0 and price.seconds == pytest.approx(sib.seconds(4096), rel=1e-12)
    # sibling and ICI messages of one phase run in parallel: the phase is the longer one
    both = links.price(inter, "all_gather", "one-shot", (0, 1, 2), 4096)
    ici = inter.ici_latency + 2 * 4096 / inter.ici_bandwidth
    assert both.seconds == pytest.approx(max(ici, sib.seconds(4096)), rel=1e-12)


def test_two_level_is_a_host_phase_then_one_across_hosts():
    inter = _links("tpu7x:2x2x4", 2 * US, 100e9)
    m = 28672
    group = tuple(range(32))  # 4 hosts of 8 cores
    reduce = links.price(inter, "all_reduce", "two-level", group, m)
    assert reduce.phases == 2 and reduce.messages == 7 + 3
    # in a host (a 2x2 plane), a chip's x link carries both cores' vectors to the 2 cores of its
    # x neighbour and the 2 of its diagonal (x first): 8 m. Across hosts (a line of 4 chips along
    # z, no wraparound), the busiest link (z = 1 -> 2) carries the vectors of both cores of the
    # chips at z = 0 and z = 1 to their counterparts at z = 2 and 3: 2 x (2 + 2) = 8 m.
    assert reduce.seconds == pytest.approx(2 * (2 * US) + 8 * m / 100e9 + 8 * m / 100e9,
                                           rel=1e-12)


def test_links_by_direction_and_routes_without_wraparound():
    sl = topology.get_slice("tpu7x:2x2x4")
    assert sl.n_ranks == 32 and sl.host_of(8) == 1 and sl.chip_of(9) == 4
    assert set(sl.links_of(0)) == {(0, 0, +1), (0, 1, +1), (0, 2, +1)}  # a corner: 3 links
    assert len(sl.links_of(sl.chip_at((1, 1, 1)))) == 4  # x, y and both ways along z
    assert sl.route(0, 1) == ()  # the sibling core: no chip link
    far = sl.route(0, 31)  # chip 0 -> chip 15 = (1, 1, 3): x, then y, then 3 hops along z
    assert [axis for _, axis, _ in far] == [0, 1, 2, 2, 2]
    ring = topology.get_slice("v5p:4x4x4")  # wraparound: the shorter way round
    assert len(ring.route(0, 3)) == 1 and ring.route(0, 3)[0] == (0, 0, -1)


def test_the_interconnect_figures_are_the_release_measurements():
    inter = links.interconnect("tpu7x")
    for nbytes, rate in links.SIBLING_MEASURED:
        assert nbytes / inter.sibling.seconds(nbytes) == pytest.approx(rate, rel=1e-9)
    # the line through the measured all-reduces: within 0.5 us of each, ~100 GB/s per link
    small = links.interconnect(inter, slice=links.COLLECTIVE_MEASURED_ON)
    for nbytes, seconds in links.COLLECTIVE_MEASURED:
        price = links.price(small, "all_reduce", "rs-ag", tuple(range(8)), nbytes)
        assert price.link_bytes == 2 * nbytes
        assert abs(price.seconds - seconds) < 0.5 * US
    assert 2.1 * US < inter.ici_latency < 2.3 * US and 95e9 < inter.ici_bandwidth < 105e9
    labels = {name: source.split(":")[0] for name, _, source in inter.explain()}
    assert labels["hop_latency"] == "ASSUMPTION"
    assert {labels[k] for k in ("sibling_latency", "ici_latency", "ici_bandwidth",
                                "injection_bandwidth")} == {"MEASURED"}


@pytest.mark.parametrize("call, match", [
    (lambda: links.interconnect("v4"), "chip='v4' is invalid"),
    (lambda: links.interconnect("tpu7x", n_ranks=12), "n_ranks=12 is invalid for chip='tpu7x'"),
    (lambda: links.interconnect("tpu7x", ici_speed=1), "override 'ici_speed' is invalid"),
    (lambda: links.interconnect("tpu7x", ici_bandwidth=0), "ici_bandwidth=0 is invalid"),
    (lambda: links.price(links.interconnect(), "broadcast", "ring", (0, 1), 8), "op='broadcast'"),
    (lambda: links.price(links.interconnect(), "all_gather", "tree", (0, 1), 8), "algorithm='tree'"),
    (lambda: links.price(links.interconnect(), "all_gather", "ring", (0, 0), 8), "group="),
    (lambda: links.price(links.interconnect(), "all_gather", "ring", (0, 40), 8), "ranks < 32"),
])
def test_bad_interconnect_input_is_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- the timeline over many ranks ---------------------------------------------------------------
def _rank_log(nbytes: int, group=(0, 1)) -> list:
    return [LogEvent("dma_start", "w", "hbm", "vmem", nbytes), LogEvent("dma_wait", "w", "hbm", "vmem", nbytes),
            CollectiveEvent("sum", "all_reduce", group, 4096),
            LogEvent("dma_start", "v", "hbm", "vmem", 1000), LogEvent("dma_wait", "v", "hbm", "vmem", 1000)]


def test_a_collective_waits_for_its_slowest_peer_and_the_parts_sum_to_the_step():
    inter = _links("v5p:2x2x2", 1 * US, 10e9)  # ranks 0 and 1: neighbouring chips
    ranks = simulate_ranks([_rank_log(10**6), _rank_log(10**7)], "tpu7x", interconnect=inter,
                           algorithm="one-shot")
    (run,) = ranks.collectives
    assert run.start == max(run.arrivals) and run.arrivals[0] < run.arrivals[1]
    assert run.end - run.start == pytest.approx(1 * US + 4096 / 10e9, rel=1e-12)
    fast, slow = ranks.decomposition(0), ranks.decomposition(1)
    assert fast["waiting_for_peers"] == pytest.approx(run.arrivals[1] - run.arrivals[0], rel=1e-9)
    assert slow["waiting_for_peers"] == 0
    for parts in (fast, slow):
        assert sum(parts[p] for p in PARTS) == pytest.approx(parts["total"], rel=1e-12)
    assert ranks.slowest_rank in (0, 1)


def test_logs_that_disagree_on_their_collectives_are_refused():
    with pytest.raises(ValueError, match="only ranks"):
        simulate_ranks([_rank_log(100), _rank_log(100)[:2]], "tpu7x")
    with pytest.raises(ValueError, match="names ranks without a log"):
        simulate_ranks([_rank_log(100, (0, 5))], "tpu7x")


def _ring_log(blocks, banks, collective_after: int, first: list) -> list:
    """The DMA log of a ring of `banks` blocks in flight (as a ("blocks", n) op runs it: filled at the
    start of the step), the events `first` after that, one blocking all-reduce after block
    `collective_after`."""
    events, issued = [], 0

    def fill(consumed):
        nonlocal issued
        while issued < min(consumed + banks, len(blocks)):
            events.append(LogEvent("dma_start", "w", "hbm", "vmem", blocks[issued], issued % banks))
            issued += 1

    fill(0)
    events += first
    for i, nbytes in enumerate(blocks):
        events.append(LogEvent("dma_wait", "w", "hbm", "vmem", nbytes, i % banks))
        fill(i + 1)
        events += [LogEvent("phase_start", "w", flops=2 * nbytes, vmem_bytes=nbytes),
                   LogEvent("phase_end", "w")]
        if i == collective_after:
            events.append(CollectiveEvent("sum", "all_reduce", (0, 1), 8192))
    return events


def test_the_rings_closed_form_is_its_dmas_one_by_one():
    """One simulator (`timeline.RankSimulation`, joined by `timeline_ranks`): a program's ring
    and fetch ops are their DMAs and phases in closed form, the same times as the same program
    written DMA by DMA (a recorded log's ops)."""
    inter = links.interconnect("tpu7x", slice="tpu7x:2x2x1")
    blocks = [2**21] * 6 + [3 * 2**20] * 5
    programs = []
    for extra in (0, 2**22):  # rank 1 fetches more first: rank 0 waits for it
        ops = [("fetch", 2**20 + extra, 1, 1), ("blocks", 4),
               ("start", "sum", "all_reduce", (0, 1), (), 8192, True), ("blocks", 7)]
        programs.append(ops)
    # the recorded log's physics: DMAs at the HBM figure, a phase at its logged FLOPs
    chip = timeline_chip("tpu7x", dma_bandwidth=timeline_chip("tpu7x").hbm_bandwidth, mxu_rows=1)
    fast = simulate_programs(programs, blocks, 3, 2, (0, 1), inter, "one-shot", chip)
    logs = [_ring_log(blocks, 3, 3, [
        LogEvent("dma_start", "f", "hbm", "vmem", 2**20 + extra, 0),
        LogEvent("dma_wait", "f", "hbm", "vmem", 2**20 + extra, 0),
        LogEvent("phase_start", "f", flops=2 * (2**20 + extra), vmem_bytes=2**20 + extra),
        LogEvent("phase_end", "f")]) for extra in (0, 2**22)]
    slow = simulate_ranks(logs, chip, interconnect=inter, algorithm="one-shot")
    assert fast.total_s == pytest.approx(slow.total_s, rel=1e-12)
    for rank in (0, 1):
        a, b = fast.decomposition(rank), slow.decomposition(rank)
        assert all(a[p] == pytest.approx(b[p], rel=1e-9, abs=1e-15) for p in PARTS)


def test_a_collective_started_early_hides_behind_the_weight_stream():
    inter = links.interconnect("tpu7x", slice="tpu7x:2x2x1")
    blocks = [2**21] * 40
    start = ("start", "sum", "all_reduce", (0,), tuple(range(8)), 2**16, True)
    blocking = [("blocks", 20), start, ("blocks", 20)]
    early = [("blocks", 20), start[:6] + (False,), ("blocks", 20), ("wait", "sum")]
    steps = {}
    for label, ops in (("blocking", blocking), ("early", early)):
        for across in (False, True):
            ranks = simulate_programs([ops], blocks, 4, 1, (0,), inter, "rs-ag",
                                       prefetch_across=across)
            parts = ranks.decomposition()
            assert sum(parts[p] for p in PARTS) == pytest.approx(ranks.total_s, rel=1e-12)
            steps[label, across] = (ranks.total_s, parts["collective_messages"])
    price = links.price(inter, "all_reduce", "rs-ag", tuple(range(8)), 2**16).seconds
    # blocking without prefetch: the whole collective is exposed; with the ring running ahead
    # only what its 4 banks do not cover; started early and waited after 20 blocks: hidden
    assert steps["blocking", False][1] == pytest.approx(price, rel=1e-9)
    assert steps["blocking", True][1] < price
    assert steps["early", False][1] == 0 and steps["early", False][0] < steps["blocking", True][0]


def test_the_release_program_reads_the_layout_bytes_and_its_collectives():
    cfg = get_config("kimi-k3")
    p = scale_out.predict(cfg, 32, layouts.RELEASE, 1)
    counted = layout_bytes.rank_bytes(layouts.layout(cfg, 32, layouts.RELEASE), 1)
    # as its kernel sends them (program.release_collectives): attention: features from the
    # sibling, the parity's one-shot all-reduce, the halves swapped (93 layers); MoE: router
    # scores, latent gather, shared and routed sums, W_lu's slices gathered in the host (92); the
    # dense FFN's sum; the embedding and the sampling merge
    assert p["collectives_per_rank"] == 3 * 93 + 5 * 92 + 1 + 2
    assert p["rank_bytes"] == counted.total and p["slice"] == "tpu7x:2x2x4"
    assert p["algorithm"] == "auto"  # each collective as the program says
    # at 8 rows token scatter: the owned rows gathered before attention and before the MoE, a
    # reduce-scatter in the host's parity, the hosts', the halves
    assert scale_out.predict(cfg, 32, layouts.RELEASE, 8)["collectives_per_rank"] == \
        6 * 93 + 5 * 92 + 1 + 2
    # the slowest rank reads the layout's bytes but for its routed experts (a seeded routing)
    routed = counted.component("routed_experts")
    assert abs(p["dma_bytes_slowest_rank"] - counted.total) < routed
    assert sum(p["parts_s"].values()) == pytest.approx(p["step_s"], rel=1e-9)


def test_routing_counts_distinct_experts_per_expert_group():
    cfg = get_config("kimi-k3")
    lay = layouts.layout(cfg, 32)
    counts = scale_out.routed_experts(cfg, lay, 1)
    assert counts.shape == (len(cfg.moe_layers), lay.ep)
    assert (counts.sum(axis=1) == cfg.top_k).all()  # one row: top_k distinct experts
    assert (scale_out.routed_experts(cfg, lay, 8).sum(axis=1) <= 8 * cfg.top_k).all()


def test_mini_predictions_on_2_4_8_ranks():
    cfg = get_config("kimi-k3-mini")
    for n in (2, 4, 8):
        ours = scale_out.predict(cfg, n, layouts.OURS, 2, keep_timeline=True)
        assert len(ours["timeline"].ranks) == n // layouts.layout(cfg, n).etp
        rows = ranks_rows(ours["timeline"])
        assert {r["kind"] for r in rows} <= set(KINDS)
        assert all(r["end_us"] > r["start_us"] for r in rows)


def test_bad_schedule_and_batch_are_refused():
    cfg = get_config("kimi-k3-mini")
    with pytest.raises(ValueError, match="schedule='fast' is invalid"):
        scale_out.predict(cfg, 2, schedule="fast")
    with pytest.raises(ValueError, match="batch=0 is invalid"):
        scale_out.predict(cfg, 2, batch=0)
    with pytest.raises(ValueError, match="Schedule.banks=0 is invalid"):
        scale_out.Schedule("x", 2**21, 0, 1, "exact", "")
    with pytest.raises(ValueError, match="Schedule.all_reduce='tree' is invalid"):
        scale_out.Schedule("x", 2**21, 1, 1, "exact", "", all_reduce="tree")
    with pytest.raises(ValueError, match="algorithm='tree' is invalid"):
        scale_out.predict(cfg, 2, algorithm="tree")
    with pytest.raises(ValueError, match="slice='tpu7x:9x9' is invalid"):
        topology.get_slice("tpu7x:9x9")


# ---- validation and ours ----------------------------------------------------------------------
# Every published point, predicted with nothing fitted to a step time, each with the window its
# ratio (predicted / published time per token) falls in as the model stands: named, not tuned.
# Outside the 10 % of the issue: Kimi K3 at B = 4 (the model's release is 18 % fast there: a cost
# growing with the batch is missing, docs/prediction.md §4); the second model is 8 % fast at every
# batch (its report's collectives, padded to 8 rows, the experts' sum one row per (row, expert)).
RATIO_WINDOWS = {
    "Kimi K3 B=1": (0.99, 1.05), "Kimi K3 B=2": (0.93, 0.98), "Kimi K3 B=4": (0.80, 0.85),
    "Kimi K3 B=8": (0.88, 0.93), "816B-A42B B=1 (8 cores)": (0.90, 0.95),
    "816B-A42B B=2 (8 cores)": (0.89, 0.95), "816B-A42B B=4 (8 cores)": (0.89, 0.94),
    "816B-A42B B=8 (8 cores)": (0.89, 0.95), "speculative a=3 (k=7)": (0.97, 1.02),
    "speculative a=6 (k=7)": (0.98, 1.03)}


def _print_validation(rows):
    print("point                       published  predicted  ratio")
    for r in rows:
        print(f"{r['point']:26s} {r['published']:9.2f} {r['predicted']:9.2f}  {r['ratio']:.3f} "
              f"{r['unit']}")


def test_validation_against_every_published_point():
    rows = calibration.validation()
    _print_validation(rows)
    assert [r["point"] for r in rows] == list(RATIO_WINDOWS)
    for r in rows:
        low, high = RATIO_WINDOWS[r["point"]]
        assert low < r["ratio"] < high, r["point"]
        assert r["within"] == (abs(r["ratio"] - 1) <= calibration.TOLERANCE)


def test_the_second_model_from_its_report():
    """Its program carries the bytes its report gives (7.02 GB per step per core); each of its
    collectives, priced alone, against the report's measurement of it (the all-gathers are not
    points of the collective fit); its payloads grow with the batch, its bytes do not."""
    m = calibration.SECOND_MODEL
    blocks, (ops,) = second_model.programs(1)
    fetched = sum(op[1] * op[2] for op in ops if op[0] == "fetch")
    assert (sum(blocks) + fetched) == pytest.approx(7.02e9, rel=0.01)
    out = calibration.second_model()
    print(json.dumps({k: v for k, v in out.items() if k != "source"}, indent=1))
    # modelled / measured, as the model stands: the one-shot gathers price 23 % and 10 % fast
    windows = {"o_proj": (0.93, 0.98), "experts": (1.00, 1.05), "pre": (0.74, 0.80),
               "post": (0.87, 0.93)}
    alone = calibration.second_model_collectives()
    for row in alone:
        print(row)
        ratio = row["modelled_us"] / row["measured_us"]
        assert windows[row["name"]][0] < ratio < windows[row["name"]][1], row["name"]
    assert sorted(r["name"] for r in alone) == sorted(windows)
    assert [r["in_fit"] for r in alone] == [r["op"] == "all_reduce" for r in alone]
    # the layer loses less than the four collectives take: the ring streams while they run
    assert out["collectives_exposed_per_layer_us"] < out["collectives_per_layer_us"]
    assert out["per_layer_us"] < m["per_layer_us"] and out["fixed_us"] > 150
    steps = [calibration.second_model(b) for b in calibration.BATCHES]
    grows = [s["predicted_ms"] for s in steps]
    assert grows == sorted(grows)  # its collectives' payloads grow with the batch, not its bytes
    # below 8 rows the padded o-proj all-reduce and gathers cost the same at every batch
    assert len({s["collectives"][0]["us"] for s in steps}) == 1
    assert second_model.payload_rows(1) == 8 and second_model.payload_rows(64) == 64


@pytest.mark.slow
def test_sensitivity_and_leave_one_out(capsys):
    sens = calibration.sensitivity()
    assert len(sens["rows"]) == sum(len(v) for *_, v in calibration.ASSUMPTIONS)
    named = {row["assumption"] for row in sens["rows"]}
    for needed in ("sibling_latency", "hop_latency", "DMA queues", "weight stream past"):
        assert any(needed in n for n in named), needed
    for point, (low, high) in sens["ranges"].items():
        print(f"{point:26s} {low:.3f} .. {high:.3f}")
        assert low <= next(r["ratio"] for r in sens["base"] if r["point"] == point) <= high
    loo = calibration.leave_one_out()
    for held in loo["held_out"]:  # each measured all-reduce predicted from the other three
        assert abs(held["predicted_us"] / held["measured_us"] - 1) < 0.1
    for point, (low, high) in loo["ranges"].items():
        assert high - low < 0.08, point
    # with a progress bar (notebook 09): the same results, the bar on stderr (validations
    # cached: validations_computed_once)
    capsys.readouterr()
    assert calibration.sensitivity(progress=True) == sens
    assert calibration.leave_one_out(progress=True) == loo
    bars = capsys.readouterr().err
    assert f"{len(sens['rows'])}/{len(sens['rows'])}" in bars
    assert "leave-one-out" in bars and "4/4" in bars


def test_ours_beside_the_release_under_the_same_assumptions(capsys):
    (row,) = calibration.ours_table(batches=(1,))
    assert calibration.ours_table(batches=(1,), progress=True) == [row]  # a bar, the same row
    assert "our layout" in capsys.readouterr().err
    published_ms = 1e3 / row["published_tok_s"]
    built, exact, release = row["ours"], row["ours_exact"], row["release"]
    print(f"B=1: published {published_ms:.2f} ms; the release modelled {release['step_ms']:.2f}; "
          f"ours (partial sums) {built['step_ms']:.2f} ms ({built['collectives_per_rank']} "
          f"collectives); ours bit-exact {exact['step_ms']:.2f} ms; ours / release "
          f"{row['ours_over_release']:.2f}")
    # one Model for both: the same chip figures, links, context, streaming rule
    assert built["schedule"]["prefetch_across"] is release["schedule"]["prefetch_across"] is None
    assert exact["step_ms"] > built["step_ms"]
    assert built["collectives_per_rank"] < exact["collectives_per_rank"]
    assert row["ours_over_release"] == pytest.approx(built["step_ms"] / release["step_ms"])
    rows = figure_rows([{"batch": 1, "predicted_ms": 3.7}], [row])
    assert len(rows) == 6 and {r["batch"] for r in rows} == {1}
    assert {r["part"] for r in parts_rows({"x": {"parts_s": built["parts_ms"]}})} == set(PARTS)


# ---- the command -------------------------------------------------------------------------------
def test_predict_command_json(capsys):
    assert cli.main(["predict", "kimi-k3-mini", "--ranks", "4", "--batch", "1,2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(p["layout"], p["batch"]) for p in out["predictions"]] == [
        ("ours", 1), ("ours", 2), ("release", 1), ("release", 2)]
    assert all(set(p["parts_s"]) == set(PARTS) for p in out["predictions"])


def test_predict_command_explains_validates_and_profiles(capsys):
    assert cli.main(["predict", "kimi-k3", "--explain"]) == 0
    out = capsys.readouterr().out
    for name in links.FIGURES:
        assert f"interconnect.{name}" in out
    assert "ASSUMPTION" in out and "MEASURED" in out and "slice tpu7x:2x2x4" in out
    assert cli.main(["predict", "kimi-k3-mini", "--ranks", "8", "--batch", "1", "--rank-layout",
                     "release", "--profile"]) == 0
    assert "profile: one 8-rank prediction" in capsys.readouterr().out


@pytest.mark.slow
def test_predict_command_validates(capsys):
    assert cli.main(["predict", "kimi-k3", "--validate"]) == 0
    out = capsys.readouterr().out
    for point in ("Kimi K3 B=1", "Kimi K3 B=8", "816B-A42B B=1", "speculative a=6"):
        assert point in out
    assert "leave-one-out" in out and "sensitivity" in out
    assert out.count(" NO ") == sum(not r["within"] for r in calibration.validation())


def test_predict_command_table(capsys):
    assert cli.main(["predict", "kimi-k3-mini", "--ranks", "2", "--batch", "1",
                     "--rank-layout", "release", "--schedule", "ours", "--algorithm", "ring"]) == 0
    out = capsys.readouterr().out
    assert "kimi-k3-mini on 2 ranks of tpu7x (ring collectives)" in out
    assert "release  ours" in out


@pytest.mark.parametrize("argv, message", [
    (["predict", "deepseek-v3", "--ranks", "3"], "n_ranks=3 is invalid for deepseek-v3"),
    (["predict", "kimi-k3", "--ranks", "7"], "n_ranks=7 is invalid"),
    (["predict", "kimi-k3", "--chip", "v5e"], "n_ranks=32 is invalid for chip='v5e'"),
    (["predict", "kimi-k3", "--batch", "1,x"], "--batch '1,x' is invalid"),
    (["predict", "kimi-k3", "--batch", "0"], "--batch 0 is invalid: an int >= 1"),
    (["predict", "kimi-k3", "--rank-layout", "mine"], "invalid choice"),
])
def test_predict_command_refuses_bad_input(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
