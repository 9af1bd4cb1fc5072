"""The paged KV cache (issue 30): its contract (`mkresearch.model.paged_kv`), the reference paged
decode step and the megakernel on pages (`kernels/compose/megakernel_paged.py`), in TPU interpret
mode with the race detector on.

Paged decoding equals contiguous decoding to the bit: tokens, logits, and the caches compared
through the page table (each row's tokens 0..p), for random page tables with unused entries -1.
The rows have different lengths, one row is a free slot (position -1: it reads and writes no
page). The KV bytes of the DMA log are the contiguous kernel's (whole 16-row groups of the tokens
before each row's position), within the pages each row uses, and no KV read crosses a page.

Default tier (one case per behaviour, the budget of a step's compile): the megakernel on Qwen3's
GQA at P = 16 (P < kv_tile: a tile spans two pages), the table round trip of every cache layout,
the bad inputs, the paged step's real Mosaic compile (slow). Exhaustive: the megakernel on both
MLA layouts of Kimi K3, DeepSeek's MLA with RoPE, GLM's and Qwen3's GQA, each at P in {16, 64};
speculative verify rows on pages (GQA, and Kimi K3's latent MLA with KDA's per-position states);
the reference paged step; the compile of every layout.
"""

import dataclasses
import os

# libtpu allows one process at a time by default; tests on a shared machine compile concurrently
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mkresearch.kernels.base import dma
from mkresearch.kernels.compose import megakernel, megakernel_paged, megakernel_verify

from mkresearch.decoding import speculative
from mkresearch.hardware import tpu
from mkresearch.model import config, paged_kv, reference, spec, weights
from mkresearch.model.kv_cache import KV_ROW_GROUP, rows_read

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

BATCH = 3
MAX_PAGES_TOKENS = 128  # the contiguous cache's length: max_pages_per_row · page_size
POSITIONS = np.array([20, 37, -1], np.int32)  # row 2 is a free slot
STEPS = 2  # the second step reads the token the first one wrote into its page


def minis(name, layout=None):
    cfg = config.get_config(name)
    return dataclasses.replace(cfg, mla_cache_layout=layout) if layout else cfg


