"""The megakernel's verify step (speculative decoding: B rows x K + 1 tokens in one pallas_call)
against two oracles that need no speculative-decoding code, in TPU interpret mode with the race
detector on; its bytes from the DMA log; its TPU7x compiles; bad input.

The K + 1 tokens of every row (the last prompt token, then K drafts) are also fed ONE BY ONE:
* through the plain megakernel decode step (`megakernel.decode_step`, return_logits): the verify
  call must give the very same targets, logits, caches and per-position KDA states, to the bit
  (the megakernel is batch-invariant bit for bit: tests/test_batch_invariance.py);
* through `reference.decode_step`: logits within LOGIT_TOL = 5e-2 at every (row, position) up to
  the row's first position where the kernels chose other experts than the reference in some
  MoE layer (a router score within float error of a tie: seen once, deepseek-v3-mini on an x86
  CPU with AMX, 1.32 from there; the kernels' routing is the stage kernels' on the megakernel's
  state, `test_megakernel.staged_step`, computed only when the bound is exceeded), the states
  of the rows never routed apart within the relative (Frobenius) error STATE_REL_TOL of
  tests/test_megakernel.py.
The drafts are the reference's own continuation (greedy, or sampled with the decode step's seed
rule) with draft `accept` replaced, so the acceptance is forced to `accept` where the kernels
agree with the reference; n_accepted must equal the one-by-one megakernel's.
"""

import contextlib
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiles run beside other tests

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuts import kimi_kinds
from mkresearch.kernels.base import dma, registry
from mkresearch.kernels.compose import megakernel as mk
from mkresearch.kernels.compose import megakernel_verify as mv
from mkresearch.kernels.compose import schedule
from mkresearch.kernels.stages.sampling import MAX_CANDIDATES
from test_megakernel import staged_step

from mkresearch.hardware import tpu
from mkresearch.measurement.logs import hbm_bytes, hbm_bytes_by_component, minimum_step_bytes
from mkresearch.model import config, reference, roofline, sampling, spec, weights
from mkresearch.model.config import get_config
from mkresearch.prediction import timeline
from mkresearch.prediction.scaling import scale_log

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

LOGIT_TOL = 5e-2  # docs/kimi-k3.md §11
STATE_REL_TOL = 2.0 ** -7
BYTES_SLACK = 1.02
MINI = config.get_config("kimi-k3-mini")
PROMPT_LEN = 30  # the verify rows at 29.. cross the KV tile and 16-row block boundary at 32
SEED = 7
SAMPLED = {"temperature": 0.8, "top_p": 0.9}

# the reference step jitted once per shape, shared with reference.prefill (no second compile)
_reference_step = reference.decode_step_jit


@pytest.fixture(scope="module")
def mini_params():
    return weights.init_params(MINI, 0)


def copy_state(state):
    return jax.tree.map(jnp.copy, state)


def prefilled(cfg, params, batch):
    prompt = jax.random.randint(jax.random.key(batch), (batch, PROMPT_LEN), 0, cfg.vocab_size)
    _, state = reference.prefill(params, reference.init_state(cfg, batch), prompt[:, :-1], cfg)
    return state, np.asarray(prompt[:, -1], np.int32)


def reference_drafts(cfg, params, state, last, positions, drafts, accept, sample):
    """The reference's continuation of `last` (K tokens, the decode step's sampling rule) with
    draft `accept` replaced by another token: tokens [B, K+1]."""
    tokens = [last]
    for j in range(drafts):
        logits, state, _ = _reference_step(params, state, jnp.asarray(tokens[-1]),
                                           jnp.asarray(positions + j), cfg=cfg)
        tokens.append(np.asarray(sampling.sample(  # the kernel's capacity of top-p candidates
            logits, seed=SEED, positions=positions + j + 1, candidates=MAX_CANDIDATES, **sample),
            np.int32))
    if accept < drafts:
        tokens[accept + 1] = (tokens[accept + 1] + 1) % cfg.vocab_size
    return np.stack(tokens, axis=1)


def relative_error(actual, expected):
    a, b = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def recurrent_leaves(state, cfg):
    table = spec.state_table(cfg, 1, cfg.max_seq_len)
    return {(kind, leaf): value for kind, leaves in state.items() for leaf, value in leaves.items()
            if table[kind][leaf].kind != spec.CACHE}


