"""Speculative decoding, the reference (issue 16): lossless against plain decoding (tokens, caches
and states, bit for bit), rollback, the acceptance rules' distributions, the drafters, bad input.

The model is kimi-k3-mini cut to two layers (KDA + dense FFN, then MLA + MoE, two attention-
residual blocks): every feature the verify and the rollback touch, at a third of the compile time.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuts import first_layers, kimi_kinds

from mkresearch.decoding import acceptance, drafters, speculative
from mkresearch.model import reference, roofline, sampling, weights
from mkresearch.model.config import get_config

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

SMALL = kimi_kinds(get_config("kimi-k3-mini"), max_seq_len=64)
# 17 tokens: 16 after the prefill's, so forced:2 ends on a cut step (5 of 3, then 1) and every
# k's runs take several verify steps (each a k + 1-step feed: the module's time)
PROMPT_LEN, N_TOKENS = 6, 17


def _prompt(cfg, batch, seed=1):
    return np.asarray(jax.random.randint(jax.random.PRNGKey(seed), (batch, PROMPT_LEN), 0,
                                         cfg.vocab_size, dtype=jnp.int32))


def _same_tree(a, b) -> bool:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(bool(jnp.array_equal(x, y)) for x, y in zip(leaves_a, leaves_b)))


class Plain:
    """Plain greedy decoding of one (layout, B): the tokens and end state to match, and the oracle
    (k tokens further) the forced drafter peeks at."""

    def __init__(self, cfg, batch):
        self.cfg, self.batch = cfg, batch
        self.params = weights.init_params(cfg, seed=0)
        self.prompt = _prompt(cfg, batch)
        self.tokens, self.state = reference.generate(self.params, self.fresh(), self.prompt,
                                                     N_TOKENS, cfg)
        longer, _ = reference.generate(self.params, self.fresh(), self.prompt,
                                       N_TOKENS + speculative.MAX_DRAFTS, cfg)
        self.oracle = np.concatenate([self.prompt, np.asarray(longer)], axis=1)

    def fresh(self):
        return reference.init_state(self.cfg, self.batch)

    def speculate(self, k, drafter, **kw):
        return speculative.speculative_generate(self.params, self.fresh(), self.prompt, N_TOKENS,
                                                self.cfg, k=k, drafter=drafter, **kw)


@pytest.fixture(scope="module")
def plain():
    """plain(layout, batch) -> one Plain per (layout, batch) for the whole module (each is one
    decode-step compile)."""
    runs = {}

    def get(layout, batch) -> Plain:
        if (layout, batch) not in runs:
            runs[layout, batch] = Plain(SMALL.replace(mla_cache_layout=layout), batch)
        return runs[layout, batch]

    return get


class RowwiseForced(drafters.Drafter):
    """Row b accepts (step + b) mod (k + 1) drafts: rows drift apart in position inside one verify
    call, and reach the end at different steps."""

    def __init__(self, oracle):
        self.oracle, self.step = oracle, 0

    def prepare(self, setup):
        self.forced = [drafters.ForcedDrafter(a, self.oracle) for a in range(setup.k + 1)]
        for forced in self.forced:
            forced.prepare(setup)

    def propose(self, history, lengths, k):
        rows = [self.forced[(self.step + b) % (k + 1)].propose(history, lengths, k)[b]
                for b in range(len(lengths))]
        self.step += 1
        return np.stack(rows)


def _check_lossless(run: Plain, k, drafter, accepted=None):
    tokens, state, stats = run.speculate(k, drafter)
    np.testing.assert_array_equal(tokens, run.tokens)
    assert _same_tree(state, run.state), "caches or states differ from plain decoding"
    if accepted is not None:  # forced: exactly A accepted on every step, on every row
        assert np.all(stats["accepted"] == accepted), stats["accepted"]
        assert stats["steps"] == -(-(N_TOKENS - 1) // (accepted + 1))
    return stats


# ---- lossless: greedy speculative == plain greedy, tokens and state ----------------------------
# (layout, B, k, forced acceptance lengths): A = 0 and A = k for every k, and one between
# (two compiles: expanded at B = 2, latent at B = 1; the slow test runs every combination)
FAST_CASES = [("expanded", 2, 1, (0, 1)), ("expanded", 2, 3, (0, 1, 3)),
              ("expanded", 2, 6, (0, 4, 6)), ("latent", 1, 1, (0, 1)), ("latent", 1, 3, (3,)),
              ("latent", 1, 6, (0, 2, 6))]
SLOW_LATENT = pytest.param("latent", marks=pytest.mark.slow)


@pytest.mark.slow
@pytest.mark.parametrize("layout, batch, k, accepts", FAST_CASES)
def test_greedy_forced_is_lossless(plain, layout, batch, k, accepts):
    run = plain(layout, batch)
    for accept in accepts:
        _check_lossless(run, k, drafters.ForcedDrafter(accept, run.oracle), accepted=accept)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("layout", ["expanded", "latent"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_forced_is_lossless_every_combination(plain, layout, batch, k):
    run = plain(layout, batch)
    for accept in sorted({0, 1, k // 2, k}):
        _check_lossless(run, k, drafters.ForcedDrafter(accept, run.oracle), accepted=accept)


@pytest.mark.parametrize("layout", ["expanded", SLOW_LATENT])
def test_rows_at_different_positions_and_ngram_are_lossless(plain, layout):
    run = plain(layout, 2)
    stats = _check_lossless(run, 3, RowwiseForced(run.oracle))
    accepted = stats["accepted"]
    assert np.any(accepted[:, 0] != accepted[:, 1])  # the rows did drift apart
    _check_lossless(run, 3, "ngram")


def test_forced_by_name_computes_its_oracle(plain):
    run = plain("latent", 1)
    stats = _check_lossless(run, 3, "forced:2", accepted=2)
    assert stats["tokens_per_step"] == pytest.approx(16 / 6)  # 5 steps of 3, one of 1
    assert stats["mean_accepted"] == 2 and stats["acceptance_rate"] == pytest.approx(2 / 3)


@pytest.mark.slow
def test_sampled_in_call_rule_emits_the_tokens_of_plain_sampled_decoding(plain):
    """For a one-hot q the rejection rule is "sample y_j ~ p_j, accept while y_j is the draft"; with
    the decode step's own sampler at positions p + j + 1 the tokens are those of plain sampled
    decoding with the same seed, token for token, and so is the end state."""
    run = plain("expanded", 2)
    settings = {"seed": 5, "temperature": 0.8, "top_p": 0.9}
    tokens, state = reference.generate(run.params, run.fresh(), run.prompt, N_TOKENS, run.cfg,
                                       **settings)
    longer, _ = reference.generate(run.params, run.fresh(), run.prompt, N_TOKENS + 3, run.cfg,
                                   **settings)
    oracle = np.concatenate([run.prompt, np.asarray(longer)], axis=1)
    got, got_state, stats = run.speculate(3, drafters.ForcedDrafter(2, oracle), **settings)
    np.testing.assert_array_equal(got, tokens)
    assert _same_tree(got_state, state)
    # the sampled continuation as drafts: accepted exactly where the in-call sample agrees
    assert np.all(stats["accepted"] == 2)


class MixtureDrafter(drafters.Drafter):
    """A stochastic drafter: q = half on the greedy oracle's next token, half uniform."""

    deterministic = False

    def __init__(self, oracle, vocab):
        self.oracle, self.vocab = oracle, vocab

    def propose_probs(self, history, lengths, k, key):
        follow = np.stack([self.oracle[b, n:n + k] for b, n in enumerate(lengths)])  # [B, k]
        q = 0.5 * jax.nn.one_hot(follow, self.vocab) + 0.5 / self.vocab  # [B, k, V]
        return np.asarray(jax.random.categorical(key, jnp.log(q), axis=-1)), q