def pool_for(page_size):
    return paged_kv.PagedKVConfig(page_size=page_size, n_pages=4 * MAX_PAGES_TOKENS // page_size,
                                  max_pages_per_row=MAX_PAGES_TOKENS // page_size)


def random_table(pages, lengths, seed):
    """Rows' pages drawn at random from the pool (unused entries -1)."""
    rng = np.random.default_rng(seed)
    table = np.full((len(lengths), pages.max_pages_per_row), -1, np.int32)
    free = rng.permutation(pages.n_pages).astype(np.int32)
    used = 0
    for b, need in enumerate(paged_kv.pages_needed(np.asarray(lengths), pages.page_size)):
        table[b, :need] = free[used:used + need]
        used += need
    return table


def random_state(cfg, batch, lengths, seed):
    """A contiguous state whose caches hold random bf16 tokens before each row's length (zero
    past it) and whose recurrent leaves are random: any content, the same for both layouts."""
    rng = np.random.default_rng(seed)
    out = {}
    for kind, leaves in spec.state_table(cfg, batch, MAX_PAGES_TOKENS).items():
        out[kind] = {}
        for name, leaf in leaves.items():
            values = 0.5 * rng.standard_normal(leaf.shape, np.float32)
            axis = leaf.token_axis
            if axis is not None:  # [L, B, ..., S, ...]: zero at and past each row's length
                slots = np.arange(leaf.shape[axis]).reshape((-1,) + (1,) * (len(leaf.shape)
                                                                           - axis - 1))
                before = slots < np.asarray(lengths).reshape((1, -1) + (1,) * (len(leaf.shape)
                                                                               - 2))
                values = np.where(before, values, 0.0)
            out[kind][name] = jnp.asarray(values, leaf.dtype)
    return out


_gather = jax.jit(paged_kv.gather_cache, static_argnums=(3, 4))
_scatter = jax.jit(paged_kv.scatter_cache, static_argnums=(4, 5))


def assert_caches_equal(paged, contiguous, page_table, lengths, cfg, pages):
    """Every leaf equal to the bit: caches through the table for tokens 0..lengths[b]-1 of each
    live row, recurrent leaves of the live rows whole."""
    gathered = _gather(paged, page_table, lengths, cfg, pages)
    table = spec.state_table(cfg, BATCH, MAX_PAGES_TOKENS)
    for kind, leaves in gathered.items():
        for name, leaf in leaves.items():
            axis = table[kind][name].token_axis
            for b in np.flatnonzero(np.asarray(lengths) > 0):
                got, want = np.asarray(leaf[:, b]), np.asarray(contiguous[kind][name][:, b])
                if axis is not None:
                    got, want = (np.take(a, np.arange(lengths[b]), axis=axis - 1)
                                 for a in (got, want))
                np.testing.assert_array_equal(got, want, err_msg=f"{kind}.{name} row {b}")


# ---- the reference ----------------------------------------------------------------------------
@pytest.mark.exhaustive
@pytest.mark.parametrize("layout, page_size", [("latent", 16), ("expanded", 64)])
def test_reference_paged_step_equals_contiguous(layout, page_size):
    """Kimi K3's MLA caches: two reference paged steps equal the contiguous ones (tokens, logits,
    caches through the table). Gather, step, scatter: the megakernel tests hold the kernel to it
    through the contiguous megakernel, which is held to this reference by its own tests."""
    cfg, pages = minis("kimi-k3-mini", layout), pool_for(page_size)
    params = weights.init_params(cfg, 0)
    positions = POSITIONS.copy()
    state = random_state(cfg, BATCH, np.maximum(positions, 0), seed=1)
    table = random_table(pages, positions + STEPS, seed=2)
    paged = paged_kv.paged_from_contiguous(state, table, np.maximum(positions, 0), cfg, pages)
    tokens = np.array([5, 700, 9], np.int32)
    for _ in range(STEPS):
        live = positions >= 0
        logits_p, paged, _ = paged_kv.paged_decode_step(params, paged, tokens, positions, table,
                                                        cfg, pages)
        logits_c, state, _ = reference.decode_step(params, state, tokens,
                                                   np.maximum(positions, 0), cfg)
        np.testing.assert_array_equal(np.asarray(logits_p)[live], np.asarray(logits_c)[live])
        assert_caches_equal(paged, state, table, np.where(live, positions + 1, 0), cfg, pages)
        tokens = np.asarray(jnp.argmax(logits_c, axis=-1), np.int32)
        positions = np.where(live, positions + 1, -1).astype(np.int32)


@pytest.mark.parametrize("name, layout, page_size", [("kimi-k3-mini", "latent", 16),
                                                    ("kimi-k3-mini", "expanded", 64),
                                                    ("qwen3-235b-a22b-mini", None, 64)])
def test_scatter_then_gather_keeps_other_pages(name, layout, page_size):
    """Through the table and back, for the token axis of every layout (latent [P, n], expanded
    and GQA [H, P, n]): the rows' tokens return; other pages and each last page's tail are kept."""
    cfg, pages = minis(name, layout), pool_for(page_size)
    lengths = np.array([70, 3, 0], np.int32)
    table = random_table(pages, lengths, seed=3)
    pool = jax.tree.map(lambda s: jnp.asarray(np.full(s.shape, 7, s.dtype)),
                        paged_kv.paged_state_shapes(cfg, pages, BATCH))
    state = random_state(cfg, BATCH, lengths, seed=4)
    paged = _scatter(pool, state, table, lengths, cfg, pages)
    assert_caches_equal(paged, state, table, lengths, cfg, pages)
    kind = cfg.attention_kinds[-1]
    need = paged_kv.pages_needed(70, page_size)
    used = set(table[0, :need].tolist()) | {int(table[1, 0])}
    tail = 70 - (need - 1) * page_size  # row 0's tokens in its last page
    for leaf_name, leaf in paged[kind].items():  # [L, N, (H,) P, n]
        leaf = np.asarray(leaf, np.float32)
        for page in set(range(pages.n_pages)) - used:
            assert (leaf[:, page] == 7).all(), (leaf_name, page)
        assert (leaf[:, table[0, need - 1], ..., tail:, :] == 7).all(), leaf_name
    if layout != "latent":  # the slot helpers once, on the model with recurrent leaves too
        return
    # a row prefilled alone, put into slot 2 and fresh pages: it reads back through its table row
    row_state = random_state(cfg, 1, [40], seed=5)
    free_pages = sorted(set(range(pages.n_pages)) - used)
    page_row = np.full(pages.max_pages_per_row, -1, np.int32)
    page_row[:paged_kv.pages_needed(40, page_size)] = free_pages[:paged_kv.pages_needed(
        40, page_size)]
    joined = paged_kv.insert_row(paged, row_state, 2, page_row, 40, cfg, pages)
    table2 = table.copy()
    table2[2] = page_row
    both = jax.tree.map(lambda a, r: np.concatenate([np.asarray(a)[:, :2], np.asarray(r)], 1),
                        state, row_state)
    assert_caches_equal(joined, both, table2, np.array([70, 3, 40], np.int32), cfg, pages)
    # a joining row's slot: its recurrent leaves zeroed, every other leaf and row kept
    cleared = paged_kv.clear_slots(paged, cfg, [1])
    for kind, leaves in cleared.items():
        for leaf_name, leaf in leaves.items():
            before, after = np.asarray(paged[kind][leaf_name]), np.asarray(leaf)
            if spec.state_table(cfg, 1, 1)[kind][leaf_name].kind == spec.CACHE:
                np.testing.assert_array_equal(after, before)
            else:  # [L, B, ...]
                assert (after[:, 1] == 0).all()
                np.testing.assert_array_equal(np.delete(after, 1, 1), np.delete(before, 1, 1))


# ---- the megakernel ---------------------------------------------------------------------------
def megakernel_run(cfg, pages, seed):
    """STEPS steps of the contiguous and the paged megakernel from the same random state: per
    step (tokens, logits) of each, the DMA log of the paged step, and the final states."""
    raw = weights.init_params(cfg, 0)
    params = megakernel.prepare_weights(raw, cfg)  # once, not per step
    positions = POSITIONS.copy()
    state = random_state(cfg, BATCH, np.maximum(positions, 0), seed)
    table = random_table(pages, positions + STEPS, seed + 1)
    paged = paged_kv.paged_from_contiguous(state, table, np.maximum(positions, 0), cfg, pages)
    tokens = np.array([5, 700, 9], np.int32)
    steps = []
    for _ in range(STEPS):
        # the routing a log on a TPU (from shapes) is given: the paged reference's (interpret
        # mode logs the kernel's own, so a CPU skips the reference steps)
        routing = (megakernel_paged.paged_routing(raw, paged, tokens[:, None], positions, table,
                                                  cfg, pages) if tpu.on_tpu() else None)
        with dma.recording() as log:
            tok_p, paged, aux_p = megakernel_paged.paged_decode_step(
                params, paged, tokens, positions, table, cfg, pages, return_logits=True,
                expert_ids=routing)
        tok_c, state, aux_c = megakernel.decode_step(params, state, tokens,
                                                     np.maximum(positions, 0), cfg,
                                                     return_logits=True)
        steps.append({"positions": positions, "log": log,
                      "paged": (np.asarray(tok_p), np.asarray(aux_p["logits"])),
                      "contiguous": (np.asarray(tok_c), np.asarray(aux_c["logits"]))})
        tokens = np.asarray(tok_c)
        positions = np.where(positions >= 0, positions + 1, -1).astype(np.int32)
    return {"steps": steps, "paged": paged, "contiguous": state, "table": table,
            "lengths": np.where(positions >= 0, positions, 0)}


def check_run(run, cfg, pages):
    for step in run["steps"]:
        live = step["positions"] >= 0
        for got, want in zip(step["paged"], step["contiguous"]):
            np.testing.assert_array_equal(got[live], want[live])
        check_kv_bytes(step["log"], step["positions"], cfg, pages)
    assert_caches_equal(run["paged"], run["contiguous"], run["table"], run["lengths"], cfg,
                        pages)


def check_kv_bytes(log, positions, cfg, pages):
    """The KV tile reads: the contiguous kernel's bytes (the 16-row groups of tokens before each
    row's position), within the pages each row uses; none longer than a page (pages of 16: one
    DMA per page used and array); a free slot reads nothing and writes nothing."""
    shapes = paged_kv.paged_state_shapes(cfg, pages, BATCH)
    kind = next(k for k in cfg.attention_kinds if k in ("mla", "gqa", "mla_rope"))
    layers = shapes[kind][next(iter(shapes[kind]))].shape[0]
    token_bytes = sum(int(np.prod(leaf.shape[2:])) * leaf.dtype.itemsize // pages.page_size
                      for leaf in shapes[kind].values())
    reads = [e for e in log.select("dma_start") if ".kv." in e.name]
    assert reads and all(e.src == "hbm" for e in reads)
    live = positions[positions >= 0]
    read = sum(e.nbytes for e in reads)
    assert read == layers * sum(rows_read(int(p)) for p in live) * token_bytes
    pages_used = sum(paged_kv.pages_needed(int(p), pages.page_size) for p in live)
    assert read <= layers * pages_used * pages.page_size * token_bytes
    if pages.page_size == KV_ROW_GROUP:  # a page is one 16-row group: one DMA per page used
        assert len(reads) == layers * len(shapes[kind]) * pages_used
    largest_leaf_page = max(int(np.prod(leaf.shape[2:])) * leaf.dtype.itemsize
                            for leaf in shapes[kind].values())
    assert max(e.nbytes for e in reads) <= largest_leaf_page
    rows = {e.indices.get("row") for e in log.select("dma_start")
            if ".kv." in e.name or "kv_update" in e.name}
    assert not rows & set(np.flatnonzero(positions < 0).tolist())  # the free slot: no KV DMA


@pytest.mark.slow
def test_megakernel_paged_equals_contiguous_gqa_p16(race_checked):
    """Qwen3's GQA at P = 16 (a KV tile of 32 spans two pages): tokens, logits and caches of the
    paged megakernel equal the contiguous one's, and its KV reads are the contiguous bytes."""
    cfg, pages = minis("qwen3-235b-a22b-mini"), pool_for(16)
    check_run(megakernel_run(cfg, pages, seed=10), cfg, pages)


# make test: both MLA layouts of Kimi K3, one page size each (GQA at P = 16 above); the rest of
# the matrix (every family at both page sizes) is the exhaustive tier's
IN_MAKE_TEST = {("kimi-k3-mini", "latent", 16), ("kimi-k3-mini", "expanded", 64)}


@pytest.mark.slow
@pytest.mark.parametrize("name, layout, page_size", [
    pytest.param(name, layout, page_size, marks=() if (name, layout, page_size) in IN_MAKE_TEST
                 else pytest.mark.exhaustive)
    for page_size in (16, 64)
    for name, layout in [("kimi-k3-mini", "latent"), ("kimi-k3-mini", "expanded"),
                         ("qwen3-235b-a22b-mini", None), ("glm-4.5-mini", None),
                         ("deepseek-v3-mini", None)]])
def test_megakernel_paged_equals_contiguous_matrix(race_checked, name, layout, page_size):
    cfg, pages = minis(name, layout), pool_for(page_size)
    check_run(megakernel_run(cfg, pages, seed=20 + page_size), cfg, pages)


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [  # make test: GQA; Kimi K3's latent MLA + KDA: exhaustive
    ("qwen3-235b-a22b-mini", None), pytest.param("kimi-k3-mini", "latent", marks=pytest.mark.exhaustive)])