def run_case(cfg, params, batch, drafts, accept, sample, *, record=False):
    """Verify once, then the same tokens one by one through the megakernel decode step and the
    reference; assert the oracles (module docstring). Returns what the byte checks need."""
    state, last = prefilled(cfg, params, batch)
    positions = np.full(batch, PROMPT_LEN - 1, np.int32)
    tokens = reference_drafts(cfg, params, state, last, positions, drafts, accept, sample)
    prepared = mk.prepare_weights(params, cfg)
    # the routing a log on a TPU (from shapes) is given: the reference's of each row
    given = mv.verify_routing(params, state, tokens, positions, cfg) if record else None
    with dma.recording() if record else contextlib.nullcontext() as log:
        targets, state_all, per_position, aux = mv.verify_step(
            prepared, copy_state(state), tokens, positions, cfg, seed=SEED, return_logits=True,
            expert_ids=given, **sample)
        jax.block_until_ready(targets)
    assert targets.shape == (batch, drafts + 1) and aux["logits"].shape == (
        batch, drafts + 1, cfg.vocab_size)
    mk_state, ref_state, routing, singles = copy_state(state), state, [], []
    diffs, mk_states = [], []  # [B] per position; the megakernel's state before each
    against = []  # (what, a state of the kernels, the reference's), held within STATE_REL_TOL
    for j in range(drafts + 1):
        at = positions + j
        mk_states.append(copy_state(mk_state))
        single, mk_state, mk_aux = mk.decode_step(prepared, mk_state, tokens[:, j], at, cfg,
                                                  seed=SEED, return_logits=True, **sample)
        singles.append(np.asarray(single))
        logits, ref_state, ref_aux = _reference_step(params, ref_state, jnp.asarray(tokens[:, j]),
                                                     jnp.asarray(at), cfg=cfg)
        routing.append(np.asarray(ref_aux["expert_ids"]))  # [n_moe, B, k]
        np.testing.assert_array_equal(targets[:, j], single, err_msg=f"token {j}")
        np.testing.assert_array_equal(np.asarray(aux["logits"][:, j]).view(np.uint32),
                                      np.asarray(mk_aux["logits"]).view(np.uint32),
                                      err_msg=f"logits of token {j} vs the decode step")
        diffs.append(np.asarray(jnp.max(jnp.abs(aux["logits"][:, j] - logits), axis=-1)))
        steps = recurrent_leaves(per_position, cfg)
        for key, value in recurrent_leaves(mk_state, cfg).items():
            np.testing.assert_array_equal(steps[key][j], value, err_msg=f"{key} after token {j}")
            against.append((f"{key} after token {j}", steps[key][j],
                            recurrent_leaves(ref_state, cfg)[key]))
    worst, agreed = check_logits(cfg, params, np.stack(diffs, axis=1), tokens, positions,
                                 mk_states, routing)
    jax.tree.map(np.testing.assert_array_equal, state_all, mk_state)  # caches: all K+1 entries
    against += [(jax.tree_util.keystr(path), a, b) for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(state_all), jax.tree.leaves(ref_state))]
    for what, a, b in against:  # state leaves [L, B, ...]: the rows never routed apart
        error = relative_error(np.asarray(a)[:, agreed], np.asarray(b)[:, agreed])
        assert error <= STATE_REL_TOL, f"{what}: {error:.3g} vs the reference"
    accepted = np.asarray(aux["n_accepted"])
    np.testing.assert_array_equal(accepted, mv.n_accepted(tokens, np.stack(singles, axis=1)))
    print(f"{cfg.name} {cfg.mla_cache_layout} B={batch} K={drafts} {sample or 'greedy'}: targets = the "
          f"decode step's, logits bit-equal to it and within {worst:.3g} of the reference; "
          f"n_accepted {accepted.tolist()} (forced {accept})")
    # routing of every verify row (row b(K+1)+j): [n_moe, R, k]
    expert_ids = np.stack(routing, axis=2).reshape(routing[0].shape[0], -1, cfg.top_k)
    return log, tokens, positions, expert_ids, aux["plan"]


def check_logits(cfg, params, diffs, tokens, positions, mk_states, routing):
    """The bound against the reference (module docstring): diffs [B, K + 1] within LOGIT_TOL up
    to each row's first routing difference. Returns the largest difference so bounded and the
    rows never routed apart ([B] bool: their states are held to the reference's)."""
    if diffs.max() <= LOGIT_TOL:
        return float(diffs.max()), np.ones(diffs.shape[0], bool)
    first = np.full(diffs.shape[0], diffs.shape[1])  # per row: the first position routed apart
    for j, mk_state in enumerate(mk_states):
        _, _, kernel_ids = staged_step(params, mk_state, tokens[:, j],
                                                       positions + j, cfg)
        same = np.all(np.sort(np.asarray(kernel_ids), -1) == np.sort(routing[j], -1),
                      axis=(0, 2))  # [B]
        first = np.where(~same & (first == diffs.shape[1]), j, first)
    before = np.arange(diffs.shape[1])[None] < first[:, None]
    print(f"{cfg.name}: logits up to {diffs.max():.3g} from the reference; first position routed "
          f"apart per row {first.tolist()}; before it {diffs[before].max(initial=0):.3g}")
    assert diffs[before].max(initial=0) <= LOGIT_TOL, (
        f"logits differ from the reference by {diffs[before].max():.4g} with the same routing")
    return float(diffs[before].max(initial=0)), first == diffs.shape[1]


