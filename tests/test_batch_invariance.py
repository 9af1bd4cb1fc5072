"""Batch invariance, bit for bit: a row's logits, caches and states never depend on the other rows
of the batch or on the batch size — in the reference, in the stage kernels and in the megakernel.

Random rows (random tokens, positions and states) are decoded together at B = 8 and again in
smaller batches B ∈ {1, 2, 3, 5} that place the same rows at other indices; every row's outputs
must be equal to the bit. How the model makes this hold on XLA:CPU is documented in
`reference.padded_rows` (every matmul on rows padded to a multiple of 8) and `reference.ordered_sum` (every reduction in
one written-out order); a TPU's MXU and VPU are row-independent by construction.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mkresearch.kernels.compose import megakernel as mk
from mkresearch.kernels.sharded import mla_sharded
from mkresearch.kernels.stages import experts, kda, mla
from mkresearch.kernels.stages import sampling as sampling_kernel
from tiers import EXHAUSTIVE

from mkresearch.model import config, reference, weights

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

MINI = config.get_config("kimi-k3-mini")
FULL_BATCH = 8
# smaller batches and which of the B = 8 rows they hold, in this order (rows land elsewhere)
SUBSETS = {1: [5], 2: [6, 1], 3: [2, 7, 0], 5: [4, 3, 0, 7, 5]}
LAYOUTS_AND_FORMATS = [(layout, fmt) for layout in config.MLA_CACHE_LAYOUTS
                       for fmt in config.EXPERT_FORMATS]
# make test: one pair (the expanded layout and FP8 run in the megakernel's check below);
# the other five pairs are the exhaustive tier's.
REFERENCE_CASES = [pytest.param(*pair, marks=() if pair in {("latent", "mxfp4")}
                                else pytest.mark.exhaustive) for pair in LAYOUTS_AND_FORMATS]


def random_rows(cfg, batch, seed):
    """tokens [B], positions [B] and a random state: every row different."""
    rng = np.random.default_rng(seed)
    state = jax.eval_shape(lambda: reference.init_state(cfg, batch))
    state = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.5, s.dtype), state)
    tokens = rng.integers(0, cfg.vocab_size, batch).astype(np.int32)
    positions = rng.integers(0, cfg.max_seq_len - 2, batch).astype(np.int32)
    return tokens, positions, state


def take_rows(state, rows):
    """The state of some rows (batch is axis 1 of every leaf)."""
    return jax.tree.map(lambda leaf: leaf[:, np.asarray(rows)], state)


def assert_rows_equal(full, part, rows, what, axis=0):
    """Every leaf of `part` equals the `rows` of `full` (batch on `axis`), bit for bit."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(full), jax.tree.leaves(part)):
        expected, got = np.take(np.asarray(a), rows, axis=axis), np.asarray(b)
        assert expected.shape == got.shape, (what, expected.shape, got.shape)
        differ = int(np.sum(expected.view(np.uint8) != got.view(np.uint8)))
        assert differ == 0, f"{what}{jax.tree_util.keystr(path)}: {differ} bytes differ"


def reference_steps(params, state, tokens, positions, cfg, n_steps=1):
    """n_steps greedy steps; returns the logits of each step and the final state."""
    all_logits = []
    for _ in range(n_steps):
        logits, state, _ = reference.decode_step(params, state, tokens, positions, cfg)
        all_logits.append(logits)
        tokens, positions = jnp.argmax(logits, -1).astype(jnp.int32), positions + 1
    return jnp.stack(all_logits, axis=1), state  # [B, steps, V]


@pytest.mark.slow
@pytest.mark.parametrize("layout, expert_format", REFERENCE_CASES)
def test_reference_is_batch_invariant(layout, expert_format):
    cfg = MINI.replace(mla_cache_layout=layout, expert_format=expert_format)
    params = weights.init_params(cfg, 3)
    tokens, positions, state = random_rows(cfg, FULL_BATCH, seed=11)
    full = reference_steps(params, state, tokens, positions, cfg)
    # every subset for one configuration, one subset (B = 1 and B = 3) for the others
    sizes = list(SUBSETS) if (layout, expert_format) == ("latent", "fp8") else [1]
    for size in sizes:
        rows = SUBSETS[size]
        part = reference_steps(params, take_rows(state, rows), tokens[rows], positions[rows], cfg)
        assert_rows_equal(full[0], part[0], rows, f"B={size} logits")
        assert_rows_equal(full[1], part[1], rows, f"B={size} state", axis=1)


# ---- stage kernels: a batch of three (and one row alone) vs the batch of eight --------------------
@pytest.fixture(scope="module")
def mini_params():
    return weights.init_params(MINI, 0)


