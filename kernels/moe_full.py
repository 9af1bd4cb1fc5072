"""The MoE layer on the full d (kind "moe_full": DeepSeek-V3, GLM-4.5, Qwen3) as one Pallas TPU
kernel: kernel twins of `mkresearch.stages.moe_full` (moe_full_ffn, routed_experts).

No new body: `experts.moe_layer_body` runs the router (`router.router_body`, with the group-limited
first stage and the renormalise switch of the family) and the FFN stage (`experts.ffn_stage_body`)
whose routed part, given no latent weights, runs the experts on x itself and returns their
weighted sum in ascending expert id; the shared experts are its always-on MLP. Expert weights
stream from HBM in their stored format through the same slot ring as Kimi K3's ("expert/" DMAs),
each distinct expert of the batch once (plan "unique").
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels import costs, dma, experts, router

from mkresearch import tpu
from mkresearch.config import ModelConfig

_VMEM, _SMEM = pltpu.MemorySpace.VMEM, pltpu.MemorySpace.SMEM


def stage_options(cfg: ModelConfig, plan: str = "unique", n_slots: int = 2,
                  chip: Any = None) -> experts.StageOptions:
    """The FFN stage's static options for a full-d MoE: the experts' width is d_model."""
    options = experts._options(cfg, plan, n_slots, chip=chip)
    return experts.StageOptions(**{**options.__dict__, "latent": cfg.d_model,
                                   "latent_padded": cfg.d_model})


def router_options(cfg: ModelConfig) -> tuple:
    """The router body's static options for cfg, the family's grouping and normalising included
    (hashable: part of a jit cache key)."""
    return experts.router_options(cfg) + (
        ("groups", cfg.router_groups), ("topk_groups", cfg.router_topk_groups),
        ("normalize", cfg.router_normalize))


def routed_tree(p: dict, cfg: ModelConfig) -> dict:
    """The routed part of one layer's weights for `experts.ffn_stage_body`: experts only."""
    return {"experts": experts._expert_parts(p["experts"], cfg, width=cfg.d_model)}


def shared_tree(p: dict, cfg: ModelConfig) -> dict | None:
    if not cfg.n_shared_experts:
        return None
    return {"w_gate": p["w_sg"], "w_up": p["w_su"], "w_down": p["w_sd"]}


def _spec(space):
    return pl.BlockSpec(memory_space=space)


@functools.partial(jax.jit, static_argnames=("options", "router_opts", "interpret",
                                             "recording"))
def _layer_call(x, w_router, router_bias, routed, always_on, *, options, router_opts,
                interpret, recording):
    del recording  # static only so recorded and silent traces never share a jit cache entry
    batch, top_k = x.shape[0], dict(router_opts)["top_k"]
    out_shape = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    cost = (costs.router(batch, w_router, router_bias if dict(router_opts)["use_bias"] else None)
            + costs.ffn(options, batch, top_k, routed, always_on))
    hbm = functools.partial(jax.tree.map, lambda _: _spec(pl.ANY))
    return pl.pallas_call(
        functools.partial(experts.moe_layer_body, options=options, router_options=dict(router_opts)),
        out_shape=out_shape,
        in_specs=(_spec(_VMEM), _spec(pl.ANY), _spec(pl.ANY), hbm(routed), hbm(always_on)),
        out_specs=_spec(_VMEM),
        scratch_shapes=[pltpu.VMEM((batch, top_k), jnp.int32),
                        pltpu.VMEM((batch, top_k), jnp.float32),
                        pltpu.SMEM((batch, top_k), jnp.int32),
                        pltpu.SMEM((batch, top_k), jnp.float32)],
        cost_estimate=cost.estimate(x, out_shape),
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=experts.VMEM_LIMIT_BYTES),
    )(x, w_router, router_bias, routed, always_on)


def moe_full_ffn(p: dict, x: jax.Array, cfg: ModelConfig, *, plan: str = "unique",
                 n_slots: int = 2, chip: Any = None) -> jax.Array:
    """Kernel twin of stages.moe_full.moe_full_ffn -> bf16 [B, d]: router + experts on the full
    d + shared experts, one kernel. chip: the kernel is built for it (None: tpu.target_chip())."""
    options = stage_options(cfg, plan, n_slots, chip=chip)
    experts._check_x(x, cfg.d_model)
    router.check_router_args(x, p["w_router"], p["router_bias"], cfg.top_k, cfg.router_score)
    bias = p["router_bias"].astype(jnp.float32).reshape(1, -1)  # not read unless cfg.router_bias
    return _layer_call(x, p["w_router"], bias, routed_tree(p, cfg), shared_tree(p, cfg),
                       options=options, router_opts=router_options(cfg),
                       interpret=tpu.interpret_params(), recording=dma.is_recording())


def routed_experts(p: dict, x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array,
                   cfg: ModelConfig, *, plan: str = "unique", n_slots: int = 2,
                   chip: Any = None) -> jax.Array:
    """Kernel twin of stages.moe_full.routed_experts -> f32 [B, d] (no shared experts)."""
    options = stage_options(cfg, plan, n_slots, chip=chip)
    experts._check_x(x, cfg.d_model)
    experts.check_routing(expert_ids, expert_weights, x.shape[0], cfg.n_experts)
    return experts._stage_call(x, expert_ids, expert_weights.astype(jnp.float32),
                               routed_tree(p, cfg), None, options=options,
                               out_dtype=jnp.float32, interpret=tpu.interpret_params(),
                               recording=dma.is_recording())