# ---- the recorded case (module scope: one compile for the oracle, the bytes and the race check)
@pytest.fixture(scope="module")
def recorded_case(mini_params):
    """kimi-k3-mini latent, B = 2, K = 3, greedy, forced acceptance 2, with the DMA log; run
    under the race detector (vector clocks of 16), as the `race_checked` fixture does."""
    cfg = MINI.replace(mla_cache_layout="latent")
    previous = tpu.current_interpret_options()
    tpu.interpret_options(detect_races=True, vector_clock_size=16)
    tpu.reset_races()
    try:
        result = run_case(cfg, mini_params, 2, 3, 2, {}, record=True)
        raced = tpu.races_found()
    finally:
        tpu.reset_interpret_state()
        tpu.reset_interpret_options()
        tpu.interpret_options(**previous)
    return cfg, raced, result


@pytest.mark.slow
def test_verify_equals_one_by_one_latent_greedy(recorded_case):
    _, raced, _ = recorded_case
    assert not raced, "the race detector found a race (see 'RACE DETECTED' above)"


@pytest.mark.slow  # the recorded verify case (~20 s, shared)
def test_weights_read_once_for_all_rows(recorded_case):
    """From the DMA log: every weight once for all R = 8 rows (exactly the minimum's weights),
    the union of the rows' experts, and the whole step <= 1.02x its minimum: the decode step's
    minimum at R rows with the states counted as a verify moves them (B rows read and written,
    R per-position copies written)."""
    cfg, _, (log, tokens, positions, expert_ids, plan) = recorded_case
    batch, width = tokens.shape
    rows = (positions[:, None] + np.arange(width)).reshape(-1)  # [R]
    minimum = minimum_step_bytes(cfg, batch * width, rows, expert_ids)
    per_row_state = roofline.recurrent_state_bytes(cfg)
    minimum = dataclasses.replace(minimum, recurrent_state=(2 * batch + batch * width)
                                  * per_row_state)
    parts = hbm_bytes_by_component(log)
    weights_read = sum(v for k, v in parts.items() if k not in (
        "kda_state", "mla_cache", "routed_experts", "embedding_rows"))
    moved = hbm_bytes(log)
    print(f"verify B={batch} K={width - 1}: {moved:,d} B DMA'd vs minimum {minimum.total:,d} "
          f"({moved / minimum.total:.4f}x); weights {weights_read:,d} vs {minimum.weights:,d}; "
          f"experts {parts['routed_experts']:,d} vs {minimum.routed_experts:,d}\n{minimum}")
    assert parts["kda_state"] == minimum.recurrent_state
    assert parts["routed_experts"] == minimum.routed_experts  # each expert of the union once
    assert moved <= BYTES_SLACK * minimum.total
    # the step ran its schedule (kernels/compose/schedule.py), event for event
    step = schedule.schedule(plan, rows, expert_ids)
    assert step.mismatch(log) is None, step.mismatch(log)


@pytest.mark.slow  # the recorded verify case (~20 s, shared)
def test_recorded_verify_scales_to_a_rank(recorded_case):
    """The recorded verify step, scaled to one rank of Kimi K3 (the release's 32) and replayed by
    the timeline model: one weight pass for the R rows (the timeline of notebook 07, per call)."""
    cfg, _, (log, tokens, _, _, _) = recorded_case
    rows = tokens.size
    rank = get_config("kimi-k3-rank")
    predicted = timeline.simulate(scale_log(log, cfg, rank, rows), "tpu7x")
    print(f"verify B={tokens.shape[0]} K={tokens.shape[1] - 1} scaled to {rank.name}: "
          f"{predicted.dma_bytes / 1e9:.2f} GB, {predicted.total_s * 1e3:.2f} ms predicted on "
          f"tpu7x, {predicted.roofline_fraction:.0%} of the HBM roofline")
    assert 0 < predicted.roofline_fraction <= 1


