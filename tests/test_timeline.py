"""The timeline model against hand calculations, the Pallas guide's closed forms and spec anchors.

Hand-calculation chip: 1 GB/s HBM (a 1000-byte block moves in 1 µs), DMA latency α = 1 µs, one
DMA engine, 1 TFLOP/s (3e6 FLOPs = 3 µs: compute-bound; 5e5 FLOPs = 0.5 µs: bandwidth-bound),
VMEM bandwidth so high that it never sets a phase's duration. Four blocks in every stream.
"""

import json
import random

import pytest

from mkresearch.prediction import timeline as tl

US = 1e-6
BLOCK = 1000  # bytes: 1 µs at 1 GB/s
COMPUTE_BOUND, BANDWIDTH_BOUND = 3e6, 5e5  # FLOPs per block: 3 µs, 0.5 µs


@pytest.fixture
def chip():
    return tl.timeline_chip("v5e", hbm_bandwidth=1e9, dma_latency=1 * US, n_dma_engines=1,
                            mxu_flops=1e12, vmem_bandwidth=1e18)


def flat(rows):
    """Rows of numbers as one flat list, for pytest.approx (which does not nest)."""
    return [x for row in rows for x in row]


def run(chip, n_buffers, flops, n_blocks=4):
    return tl.simulate(tl.stream_log(n_blocks, BLOCK, flops, n_buffers), chip)


# Hand calculations (α = 1, X/β = 1, times in µs; "c" compute, "d" DMA):
# 1 buffer:  every block is α + X/β + Y/F in series                -> 4 * (2 + Y/F)
# 2 buffers, Y/F = 3: d0 [1,2] d1 [2,3] c0 [2,5]; d2 issued at 5 -> [6,7], c1 [5,8];
#            d3 issued at 8 -> [9,10], c2 [8,11], c3 [11,14]        -> 14
# 2 buffers, Y/F = 0.5: d0 [1,2] d1 [2,3] c0 [2,2.5]; d2 issued 2.5 -> [3.5,4.5]; c1 [3,3.5];
#            d3 issued 3.5 -> [4.5,5.5]; c2 [4.5,5]; c3 [5.5,6]       -> 6 (α shows: the slot
#            frees only after the previous block's compute)
# 3 buffers, Y/F = 3: d0 [1,2] d1 [2,3] d2 [3,4]; c0 [2,5]; d3 -> [6,7]; c1..c3 back to back -> 14
# 3 buffers, Y/F = 0.5: d0..d2 [1,2] [2,3] [3,4]; d3 issued 2.5, queued -> [4,5]; c3 [5,5.5] -> 5.5
HAND = {
    (1, COMPUTE_BOUND): 20.0, (1, BANDWIDTH_BOUND): 10.0,
    (2, COMPUTE_BOUND): 14.0, (2, BANDWIDTH_BOUND): 6.0,
    (3, COMPUTE_BOUND): 14.0, (3, BANDWIDTH_BOUND): 5.5,
}


@pytest.mark.parametrize("n_buffers,flops", list(HAND))
def test_total_matches_hand_calculation(chip, n_buffers, flops):
    timeline = run(chip, n_buffers, flops)
    assert timeline.total_s == pytest.approx(HAND[n_buffers, flops] * US, rel=1e-9)
    assert timeline.dma_bytes == 4 * BLOCK
    assert timeline.peak_vmem_bytes == n_buffers * BLOCK  # the ring's slots, all in use
    assert timeline.hbm_floor_s == pytest.approx(4 * US)


