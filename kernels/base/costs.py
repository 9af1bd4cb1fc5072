"""What each kernel costs, for XLA: the `pl.CostEstimate` every `pallas_call` declares.

A Mosaic kernel is opaque to XLA. Without `pallas_call(cost_estimate=...)` its cost analysis
counts 0 FLOPs and none of the bytes the kernel moves by its own DMAs, only what XLA copies
around the call: an MoE layer that streams a GB looked like a few kB to XLA's scheduler and to
`tpu.compile_for(...).bytes_accessed`.

One function per stage body returns its `Cost` (FLOPs, transcendentals, and the HBM bytes the
body reads and writes by DMA) from shapes known before tracing: the body's plan and the shapes of
one layer's weights and states. A stand-alone wrapper adds the operands and results Pallas copies
between HBM and VMEM/SMEM around the body (`Cost.estimate(*io)`); the megakernel sums the bodies
over its layers (`megakernel`), its activations never leaving VMEM.

Where the bytes depend on data, an estimate takes the most a call can move, so a run in that
worst case moves exactly the estimate:
  MLA KV          every row at the cache's last position S - 1: its S - 1 cached tokens, rounded
                  up to 16-row HBM tiles, are all S rows of the cache (the whole cache is read)
  routed experts  plan "unique": min(E, B·k) distinct experts (no two choices share one);
                  "routed": B·k fetches; "all": E
Weights are read once, states (KDA conv and recurrent, the MLA entry's 16-row block) read and
written once. FLOPs count the matmuls (2·M·K·N), the attention over the cache, the delta rule
and the final mix (the FLOPs the sampling stage's phase logs); other element-wise work of
O(B·d) per stage (norms, layer mixes, gates, the top-k selection) is left out. Transcendentals
count one per exp / sigmoid / tanh / rsqrt of the large tensors.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from mkresearch.kernels.base.kv_update import UPDATE_ROWS

# Transcendentals per hidden unit of a gated MLP: SiTU = 4·tanh(g/4)·σ(g)·25·tanh(u/25); SiLU σ.
ACTIVATION_TRANSCENDENTALS = {"situ": 3, "silu": 1, "swiglu": 1}


@dataclass(frozen=True)
class Cost:
    """FLOPs, transcendentals and HBM bytes (read + written) of a kernel or a stage body."""

    flops: int = 0
    transcendentals: int = 0
    bytes_accessed: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __mul__(self, count: int) -> Cost:  # a stage run `count` times (layers, experts)
        return Cost(*(int(count) * a for a in astuple(self)))

    __rmul__ = __mul__

    def estimate(self, *io: Any) -> pl.CostEstimate:
        """This cost plus the bytes of `io` (pytrees of arrays or shape structs: the operands
        and results Pallas copies into and out of VMEM/SMEM around the body), for pallas_call."""
        return pl.CostEstimate(flops=int(self.flops), transcendentals=int(self.transcendentals),
                               bytes_accessed=int(self.bytes_accessed + nbytes(*io)))


def nbytes(*trees: Any) -> int:
    """Bytes of every array (or shape struct) in the pytrees; None leaves count 0."""
    return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(trees))


def per_layer(tree: Any) -> Any:
    """Shape structs of one layer's slice of stacked arrays [n, ...] -> [...]."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)


def matmul_flops(rows: int, *matrices: Any) -> int:
    """2·rows·K·N summed over [K, N] matrices (arrays or shape structs)."""
    return sum(2 * rows * m.shape[0] * m.shape[1] for m in matrices)


def _matrices(weights: dict) -> list:
    """The weight matrices of an attention layer: named w_* (norms and gate vectors are not)."""
    return [w for name, w in weights.items() if name.startswith("w_")]


# ---- stage bodies -------------------------------------------------------------------------------
def kda(plan: Any, weights: dict) -> Cost:
    """KDA body (kernels/stages/kda.py) for plan.batch rows; weights: one layer's, by name (vectors as
    [n] or [1, n]). The conv and recurrent states are read and written whole."""
    b, h, d = plan.batch, plan.n_heads, plan.head_dim
    conv = b * (plan.conv_size - 1) * 3 * h * d * 2  # [B, conv-1, 3, H, D] bf16
    state = b * h * d * d * 4  # [B, H, D, D] f32
    # per (row, head): S̄ = e^λ·S (D²), S̄ᵀk (2D²), S̄ + k·(β(v − S̄ᵀk))ᵀ (2D²), Sᵀq (2D²);
    # λ (exp, sigmoid), SiLU of q, k, v, the output gate: 6 transcendentals per channel
    return Cost(flops=matmul_flops(b, *_matrices(weights)) + 7 * b * h * d * d,
                transcendentals=6 * b * h * d,
                bytes_accessed=nbytes(weights) + 2 * (conv + state))


def _attention(plan: Any, tokens: int, key_dims: int, value_dims: int) -> Cost:
    """Scores and the weighted sum over `tokens` cached tokens for every row and head."""
    rows = plan.batch * plan.n_heads * tokens
    return Cost(flops=2 * rows * (key_dims + value_dims), transcendentals=rows)


def mla(plan: Any, weights: dict, cache: dict) -> Cost:
    """MLA body (kernels/stages/mla.py); weights: one layer's by name; cache: the layer's two cache
    arrays [B, (H,) S, n]. Assumes every row at the last position (module docstring): the whole
    cache is read, plus the 16-row block around each new entry read and written."""
    kv = nbytes(cache)
    update = 2 * kv * UPDATE_ROWS // plan.seq_len  # per row and array: 16 rows in, 16 out
    if plan.layout == "expanded":  # per head q·[k^C | k^X], Σ α v
        keys, values = plan.qk_dim, plan.v_dim
    else:  # absorbed: q̃·ĉ + q^X·k^X, Σ α ĉ (W_kvb's two sides are in the w_kvb matmul below)
        keys, values = plan.kv_rank + plan.qk_extra, plan.kv_rank
    gate = plan.batch * plan.n_heads * plan.v_dim  # σ of the output gate
    return (_attention(plan, plan.seq_len, keys, values)
            + Cost(flops=matmul_flops(plan.batch, *_matrices(weights)), transcendentals=gate,
                   bytes_accessed=nbytes(weights) + kv + update))


