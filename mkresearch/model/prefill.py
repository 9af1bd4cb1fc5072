"""Prefill: a prompt fills every cache and state in one jitted call per chunk of tokens.

`reference.prefill` feeds a prompt one decode step per token (the oracle); this runs a chunk of T
tokens of B rows through the same residual loop (`reference.RESIDUAL_STEPS`) as B·T rows at once.
Every per-token piece (embedding, norms, mixes, the projections, the FFN kinds, the head) is the
decode step's own function on more rows; only the attention sublayers differ, each in its chunk
form here (`CHUNK_SUBLAYERS`), reusing its stage's projections:

    gqa, mla (expanded and latent), mla_rope   the chunk's entries are written into the cache
        first (slots start .. start+T-1), then every query of the chunk attends over the cache at
        once, causally: query t sees slots 0 .. start+t (the cache before the chunk and the chunk
        up to itself). One softmax in f32 (not online): it equals the decode step's online one
        up to f32 rounding, so logits and caches after the first attention layer differ from the
        step-by-step ones by a few bf16 ulps, until a router score that close to a tie picks
        another expert in one of them (bounds, measured over seeds: tests/test_prefill.py).
    kda (and any kind with no chunk form)       a `lax.scan` of the kind's own decode sublayer over
        the chunk's tokens, inside the jitted call (KDA's chunkwise-parallel form is not here yet):
        the same bits as step-by-step decoding.

A row's positions are consecutive: row b's token t sits at slot start_b + t.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from tqdm import tqdm

from mkresearch.model import numerics, reference, rope, spec
from mkresearch.model.config import ModelConfig
from mkresearch.model.numerics import HIGHEST, bf, f32, i32, matmul
from mkresearch.model.stages import gqa, mla, mla_rope

DEFAULT_CHUNK = 256  # tokens per jitted call: bounds the [B, H, T, S] scores and [B, T, V] logits


# ---- chunk attention ------------------------------------------------------------------------
def _rows_of(layer_state: dict, x: jax.Array) -> tuple[int, int]:
    """(B, T) of a chunk: x is [B·T, d] (row-major: row b's token t at b·T + t), the state [B, ...]."""
    batch = jax.tree.leaves(layer_state)[0].shape[0]
    return batch, x.shape[0] // batch


def write_chunk(cache: jax.Array, new: jax.Array, start: jax.Array, axis: int) -> jax.Array:
    """cache [B, ...] (one row's slot axis `axis`, as `numerics.write_slot`) with row b's slots
    start_b .. start_b+T-1 set to new[b, 0..T-1]; new [B, T, *one entry]. A gather and a select
    (no scatter), as the decode step's write."""
    batch, length = new.shape[:2]
    slots = cache.shape[axis + 1]
    offset = jnp.arange(slots)[None, :] - start[:, None]  # [B, S]: the chunk token at each slot
    index = jnp.clip(offset, 0, length - 1).reshape((batch, slots) + (1,) * (new.ndim - 2))
    entries = jnp.moveaxis(jnp.take_along_axis(new, index, axis=1), 1, axis + 1)
    hit = ((offset >= 0) & (offset < length)).reshape(
        (batch,) + (1,) * axis + (slots,) + (1,) * (cache.ndim - axis - 2))
    return jnp.where(hit, entries.astype(cache.dtype), cache)


def causal_attend(scores: jax.Array, values: jax.Array, positions: jax.Array) -> jax.Array:
    """Σ_j α_tj V_j over slots 0..p_t, α = softmax in f32: scores [B, H, T, S] f32, values
    [B, H, S, n] or [B, S, n] (shared by the heads), positions [B, T]. Returns [B, H, T, n] f32."""
    visible = jnp.arange(scores.shape[-1])[None, None, None, :] <= positions[:, None, :, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    weights = jnp.where(visible, jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True)), 0.0)
    contract = "bhts,bsn->bhtn" if values.ndim == 3 else "bhts,bhsn->bhtn"
    acc = jnp.einsum(contract, weights, values.astype(f32), precision=HIGHEST)
    return acc / jnp.sum(weights, axis=-1, keepdims=True)


def _heads_last(o: jax.Array) -> jax.Array:
    """[B, H, T, n] -> [B·T, H, n] (the rows of the chunk, in x's order)."""
    batch, heads, length, width = o.shape
    return o.transpose(0, 2, 1, 3).reshape(batch * length, heads, width)


