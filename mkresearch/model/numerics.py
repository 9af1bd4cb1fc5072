"""The arithmetic every sublayer of the reference (and every kernel) shares: bf16 rounding, the
matmul, reductions in one written-out order, RMSNorm, the activations and the attention-residual
mix (docs/kimi-k3.md §2–§3).

Conventions:
- `bf(x)` rounds to bf16 exactly where the spec writes bf(...);
- every matmul takes bf16 inputs and accumulates in f32 (`matmul`); f32 x f32 contractions (the KDA
  recurrence, softmax-weighted sums) use Precision.HIGHEST so a TPU computes them in full f32 too.
  Every product states its precision (`precision_for`): a TPU computes an f32 operand in one bf16
  pass at DEFAULT, a CPU in f32, so an unstated one would differ between them;
- batch invariance: every reduction is `ordered_sum` (one written-out order) and no matmul runs
  on a row count other than a multiple of 8 (`padded_rows`), so a row's result is the same bits
  whatever the batch; nor on one column (`lane_columns`), so a column's result is the same bits
  whatever the columns beside it (a rank's column slice of a matrix).

The kernels call these same functions on VMEM values (`kernels/base/blocks.py`), so they round and sum
exactly as the reference does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mkresearch.model.model_config import LANE, ModelConfig

f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
HIGHEST = lax.Precision.HIGHEST
# bf16 (or fp8) operands: one MXU pass computes each product exactly in f32 on every chip
EXACT_PRODUCTS = lax.Precision.DEFAULT


def einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum of two operands into f32 at the precision they call for (`precision_for`)."""
    return jnp.einsum(spec, a, b, preferred_element_type=f32, precision=precision_for(a, b))


def precision_for(*operands: Any) -> lax.Precision:
    """The precision a product of these operands is asked for: HIGHEST when one is f32 (a TPU's
    DEFAULT would round it to bf16 first), else EXACT_PRODUCTS (narrower operands are exact)."""
    return HIGHEST if any(jnp.dtype(o.dtype) == f32 for o in operands) else EXACT_PRODUCTS


def bf(x: jax.Array) -> jax.Array:
    """Round to bf16 (the spec's bf(...))."""
    return x.astype(bf16)


def matmul(a: jax.Array, b: Any) -> jax.Array:
    """a [M, K] @ b [K, N] with bf16 inputs and f32 accumulation (how every matmul of the model
    runs), batch-invariant: see `padded_rows`. b may be `Partials` (a sharded reference)."""
    if isinstance(b, Partials):
        return b.contract(a)
    return padded_rows(lambda a2: lane_columns(
        lambda w: jnp.matmul(a2.astype(bf16), w.astype(bf16), preferred_element_type=f32,
                             precision=EXACT_PRODUCTS), b), a)


def lane_columns(product, w: jax.Array) -> jax.Array:
    """product(w) for w [..., K, N]; a one-column w (N = 1) given as a lane of LANE copies of
    its column, the first copy's result kept ([..., M, 1]), so that a column's bits never
    depend on how many columns its product has.

    XLA:CPU sums a matrix-vector product in another order than a column of a wider product
    (measured: a [K, 1] bf16 product differs from column 0 of the [K, N] one for every
    N from 2 to 512 in every trial, while those agree with each other). A matrix split by its
    output columns across ranks gives a rank a one-column slice where a head has one column
    (KDA's W_b [d, H] on a rank holding one head): without this its β, and so its recurrent
    state, differ from the single device's in the last bits (issue 79). On a TPU a [K, 1]
    block fills a lane tile anyway."""
    if w.shape[-1] != 1:
        return product(w)
    return lax.slice_in_dim(product(jnp.broadcast_to(w, w.shape[:-1] + (LANE,))), 0, 1, axis=-1)