def gqa(plan: Any, weights: dict, cache: Any) -> Cost:
    """GQA body (kernels/stages/gqa.py); weights: one layer's by name; cache: the layer's K and V
    [B, KV, S, D]. Every row at the last position: the whole cache is read, plus the 16-row
    block around each new entry read and written. Scores and Σ α v per query head; RoPE's
    cos and sin per row."""
    kv = nbytes(cache)
    update = 2 * kv * UPDATE_ROWS // plan.seq_len
    return (_attention(plan, plan.seq_len, plan.head_dim, plan.head_dim)
            + Cost(flops=matmul_flops(plan.batch, *_matrices(weights)),
                   transcendentals=plan.batch * plan.rope.dim,
                   bytes_accessed=nbytes(weights) + kv + update))


def mla_rope(plan: Any, weights: dict, cache: Any) -> Cost:
    """MLA-with-RoPE body (kernels/stages/mla_rope.py): the latent MLA's cost without the output gate,
    with RoPE's cos and sin per row."""
    gate = plan.batch * plan.n_heads * plan.v_dim
    return mla(plan, weights, cache) + Cost(transcendentals=plan.batch * plan.qk_extra - gate)


def mla_partial(plan: Any, cache: dict) -> Cost:
    """`mla_latent_partial` body over its shard: every row attends to the whole shard."""
    return (_attention(plan, plan.seq_len, plan.kv_rank + plan.qk_extra, plan.kv_rank)
            + Cost(bytes_accessed=nbytes(cache)))


def router(batch: int, w_router: Any, bias: Any | None) -> Cost:
    """Router body (kernels/stages/router.py): x W_r streamed, the bias if used, one score per logit.
    (The ids' VMEM -> SMEM copy is not HBM traffic.)"""
    return Cost(flops=matmul_flops(batch, w_router), transcendentals=batch * w_router.shape[1],
                bytes_accessed=nbytes(w_router, bias))


def experts_fetched(plan: str, n_experts: int, batch: int, top_k: int) -> int:
    """Experts one call DMAs, at most (module docstring): 'unique' min(E, B·k), 'routed' B·k,
    'all' E."""
    return {"all": n_experts, "routed": batch * top_k,
            "unique": min(n_experts, batch * top_k)}[plan]


def ffn(options: Any, batch: int, top_k: int, routed: dict | None,
        always_on: dict | None) -> Cost:
    """FFN stage body (kernels/stages/experts.py): routed latent experts (experts stacked [E, ...] in
    their stored parts) and/or the always-on gated MLP; one layer's weights."""
    per_unit = ACTIVATION_TRANSCENDENTALS[options.activation]
    cost = Cost()
    if routed is not None:
        w1, w3, w2 = (routed["experts"][m] for m in ("w1", "w3", "w2"))
        n_experts, hidden = w1[0].shape[0], w1[0].shape[-1]  # E, F
        latent = options.latent  # the width the experts work on: the latent, or d without one
        fetched = experts_fetched(options.plan, n_experts, batch, top_k)
        one_expert = nbytes(w1, w3, w2) // n_experts  # every stored part of W1, W3, W2
        if "w_ld" in routed:  # the latent down and up projections and norm
            cost += Cost(flops=matmul_flops(batch, routed["w_ld"], routed["w_lu"]),
                         bytes_accessed=nbytes(routed["w_ld"], routed["latent_norm"],
                                               routed["w_lu"]))
        # each fetched expert runs for all B rows (rows that did not choose it weigh 0)
        cost += fetched * Cost(flops=6 * batch * latent * hidden,
                               transcendentals=per_unit * batch * hidden,
                               bytes_accessed=one_expert)
    if always_on is not None:
        mats = list(always_on.values())  # W_gate, W_up (or the two as one [d, 2 S]), W_down
        cost += Cost(flops=matmul_flops(batch, *mats),
                     transcendentals=per_unit * batch * always_on["w_down"].shape[-2],
                     bytes_accessed=nbytes(mats))
    return cost


def sampling(batch: int, lm_head: Any, n_mixed: int) -> Cost:
    """Sampling stage body (kernels/stages/sampling.py): the final mix of n_mixed candidates (the FLOPs
    its phase logs), the LM head streamed once with the logits kept in VMEM; an exp
    (log-sum-exp) and the Gumbel noise's log per logit."""
    mix = 6 * n_mixed * batch * lm_head.shape[0]
    return Cost(flops=matmul_flops(batch, lm_head) + mix,
                transcendentals=2 * batch * lm_head.shape[1], bytes_accessed=nbytes(lm_head))


def gemv(batch: int, w: Any) -> Cost:
    """x [B, K] @ w [K, N] (kernels/base/gemv.py): w read once."""
    return Cost(flops=matmul_flops(batch, w), bytes_accessed=nbytes(w))


def decode(parts: tuple, expert_format: str) -> Cost:
    """quant.decode_body: the stored parts read once, one scale multiply per decoded value."""
    values = math.prod(parts[0].shape) * (8 if expert_format == "mxfp4" else 1)  # K·N
    return Cost(flops=0 if expert_format == "bf16" else values, bytes_accessed=nbytes(parts))
