"""The megakernel (one pallas_call per decode step) against the reference, in TPU interpret mode
with the race detector on; its bytes from the DMA log; its TPU7x compiles; bad input.

Every step is teacher-forced on the reference's token and starts from the reference's state (one
near-tie cannot derail the steps after it), and is checked against two references:

* the plain-JAX reference (docs/kimi-k3.md §11, whole-step interpret-mode runs): logits within LOGIT_TOL =
  5e-2 on EVERY row-step, the same experts in every MoE layer, greedy tokens equal except at
  near-ties, and each cache and state leaf after the step within a relative (Frobenius) error
  of STATE_REL_TOL = 2^-7 (see `assert_states_match`). A near-tie is a row whose reference top-2
  logit gap is under NEAR_TIE_GAP = 2 x LOGIT_TOL: only there can two logit vectors that agree
  within LOGIT_TOL pick different tokens. Near-ties are reported (and asserted to be the only
  token differences). Where the spec leaves a summation order open the reference takes the
  kernels' (DEVELOPERS.md), so most row-steps match to the bit; what remains is XLA:CPU's own
  dot order (a [B, K] @ [K, N] product sums a row in another order than a [1, K] one), which
  flips a bf16 rounding now and then;
* the stage kernels run one pallas_call each (`reference.RESIDUAL_STEPS[cfg.residual]` with the
  kernels as its `sublayers`, `staged_step`): the megakernel composes the very same bodies, so
  its tokens must be IDENTICAL and its logits within COMPOSE_TOL (LM-head tiles accumulate in
  another order).
"""

import contextlib
import functools
import os

# libtpu allows one process at a time by default; tests on a shared machine compile concurrently
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuts import kimi_kinds
from mkresearch.kernels.base import dma, quant
from mkresearch.kernels.compose import megakernel as mk
from mkresearch.kernels.compose import schedule
from mkresearch.kernels.compose.megakernel_plan import VmemPlanError
from mkresearch.kernels.stages import experts, kda, mla, router

from mkresearch.cli.bench import near_tie_rows
from mkresearch.hardware.chips import CHIPS
from mkresearch.measurement.hlo import count_xla_kernels
from mkresearch.measurement.logs import hbm_bytes, minimum_step_bytes
from mkresearch.model import config, reference, sampling, weights
from mkresearch.model.config import get_config
from mkresearch.prediction import timeline
from mkresearch.prediction.scaling import scale_log

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

COMPOSE_TOL = 1e-3
LOGIT_TOL = 5e-2  # docs/kimi-k3.md §11, asserted for every row-step
NEAR_TIE_GAP = 2 * LOGIT_TOL  # a smaller reference top-2 gap may swap within LOGIT_TOL
BF16_TOL = 2.0 ** -7
STATE_ATOL = 1e-4
STATE_REL_TOL = 2.0 ** -7
BYTES_SLACK = 1.02
MINI = config.get_config("kimi-k3-mini")
PROMPT_LEN = 28  # prefilled by the reference, so the steps cross the KV tile boundary at 32


@pytest.fixture(scope="module")
def mini_params():
    return weights.init_params(MINI, 0)


_prefilled: dict = {}


def prefilled(cfg, params, batch, length, seed=0):
    """Reference state after teacher-forcing a random prompt, and the prompt's last tokens (made
    once per arguments: a test that replays the reference from it does not prefill again; the
    entry keeps its parameters alive, so that their id is never reused)."""
    key = (cfg, id(params), batch, length, seed)
    if key not in _prefilled:
        prompt = jax.random.randint(jax.random.key(seed), (batch, length), 0, cfg.vocab_size)
        state = reference.init_state(cfg, batch)
        if length > 1:
            _, state = reference.prefill(params, state, prompt[:, :-1], cfg)
        _prefilled[key] = (params, state, prompt[:, -1])
    return _prefilled[key][1:]


def copy_state(state):
    return jax.tree.map(jnp.copy, state)


# the reference step jitted once per shape, shared with reference.prefill (no second compile)
_reference_step = reference.decode_step_jit


