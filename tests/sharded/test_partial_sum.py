"""The partial-sum sharded megakernel (`layout.layout(..., collectives="partial-sum")`,
`kernels/sharded/collective_ops.py`) on 8 simulated devices, in TPU interpret mode with the race
detector on, against the sharded reference (`mkresearch.sharding.reference_sharded`: the same partial
sums added in the same order, plain JAX) and the single-device reference.

Each case checks: every rank chose the same tokens and holds the same logits; the logits, tokens
and every rank's state slice EQUAL the sharded reference's to the bit; against the single-device
reference, the partial-sum claim (`reference_sharded.within_claim`: within SAME_ROUTING_BOUND
[wire] where the row's routing is the single device's; over many seeds: tests/
test_partial_sum_claim.py). The fast set runs Kimi K3's mini (its first 4 layers:
test_sharded_decode.FIRST_4_LAYERS, every kind of layer and of sublayer boundary)
at B = 3 with greedy and sampled rows; the exhaustive tier adds a row alone (its logits equal to the same
row in the batch), a second run (the same bits), the other family (DeepSeek-V3's mini) and the
bf16 wire (each another interpret-mode step of ~0.5-2 min here).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import schedule_check
import test_faults
import test_sharded_decode
from mkresearch.kernels.base import dma, registry
from mkresearch.kernels.compose import megakernel_sharded as ms
from mkresearch.kernels.compose.megakernel_plan import MegakernelOptions
from mkresearch.kernels.sharded import plan as sharding
from mkresearch.kernels.sharded.levels import LEVEL_PHASES, LevelReductions
from mkresearch.kernels.stages import gate_up

from mkresearch.measurement import collective_overlap
from mkresearch.model import config, reference, weights
from mkresearch.sharding import (
    layout,
    layout_bytes,
    layout_split,
    reference_mesh,
    reference_sharded,
)

# the fast cases' model: kimi-k3-mini's first 4 layers (test_sharded_decode.FIRST_4_LAYERS)
KIMI_4L = test_sharded_decode.FIRST_4_LAYERS

N_RANKS = 8
PROMPT_LEN = 20
SEED = 7
# every algorithm a reduction can be sent by, on two simulated hosts of 4 ranks (each reduction
# adds a host's partials first, then the hosts' sums): the shared experts' sum, which W_lu's
# column chunks ride in, and the MLA output's as rs-ag (three levels), the routed experts' and
# KDA's as two-level, the rest one-shot
LEVELS = {"shared/w_down/sum": "rs-ag", "mla.w_o/sum": "rs-ag", "expert/sum": "two-level",
          "kda.w_o/sum": "two-level"}
RANKS_PER_HOST = 4
RESTRUCTURED_MODE = layout.RESTRUCTURED
_cache: dict = {}


def options_for(lay, levels):
    """The kernel's options: one-shot reductions on one host, or LEVELS on hosts of `levels`
    ranks (True: RANKS_PER_HOST)."""
    if not levels:
        return MegakernelOptions()
    names = {r.name for r in sharding.reductions(lay) if not r.scatter}
    return MegakernelOptions(reductions=tuple((n, a) for n, a in LEVELS.items() if n in names),
                             ranks_per_host=RANKS_PER_HOST if levels is True else levels)


def setup(model, batch, wire="f32", levels=False, mode=layout.PARTIAL_SUM, etp=None):
    """(params, layout, plan, mesh, prepared weights, prefilled state, tokens, positions);
    model: a preset's name or a ModelConfig; mode: a partial-sum mode
    (`layout.PARTIAL_SUM_MODES`); etp: the experts' expert-tensor ways (None: the layout's)."""
    cfg = config.get_config(model) if isinstance(model, str) else model
    key = (model, batch, wire, levels, mode, etp)
    if key not in _cache:
        params = _cache.setdefault(model, weights.init_params(cfg, 0))
        lay = layout.layout(cfg, N_RANKS, collectives=mode, etp=etp)
        plan = ms.make_sharded_plan(lay, batch, cfg.max_seq_len, wire=wire,
                                    options=options_for(lay, levels))
        mesh = ms.make_mesh(N_RANKS)
        prepared = _cache.setdefault((model, "prepared", mode, etp),
                                     ms.prepare_weights(params, lay, mesh))
        prompt = jax.random.randint(jax.random.key(0), (batch, PROMPT_LEN), 0, cfg.vocab_size)
        state = reference.init_state(cfg, batch)
        _, state = reference.prefill(params, state, prompt[:, :-1], cfg)
        _cache[key] = (params, lay, plan, mesh, prepared, state,
                       np.asarray(prompt[:, -1], np.int32), np.full(batch, PROMPT_LEN - 1, np.int32))
    return _cache[key]


def step(model, batch, wire="f32", temperature=None, rows=None, record=False, levels=False,
         mode=layout.PARTIAL_SUM, etp=None, mesh_reference=False):
    """One step of a partial-sum mode, checked against the sharded reference -> (tokens,
    logits, DMA log or None). rows: run only these rows of the batch's inputs (a row alone);
    levels: the reductions sent as LEVELS says, on hosts of RANKS_PER_HOST ranks;
    mesh_reference: `decode --backend reference`'s step of the same mode too (`reference_mesh`),
    its logits equal to the kernel's and its state to the sharded reference's, to the bit."""
    params, lay, plan, mesh, prepared, state, tokens, positions = setup(model, batch, wire,
                                                                        levels, mode, etp)
    if rows is not None:
        state = jax.tree.map(lambda leaf: leaf[:, rows], state)
        tokens, positions = tokens[rows], positions[rows]
        plan = ms.make_sharded_plan(lay, len(rows), lay.cfg.max_seq_len, wire=wire,
                                    options=plan.mega.options)
        temperature = None if temperature is None else [temperature[r] for r in rows]
    kw = {"seed": SEED, "temperature": temperature}
    with dma.recording() if record else contextlib.nullcontext() as log:
        got, got_state, aux = ms.decode_step(prepared, ms.shard_state(state, lay, mesh), tokens,
                                             positions, plan, mesh=mesh, return_logits=True, **kw)
        jax.block_until_ready(got)
    per_rank = np.asarray(aux["tokens_per_rank"])
    assert (per_rank == per_rank[:1]).all(), f"the ranks disagree: {per_rank}"
    logits = np.asarray(aux["logits"])
    want, want_state, want_aux = reference_sharded.decode_step(
        params, state, jnp.asarray(tokens), jnp.asarray(positions), lay, wire,
        plan.mega.options.ranks_per_host)
    np.testing.assert_array_equal(logits.view(np.uint32), np.asarray(want).view(np.uint32),
                                  err_msg="logits != the sharded reference's")
    for got_leaf, want_leaf in zip(jax.tree.leaves(got_state),
                                   jax.tree.leaves(layout.shard_state(want_state, lay)), strict=True):
        np.testing.assert_array_equal(np.asarray(got_leaf).view(np.uint8),
                                      np.asarray(want_leaf).view(np.uint8),
                                      err_msg="a rank's state slice != the sharded reference's")
    if mesh_reference:
        mesh_logits, mesh_state = mesh_reference_step(params, lay, state, tokens, positions, wire,
                                                      plan.mega.options.ranks_per_host)
        np.testing.assert_array_equal(mesh_logits.view(np.uint32), logits.view(np.uint32),
                                      err_msg=f"the mesh reference's {mode} logits != the kernel's")
        assert_states_equal(mesh_state, want_state)
    single, _, single_aux = reference.decode_step(params, state, jnp.asarray(tokens),
                                                  jnp.asarray(positions), lay.cfg)
    diff = float(np.abs(logits - np.asarray(single)).max())
    routing = reference_sharded.routing_differs(want_aux["expert_ids"], single_aux["expert_ids"])
    how = (f", reductions {dict(plan.mega.options.reductions)} on hosts of "
           f"{plan.mega.options.ranks_per_host} ranks" if levels else "")
    how += f", experts in {lay.ep} groups x ETP {lay.etp}" if lay.etp > 1 else ""
    print(f"{lay.cfg.name} {mode} on {N_RANKS} ranks{how}, B={len(tokens)}, wire {wire}: logits and "
          f"states equal to the sharded reference's to the bit, identical on every rank; max "
          f"|logit diff| vs the single-device reference {diff:.3g} (rows whose routing differs: "
          f"{int(routing.sum())}; bound where it does not "
          f"{reference_sharded.SAME_ROUTING_BOUND[wire]})")
    assert reference_sharded.within_claim(logits, single, routing, wire).all()
    return np.asarray(got), logits, log


def mesh_reference_step(params, lay, state, tokens, positions, wire="f32", ranks_per_host=0):
    """`decode --ranks N --backend reference`'s step (`reference_mesh`: plain JAX on the mesh,
    each rank holding its slices of lay's collectives mode) -> (logits [B, V], state), numpy."""
    mesh = reference_mesh.make_mesh(lay.n_ranks)
    plan = reference_mesh.MeshReference(lay, wire, ranks_per_host)
    placed = reference_mesh.place_params(layout.shard_params(params, lay), mesh)
    logits, new_state, _ = reference_mesh.decode_step(
        placed, reference_mesh.place_state(jax.tree.map(np.asarray, state), mesh), tokens,
        positions, plan, mesh)
    return np.asarray(logits), jax.tree.map(np.asarray, new_state)


