"""The FFN kinds (docs/kimi-k3.md §6): the dense gated MLP and the latent MoE layer.

MoE: a sigmoid (or softmax) router with a correction bias for selection only, the top-k routed
experts working in a latent (down-projected, RMS-normalised, up-projected), their weighted sum
taken in ascending expert id, and always-on shared experts on the full d.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mkresearch.model import numerics, spec
from mkresearch.model.formats import dequantize, k_rows, mxu_matmul
from mkresearch.model.model_config import ModelConfig
from mkresearch.model.numerics import (
    ExpertGroups,
    NormedRows,
    activation,
    bf,
    f32,
    i32,
    matmul,
    ordered_sum,
    padded_rows,
    reduce_partials,
    rms_norm,
    sequence_sum,
    softmax,
)


def gated_mlp(d: int, hidden: int) -> dict[str, spec.Param]:
    """W_gate, W_up [d, F] split by the hidden F; W_down [F, d] by its d columns, the hidden
    gathered first."""
    cols = spec.split(1, spec.FFN_HIDDEN)
    return {"w_gate": spec.matrix(d, hidden, shard=cols), "w_up": spec.matrix(d, hidden, shard=cols),
            "w_down": spec.matrix(hidden, d, shard=spec.split(1, spec.MODEL_COLS),
                                  gather=spec.FFN_HIDDEN)}


def dense_params(cfg: ModelConfig) -> dict[str, spec.Param]:
    return gated_mlp(cfg.d_model, cfg.dense_hidden)


def moe_params(cfg: ModelConfig) -> dict[str, Any]:
    """Sharding (`mkresearch.sharding.layout`): routed experts by expert (EP) and inside (ETP: W1, W3 by
    their hidden columns, W2 by its latent columns, the hidden gathered first); the shared experts
    as a gated MLP; the router and the latent down-projection by their columns, the latent
    up-projection by its d columns; norms and bias whole."""
    d, n_experts, latent, hidden = cfg.d_model, cfg.n_experts, cfg.moe_latent, cfg.expert_hidden

    def expert(n_in, n_out, gather=None):
        return spec.matrix(n_in, n_out, quantized=True, shard=spec.split(1, spec.EXPERT_TP),
                           gather=gather).stacked(n_experts, by=spec.EXPERTS)

    table: dict[str, Any] = {
        "w_router": spec.matrix(d, n_experts, shard=spec.split(1, spec.DOWN_COLS), router=True),
        # small correction bias: changes some selections, never dominates the scores
        "router_bias": spec.Param((n_experts,), jnp.float32, ("normal", 0.05),
                                  shard=spec.REPLICATED),
        "w_ld": spec.matrix(d, latent, shard=spec.split(1, spec.MOE_LATENT)),
        "latent_norm": spec.norm((latent,), jnp.float32),
        # restructured: its partial sums ride in the shared experts' W_down reduction
        "w_lu": spec.matrix(latent, d, shard=spec.split(1, spec.MODEL_COLS),
                            scattered=spec.MOE_LATENT, beside="w_sd"),
        "experts": {"w1": expert(latent, hidden), "w3": expert(latent, hidden),
                    "w2": expert(hidden, latent, gather=spec.EXPERT_TP)},
    }
    if cfg.n_shared_experts:
        shared = gated_mlp(d, cfg.shared_hidden)
        table.update(w_sg=shared["w_gate"], w_su=shared["w_up"], w_sd=shared["w_down"])
    return table


def route(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Router: expert_ids [B, k] i32 and expert_weights [B, k] f32 (§6.1).

    r = x W_r (f32); s = σ(r) (or softmax); top-k of s + bias by iterated argmax (lowest index
    wins ties), within the router_topk_groups best groups when cfg.router_groups > 1
    (`limit_to_groups`); weights = s / Σ_top s (cfg.router_normalize) from the UNcorrected scores,
    times cfg.routed_scale. "topk_softmax" (GPT-OSS): s = r + bias (the bias is the linear
    layer's, part of the logit), top-k of s, weights = softmax over the k chosen s
    (router_normalize not read: they sum to 1).
    """
    scores, selection = router_scores(p, x, cfg)
    chosen = []
    for _ in range(cfg.top_k):
        best = jnp.argmax(selection, axis=-1)  # first maximum: the lowest index wins a tie
        chosen.append(best)
        selection = jnp.where(jax.nn.one_hot(best, cfg.n_experts, dtype=bool), -jnp.inf, selection)
    expert_ids = jnp.stack(chosen, axis=-1).astype(i32)  # [B, k]
    top_scores = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if cfg.router_score == "topk_softmax":  # a softmax over the k chosen logits: sums to 1
        top_scores = softmax(top_scores)
    elif cfg.router_normalize:
        top_scores = top_scores / ordered_sum(top_scores, keepdims=True)
    return expert_ids, top_scores * cfg.routed_scale