def test_paged_verify_equals_contiguous_verify(race_checked, name, layout):
    """Speculative verify rows on pages (K = 3, a free slot): targets, logits, per-position KDA
    states and the caches equal the contiguous verify step's, and so does the rollback."""
    cfg, pages, drafts = minis(name, layout), pool_for(16), 3
    params = megakernel.prepare_weights(weights.init_params(cfg, 0), cfg)  # once for both steps
    positions = POSITIONS.copy()
    live = positions >= 0
    state = random_state(cfg, BATCH, np.maximum(positions, 0), seed=30)
    table = random_table(pages, np.where(live, positions + drafts + 1, 0), seed=31)
    paged = paged_kv.paged_from_contiguous(state, table, np.maximum(positions, 0), cfg, pages)
    tokens = np.array([[5, 6, 7, 8], [700, 3, 2, 1], [9, 9, 9, 9]], np.int32)
    targets_p, paged, per_position_p, aux_p = megakernel_paged.paged_verify_step(
        params, paged, tokens, positions, table, cfg, pages, return_logits=True)
    targets_c, state, per_position_c, aux_c = megakernel_verify.verify_step(
        params, state, tokens, np.maximum(positions, 0), cfg, return_logits=True)
    np.testing.assert_array_equal(np.asarray(targets_p)[live], np.asarray(targets_c)[live])
    np.testing.assert_array_equal(np.asarray(aux_p["logits"])[live],
                                  np.asarray(aux_c["logits"])[live])
    for kind, leaves in (per_position_p or {}).items():
        for leaf_name, leaf in leaves.items():  # [K+1, L, B, ...]
            np.testing.assert_array_equal(np.asarray(leaf)[:, :, live],
                                          np.asarray(per_position_c[kind][leaf_name])[:, :, live])
    assert_caches_equal(paged, state, table, np.where(live, positions + drafts + 1, 0), cfg,
                        pages)
    kept = np.array([2, 4, 1])
    assert_caches_equal(paged_kv.keep_positions(paged, per_position_p, kept, cfg),
                        speculative.rollback(state, per_position_c, np.maximum(positions, 0),
                                             kept, cfg),
                        table, np.where(live, positions + kept, 0), cfg, pages)


