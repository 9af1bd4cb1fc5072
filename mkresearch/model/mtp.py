"""DeepSeek-V3's multi-token-prediction (MTP) module in plain JAX: a draft model for speculative
decoding (`mkresearch.decoding.drafters`, drafter "mtp"), for configs with n_mtp_layers > 0.

One module (DeepSeek-V3 paper §2.2), at position i of the sequence, given the target's final
hidden state h_i (before its final norm) and the next token t_{i+1}:

    h'_i = bf([RMSNorm_h(h_i); RMSNorm_e(Emb(t_{i+1}))] M)          M [2d, d]
    h''  = one transformer block of the model's kinds (its last layer's attention and FFN kinds,
           pre-norm: bf(h + Attn(RMSNorm(h))), bf(h + FFN(RMSNorm(h))))
    logits for t_{i+2} = RMSNorm_f(h'') W_lm                        the shared output head

It shares the embedding and the LM head with the model and keeps its own attention cache (slot i
holds position i's entry). Its weights (`param_table`, drawn by `weights.init_mtp_params`) are the
parameters `roofline.mtp_parameters` counts: the block, its two norms, M with its two norms and the
final norm. (DeepSeek's Hugging Face code concatenates [Emb; h]; the paper's order is used here.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mkresearch.model import reference, spec
from mkresearch.model.config import ModelConfig
from mkresearch.model.numerics import bf, matmul, rms_norm


def check(cfg: ModelConfig) -> None:
    if not cfg.n_mtp_layers:
        raise ValueError(f"drafter='mtp' is invalid for {cfg.name}: it has n_mtp_layers=0 (no "
                         "multi-token-prediction module); use forced:A or ngram")


def kinds(cfg: ModelConfig) -> tuple[str, str]:
    """(attention kind, FFN kind) of the module's block: the model's last layer's."""
    return cfg.layers[-1]


def param_table(cfg: ModelConfig) -> dict[str, Any]:
    """The modules' parameters (spec.Param), stacked along a leading axis of n_mtp_layers."""
    check(cfg)
    d = cfg.d_model
    attention, ffn = kinds(cfg)
    one = {"h_norm": spec.norm((d,)), "e_norm": spec.norm((d,)), "eh_proj": spec.matrix(2 * d, d),
           "attn_norm": spec.norm((d,)), "mlp_norm": spec.norm((d,)),
           "final_norm": spec.norm((d,)),
           attention: spec.stage(attention).params(cfg), ffn: spec.stage(ffn).params(cfg)}
    return jax.tree.map(lambda p: p.stacked(cfg.n_mtp_layers), one,
                        is_leaf=lambda x: isinstance(x, spec.Param))


def module_params(params: dict[str, Any], index: int) -> dict[str, Any]:
    """Module `index`'s weights from the stacked tree."""
    return reference.layer_params(params, index)


def init_state(cfg: ModelConfig, batch: int, seq_len: int) -> dict[str, Any]:
    """The module's attention cache: {leaf: zeros [B, ...]} of its attention kind."""
    attention, _ = kinds(cfg)
    leaves = spec.stage(attention).state(cfg, seq_len)
    return {name: jnp.zeros((batch, *leaf.shape), leaf.dtype) for name, leaf in leaves.items()}


def select_rows(keep: jax.Array, new: dict, old: dict) -> dict:
    """new where keep [B, 1] else old, row by row."""
    return jax.tree.map(lambda a, b: jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                        new, old)


def _mtp_step(module, embed, lm_head, hidden, tokens, state, positions, cfg):
    attention, ffn = kinds(cfg)
    eps = cfg.rms_eps
    joined = jnp.concatenate([rms_norm(hidden, module["h_norm"], eps),
                              rms_norm(embed[tokens], module["e_norm"], eps)], axis=-1)  # [B, 2d]
    h = bf(matmul(joined, module["eh_proj"]))  # [B, d]
    a, state, _ = spec.stage(attention).sublayer(module[attention],
                                                 rms_norm(h, module["attn_norm"], eps), state,
                                                 positions, cfg)
    h = bf(h.astype(jnp.float32) + a.astype(jnp.float32))
    m, _, _ = spec.stage(ffn).sublayer(module[ffn], rms_norm(h, module["mlp_norm"], eps), {},
                                       positions, cfg)
    h = bf(h.astype(jnp.float32) + m.astype(jnp.float32))
    logits = reference.head_logits({"final_norm": module["final_norm"], "lm_head": lm_head}, h,
                                   cfg)
    return logits, h, state


mtp_step = jax.jit(_mtp_step, static_argnames="cfg")
mtp_step.__doc__ = """One MTP position for B rows: hidden [B, d] (h_i), tokens [B] (t_{i+1}),
state (the module's cache), positions [B] (i, its cache slot) -> (logits [B, V] f32 for t_{i+2},
the block's output h'' [B, d] bf16 (the next chained step's h), the updated cache)."""