def routing_margin(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """[B] f32: the gap between the k-th and the (k+1)-th selection score of each row (`route`
    takes the k largest): how far the routing is from choosing another expert. A kernel whose
    layer input differs from the reference's by float rounding can route otherwise only where
    this is small (a router near-tie; docs/kimi-k3.md §11)."""
    ranked = lax.top_k(router_scores(p, x, cfg)[1], cfg.top_k + 1)[0]  # [B, k + 1], descending
    return ranked[:, cfg.top_k - 1] - ranked[:, cfg.top_k]


def router_scores(p: dict[str, Any], x: jax.Array,
                  cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(scores, selection), both [B, E] f32: the router's scores s = σ(x W_r) (or softmax) and
    what top-k selects from, s + bias (cfg.router_bias), −inf outside the kept groups
    (cfg.router_groups > 1). `route` picks the top k of the selection; a row whose k-th and
    (k+1)-th selection are near equal is a routing near-tie."""
    logits = matmul(x, p["w_router"])  # [B, E]
    if cfg.router_score == "topk_softmax":  # the bias is the router's own: in the logits
        scores = logits + p["router_bias"].astype(f32) if cfg.router_bias else logits
        return scores, scores
    if cfg.router_score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = softmax(logits)
    selection = scores + p["router_bias"].astype(f32) if cfg.router_bias else scores
    if cfg.router_groups > 1:
        selection = limit_to_groups(selection, cfg.router_groups, cfg.router_topk_groups)
    return scores, selection


def limit_to_groups(selection: jax.Array, n_groups: int, keep: int) -> jax.Array:
    """Group-limited selection (DeepSeek-V3's noaux_tc): selection [B, E] with every expert
    outside the `keep` best of n_groups equal groups set to −inf. A group's score is the sum of
    its two largest entries (first + second); the best groups are taken by iterated argmax, the
    lower group index winning a tie."""
    batch, n_experts = selection.shape
    grouped = selection.reshape(batch, n_groups, n_experts // n_groups)
    top_two = lax.top_k(grouped, 2)[0]  # [B, G, 2], descending
    group_scores = top_two[..., 0] + top_two[..., 1]  # [B, G]
    kept = jnp.zeros((batch, n_groups), bool)
    for _ in range(keep):
        best = jnp.argmax(group_scores, axis=-1)  # the lowest group index wins a tie
        hit = jax.nn.one_hot(best, n_groups, dtype=bool)
        kept, group_scores = kept | hit, jnp.where(hit, -jnp.inf, group_scores)
    return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(batch, n_experts)


# each expert matrix's bias with cfg.expert_bias (GPT-OSS): b1, b3 [E, F], b2 [E, n]
EXPERT_BIASES = {"w1": "b1", "w3": "b3", "w2": "b2"}


def combine_experts(experts: dict[str, Any], z: jax.Array, expert_ids: jax.Array,
                    expert_weights: jax.Array, cfg: ModelConfig, *, parts: bool = False) -> Any:
    """Σ_e w_e y_e in f32 [B, n], y_e = bf(act(bf(z W1_e), bf(z W3_e)) W2_e), for the chosen
    experts of each row (z [B, n] bf16; experts: w1, w3 [E, n, F], w2 [E, F, n] stored in
    cfg.expert_format; with cfg.expert_bias also b1, b3 [E, F], b2 [E, n]: y_e =
    bf(act(bf(z W1_e + b1_e), bf(z W3_e + b3_e)) W2_e + b2_e), each bias added in f32). The sum
    runs in ascending expert id; experts given as
    `numerics.ExpertGroups` (a sharded reference): each group's sum apart, then the groups'
    (`parts`: the groups' sums, a list, not yet reduced)."""
    groups = None
    if isinstance(experts, ExpertGroups):
        groups, experts = experts, experts.experts
    fmt = cfg.expert_format
    chosen = (groups.chosen(expert_ids) if groups is not None  # each leaf [B, k, ...]
              else jax.tree.map(lambda w: w[expert_ids], experts))
    def per_expert(v, name, rows=None):  # v [B, k, 1, K] @ each (row, expert)'s matrix (its
        # K rows `rows` = (start, stop) of them) -> [B, k, N] f32
        w = chosen[name] if rows is None else k_rows(chosen[name], *rows, cfg.expert_hidden)
        if cfg.expert_mxu == "fp8":  # as the MXU is handed it: e4m3 values, scales after the dot
            product = jax.vmap(jax.vmap(functools.partial(mxu_matmul, fmt=fmt)))
            return product(v, w)[:, :, 0]
        w = dequantize(w, fmt)  # [B, k, K, N] bf16
        return padded_rows(  # each (row, expert) product on padded rows, as `matmul`
            lambda v2: numerics.einsum("bkml,bklf->bkmf", v2, w),
            v, axis=-2)[:, :, 0]
    def biased(y, name):  # + the chosen expert's bias (cfg.expert_bias, GPT-OSS), in f32
        return y + chosen[EXPERT_BIASES[name]].astype(f32) if cfg.expert_bias else y
    zk = jnp.broadcast_to(z[:, None, None], (z.shape[0], expert_ids.shape[1], 1, z.shape[-1]))
    g = bf(biased(per_expert(zk, "w1"), "w1"))  # [B, k, F_e]
    u = bf(biased(per_expert(zk, "w3"), "w3"))
    h = activation(g, u, cfg)[:, :, None]  # [B, k, 1, F_e]
    slices = 1 if groups is None else groups.etp
    if slices > 1:  # ETP: each rank's hidden slice times its rows of W2, rounded apart
        ys = groups.slice_outputs(h, lambda part, rows: bf(per_expert(part, "w2", rows)))
    else:
        ys = [bf(biased(per_expert(h, "w2"), "w2"))]  # [B, k, n]
    if groups is None:
        return weighted_sum(ys[0], expert_ids, expert_weights)  # [B, n]
    order = jnp.argsort(expert_ids, axis=-1)  # [B, k]
    coef = jnp.take_along_axis(expert_weights.astype(f32), order, axis=-1)  # [B, k]
    ys = [jnp.take_along_axis(y.astype(f32), order[..., None], axis=1) for y in ys]  # [B, k, n]
    y = ys[0]
    # each group's experts in ascending id, then the groups
    ids = jnp.take_along_axis(expert_ids, order, axis=-1)
    sums = groups.rank_sums(ys, coef, ids) if slices > 1 else groups.group_sums(y, coef, ids)
    return sums if parts else reduce_partials(sums, groups.hosts, groups.wire)  # [B, n]



def weighted_sum(y: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array, *,
                 unrolled: bool = False) -> jax.Array:
    """Σ_j w_j y_j over each row's chosen experts, f32 [B, n] (y [B, k, n]: the chosen experts'
    outputs, in the router's order as expert_ids [B, k] and expert_weights [B, k]).

    The f32 sum is taken in ascending expert id: a row's sum depends neither on the router's
    ranking nor on the other rows of the batch (kernels fetch each distinct expert of the batch
    once, in id order, and add it to the rows that chose it). unrolled: the k terms added in one
    expression instead of a loop (the same sum in the same order; no device loop per term)."""
    order = jnp.argsort(expert_ids, axis=-1)  # [B, k]
    coef = jnp.take_along_axis(expert_weights.astype(f32), order, axis=-1)  # [B, k]
    y = jnp.take_along_axis(y.astype(f32), order[..., None], axis=1)  # [B, k, n]
    if unrolled:
        return sequence_sum(coef[:, j, None] * y[:, j] for j in range(y.shape[1]))  # [B, n]
    return lax.fori_loop(0, y.shape[1], lambda j, acc: acc + coef[:, j, None] * y[:, j],
                         jnp.zeros(y.shape[::2], f32))  # [B, n]


def routed_experts(p: dict[str, Any], x: jax.Array, expert_ids: jax.Array,
                   expert_weights: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Latent routed experts (§6.2–6.5): latent down, each expert, weighted combine, latent norm,
    up. Returns routed [B, d] in f32 (moe_ffn rounds it together with the shared experts)."""
    z = bf(matmul(x, p["w_ld"]))  # [B, Lat]
    rho = bf(combine_experts(p["experts"], z, expert_ids, expert_weights, cfg))  # [B, Lat]
    if isinstance(p["w_lu"], NormedRows):  # the restructured sharded reference
        return p["w_lu"].normed_contract(rho, p["latent_norm"], cfg.rms_eps, cfg.moe_latent)
    rho_hat = rms_norm(rho, p["latent_norm"], cfg.rms_eps, n=cfg.moe_latent)
    return matmul(rho_hat, p["w_lu"])  # [B, d] f32


def shared_hidden(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The shared experts' hidden act(bf(x W_sg), bf(x W_su)), bf16 [B, S]."""
    return activation(bf(matmul(x, p["w_sg"])), bf(matmul(x, p["w_su"])), cfg)


def shared_experts(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The always-on shared experts on the full x: act(bf(x W_sg), bf(x W_su)) W_sd, f32 [B, d]."""
    return matmul(shared_hidden(p, x, cfg), p["w_sd"])


def moe_ffn(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """MoE layer (§6): m = bf(routed + shared) [B, d] bf16."""
    expert_ids, expert_weights = route(p, x, cfg)
    routed = routed_experts(p, x, expert_ids, expert_weights, cfg)
    if not cfg.n_shared_experts:
        return bf(routed)
    return bf(routed + shared_experts(p, x, cfg))


def dense_ffn(p: dict[str, Any], x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Dense layer (§6): m = bf(SiTU(bf(x W_g), bf(x W_u)) W_d) [B, d] bf16."""
    hidden = activation(bf(matmul(x, p["w_gate"])), bf(matmul(x, p["w_up"])), cfg)
    return bf(matmul(hidden, p["w_down"]))


def moe_sublayer(p: dict[str, Any], x: jax.Array, layer_state: dict, positions: jax.Array,
                 cfg: ModelConfig) -> tuple[jax.Array, dict, dict]:
    del positions
    expert_ids = route(p, x, cfg)[0]  # for aux: moe_ffn routes again (XLA computes it once)
    return moe_ffn(p, x, cfg), layer_state, {"expert_ids": expert_ids,
                                             "routing_margin": routing_margin(p, x, cfg)}


def dense_sublayer(p: dict[str, Any], x: jax.Array, layer_state: dict, positions: jax.Array,
                   cfg: ModelConfig) -> tuple[jax.Array, dict, dict]:
    del positions
    return dense_ffn(p, x, cfg), layer_state, {}


def _dense_label(cfg: ModelConfig) -> str:
    layers = cfg.dense_layers
    where = (f"layer {layers[0]}" if len(layers) == 1
             else f"layers {layers[0]}-{layers[-1]}")
    return f"dense FFN ({where})"


DENSE = spec.register(spec.Stage(
    name="dense", role=spec.FFN, params=dense_params, sublayer=dense_sublayer,
    component=("dense", _dense_label), description="dense gated MLP"))

MOE = spec.register(spec.Stage(
    name="moe", role=spec.FFN, params=moe_params, sublayer=moe_sublayer,
    component=("moe_nonrouted", lambda cfg: "MoE non-routed (router, latent, shared)"),
    routed=("experts",),
    description="routed latent experts (top-k of a sigmoid/softmax router) + shared experts"))