@pytest.mark.slow
def test_paged_step_compiles_for_tpu7x():
    """The real Mosaic compiler takes the paged step (the SMEM page table, a page's window of
    the pool): one kernel. Qwen3's GQA mini at P = 16; every layout in the exhaustive tier."""
    result, _ = megakernel_paged.compile_paged_step(minis("qwen3-235b-a22b-mini"), pool_for(16),
                                                    batch=4)
    assert result.n_mosaic_kernels == 1


@pytest.mark.exhaustive
@pytest.mark.parametrize("name, layout, page_size", [("kimi-k3-mini", "latent", 16),
                                                    ("kimi-k3-mini", "expanded", 64),
                                                    ("deepseek-v3-mini", None, 64),
                                                    ("glm-4.5-mini", None, 64)])
def test_paged_step_compiles_for_tpu7x_every_layout(name, layout, page_size):
    result, _ = megakernel_paged.compile_paged_step(minis(name, layout), pool_for(page_size),
                                                    batch=4)
    assert result.n_mosaic_kernels == 1


# ---- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("table, lengths, match", [
    ([[0, 1], [9, -1]], [20, 5], r"page_table\[1, 0\]=9 is out of the pool: allowed \[0, 8\)"),
    ([[0, 1], [1, -1]], [20, 5], (r"page_table\[1, 0\]=1 is shared: page 1 is already used "
                                  r"by row 0")),
    ([[0, 0], [2, -1]], [20, 5], r"page_table\[0, 1\]=0 is shared"),
    ([[0, 1], [2, -1]], [20, 40], (r"page_table row 1 is too short: length 40 needs 3 pages "
                                   r"of 16 tokens, the table has 2 columns")),
    ([[0, 1, 2]], [5], r"page_table has shape \(1, 3\) int32: allowed \[B, 2\]"),
    ([[0, 1], [2, 3]], [5], r"lengths has shape \(1,\)"),
    ([[0, 1], [2, 3]], [5, -2], r"lengths=\[5, -2\] is invalid"),
])
def test_bad_page_table(table, lengths, match):
    pages = paged_kv.PagedKVConfig(page_size=16, n_pages=8, max_pages_per_row=2)
    with pytest.raises(ValueError, match=match) as error:
        paged_kv.validate_page_table(np.asarray(table, np.int32), np.asarray(lengths), pages)
    assert "\n" not in str(error.value)