def assert_states_equal(got, want):
    for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got_leaf).view(np.uint8),
                                      np.asarray(want_leaf).view(np.uint8))


def test_mesh_reference_exact_is_the_reference():
    """`decode --backend reference --collectives exact`'s step (every split weight gathered
    whole) is the single-device reference's, logits and state to the bit; the partial-sum and
    restructured modes' steps equal their kernels' (`step(mesh_reference=True)`: the fast
    cases)."""
    params, _, _, _, _, state, tokens, positions = setup(KIMI_4L, 3)
    lay = layout.layout(KIMI_4L, N_RANKS, collectives=layout.EXACT)
    logits, mesh_state = mesh_reference_step(params, lay, state, tokens, positions)
    want, want_state, _ = reference.decode_step(params, state, jnp.asarray(tokens),
                                                jnp.asarray(positions), KIMI_4L)
    np.testing.assert_array_equal(logits.view(np.uint32), np.asarray(want).view(np.uint32))
    assert_states_equal(mesh_state, want_state)


MIXED = [None, 0.8, None]  # greedy, sampled, greedy rows


def test_kimi_b3_greedy_and_sampled_rows(race_checked):
    """The fast case, recorded, with every reduction algorithm on two simulated hosts (LEVELS):
    every rank's remote copies are the step's collectives (`collective_ops`, which the
    prediction reads), collective by collective and level by level."""
    _, _, log = step(KIMI_4L, 3, temperature=MIXED, record=True, levels=True)
    _, lay, plan = setup(KIMI_4L, 3, levels=True)[:3]
    options = plan.mega.options
    expert_ids = routed_expert_ids(KIMI_4L, 3)
    count = schedule_check.check(log, lay, 3, expert_ids, options)
    moved = schedule_check.check_reduction_bytes(log, lay, 3, "f32", options.reductions)
    print(f"f32 wire: the one-shot reductions' bytes per remote copy {moved} (priced)")
    ops = schedule_check.ops_of(lay, 3, options.reductions, 0,
                                schedule_check.expert_counts(lay, expert_ids, 0))
    runs = schedule_check.expected_collectives(ops, 0, options.ranks_per_host)
    print(f"the recorded remote copies of all {N_RANKS} ranks are the schedule's collectives "
          f"({count} on rank 0, {len(runs)} runs of copies: a reduction in levels one per "
          "level), in order")
    # overlap: when a rank first waits for a collective, weight DMAs are in flight (the global
    # ring's next blocks, the first experts' slots), but for the last ones of the step: the
    # last layer's last reduction (each of its levels) and the sampling merge (nothing left to
    # stream). Held on the ranks reading the most bytes (the step is priced at the busiest
    # rank, `layout_bytes.rank_bytes`); a rank that skips more slices of padding only
    # (check_zero_only_slices) may have nothing left to fetch
    most = layout_bytes.rank_bytes(lay, 3).total
    busiest = [rank for rank in range(N_RANKS)
               if layout_bytes.rank_bytes(lay, 3, rank=rank).total == most]
    assert busiest
    last = [f"shared/w_down/sum/{level}" for level in LEVEL_PHASES]
    for rank in range(N_RANKS):
        seen = collective_overlap.collective_overlap(log, rank)
        assert len(seen) == len(runs)  # the embedding's all-reduce: two phases
        idle = [c["name"] for c in seen if not c["hbm_in_flight"]]
        if rank in busiest:
            assert idle[-1] == "sampling_state/all_gather" and set(idle[:-1]) <= set(last) \
                and idle[:-1], (rank, idle)
        print(f"rank {rank}: HBM busy (weight DMAs in flight) at {len(seen) - len(idle)} of the "
              f"{len(seen)} collective waits")
    # one answer for the bytes: each rank's DMA'd HBM bytes per component are layout_bytes'
    test_sharded_decode.check_bytes(lay, 3, log, expert_ids)
    check_zero_only_slices(log, lay)