def gqa_chunk(p: dict, x: jax.Array, cache: dict, positions: jax.Array, cfg: ModelConfig):
    """GQA over a chunk: x [B·T, d], cache {"k", "v"} [B, KV, S, D], positions [B·T]."""
    batch, length = _rows_of(cache, x)
    q, k, v = gqa.projections(p, x, positions, cfg)  # [N, H, D], [N, KV, D] x2
    pos = positions.reshape(batch, length)
    cache = {name: write_chunk(cache[name], new.reshape(batch, length, *new.shape[1:]),
                               pos[:, 0], axis=1) for name, new in (("k", k), ("v", v))}
    group = cfg.n_heads // cfg.n_kv_heads
    keys, values = (jnp.repeat(cache[name], group, axis=1) for name in ("k", "v"))  # [B,H,S,D]
    queries = q.reshape(batch, length, cfg.n_heads, cfg.head_dim)
    scores = numerics.einsum("bthd,bhsd->bhts", queries, keys) * rope.attention_scale(
        cfg, cfg.head_dim)
    o = bf(_heads_last(causal_attend(scores, values, pos)))  # [N, H, D]
    return bf(matmul(o.reshape(x.shape[0], -1), p["w_o"])), cache, {}


def _latent_context(q_nope, q_extra, w_kb, w_vb, ckv, extra_cache, pos, scale) -> jax.Array:
    """The absorbed latent attention of a chunk (as `stages.mla` latent and `stages.mla_rope`):
    q̃ = bf(q^C W_kbᵀ), scores q̃·ĉ + q^X·k^X, o = bf(bf(Σ α ĉ) W_vb) [N, H, v]."""
    batch, length = pos.shape
    heads = q_nope.shape[1]
    q_absorbed = bf(numerics.einsum("nhk,rhk->nhr", q_nope, w_kb))
    q_absorbed = q_absorbed.reshape(batch, length, heads, -1)
    q_extra = q_extra.reshape(batch, length, heads, -1)
    scores = (numerics.einsum("bthr,bsr->bhts", q_absorbed, ckv)
              + numerics.einsum("bthe,bse->bhts", q_extra, extra_cache)
              ) * scale  # [B, H, T, S]
    context = bf(_heads_last(causal_attend(scores, ckv, pos)))  # [N, H, rank]
    return bf(numerics.einsum("nhr,rhv->nhv", context, w_vb))


def mla_chunk(p: dict, x: jax.Array, cache: dict, positions: jax.Array, cfg: ModelConfig):
    """Kimi's MLA (no RoPE, output-gated) over a chunk, either cache layout."""
    batch, length = _rows_of(cache, x)
    nope, extra = cfg.mla_qk_nope, cfg.mla_qk_extra
    q_nope, q_extra, c_hat, k_extra = mla.mla_inputs(p, x, cfg)
    w_kb, w_vb = mla.split_kvb(p, cfg)
    pos = positions.reshape(batch, length)
    scale = cfg.mla_qk_dim ** -0.5

    def rows(a: jax.Array) -> jax.Array:
        return a.reshape(batch, length, *a.shape[1:])

    if cfg.mla_cache_layout == "expanded":
        _, v_new, k_new = mla.expanded_entry(p, c_hat, k_extra, cfg)
        cache = {"k": write_chunk(cache["k"], rows(k_new), pos[:, 0], axis=1),
                 "v": write_chunk(cache["v"], rows(v_new), pos[:, 0], axis=1)}
        queries = rows(jnp.concatenate([q_nope, q_extra], axis=-1))  # [B, T, H, nope+extra]
        scores = numerics.einsum("bthk,bhsk->bhts", queries,
                                 cache["k"][..., :nope + extra]) * scale
        o = bf(_heads_last(causal_attend(scores, cache["v"], pos)))
    else:
        cache = {"ckv": write_chunk(cache["ckv"], rows(c_hat), pos[:, 0], axis=0),
                 "kx": write_chunk(cache["kx"], rows(k_extra), pos[:, 0], axis=0)}
        o = _latent_context(q_nope, q_extra, w_kb, w_vb, cache["ckv"], cache["kx"], pos, scale)
    return mla.gated_output(p, x, o, cfg), cache, {}


