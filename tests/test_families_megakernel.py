"""The megakernel on the other families' minis (DeepSeek-V3, GLM-4.5, Qwen3-235B: docs/families.md)
against the reference, in TPU interpret mode with the race detector on; its bytes against the
minimum; one pallas_call per step; its TPU7x compiles.

Like tests/test_megakernel.py, every step is teacher-forced on the reference's token and starts
from the reference's state (one near-tie cannot derail the steps after it). Per row-step: logits
within LOGIT_TOL = 5e-2 of `reference.decode_step`'s, greedy tokens equal except at near-ties (a
reference top-2 gap under NEAR_TIE_GAP = 0.1: only there can two logit vectors that agree within
LOGIT_TOL pick different tokens; reported, and asserted to be the only token differences), and
every cache leaf after the step within a relative error of STATE_REL_TOL of the reference's
(`assert_states_match`; the row-steps and steps that are bit-equal are counted and reported).
A row-step over LOGIT_TOL passes only where the reference routed at a near-tie: in some MoE layer
its k-th and (k+1)-th selection scores lie within ROUTER_TIE of each other, so bf16 rounding of
the layer's input can pick another expert in the kernel (`routing_margins`; seen on
qwen3-235b-a22b-mini at B = 1, step 13 of 16, before the reference took the GQA kernel's
products: a margin of 7.7e-5, logits 0.30 apart). Such a row-step is reported and its row's token
and state left out of that step's checks; the next step starts from the reference's state again.
Measured here since the reference sums GQA's scores and values as the kernel does
(`mkresearch.model.stages.gqa`): every row-step of the three minis is bit-equal to the reference,
caches too (printed with -s; in the exhaustive tier 16 at B = 1 and 64 at B = 4 each; before,
GLM's 15 and 60, Qwen's 14 and 59).
The reference runs once per mini, at B = 4 (`reference_runs`); the B = 1 run reads its row 0,
which is the reference at B = 1 bit for bit (its step is batch-invariant: tests/test_families.py),
so no second reference compile.
"""

import os

# libtpu allows one process at a time by default; tests on a shared machine compile concurrently
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mkresearch.kernels.base import dma
from mkresearch.kernels.compose import megakernel as mk
from tiers import EXHAUSTIVE

from mkresearch.cli import bench
from mkresearch.measurement.hlo import jaxpr_primitives
from mkresearch.measurement.logs import hbm_bytes, minimum_step_bytes
from mkresearch.model import config, partition, reference, sampling, weights
from mkresearch.model.config import get_config
from mkresearch.prediction import timeline

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

MINIS = ("deepseek-v3-mini", "glm-4.5-mini", "qwen3-235b-a22b-mini")
# Prefilled by the reference, then N_STEPS teacher-forced steps from position 27: make test runs 6
# (27..32: the KV tile boundary at 32 is crossed); every step starts from the reference's state, so
# more steps run the same code at more positions: the exhaustive tier runs 16 (27..42).
N_STEPS = 16 if EXHAUSTIVE else 6
PROMPT_LEN = 28
LOGIT_TOL = 5e-2  # docs/kimi-k3.md §11, asserted for every row-step
NEAR_TIE_GAP = 2 * LOGIT_TOL
# a router's selection scores this close (sigmoid or softmax, in [0, 1]) are a tie to within the
# float error of its bf16 input; the margins of the reference's routings here are ~4e-3 and up
ROUTER_TIE = 1e-3
BYTES_SLACK = 1.02
STATE_REL_TOL = 2.0 ** -7


@pytest.fixture(scope="module")
def mini_params():
    """Each mini's parameters, made once for the module."""
    return {name: weights.init_params(config.get_config(name), 0) for name in MINIS}


# the reference step jitted once per shape, shared with reference.prefill (no second compile)
_reference_step = reference.decode_step_jit
REFERENCE_BATCH = 4  # the reference runs at B = 4 once per mini; the B = 1 run reads its row 0


def prefilled(cfg, params, batch, length, seed=0):
    """Reference state after teacher-forcing a random prompt, and the prompt's last tokens."""
    prompt = jax.random.randint(jax.random.key(seed), (batch, length), 0, cfg.vocab_size)
    _, state = reference.prefill(params, reference.init_state(cfg, batch), prompt[:, :-1], cfg)
    return state, prompt[:, -1]