def check_zero_only_slices(log, lay):
    """No rank streams a slice that is only padding (`layout_split.streamed_zeros`, recorded):
    each such rank issues no DMA of that matrix (and its ring blocks of real slices are the
    layout's bytes, `check_bytes`)."""
    names = {}  # parameter path -> the DMA-log name of what a rank streams of it
    for kind in lay.cfg.kinds:
        streamed = registry.kernel_stage(kind).streamed(lay.cfg)
        for m in ms._local_streamed(lay)(kind, streamed):  # gate + up fused
            for key in gate_up.FUSED_FROM.get(m.key, (m.key,)):
                names[f"['{kind}']['{key}']"] = m.name
    checked = 0
    for z in layout_split.streamed_zeros(lay):
        for rank in z.zero_only:
            moved = sum(e.nbytes for e in log.of_rank(rank).events
                        if e.kind == "dma_start" and not e.remote and e.name == names[z.path])
            assert moved == 0, (z.path, rank, moved)
            checked += 1
    print(f"slices of padding only: {checked} (matrix, rank) pairs, none streamed (recorded)")
    assert checked > 0


def routed_expert_ids(model, batch):
    """[n_moe, B, k]: the step's routing (the reference's), which the exact mode's per-expert
    gathers depend on."""
    params, lay, _, _, _, state, tokens, positions = setup(model, batch)
    _, _, aux = reference.decode_step(params, state, jnp.asarray(tokens), jnp.asarray(positions),
                                      lay.cfg)
    return np.asarray(aux["expert_ids"])


