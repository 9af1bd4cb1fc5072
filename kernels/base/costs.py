"""What each kernel costs, for XLA: the `pl.CostEstimate` every `pallas_call` declares.

A Mosaic kernel is opaque to XLA. Without `pallas_call(cost_estimate=...)` its cost analysis
counts 0 FLOPs and none of the bytes the kernel moves by its own DMAs, only what XLA copies
around the call: an MoE layer that streams a GB looked like a few kB to XLA's scheduler and to
`tpu.compile_for(...).bytes_accessed`.

Each body's cost sits beside the body, in its kernel's module (`kda.layer_cost`,
`mla.layer_cost`, `gqa.layer_cost`, `mla_rope.layer_cost`, `router.cost`, `experts.cost`,
`sampling.cost`, `gemv.cost`, `quant.decode_cost`, a kind's `KernelStage.cost`): its `Cost`
(FLOPs, transcendentals, and the HBM bytes the body reads and writes by DMA) from shapes known
before tracing, the body's plan and one layer's weights and states. This module is what they
share. A stand-alone wrapper adds the operands and results Pallas copies between HBM and
VMEM/SMEM around the body (`Cost.estimate(*io)`); the megakernel sums the bodies over its layers
(`megakernel_plan.step_cost`), its activations never leaving VMEM. One cost model serves a
single device and a rank of the sharded kernel alike (one program for every rank, on a rank's
shapes), which is why it is a model over shapes and not the schedule's DMAs (a rank's differ:
the padding it skips, the embedding rows and experts it holds).

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


def matrices(weights: dict) -> list:
    """The weight matrices of an attention layer: named w_* (norms and gate vectors are not)."""
    return [w for name, w in weights.items() if name.startswith("w_")]


def attention(plan: Any, tokens: int, key_dims: int, value_dims: int) -> Cost:
    """Scores and the weighted sum over `tokens` cached tokens for every row and head."""
    rows = plan.batch * plan.n_heads * tokens
    return Cost(flops=2 * rows * (key_dims + value_dims), transcendentals=rows)
