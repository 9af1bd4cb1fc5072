"""The scale-out model: collective pricing against closed forms, the timeline over many ranks,
every rank's program from a layout, the calibration against the release's published steps, our
prediction beside them, `mkresearch predict` and figures/scale_out.png's data."""

import json

import pytest

from mkresearch import calibration, cli, layout_bytes, scale_out
from mkresearch import interconnect as links
from mkresearch import layout as layouts
from mkresearch.config import get_config
from mkresearch.scale_out_plots import KINDS, figure_rows, parts_rows, ranks_rows
from mkresearch.timeline_events import CollectiveEvent, LogEvent
from mkresearch.timeline_ranks import PARTS, simulate_ranks

US = 1e-6


def _one_link(latency: float, bandwidth: float, cores_per_chip: int) -> links.Interconnect:
    # cores_per_chip 1: every peer across ICI; 64: every peer a sibling. Both links the same.
    return links.interconnect("tpu7x", cores_per_chip=cores_per_chip, ici_latency=latency,
                              sibling_latency=latency, ici_bandwidth=bandwidth,
                              sibling_bandwidth=bandwidth)


@pytest.mark.parametrize("n, nbytes, latency, bandwidth", [
    (2, 1024, 1 * US, 10e9), (8, 14336, 2.2 * US, 45e9), (32, 229376, 0.5 * US, 100e9),
    (16, 1, 5 * US, 1e9)])
@pytest.mark.parametrize("cores_per_chip", [1, 64])
def test_collective_prices_match_their_closed_forms(n, nbytes, latency, bandwidth, cores_per_chip):
    inter, group = _one_link(latency, bandwidth, cores_per_chip), tuple(range(n))
    one_shot = latency + (n - 1) * nbytes / bandwidth
    for op in ("all_gather", "all_reduce"):
        price = links.price(inter, op, "one-shot", group, nbytes)
        assert price.seconds == pytest.approx(one_shot, rel=1e-12)
        assert (price.rounds, price.messages) == (1, n - 1)
    gather = links.price(inter, "all_gather", "ring", group, nbytes)
    assert gather.seconds == pytest.approx((n - 1) * (latency + nbytes / bandwidth), rel=1e-12)
    reduce = links.price(inter, "all_reduce", "ring", group, nbytes)
    assert reduce.seconds == pytest.approx(2 * (n - 1) * (latency + nbytes / n / bandwidth),
                                           rel=1e-12)
    assert (reduce.rounds, reduce.messages) == (2 * (n - 1), 2 * (n - 1))
    chain = links.price(inter, "chain", "one-shot", group, nbytes)
    assert chain.seconds == pytest.approx((n - 1) * (latency + nbytes / bandwidth), rel=1e-12)


def test_two_level_prices_sibling_then_ici():
    inter = links.interconnect("tpu7x")
    sib, ici, m = inter.sibling, inter.ici, 28672
    group = tuple(range(32))  # 16 chips of 2 cores
    reduce = links.price(inter, "all_reduce", "two-level", group, m)
    # siblings add their vectors, each core sends its half to 15 chips, siblings swap halves
    assert reduce.seconds == pytest.approx(sib.seconds(m) + ici.seconds(15 * m / 2)
                                           + sib.seconds(m / 2), rel=1e-12)
    gather = links.price(inter, "all_gather", "two-level", group, m)
    assert gather.seconds == pytest.approx(ici.seconds(15 * m) + sib.seconds(16 * m), rel=1e-12)
    # a ring is as slow as its slowest hop: ICI, though rank 0's own neighbour is its sibling
    ring = links.price(inter, "all_gather", "ring", group, m)
    assert ring.seconds == pytest.approx(31 * ici.seconds(m), rel=1e-12)


def test_the_sibling_link_goes_through_the_release_measurements():
    inter = links.interconnect("tpu7x")
    for nbytes, rate in links.SIBLING_MEASURED:
        assert nbytes / inter.sibling.seconds(nbytes) == pytest.approx(rate, rel=1e-9)
    assert 2.1 * US < inter.sibling_latency < 2.3 * US
    assert inter.ici_bandwidth == 45e9
    assert "ASSUMPTION" in inter.sources["ici_latency"]