def host_ordered_sum(parts: list, hosts: tuple[int, ...] = (), wire: str = "f32") -> jax.Array:
    """Σ of `parts` (one per rank, in rank order) in the one order every partial-sum reduction
    of the sharded megakernel adds them, whatever its algorithm (`kernels/sharded/collectives.py`):
    the parts of each host first (consecutive parts with the same entry of `hosts`, in order),
    then the hosts' sums in host order. hosts () or all equal: one running sum in part order.
    A bf16 wire (`wire_round`): each host's sum rounded to bf16 before the hosts' sums are
    added, and the total rounded once more: the values a reduction sent in levels puts on the
    wire (a host's sum to the other hosts, rs-ag's summed chunks to its host), so every
    algorithm gives the same bits."""
    if hosts and len(hosts) != len(parts):
        raise ValueError(f"hosts={hosts!r} is invalid: one host per part ({len(parts)})")
    sums, last = [], None
    for i, part in enumerate(parts):
        host = hosts[i] if hosts else 0
        if sums and host == last:
            sums[-1] = sums[-1] + part
        else:
            sums.append(part)
        last = host
    sums = [wire_round(s, wire) for s in sums]
    return wire_round(functools.reduce(lambda a, b: a + b, sums), wire)


def wire_round(x: jax.Array, wire: str) -> jax.Array:
    """x (f32) as the wire carries it: rounded to bf16 (kept in f32) with a bf16 wire."""
    return bf(x).astype(f32) if wire == "bf16" else x


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pieces"],
                   meta_fields=["bounds", "wire", "hosts"])
@dataclass(frozen=True)
class Partials:
    """A matrix split by its rows across ranks (`mkresearch.sharding.reference_sharded`): pieces[i]
    [K_i, N] multiplies columns bounds[i] = (start, stop) of the input (zero rows beyond stop,
    as a rank's padded slice), and the partial products are added as `host_ordered_sum` adds
    them (`hosts`: the host of each piece's rank), each rounded to bf16 first when `wire` is
    "bf16": the sum a partial-sum all-reduce computes on every rank.
    A pytree: a per-layer stack's pieces carry the layer axis in front."""

    pieces: tuple
    bounds: tuple
    wire: str = "f32"
    hosts: tuple = ()

    def products(self, a: jax.Array) -> list:
        """Each piece's partial product [..., N] f32, as its rank computes it (not yet rounded
        for the wire)."""
        parts = []
        for piece, (start, stop) in zip(self.pieces, self.bounds, strict=True):
            x = a[..., start:stop]
            rows = piece.shape[-2]
            if rows > stop - start:  # the rank's zero padding: zero inputs too
                x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, rows - (stop - start))])
            parts.append(matmul(x, piece))
        return parts

    def contract(self, a: jax.Array) -> jax.Array:
        return reduce_partials(self.products(a), self.hosts, self.wire)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["experts"],
                   meta_fields=["groups", "wire", "hosts", "merged", "ranks"])