def _kda_kernel(p, x, layer_state, positions, cfg):
    out, conv, recurrent = kda.kda_attention(p, x, layer_state["conv"], layer_state["recurrent"],
                                             cfg)
    return out, {"conv": conv, "recurrent": recurrent}, {}


def _mla_kernel(p, x, layer_state, positions, cfg):
    out, cache = mla.mla_attention(p, x, layer_state, positions, cfg)
    return out, cache, {}


def _moe_kernel(p, x, layer_state, positions, cfg):
    return experts.moe_ffn(p, x, cfg), layer_state, {"expert_ids": router.route(p, x, cfg)[0]}


def _dense_kernel(p, x, layer_state, positions, cfg):
    return experts.dense_ffn(p, x, cfg), layer_state, {}


# the stage kernels in the reference's sublayer contract, (out, layer state, aux)
KERNEL_SUBLAYERS = {"kda": _kda_kernel, "mla": _mla_kernel, "moe": _moe_kernel,
                    "dense": _dense_kernel}


def staged_step(params, state, tokens, positions, cfg):
    """The step with one pallas_call per stage: the reference's skeleton with the kernels as its
    `sublayers` (as `prefill` passes its own). Returns (logits, state, expert ids
    [n_moe, B, k]: the router kernel's routing)."""
    logits, state, aux = reference.RESIDUAL_STEPS[cfg.residual](
        params, state, jnp.asarray(tokens), jnp.asarray(positions), cfg,
        sublayers=KERNEL_SUBLAYERS)
    return logits, state, aux["expert_ids"]


# jitted: the kernel wrappers are traced once (interpret options are read at trace time, and every
# test here runs under race_checked)
_staged_step = jax.jit(staged_step, static_argnames="cfg")


def run_steps(cfg, params, batch, n_steps, *, record=False, prompt_len=PROMPT_LEN):
    """n_steps teacher-forced on the reference: each step, the megakernel (and the stage kernels,
    one call each) starts from the reference's state and token and is checked against both (see
    the module docstring). Returns (near-ties [(step, row, top-2 gap, tokens differ)], max |logit
    difference| over all row-steps, DMA logs, the last step's positions and the reference's
    routing of it [n_moe, B, k])."""
    ref_state, tokens = prefilled(cfg, params, batch, prompt_len)
    prepared = mk.prepare_weights(params, cfg)
    positions = np.full(batch, prompt_len - 1, np.int32)
    near_ties, worst, logs = [], 0.0, []
    for step in range(n_steps):
        start = jnp.asarray(tokens), jnp.asarray(positions)
        logits, next_state, aux_ref = _reference_step(params, ref_state, *start, cfg=cfg)
        ref_tokens = np.asarray(sampling.sample(logits, seed=0, positions=positions + 1))
        with dma.recording() if record else contextlib.nullcontext() as log:
            # expert_ids: the routing a log from shapes (on a TPU) is given, the reference's
            mk_tokens, mk_state, aux = mk.decode_step(prepared, copy_state(ref_state), tokens,
                                                      positions, cfg, return_logits=True,
                                                      expert_ids=aux_ref["expert_ids"])
            jax.block_until_ready(mk_tokens)
        logs.append(log)
        # the composition: the same bodies, one pallas_call each
        staged_logits, staged_state, kernel_experts = _staged_step(params, ref_state, *start,
                                                                   cfg=cfg)
        composed = float(jnp.max(jnp.abs(aux["logits"] - staged_logits)))
        assert composed <= COMPOSE_TOL, f"step {step}: megakernel vs stage kernels {composed}"
        np.testing.assert_array_equal(
            mk_tokens, sampling.sample(staged_logits, seed=0, positions=positions + 1))
        assert_states_match(mk_state, staged_state)
        # the reference: routing, logits, states, tokens
        np.testing.assert_array_equal(np.sort(np.asarray(kernel_experts), -1),
                                      np.sort(np.asarray(aux_ref["expert_ids"]), -1),
                                      err_msg=f"step {step}: the kernels chose other experts")
        diff = np.asarray(jnp.max(jnp.abs(aux["logits"] - logits), axis=-1))  # [B]
        worst = max(worst, float(diff.max()))
        assert diff.max() <= LOGIT_TOL, (
            f"step {step}: logits differ by {diff.max():.4g} > {LOGIT_TOL} in rows "
            f"{np.flatnonzero(diff > LOGIT_TOL).tolist()}")
        assert_states_match(mk_state, next_state, same_inputs=False)
        rows = near_tie_rows(logits, mk_tokens, NEAR_TIE_GAP)
        near_ties += [(step, row, round(gap, 4), differs) for row, gap, differs in rows]
        assert all(gap < NEAR_TIE_GAP for _, gap, differs in rows if differs), (
            f"step {step}: tokens {np.asarray(mk_tokens).tolist()} != reference "
            f"{ref_tokens.tolist()} off near-ties {rows}")
        last = positions, np.asarray(aux_ref["expert_ids"])
        ref_state, tokens, positions = next_state, jnp.asarray(ref_tokens), positions + 1
    return near_ties, worst, logs, last


