"""The FFN kinds in the kernel registry: the dense MLP and the MoE layer (router + routed latent
experts + shared experts), composed from the bodies of `kernels/stages/experts.py` and `router.py`.

What the megakernel needs of each kind beyond its body: its plan, how it takes its stacked weights,
the matrices its body streams (in the body's order), its VMEM buffers, its scratch (the MoE
routing, allocated once for every layer) and its cost.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from mkresearch.kernels.base import blocks, costs, planned, quant
from mkresearch.kernels.base.registry import KernelStage, Streamed, register
from mkresearch.kernels.stages import gate_up, router
from mkresearch.kernels.stages.experts import (
    EXPERT_MATRICES,
    LATENT_DOWN,
    LATENT_NORM,
    LATENT_UP,
    ROUTED_KEYS,
    SHARED_KEYS,
    MoePlan,
    StageOptions,
    _options,
    dense_body,
    dense_options,
    expert_dma_name,
    moe_layer_body,
    router_options,
)

from mkresearch.model.config import ModelConfig


def _moe_plan(cfg: ModelConfig, batch: int, seq_len: int, options: Any) -> MoePlan:
    return MoePlan(_options(cfg, options.expert_plan, options.expert_slots, chip=options.chip),
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
    """In the body's order: router, latent down and up, then the shared experts."""
    d, lat = cfg.d_model, cfg.moe_latent
    out = [Streamed("w_router", router.W_ROUTER, (d, cfg.n_experts)),
           Streamed("w_ld", LATENT_DOWN, (d, lat)), Streamed("w_lu", LATENT_UP, (lat, d))]
    if cfg.n_shared_experts:
        shapes = {"w_gate": (d, cfg.shared_hidden), "w_up": (d, cfg.shared_hidden),
                  "w_down": (cfg.shared_hidden, d)}
        out += [Streamed(key, f"shared/{part}", shapes[part]) for part, key in SHARED_KEYS.items()]
    return tuple(out)


def _moe_vmem(plan: MoePlan, cfg: ModelConfig) -> list:
    out = []
    for m, (k, n) in zip(EXPERT_MATRICES, ((cfg.moe_latent, cfg.expert_hidden),) * 2
                         + ((cfg.expert_hidden, cfg.moe_latent),)):
        for name, part in zip(quant.part_names(cfg.expert_format),
                              quant.part_structs(cfg.expert_format, k, n)):
            out.append((f"expert {m}/{name} slots", (plan.stage.n_slots, *part.shape), part.dtype))
    return out + [("latent ρ (padded)", (plan.batch, cfg.moe_latent_padded), jnp.float32),
                  ("dedupe lists (SMEM)", (0,), jnp.int32)]


def _dense_streamed(cfg: ModelConfig) -> tuple[Streamed, ...]:
    d, hidden = cfg.d_model, cfg.dense_hidden
    return (Streamed("w_gate", "dense/w_gate", (d, hidden)),
            Streamed("w_up", "dense/w_up", (d, hidden)),
            Streamed("w_down", "dense/w_down", (hidden, d)))


def _moe_cost(plan: MoePlan, weights: dict, state: dict, cfg: ModelConfig, batch: int) -> Any:
    routed = {key: weights[key] for key in ROUTED_KEYS}
    shared = gate_up.parts(weights, SHARED_KEYS) if cfg.n_shared_experts else None
    bias = weights["router_bias"] if cfg.router_bias else None
    return (costs.router(plan.batch, weights["w_router"], bias)
            + costs.ffn(plan.stage, plan.batch, cfg.top_k, routed, shared))


# ---- the schedules: each body's DMAs for one layer, in its order, as data ----------------------
def _stream(call: planned.StageCall, name: str, weight) -> list[planned.PlannedDma]:
    """A matmul of the FFN bodies: they stream with the default block rows and no indices."""
    return call.matmul(name, weight, blocks.weight_block_rows(tuple(weight.shape), weight.dtype))


def _gated_mlp_dmas(call: planned.StageCall, prefix: str, parts: dict) -> list:
    """`experts.gated_mlp`: W_gate, W_up (or the two as one, `gate_up`), W_down streamed, in
    order; parts: `gate_up.parts`."""
    return [dma for part, w in parts.items() for dma in _stream(call, f"{prefix}/{part}", w)]