@pytest.mark.exhaustive  # two more steps (B = 1 traced anew, B = 3 again): ~2 min here
def test_kimi_row_alone_and_second_run(race_checked):
    tokens, logits, _ = step("kimi-k3-mini", 3, temperature=MIXED)
    again, logits_again, _ = step("kimi-k3-mini", 3, temperature=MIXED)
    np.testing.assert_array_equal(logits_again.view(np.uint32), logits.view(np.uint32))
    np.testing.assert_array_equal(again, tokens)
    # the sampled row alone: its logits are the batch's (its sample is not: the sampler's
    # uniforms are keyed by the row's index in the batch, `sampling.counter_uniform`)
    _, logits_alone, _ = step("kimi-k3-mini", 3, temperature=MIXED, rows=[1])
    np.testing.assert_array_equal(logits_alone.view(np.uint32), logits[1:2].view(np.uint32))


@pytest.mark.exhaustive  # the other family and B = 1: two more traced steps (~3 min here)
@pytest.mark.parametrize("model, batch", [("deepseek-v3-mini", 3), ("deepseek-v3-mini", 1),
                                          ("kimi-k3-mini", 1)])
def test_other_family_and_b1(race_checked, model, batch):
    step(model, batch, temperature=MIXED[:batch])


@pytest.mark.exhaustive  # reductions in levels on 4 hosts of 2 ranks: two more steps (~2 min)
@pytest.mark.parametrize("model, batch", [("deepseek-v3-mini", 3), ("kimi-k3-mini", 1)])
def test_levels_on_hosts_of_2(race_checked, model, batch):
    step(model, batch, temperature=MIXED[:batch], levels=2)


