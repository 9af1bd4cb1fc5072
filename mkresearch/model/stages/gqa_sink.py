"""GQA with learned attention sinks (GPT-OSS; docs/families.md §6): weights, KV cache, reference
sublayer, for two kinds that share them:

    "gqa_sink"         every cached token (GPT-OSS's full-attention layers)
    "gqa_sink_window"  the last cfg.sliding_window tokens, the new one included (its
                       sliding-window layers: slot j counts at position p when j > p − window)

One decode step per row at position p, on `stages.gqa`'s projections (q/k/v biases, RoPE with
GPT-OSS's untruncated YaRN, no QK-norm):

    q, k, v = stages.gqa.projections(x)            [H, D], [KV, D], [KV, D] bf16
    cache[p] = (k, v)                              [KV·D] each: the heads side by side (`state`)
    o_h = Σ_j α_hj v_{g,j}   α = softmax over (q_h · k_{g,j} · D^-½ for the slots j counted,
                                                sink_h)                 (f32, online)
    out = bf(bf(o) W_o + b_o)                       (b_o with cfg.attention_bias)

The sink is one more logit per query head in the softmax's normaliser with no value
(transformers' GptOssAttention: `sinks` concatenated to the scores, dropped after the softmax).
Order choices (the kernels follow them): the online softmax starts from the new token and the
sink (`numerics.sink_seed`), then takes the cache `cfg.kv_tile` slots at a time; a tile outside
the window or past p changes nothing, exactly, so a kernel reads only the window's tiles.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mkresearch.model import numerics, rope, spec
from mkresearch.model.model_config import ModelConfig
from mkresearch.model.numerics import bf, bf16, f32, matmul
from mkresearch.model.stages import gqa

FULL, WINDOW = "gqa_sink", "gqa_sink_window"


def params(cfg: ModelConfig) -> dict[str, spec.Param]:
    """`stages.gqa`'s weights, the output bias b_o [d] and the sinks [H] f32 (one logit per query
    head, O(1) so that a kernel forgetting it fails its test). b_o has no sharding rule: a
    layout over ranks refuses the kind, naming it (GPT-OSS-20B fits one chip)."""
    table = gqa.params(cfg)
    if cfg.attention_bias:
        table["b_o"] = spec.Param((cfg.d_model,), bf16, ("normal", 0.5))
    table["sinks"] = spec.Param((cfg.n_heads,), jnp.float32, ("normal", 1.0),
                                shard=spec.split(0, spec.HEADS))
    return table


def state(cfg: ModelConfig, seq_len: int) -> dict[str, spec.StateLeaf]:
    """The KV cache of one row: {"k", "v"} [S, KV·D] bf16 (k roped): a token's K/V heads side
    by side in its lanes. GQA's [KV, S, D] would give each 64-wide head a whole 128-lane tile in
    HBM (twice GPT-OSS's cache, and a relayout copy of it around the kernel); [S, KV·D] fills the
    lanes, and a KV tile of every head is one contiguous window. No sharding rule (as b_o)."""
    shape = (seq_len, cfg.n_kv_heads * cfg.head_dim)
    return {"k": spec.StateLeaf(shape, bf16, spec.CACHE, 0),
            "v": spec.StateLeaf(shape, bf16, spec.CACHE, 0)}


def window_of(kind: str, cfg: ModelConfig) -> int:
    """Tokens a layer of `kind` attends to (0: all)."""
    return cfg.sliding_window if kind == WINDOW else 0


def sink_attention(p: dict[str, Any], x: jax.Array, cache: dict[str, jax.Array],
                   positions: jax.Array, cfg: ModelConfig, window: int = 0
                   ) -> tuple[jax.Array, dict]:
    """One decode step with sinks. x [B, d] bf16 (normalised); cache {"k", "v"} [B, S, KV·D]
    bf16 (this layer, batch-major: `state`); positions [B] i32; window: tokens attended (0: all).
    Returns (out [B, d] bf16, updated cache)."""
    batch, group = x.shape[0], cfg.n_heads // cfg.n_kv_heads
    q, k, v = gqa.projections(p, x, positions, cfg)
    width = cfg.n_kv_heads * cfg.head_dim
    cache = {"k": numerics.write_slot(cache["k"], k.reshape(batch, width), positions, axis=0),
             "v": numerics.write_slot(cache["v"], v.reshape(batch, width), positions, axis=0)}
    k_new, v_new = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)  # [B, H, D]
    scale = rope.attention_scale(cfg, cfg.head_dim)
    new_score = numerics.dot_exact(q, k_new) * scale  # [B, H]
    keys, values = (cache[n].reshape(batch, -1, cfg.n_kv_heads, cfg.head_dim)
                    for n in ("k", "v"))  # [B, S, KV, D]: each K/V head's lanes
    q_groups = q.reshape(batch, cfg.n_kv_heads, group, cfg.head_dim)  # [B, KV, G, D]
    # the G rows of each product padded to 8, as GQA's (the kernel's `rows_dot_t`, padded=True)
    scores = numerics.padded_rows(lambda rows: numerics.einsum("bkgd,bskd->bkgs", rows, keys),
                                  q_groups, axis=2)
    scores = scores.reshape(batch, cfg.n_heads, -1) * scale  # [B, H, S]
    o = bf(numerics.online_softmax(new_score, v_new, scores, values.transpose(0, 2, 1, 3),
                                   positions, cfg.kv_tile, padded=True, sinks=p["sinks"],
                                   window=window))  # [B, H, D]
    out = matmul(o.reshape(batch, cfg.n_heads * cfg.head_dim), p["w_o"])
    if cfg.attention_bias:
        out = out + p["b_o"].astype(f32)
    return bf(out), cache


def _sublayer(window: bool):
    def sublayer(p: dict[str, Any], x: jax.Array, layer_state: dict, positions: jax.Array,
                 cfg: ModelConfig) -> tuple[jax.Array, dict, dict]:
        out, cache = sink_attention(p, x, layer_state, positions, cfg,
                                    cfg.sliding_window if window else 0)
        return out, cache, {}
    return sublayer


def check(cfg: ModelConfig) -> None:
    """A window layer needs a window; the sinks' GQA reads no QK-norm (GPT-OSS has none)."""
    if WINDOW in cfg.attention_kinds and not cfg.sliding_window:
        raise ValueError(f"ModelConfig.sliding_window=0 is invalid with attention="
                         f"{cfg.attention!r}: a window of >= 1 token for its {WINDOW!r} layers")
    if cfg.qk_norm:
        raise ValueError(f"ModelConfig.qk_norm=True is invalid with attention={cfg.attention!r}: "
                         f"False ({FULL!r} and {WINDOW!r} have no QK-norm)")


def _stage(name: str, window: bool) -> spec.Stage:
    what = "over a sliding window" if window else "over every cached token"
    return spec.register(spec.Stage(
        name=name, role=spec.ATTENTION, params=params, state=state, sublayer=_sublayer(window),
        check=check,
        component=(name, lambda cfg: "GQA weights (sinks" + (", window)" if window else ")")),
        state_component=(f"{name}_cache", "GQA KV cache" + (" (window)" if window else "")),
        context_flops=lambda cfg: 2 * cfg.n_heads * 2 * cfg.head_dim,  # q·k and α·v per head
        window=(lambda cfg: cfg.sliding_window) if window else (lambda cfg: 0),
        description=f"grouped-query attention with learned sinks {what}, q/k/v/o bias, YaRN"))


STAGE = _stage(FULL, window=False)
WINDOW_STAGE = _stage(WINDOW, window=True)
