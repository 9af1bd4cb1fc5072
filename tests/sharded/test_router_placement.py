"""The router's placements in the sharded megakernel (`MegakernelOptions.router_placement`,
`layout.place_router`) on 8 simulated devices, in TPU interpret mode with the race detector on,
against the sharded reference (`mkresearch.sharding.reference_sharded`, no numerics of its own
for the router: each column's score is one whole dot of the same x wherever the column lives).

kimi-k3-mini's 16 experts fit one lane tile, so its router is whole on every rank in any layout:
the cases run its first 4 layers (test_sharded_decode.FIRST_4_LAYERS) with 256 experts, whose
router splits ("split": 8 ways over every rank, 2 chunks of 128 real; "host" on hosts of 4: 4
ways, 2 real; "sibling": 2 ways, both real; "replicated": whole). Each case checks: every rank
chose the same tokens and holds the same logits; logits, tokens and every rank's state slice
EQUAL the sharded reference's to the bit, and the logits equal the "split" placement's (the same
routed scores); every rank's remote copies are the placement's collectives (`collective_ops`,
which the prediction reads); every rank's HBM bytes the placed layout's (`layout_bytes`); no
scores gather over every rank before top-k outside "split" (none
at all "replicated"); W_ld's latent gathered on its own after routing and after the first
experts' DMAs are started, waited for before the first expert is computed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import schedule_check
import test_sharded_decode
from mkresearch.kernels.base import dma
from mkresearch.kernels.compose import megakernel_sharded as ms
from mkresearch.kernels.compose.megakernel_plan import MegakernelOptions
from mkresearch.kernels.stages.experts import LATENT_DOWN
from mkresearch.kernels.stages.router import W_ROUTER

from mkresearch.model import config, reference, weights
from mkresearch.sharding import layout, reference_sharded

N_RANKS = 8
PROMPT_LEN = 20
SEED = 7
MIXED = [None, 0.8, None]  # greedy, sampled, greedy rows
# the fast cases' model with a router that splits (more than one lane tile of experts)
KIMI_4L_E256 = test_sharded_decode.FIRST_4_LAYERS.replace(name="kimi-k3-mini-4l-e256",
                                                          n_experts=256)
FUSED = f"{W_ROUTER}+{LATENT_DOWN}"
_cache: dict = {}


def setup(cfg, batch):
    if (cfg, batch) not in _cache:
        params = _cache.setdefault(cfg, weights.init_params(cfg, 0))
        prompt = jax.random.randint(jax.random.key(0), (batch, PROMPT_LEN), 0, cfg.vocab_size)
        state = reference.init_state(cfg, batch)
        _, state = reference.prefill(params, state, prompt[:, :-1], cfg)
        _cache[cfg, batch] = (params, state, np.asarray(prompt[:, -1], np.int32),
                              np.full(batch, PROMPT_LEN - 1, np.int32))
    return _cache[cfg, batch]


def step(cfg, batch, placement, ranks_per_host=0):
    """One step with the router placed, checked against the sharded reference -> (tokens,
    logits, DMA log, plan)."""
    params, state, tokens, positions = setup(cfg, batch)
    lay = layout.layout(cfg, N_RANKS, collectives=layout.PARTIAL_SUM)
    options = MegakernelOptions(router_placement=placement, ranks_per_host=ranks_per_host)
    plan = ms.make_sharded_plan(lay, batch, cfg.max_seq_len, options=options)
    assert plan.layout.router == placement
    mesh = ms.make_mesh(N_RANKS)
    prepared = ms.prepare_weights(params, plan.layout, mesh)
    with dma.recording() as log:
        got, got_state, aux = ms.decode_step(
            prepared, ms.shard_state(state, plan.layout, mesh), tokens, positions, plan,
            mesh=mesh, return_logits=True, seed=SEED, temperature=MIXED[:batch])
        jax.block_until_ready(got)
    per_rank = np.asarray(aux["tokens_per_rank"])
    assert (per_rank == per_rank[:1]).all(), f"the ranks disagree: {per_rank}"
    logits = np.asarray(aux["logits"])
    want, want_state, want_aux = reference_sharded.decode_step(
        params, state, jnp.asarray(tokens), jnp.asarray(positions), lay, "f32", ranks_per_host)
    np.testing.assert_array_equal(logits.view(np.uint32), np.asarray(want).view(np.uint32),
                                  err_msg="logits != the sharded reference's")
    for got_leaf, want_leaf in zip(jax.tree.leaves(got_state),
                                   jax.tree.leaves(layout.shard_state(want_state, lay)),
                                   strict=True):
        np.testing.assert_array_equal(np.asarray(got_leaf).view(np.uint8),
                                      np.asarray(want_leaf).view(np.uint8),
                                      err_msg="a rank's state slice != the sharded reference's")
    # every rank's remote copies: the placement's collectives, in order
    expert_ids = np.asarray(want_aux["expert_ids"])
    schedule_check.check(log, plan.layout, batch, expert_ids, options)
    # every rank's HBM bytes by component: the placed layout's (`layout_bytes`, the router's
    # columns over its group; a rank skips its slices of padding only)
    if "moe" in cfg.kinds:  # Kimi K3's MoE kind (check_bytes reads its experts)
        test_sharded_decode.check_bytes(plan.layout, batch, log, expert_ids)
    print(f"{cfg.name} on {N_RANKS} ranks, router {placement} (over "
          f"{plan.layout.router_ways or N_RANKS} ranks"
          f"{f', hosts of {ranks_per_host}' if ranks_per_host else ''}), B={batch}: logits and "
          "states equal to the sharded reference's to the bit, identical on every rank; remote "
          "copies as its collectives, HBM bytes as the placed layout's")
    return np.asarray(got), logits, log, plan


def check_latent_gather(log, plan):
    """Per rank and MoE layer: no remote copy over every rank before top-k (the router's own
    group's only), W_ld's latent gather started after top-k and after the layer's first expert
    DMA (when the rank computes any), its wait before the first expert's compute."""
    cfg = plan.layout.cfg
    group = plan.layout.router_ways
    for rank in range(N_RANKS):
        events = log.of_rank(rank).events
        marks = [i for i, e in enumerate(events)
                 if e.kind == "phase_start" and e.name == "router/select"]
        assert len(marks) == len(cfg.moe_layers)
        latent_waits = [i for i, e in enumerate(events)
                        if e.kind == "dma_wait" and e.name == f"{LATENT_DOWN}/all_gather"]
        for n, select in enumerate(marks):  # from the previous layer's latent wait on
            first = max([i + 1 for i in latent_waits if i < select], default=0)
            before = [e.name for e in events[first:select] if e.kind == "dma_start" and e.remote
                      and (e.name.startswith(W_ROUTER) or e.name.startswith(LATENT_DOWN))]
            assert not [n for n in before if n.startswith((FUSED, LATENT_DOWN))], \
                (rank, before)
            if group == 1:
                assert not before, (rank, before)
            else:
                assert set(before) == {f"{W_ROUTER}/all_gather"}, (rank, before)
                assert len(before) == group - 1
            after = events[select:marks[n + 1] if n + 1 < len(marks) else len(events)]
            gather = next(i for i, e in enumerate(after) if e.kind == "dma_start" and e.remote
                          and e.name == f"{LATENT_DOWN}/all_gather")
            waited = next(i for i, e in enumerate(after) if e.kind == "dma_wait"
                          and e.name == f"{LATENT_DOWN}/all_gather")
            expert = [i for i, e in enumerate(after) if e.kind == "dma_start" and not e.remote
                      and e.name.startswith("expert/")]
            compute = [i for i, e in enumerate(after) if e.kind == "phase_start"
                       and e.name == "expert/compute"]
            assert waited > gather
            if expert:
                assert expert[0] < gather, (rank, "the first expert DMA after the latent gather")
            if compute:
                assert waited < compute[0], (rank, "an expert computed before the latent")


_split_logits: dict = {}


def split_logits(batch):
    if batch not in _split_logits:
        _split_logits[batch] = step(KIMI_4L_E256, batch, layout.ROUTER_SPLIT)[1]
    return _split_logits[batch]


# the exhaustive tier: every placement at B = 3 and 1, each also against the split placement's
# logits (each case one more 8-rank step, ~30 s here: over make test's budget, which checks each
# placement's collectives, bytes and layout without a step, tests/test_router_placement.py)
PLACEMENTS = [(layout.ROUTER_REPLICATED, 0), (layout.ROUTER_HOST, 4), (layout.ROUTER_SIBLING, 0)]


@pytest.mark.exhaustive
@pytest.mark.parametrize("placement, ranks_per_host", PLACEMENTS)
@pytest.mark.parametrize("batch", [3, 1])
def test_placement_equals_reference_and_split(race_checked, placement, ranks_per_host, batch):
    """Each placement at B = 3 (greedy and sampled rows) and B = 1, against the reference and
    the split placement, recorded."""
    _, logits, log, plan = step(KIMI_4L_E256, batch, placement, ranks_per_host)
    np.testing.assert_array_equal(logits.view(np.uint32), split_logits(batch).view(np.uint32),
                                  err_msg=f"router {placement}: logits != the split placement's")
    check_latent_gather(log, plan)


@pytest.mark.exhaustive  # hosts of 2 (a host is a sibling pair): one more step
def test_host_of_2(race_checked):
    _, logits, log, plan = step(KIMI_4L_E256, 3, layout.ROUTER_HOST, 2)
    np.testing.assert_array_equal(logits.view(np.uint32), split_logits(3).view(np.uint32))
    check_latent_gather(log, plan)


@pytest.mark.parametrize("placement", [layout.ROUTER_REPLICATED, layout.ROUTER_SIBLING])
@pytest.mark.exhaustive  # the other family: its router is whole on every rank (full-d experts)
def test_other_family(race_checked, placement):
    step(config.get_config("deepseek-v3-mini"), 3, placement)


@pytest.mark.exhaustive  # the exact mode: two more steps (~40 s here)
def test_exact_mode_replicated_equals_split(race_checked):
    """The exact collectives with the router whole on every rank: the same bits as the split
    router's (every value whole on one rank either way), identical on every rank, remote copies
    as its collectives."""
    cfg, batch = KIMI_4L_E256, 1
    params, state, tokens, positions = setup(cfg, batch)
    lay = layout.layout(cfg, N_RANKS, collectives=layout.EXACT)
    mesh = ms.make_mesh(N_RANKS)
    _, _, single_aux = reference.decode_step(params, state, jnp.asarray(tokens),
                                             jnp.asarray(positions), cfg)
    out = {}
    for placement in (layout.ROUTER_SPLIT, layout.ROUTER_REPLICATED):
        options = MegakernelOptions(router_placement=placement)
        plan = ms.make_sharded_plan(lay, batch, cfg.max_seq_len, options=options)
        with dma.recording() as log:
            got, _, aux = ms.decode_step(
                ms.prepare_weights(params, plan.layout, mesh),
                ms.shard_state(state, plan.layout, mesh), tokens, positions, plan, mesh=mesh,
                return_logits=True)
            jax.block_until_ready(got)
        per_rank = np.asarray(aux["tokens_per_rank"])
        assert (per_rank == per_rank[:1]).all(), f"the ranks disagree: {per_rank}"
        schedule_check.check(log, plan.layout, batch, np.asarray(single_aux["expert_ids"]),
                             options)
        out[placement] = np.asarray(aux["logits"])
    np.testing.assert_array_equal(out[layout.ROUTER_REPLICATED].view(np.uint32),
                                  out[layout.ROUTER_SPLIT].view(np.uint32))