def test_spans_of_the_two_buffer_bandwidth_bound_stream(chip):
    timeline = run(chip, 2, BANDWIDTH_BOUND)
    dma = [(s.start / US, s.end / US, s.issue / US, s.slot) for s in timeline.spans_on("DMA 0")]
    assert flat(dma) == pytest.approx(flat([(1, 2, 0, 0), (2, 3, 0, 1), (3.5, 4.5, 2.5, 0),
                                            (4.5, 5.5, 3.5, 1)]))
    compute = [(s.start / US, s.end / US) for s in timeline.spans_on(tl.COMPUTE_LANE)]
    assert flat(compute) == pytest.approx(flat([(2, 2.5), (3, 3.5), (4.5, 5), (5.5, 6)]))
    # compute idle: [0,1] nothing moves (α: a bubble); [1,2] [2.5,3] [3.5,4.5] [5,5.5] a DMA
    # moves bytes meanwhile (compute idle, HBM busy)
    assert timeline.idle_s("bubble") == pytest.approx(1 * US)
    assert timeline.idle_s("hbm_busy") == pytest.approx(3 * US)
    assert timeline.idle_s() + timeline.busy_s("compute") == pytest.approx(timeline.total_s)
    summary = timeline.summary()
    assert summary["bubble_fraction"] == pytest.approx(1 / 6)
    assert summary["idle_hbm_busy_fraction"] == pytest.approx(3 / 6)


def test_one_buffer_idle_is_latency_and_transfer(chip):
    timeline = run(chip, 1, COMPUTE_BOUND)
    assert timeline.idle_by_cause() == pytest.approx({"hbm_busy": 4 * US, "bubble": 4 * US})
    assert timeline.roofline_fraction == pytest.approx(4 / 20)


def test_a_bandwidth_bound_stream_at_the_roofline_is_hbm_busy_not_bubbles(chip):
    """Three buffers, little compute: the copies run back to back after the first α. The compute
    unit is idle most of the step, but HBM is busy all that time: only α is a bubble."""
    timeline = run(chip, 3, BANDWIDTH_BOUND, n_blocks=64)
    assert timeline.roofline_fraction > 0.95
    assert timeline.step_fraction(timeline.idle_s("hbm_busy")) > 0.45
    assert timeline.idle_s("bubble") == pytest.approx(1 * US)  # the first DMA's latency only
    with pytest.raises(ValueError, match="cause='dma_wait'"):
        timeline.idle_s("dma_wait")


def test_vmem_curve_holds_a_block_from_issue_to_the_end_of_its_phase(chip):
    timeline = run(chip, 1, COMPUTE_BOUND, n_blocks=2)
    assert flat((t / US, b) for t, b in timeline.vmem) == pytest.approx(
        flat([(0, BLOCK), (5, BLOCK), (10, 0)]))  # block 1 issued as block 0 is released
    assert tl.vmem_at(timeline, 7 * US) == BLOCK


def test_guide_formulas(chip):
    """The Pallas pipelining guide: compute-bound (α + X/β) + N·Y/F, bandwidth-bound α + N·X/β.

    The model equals the compute-bound form when Y/F >= α + X/β, and the bandwidth-bound form plus
    the last block's compute (the guide leaves out the tail) when the ring is deep enough to hide α.
    """
    alpha, beta, f = 1 * US, 1e9, 1e12
    compute = tl.guide_compute_bound_s(alpha, BLOCK, beta, 4, COMPUTE_BOUND, f)
    bandwidth = tl.guide_bandwidth_bound_s(alpha, BLOCK, beta, 4)
    assert compute == pytest.approx(14 * US) and bandwidth == pytest.approx(5 * US)
    assert run(chip, 2, COMPUTE_BOUND).total_s == pytest.approx(compute)
    assert run(chip, 3, BANDWIDTH_BOUND).total_s == pytest.approx(bandwidth + BANDWIDTH_BOUND / f)


@pytest.mark.parametrize("n_blocks", [16, 64])
def test_guide_formulas_hold_for_long_streams(chip, n_blocks):
    f = 1e12
    compute = tl.simulate(tl.stream_log(n_blocks, BLOCK, COMPUTE_BOUND, 2), chip).total_s
    assert compute == pytest.approx(tl.guide_compute_bound_s(US, BLOCK, 1e9, n_blocks,
                                                             COMPUTE_BOUND, f))
    bandwidth = tl.simulate(tl.stream_log(n_blocks, BLOCK, BANDWIDTH_BOUND, 3), chip).total_s
    assert bandwidth == pytest.approx(tl.guide_bandwidth_bound_s(US, BLOCK, 1e9, n_blocks)
                                      + BANDWIDTH_BOUND / f)