def reference_trajectory(cfg, params, batch, n_steps):
    """n_steps of the reference after a prefilled random prompt, each fed the previous step's
    greedy tokens: per step its inputs (state, tokens, positions) and outputs (logits, next state,
    routing, greedy tokens)."""
    state, tokens = prefilled(cfg, params, batch, PROMPT_LEN)
    positions = np.full(batch, PROMPT_LEN - 1, np.int32)
    steps = []
    for _ in range(n_steps):
        logits, next_state, aux = _reference_step(params, state, jnp.asarray(tokens),
                                                  jnp.asarray(positions), cfg=cfg)
        greedy = np.asarray(sampling.sample(logits, seed=0, positions=positions + 1))
        steps.append({"state": state, "tokens": np.asarray(tokens), "positions": positions,
                      "logits": logits, "next_state": next_state, "greedy": greedy,
                      "expert_ids": np.asarray(aux["expert_ids"])})  # [n_routed_layers, B, k]
        state, tokens, positions = next_state, greedy, positions + 1
    return steps


@pytest.fixture(scope="module")
def reference_runs(mini_params):
    """name -> the mini's reference trajectory at REFERENCE_BATCH, made once for the module."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = reference_trajectory(config.get_config(name), mini_params[name],
                                              REFERENCE_BATCH, N_STEPS)
        return made[name]
    return get


def first_rows(step, batch):
    """A reference step's first `batch` rows: the reference at that batch, bit for bit (its step
    is batch-invariant: tests/test_families.py, tests/test_batch_invariance.py)."""
    def rows(tree):  # state leaves [n_layers_of_kind, B, ...]
        return jax.tree.map(lambda leaf: leaf[:, :batch], tree)
    return {"state": rows(step["state"]), "next_state": rows(step["next_state"]),
            "tokens": step["tokens"][:batch], "positions": step["positions"][:batch],
            "logits": step["logits"][:batch], "greedy": step["greedy"][:batch],
            "expert_ids": step["expert_ids"][:, :batch]}


def run_steps(cfg, params, batch, trajectory):
    """The megakernel on each step of the reference's trajectory (its first `batch` rows), from
    the reference's state and tokens, checked as the module docstring says. Returns a summary:
    near-ties [(step, row, top-2 gap, tokens differ)], the max |logit difference| over all
    row-steps, the row-steps whose logits are bit-equal, the last step's DMA log with its
    positions and routing, and interpret-mode seconds per megakernel step."""
    prepared = mk.prepare_weights(params, cfg)
    near_ties, worst, bit_equal, states_equal, seconds = [], 0.0, 0, 0, []
    tied_rows = []  # (step, row, routing margin): over LOGIT_TOL at a routing near-tie
    for step, ref in enumerate(first_rows(each, batch) for each in trajectory):
        logits, positions, ref_tokens = ref["logits"], ref["positions"], ref["greedy"]
        started = time.perf_counter()
        with dma.recording() as log:  # every step: the last one's log is kept for the bytes
            mk_tokens, mk_state, aux = mk.decode_step(
                prepared, jax.tree.map(jnp.copy, ref["state"]), jnp.asarray(ref["tokens"]),
                positions, cfg, return_logits=True,
                expert_ids=ref["expert_ids"])  # the routing a log on a TPU is given
            jax.block_until_ready(mk_tokens)
        seconds.append(time.perf_counter() - started)
        diff = np.asarray(jnp.max(jnp.abs(aux["logits"] - logits), axis=-1))  # [B]
        bit_equal += int(np.sum(np.all(np.asarray(aux["logits"]) == np.asarray(logits), -1)))
        over = np.flatnonzero(diff > LOGIT_TOL)
        margins = routing_margins(cfg, params, ref) if over.size else np.ones(batch)  # [B]
        assert np.all(margins[over] < ROUTER_TIE), (
            f"{cfg.name} step {step}: logits differ by {diff.max():.4g} > {LOGIT_TOL} in rows "
            f"{over.tolist()}, whose routing margins {margins[over].tolist()} are no tie")
        tied_rows += [(step, int(row), float(margins[row])) for row in over]
        kept = np.setdiff1d(np.arange(batch), over)
        worst = max(worst, float(diff[kept].max(initial=0)))
        equal = assert_states_match(rows_of(mk_state, kept), rows_of(ref["next_state"], kept),
                                    f"{cfg.name} step {step}")  # the rows not at a routing tie
        states_equal += equal and not over.size
        rows = bench.near_tie_rows(logits, mk_tokens, NEAR_TIE_GAP)  # (row, top-2 gap, differs)
        near_ties += [(step, row, round(gap, 4), differs) for row, gap, differs in rows]
        differing = [gap for row, gap, differs in rows if differs and row not in over]
        assert all(gap < NEAR_TIE_GAP for gap in differing), (
            f"{cfg.name} step {step}: tokens {np.asarray(mk_tokens).tolist()} != reference "
            f"{ref_tokens.tolist()} off near-ties {rows}")
        last = {"log": log, "positions": positions, "expert_ids": ref["expert_ids"]}
    return {"near_ties": near_ties, "worst": worst, "bit_equal": bit_equal,
            "states_equal": states_equal, "tied_rows": tied_rows,
            "row_steps": batch * len(trajectory), "last": last,
            "step_s": float(np.median(seconds[1:] or seconds))}


def rows_of(state, rows):
    """The state's leaves [n_layers_of_kind, B, ...] at rows."""
    return jax.tree.map(lambda leaf: leaf[:, rows], state)