@pytest.mark.parametrize("call, match", [
    (lambda: links.interconnect("v5e"), "chip='v5e' is invalid"),
    (lambda: links.interconnect("tpu7x", ici_speed=1), "override 'ici_speed' is invalid"),
    (lambda: links.interconnect("tpu7x", ici_bandwidth=0), "ici_bandwidth=0 is invalid"),
    (lambda: links.price(links.interconnect(), "broadcast", "ring", (0, 1), 8), "op='broadcast'"),
    (lambda: links.price(links.interconnect(), "all_gather", "tree", (0, 1), 8), "algorithm='tree'"),
    (lambda: links.price(links.interconnect(), "all_gather", "ring", (0, 0), 8), "group="),
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
    inter = _one_link(1 * US, 10e9, 1)
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


# ---- every rank's program ----------------------------------------------------------------------
def test_the_release_program_reads_the_layout_bytes_and_combines_188_times():
    cfg = get_config("kimi-k3")
    p = scale_out.predict(cfg, 32, layouts.RELEASE, 1)
    counted = layout_bytes.rank_bytes(layouts.layout(cfg, 32, layouts.RELEASE), 1)
    # 2 all-reduces per layer (93 layers), the embedding and the sampling merge
    assert p["collectives_per_rank"] == 2 * 93 + 2
    assert p["rank_bytes"] == counted.total
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


# ---- calibration and ours ----------------------------------------------------------------------
def _print_release(rows):
    print("release layout + schedule on 32 TPU7x cores, predicted vs published:")
    print("   B  published  predicted   miss   floor  peers  coll.  comp. bubble  unexplained")
    for r in rows:
        parts = " ".join(f"{r['parts_ms'][p]:6.2f}" for p in PARTS)
        print(f"  {r['batch']:2d}  {r['published_ms']:7.2f}    {r['predicted_ms']:7.2f}  "
              f"{r['miss']:+6.1%} {parts}  {r['unexplained_ms']:+6.2f}  {r.get('assumption', '')}")


@pytest.mark.slow
def test_calibration_table_against_the_published_steps():
    rows = calibration.release_table()
    _print_release(rows)
    assert [r["batch"] for r in rows] == [1, 2, 4, 8]
    first = rows[0]
    assert first["within"] and abs(first["miss"]) <= calibration.MISS_FRACTION  # B = 1: 4.0 ms
    for r in rows:
        # a miss over 20 % names the assumption that would have to change, and by how much
        assert r["within"] == ("assumption" not in r)
        if not r["within"]:
            assert r["assumption"].startswith("ici_bandwidth") and r["needed_ici_bandwidth"] > 45e9


def test_release_b1_is_within_20_percent_of_4_ms():
    (row,) = calibration.release_table(batches=(1,))
    _print_release([row])
    assert row["within"] and row["parts_ms"]["hbm_floor"] < row["predicted_ms"]


@pytest.mark.slow
def test_second_model_per_layer_and_fixed():
    out = calibration.second_model()
    print(json.dumps({k: v for k, v in out.items() if k != "source"}, indent=1))
    assert out["within"] == ("assumption" not in out)
    if not out["within"]:
        assert out["needed_latency_us"] > 2.2 and "latency per message" in out["assumption"]


def test_ours_beside_the_release_at_b1():
    (row,) = calibration.ours_table(batches=(1,))
    published_ms = 1e3 / row["published_tok_s"]
    built, summed = row["ours"], row["ours_release_schedule"]
    print(f"B=1: published {published_ms:.2f} ms; ours as built {built['step_ms']:.2f} ms "
          f"({built['collectives_per_rank']} collectives per rank, dominant "
          f"{built['dominant']}); our layout + the release's schedule {summed['step_ms']:.2f} ms")
    # Ours as built does not beat the release: reported as it is, with the term that dominates
    # (its bit-exact collectives: a gather around every split matrix, the expert chain).
    assert built["step_ms"] > published_ms and built["dominant"] == "collective_messages"
    # our layout under the release's schedule (partial sums) does: fewer bytes per rank
    assert summed["step_ms"] < published_ms
    rows = figure_rows([{"batch": 1, "predicted_ms": 3.7}], [row])
    assert len(rows) == 5 and {r["batch"] for r in rows} == {1}
    assert {r["part"] for r in parts_rows({"x": {"parts_s": built["parts_ms"]}})} == set(PARTS)


# ---- the command -------------------------------------------------------------------------------
def test_predict_command_json(capsys):
    assert cli.main(["predict", "kimi-k3-mini", "--ranks", "4", "--batch", "1,2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(p["layout"], p["batch"]) for p in out["predictions"]] == [
        ("ours", 1), ("ours", 2), ("release", 1), ("release", 2)]
    assert all(set(p["parts_s"]) == set(PARTS) for p in out["predictions"])


def test_predict_command_table(capsys):
    assert cli.main(["predict", "kimi-k3-mini", "--ranks", "2", "--batch", "1",
                     "--layout", "release", "--schedule", "ours", "--algorithm", "ring"]) == 0
    out = capsys.readouterr().out
    assert "kimi-k3-mini on 2 ranks of tpu7x (ring collectives)" in out
    assert "release  ours" in out


@pytest.mark.parametrize("argv, message", [
    (["predict", "deepseek-v3", "--ranks", "3"], "n_ranks=3 is invalid for deepseek-v3"),
    (["predict", "kimi-k3", "--ranks", "7"], "n_ranks=7 is invalid"),
    (["predict", "kimi-k3", "--chip", "v5e"], "--chip 'v5e' is invalid for predict"),
    (["predict", "kimi-k3", "--batch", "1,x"], "--batch '1,x' is invalid"),
    (["predict", "kimi-k3", "--batch", "0"], "--batch must be an int >= 1"),
    (["predict", "kimi-k3", "--layout", "mine"], "invalid choice"),
])
def test_predict_command_refuses_bad_input(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