def assert_states_match(actual, expected, *, same_inputs=True):
    """same_inputs (against the stage kernels): bf16 leaves (caches, conv state) within one bf16 ulp
    of their scale and the f32 recurrent state within STATE_ATOL, element by element. Against the
    reference, a layer's input can differ by a bf16 ulp (the MoE kernel sums its experts' f32
    contributions in another order, and a sum can round the other way); with mini's random
    weights later layers carry that to a few elements, so each leaf's relative Frobenius error
    is held within STATE_REL_TOL."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        name = jax.tree_util.keystr(path)
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if not same_inputs:
            error = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
            assert error <= STATE_REL_TOL, f"{name}: relative error {error:.3g} > {STATE_REL_TOL}"
        elif name == "['kda']['recurrent']":
            np.testing.assert_allclose(a, b, atol=STATE_ATOL, rtol=0, err_msg=name)
        else:
            scale = float(np.abs(b).max()) or 1.0
            np.testing.assert_allclose(a, b, rtol=BF16_TOL, atol=BF16_TOL * scale, err_msg=name)


# ---- correctness: greedy steps against the reference ---------------------------------------------
def report(label, near_ties, worst):
    differ = [(step, row, gap) for step, row, gap, changed in near_ties if changed]
    print(f"{label}: max |logit diff| vs the reference {worst:.3g} (<= {LOGIT_TOL} asserted); "
          f"{len(near_ties)} near-tie row-steps (top-2 gap < {NEAR_TIE_GAP}), tokens differ at "
          f"{len(differ)} of them {differ}: {[(step, row, gap) for step, row, gap, _ in near_ties]}")


# make test: 2 steps at B = 4 after a prompt of 32 (positions 31 and 32: the KV tile boundary at 32
# is crossed); each step starts from the reference's state, so more steps run the same checks at
# more positions: the exhaustive tier runs 32 after the module's prompt of 28 (27..58).
GREEDY_STEPS = [pytest.param(2, 32, id="2"),
                pytest.param(32, PROMPT_LEN, id="32", marks=pytest.mark.exhaustive)]


@pytest.mark.exhaustive  # make test runs the same steps at B = 4; batch invariance, B = 1 vs 4
def test_greedy_32_steps_batch_1(race_checked, mini_params):
    near_ties, worst, _, _ = run_steps(MINI, mini_params, 1, 32)
    report("B=1, 32 steps", near_ties, worst)


@pytest.mark.slow
@pytest.mark.parametrize("n_steps, prompt_len", GREEDY_STEPS)
def test_greedy_steps_batch_4_and_bytes(race_checked, mini_params, n_steps, prompt_len):
    """B = 4, recorded: tokens, states, and the bytes each step moves against the minimum."""
    assert prompt_len - 1 < 32 < prompt_len - 1 + n_steps  # the steps cross the KV tile boundary
    near_ties, worst, logs, (positions, expert_ids) = run_steps(
        MINI, mini_params, 4, n_steps, record=True, prompt_len=prompt_len)
    report(f"B=4, {n_steps} steps", near_ties, worst)
    # the bytes of the last step against the minimum of that step (its reference routing)
    moved = hbm_bytes(logs[-1])
    minimum = minimum_step_bytes(MINI, 4, positions, np.asarray(expert_ids))
    print(f"B=4 step bytes: {moved:,d} DMA'd vs minimum {minimum.total:,d} "
          f"({moved / minimum.total:.4f}x)\n{minimum}")
    assert moved <= BYTES_SLACK * minimum.total
    # the step ran its schedule (kernels/compose/schedule.py), whose prefetches run ahead
    step = schedule.schedule(mk.make_plan(MINI, 4, MINI.max_seq_len), positions,
                             np.asarray(expert_ids))
    assert step.mismatch(logs[-1]) is None, step.mismatch(logs[-1])
    assert_prefetch_order(step)
    # the recorded step scaled to the per-rank shapes of Kimi K3 (notebook 07's timeline)
    rank = get_config("kimi-k3-rank")
    scaled = scale_log(logs[-1], MINI, rank, 4)
    layers = [e for e in scaled if e.kind == "dma_start" and e.name == "mix_attn"]
    assert [dict(e.indices)["layer"] for e in layers] == list(range(rank.n_layers))
    predicted = timeline.simulate(scaled, "tpu7x")
    print(f"scaled to {rank.name}: {predicted.dma_bytes / 1e9:.2f} GB, "
          f"{predicted.total_s * 1e3:.2f} ms predicted on tpu7x, "
          f"{predicted.roofline_fraction:.0%} of the HBM roofline")
    assert 0 < predicted.roofline_fraction <= 1


def assert_prefetch_order(step):
    """The global weight stream in the step's schedule: the FFN's first block is issued before
    the attention's last block is waited for, the next layer's first block before this layer's
    FFN ends, and expert DMAs right after routing, before the latent down-projection is waited
    for (tests/test_schedule.py finds late ones)."""
    assert step.late_prefetches() == {"ffn": [], "next_layer": [], "experts": []}


# ---- the format / layout matrix (fewer steps) -----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("layout, expert_format, expert_mxu, batch",
                         [("latent", "fp8", "bf16", 2), ("expanded", "bf16", "bf16", 8),
                          pytest.param("expanded", "mxfp4", "fp8", 3,  # make test: the stage's
                                       marks=pytest.mark.exhaustive)])  # bits, test_expert_kernel
def test_layouts_and_formats(race_checked, layout, expert_format, expert_mxu, batch):
    """On kimi-k3-mini cut to 2 layers (KDA + dense, MLA + MoE: the MLA cache layout, the
    expert format and what the MXU is handed each in one layer), 2/7 of the whole mini's
    interpret-mode time."""
    cfg = kimi_kinds(MINI, mla_cache_layout=layout, expert_format=expert_format,
                     expert_mxu=expert_mxu)
    params = weights.init_params(cfg, 1)
    near_ties, worst, _, _ = run_steps(cfg, params, batch, 3)
    report(f"{layout}/{expert_format}/MXU {expert_mxu} B={batch}, 3 steps", near_ties, worst)


# ---- compiling for TPU7x ----------------------------------------------------------------------------
@functools.cache
def compiled_step(cfg, batch, chip):
    """`mk.compile_step` once per (config, batch, chip) in this module: the tests below that
    compile the same kernel read one compile."""
    return mk.compile_step(cfg, batch, chip=chip)


# kimi-k3-rank's compile (~35 s here) is exhaustive: make test compiles the same kernel at mini
# shapes here and holds the committed record of the rank's compile (`make recorded`) to its
# current plan (tests/test_recorded.py), as for the other families' ranks.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["kimi-k3-mini",
                                  pytest.param("kimi-k3-rank", marks=pytest.mark.exhaustive)])
def test_compiles_to_one_mosaic_kernel(name):
    cfg = get_config(name)
    result, plan = compiled_step(cfg, 1, "tpu7x")
    print(f"{name}: {result}; VMEM plan {plan.vmem.total_bytes / 2**20:.2f} MiB; "
          f"{count_xla_kernels(result.hlo_text)} XLA kernels incl. layout/alias copies")
    assert result.n_mosaic_kernels == 1
    if name == "kimi-k3-mini":
        ref = mk.compile_reference_step(cfg, 1, chip="tpu7x")
        print(f"reference backend for tpu7x: {ref.n_mosaic_kernels} Mosaic kernels, "
              f"{count_xla_kernels(ref.hlo_text)} XLA kernels per step")
        assert count_xla_kernels(ref.hlo_text) > 1


@pytest.mark.parametrize("chip, decode_path", [("v5e", "integer"), ("v6e", "integer"),
                                               ("v5p", "integer"), ("tpu7x", "native")])
@pytest.mark.slow
def test_mxfp4_compiles_for_every_chip(chip, decode_path):
    """The default preset (MXFP4 experts) on every chip: one Mosaic kernel, MXFP4 decoded by bit
    operations where Mosaic has no float4 vectors."""
    assert MINI.expert_format == "mxfp4"
    result, plan = compiled_step(MINI, 1, chip)
    print(f"kimi-k3-mini on {chip}: {result}; MXFP4 decode {plan.stage_plan('moe').stage.mxfp4_decode}")
    assert result.n_mosaic_kernels == 1 and result.chip == chip
    assert plan.stage_plan("moe").stage.mxfp4_decode == decode_path


@pytest.mark.exhaustive  # make test: both paths equal the reference's bits in the stage kernel
def test_mxfp4_decode_paths_give_the_same_step(race_checked, mini_params):
    """The megakernel built for v5e (integer MXFP4 decode) and for TPU7x (native), interpreted:
    the same logits to the bit, the same tokens and state (make test checks both paths in the
    expert stage the megakernel composes: test_expert_kernel)."""
    state, tokens = prefilled(MINI, mini_params, 2, 4)
    prepared = mk.prepare_weights(mini_params, MINI)
    positions = np.full(2, 3, np.int32)
    steps = {}
    for chip in ("v5e", "tpu7x"):
        out, new_state, aux = mk.decode_step(prepared, copy_state(state), tokens, positions, MINI,
                                             options=mk.MegakernelOptions(chip=chip),
                                             return_logits=True)
        assert aux["plan"].stage_plan("moe").stage.mxfp4_decode == quant.mxfp4_decode_path(chip)
        steps[chip] = (np.asarray(out), np.asarray(aux["logits"]).view(np.uint32), new_state)
    (tokens_a, logits_a, state_a), (tokens_b, logits_b, state_b) = steps.values()
    np.testing.assert_array_equal(tokens_a, tokens_b)
    np.testing.assert_array_equal(logits_a, logits_b)
    jax.tree.map(np.testing.assert_array_equal, state_a, state_b)


@pytest.mark.slow
def test_fp8_experts_compile_on_a_chip_without_fp8():
    """FP8 e4m3 values are widened in VMEM, which Mosaic lowers on chips without an FP8 MXU too
    (every chip compiles the FP8 MoE layer: test_expert_kernel.py)."""
    assert CHIPS["v5e"].fp8_flops == 0
    result, _ = mk.compile_step(MINI.replace(expert_format="fp8"), 1, chip="v5e")
    assert result.n_mosaic_kernels == 1


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_hbm_over_the_chip_is_refused_before_compiling(chip):
    """kimi-k3-rank (61 GB for B = 1) on a 17 / 34 GB device: a ValueError naming the chip, the
    bytes needed and available and what to change, before anything is traced."""
    cfg = get_config("kimi-k3-rank")
    with mock.patch.object(mk.tpu, "compile_for", side_effect=AssertionError("compiled")):
        with pytest.raises(ValueError, match=rf"kimi-k3-rank does not fit the HBM of one {chip} "
                                             r"device: it needs [\d,]+ B .* but "
                                             rf"{chip} has [\d,]+ B .*shard the model across more "
                                             r"ranks / devices.*expert_format='mxfp4'"):
            mk.compile_step(cfg, 1, chip=chip)
    needed = get_config("kimi-k3-rank", expert_format="bf16")
    with pytest.raises(ValueError, match=r"use expert_format='mxfp4' \(.* needed\) instead of "
                                         r"'bf16'"):
        mk.make_plan(needed, 1, needed.max_seq_len, mk.MegakernelOptions(chip="v5p"))


def test_compile_step_chip_and_options_chip_must_agree():
    with pytest.raises(ValueError, match=r"options.chip='tpu7x' differs from chip='v5e'"):
        mk.compile_step(MINI, 1, chip="v5e", options=mk.MegakernelOptions(chip="tpu7x"))


# ---- bad input ---------------------------------------------------------------------------------------
def test_vmem_plan_over_the_chip_is_refused_with_the_plan():
    options = mk.MegakernelOptions(expert_slots=8, chip="v5p")
    # 24 of the 93 layers: the bf16 experts of all of them would not fit v5p's HBM (refused
    # first, see test_hbm_over_the_chip_is_refused_before_compiling); VMEM is per layer
    cfg = get_config("kimi-k3-rank", expert_format="bf16", n_layers=24)
    with pytest.raises(VmemPlanError,
                       match=r"(?s)VMEM plan needs.*expert_slots.*slots\['w1/weight'\]"):
        mk.make_plan(cfg, 8, cfg.max_seq_len, options)


def test_ring_config_over_the_chip_is_refused():
    """The ring's depth and slot bytes are config fields; the plan checks them against VMEM (a
    TPU7x core's, named: on a TPU the default chip is the one present)."""
    tpu7x = mk.MegakernelOptions(chip="tpu7x")
    fits = get_config("kimi-k3-rank", ring_block_bytes=8 * 2**20, ring_depth=3)
    assert mk.make_plan(fits, 1, fits.max_seq_len, tpu7x).stream.slot_shape == (512, 7168)
    cfg = fits.replace(ring_depth=8)
    with pytest.raises(VmemPlanError, match=r"(?s)lower the config's ring_depth, "
                                               r"ring_block_bytes.*weight ring +\[8, 512, 7168\]"):
        mk.make_plan(cfg, 1, cfg.max_seq_len, tpu7x)