@pytest.mark.exhaustive  # the bf16 wire: two more traced steps (~1 min each here)
@pytest.mark.parametrize("batch", [1, 3])
def test_bf16_wire(race_checked, batch):
    """The bf16 wire's remote copies move 2 bytes a partial sum (`levels.pack_bf16`), the
    bytes the step's collectives price; the f32 wire's, 4 (the fast case's, recorded)."""
    _, _, log = step("kimi-k3-mini", batch, wire="bf16", record=True)
    lay = setup("kimi-k3-mini", batch, "bf16")[1]
    moved = schedule_check.check_reduction_bytes(log, lay, batch, "bf16")
    print(f"kimi-k3-mini B={batch}, bf16 wire: bytes per remote copy {moved} (priced)")


@pytest.mark.exhaustive  # the bf16 wire in levels: one more traced step (~1 min here)
def test_bf16_wire_in_levels(race_checked):
    """The bf16 wire with every algorithm on two simulated hosts (LEVELS): each level's remote
    copies move the partial sums, a host's sums and rs-ag's summed chunks 2 bytes a value
    (`levels.pack_bf16`; riders f32), and the step equals the sharded reference, whose hosts'
    sums and totals are rounded as the wire carries them (`numerics.host_ordered_sum`)."""
    _, _, log = step("kimi-k3-mini", 3, wire="bf16", temperature=MIXED, record=True, levels=True)
    lay, plan = setup("kimi-k3-mini", 3, "bf16", True)[1:3]
    moved = schedule_check.check_level_bytes(log, lay, 3, "bf16", plan.mega.options)
    print(f"kimi-k3-mini B=3, bf16 wire in levels: bytes per remote copy {moved}")


# the mini with a latent of 384: ETP 2 splits the hidden (256) in lane tiles but not W2's
# columns (192 each), which only the exact mode needs (`partition._expert_ways`)
WIDE_LATENT = config.get_config("kimi-k3-mini", moe_latent=384)


@pytest.mark.exhaustive  # three more traced steps (~1 min each here)
@pytest.mark.parametrize("model, mode", [("kimi-k3-mini", layout.PARTIAL_SUM),
                                         ("kimi-k3-mini", RESTRUCTURED_MODE),
                                         (WIDE_LATENT, RESTRUCTURED_MODE)])
def test_expert_tensor_parallel(race_checked, model, mode):
    """Each expert's hidden split over 2 ranks (ETP 2, 4 expert groups; the full presets on 32
    ranks split it 4 ways as built): every rank's partial output over its hidden slice, rounded
    to bf16, added in rank order, equals the sharded reference's (`numerics.ExpertGroups.ranks`)
    to the bit; every rank's remote copies are the step's collectives. With a latent ETP does
    not split in lane tiles, the partial-sum modes run (W2 split by its rows), the exact mode's
    layout is refused naming etp."""
    _, _, log = step(model, 3, temperature=MIXED, record=True, mode=mode, etp=2)
    lay, plan = setup(model, 3, mode=mode, etp=2)[1:3]
    assert (lay.ep, lay.etp) == (4, 2)
    schedule_check.check(log, lay, 3, routed_expert_ids(model, 3), plan.mega.options)
    if model is WIDE_LATENT:
        with pytest.raises(ValueError, match=r"etp=2 is invalid for kimi-k3-mini on 8 ranks"):
            layout.layout(model, N_RANKS, etp=2, collectives=layout.EXACT)


