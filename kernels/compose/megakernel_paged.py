"""The megakernel on a paged KV cache: one `pallas_call` per decode step, rows of any length.

The cache leaves of the state are pools of pages (`mkresearch.model.paged_kv`: [L, N, (H,) P, n]),
KDA keeps its state per row slot, and the page table [B, M] i32 goes to SMEM (flattened, row
major) beside the positions. The step is the megakernel's own (`megakernel.step_call`): its
attention bodies read each row's KV tiles through the table (`kv_tiles.KvRows`: the same 16-row
reads as a contiguous cache, split at page boundaries, so a row reads the pages it uses and no
more) and write the new token into the page of its position. A row at position -1 is a free
slot: it reads and writes no page.

    paged_decode_step(params, state, tokens, positions, page_table, cfg, pages, ...)

is `megakernel.decode_step` with a page table: the same tokens, logits and (through the table)
caches as the contiguous megakernel and as `paged_kv.paged_decode_step` (the reference), bit for
bit (tests/test_paged_kv.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mkresearch.kernels.base import dma
from mkresearch.kernels.compose import megakernel
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
                      return_logits: bool = False) -> tuple[jax.Array, dict, dict]:
    """One megakernel decode step on a paged state -> (next tokens [B], state, aux).

    state: `paged_kv.init_paged_state(cfg, pages, B)` (donated, updated in place); tokens [B];
    positions [B] i32, the slot of each row's new token, -1 for a free slot; page_table [B,
    pages.max_pages_per_row] i32 covering positions + 1 tokens per row (validated:
    `paged_kv.validate_page_table`). Sampling and aux as `megakernel.decode_step` (the next token
    is drawn for position p + 1; aux["logits"] [B, V] f32 when return_logits)."""
    paged_kv.check_paged_inputs(state, tokens, positions, page_table, cfg, pages)
    batch = np.shape(tokens)[0]
    if not isinstance(tokens, jax.core.Tracer):
        tok = np.asarray(tokens)
        if tok.min() < 0 or tok.max() >= cfg.vocab_size:
            raise ValueError(f"tokens={tok.tolist()} is invalid: each in [0, {cfg.vocab_size})")
    plan = make_plan(cfg, batch, pages.max_context, options)
    inputs, use_gumbel, use_candidates = megakernel.step_inputs(plan, tokens, positions, seed,
                                                                temperature, top_k, top_p)
    inputs = dataclasses.replace(inputs, page_table=jnp.asarray(page_table, jnp.int32).reshape(-1))
    tokens_out, overflow, logits, new_state = _call(
        plan, pages, tpu.interpret_params(), dma.is_recording(), use_gumbel, use_candidates,
        bool(return_logits), inputs, megakernel.prepare_weights(params, cfg), state)
    aux = {"nucleus_overflow": overflow, "plan": plan}
    if return_logits:
        aux["logits"] = logits
    return tokens_out, new_state, aux