def test_position_past_the_cache(mini_params):
    state = reference.init_state(MINI, 1)
    with pytest.raises(ValueError, match=r"positions=\[128\] is invalid: each in \[0, 128\)"):
        mk.decode_step(mini_params, state, np.array([1]), np.array([128]), MINI)


def test_batch_larger_than_supported(mini_params):
    batch = mk.MAX_BATCH + 1
    state = jax.eval_shape(lambda: reference.init_state(MINI, batch))
    with pytest.raises(ValueError, match=rf"batch={batch} is invalid: an int in \[1, 16\]"):
        mk.decode_step(mini_params, state, np.zeros(batch, np.int32), np.zeros(batch, np.int32),
                       MINI)


def test_ring_deeper_than_the_shortest_stage():
    """ring_depth is a config field (validated by ModelConfig itself: an int in [2, 32]); the
    megakernel also refuses a lookahead that would cross two stage boundaries."""
    cfg = MINI.replace(ring_depth=5)
    with pytest.raises(ValueError, match=r"ModelConfig.ring_depth=5 is invalid for the "
                                         r"megakernel: an int in \[2, 4\]"):
        mk.make_plan(cfg, 1, cfg.max_seq_len)
    with pytest.raises(ValueError, match=r"ModelConfig.ring_depth=1 is invalid: an int in \[2, 32\]"):
        MINI.replace(ring_depth=1)


@pytest.mark.parametrize("field, value, match", [
    ("expert_slots", 1, r"expert_slots=1 is invalid: an int in \[2, 8\]"),
    ("expert_plan", "some", "plan='some' is invalid"),
    ("chip", "h100", "unknown chip 'h100'"),
])
def test_bad_options(field, value, match):
    options = mk.MegakernelOptions(**{field: value})
    with pytest.raises(ValueError, match=match):
        mk.make_plan(MINI, 1, MINI.max_seq_len, options)


@pytest.mark.slow
def test_state_of_the_other_layout(mini_params):
    state = reference.init_state(MINI.replace(mla_cache_layout="latent"), 1)
    with pytest.raises(ValueError, match=r"state\['mla'\] has keys"):
        mk.decode_step(mini_params, state, np.array([1]), np.array([0]), MINI)
