"""The schedule as data (`kernels/compose/schedule.py`) is the step the megakernel runs.

The schedule is the kernel run on shapes (`kernels/base/dry_run.py`), so these tests check that
dry run: a recorded DMA log equals the schedule event for event (kind, name, src, dst, bytes, slot and the
log's tags: layer, block, row, tile, item), for both MLA layouts, every expert format and B in
{1, 4} (every pair of the three), from a non-trivial state (random caches and states, rows at
positions on both sides of KV tile boundaries) with the routing of the reference step; the worst case the schedule assumes
without positions and routing is the cost estimate's, byte for byte, on every preset; the
prefetch checks read the schedule.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuts import first_layers
from mkresearch.kernels.base import dma, planned
from mkresearch.kernels.compose import megakernel as mk
from mkresearch.kernels.compose import schedule
from tiers import EXHAUSTIVE

from mkresearch.model import config, reference, weights
from mkresearch.model.config import EXPERT_FORMATS, MLA_CACHE_LAYOUTS

MINI = config.get_config("kimi-k3-mini")
# kv_tile 32: whole tiles; the last tile's 16-row groups (20, 31: one tile; 33, 47: two, the
# second read in one 16-row run); at kv_tile 64 runs of 2 and 1 groups (40, 47, 100), none (0)
POSITIONS = {1: (33,), 4: (20, 31, 33, 47)}
NOT_LATE = {"ffn": [], "next_layer": [], "experts": []}


@functools.cache
def mini_params(cfg):
    return weights.init_params(cfg, 0)


def random_state(cfg, batch, seed=0):
    """Every cache and state leaf drawn at random (scale 0.5) in its dtype: not a fresh state."""
    leaves, treedef = jax.tree.flatten(reference.init_state(cfg, batch))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([(0.5 * jax.random.normal(key, leaf.shape)).astype(leaf.dtype)
                              for key, leaf in zip(keys, leaves)])


def recorded_step(cfg, positions, options=mk.MegakernelOptions()):  # noqa: B008 - frozen
    """One recorded megakernel step from a random state -> (log, plan, the reference's routing)."""
    batch = len(positions)
    params, state = mini_params(cfg), random_state(cfg, batch)
    tokens = jax.random.randint(jax.random.key(1), (batch,), 0, cfg.vocab_size)
    positions = np.asarray(positions, np.int32)
    _, _, aux = reference.decode_step(params, state, tokens, positions, cfg)
    with dma.recording() as log:
        out, _, step = mk.decode_step(mk.prepare_weights(params, cfg),
                                      jax.tree.map(jnp.copy, state), tokens, positions, cfg,
                                      options=options)
        jax.block_until_ready(out)
    return log, step["plan"], np.asarray(aux["expert_ids"])


def assert_tags_agree(sched):
    """Where the kernel tags a DMA with its layer, the schedule's layer is that one; a stage
    kind's DMAs belong to a layer of that kind."""
    for dma_ in sched.events:
        tags = dict(dma_.indices)
        if "layer" in tags:
            assert tags["layer"] == dma_.layer, dma_
        if dma_.stage in sched.plan.cfg.kinds:
            assert dma_.stage in sched.plan.cfg.layers[dma_.layer], dma_


def check(cfg, positions, options=mk.MegakernelOptions()):  # noqa: B008 - frozen
    log, plan, expert_ids = recorded_step(cfg, positions, options)
    sched = schedule.schedule(plan, positions, expert_ids)
    assert sched.exact and sched.positions == tuple(positions)
    problem = sched.mismatch(log)
    assert problem is None, problem
    assert_tags_agree(sched)
    print(f"{cfg.mla_cache_layout}/{cfg.expert_format} B={len(positions)}: {len(sched.events)} "
          f"DMA events recorded == planned; {sched.experts_fetched()} experts per routed layer")
    return sched


# Every layout x format pair, and each of them beside both batch sizes (a pairwise covering of
# layout x format x B: every two-way combination runs, in 6 compiled steps rather than 12).
CASES = [(layout, fmt, (1, 4)[(i + j) % 2]) for i, layout in enumerate(MLA_CACHE_LAYOUTS)
         for j, fmt in enumerate(EXPERT_FORMATS)]
FAST_CASE = ("expanded", "mxfp4", 1)  # the preset's layout and format
OPPOSITE_CASE = ("latent", "bf16", 4)  # the other layout, batch size and an unquantised format
# make test runs those two; the other pairs of the covering are the exhaustive tier's.
CASE_MARKS = {FAST_CASE: pytest.mark.slow, OPPOSITE_CASE: pytest.mark.slow}


@pytest.mark.parametrize("layout, expert_format, batch", [
    pytest.param(*case, marks=CASE_MARKS.get(case, pytest.mark.exhaustive)) for case in CASES])
def test_recorded_log_is_the_schedule(race_checked, layout, expert_format, batch):
    cfg = MINI.replace(mla_cache_layout=layout, expert_format=expert_format)
    sched = check(cfg, POSITIONS[batch])
    assert sched.late_prefetches() == NOT_LATE


@pytest.mark.slow
@pytest.mark.parametrize("name", [  # these two stream every kind's matrices (GLM: GQA with its
    "deepseek-v3-mini", "glm-4.5-mini",  # biases, dense first layers); Qwen3 adds no DMA of its own
    pytest.param("qwen3-235b-a22b-mini", marks=pytest.mark.exhaustive)])
def test_recorded_log_is_the_schedule_of_other_families(race_checked, name):
    """GQA (bias, QK-norm, partial RoPE), MLA with the rope key, full-d MoE with group-limited or
    softmax routing, dense first layers, a pre-norm residual stream: each kind's schedule."""
    sched = check(config.get_config(name), POSITIONS[4])
    assert sched.late_prefetches()["experts"] == []


@pytest.mark.slow
def test_recorded_log_is_the_schedule_off_the_global_ring(race_checked):
    """Every matrix on its own two-slot ring, KV tiles of 64 (runs of 2 and 1 row groups), three
    expert slots fetching every (row, k) choice, a pre-norm residual stream (no final mix)."""
    cfg = MINI.replace(residual="prenorm", mla_cache_layout="latent", expert_format="fp8")
    options = mk.MegakernelOptions(global_stream=False, kv_tile=64, expert_slots=3,
                                   expert_plan="routed")
    sched = check(cfg, (0, 40, 47, 100), options)
    assert sched.experts_fetched() == {layer: 4 * cfg.top_k for layer in cfg.moe_layers}
    # no global ring: no stage's blocks fly before the previous stage has waited for its last one
    late = sched.late_prefetches()
    assert late["ffn"] == list(range(cfg.n_layers))
    assert late["next_layer"] == list(range(cfg.n_layers - 1)) and late["experts"] == []


@pytest.mark.slow
@pytest.mark.parametrize("name, batch", [  # the full-size families other than Kimi K3: exhaustive
    pytest.param(name, 1, marks=pytest.mark.exhaustive if name != "kimi-k3" and not name.endswith(
        ("-mini", "-rank")) else ()) for name in config.PRESETS]
                         + [("kimi-k3-mini", 4), ("kimi-k3-mini", mk.MAX_BATCH)])
def test_worst_case_is_the_cost_estimate(name, batch):
    """Without positions and routing the schedule takes the cost estimate's worst case (every
    row at the last position, min(E, B·k) distinct experts), and the kernel then moves exactly
    the bytes it declares to XLA; shapes only, so the full-size presets too (planned without
    the HBM and VMEM refusals)."""
    cfg = config.get_config(name)
    if name == "kimi-k3" and not EXHAUSTIVE:  # full-size shapes, every layer kind, two blocks
        cfg = first_layers(cfg, 13)  # (kimi-k3-rank's 93 layers run whole below)
    plan = mk.make_plan(cfg, batch, cfg.max_seq_len, check_fits=False)
    sched = schedule.schedule(plan)
    assert not sched.exact and len(sched.assumptions) == 2
    assert sched.positions == (cfg.max_seq_len - 1,) * batch
    assert set(sched.experts_fetched().values()) == {min(cfg.n_experts, batch * cfg.top_k)}
    estimate = mk.step_cost(plan, *mk.step_shapes(plan)).bytes_accessed
    assert sched.total.read + sched.total.written == estimate
    assert sched.late_prefetches() == NOT_LATE
    assert_tags_agree(sched)


def test_late_prefetches_read_the_schedule():
    """The checks read stages, layers and buffers, not DMA names: layer 0's first FFN block
    moved after its attention's last wait, layer 2's first expert DMA after the latent
    down-projection's wait, are found as late."""
    sched = schedule.schedule(mk.make_plan(MINI, 2, MINI.max_seq_len))
    events = list(sched.events)

    def index(predicate):
        return next(i for i, e in enumerate(events) if predicate(e))

    def delay(moved, anchor):  # the events moved(e) before the anchor's index: after it
        end = index(anchor)
        early = [e for e in events[:end] if moved(e)]
        kept = [e for e in events[:end + 1] if not moved(e)]
        events[:] = kept + early + events[end + 1:]

    attention, ffn = MINI.layers[0]
    delay(lambda e: e.kind == "dma_start" and e.stage == ffn and e.layer == 0,  # layer 0's FFN
          lambda e: e.kind == "dma_wait" and e.stage == attention and e.name == "kda.w_o")
    delay(lambda e: e.buffer == planned.EXPERT_SLOTS and e.layer == 2,  # layer 2's experts
          lambda e: e.kind == "dma_wait" and e.layer == 2 and e.name == "latent/w_ld")
    late = schedule.StepSchedule(sched.plan, tuple(events), sched.positions).late_prefetches()
    assert late == {"ffn": [0], "next_layer": [], "experts": [2]}


def test_a_log_that_differs_is_named():
    sched = schedule.schedule(mk.make_plan(MINI, 1, MINI.max_seq_len))
    recorded = [dma.Event(e.kind, e.name, e.src, e.dst, e.nbytes, e.slot, dict(e.indices))
                for e in sched.events]
    assert sched.mismatch(dma.DmaLog(recorded)) is None
    assert "planned 724 DMAs, recorded 723" in sched.mismatch(dma.DmaLog(recorded[:-1]))
    recorded[5] = dma.Event(**{**recorded[5].to_record(), "slot": 7})
    assert sched.mismatch(dma.DmaLog(recorded)).startswith(f"DMA 5 of {len(recorded)}: planned")


@pytest.mark.parametrize("kwargs, match", [
    ({"positions": [1, 2]}, r"positions has shape \(2,\) .*expected \[B=1\]"),
    ({"positions": [128]}, r"positions=\[128\] is invalid: each in \[0, 128\)"),
    ({"expert_ids": np.zeros((6, 1, 3), np.int32)}, r"expert_ids has shape \(6, 1, 3\)"),
    ({"expert_ids": np.full((6, 1, 4), 16)}, r"expert_ids is invalid: each in \[0, n_experts=16\)"),
])
def test_bad_input_names_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        schedule.schedule(mk.make_plan(MINI, 1, MINI.max_seq_len), **kwargs)