def routing_margins(cfg, params, ref):
    """Per row [B]: the smallest gap, over the MoE layers of the reference's step `ref`, between
    the k-th and (k+1)-th selection scores of its router (the reference re-run op by op, its
    router watched)."""
    from mkresearch.model.stages import ffn, moe_full

    gaps = []

    def route(p, x, cfg):
        selection = ffn.router_scores(p, x, cfg)[1]  # what `ffn.route` selects from
        ranked = -np.sort(-np.asarray(selection, np.float32), axis=-1)  # [B, E] descending
        gaps.append(ranked[:, cfg.top_k - 1] - ranked[:, cfg.top_k])
        return real_route(p, x, cfg)

    real_route = ffn.route
    with mock.patch.object(ffn, "route", route), mock.patch.object(moe_full, "route", route), \
            jax.disable_jit():
        reference.decode_step_unchecked(params, ref["state"], jnp.asarray(ref["tokens"]),
                                        jnp.asarray(ref["positions"]), cfg)
    assert gaps, f"{cfg.name}: no router ran"
    return np.min(gaps, axis=0)


def assert_states_match(actual, expected, what):
    """Every cache leaf within a relative (Frobenius) error of STATE_REL_TOL of the reference's;
    returns whether all are bit-equal. A layer's input can differ from the reference's by a bf16
    ulp now and then (XLA:CPU sums a [B, K] @ [K, N] row in its own order; the kernel in its), and
    the next layers carry that into a few cache entries: so equality is reported, the bound
    asserted (as tests/test_megakernel.py does for Kimi K3)."""
    equal = True
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)  # a TPU array may come strided
        if np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            continue
        equal = False
        a, b = a.astype(np.float32), b.astype(np.float32)
        error = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert error <= STATE_REL_TOL, (f"{what} state{jax.tree_util.keystr(path)}: relative "
                                        f"error {error:.3g} > {STATE_REL_TOL}")
    return equal


def check_bytes(cfg, batch, last):
    """The last step's HBM bytes (DMA log) within BYTES_SLACK of the minimum for its positions
    and routing (`logs.minimum_step_bytes`); returns the ratio."""
    moved = hbm_bytes(last["log"])
    minimum = minimum_step_bytes(cfg, batch, last["positions"], last["expert_ids"])
    ratio = moved / minimum.total
    print(f"{cfg.name} B={batch} step bytes: {moved:,d} DMA'd vs {minimum} ({ratio:.4f}x)")
    assert minimum.total <= moved <= BYTES_SLACK * minimum.total
    return ratio


def report(cfg, batch, result):
    differ = [(step, row, gap) for step, row, gap, changed in result["near_ties"] if changed]
    print(f"{cfg.name} B={batch}, {N_STEPS} steps: max |logit diff| vs the reference "
          f"{result['worst']:.3g} (<= {LOGIT_TOL} asserted), {result['bit_equal']} of "
          f"{result['row_steps']} row-steps bit-equal; caches bit-equal after "
          f"{result['states_equal']} of {N_STEPS} steps; "
          f"{len(result['near_ties'])} near-tie row-steps (top-2 gap < {NEAR_TIE_GAP}), tokens "
          f"differ at {len(differ)} of them {differ}: "
          f"{[(step, row, gap) for step, row, gap, _ in result['near_ties']]}; "
          f"{result['step_s']:.2f} s per interpret-mode step; over {LOGIT_TOL} at a routing "
          f"near-tie (step, row, margin < {ROUTER_TIE}): {result['tied_rows']}")


