"""The routed MoE on the full hidden width (kind "moe_full": DeepSeek-V3, GLM-4.5, Qwen3;
docs/families.md): the experts work on x itself, with no latent down/up projection.

    expert_ids, w = route(x)                           `stages.ffn.route`: sigmoid + correction
                                                       bias + group-limited top-k (DeepSeek, GLM)
                                                       or softmax top-k (Qwen), renormalised,
                                                       times routed_scale; or a softmax over
                                                       the k largest biased logits (GPT-OSS)
    y_e = bf(SiLU-GLU(bf(x W1_e), bf(x W3_e)) W2_e)    each chosen expert, [B, d] (GPT-OSS: the
                                                       clamped SwiGLU, each product + its bias)
    routed = Σ_e w_e y_e                               f32, in ascending expert id
    m = bf(routed + shared)                            shared = act(bf(x W_sg), bf(x W_su)) W_sd
                                                       (f32), when cfg.n_shared_experts

Where the public implementations leave the arithmetic to the framework (bf16 sums in some order),
this reads it as Kimi K3's MoE does (docs/kimi-k3.md §6): f32 sums in ascending expert id, one
rounding of routed + shared. DeepSeek's router divides by Σ + 1e-20; the 1e-20 is left out (it
does not change an f32 sum of sigmoid scores). Masked experts of the group-limited selection are
−inf (DeepSeek's inference code), never chosen: top_k <= router_topk_groups · group size is
validated. Experts are stored in cfg.expert_format; the contraction dim of W1/W3 is d_model, of W2
expert_hidden.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mkresearch.model import spec
from mkresearch.model.config_rules import EXPERT_BLOCKS
from mkresearch.model.model_config import ModelConfig
from mkresearch.model.numerics import ExpertGroups, bf, reduce_partials
from mkresearch.model.stages.ffn import (
    combine_experts,
    gated_mlp,
    route,
    routing_margin,
    shared_experts,
    shared_hidden,
)


def params(cfg: ModelConfig) -> dict[str, Any]:
    """Sharding (`mkresearch.sharding.layout`): routed experts by expert (EP) and inside (ETP: W1, W3 by
    their hidden columns, W2 by its d columns, the hidden gathered first), as Kimi K3's; the
    shared expert as a gated MLP (hidden slices, W_sd by its d columns); the router (softmax or
    group-limited) and its bias whole on every rank."""
    d, n_experts, hidden = cfg.d_model, cfg.n_experts, cfg.expert_hidden

    def expert(n_in, n_out, gather=None):
        return spec.matrix(n_in, n_out, quantized=True, shard=spec.split(1, spec.EXPERT_TP),
                           gather=gather).stacked(n_experts, by=spec.EXPERTS)

    table: dict[str, Any] = {
        "w_router": spec.matrix(d, n_experts, shard=spec.REPLICATED),
        # small correction bias: changes some selections, never dominates the scores
        "router_bias": spec.Param((n_experts,), jnp.float32, ("normal", 0.05),
                                  shard=spec.REPLICATED),
        "experts": {"w1": expert(d, hidden), "w3": expert(d, hidden),
                    "w2": expert(hidden, d, gather=spec.EXPERT_TP)},
    }
    if cfg.expert_bias:  # GPT-OSS: no sharding rule (a layout over ranks refuses them)
        table["experts"].update({
            bias: spec.Param((n_experts, width), jnp.bfloat16, ("normal", 0.5))
            for bias, width in (("b1", hidden), ("b3", hidden), ("b2", d))})
    if cfg.n_shared_experts:
        shared = gated_mlp(d, cfg.shared_hidden)
        table.update(w_sg=shared["w_gate"], w_su=shared["w_up"], w_sd=shared["w_down"])
    return table


def routed_experts(p: dict[str, Any], x: jax.Array, expert_ids: jax.Array,
                   expert_weights: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Σ_e w_e y_e over each row's chosen experts, f32 [B, d] (moe_full_ffn rounds it together
    with the shared experts)."""
    return combine_experts(p["experts"], x, expert_ids, expert_weights, cfg)


def moe_full_ffn(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The MoE layer on the full d: m = bf(routed + shared) [B, d] bf16 (x normalised, bf16).
    A sharded reference whose expert groups are `merged` (`numerics.ExpertGroups`): each rank's
    routed and shared partial sums added first, then one reduction of the ranks' sums."""
    expert_ids, expert_weights = route(p, x, cfg)
    if isinstance(p["experts"], ExpertGroups) and p["experts"].merged:
        return bf(_merged_sum(p, x, expert_ids, expert_weights, cfg))
    routed = routed_experts(p, x, expert_ids, expert_weights, cfg)
    if not cfg.n_shared_experts:
        return bf(routed)
    return bf(routed + shared_experts(p, x, cfg))


def _merged_sum(p: dict[str, Any], x: jax.Array, expert_ids: jax.Array,
                expert_weights: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Σ over ranks of (rank's routed experts' sum + its shared experts' partial product), in the
    reduction's order. Rank r holds shared slice r (`Partials` pieces, one per rank) and its
    routed partial: ETP = 1, group r's sum; ETP > 1, its hidden slice's (`ExpertGroups.ranks`)."""
    groups, w_sd = p["experts"], p["w_sd"]
    routed = combine_experts(groups, x, expert_ids, expert_weights, cfg, parts=True)
    shared = w_sd.products(shared_hidden(p, x, cfg))
    etp = len(shared) // len(routed)  # 1 with a partial per rank
    ranks = [part + routed[r // etp] if r % etp == 0 else part for r, part in enumerate(shared)]
    return reduce_partials(ranks, w_sd.hosts, w_sd.wire)


def sublayer(p: dict[str, Any], x: jax.Array, layer_state: dict, positions: jax.Array,
             cfg: ModelConfig) -> tuple[jax.Array, dict, dict]:
    del positions
    expert_ids = route(p, x, cfg)[0]  # for aux: moe_full_ffn routes again (XLA computes it once)
    return moe_full_ffn(p, x, cfg), layer_state, {"expert_ids": expert_ids,
                                                  "routing_margin": routing_margin(p, x, cfg)}


def check(cfg: ModelConfig) -> None:
    """The experts' contraction dims (d_model for W1/W3) are whole scale blocks of the format."""
    block = EXPERT_BLOCKS.get(cfg.expert_format, 1)
    if cfg.d_model % block:
        raise ValueError(f"ModelConfig.expert_format={cfg.expert_format!r} is invalid with "
                         f"ffn={cfg.ffn!r}: experts on the full d_model={cfg.d_model} need it a "
                         f"multiple of {block} (its scale blocks)")


STAGE = spec.register(spec.Stage(
    name="moe_full", role=spec.FFN, params=params, sublayer=sublayer, check=check,
    component=("moe_nonrouted", lambda cfg: "MoE non-routed (router"
               + (", shared)" if cfg.n_shared_experts else ")")),
    routed=("experts",),
    description="routed experts on the full d (sigmoid group-limited or softmax top-k router) "
                "+ shared experts"))
