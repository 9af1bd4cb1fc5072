"""MoE router as a Pallas TPU kernel (docs/kimi-k3.md §6.1): which experts each row uses, and how much.

    r = x · W_r                       f32 accumulation         x [B, d] bf16, W_r [d, E] bf16
    s = σ(r)            (sigmoid)     or softmax(r) over E     (cfg.router_score)
    groups              with cfg.router_groups > 1, only the router_topk_groups groups whose two
                        best s + b sum highest stay eligible (DeepSeek-V3, `limit_to_groups`)
    top-k of s + b      iterated argmax, the lower index wins ties; b (f32) only selects
    w = s_top / Σ s_top · routed_scale                        weights from the *uncorrected* s
                                                              (no division: router_normalize off)
    topk_softmax        GPT-OSS: s = r + b (the bias in the logits), top-k of s, w = a softmax
                        over the k chosen s

The selection is k rounds of "max, then the lowest index holding it, then mask it out" over the
whole [B, E] tile at once: vector work only, no sort. The ids and weights are written to VMEM and
then DMA'd to SMEM, where the expert stage reads them as scalars to address its weight DMAs (a
vector store to SMEM does not exist; a VMEM->SMEM DMA does).

W_r streams from HBM through `blocks.stream_matmul`, the bias arrives by DMA too: every byte the
router reads is in the DMA log.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, chip_log, costs, dma, dry_run, planned

from mkresearch.hardware import tpu
from mkresearch.model.config import ROUTER_SCORES, ModelConfig

# DMA-log names of the router's matrix, its bias, and its choices copied VMEM -> SMEM (ids, weights)
W_ROUTER, BIAS = "router/w_router", "router/bias"
TO_SMEM = ("router/ids_to_smem", "router/weights_to_smem")
ROUTING = "routing"  # what a dry run is given: a layer's expert ids [B, k] (`dry_run.given`)


def worst_routing(n_experts: int, batch: int, top_k: int) -> np.ndarray:
    """[B, k] expert ids sharing no expert while they can: min(E, B·k) distinct experts (the
    cost estimate's worst case, `kernels/base/costs.py`)."""
    return (np.arange(batch * top_k).reshape(batch, top_k) % n_experts).astype(np.int32)


@dataclass(frozen=True)
class Routing:
    """Where the router leaves its choices for the expert stage: ids [B, k] i32 and weights
    [B, k] f32 in VMEM (vector compares) and in SMEM (scalars that address the expert DMAs)."""

    ids: Any
    weights: Any
    ids_smem: Any
    weights_smem: Any


def routing_scratch(batch: int, top_k: int) -> tuple:
    """The scratch shapes of a Routing (VMEM ids, weights; SMEM ids, weights)."""
    return (pltpu.VMEM((batch, top_k), jnp.int32), pltpu.VMEM((batch, top_k), jnp.float32),
            pltpu.SMEM((batch, top_k), jnp.int32), pltpu.SMEM((batch, top_k), jnp.float32))


def router_body(x_ref: Any, w_router_hbm: Any, bias_hbm: Any, routing: Any, *, stream: Any,
                top_k: int, router_score: str, use_bias: bool, routed_scale: float,
                block_rows: int, groups: int = 1, topk_groups: int = 1,
                normalize: bool = True, logits: Any = None) -> None:
    """x_ref [B, d] bf16 (VMEM); w_router_hbm [d, E] bf16, bias_hbm [1, E] f32 (HBM).
    Writes routing.ids [B, k] i32 and routing.weights [B, k] f32 (VMEM) and their SMEM copies
    (routing: a Routing). groups > 1: only the topk_groups best of `groups` equal groups are
    eligible (`limit_to_groups`); normalize: weights divided by their sum (else the plain
    scores); logits: r [B, E] f32 when the caller streamed W_r already (a rank: gathered with
    W_ld's columns, `experts.moe_layer_body`)."""
    ids_ref, weights_ref = routing.ids, routing.weights
    ids_smem, weights_smem = routing.ids_smem, routing.weights_smem
    if logits is None:
        logits = blocks.stream_matmul(stream, x_ref[...], w_router_hbm, rows=block_rows,
                                      name=W_ROUTER)  # [B, E] f32 (on a rank: columns gathered)
    batch, n_experts = logits.shape
    bias = blocks.load_whole(bias_hbm, name=BIAS) if use_bias else None  # [1, E] f32
    with dma.phase("router/select", vmem_bytes=batch * n_experts * 4):
        ids_ref[...], weights_ref[...] = _choose(logits, bias, top_k, router_score, routed_scale,
                                                 groups, topk_groups, normalize)

    def to_smem(sems):
        copies = [dma.Copy(vmem, smem, sems.at[i], name=name, buffer=planned.ROUTING)
                  for i, (vmem, smem, name) in
                  enumerate(zip((ids_ref, weights_ref), (ids_smem, weights_smem), TO_SMEM))]
        for copy in copies:
            copy.start()
        for copy in copies:
            copy.wait()
        # a dry run fetches the experts of the routing it is given (`dry_run.given`)
        given = dry_run.given(ROUTING, jax.ShapeDtypeStruct(ids_smem.shape, jnp.int32),
                              dry_run.owner()[1])
        if given is not None:
            ids_smem[...] = given

    pl.run_scoped(to_smem, pltpu.SemaphoreType.DMA((2,)))


def _choose(logits: jax.Array, bias: Any, top_k: int, router_score: str, routed_scale: float,
            groups: int, topk_groups: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(ids [B, k] i32, weights [B, k] f32) from the logits [B, E] f32: k rounds of max, then
    the lowest index holding it, then masked out; the weights from the uncorrected scores."""
    batch, n_experts = logits.shape
    if router_score == "topk_softmax":  # GPT-OSS: the bias is the router's own, in the logits
        scores = logits + bias if bias is not None else logits
    elif router_score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = blocks.softmax(logits)
    select = scores  # [B, E] f32
    if bias is not None and router_score != "topk_softmax":  # the correction bias selects only
        select = scores + bias
    expert_iota = jax.lax.broadcasted_iota(jnp.int32, (batch, n_experts), 1)
    if groups > 1:
        select = limit_to_groups(select, expert_iota, groups, topk_groups)
    k_iota = jax.lax.broadcasted_iota(jnp.int32, (batch, top_k), 1)
    ids = jnp.zeros((batch, top_k), jnp.int32)
    chosen = jnp.zeros((batch, top_k), jnp.float32)
    for i in range(top_k):
        best = jnp.max(select, axis=-1, keepdims=True)  # [B, 1]
        # lowest index holding the max: ties go to the lower expert id, like the reference
        index = jnp.min(jnp.where(select == best, expert_iota, n_experts), axis=-1,
                        keepdims=True)  # [B, 1]
        hit = expert_iota == index  # [B, E], one True per row
        ids = jnp.where(k_iota == i, index, ids)
        chosen = jnp.where(k_iota == i, jnp.sum(jnp.where(hit, scores, 0.0), axis=-1,
                                                 keepdims=True), chosen)
        select = jnp.where(hit, -jnp.inf, select)
    if router_score == "topk_softmax":  # a softmax over the k chosen logits
        chosen = blocks.softmax(chosen)
    elif normalize:
        chosen = chosen / blocks.ordered_sum(chosen, keepdims=True)
    return ids, chosen * routed_scale


def limit_to_groups(select: jax.Array, expert_iota: jax.Array, groups: int,
                    topk_groups: int) -> jax.Array:
    """Stage one of the two-stage top-k (DeepSeek-V3's group-limited routing), on vectors:
    select [B, E] with every expert outside the topk_groups best groups set to −inf.

    A group's score is the sum of its two largest entries (first + second, the second found
    after masking one instance of the first). The groups are kept by iterated argmax over those
    scores broadcast to their experts ([B, E], no [B, G] relayout), the lower group winning a tie,
    as `stages.ffn.limit_to_groups`. Static loops over the (few) groups.
    """
    size = select.shape[1] // groups
    member = [(expert_iota >= g * size) & (expert_iota < (g + 1) * size) for g in range(groups)]
    group_of = sum(jnp.where(m, g, 0) for g, m in enumerate(member))  # [B, E] i32
    group_scores = jnp.zeros(select.shape, jnp.float32)  # each expert: its group's score
    for m in member:
        values = jnp.where(m, select, -jnp.inf)
        first = jnp.max(values, axis=-1, keepdims=True)  # [B, 1]
        first_at = jnp.min(jnp.where(values == first, expert_iota, select.shape[1]), axis=-1,
                           keepdims=True)
        second = jnp.max(jnp.where(expert_iota == first_at, -jnp.inf, values), axis=-1,
                         keepdims=True)
        group_scores = jnp.where(m, first + second, group_scores)
    kept = jnp.zeros(select.shape, jnp.bool_)
    for _ in range(topk_groups):
        best = jnp.max(group_scores, axis=-1, keepdims=True)
        group = jnp.min(jnp.where(group_scores == best, group_of, groups), axis=-1, keepdims=True)
        hit = group_of == group
        kept, group_scores = kept | hit, jnp.where(hit, -jnp.inf, group_scores)
    return jnp.where(kept, select, -jnp.inf)


def check_router_args(x: Any, w_router: Any, router_bias: Any, top_k: Any, router_score: Any) -> None:
    """ValueError naming the bad parameter, before anything is traced."""
    if router_score not in ROUTER_SCORES:
        raise ValueError(f"router_score={router_score!r} is invalid: one of "
                         f"{', '.join(map(repr, ROUTER_SCORES))}")
    if getattr(x, "ndim", None) != 2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bf16 [B, d], got {getattr(x, 'shape', x)} "
                         f"{getattr(x, 'dtype', '')}")
    if getattr(w_router, "ndim", None) != 2 or w_router.shape[0] != x.shape[1]:
        raise ValueError(f"w_router must be [d={x.shape[1]}, E], got "
                         f"{getattr(w_router, 'shape', w_router)}")
    n_experts = w_router.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k!r} is invalid: an int in [1, n_experts={n_experts}]")
    if router_bias is not None and tuple(router_bias.shape) != (n_experts,):
        raise ValueError(f"router_bias must be [E={n_experts}] f32, got {router_bias.shape}")


@functools.partial(jax.jit, static_argnames=("top_k", "router_score", "routed_scale",
                                             "groups", "topk_groups", "normalize",
                                             "interpret", "recording"))
def _route_call(x, w_router, router_bias, *, top_k, router_score, routed_scale, groups,
                topk_groups, normalize, interpret, recording):
    del recording  # static only so recorded and silent traces never share a jit cache entry
    batch, n_experts = x.shape[0], w_router.shape[1]
    use_bias = router_bias is not None
    bias = (router_bias if use_bias else jnp.zeros((n_experts,), jnp.float32))
    bias = bias.astype(jnp.float32).reshape(1, n_experts)
    rows = blocks.weight_block_rows(w_router.shape, w_router.dtype)
    def body(x_ref, w_router_ref, bias_ref, ids_ref, weights_ref, ids_smem, weights_smem):
        router_body(x_ref, w_router_ref, bias_ref,
                    Routing(ids_ref, weights_ref, ids_smem, weights_smem),
                    stream=blocks.LOCAL_STREAM, top_k=top_k, router_score=router_score,
                    use_bias=use_bias, routed_scale=routed_scale, block_rows=rows,
                    groups=groups, topk_groups=topk_groups, normalize=normalize)
    vmem, smem = pltpu.MemorySpace.VMEM, pltpu.MemorySpace.SMEM
    out_shape = (jax.ShapeDtypeStruct((batch, top_k), jnp.int32),
                 jax.ShapeDtypeStruct((batch, top_k), jnp.float32))
    call = functools.partial(
        pl.pallas_call, body,
        out_shape=out_shape * 2,
        in_specs=[pl.BlockSpec(memory_space=vmem), pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=(pl.BlockSpec(memory_space=vmem),) * 2 + (pl.BlockSpec(memory_space=smem),) * 2,
        interpret=interpret)
    # read off the body (kernels/base/costs.py): its dry run states the routing as given
    worst = worst_routing(n_experts, batch, top_k)
    ids, weights, ids_smem, weights_smem = costs.costed_call(
        call, x, w_router, bias, io=(x, out_shape * 2), given={ROUTING: lambda layer: worst})
    del ids, weights  # the SMEM copies are what the expert stage consumes
    return ids_smem, weights_smem


def route(p: dict, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Kernel twin of reference.route: (expert_ids [B, k] i32, expert_weights [B, k] f32).

    p: one MoE layer's weights (w_router [d, E], router_bias [E]); x: normalised [B, d] bf16."""
    return route_with(x, p["w_router"], p["router_bias"] if cfg.router_bias else None,
                      top_k=cfg.top_k, router_score=cfg.router_score,
                      routed_scale=cfg.routed_scale, groups=cfg.router_groups,
                      topk_groups=cfg.router_topk_groups, normalize=cfg.router_normalize)


def route_with(x: jax.Array, w_router: jax.Array, router_bias: jax.Array | None, *, top_k: int,
               router_score: str = "sigmoid", routed_scale: float = 1.0, groups: int = 1,
               topk_groups: int = 1, normalize: bool = True):
    """The router kernel with explicit options (the notebook varies them one at a time)."""
    check_router_args(x, w_router, router_bias, top_k, router_score)
    check_groups(w_router.shape[1], top_k, groups, topk_groups, normalize)
    return chip_log.run(
        lambda x, w_router, router_bias: _route_call(
            x, w_router, router_bias, top_k=top_k, router_score=router_score,
            routed_scale=float(routed_scale), groups=groups, topk_groups=topk_groups,
            normalize=normalize, interpret=tpu.interpret_params(), recording=dma.is_recording()),
        x, w_router, router_bias, given=lambda out: {ROUTING: lambda layer: out[0]})


def check_groups(n_experts: int, top_k: int, groups: Any, topk_groups: Any,
                 normalize: Any) -> None:
    """ValueError naming the bad grouping option (as ModelConfig validates it)."""
    if (isinstance(groups, bool) or not isinstance(groups, int) or groups < 1
            or n_experts % groups or (groups > 1 and n_experts // groups < 2)):
        raise ValueError(f"groups={groups!r} is invalid: a divisor of n_experts={n_experts} "
                         "leaving at least 2 experts per group")
    if (isinstance(topk_groups, bool) or not isinstance(topk_groups, int)
            or not 1 <= topk_groups <= groups or top_k > topk_groups * (n_experts // groups)):
        raise ValueError(f"topk_groups={topk_groups!r} is invalid: an int in [1, groups={groups}]"
                         f" whose groups hold at least top_k={top_k} experts")
    if not isinstance(normalize, bool):
        raise ValueError(f"normalize={normalize!r} is invalid: True or False")


# ---- the experts' work list (kernels/stages/experts.py): which expert each loop step fetches ----------
def choice(i: Any, top_k: int) -> tuple[Any, Any]:
    """Flat choice index i -> (row, k). lax.div/rem: i >= 0, and jnp's floor // and % lower
    through a sign op that needs a TPU device to lower."""
    return lax.div(i, top_k), lax.rem(i, top_k)


def dedupe_experts(ids_smem: Any, unique_ref: Any, seen_ref: Any, first: Any = 0,
                   n_local: int | None = None) -> jax.Array:
    """Distinct expert ids of the batch, in ascending order, into unique_ref [B*k] (SMEM);
    returns their count. seen_ref [E] (SMEM) is a scratch table. Scalar work: about 3E + 2·B·k
    SMEM accesses, done before any expert DMA is issued. On a rank of a sharded model only its
    experts, ids first..first+n_local-1, are kept, as local ids (id - first).

    Ascending order, not the order of first use: each row then adds its experts' contributions
    in id order whatever the other rows of the batch chose, so a row's f32 sum (and its bf16
    rounding) is batch-invariant and is the reference's (`reference.routed_experts`)."""
    batch, top_k = ids_smem.shape

    def clear(e, carry):
        seen_ref[e] = 0
        return carry

    lax.fori_loop(0, seen_ref.shape[0], clear, 0)

    def mark(i, carry):
        seen_ref[ids_smem[choice(i, top_k)]] = 1
        return carry

    lax.fori_loop(0, batch * top_k, mark, 0)

    def compact(e, count):
        used = seen_ref[e if n_local is None else first + e] != 0

        @pl.when(used)
        def _():
            unique_ref[count] = e

        return count + used.astype(jnp.int32)

    return lax.fori_loop(0, seen_ref.shape[0] if n_local is None else n_local, compact,
                         jnp.int32(0))
