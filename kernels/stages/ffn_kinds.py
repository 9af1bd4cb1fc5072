"""The FFN kinds in the kernel registry: the dense MLP and the MoE layer (router + routed latent
experts + shared experts), composed from the bodies of `kernels/stages/experts.py` and `router.py`.

What the megakernel needs of each kind beyond its body: its plan, how it takes its stacked weights,
the matrices its body streams (in the body's order), its VMEM buffers, its scratch (the MoE
routing, allocated once for every layer) and its cost.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from mkresearch.kernels.base import quant
from mkresearch.kernels.base.registry import KernelStage, Streamed, register
from mkresearch.kernels.stages import gate_up, router
from mkresearch.kernels.stages.experts import (
    EXPERT_MATRICES,
    LATENT_DOWN,
    LATENT_UP,
    SHARED_KEYS,
    MoePlan,
    dense_body,
    dense_options,
    moe_layer_body,
    router_options,
    stage_options,
)

from mkresearch.model.config import ModelConfig


def _moe_plan(cfg: ModelConfig, batch: int, seq_len: int, options: Any) -> MoePlan:
    return MoePlan(stage_options(cfg, options.expert_plan, options.expert_slots, chip=options.chip),
                   router_options(cfg), batch)


def _moe_prepare(stack: dict, cfg: ModelConfig) -> dict:
    """The MoE layers' stacked weights as the body reads them: the router bias and latent norm
    as [n, 1, x] rows in f32, each expert matrix as the tuple of its stored parts."""
    def rows(v):
        return v.astype(jnp.float32).reshape(v.shape[0], 1, -1)

    out = {"w_router": stack["w_router"], "router_bias": rows(stack["router_bias"]),
           "w_ld": stack["w_ld"], "latent_norm": rows(stack["latent_norm"]), "w_lu": stack["w_lu"],
           "experts": {m: tuple(quant.split_parts(stack["experts"][m], cfg.expert_format))
                       for m in EXPERT_MATRICES}}
    if cfg.n_shared_experts:
        out.update(gate_up.fuse({key: stack[key] for key in SHARED_KEYS.values()}, SHARED_KEYS))
    return out


def _moe_streamed(cfg: ModelConfig) -> tuple[Streamed, ...]:
    """In the body's order: router, latent down, the shared experts, then latent up (the shared
    experts run while the routed experts' sum is reduced: `experts.ffn_stage_body`)."""
    d, lat = cfg.d_model, cfg.moe_latent
    out = [Streamed("w_router", router.W_ROUTER, (d, cfg.n_experts)),
           Streamed("w_ld", LATENT_DOWN, (d, lat))]
    if cfg.n_shared_experts:
        shapes = {"w_gate": (d, cfg.shared_hidden), "w_up": (d, cfg.shared_hidden),
                  "w_down": (cfg.shared_hidden, d)}
        out += [Streamed(key, f"shared/{part}", shapes[part]) for part, key in SHARED_KEYS.items()]
    return (*out, Streamed("w_lu", LATENT_UP, (lat, d)))


def _dense_streamed(cfg: ModelConfig) -> tuple[Streamed, ...]:
    d, hidden = cfg.d_model, cfg.dense_hidden
    return (Streamed("w_gate", "dense/w_gate", (d, hidden)),
            Streamed("w_up", "dense/w_up", (d, hidden)),
            Streamed("w_down", "dense/w_down", (hidden, d)))


MOE_KERNEL = register(KernelStage(
    name="moe", plan=_moe_plan, prepare=_moe_prepare, streamed=_moe_streamed,
    body=moe_layer_body, scope=lambda plan: "MoE",
    scratch=lambda cfg, batch: tuple(zip(("router ids", "router weights", "router ids (SMEM)",
                                          "router weights (SMEM)"),
                                         router.routing_scratch(batch, cfg.top_k))),
    scratch_bundle=lambda refs: router.Routing(*refs)))
DENSE_KERNEL = register(KernelStage(
    name="dense", plan=lambda cfg, batch, seq_len, options: dense_options(cfg),
    prepare=lambda stack, cfg: gate_up.fuse(dict(stack), gate_up.DENSE_KEYS),
    streamed=_dense_streamed, body=dense_body,
    scope=lambda plan: "dense"))
