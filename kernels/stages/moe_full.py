"""The MoE layer on the full d (kind "moe_full": DeepSeek-V3, GLM-4.5, Qwen3) as one Pallas TPU
kernel: kernel twins of `mkresearch.model.stages.moe_full` (moe_full_ffn, routed_experts).

No new body: `experts.moe_layer_body` runs the router (`router.router_body`, with the group-limited
first stage and the renormalise switch of the family) and the FFN stage (`experts.ffn_stage_body`)
whose routed part, given no latent weights, runs the experts on x itself and returns their
weighted sum in ascending expert id; the shared experts are its always-on MLP. Expert weights
stream from HBM in their stored format through the same slot ring as Kimi K3's ("expert/" DMAs),
each distinct expert of the batch once (plan "unique").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import chip_log, dma, quant
from mkresearch.kernels.base.registry import KernelStage, Streamed, register
from mkresearch.kernels.stages import experts, gate_up, router

from mkresearch.hardware import tpu
from mkresearch.model.config import ModelConfig
from mkresearch.model.stages.ffn import EXPERT_BIASES

_VMEM, _SMEM = pltpu.MemorySpace.VMEM, pltpu.MemorySpace.SMEM


def stage_options(cfg: ModelConfig, plan: str = "unique", n_slots: int = 2,
                  chip: Any = None) -> experts.StageOptions:
    """The FFN stage's static options for a full-d MoE: the experts' width is d_model."""
    options = experts.stage_options(cfg, plan, n_slots, chip=chip)
    return experts.StageOptions(**{**options.__dict__, "latent": cfg.d_model,
                                   "latent_padded": cfg.d_model})


def router_options(cfg: ModelConfig) -> tuple:
    """The router body's static options for cfg, the family's grouping and normalising included
    (hashable: part of a jit cache key)."""
    return experts.router_options(cfg) + (
        ("groups", cfg.router_groups), ("topk_groups", cfg.router_topk_groups),
        ("normalize", cfg.router_normalize))


def routed_tree(p: dict, cfg: ModelConfig) -> dict:
    """The routed part of one layer's weights for `experts.ffn_stage_body`: experts only (with
    GPT-OSS's biases as 1-tuples [E, 1, n])."""
    return {"experts": {**experts.expert_parts(p["experts"], cfg, width=cfg.d_model),
                        **_biases(p["experts"], 1)}}


def _biases(tree: dict, axis: int) -> dict:
    """The experts' biases (cfg.expert_bias) as the expert loop takes them: 1-tuples with a
    row axis before the last, [.., E, 1, n] (`axis`: where E is)."""
    return {b: (jnp.expand_dims(tree[b], axis),) for b in EXPERT_BIASES.values() if b in tree}


def shared_tree(p: dict, cfg: ModelConfig) -> dict | None:
    if not cfg.n_shared_experts:
        return None
    return {"w_gate": p["w_sg"], "w_up": p["w_su"], "w_down": p["w_sd"]}


def moe_full_ffn(p: dict, x: jax.Array, cfg: ModelConfig, *, plan: str = "unique",
                 n_slots: int = 2, chip: Any = None) -> jax.Array:
    """Kernel twin of stages.moe_full.moe_full_ffn -> bf16 [B, d]: router + experts on the full
    d + shared experts, one kernel. chip: the kernel is built for it (None: tpu.target_chip())."""
    quant.check_runs_here(chip)
    options = stage_options(cfg, plan, n_slots, chip=chip)
    experts.check_input(x, cfg.d_model)
    router.check_router_args(x, p["w_router"], p["router_bias"], cfg.top_k, cfg.router_score)
    bias = p["router_bias"].astype(jnp.float32).reshape(1, -1)  # not read unless cfg.router_bias
    return chip_log.run(
        lambda *args: experts.moe_layer_call(*args, options=options,
                                             router_options=router_options(cfg),
                                             interpret=tpu.interpret_params(),
                                             recording=dma.is_recording()),
        x, p["w_router"], bias, routed_tree(p, cfg), shared_tree(p, cfg),
        given=lambda _: experts.reference_routing(p, x, cfg))


def routed_experts(p: dict, x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array,
                   cfg: ModelConfig, *, plan: str = "unique", n_slots: int = 2,
                   chip: Any = None) -> jax.Array:
    """Kernel twin of stages.moe_full.routed_experts -> f32 [B, d] (no shared experts)."""
    quant.check_runs_here(chip)
    options = stage_options(cfg, plan, n_slots, chip=chip)
    experts.check_input(x, cfg.d_model)
    experts.check_routing(expert_ids, expert_weights, x.shape[0], cfg.n_experts)
    return chip_log.run(
        lambda *args: experts.stage_call(*args, None, options=options, out_dtype=jnp.float32,
                                         interpret=tpu.interpret_params(),
                                         recording=dma.is_recording()),
        x, expert_ids, expert_weights.astype(jnp.float32), routed_tree(p, cfg))


# ---- the kind in the kernel registry (what the megakernel composes) ----------------------------
def _prepare(stack: dict, cfg: ModelConfig) -> dict:
    """The layers' stacked weights as the MoE body reads them: the router bias as [n, 1, E] f32,
    each expert matrix as the tuple of its stored parts."""
    out = {"w_router": stack["w_router"],
           "router_bias": stack["router_bias"].astype(jnp.float32).reshape(
               stack["router_bias"].shape[0], 1, -1),
           "experts": {**{m: tuple(quant.split_parts(stack["experts"][m], cfg.expert_format))
                          for m in experts.EXPERT_MATRICES}, **_biases(stack["experts"], 2)}}
    if cfg.n_shared_experts:
        out.update(gate_up.fuse({key: stack[key] for key in experts.SHARED_KEYS.values()},
                                experts.SHARED_KEYS))
    return out


def _streamed(cfg: ModelConfig) -> tuple[Streamed, ...]:
    """In the body's order: the router, then the shared experts."""
    d = cfg.d_model
    out = [Streamed("w_router", "router/w_router", (d, cfg.n_experts))]
    if cfg.n_shared_experts:
        shapes = {"w_gate": (d, cfg.shared_hidden), "w_up": (d, cfg.shared_hidden),
                  "w_down": (cfg.shared_hidden, d)}
        out += [Streamed(key, f"shared/{part}", shapes[part])
                for part, key in experts.SHARED_KEYS.items()]
    return tuple(out)


KERNEL = register(KernelStage(
    name="moe_full",
    plan=lambda cfg, batch, seq_len, options: experts.MoePlan(
        stage_options(cfg, options.expert_plan, options.expert_slots, chip=options.chip),
        router_options(cfg), batch),
    prepare=_prepare, streamed=_streamed, body=experts.moe_layer_body,
    scope=lambda plan: "MoE (full d)",
    scratch=lambda cfg, batch: tuple(zip(("router ids", "router weights", "router ids (SMEM)",
                                          "router weights (SMEM)"),
                                         router.routing_scratch(batch, cfg.top_k))),
    scratch_bundle=lambda refs: router.Routing(*refs)))

