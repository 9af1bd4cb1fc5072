"""The megakernel on a paged KV cache: one `pallas_call` per decode step, rows of any length.

The cache leaves of the state are pools of pages (`mkresearch.model.paged_kv`: [L, N, (H,) P, n]),
KDA keeps its state per row slot, and the page table [B, M] i32 goes to SMEM (flattened, row
major) beside the positions. The step is the megakernel's own (`megakernel.step_call`): its
attention bodies read each row's KV tiles through the table (`kv_tiles.KvRows`: the same 16-row
reads as a contiguous cache, split at page boundaries, so a row reads the pages it uses and no
more) and write the new token into the page of its position. A row at position -1 is a free
slot: it reads and writes no page.

    paged_decode_step(params, state, tokens, positions, page_table, cfg, pages, ...)
    paged_verify_step(params, state, tokens [B, K+1], positions, page_table, cfg, pages, ...)
    compile_paged_step(cfg, pages, batch, chip=...)       the real Mosaic compile, from shapes

are `megakernel.decode_step` and `megakernel_verify.verify_step` with a page table: the same
tokens, logits and (through the table) caches as the contiguous megakernel, bit for bit
(tests/test_paged_kv.py); the reference of the paged layout is `paged_kv.paged_decode_step`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mkresearch.kernels.base import chip_log, dma
from mkresearch.kernels.compose import megakernel, megakernel_verify
from mkresearch.kernels.compose.megakernel_plan import MegakernelOptions, MegaPlan, make_plan

from mkresearch.hardware import tpu
from mkresearch.model import paged_kv
from mkresearch.model.config import ModelConfig


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6), donate_argnums=(9,))
def _call(plan: MegaPlan, pages: paged_kv.PagedKVConfig, interpret: Any, recording: bool,
          use_gumbel: bool, use_candidates: bool, return_logits: bool, inputs: Any, weights: dict,
          state: dict):
    del recording  # static only so recorded and silent traces never share a jit cache entry
    return megakernel.step_call(plan, interpret, use_gumbel, use_candidates, return_logits,
                                inputs, weights, state, pages=pages)


def paged_decode_step(params: dict, state: dict, tokens: Any, positions: Any, page_table: Any,
                      cfg: ModelConfig, pages: paged_kv.PagedKVConfig, *, seed: int = 0,
                      temperature: Any = None, top_k: Any = 0, top_p: Any = 1.0,
                      options: MegakernelOptions = MegakernelOptions(),  # noqa: B008 - frozen
                      return_logits: bool = False,
                      expert_ids: Any = None) -> tuple[jax.Array, dict, dict]:
    """One megakernel decode step on a paged state -> (next tokens [B], state, aux).

    state: `paged_kv.init_paged_state(cfg, pages, B)` (donated, updated in place); tokens [B];
    positions [B] i32, the slot of each row's new token, -1 for a free slot; page_table [B,
    pages.max_pages_per_row] i32 covering positions + 1 tokens per row (validated:
    `paged_kv.validate_page_table`). Sampling and aux as `megakernel.decode_step` (the next token
    is drawn for position p + 1; aux["logits"] [B, V] f32 when return_logits). expert_ids
    [n_routed_layers, B, k]: the routing a step recorded on a TPU logs (None: the paged
    reference's, `paged_routing`), as `megakernel.decode_step`'s."""
    paged_kv.check_paged_inputs(state, tokens, positions, page_table, cfg, pages)
    batch = np.shape(tokens)[0]
    if not isinstance(tokens, jax.core.Tracer):
        tok = np.asarray(tokens)
        if tok.min() < 0 or tok.max() >= cfg.vocab_size:
            raise ValueError(f"tokens={tok.tolist()} is invalid: each in [0, {cfg.vocab_size})")
    plan = make_plan(cfg, batch, pages.max_context, options)
    given = _given(plan, params, state, tokens, positions, page_table, pages, expert_ids)
    tokens_out, overflow, logits, new_state = _run(plan, pages, params, state, tokens, positions,
                                                   table_of(page_table), seed, temperature, top_k,
                                                   top_p, return_logits, given)
    aux = {"nucleus_overflow": overflow, "plan": plan}
    if return_logits:
        aux["logits"] = logits
    return tokens_out, new_state, aux


def table_of(page_table: Any) -> jax.Array:
    """The page table as the kernel's SMEM operand: [B, M] -> [B · M] i32, row major (a 2-D
    SMEM array would pad its rows to 128 words)."""
    return jnp.asarray(page_table, jnp.int32).reshape(-1)


def _run(plan, pages, params, state, tokens, positions, table, seed, temperature, top_k, top_p,
         return_logits, given):
    """The step's inputs, the flat page table among them, and the call (its log from shapes on
    a TPU given `given`, `chip_log.run`)."""
    inputs, use_gumbel, use_candidates = megakernel.step_inputs(plan, tokens, positions, seed,
                                                                temperature, top_k, top_p)
    inputs = dataclasses.replace(inputs, page_table=table)
    return chip_log.run(
        lambda *args: _call(plan, pages, tpu.interpret_params(), dma.is_recording(), use_gumbel,
                            use_candidates, bool(return_logits), *args),
        inputs, megakernel.prepare_weights(params, plan.cfg), state, given=given)


def _given(plan, params, state, tokens, positions, page_table, pages, expert_ids):
    """What the step's log from shapes (on a TPU) is given: its routing (expert_ids, else the
    paged reference's of tokens [B] or [B, W] from positions), before the step donates the
    state. None where no log is made from shapes (read nothing back from the device)."""
    if not dma.logs_from_shapes():
        return None
    if expert_ids is None and plan.cfg.n_experts:
        tokens = np.asarray(tokens).reshape(np.shape(tokens)[0], -1)  # [B, W]
        expert_ids = paged_routing(params, state, tokens, positions, page_table, plan.cfg, pages)
    return megakernel.log_routing(plan, params, state, None, None, expert_ids)


def paged_routing(params: dict, state: dict, tokens: Any, positions: Any, page_table: Any,
                  cfg: ModelConfig, pages: paged_kv.PagedKVConfig) -> np.ndarray:
    """The paged reference's routing of tokens [B, W] from positions [B] (-1: a free slot) ->
    [n_routed_layers, B W, k], `megakernel.routing_of_rows` over `paged_kv.paged_decode_step`.
    ValueError for prepared weights."""
    megakernel.check_routable(params, "a paged step", "rows")

    def route_step(state, tokens, positions):
        _, state, aux = paged_kv.paged_decode_step(params, state, tokens, positions, page_table,
                                                   cfg, pages)
        return state, aux["expert_ids"]

    return megakernel.routing_of_rows(route_step, state, tokens, positions)


def paged_verify_step(params: dict, state: dict, tokens: Any, positions: Any, page_table: Any,
                      cfg: ModelConfig, pages: paged_kv.PagedKVConfig, *, seed: int = 0,
                      temperature: Any = None, top_k: Any = 0, top_p: Any = 1.0,
                      options: MegakernelOptions = MegakernelOptions(),  # noqa: B008 - frozen
                      return_logits: bool = False,
                      expert_ids: Any = None) -> tuple[jax.Array, dict, dict, dict]:
    """A speculative verify step on a paged state, as `megakernel_verify.verify_step`: tokens
    [B, K+1] (the last accepted token at positions[b], then K drafts), page_table covering
    positions + K + 1 tokens per row; a free slot (position -1) verifies nothing (its rows read
    and write no page). Returns (targets [B, K+1], state_all, per_position, aux); the rollback of
    a paged state is `paged_kv.keep_positions` (the caches need none)."""
    if np.ndim(tokens) != 2:
        raise ValueError(f"tokens has shape {np.shape(tokens)}: allowed [B, K+1] (the last "
                         "accepted token, then K drafts)")
    width = np.shape(tokens)[1]
    paged_kv.check_paged_inputs(state, np.asarray(tokens)[:, 0], positions, page_table, cfg,
                                pages, width=width)
    positions = np.asarray(positions, np.int32)
    batch, drafts = megakernel_verify.check_tokens(tokens, np.maximum(positions, 0), cfg,
                                                   pages.max_context)
    plan = megakernel_verify.verify_plan(cfg, batch, drafts, pages.max_context, options)
    # row r = b (K + 1) + j: batch row b's token j at position p_b + j (-1 for a free slot)
    rows = np.where(positions[:, None] >= 0, positions[:, None] + np.arange(width), -1)
    given = _given(plan, params, state, tokens, positions, page_table, pages, expert_ids)
    targets, overflow, logits, state_all, per_position = _run(
        plan, pages, params, state, np.asarray(tokens).reshape(-1), rows.reshape(-1),
        table_of(page_table), seed, temperature, top_k, top_p, return_logits, given)
    targets = targets.reshape(batch, width)
    aux = {"n_accepted": megakernel_verify.n_accepted(tokens, targets),
           "nucleus_overflow": overflow.reshape(batch, width), "plan": plan}
    if return_logits:
        aux["logits"] = logits.reshape(batch, width, cfg.vocab_size)
    return targets, state_all, per_position, aux


def compile_paged_step(cfg: ModelConfig, pages: paged_kv.PagedKVConfig, batch: int = 1, *,
                       chip: str = "tpu7x"):
    """Compile one greedy paged decode step for `chip` from shapes only (the real Mosaic
    compiler, no TPU needed) -> (CompileResult, plan)."""
    pages.check(cfg)
    plan = make_plan(cfg, batch, pages.max_context, MegakernelOptions(chip=chip))
    inputs, weights, _ = megakernel.step_shapes(plan)
    inputs = dataclasses.replace(inputs, page_table=jax.ShapeDtypeStruct(
        (batch * pages.max_pages_per_row,), jnp.int32))

    def step(inputs, weights, state):
        return _call(plan, pages, tpu.interpret_params(), False, False, False, False, inputs,
                     weights, state)

    return tpu.compile_for(step, inputs, weights, paged_kv.paged_state_shapes(cfg, pages, batch),
                           chip=chip), plan