def test_a_free_row_may_hold_any_table_row():
    """Entries past a row's pages are never read: a free slot's row may repeat live pages."""
    pages = paged_kv.PagedKVConfig(page_size=16, n_pages=8, max_pages_per_row=2)
    paged_kv.validate_page_table(np.array([[0, 1], [0, 1]], np.int32), np.array([17, 0]), pages)


@pytest.mark.parametrize("fields, match", [
    ({"page_size": 48}, r"PagedKVConfig.page_size=48 is invalid: 16 · 2\^j"),
    ({"n_pages": 0}, r"PagedKVConfig.n_pages=0 is invalid: an int >= 1"),
    ({"max_pages_per_row": 1.5}, r"PagedKVConfig.max_pages_per_row=1.5 is invalid"),
])
def test_bad_paged_config(fields, match):
    with pytest.raises(ValueError, match=match):
        paged_kv.PagedKVConfig(**{"page_size": 16, "n_pages": 8, "max_pages_per_row": 2,
                                  **fields})


def test_bad_step_inputs_at_the_megakernel_boundary():
    """The megakernel's paged step refuses bad input before it traces anything: one line each."""
    cfg, pages = minis("qwen3-235b-a22b-mini"), paged_kv.PagedKVConfig(16, 8, 2)
    state = paged_kv.init_paged_state(cfg, pages, 2)
    table, tokens = np.array([[0, 1], [2, -1]], np.int32), np.array([1, 2], np.int32)
    cases = [
        (np.array([20, 40], np.int32), table, r"page_table row 1 is too short"),
        (np.array([20, 3], np.int32), np.array([[0, 1], [1, -1]], np.int32), r"is shared"),
        (np.array([20, 3], np.int32), np.array([[0, 9], [2, -1]], np.int32), r"out of the pool"),
        (np.array([20, -2], np.int32), table, r"positions=\[20, -2\] is invalid: ints >= -1"),
    ]
    for positions, page_table, match in cases:
        with pytest.raises(ValueError, match=match) as error:
            megakernel_paged.paged_decode_step({}, state, tokens, positions, page_table, cfg,
                                               pages)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"PagedKVConfig.max_pages_per_row=1 is invalid for "
                                         r"qwen3-235b-a22b-mini: 1 pages of 16 tokens are not "
                                         r"whole KV tiles of cfg.kv_tile=32"):
        paged_kv.PagedKVConfig(16, 8, 1).check(cfg)
    with pytest.raises(ValueError, match=r"state\['gqa'\]\['k'\] has shape"):
        paged_kv.paged_decode_step({}, paged_kv.init_paged_state(cfg, pool_for(16), 2), tokens,
                                   np.array([1, 2], np.int32), table, cfg, pages)