# ---- greedy steps at B = 1 and B = 4 across the KV tile boundary, and the bytes of the last -------
@pytest.mark.slow
@pytest.mark.parametrize("name", [  # GLM's steps and bytes run at B = 4 below (B = 1: exhaustive)
    name if name != "glm-4.5-mini" else pytest.param(name, marks=pytest.mark.exhaustive)
    for name in MINIS])
def test_greedy_steps_batch_1_and_bytes(race_checked, mini_params, reference_runs, name):
    """B = 1, and the last step scaled to one rank of the full model (`bench.scale_to_rank`): it
    moves within BYTES_SLACK of that rank's minimum too, layer by layer along the rank's layers,
    and the timeline model predicts its TPU7x step."""
    cfg = config.get_config(name)
    result = run_steps(cfg, mini_params[name], 1, reference_runs(name))
    report(cfg, 1, result)
    check_bytes(cfg, 1, result["last"])
    rank, scaled, unique = bench.scale_to_rank(result["last"]["log"], cfg, 1)
    assert rank.name == name.replace("-mini", "-rank") and unique == pytest.approx(1)  # 8 of 256
    first = [dict(e.indices)["layer"] for e in scaled if e.kind == "dma_start"
             and e.name == "attn_norm"]  # the pre-norm residual's first load of each layer
    assert first == list(range(rank.n_layers))
    moved = sum(e.nbytes for e in scaled if e.kind == "dma_start" and "hbm" in (e.src, e.dst))
    one_expert = np.zeros((len(rank.layers_of("moe_full")), 1, 1), np.int32)
    minimum = minimum_step_bytes(rank, 1, result["last"]["positions"], one_expert)
    predicted = timeline.simulate(scaled, "tpu7x")
    print(f"scaled to {rank.name}: {moved:,d} B vs its {minimum} ({moved / minimum.total:.4f}x); "
          f"{predicted.total_s * 1e3:.2f} ms predicted on tpu7x, "
          f"{predicted.roofline_fraction:.0%} of the HBM roofline")
    assert minimum.total <= moved <= BYTES_SLACK * minimum.total
    assert 0 < predicted.roofline_fraction <= 1


@pytest.mark.slow
@pytest.mark.parametrize("name", [  # B = 1 runs every family; B = 4 one (the others: exhaustive)
    pytest.param("deepseek-v3-mini", marks=pytest.mark.exhaustive), "glm-4.5-mini",
    pytest.param("qwen3-235b-a22b-mini", marks=pytest.mark.exhaustive)])
def test_greedy_steps_batch_4_and_bytes(race_checked, mini_params, reference_runs, name):
    cfg = config.get_config(name)
    result = run_steps(cfg, mini_params[name], 4, reference_runs(name))
    report(cfg, 4, result)
    check_bytes(cfg, 4, result["last"])


# ---- one pallas_call per step --------------------------------------------------------------------
@pytest.mark.parametrize("name", MINIS)
@pytest.mark.parametrize("batch", [1, 4])
def test_one_pallas_call_per_step(name, batch):
    cfg = config.get_config(name)
    plan = mk.make_plan(cfg, batch, cfg.max_seq_len)
    closed = jax.make_jaxpr(mk.step_fn(plan))(*mk.step_shapes(plan))
    assert list(jaxpr_primitives(closed)).count("pallas_call") == 1


# ---- compiling for TPU7x -------------------------------------------------------------------------
# One rank of each full model: DeepSeek-V3's and GLM-4.5's compile for 20-25 s on 2 cores, so
# their results are the records of `make recorded` (notebook 10 shows them), which
# tests/test_recorded.py holds to the current plan (1 Mosaic kernel each; a changed plan fails
# there until recompiled). Qwen3's rank compiles in ~3 s: compiled here too.
RANK_COMPILES = ["qwen3-235b-a22b-rank"]