@pytest.mark.exhaustive  # experts to the MXU as fp8: one more traced step (~1 min here)
@pytest.mark.parametrize("model, batch", [("kimi-k3-mini", 3), ("deepseek-v3-mini", 1)])
def test_fp8_mxu(race_checked, model, batch):
    """ModelConfig.expert_mxu = "fp8" on 8 ranks (MXFP4 experts for Kimi K3's mini, FP8 for
    DeepSeek-V3's): each rank's block-scaled products and the sharded reference's
    (`formats.mxu_matmul` per expert group) give the same bits."""
    step(config.get_config(model, expert_mxu="fp8"), batch, temperature=MIXED[:batch])


def test_skipped_wait_in_a_reduction_is_a_race():
    """A partial-sum reduction that reads its receive slots without waiting for them (the last
    shared-expert sum's, at trace time every MoE layer's) is flagged by the race detector."""
    calls, raced, _ = test_faults.skipped_wait_races("shared/w_down/sum",
                                                     lambda: step_raw(CUT_2_LAYERS))
    assert calls, "the reduction's wait was not reached"
    assert raced, "the race detector did not see the read before the partial sums landed"


def test_skipped_wait_in_a_level_is_a_race():
    """A reduction sent in levels (rs-ag, 2 ranks on 2 hosts) whose last level reads its receive
    slots without waiting for them is flagged by the race detector."""
    options = MegakernelOptions(reductions=(("shared/w_down/sum", "rs-ag"),), ranks_per_host=1)
    calls, raced, _ = test_faults.skipped_wait_races(
        "shared/w_down/sum/across", lambda: step_raw(CUT_2_LAYERS, options=options),
        method="wait", owner=LevelReductions)
    assert calls, "the level's wait was not reached"
    assert raced, "the race detector did not see the read before the host sums landed"


# A broken kernel's step runs on kimi-k3-mini's 2-layer cut (KDA + dense, MLA + MoE): one MoE
# layer has every reduction a skipped wait is tried in, at 2/7 of the whole mini's trace.
CUT_2_LAYERS = test_faults.CUT_2_LAYERS


def step_raw(cfg, n_ranks=2, batch=1, options=None, mode=layout.PARTIAL_SUM):
    """One step of a partial-sum mode on n_ranks, unchecked (for a broken kernel)."""
    lay = layout.layout(cfg, n_ranks, collectives=mode)
    plan = ms.make_sharded_plan(lay, batch, cfg.max_seq_len, options=options or MegakernelOptions())
    mesh = ms.make_mesh(n_ranks)
    state = ms.shard_state(reference.init_state(cfg, batch), lay, mesh)
    params = weights.init_params(cfg, 0)
    out, _, _ = ms.decode_step(ms.prepare_weights(params, lay, mesh), state,
                               np.arange(batch, dtype=np.int32) + 5, np.full(batch, 3, np.int32),
                               plan, mesh=mesh)
    return np.asarray(jax.block_until_ready(out))


# ---- the restructured MoE reductions (`layout.RESTRUCTURED`, `kernels/sharded/plan.py`) ------
RESTRUCTURED = RESTRUCTURED_MODE