@pytest.mark.slow
def test_stochastic_drafter_takes_the_rejection_rule_and_keeps_the_state_exact(plain):
    """Sampled with a non-one-hot q (`accept_sampled`): whatever is emitted, the end state is the
    state of decoding the emitted tokens one by one."""
    run = plain("expanded", 2)
    tokens, state, stats = run.speculate(3, MixtureDrafter(run.oracle, SMALL.vocab_size),
                                         temperature=1.0, seed=2)
    assert tokens.shape == (2, N_TOKENS) and stats["steps"] < N_TOKENS - 1  # some accepted
    consumed = np.concatenate([run.prompt, np.asarray(tokens)[:, :-1]], axis=1)
    _, expected = reference.prefill(run.params, run.fresh(), consumed, SMALL)
    assert _same_tree(state, expected)


# ---- rollback ----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["expanded", SLOW_LATENT])
def test_rollback_equals_decoding_the_kept_tokens(plain, layout):
    run = plain(layout, 2)
    start = np.array([PROMPT_LEN, PROMPT_LEN + 3], np.int32)  # the rows at different positions
    _, state = reference.prefill(run.params, run.fresh(), run.oracle[:, :PROMPT_LEN + 3], run.cfg)
    fed = np.stack([run.oracle[0, PROMPT_LEN:PROMPT_LEN + 5],
                    run.oracle[1, PROMPT_LEN + 3:PROMPT_LEN + 8]])  # [B, K + 1 = 5]
    _, state_row0 = reference.prefill(run.params, run.fresh(), run.oracle[:, :PROMPT_LEN],
                                      run.cfg)
    # a state where row 0 has consumed PROMPT_LEN tokens and row 1 PROMPT_LEN + 3
    state = speculative._select_rows(np.array([True, False]), state_row0, state)
    logits, state_all, per_position = speculative.verify_step(run.params, state, fed, start,
                                                              run.cfg)
    assert logits.shape == (2, 5, run.cfg.vocab_size)
    for kept in ([1, 5], [3, 2], [5, 1]):
        rolled = speculative.rollback(state_all, per_position, start, np.array(kept), run.cfg)
        expected = state
        for j in range(max(kept)):
            stepped = reference.decode_step(run.params, expected, fed[:, j], start + j, run.cfg)[1]
            expected = speculative._select_rows(np.array(kept) > j, stepped, expected)
        assert _same_tree(rolled, expected), kept