@dataclass(frozen=True)
class ExpertGroups:
    """The routed experts split into `groups` expert groups of consecutive ids (expert
    parallel): each group's weighted sum taken apart (ascending id), the groups' sums added as
    `host_ordered_sum` adds them (`hosts`: the host of each group's rank; rounded to bf16 first
    with a bf16 wire): a partial-sum all-reduce's result. With `ranks` (expert-tensor parallel,
    ETP > 1: each expert's hidden split over the ranks of its group), every rank's sum instead:
    its group's experts' partial outputs over its hidden slice, each rounded to bf16
    (`stages.ffn.combine_experts`), `hosts` then one per rank."""

    experts: Any
    groups: int
    wire: str = "f32"
    hosts: tuple = ()
    # the shared experts' partial sums added to each rank's before one reduction (experts on the
    # full d, `layout.merges_shared_sum`): `stages.moe_full.moe_full_ffn` sums them so
    merged: bool = False
    # ETP > 1: (expert group, hidden slice) of each rank, in rank order; (): one rank per group
    ranks: tuple = ()

    @property
    def etp(self) -> int:
        """The hidden slices an expert is split into (1: whole on one rank)."""
        return 1 + max((piece for _, piece in self.ranks), default=0)

    def chosen(self, expert_ids: jax.Array) -> Any:
        """Each (row, choice)'s expert weights, leaves [B, k, ...] (`stages.ffn.combine_experts`)."""
        return jax.tree.map(lambda w: w[expert_ids], self.experts)

    def group_sums(self, y: jax.Array, coef: jax.Array, ids: jax.Array) -> list:
        """Each group's Σ coef·y over its experts, ascending id (y [B, k, n] f32 and coef [B, k]
        in ascending id order of `ids` [B, k]), one [B, n] per group in group order."""
        per_group = jax.tree.leaves(self.experts)[0].shape[0] // self.groups
        return [group_sum(y, coef, ids // per_group == g) for g in range(self.groups)]

    def slice_outputs(self, h: jax.Array, product) -> list:
        """ETP > 1: each hidden slice's partial output, `product(h's slice, its rows (start,
        stop) of W2)`, slices in order (h [B, k, 1, F] the whole hidden)."""
        width = h.shape[-1] // self.etp
        return [product(h[..., s * width:(s + 1) * width], (s * width, (s + 1) * width))
                for s in range(self.etp)]

    def rank_sums(self, ys: list, coef: jax.Array, ids: jax.Array) -> list:
        """ETP > 1: each rank's Σ coef·y over its group's experts, ascending id, y its hidden
        slice's partial output (ys[slice] [B, k, n] f32, in ascending id order of `ids`), one
        [B, n] per rank in rank order."""
        per_group = jax.tree.leaves(self.experts)[0].shape[0] // self.groups
        return [group_sum(ys[piece], coef, ids // per_group == g) for g, piece in self.ranks]


def group_sum(y: jax.Array, coef: jax.Array, mine: jax.Array) -> jax.Array:
    """Σ_j coef[:, j]·y[:, j] over the choices j that are `mine` [B, k], in order j (f32 [B, n])."""
    return lax.fori_loop(0, y.shape[1], lambda j, acc: jnp.where(
        mine[:, j, None], acc + coef[:, j, None] * y[:, j], acc), jnp.zeros(y.shape[::2], f32))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pieces"],
                   meta_fields=["bounds", "wire", "hosts"])
@dataclass(frozen=True)
class NormedRows:
    """The restructured sharded MoE's W_lu (`mkresearch.sharding.reference_sharded`): split by
    its latent rows across ranks, pieces[i] [K_i, N] for input columns bounds[i] (zero rows
    beyond, a rank's padded slice), the ranks in the order their reduction adds them. Applied
    to ρ (bf16 [B, Lat]) as `normed_contract`: each rank's partial product of its chunk times
    γ, and its partial Σ ρ², each summed as `reduce_partials` sums (`hosts`, `wire`), then
    RMSNorm's scale applied after the sum."""

    pieces: tuple
    bounds: tuple
    wire: str = "f32"
    hosts: tuple = ()

    def normed_contract(self, rho: jax.Array, gamma: jax.Array, eps: float,
                        width: int) -> jax.Array:
        """RMSNorm_γ(ρ) W_lu as the ranks compute it -> [B, N] f32: Σ_r bf(ρ_r γ_r) W_r times
        rms_scale(Σ_r Σ ρ_r², width, eps) (not `rms_norm`'s bf16 ρ̂: the scale is not known
        before the sum)."""
        products, squares = self.parts(rho.astype(f32), gamma.astype(f32))
        total = reduce_partials(products, self.hosts, self.wire)
        return total * rms_scale(reduce_partials(squares, self.hosts, self.wire), width, eps)

    def parts(self, v: jax.Array, g: jax.Array) -> tuple[list, list]:
        """Each piece's partial product bf(ρ_r γ_r) W_r [B, N] and Σ ρ_r² [B, 1] (f32, as its
        rank computes them, not yet rounded for the wire): v ρ [B, Lat], g γ [Lat] f32."""
        products, squares = [], []
        for piece, (start, stop) in zip(self.pieces, self.bounds, strict=True):
            pad = [(0, 0)] * (v.ndim - 1) + [(0, piece.shape[-2] - (stop - start))]
            chunk = jnp.pad(v[..., start:stop], pad)  # [B, c]
            squares.append(ordered_sum(chunk * chunk, keepdims=True))  # [B, 1]
            products.append(matmul(bf(chunk * jnp.pad(g[start:stop], pad[-1:])), piece))
        return products, squares


def reduce_partials(parts: list, hosts: tuple = (), wire: str = "f32") -> jax.Array:
    """A partial-sum all-reduce of the ranks' `parts` (in rank order): each rounded to bf16
    first with a bf16 wire, then added as `host_ordered_sum` adds them (with a bf16 wire its
    hosts' sums and its total rounded too)."""
    return host_ordered_sum([wire_round(part, wire) for part in parts], hosts, wire)


ROW_TILE = 8  # a product's rows are padded to a multiple of this (`padded_rows`)


def row_product(row: jax.Array, matrix: jax.Array, contract: int = 0) -> jax.Array:
    """row [K] times matrix [K, N] (contract=0) or [N, K] (contract=1) -> [N] f32, at the precision
    its operands call for (`precision_for`), multiplied as 8 rows (`padded_rows`): never a one-row
    product, which XLA:CPU sums in an order of its own and which a TPU's Mosaic kernels and its
    XLA round apart (docs/tpu.md §5). What a kernel's row and head loops multiply, one row each."""
    return padded_rows(lambda rows: lax.dot_general(
        rows, matrix, (((1,), (contract,)), ((), ())), preferred_element_type=f32,
        precision=precision_for(rows, matrix)), row[None])[0]


def padded_rows(product, a: jax.Array, axis: int = -2) -> jax.Array:
    """product(a) computed on a's rows along `axis` padded with zero rows to a multiple of
    ROW_TILE, the padding's rows dropped, so that a row's result never depends on how many rows
    there are or where the row sits (batch invariance).

    XLA:CPU's products (YNNPACK's kernels by default in jax 0.10.2) pick their kernels by the
    row count. Measured on an x86 CPU with AMX and AVX512-BF16: a product of 1 row, one of 2
    rows, and the 1 or 2 rows left over past a 16-row tile (rows 17, 18, 33, ...) each sum in
    an order of their own; every other row of 3 to 300 sums alike. On AVX-512 and AVX2 CPUs
    without those units only the one-row product differed. A multiple of 8 rows leaves no such
    remainder on any of them (tests/test_batch_invariance.py keeps checking it). Not removed by
    padding: on the AMX CPU a bf16 x fp8 product at K = 256 sums a row in one order from 2 to 50
    rows and in another from 51 (XLA's choice by size), so a row of an fp8 product is the same
    bits in any batch of at most 50 rows there. On a TPU 8 rows are one sublane tile, which the
    MXU takes in the one pass it takes a row in.
    """
    axis = axis % a.ndim
    rows = a.shape[axis]
    pad = -rows % ROW_TILE if rows >= ROW_TILE else ROW_TILE - rows
    if pad == 0:
        return product(a)
    zeros = jnp.zeros(a.shape[:axis] + (pad,) + a.shape[axis + 1:], a.dtype)
    return lax.slice_in_dim(product(jnp.concatenate([a, zeros], axis)), 0, rows, axis=axis)


def ordered_sum(v: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Σ over `axis` in one fixed order, whatever the other axes (the batch rows) or the host.

    XLA:CPU picks a reduction's summation order from the whole shape, so a row's sum would change
    with the batch size. Here the order is written out as element-wise adds, which no compiler
    reorders: 128-wide chunks are added in sequence (one vreg column group at a time on a TPU),
    then the remaining width is folded in halves while it is even, and the rest added in sequence.
    The kernels call this same function, so they sum in the same order as the reference.
    """
    axis = axis % v.ndim
    width = v.shape[axis]

    def columns(start: int, stop: int) -> jax.Array:
        return lax.slice_in_dim(v, start, stop, axis=axis)

    if width > LANE and width % LANE == 0:
        chunks = [columns(c, c + LANE) for c in range(0, width, LANE)]
        v, width = functools.reduce(jnp.add, chunks), LANE
    while width > 1 and width % 2 == 0:
        width //= 2
        v = columns(0, width) + columns(width, 2 * width)
    if width > 1:
        v = functools.reduce(jnp.add, [columns(i, i + 1) for i in range(width)])
    return v if keepdims else jnp.squeeze(v, axis)


def block_scaled_matmul(x: jax.Array, values: jax.Array, scales: jax.Array) -> jax.Array:
    """x bf16 [M, K] @ (values [K, N] times a scale per block of K rows, scales f32 [J, N]) ->
    f32 [M, N], the way an MXU is handed quantised weights without decoding them: the values as
    they are (fp8 e4m3), each block j's partial product x_j values_j scaled after the dot.

    One dot makes every block's partial product: x is spread into block-diagonal rows, row
    (m, j) holding x[m] in block j's columns and zeros elsewhere (zeros add nothing), so the dot
    has M·J rows, at decode far below the MXU's 256: no extra passes. The scaled partials are
    added over j by `ordered_sum` (one order whatever M). The products are exact in f32; only the
    summation order differs from the decoded-bf16 product (`matmul`). x's rows are padded as
    `matmul`'s are (`padded_rows`)."""
    return padded_rows(lambda rows: _spread_product(rows, values, scales), x)


def _spread_product(x: jax.Array, values: jax.Array, scales: jax.Array) -> jax.Array:
    """`block_scaled_matmul` on x's rows as they are."""
    m, k = x.shape
    j = scales.shape[0]
    # x times a 0/1 mask, not a select: Mosaic cannot lay a boolean mask out as the rows of x
    # broadcast over J; lax.div, not //: jnp's floor division of ints lowers through sign, which
    # a TPU compile without a TPU cannot lower (non-negative here: the same quotient)
    block_of_column = lax.div(lax.broadcasted_iota(i32, (j, k), 1), i32(k // j))
    ones = (block_of_column == lax.broadcasted_iota(i32, (j, k), 0)).astype(bf16)  # [J, K]
    spread = x.astype(bf16)[:, None, :] * ones[None]  # [M, J, K]: exact (x or ±0)
    partial = lax.dot_general(spread.reshape(m * j, k), values, (((1,), (0,)), ((), ())),
                              preferred_element_type=f32,
                              precision=EXACT_PRODUCTS).reshape(m, j, -1)  # [M, J, N]
    return ordered_sum(partial * scales[None], axis=1)


def sequence_sum(terms) -> jax.Array:
    """t_0 + t_1 + ... added in this order (a short static sum: candidates, conv taps)."""
    return functools.reduce(jnp.add, terms)


def softmax(v: jax.Array, axis: int = -1) -> jax.Array:
    """exp(v − max) / Σ exp(v − max) over `axis`, summed by `ordered_sum` (batch-invariant)."""
    shifted = jnp.exp(v - jnp.max(v, axis=axis, keepdims=True))
    return shifted / ordered_sum(shifted, axis=axis, keepdims=True)


# ---- §2 norms and activation -----------------------------------------------------------------
def rms_norm(v: jax.Array, gamma: jax.Array, eps: float, n: int | None = None) -> jax.Array:
    """RMSNorm_γ(v) = bf(v · (mean(v²) + eps)^-½ · γ) in f32 over the last axis.

    n: the width the mean divides by (default v.shape[-1]); the MoE latent norm passes
    cfg.moe_latent so zero padding columns do not change the result.
    """
    v32 = v.astype(f32)
    width = v.shape[-1] if n is None else n
    return bf(v32 * rms_scale(ordered_sum(v32 * v32, keepdims=True), width, eps)
              * gamma.astype(f32))


def rms_scale(sum_squares: jax.Array, width: int, eps: float) -> jax.Array:
    """RMSNorm's scale (mean(v²) + eps)^-½ from Σ v² [..., 1] f32 over `width` values: what
    `rms_norm` multiplies by, applied after a sum when the sum of squares arrives summed
    (the restructured sharded MoE, `mkresearch.sharding.reference_sharded`)."""
    return lax.rsqrt(sum_squares / width + eps)


def situ(g: jax.Array, u: jax.Array) -> jax.Array:
    """SiTU(g, u) = bf(4·tanh(g/4) · σ(g) · 25·tanh(u/25)); g and u are bf16 projections."""
    g32, u32 = g.astype(f32), u.astype(f32)
    return bf(4 * jnp.tanh(g32 / 4) * jax.nn.sigmoid(g32) * 25 * jnp.tanh(u32 / 25))


def clamped_swiglu(g: jax.Array, u: jax.Array, alpha: float, limit: float) -> jax.Array:
    """GPT-OSS's activation: bf((clip(u, −limit, limit) + 1) · g σ(α g)) with g = min(g, limit),
    in f32 from the bf16 projections (transformers' GptOssExperts._apply_gate, in its order)."""
    g32 = jnp.minimum(g.astype(f32), f32(limit))
    u32 = jnp.clip(u.astype(f32), f32(-limit), f32(limit))
    return bf((u32 + 1) * (g32 * jax.nn.sigmoid(g32 * f32(alpha))))


def activation(g: jax.Array, u: jax.Array, cfg: ModelConfig) -> jax.Array:
    if cfg.activation == "situ":
        return situ(g, u)
    if cfg.activation == "clamped_swiglu":
        return clamped_swiglu(g, u, cfg.swiglu_alpha, cfg.swiglu_limit)
    return bf(jax.nn.silu(g.astype(f32)) * u.astype(f32))  # "silu": SwiGLU, for comparison


# ---- §3 attention residuals --------------------------------------------------------------------
def mix(candidates: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Mix over candidates [N, B, d] with the folded weight w [d] (f32) -> [B, d] bf16.

    s_i = <v_i, w> · (mean(v_i²) + eps)^-½; α = softmax_i(s); out = bf(Σ α_i v_i).
    """
    v = candidates.astype(f32)  # [N, B, d]
    d = v.shape[-1]
    scores = ordered_sum(v * w.astype(f32)) * lax.rsqrt(ordered_sum(v * v) / d + eps)  # [N, B]
    alpha = softmax(scores, axis=0)  # [N, B]
    return bf(sequence_sum(alpha[i, :, None] * v[i] for i in range(v.shape[0])))


# ---- the attention kinds' cache arithmetic ------------------------------------------------
def write_slot(cache: jax.Array, new: jax.Array, positions: jax.Array, axis: int) -> jax.Array:
    """cache with row b's slot positions[b] (along `axis` of one row) set to new[b].

    A select against the slot index rather than a scatter: same result, and XLA compiles it fast.
    """
    slot_axis = axis + 1  # in the batched cache
    slots = jnp.arange(cache.shape[slot_axis]).reshape(
        (-1,) + (1,) * (cache.ndim - slot_axis - 1))
    hit = slots == positions.reshape((-1,) + (1,) * (cache.ndim - 1))  # broadcasts like cache
    return jnp.where(hit, jnp.expand_dims(new, slot_axis).astype(cache.dtype), cache)


def dot_exact(a: jax.Array, b: jax.Array) -> jax.Array:
    """Σ a·b over the last axis of bf16 vectors: each product is exact in f32, summed in f32."""
    return ordered_sum(a.astype(f32) * b.astype(f32))


def online_softmax(new_score: jax.Array, new_value: jax.Array, scores: jax.Array,
                    values: jax.Array, positions: jax.Array, tile: int,
                    padded: bool = False, *, sinks: jax.Array | None = None,
                    window: int = 0) -> jax.Array:
    """Σ_j α_j V_j over slots 0..p with α = softmax(scores) in f32, computed online (§5).

    new_score [B, H] and new_value [B, H, n] or [B, n]: slot p (the new token); scores [B, H, S]
    and values [B, K, S, n] or [B, S, n] (shared by the heads): the cache. With K heads of values
    (K divides H: K = H one per head, fewer for GQA's K/V heads) query heads kG..kG+G−1 read
    values head k, G = H/K of them in one [G, T] × [T, n] product per tile, the kernels' form (the
    values repeated per query head sum in another order when XLA compiles at level 0). The order
    is the one a decode kernel can stream: the new token seeds the running state (m = its score,
    norm = 1, acc = its value), then the cached slots 0..p−1 come `tile` at a time, each tile
    rescaling the state by e^(m_old − m_new). A tile past p changes nothing (exactly: correction
    1, weights 0), so every row runs all ⌈S/tile⌉ tiles. Returns acc / norm [B, H, n] f32.
    padded: each [G, T] × [T, n] product (the H heads' with shared values) on its rows padded
    to a multiple of 8 (`padded_rows`), as the kernels' `online_softmax_step(padded=True)`:
    where the head count of one product differs between one device and a rank (GQA's query
    heads of a K/V head, the latent layout's heads), a head sums in one order whatever it is.

    sinks [H] f32 (GPT-OSS's learned sinks): one more logit per head in the normaliser, with no
    value; it seeds the state with the new token: m = max(s_new, sink), norm = e^(s_new − m) +
    e^(sink − m), acc = e^(s_new − m) v_new. window > 0: slot j counts only when j > p − window
    (the new token and the window − 1 before it, transformers' sliding window); a tile before
    the window changes nothing (exactly, as one past p), so a kernel reads the window's tiles only.
    """
    B, H, S = scores.shape
    slots = jnp.arange(tile)
    slot_axis = values.ndim - 2

    def weighted(weights, tile_values):  # [B, H, T] x the tile's values -> [B, H, n]
        if values.ndim == 3:
            return rows_of(lambda w: jnp.einsum("bht,btn->bhn", w, tile_values,
                                                precision=HIGHEST), weights, 1)
        groups = values.shape[1]
        grouped = weights.reshape(B, groups, H // groups, tile)  # [B, K, G, T]
        return rows_of(lambda w: jnp.einsum("bkgt,bktn->bkgn", w, tile_values,
                                            precision=HIGHEST), grouped, 2).reshape(B, H, -1)

    def rows_of(product, a, axis):  # the product's rows (axis) padded or as they are
        return padded_rows(product, a, axis) if padded else product(a)

    n_tiles = -(-S // tile)  # a cache shorter than a tile, or not a multiple: pad (masked anyway)
    scores = jnp.pad(scores, ((0, 0), (0, 0), (0, n_tiles * tile - S)))
    values = jnp.pad(values, [(0, n_tiles * tile - S) if axis == slot_axis else (0, 0)
                              for axis in range(values.ndim)])

    def one_tile(t, carry):
        m, norm, acc = carry  # [B, H, 1], [B, H, 1], [B, H, n]
        tile_scores = lax.dynamic_slice_in_dim(scores, t * tile, tile, axis=2)  # [B, H, T]
        tile_values = lax.dynamic_slice_in_dim(values, t * tile, tile, slot_axis).astype(f32)
        slot = (t * tile + slots)[None, None, :]
        valid = slot < positions[:, None, None]  # [B, 1, T]
        if window:
            valid = valid & (slot > positions[:, None, None] - window)
        tile_scores = jnp.where(valid, tile_scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(tile_scores, axis=-1, keepdims=True))  # finite
        correction = jnp.exp(m - m_new)
        weights = jnp.where(valid, jnp.exp(tile_scores - m_new), 0.0)
        norm = correction * norm + ordered_sum(weights, keepdims=True)
        acc = correction * acc + weighted(weights, tile_values)
        return m_new, norm, acc

    m = new_score[..., None]
    acc = jnp.broadcast_to(new_value.astype(f32)[:, None] if new_value.ndim == 2
                           else new_value.astype(f32), (B, H, new_value.shape[-1]))
    norm = jnp.ones_like(m)
    if sinks is not None:
        m, norm, acc = sink_seed(m, sinks.astype(f32)[None, :, None], acc)
    _, norm, acc = lax.fori_loop(0, n_tiles, one_tile, (m, norm, acc))
    return acc / norm


def sink_seed(score: jax.Array, sink: jax.Array, value: jax.Array) -> tuple:
    """The online softmax's state after the new token (its score [.., 1], value [.., n]) and a
    learned sink (a logit with no value, [.., 1]): (m, norm, acc), as `online_softmax` starts it
    and the kernels do."""
    m = jnp.maximum(score, sink)
    weight = jnp.exp(score - m)
    return m, weight + jnp.exp(sink - m), weight * value