def mla_rope_chunk(p: dict, x: jax.Array, cache: dict, positions: jax.Array, cfg: ModelConfig):
    """DeepSeek's MLA (decoupled rope key, YaRN, latent cache, no gate) over a chunk."""
    batch, length = _rows_of(cache, x)
    q_nope, q_rope, c_hat, k_rope = mla_rope.queries_and_keys(p, x, positions, cfg)
    pos = positions.reshape(batch, length)
    cache = {"ckv": write_chunk(cache["ckv"], c_hat.reshape(batch, length, -1), pos[:, 0], 0),
             "kpe": write_chunk(cache["kpe"], k_rope.reshape(batch, length, -1), pos[:, 0], 0)}
    w_kb, w_vb = mla.split_kvb(p, cfg)
    o = _latent_context(q_nope, q_rope, w_kb, w_vb, cache["ckv"], cache["kpe"], pos,
                        rope.attention_scale(cfg, cfg.mla_qk_dim))
    return bf(matmul(o.reshape(x.shape[0], -1), p["w_o"])), cache, {}


def scan_chunk(kind: str):
    """The chunk form of a kind without one: its decode sublayer scanned over the chunk's tokens
    (inside the jitted call; the same bits as step-by-step decoding). The sublayer's aux is
    dropped (no attention kind has one)."""
    stage = spec.stage(kind)

    def chunk(p: dict, x: jax.Array, layer_state: dict, positions: jax.Array, cfg: ModelConfig):
        batch, length = _rows_of(layer_state, x)
        tokens = x.reshape(batch, length, -1).swapaxes(0, 1)  # [T, B, d]
        slots = positions.reshape(batch, length).T  # [T, B]

        def one_token(carry, inputs):
            out, carry, _ = stage.sublayer(p, inputs[0], carry, inputs[1], cfg)
            return carry, out

        layer_state, outs = lax.scan(one_token, layer_state, (tokens, slots))
        return outs.swapaxes(0, 1).reshape(x.shape[0], -1), layer_state, {}

    return chunk


CHUNK_SUBLAYERS = {"gqa": gqa_chunk, "mla": mla_chunk, "mla_rope": mla_rope_chunk}


def chunk_sublayers(cfg: ModelConfig) -> dict[str, Any]:
    """{kind: chunk function} for the model's kinds with state: the chunk form, else a scan of
    the decode sublayer (KDA). Kinds without state (the FFNs) run their decode sublayer on B·T
    rows."""
    table = spec.state_table(cfg, 1, 1)
    return {kind: CHUNK_SUBLAYERS.get(kind) or scan_chunk(kind) for kind in table}


# ---- the chunked prefill --------------------------------------------------------------------
def _chunk_step(params, state, tokens, start, cfg):
    batch, length = tokens.shape
    positions = (start[:, None] + jnp.arange(length, dtype=i32)[None]).reshape(-1)
    logits, state, aux = reference.RESIDUAL_STEPS[cfg.residual](
        params, state, tokens.reshape(-1), positions, cfg, sublayers=chunk_sublayers(cfg))
    routing = aux.get("expert_ids", jnp.zeros((0, batch * length, 0), i32))  # [n_moe, B T, k]
    return (logits.reshape(batch, length, -1), state,
            routing.swapaxes(0, 1).reshape(batch, length, *routing.shape[::2]))


_chunk_step_jit = jax.jit(_chunk_step, static_argnames="cfg")


def prefill(params: dict[str, Any], state: dict[str, Any], prompt: Any, cfg: ModelConfig, *,
            start: Any = 0, chunk: int = DEFAULT_CHUNK, progress: bool = False,
            expert_ids: bool = False) -> tuple:
    """Prompt [B, T] at positions start .. start+T-1 (start: int or [B]) in one jitted call per
    chunk of `chunk` tokens (the last chunk may be shorter: one more compile). Returns (logits
    [B, T, V] f32 after each prompt token, the new state), and with expert_ids each token's
    routing [B, T, n_moe, top_k], as `reference.prefill` does."""
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} is invalid: an int >= 1 (tokens per jitted call)")
    reference.check_prompt(prompt, cfg)
    batch, length = np.shape(prompt)
    start = np.broadcast_to(np.asarray(start, np.int32), (batch,))
    reference.check_step_inputs(state, np.zeros(batch, np.int32), start + length - 1, cfg)
    prompt = jnp.asarray(prompt, i32)
    bounds = range(0, length, int(chunk))
    if progress:
        bounds = tqdm(bounds, desc=f"{cfg.name} prefill", unit="chunk")
    all_logits, routing = [], []
    for first in bounds:
        tokens = prompt[:, first:first + chunk]
        logits, state, chosen = _chunk_step_jit(params, state, tokens,
                                                jnp.asarray(start + first, i32), cfg=cfg)
        all_logits.append(logits)
        routing.append(chosen)
    if expert_ids:
        return jnp.concatenate(all_logits, axis=1), state, jnp.concatenate(routing, axis=1)
    return jnp.concatenate(all_logits, axis=1), state