def test_per_position_bytes_of_kimi_k3():
    """Keeping every position's KDA state: per KDA layer and row, 96 x 128 x 128 f32 recurrent +
    3 x 3 x 96 x 128 bf16 conv per position; K = 6 keeps 7; 69 KDA layers per row."""
    cfg = get_config("kimi-k3")
    cost = speculative.per_position_bytes(cfg, 6)
    assert cost["per_layer_per_position"] == 96 * 128 * 128 * 4 + 3 * 3 * 96 * 128 * 2 == 6_512_640
    assert cost["per_layer"] == 7 * 6_512_640 == 45_588_480
    assert len(cfg.kda_layers) == 69 and cost["per_row"] == 69 * 45_588_480 == 3_145_605_120
    rank = get_config("kimi-k3-rank")  # one of the release's 32 ranks: 3 of the 96 heads
    assert 3 * (128 * 128 * 4 + 3 * 3 * 128 * 2) == 203_520
    assert speculative.per_position_bytes(rank, 6) == {
        "per_layer_per_position": 203_520, "per_layer": 7 * 203_520, "per_row": 69 * 7 * 203_520}
    assert speculative.per_position_bytes(get_config("deepseek-v3"), 3)["per_row"] == 0  # no KDA


# ---- acceptance: distributions -----------------------------------------------------------------
V, DRAWS = 16, 100_000