def _x(batch, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((batch, MINI.d_model)), jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["kda", "mla", "moe", "dense", "sampling"])
def test_stage_kernels_are_batch_invariant(race_checked, mini_params, stage):
    x = _x(FULL_BATCH, seed=5)
    _, positions, state = random_rows(MINI, FULL_BATCH, seed=6)
    layer = lambda kind: reference.layer_params(mini_params[kind], 0)  # noqa: E731

    def run(select):
        xs, pos = x[np.asarray(select)], jnp.asarray(positions[select])
        st = take_rows(state, select)
        if stage == "kda":
            return kda.kda_attention(layer("kda"), xs, st["kda"]["conv"][0], st["kda"]["recurrent"][0],
                                    MINI)
        if stage == "mla":
            cache = jax.tree.map(lambda leaf: leaf[0], st["mla"])
            return mla.mla_attention(layer("mla"), xs, cache, pos, MINI)
        if stage == "moe":
            return experts.moe_ffn(layer("moe"), xs, MINI)
        if stage == "dense":
            return experts.dense_ffn(layer("dense"), xs, MINI)
        snapshots = jnp.stack([xs] * MINI.n_blocks)  # greedy: the tokens follow the logits
        out = sampling_kernel.sample_stage(
            snapshots, xs, mini_params["mix_out"], mini_params["final_norm"],
            mini_params["lm_head"], cfg=MINI, seed=0, positions=pos, return_logits=True)
        return out.tokens, out.logits

    every = run(list(range(FULL_BATCH)))
    # make test: B = 3 (rows at other indices, another batch size); a row alone (B = 1) is the
    # exhaustive tier's: test_megakernel_is_batch_invariant runs one row alone through the same
    # stage bodies (B = 1 of the latent layout)
    for size in (1, 3) if EXHAUSTIVE else (3,):
        select = SUBSETS[size]
        # states come back [B, ...] from the stage kernels: batch on axis 0 everywhere
        assert_rows_equal(every, run(select), select, f"{stage} B={size}")


# ---- heads: one head alone vs beside another (a rank of the sharded model vs one device) -----------
def test_latent_attention_is_head_count_invariant(race_checked):
    """The latent layout attends with all of a device's heads at once ([H, T] scores, [H, kv_rank]
    sums): 2 heads on one device of the mini, 1 on each of its ranks. Each head's online-softmax
    state must be the same bits either way (issue 22: a one-head product summed in another order,
    so the sharded step left the single-device one after a latent MLA layer)."""
    cfg = MINI.replace(mla_cache_layout="latent")
    rng = np.random.default_rng(21)
    batch, heads = 2, 2

    def bf16_normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    q_absorbed = bf16_normal(batch, heads, cfg.mla_kv_rank)
    q_extra = bf16_normal(batch, heads, cfg.mla_qk_extra)
    cache = {"ckv": bf16_normal(batch, cfg.max_seq_len, cfg.mla_kv_rank),
             "kx": bf16_normal(batch, cfg.max_seq_len, cfg.mla_qk_extra)}
    positions = jnp.asarray([45, 77], jnp.int32)  # 2 and 3 KV tiles, the last one partly read
    both = mla_sharded.mla_latent_partial(q_absorbed, q_extra, cache, positions, 0, cfg)
    for h in range(heads):
        alone = mla_sharded.mla_latent_partial(q_absorbed[:, h:h + 1], q_extra[:, h:h + 1], cache,
                                               positions, 0, cfg)
        for name, a, b in zip(("m", "norm", "acc"), both, alone):
            assert_rows_equal([np.asarray(a)[:, h:h + 1]], [b], list(range(batch)),
                              f"head {h} {name}")


# ---- the megakernel ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("layout, expert_format", [("expanded", "mxfp4"), ("latent", "fp8")])
def test_megakernel_is_batch_invariant(race_checked, layout, expert_format):
    cfg = MINI.replace(mla_cache_layout=layout, expert_format=expert_format)
    prepared = mk.prepare_weights(weights.init_params(cfg, 3), cfg)
    tokens, positions, state = random_rows(cfg, FULL_BATCH, seed=12)

    def run(rows):
        out, new_state, aux = mk.decode_step(prepared, take_rows(state, rows), tokens[rows],
                                             positions[rows], cfg, return_logits=True)
        return aux["logits"], new_state

    full = run(list(range(FULL_BATCH)))
    # one compile per batch size: make test runs B = 3 (expanded) and B = 1 (latent) against the
    # full batch; the exhaustive tier also B = 1 and 5 of the expanded layout
    sizes = (1, 3, 5) if EXHAUSTIVE else (3,)
    for size in (sizes if layout == "expanded" else (1,)):
        rows = SUBSETS[size]
        part = run(rows)
        assert_rows_equal(full[0], part[0], rows, f"B={size} logits")
        assert_rows_equal(full[1], part[1], rows, f"B={size} state", axis=1)
