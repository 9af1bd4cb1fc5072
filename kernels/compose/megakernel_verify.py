"""Speculative decoding's verify step: ONE megakernel `pallas_call` scores, for each of B batch
rows, its last accepted token and K draft tokens (K in 1..7), causally, against the cache.

    tokens [B, K+1]  (b, 0) the last accepted token at position p_b, (b, j) the j-th draft at p_b + j
    rows   R = B (K + 1) <= 64 verify rows, row r = b (K + 1) + j: the activation block [R, d]
    per layer: the stage bodies of the decode step (`kernels/compose/megakernel.py`), run on R rows with
           plan.rows_per_state = K + 1: row r uses the cache and recurrent state of batch row
           r // (K + 1) and its own position. Every weight is read ONCE for all R rows (one pass
           of the global ring; the MoE routes R rows and fetches the union of their experts).
      MLA  rows run in order; each writes its cache entry (position p_b + j) before the next row
           attends, and a row attends to the cache up to its own position (length masking):
           causal within the batch row. All K + 1 entries are written. (MLA with RoPE and GQA,
           the other families' caches, the same way.)
      KDA  rows run in order on the shared state row: the conv window and the recurrent state
           advance token by token inside the call.
    head   targets[b, j] = the token the decode step would emit after token (b, j): the greedy
           argmax, or the sample of `sampling.sample` keyed (seed, b, p_b + j + 1) — the decode
           step's seed rule, so a row's j-th target is what plain decoding would draw there.

For a deterministic drafter this IS the standard rejection-sampling rule: accept draft j + 1
while it equals targets[b, j]; the bonus token, targets[b, n_accepted], is drawn in the same
call. `n_accepted` [B] (leading j with tokens[b, j + 1] == targets[b, j]) is computed by the
wrapper from the targets (a [B, K] compare outside the kernel).

Rollback: per-position states are KEPT, written to HBM as outputs (not recomputed): after each
row the body DMAs its batch row's KDA conv and recurrent states to `per_position[kind][leaf]`
[K+1, n_layers, B, ...] at [j, layer, b]
(`kda.kda_attention_body`, refs.steps_out). Bytes per KDA layer per verify row
(`per_position_bytes`): the recurrent state H·D·D·4 + the conv state (conv-1)·3·H·D·2. Kimi K3
at full size (H = 96, D = 128, conv 4): 6,291,456 + 221,184 = 6,512,640 B (6.2 MiB), x 69 KDA
layers = 449 MB per verify row; one of the release's 32 ranks (3 heads): 203,520 B per layer,
14.0 MB per verify row (98 MB for B = 1, K = 6), written once each, never read in the call.
`state_all` is the state after all K + 1 tokens (caches with all K + 1
entries written); the rollback (`mkresearch.decoding.speculative`) takes per_position[n_kept - 1] and
clears the cache entries of rejected tokens. `schedule.schedule(plan, positions [R], expert_ids)`
states a verify step's DMAs too (the KDA rows' state copies, the MLA rows' shared cache row).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mkresearch.kernels.base import chip_log, dma, input_checks
from mkresearch.kernels.compose import megakernel as mk
from mkresearch.kernels.compose.megakernel_plan import (
    MAX_VERIFY_ROWS,
    MegakernelOptions,
    MegaPlan,
    make_plan,
)

from mkresearch.decoding import speculative
from mkresearch.hardware import tpu
from mkresearch.model import reference, spec
from mkresearch.model.config import ModelConfig

MAX_DRAFTS = speculative.MAX_DRAFTS  # K: draft tokens per batch row (the reference's limit)


def check_tokens(tokens: Any, positions: Any, cfg: ModelConfig, seq_len: int) -> tuple[int, int]:
    """ValueError naming the parameter for bad tokens / positions; returns (B, K)."""
    shape = np.shape(tokens)
    if len(shape) != 2 or shape[0] < 1:
        raise ValueError(f"tokens has shape {shape}: allowed [B, K+1] (the last accepted token, "
                         "then K drafts)")
    batch, drafts = shape[0], shape[1] - 1
    if not 1 <= drafts <= MAX_DRAFTS:
        raise ValueError(f"K={drafts} is invalid: an int in [1, {MAX_DRAFTS}] (tokens [B, K+1] "
                         f"has shape {shape})")
    if batch * (drafts + 1) > MAX_VERIFY_ROWS:
        raise ValueError(f"rows=B*(K+1)={batch}*{drafts + 1}={batch * (drafts + 1)} is invalid: "
                         f"at most {MAX_VERIFY_ROWS} verify rows per call (fewer rows or drafts)")
    if np.shape(positions) != (batch,):
        raise ValueError(f"positions has shape {np.shape(positions)}: allowed ({batch},)")
    input_checks.check_each_in("positions", positions, seq_len - drafts,
                               f" — the K+1={drafts + 1} tokens of a row fill positions p..p+K "
                               f"of a cache of {seq_len}")
    reference.check_token_ids("tokens", tokens, cfg)
    return batch, drafts


def verify_plan(cfg: ModelConfig, batch: int, drafts: int, seq_len: int,
                options: MegakernelOptions = MegakernelOptions()) -> MegaPlan:  # noqa: B008
    """The plan of a verify step: R = B (K + 1) rows, K + 1 per state row."""
    return make_plan(cfg, batch * (drafts + 1), seq_len, options, rows_per_state=drafts + 1)


def n_accepted(tokens: Any, targets: Any) -> jax.Array:
    """[B] i32: the leading drafts equal to the target before them (tokens[b, j+1] ==
    targets[b, j] for j < n): the drafts a greedy / rejection-sampling verifier keeps."""
    matches = jnp.asarray(tokens)[:, 1:] == jnp.asarray(targets)[:, :-1]  # [B, K]
    return jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=1), axis=1)


def verify_step(params: dict, state: dict, tokens: Any, positions: Any, cfg: ModelConfig, *,
                seed: int = 0, temperature: Any = None, top_k: Any = 0, top_p: Any = 1.0,
                options: MegakernelOptions = MegakernelOptions(),  # noqa: B008 - frozen
                return_logits: bool = False,
                expert_ids: Any = None) -> tuple[jax.Array, dict, dict, dict]:
    """Score tokens [B, K+1] (last accepted, then K drafts) at positions [B] (of tokens[:, 0])
    in ONE pallas_call -> (targets [B, K+1] i32, state_all, per_position, aux).

    targets[b, j]: the token the decode step (`megakernel.decode_step`, same seed and sampling
    arguments, per batch row as there) would emit after token j at position p_b + j.
    state_all: the state after all K + 1 tokens (donated, updated in place); per_position
    {kind: {leaf: [K+1, n_layers, B, ...]}}: every non-cache state leaf after each token.
    aux: "n_accepted" [B] i32, "nucleus_overflow" [B, K+1] bool, "plan", and "logits"
    [B, K+1, V] f32 when return_logits (checking only).
    expert_ids [n_routed_layers, B (K+1), k]: the routing a step recorded on a TPU logs (its
    log is the kernel run on shapes, `chip_log`); None: the reference's (`verify_routing`),
    which needs the parameters, not `prepare_weights`' output. Unused elsewhere.
    """
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg={cfg!r} is invalid: a mkresearch.model.config.ModelConfig")  # noqa: TRY004
    batch = np.shape(tokens)[0] if np.ndim(tokens) == 2 else 0
    seq_len = reference.check_state(state, cfg, batch) if batch else 0
    batch, drafts = check_tokens(tokens, positions, cfg, seq_len)
    width = drafts + 1
    plan = verify_plan(cfg, batch, drafts, seq_len, options)
    # row r = b (K + 1) + j: batch row b's token j at position p_b + j
    rows = (jnp.asarray(positions, jnp.int32)[:, None] + jnp.arange(width, dtype=jnp.int32))
    inputs, use_gumbel, use_candidates = mk.step_inputs(
        plan, jnp.asarray(tokens, jnp.int32).reshape(-1), rows.reshape(-1), seed, temperature,
        top_k, top_p)
    given = None
    if dma.logs_from_shapes():  # before the step, which donates the state
        if expert_ids is None and cfg.n_experts:
            expert_ids = verify_routing(params, state, tokens, positions, cfg)
        given = mk.log_routing(plan, params, state, None, None, expert_ids)
    targets, overflow, logits, state_all, per_position = chip_log.run(
        lambda *args: mk.call_step(plan, tpu.interpret_params(), dma.is_recording(), use_gumbel,
                                   use_candidates, bool(return_logits), *args),
        inputs, mk.prepare_weights(params, cfg), state, given=given)
    targets = targets.reshape(batch, width)
    aux = {"n_accepted": n_accepted(tokens, targets),
           "nucleus_overflow": overflow.reshape(batch, width), "plan": plan}
    if return_logits:
        aux["logits"] = logits.reshape(batch, width, cfg.vocab_size)
    return targets, state_all, per_position, aux


def verify_routing(params: dict, state: dict, tokens: Any, positions: Any,
                   cfg: ModelConfig) -> np.ndarray:
    """The reference's routing of each verify row, [n_routed_layers, B (K+1), k] (row b (K+1) +
    j: token j of row b at position p_b + j), `mk.routing_of_rows` over `reference.decode_step`.
    ValueError for prepared weights."""
    mk.check_routable(params, "a verify step", "B (K+1)")

    def route_step(state, tokens, positions):
        _, state, aux = reference.decode_step(params, state, tokens, positions, cfg)
        return state, aux["expert_ids"]

    return mk.routing_of_rows(route_step, state, tokens, positions)


def as_verify(options: MegakernelOptions = MegakernelOptions()):  # noqa: B008 - frozen
    """`verify_step` as the verify of `speculative.speculative_generate` (its samples_in_call
    contract): (params, state, tokens, positions, cfg, *, seed, temperature, top_k, top_p) ->
    (None, state_all, per_position, targets). The targets are drawn in the call, so no logits
    leave the kernel; the state is copied first (the call donates it, and the loop still reads
    the old state's rows of finished sequences)."""
    def verify(params, state, tokens, positions, cfg, *, seed=0, temperature=None, top_k=0,
               top_p=1.0):
        targets, state_all, per_position, _ = verify_step(
            params, jax.tree.map(jnp.copy, state), tokens, positions, cfg, seed=seed,
            temperature=temperature, top_k=top_k, top_p=top_p, options=options)
        return None, state_all, per_position, targets

    verify.samples_in_call = True
    return verify


# ---- compiling for a TPU on this machine -------------------------------------------------------
def compile_verify(cfg: ModelConfig, batch: int, drafts: int, *, chip: str = "tpu7x",
                   seq_len: int | None = None):
    """Compile one greedy verify step for `chip` from shapes only -> (CompileResult, plan)."""
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    plan = verify_plan(cfg, batch, drafts, seq_len, MegakernelOptions(chip=chip))
    return tpu.compile_for(mk.step_fn(plan), *mk.step_shapes(plan), chip=chip), plan


def per_position_bytes(cfg: ModelConfig) -> dict[str, int]:
    """Bytes of each non-cache state leaf for one layer and one row (what a verify row writes
    per layer of that kind to `per_position`)."""
    return {f"{kind}.{leaf}": int(np.prod(v.shape[2:])) * jnp.dtype(v.dtype).itemsize
            for kind, leaves in spec.state_table(cfg, 1, 1).items()
            for leaf, v in leaves.items() if v.kind != spec.CACHE}