# ---- the matrix (slow: one compile per case) ---------------------------------------------------
# make test runs the sampled case: greedy speculative decoding on the megakernel is lossless by
# tests/test_cli_speculative.py (the tokens, K = 3, forced acceptance 2) and the verify call's caches
# and states are the one-by-one decode steps' to the bit (test_verify_equals_one_by_one_latent_greedy)
@pytest.mark.parametrize("sample, n_tokens, drafts", [  # 7 tokens: the prefill's and 2 verify steps
    pytest.param({}, 7, 3, marks=[pytest.mark.slow, pytest.mark.exhaustive]),
    pytest.param(SAMPLED, 10, 3, marks=pytest.mark.slow),
    pytest.param({}, 32, 6, marks=pytest.mark.exhaustive)], ids=["greedy", "sampled", "greedy-32"])
def test_speculative_decoding_on_the_megakernel_is_lossless(mini_params, sample, n_tokens, drafts):
    """n_tokens x 2 rows through `speculative.speculative_generate` with the megakernel's verify
    (`as_verify`, K = drafts, forced acceptance K - 1 from plain decoding's own continuation; make
    test runs K = 3 for 2 and 3 verify steps, the exhaustive tier K = 6 for 32 tokens): the tokens
    and the final caches and states are those of plain decoding with the megakernel decode step,
    bit for bit — greedy, and sampled with the same seed (the targets drawn in the call by the
    decode step's rule)."""
    from mkresearch.decoding import drafters, speculative

    batch, prompt_len = 2, 8
    prompt = np.asarray(jax.random.randint(jax.random.key(3), (batch, prompt_len), 0,
                                           MINI.vocab_size))
    # plain decoding: the prompt on the reference (as speculative_generate), then the megakernel
    logits, plain_state = reference.prefill(mini_params, reference.init_state(MINI, batch),
                                            prompt, MINI)
    token = sampling.sample(logits[:, -1], seed=SEED, positions=np.full(batch, prompt_len),
                            **sample)
    plain = [np.asarray(token)]
    prepared = mk.prepare_weights(mini_params, MINI)  # once, not per step
    for i in range(n_tokens - 1 + drafts):  # drafts further: the forced drafter's oracle
        token, state, _ = mk.decode_step(prepared, copy_state(plain_state), plain[-1],
                                         np.full(batch, prompt_len + i, np.int32), MINI,
                                         seed=SEED, **sample)
        if i < n_tokens - 1:
            plain_state = state
        plain.append(np.asarray(token))
    plain = np.stack(plain, axis=1)
    drafter = drafters.get_drafter(f"forced:{drafts - 1}", oracle=np.concatenate([prompt, plain], axis=1))
    tokens, state, stats = speculative.speculative_generate(
        mini_params, reference.init_state(MINI, batch), prompt, n_tokens, MINI, k=drafts,
        drafter=drafter, seed=SEED, verify=mv.as_verify(), **sample)
    np.testing.assert_array_equal(np.asarray(tokens), plain[:, :n_tokens])
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(plain_state), strict=True):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                      np.asarray(want).view(np.uint8))
    # 1 token from the prefill, then K per verify step (K - 1 drafts accepted and the bonus)
    assert stats["steps"] == -(-(n_tokens - 1) // (drafts))
    print(f"{sample or 'greedy'}: {stats['steps']} verify steps, {stats['tokens_per_step']:.2f} "
          f"tokens per row and step; {n_tokens} x {batch} tokens and every state leaf equal")


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("layout_name, batch, drafts, accept, sampled", [
    ("expanded", 1, 1, 1, False), ("expanded", 1, 6, 3, False), ("expanded", 2, 3, 0, False),
    ("expanded", 2, 3, 3, True), ("latent", 1, 3, 1, True)])
def test_verify_matrix(race_checked, mini_params, layout_name, batch, drafts, accept, sampled):
    cfg = MINI.replace(mla_cache_layout=layout_name)
    run_case(cfg, mini_params, batch, drafts, accept, SAMPLED if sampled else {})


@pytest.mark.slow
def test_64_rows(race_checked):
    """The most rows one call takes: B = 8, K = 7 (activations [64, d], four 16-row tiles), on
    kimi-k3-mini cut to its first KDA + dense and MLA + MoE layers (every kind of layer, 2 of the
    7 layers' interpret-mode time; the whole mini runs B = 2 in the recorded case)."""
    cfg = kimi_kinds(MINI, mla_cache_layout="latent")
    run_case(cfg, weights.init_params(cfg, 0), 8, 7, 4, {})


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("name", ["deepseek-v3-mini", "qwen3-235b-a22b-mini"])
def test_other_families(race_checked, name):
    """MLA with RoPE (DeepSeek-V3: the MTP drafter's family) and GQA rows on a shared cache row."""
    cfg = config.get_config(name)
    run_case(cfg, weights.init_params(cfg, 0), 2, 3, 2, {})


# ---- compiling for TPU7x ---------------------------------------------------------------------
@pytest.mark.slow  # ~5 s: a Mosaic compile of the mini's verify step
def test_compiles_to_one_mosaic_kernel_mini():
    result, plan = mv.compile_verify(MINI, 2, 3, chip="tpu7x")
    print(f"kimi-k3-mini verify B=2 K=3: {result}; VMEM {plan.vmem.total_bytes / 2**20:.2f} MiB")
    assert result.n_mosaic_kernels == 1


@pytest.mark.slow
@pytest.mark.exhaustive  # make test compiles the same verify kernel at mini shapes (above)
def test_compiles_to_one_mosaic_kernel_rank():
    """One rank of Kimi K3 (the release's 32), B = 1, K = 6 (~45 s here); B = 8, K = 7 (64 rows)
    also compiles to one Mosaic kernel (VMEM plan 51.7 MiB) but takes ~3.5 min: not a test."""
    cfg = get_config("kimi-k3-rank")
    result, plan = mv.compile_verify(cfg, 1, 6, chip="tpu7x")
    print(f"kimi-k3-rank verify B=1 K=6: {result}; VMEM {plan.vmem.total_bytes / 2**20:.2f} MiB")
    assert result.n_mosaic_kernels == 1


# ---- bad input -------------------------------------------------------------------------------
def bad_call(params, batch, width, positions=None, cfg=MINI, **kwargs):
    state = jax.eval_shape(lambda: reference.init_state(MINI, batch))
    positions = np.zeros(batch, np.int32) if positions is None else positions
    return mv.verify_step(params, state, np.zeros((batch, width), np.int32), positions, cfg,
                          **kwargs)


@pytest.mark.parametrize("batch, width, match", [
    (1, 1, r"^K=0 is invalid: an int in \[1, 7\]"),
    (1, 9, r"^K=8 is invalid: an int in \[1, 7\]"),
    (9, 8, r"^rows=B\*\(K\+1\)=9\*8=72 is invalid: at most 64 verify rows"),
    (13, 5, r"^rows=B\*\(K\+1\)=13\*5=65 is invalid: at most 64"),
])
def test_bad_shapes(mini_params, batch, width, match):
    with pytest.raises(ValueError, match=match) as error:
        bad_call(mini_params, batch, width)
    assert "\n" not in str(error.value)


def test_bad_tokens_positions_and_sampling(mini_params):
    with pytest.raises(ValueError, match=r"^tokens has shape \(3,\): allowed \[B, K\+1\]"):
        mv.verify_step(mini_params, reference.init_state(MINI, 1), np.zeros(3, np.int32),
                       np.zeros(1, np.int32), MINI)
    with pytest.raises(ValueError, match=r"^positions=\[125\] is invalid: each in \[0, 125\)"):
        bad_call(mini_params, 1, 4, positions=np.array([125], np.int32))
    with pytest.raises(ValueError, match=r"^positions has shape \(2,\): allowed \(1,\)"):
        bad_call(mini_params, 1, 4, positions=np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"temperature"):
        bad_call(mini_params, 1, 4, temperature=0.0)
    with pytest.raises(ValueError, match=r"^cfg=.* is invalid"):
        bad_call(mini_params, 1, 4, cfg="kimi-k3-mini")


def test_state_of_another_batch(mini_params):
    state = jax.eval_shape(lambda: reference.init_state(MINI, 2))
    with pytest.raises(ValueError, match=r"state"):
        mv.verify_step(mini_params, state, np.zeros((1, 4), np.int32), np.zeros(1, np.int32),
                       MINI)


@pytest.mark.slow
def test_kind_without_verify_support_is_refused(monkeypatch):
    """A kind that keeps state but whose plan has no rows_per_state (its body runs one row per
    state row): refused, naming the field."""

    @dataclasses.dataclass(frozen=True)
    class OneRowPlan:
        batch: int

    stage = registry.kernel_stage("gqa")
    monkeypatch.setitem(registry._KERNELS, "gqa", dataclasses.replace(
        stage, plan=lambda cfg, batch, seq_len, options: OneRowPlan(batch)))
    cfg = config.get_config("qwen3-235b-a22b-mini")
    with pytest.raises(ValueError, match=r"^ModelConfig.attention='gqa' is invalid for a verify "
                                         r"step: layer kind 'gqa' keeps state"):
        mv.verify_plan(cfg, 1, 3, cfg.max_seq_len)