@pytest.mark.parametrize("name", [*MINIS, *RANK_COMPILES])
@pytest.mark.slow
def test_compiles_to_one_mosaic_kernel(name):
    """Each mini, and Qwen3's rank (`partition.rank_config`) with its whole context: one Mosaic
    kernel per step, its VMEM plan within the chip's."""
    result, plan = mk.compile_step(get_config(name), 1, chip="tpu7x")
    print(f"{name}: {result}; VMEM plan {plan.vmem.total_bytes / 2**20:.2f} MiB")
    assert result.n_mosaic_kernels == 1 and plan.vmem.fits()


# ---- one rank's shapes and the minimum bytes, by hand --------------------------------------------
def test_each_rank_divides_as_the_release_divides_kimi():
    """The families' ranks (from their kinds' rules, `partition.rank_config`) by hand: heads /
    32, GQA's one K/V head, experts / 8 x hidden / 4, shared, dense and vocab / 32 padded to 128;
    a rank count that does not split a field is refused, naming it."""
    expected = {  # n_heads, n_kv_heads, vocab, experts, expert hidden, shared, dense
        "deepseek-v3-rank": (128 // 32, 1, 4096, 256 // 8, 2048 // 4, 128, 640),  # 4040, 64, 576
        "glm-4.5-rank": (96 // 32, 1, 151552 // 32, 160 // 8, 1536 // 4, 128, 12288 // 32),
        "qwen3-235b-a22b-rank": (64 // 32, 1, 4864, 128 // 8, 1536 // 4, 128, 1152)}  # 4748
    for name, values in expected.items():
        rank = get_config(name)
        assert (rank.n_heads, rank.n_kv_heads, rank.vocab_size, rank.n_experts, rank.expert_hidden,
                rank.shared_hidden, rank.dense_hidden) == values, name
        full = config.get_config(name.removesuffix("-rank"))
        assert rank.replace(**{f: getattr(full, f) for f in (
            "name", "n_heads", "n_kv_heads", "vocab_size", "n_experts", "expert_hidden",
            "shared_hidden", "dense_hidden")}) == full  # nothing else changes
    with pytest.raises(ValueError, match=r"n_ranks=32 is invalid for qwen3-235b-a22b: it must "
                                         r"divide n_heads=48"):
        partition.rank_config(config.get_config("qwen3-235b-a22b", n_heads=48, n_kv_heads=4))
    with pytest.raises(ValueError, match=r"n_kv_heads=24 must split evenly over the 32 head "
                                         r"slices"):  # 3 query heads per rank span two K/V heads
        partition.rank_config(config.get_config("glm-4.5", n_kv_heads=24))


@pytest.mark.parametrize("name, per_token", [
    ("glm-4.5-mini", 2 * 2 * 128 * 2),  # K and V of 2 K/V heads x head_dim 128, bf16
    ("deepseek-v3-mini", (256 + 64) * 2),  # ĉ (kv_rank) + the rope key, bf16
    ("qwen3-235b-a22b-mini", 2 * 1 * 128 * 2)])
def test_minimum_bytes_of_each_cache_kind(name, per_token):
    """minimum_step_bytes over the registry: every weight once but the routed experts and the
    embedding, each unique expert once, the cached tokens in whole 16-row tiles per layer, one new
    KV entry per row and layer, no recurrent state."""
    cfg = config.get_config(name)
    positions, layers = np.array([0, 17, 33]), cfg.n_layers
    expert_ids = np.zeros((len(cfg.layers_of("moe_full")), 3, cfg.top_k), np.int32)
    expert_ids[0, 1] = np.arange(cfg.top_k)  # layer 0: top_k distinct experts, 1 elsewhere
    minimum = minimum_step_bytes(cfg, 3, positions, expert_ids)
    params = weights.param_shapes(cfg)
    routed = sum(leaf.size * leaf.dtype.itemsize
                 for leaf in jax.tree.leaves(params["moe_full"]["experts"]))
    everything = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    assert minimum.weights == everything - routed - params["embed"].size * 2
    assert minimum.embedding_rows == 3 * cfg.d_model * 2
    n_unique = cfg.top_k + len(cfg.layers_of("moe_full")) - 1
    assert minimum.routed_experts == n_unique * routed // (cfg.n_experts * expert_ids.shape[0])
    assert minimum.kv_tiles == (0 + 32 + 48) * layers * per_token
    assert minimum.kv_entries == 3 * layers * per_token and minimum.recurrent_state == 0