def test_restructured_kimi_b3_greedy_and_sampled_rows(race_checked):
    """The restructured mode (ρ reduce-scattered, W_lu by its latent rows beside the shared
    experts' sum, the norm's scale after it) equals its sharded reference to the bit, on every
    rank, and so does `decode --backend reference --collectives restructured`'s step (the
    kernel's logits: issue 79 found it running the exact mode); recorded: ρ's only remote copies are its reduce-scatter's, one message per peer, and
    W_lu has no collective of its own (its partial sums ride in the shared experts' messages);
    the reduce-scatter is in flight while the shared experts run: in each MoE layer, blocks of
    theirs are waited for after its last copy starts and before it is waited for."""
    _, _, log = step(KIMI_4L, 3, temperature=MIXED, record=True, mode=RESTRUCTURED,
                     mesh_reference=True)  # decode --backend reference's restructured step too
    cfg, scatter = KIMI_4L, "expert/sum/reduce_scatter"
    for rank in range(N_RANKS):
        events = log.of_rank(rank).events
        names = [e.name for e in events if e.kind == "dma_start" and e.remote]
        rho = [n for n in names if n.startswith("expert/sum")]
        assert set(rho) == {scatter}, set(rho)
        assert len(rho) == len(cfg.moe_layers) * (N_RANKS - 1)
        assert not [n for n in names if n.startswith("latent/w_lu")]
        started = [i for i, e in enumerate(events) if e.kind == "dma_start" and e.name == scatter]
        waited = [i for i, e in enumerate(events) if e.kind == "dma_wait" and e.name == scatter]
        shared = [i for i, e in enumerate(events)
                  if e.kind == "dma_wait" and e.name.startswith("shared/")]
        waits_per_layer = len(waited) // len(cfg.moe_layers)
        for k in range(len(cfg.moe_layers)):
            issued = started[(k + 1) * (N_RANKS - 1) - 1]
            awaited = waited[k * waits_per_layer]
            assert any(issued < i < awaited for i in shared), (rank, k)


@pytest.mark.exhaustive  # two more steps (B = 1 traced anew, B = 3 again): ~2 min here
def test_restructured_row_alone_and_second_run(race_checked):
    tokens, logits, _ = step("kimi-k3-mini", 3, temperature=MIXED, mode=RESTRUCTURED)
    again, logits_again, _ = step("kimi-k3-mini", 3, temperature=MIXED, mode=RESTRUCTURED)
    np.testing.assert_array_equal(logits_again.view(np.uint32), logits.view(np.uint32))
    np.testing.assert_array_equal(again, tokens)
    _, logits_alone, _ = step("kimi-k3-mini", 3, temperature=MIXED, rows=[1], mode=RESTRUCTURED)
    np.testing.assert_array_equal(logits_alone.view(np.uint32), logits[1:2].view(np.uint32))


@pytest.mark.exhaustive  # the bf16 wire: one more traced step (~1 min here)
def test_restructured_bf16_wire(race_checked):
    """The restructured mode with a bf16 wire: ρ's reduce-scatter sends each peer its chunk as
    bf16 (2 bytes a value, `ShardPlan.packs_scatter`), the shared experts' widened sum packed
    in pairs; the bytes its collectives price, and the sharded reference's bits."""
    _, _, log = step("kimi-k3-mini", 3, wire="bf16", temperature=MIXED, record=True,
                     mode=RESTRUCTURED)
    lay = setup("kimi-k3-mini", 3, "bf16", mode=RESTRUCTURED)[1]
    moved = schedule_check.check_reduction_bytes(log, lay, 3, "bf16")
    assert moved["expert/sum/reduce_scatter"] == 3 * 128 * 2, moved
    print(f"kimi-k3-mini restructured B=3, bf16 wire: bytes per remote copy {moved} (priced)")


@pytest.mark.exhaustive  # the other family (nothing to restructure: its experts work on the full
# d, their partial sums already in the shared experts'), B = 1, levels, the bf16 wire
@pytest.mark.parametrize("model, batch, levels, wire", [
    ("deepseek-v3-mini", 3, False, "f32"), ("deepseek-v3-mini", 1, False, "f32"),
    ("kimi-k3-mini", 1, False, "f32"), ("kimi-k3-mini", 1, True, "f32"),
    ("kimi-k3-mini", 1, True, "bf16")])
def test_restructured_other_cases(race_checked, model, batch, levels, wire):
    step(model, batch, wire=wire, temperature=MIXED[:batch], levels=levels, mode=RESTRUCTURED)


def test_skipped_wait_in_the_reduce_scatter_is_a_race():
    """ρ's reduce-scatter reading its receive slots without waiting for them is flagged by the
    race detector."""
    calls, raced, _ = test_faults.skipped_wait_races(
        "expert/sum", lambda: step_raw(CUT_2_LAYERS, mode=RESTRUCTURED))
    assert calls, "the reduce-scatter's wait was not reached"
    assert raced, "the race detector did not see the read before the partial sums landed"