@pytest.mark.parametrize("n_buffers", [1, 2, 3])
@pytest.mark.parametrize("latency_us", [0.0, 0.5, 2.0, 3.3])
@pytest.mark.parametrize("compute_us", [0.05, 0.5, 0.9, 1.5])
def test_steady_state_period(chip, n_buffers, latency_us, compute_us):
    """Per block, a ring of n slots costs max(X/β, c, (X/β + c + α) / n): block k+n is issued
    when compute k ends, so n blocks share one transfer + compute + latency chain."""
    ring = tl.timeline_chip(chip, dma_latency=latency_us * US)
    timeline = tl.simulate(tl.stream_log(64, BLOCK, compute_us * 1e6, n_buffers), ring)
    ends = [s.end for s in timeline.spans_on(tl.COMPUTE_LANE)]
    period = (ends[54] - ends[30]) / 24  # 24 blocks: whole cycles of 1, 2 and 3
    expected = max(1.0, compute_us, (1.0 + compute_us + latency_us) / n_buffers) * US
    assert period == pytest.approx(expected, rel=1e-9)


def test_vmem_bandwidth_sets_the_duration_when_it_is_the_bottleneck(chip):
    slow_vmem = tl.timeline_chip(chip, vmem_bandwidth=1e9)  # reading a block takes 1 µs > 0.5
    events = tl.stream_log(1, BLOCK, BANDWIDTH_BOUND, 1)
    (span,) = tl.simulate(events, slow_vmem).spans_on(tl.COMPUTE_LANE)
    assert span.duration == pytest.approx(1 * US) and span.bound == "vmem"
    (span,) = tl.simulate(events, chip).spans_on(tl.COMPUTE_LANE)
    assert span.duration == pytest.approx(0.5 * US) and span.bound == "flops"


def test_vpu_phases_run_at_the_vpu_peak(chip):
    vpu = tl.timeline_chip(chip, vpu_flops=1e11)
    events = tl.stream_log(1, BLOCK, BANDWIDTH_BOUND, 1, name="norm")
    (span,) = tl.simulate(events, vpu, vpu_phases=("norm",)).spans_on(tl.COMPUTE_LANE)
    assert span.duration == pytest.approx(5 * US)


def test_engines_share_the_bandwidth(chip):
    two = tl.timeline_chip(chip, n_dma_engines=2)
    events = [tl.LogEvent("dma_start", "a", "hbm", "vmem", BLOCK, 0),
              tl.LogEvent("dma_start", "b", "hbm", "vmem", BLOCK, 1),
              tl.LogEvent("dma_wait", "a", "hbm", "vmem", BLOCK, 0),
              tl.LogEvent("dma_wait", "b", "hbm", "vmem", BLOCK, 1)]
    one_engine = [(s.start / US, s.end / US) for s in tl.simulate(events, chip).spans]
    two_engines = tl.simulate(events, two)
    assert flat(one_engine) == pytest.approx(flat([(1, 2), (2, 3)]))  # in issue order, full bandwidth each
    assert [(s.lane, s.start / US, s.end / US) for s in two_engines.spans] == [
        ("DMA 0", pytest.approx(1), pytest.approx(3)), ("DMA 1", pytest.approx(1), pytest.approx(3))]
    assert two_engines.total_s == pytest.approx(3 * US)  # same bytes per second in total


def test_odd_sizes_and_late_times_terminate():
    """Regression: a few bytes left after float rounding once made the DMA clock spin forever
    (found on the megakernel's log: 1178 events of odd sizes, two engines)."""
    rng = random.Random(0)
    events = []
    for i in range(300):
        nbytes = rng.randint(1, 5_000_000)
        events += [tl.LogEvent("dma_start", f"a{i}", "hbm", "vmem", nbytes, 0),
                   tl.LogEvent("dma_start", f"b{i}", "hbm", "vmem", rng.randint(1, 3000), 1),
                   tl.LogEvent("dma_wait", f"a{i}", "hbm", "vmem", nbytes, 0),
                   tl.LogEvent("phase_start", "p", flops=rng.randint(0, 10**9)),
                   tl.LogEvent("phase_end", "p")]
    timeline = tl.simulate(events, tl.timeline_chip("tpu7x", n_dma_engines=2))
    assert timeline.total_s > 0 and len(timeline.spans_on("DMA 0")) + len(
        timeline.spans_on("DMA 1")) == 600