def work_list(plan: str, n_experts: int, expert_ids) -> list[int]:
    """The experts the expert loop fetches for a routing [B, k], in its order: "unique" each
    distinct expert of the batch in ascending id (`router.dedupe_experts`), "routed" every
    (row, k) choice, "all" every expert."""
    choices = np.asarray(expert_ids).reshape(-1).tolist()
    return {"all": list(range(n_experts)), "routed": choices,
            "unique": sorted(set(choices))}[plan]


def _routed_dmas(options: StageOptions, call: planned.StageCall, items: list[int]) -> list:
    """`experts._run_experts`: the first n_slots - 1 experts started, the latent down-projection
    streamed, then per item the one n_slots - 1 ahead started and this one waited for; the
    latent norm's gain, then the up-projection."""
    w, n_slots = call.weights, options.n_slots
    parts = [(expert_dma_name(m, name), planned.nbytes(part.shape[1:], part.dtype))
             for m in EXPERT_MATRICES
             for name, part in zip(quant.part_names(options.expert_format), w["experts"][m])]

    def start(i):  # every stored part of item i's expert into slot i mod n_slots
        return [call.start(name, size, buffer=planned.EXPERT_SLOTS, slot=i % n_slots, item=i)
                for name, size in parts]

    out = [dma for i in range(min(n_slots - 1, len(items))) for dma in start(i)]
    latent = "w_ld" in w  # experts on the full d (moe_full) have no latent projections
    out += _stream(call, LATENT_DOWN, w["w_ld"]) if latent else []
    for i in range(len(items)):
        ahead = i if n_slots == 1 else i + n_slots - 1
        out += start(ahead) if ahead < len(items) else []
        out += [dma.waited() for dma in start(i)]
    if not latent:
        return out
    out += call.copy(LATENT_NORM, planned.nbytes(w["latent_norm"]), buffer=planned.WHOLE)
    return out + _stream(call, LATENT_UP, w["w_lu"])


def moe_schedule(plan: MoePlan, call: planned.StageCall) -> list[planned.PlannedDma]:
    """`experts.moe_layer_body`: the router (its matrix, its bias, its choices to SMEM), the
    routed experts of the layer's routing (call.expert_ids), the shared experts."""
    w, options = call.weights, dict(plan.router)
    out = call.matmul(router.W_ROUTER, w["w_router"], options["block_rows"])
    if options["use_bias"]:
        out += blocks.load_whole_dmas(call, router.BIAS, w["router_bias"])
    smem = router.routing_scratch(plan.batch, options["top_k"])[2:]  # ids, weights in SMEM
    to_smem = [call.start(name, planned.nbytes(dst.shape, dst.dtype), buffer=planned.ROUTING,
                          src="vmem", dst="smem") for name, dst in zip(router.TO_SMEM, smem)]
    out += to_smem + [dma.waited() for dma in to_smem]
    items = work_list(plan.stage.plan, w["experts"]["w1"][0].shape[0], call.expert_ids)
    out += _routed_dmas(plan.stage, call, items)
    shared = gate_up.parts(w, SHARED_KEYS)
    if shared is not None:
        out += _gated_mlp_dmas(call, plan.stage.always_on_name, shared)
    return out


MOE_KERNEL = register(KernelStage(
    name="moe", plan=_moe_plan, prepare=_moe_prepare, streamed=_moe_streamed,
    body=moe_layer_body, vmem=_moe_vmem, scope=lambda plan: "MoE", cost=_moe_cost,
    scratch=lambda cfg, batch: tuple(zip(("router ids", "router weights", "router ids (SMEM)",
                                          "router weights (SMEM)"),
                                         router.routing_scratch(batch, cfg.top_k))),
    scratch_bundle=lambda refs: router.Routing(*refs), schedule=moe_schedule))
DENSE_KERNEL = register(KernelStage(
    name="dense", plan=lambda cfg, batch, seq_len, options: dense_options(cfg),
    prepare=lambda stack, cfg: gate_up.fuse(dict(stack), gate_up.DENSE_KEYS),
    streamed=_dense_streamed, body=dense_body, vmem=lambda plan, cfg: [],
    scope=lambda plan: "dense",
    cost=lambda plan, weights, state, cfg, batch: costs.ffn(
        plan, batch, 0, None, gate_up.parts(weights, gate_up.DENSE_KEYS)),
    schedule=lambda plan, call: _gated_mlp_dmas(call, plan.always_on_name,
                                                gate_up.parts(call.weights, gate_up.DENSE_KEYS))))