def _tables(seed):
    """p [1, 3, V] from the sampling transform (T 0.9, top-k 12) of random logits; a non-one-hot
    q [1, 2, V] and a one-hot one."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.standard_normal((1, 3, V)) * 1.5, jnp.float32)
    p = acceptance.target_probs(logits, temperature=0.9, top_k=12)
    q = jnp.asarray(rng.dirichlet(np.ones(V), size=(1, 2)), jnp.float32)
    return p, q


def _within_5_sigma(tokens, probs, what):
    """Each token's empirical frequency within 5 binomial standard deviations of its probability
    (plus 1 / n): a false alarm has probability < 16 x 6e-7 per check."""
    n = tokens.size
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=V) / n
    probs = np.asarray(probs, np.float64)
    bound = 5 * np.sqrt(probs * (1 - probs) / n) + 1 / n
    worst = np.max(np.abs(counts - probs) - bound)
    assert worst <= 0, f"{what}: a frequency is {worst:.2e} beyond its 5-sigma bound"


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.slow
def test_rejection_sampling_reproduces_the_target_distribution(one_hot):
    p, q = _tables(3)
    keys = jax.random.split(jax.random.key(0), DRAWS)
    if one_hot:  # a deterministic drafter: its drafts are fixed, q is one-hot on them
        drafts = jnp.broadcast_to(jnp.array([[int(jnp.argmax(p[0, 0])), 7]]), (DRAWS, 1, 2))
        q = jax.nn.one_hot(drafts, V)
    else:  # drafts drawn from q
        drafts = jax.vmap(lambda key: jax.random.categorical(key, jnp.log(q), axis=-1))(
            jax.random.split(jax.random.key(1), DRAWS))  # [DRAWS, 1, 2]
        q = jnp.broadcast_to(q, (DRAWS, *q.shape))
    n_accepted, next_token = jax.vmap(acceptance.accept_sampled, in_axes=(0, 0, None, 0))(
        drafts, q, p, keys)
    n_accepted, next_token, drafts = (np.asarray(a)[:, 0] for a in (n_accepted, next_token,
                                                                     drafts))
    first = np.where(n_accepted >= 1, drafts[:, 0], next_token)
    _within_5_sigma(first, p[0, 0], "first token")
    # given the first draft accepted, the second token (p_1 stands for p(. | d_1) here)
    took = n_accepted >= 1
    second = np.where(n_accepted[took] >= 2, drafts[took, 1], next_token[took])
    _within_5_sigma(second, p[0, 1], "second token after an accepted first")
    assert 0.05 < took.mean() < 0.95  # both branches are exercised


@pytest.mark.slow
def test_greedy_and_in_call_rules():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, V)), jnp.float32)
    best = np.asarray(jnp.argmax(logits, axis=-1))  # [2, 4]
    drafts = np.array([best[0, :3], [best[1, 0], (best[1, 1] + 1) % V, best[1, 2]]])
    n, nxt = acceptance.accept_greedy(drafts, logits)
    assert n.tolist() == [3, 1] and nxt.tolist() == [best[0, 3], best[1, 1]]
    n_call, next_call = acceptance.accept_in_call(drafts, logits, np.array([4, 9]), seed=0)
    assert n_call.tolist() == [3, 1] and next_call.tolist() == nxt.tolist()  # greedy: the same
    y = acceptance.in_call_tokens(logits, np.array([4, 9]), seed=7, temperature=1.0)
    for j in range(4):  # y_j is the decode step's sample at the position of the token it picks
        assert y[:, j].tolist() == sampling.sample(logits[:, j], seed=7,
                                                   positions=np.array([5, 10]) + j,
                                                   temperature=1.0).tolist()


# ---- drafters ----------------------------------------------------------------------------------
def test_ngram_lookup():
    assert drafters.ngram_lookup(np.array([1, 2, 3, 4, 1, 2, 3]), 3).tolist() == [4, 1, 2]
    assert drafters.ngram_lookup(np.array([5, 9, 1, 2, 8, 9]), 3).tolist() == [1, 2, 8]  # n = 1
    assert drafters.ngram_lookup(np.array([5, 6, 9, 7, 6]), 4).tolist() == [9, 7, 6, 6]  # padded
    assert drafters.ngram_lookup(np.array([5, 6, 7]), 2).tolist() == [7, 7]  # no match


@pytest.mark.slow
@pytest.mark.exhaustive  # test_cli_speculative decodes deepseek-v3-mini with mtp, lossless
def test_mtp_drafter_is_lossless_on_deepseek():
    cfg = first_layers(get_config("deepseek-v3-mini"), 2, max_seq_len=64)
    run = Plain(cfg, 2)
    stats = _check_lossless(run, 3, "mtp")
    assert stats["steps"] >= 1


def test_mtp_weights_are_counted_and_leave_the_step_unchanged():
    cfg = get_config("deepseek-v3-mini")
    mtp_params = weights.init_mtp_params(cfg)
    assert weights.n_values(mtp_params) == roofline.mtp_parameters(cfg) == 7_875_600
    shapes = weights.mtp_param_shapes(cfg)
    assert jax.tree.structure(shapes) == jax.tree.structure(mtp_params)
    assert "mtp" not in weights.param_shapes(cfg)  # the step's weights are as before
    with pytest.raises(ValueError, match="n_mtp_layers=0"):
        weights.init_mtp_params(SMALL)


# ---- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k, batch, drafter, message", [
    (0, 1, "ngram", r"k=0 is invalid: an int in \[1, 7\]"),
    (8, 1, "ngram", r"k=8 is invalid"),
    (True, 1, "ngram", r"k=True is invalid"),
    (7, 9, "ngram", r"9 x 8 = 72 rows is invalid: at most 64"),
    (3, 1, "eagle", r"drafter='eagle' is unknown: one of forced:A, ngram, mtp"),
    (3, 1, "forced:x", r"drafter='forced:x' is unknown"),
    (3, 1, "forced:4", r"drafter='forced:4' is invalid for k=3: forced:A with A in \[0, 3\]"),
    (3, 1, "mtp", r"drafter='mtp' is invalid for kimi-k3-mini-2l: it has n_mtp_layers=0"),
])
def test_bad_input_is_one_line(plain, k, batch, drafter, message):
    _raises_one_line(plain("expanded", 2), k, batch, drafter, message)


def test_a_prompt_token_past_the_vocabulary_is_one_line(plain):
    state = reference.init_state(SMALL, 1)
    prompt = np.full((1, PROMPT_LEN), SMALL.vocab_size, np.int32)
    with pytest.raises(ValueError, match=r"prompt\[0, 0\]=\d+ is invalid: token ids in") as error:
        speculative.speculative_generate(plain("expanded", 2).params, state, prompt, 4, SMALL, k=3,
                                         drafter="ngram")
    assert "\n" not in str(error.value)


def test_past_the_cache_is_one_line(plain):
    _raises_one_line(plain("expanded", 2), 3, 1, "ngram", r"n_tokens=60 is invalid with a prompt of 6 and k=3: the last "
                     r"verify reaches position 67, past the cache \(64 tokens\)", n_tokens=60)
def _raises_one_line(run, k, batch, drafter, message, n_tokens=4):
    state = reference.init_state(SMALL, batch)
    prompt = np.zeros((batch, PROMPT_LEN), np.int32)
    with pytest.raises(ValueError, match=message) as error:
        speculative.speculative_generate(run.params, state, prompt, n_tokens, SMALL, k=k,
                                         drafter=drafter)
    assert "\n" not in str(error.value)


def test_verify_bad_input(plain):
    run = plain("expanded", 2)
    for tokens, message in ((np.zeros(2), r"tokens has shape \(2,\): allowed \[B, K \+ 1\]"),
                            (np.zeros((2, 9)), r"k=8 is invalid: an int in \[1, 7\]")):
        with pytest.raises(ValueError, match=message):
            speculative.verify_step(run.params, run.fresh(), tokens.astype(np.int32), [0, 0],
                                    SMALL)
    with pytest.raises(ValueError, match=r"positions \+ K = \[4, 64\] is invalid: ints in "
                                         r"\[0, 64\)"):
        speculative.verify_step(run.params, run.fresh(), np.zeros((2, 5), np.int32), [0, 60],
                                SMALL)
    with pytest.raises(ValueError, match=r"kept=\[1, 0\] is invalid"):
        speculative.rollback(run.fresh(), {"hidden": jnp.zeros((5, 2, 4))}, [0, 0], [1, 0],
                             SMALL)
    assert dataclasses.is_dataclass(drafters.DraftSetup)