def test_json_records_give_the_same_timeline(chip):
    events = tl.stream_log(4, BLOCK, COMPUTE_BOUND, 2)
    records = json.dumps(tl.to_records(events))
    assert tl.simulate(records, chip) == tl.simulate(events, chip)
    assert tl.simulate(json.loads(records), chip) == tl.simulate(events, chip)


@pytest.mark.parametrize("n_buffers", [1, 2, 3])
def test_rebuffer_replays_a_stream_with_another_ring(chip, n_buffers):
    recorded = tl.stream_log(6, BLOCK, BANDWIDTH_BOUND, 2)
    replayed = tl.rebuffer(recorded, n_buffers)
    assert replayed == tl.stream_log(6, BLOCK, BANDWIDTH_BOUND, n_buffers)


def test_blockspec_log_is_the_double_buffered_stream(chip):
    """Pallas's BlockSpec pipeline, put around the phases, is the two-slot ring."""
    stream = tl.stream_log(5, BLOCK, BANDWIDTH_BOUND, 2)
    phases = [e for e in stream if e.kind.startswith("phase")]
    assert tl.blockspec_log(phases, {"w": BLOCK}) == stream
    with_out = tl.simulate(tl.blockspec_log(phases, {"w": BLOCK}, out_bytes=BLOCK), chip)
    alone = tl.simulate(stream, chip)
    # the output writeback is one more DMA after the last phase: α + X/β more, not in VMEM
    assert with_out.total_s == pytest.approx(alone.total_s + 2 * US)
    assert with_out.peak_vmem_bytes == alone.peak_vmem_bytes
    with pytest.raises(ValueError, match="only phases"):
        tl.blockspec_log(stream, {"w": BLOCK})


def test_scale_batch_scales_flops_only(chip):
    events = tl.scale_batch(tl.stream_log(4, BLOCK, BANDWIDTH_BOUND, 2), 6)
    timeline = tl.simulate(events, chip)
    assert timeline.flops == pytest.approx(4 * 6 * BANDWIDTH_BOUND)
    assert timeline.total_s == pytest.approx(HAND[2, COMPUTE_BOUND] * US)  # 3 µs per block now


def test_hbm_floor_of_one_kimi_k3_rank():
    """docs/tpu.md: ≈6.97 GB per rank per step at ≈3.69 TB/s per TensorCore -> ≈1.9 ms, against
    4.0 ms measured (249 tok/s at B=1): the release runs at about half the roofline."""
    floor = tl.hbm_floor_s(6.97e9, "tpu7x")
    assert floor == pytest.approx(1.9e-3, rel=0.02)
    assert floor / (1 / 249) == pytest.approx(0.47, abs=0.02)


def test_chip_fields_have_sources():
    for name in ("v5e", "v6e", "v5p", "tpu7x"):
        chip = tl.timeline_chip(name)
        for field in ("hbm_bandwidth", "mxu_flops", "vpu_flops", "vmem_bandwidth", "dma_latency",
                      "n_dma_engines", "vmem_capacity"):
            assert chip.sources[field], field
        assert "ASSUMPTION" in chip.sources["dma_latency"]
        assert "chips" in chip.sources["hbm_bandwidth"]


@pytest.mark.parametrize("call,match", [
    (lambda: tl.timeline_chip("v4"), "chip='v4'"),
    (lambda: tl.timeline_chip("v5e", bandwidth=1.0), "override 'bandwidth'"),
    (lambda: tl.timeline_chip("v5e", n_dma_engines=0), "n_dma_engines"),
    (lambda: tl.stream_log(0, BLOCK, 1.0, 2), "n_blocks"),
    (lambda: tl.rebuffer([], 0), "n_buffers"),
    (lambda: tl.scale_batch([], 0), "factor"),
    (lambda: tl.simulate([{"kind": "dma_go", "name": "w"}], "v5e"), "kind='dma_go'"),
    (lambda: tl.simulate([tl.LogEvent("dma_wait", "w")], "v5e"), "no matching dma_start"),
    (lambda: tl.simulate([tl.LogEvent("phase_end", "p")], "v5e"), "without a phase_start"),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
