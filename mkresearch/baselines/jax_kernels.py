"""The op-by-op decode step on JAX's own TPU kernels: what a user builds on one TPU today.

    logits, state, aux = decode_step(params, state, tokens, positions, cfg)   # the reference's
                                                                            # contract and pytrees
    logits, state, aux = paged_decode_step(params, state, tokens, positions, page_table, cfg,
                                           pages)   # a paged GQA cache (Qwen3, GLM)

One XLA program per step, as vLLM's TPU backend and SGLang-JAX compose it: JAX's shipped Pallas
kernels where a stage has one, XLA for the rest: each stage a few XLA fusions and kernel launches.

- Routed experts: megablox `gmm` (`jax.experimental.pallas.ops.tpu.megablox`). The B·k (row,
  expert) pairs are sorted by expert, the group sizes counted, then one gmm for W1, one for W3
  (the gate and up products), the activation in XLA, one gmm for W2, the outputs put back in
  (row, choice) order and summed with the router's weights in ascending expert id (the
  reference's order, `stages.ffn.weighted_sum`). bf16 experts: gmm reads the stacked weights of
  every MoE layer as one [n_layers·E, K, N] array (a reshape, no copy), each pair's group being
  layer·E + expert, so a layer's chosen experts are read in place. fp8 and MXFP4 experts, which
  gmm cannot take: the step gathers the batch's distinct experts (min(E, B·k) slots, a static
  shape: slots past the distinct experts repeat the last one) and decodes them to bf16 in XLA
  (`formats.dequantize`), then gmm reads the bf16 copies. That costs, per slot and weight, the
  stored bytes read (1 + 1/128 for fp8, 0.53 for MXFP4), 2 bytes written and 2 read again by
  gmm: about 5 bytes (fp8) or 4.5 (MXFP4) against the 1 or 0.53 the megakernel streams. The
  other fair reading of "a backend without fp8 or FP4 products": experts decoded to bf16 once
  at load, which is the same model with `expert_format="bf16"` weights (`dequantize`): run that
  config (it reads 2 bytes per weight and decodes nothing in the step).
  gmm's tiles (`gmm_tiling`): all B·k rows in one row tile (rounded up to 16, a bf16 sublane
  tile), so every chosen expert's weights are read once whatever the batch (a smaller row tile
  would read an expert again for each tile its rows straddle; at decode the MXU takes 16 to 512
  rows in one pass anyway); the weight tile as wide as the matrix and as many rows of it as fit
  2 MiB (the megakernel's weight block: the size at which a v5e's DMAs reach full bandwidth,
  double-buffered by Pallas within the default scoped VMEM): at the minis' sizes one tile per
  expert.
- Attention: KDA as the reference writes it (plain XLA ops). MLA (both cache layouts), MLA with
  RoPE and GQA on a contiguous cache in XLA: the new entry written in place into the stacked
  cache (a scatter into the donated state), scores over the whole cache in one product, one
  masked f32 softmax (not online), one product with the values; MLA's latent layout absorbs
  W_kvb with one batched product. GQA on a paged cache (`paged_decode_step`, every attention
  layer GQA: Qwen3, GLM): JAX's ragged paged attention
  (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`) on the cache layout it reads,
  K and V heads interleaved in one pool [L, n_pages, page_size, 2·KV, D] (`paged_state_shapes`;
  `from_paged_kv` / `to_paged_kv` convert the package's paged state), the new entry written
  into its page by XLA first. Its block sizes (`rpa_block_sizes`): the kernel's own choice, its
  tuned table for the chip, else 128 pages and 32 queries per block, clipped to the table and
  the batch. jax 0.10.2 cannot interpret that kernel (TPU interpret mode lacks its ref reshapes
  and bitcasts, the HLO interpreter its scalar-prefetch indices): off a TPU the paged step runs
  its XLA twin (`paged_attention_xla`, the kernel's own reference arithmetic), checked against
  `ref_ragged_paged_attention`; the kernel itself is compiled with Mosaic for the v5e in the
  tests and runs on a TPU (benchmarks/yardsticks_tpu.py prints its |Δlogit| there).
- Everything else (norms, residuals, router, shared experts, projections, LM head): the
  reference's own functions, in XLA.

On a TPU the kernels are compiled; elsewhere they run in TPU interpret mode
(`mkresearch.hardware.tpu.interpret_params`), read when the step is traced.

Against the reference (`reference.decode_step`, same weights, same state), measured on CPU in
interpret mode: see `SAME_ROUTING_BOUND` (tests/test_jax_kernels.py; the measurement:
`python -m mkresearch.baselines.jax_kernels_sweep`). `cfg.expert_mxu="fp8"` (no preset's) runs
the same bf16 products: gmm takes no fp8 input; the bound is measured without it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa
from jax.experimental.pallas.ops.tpu.megablox import gmm

from mkresearch.hardware import tpu
from mkresearch.hardware.chips import get_chip
from mkresearch.model import numerics, paged_kv, reference, rope, spec
from mkresearch.model.config import ModelConfig
from mkresearch.model.formats import dequantize
from mkresearch.model.numerics import HIGHEST, activation, bf, bf16, f32, i32, matmul, rms_norm
from mkresearch.model.stages import ffn, gqa, mla, mla_rope

GMM_ROW_TILE = 16  # bf16 rows of one sublane tile: gmm's row tile is whole tiles
GMM_MAX_ROWS = 512  # the largest row tile (B·k pairs past it take several tiles)
GMM_TILE_BYTES = 2 * 1024 * 1024  # a gmm weight tile (bf16): the megakernel's weight block
ROUTED_KINDS = ("moe", "moe_full")


# ---- the routed experts: megablox gmm ------------------------------------------------------------
def _divisor(size: int, limit: int) -> int:
    """The largest multiple of 128 dividing `size` that is at most `limit` (128 at least);
    `size` itself when it is not a multiple of 128."""
    if size % 128:
        return size
    best = 128
    for rows in range(128, min(size, max(limit, 128)) + 1, 128):
        if size % rows == 0:
            best = rows
    return best


def gmm_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """gmm's (tm, tk, tn) for lhs [m, k] and weights [G, k, n] bf16 (the module docstring): tm = m
    (at most GMM_MAX_ROWS), whole weight rows (tn = n) and as many of them as fit GMM_TILE_BYTES;
    a weight row wider than that splits n too."""
    tm = min(m, GMM_MAX_ROWS)
    tk = _divisor(k, GMM_TILE_BYTES // (2 * n))
    tn = n if tk * n * 2 <= GMM_TILE_BYTES else _divisor(n, GMM_TILE_BYTES // (2 * tk))
    return tm, tk, tn


def _rows(pairs: int) -> int:
    """gmm's lhs rows for `pairs` rows: whole row tiles."""
    rows = -(-pairs // GMM_ROW_TILE) * GMM_ROW_TILE
    return rows if rows <= GMM_MAX_ROWS else -(-rows // GMM_MAX_ROWS) * GMM_MAX_ROWS


def grouped_product(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                    interpret: Any) -> jax.Array:
    """lhs [m, k] bf16 (rows sorted by group) @ each group's rhs [G, k, n] bf16 -> [m, n] f32:
    megablox gmm with `gmm_tiling`. Rows past the groups' total are left unwritten."""
    tiling = gmm_tiling(lhs.shape[0], lhs.shape[1], rhs.shape[2])
    return gmm(lhs, rhs, group_sizes, f32, tiling, None, None, False, interpret or False)


def expert_groups(experts: dict[str, Any], index: int, expert_ids: jax.Array,
                  cfg: ModelConfig) -> tuple[jax.Array, jax.Array, list[jax.Array]]:
    """The gmm groups of the (row, choice) pairs of expert_ids [B, k] in MoE layer `index` (of its
    kind): (each pair's group [B·k] i32, the group sizes [G] i32, [W1, W3, W2] as gmm's
    [G, K, N] bf16 weights). bf16 experts: the stacks of every layer as one, G = n_layers·E;
    fp8 / MXFP4: the batch's distinct experts gathered and decoded, G = min(E, B·k)."""
    n_experts, ids = cfg.n_experts, expert_ids.reshape(-1)
    names = ("w1", "w3", "w2")
    if cfg.expert_format == "bf16":
        weights = [experts[name].reshape(-1, *experts[name].shape[2:]) for name in names]
        groups = index * n_experts + ids
        return groups, jnp.bincount(groups, length=weights[0].shape[0]).astype(i32), weights
    slots = min(n_experts, ids.shape[0])
    chosen = jnp.unique(ids, size=slots, fill_value=n_experts)  # ascending; n_experts pads
    groups = jnp.searchsorted(chosen, ids).astype(i32)
    fetched = jnp.minimum(chosen, n_experts - 1)
    weights = [dequantize(jax.tree.map(lambda w: chosen_experts(w, index, fetched),
                                       experts[name]), cfg.expert_format)
               for name in names]  # [slots, K, N] bf16
    return groups, jnp.bincount(groups, length=slots).astype(i32), weights


def chosen_experts(stack: jax.Array, index: int, ids: jax.Array) -> jax.Array:
    """Experts ids [S] of layer `index` of a stacked leaf [L, E, ...] -> [S, ...]: one dynamic
    slice each, so no other expert's byte is read (a gather of whole experts on a TPU copies the
    layer's slice first, `reference.LayerOfStack`), unrolled (S is static: no device loop)."""
    rest = stack.shape[2:]
    return jnp.stack([lax.dynamic_slice(stack, (index, ids[s]) + (0,) * len(rest),
                                        (1, 1, *rest))[0, 0] for s in range(ids.shape[0])])


def routed_experts(experts: dict[str, Any], index: int, x: jax.Array, expert_ids: jax.Array,
                   expert_weights: jax.Array, cfg: ModelConfig, interpret: Any) -> jax.Array:
    """Σ_e w_e y_e in f32 [B, n], y_e = bf(act(bf(x W1_e), bf(x W3_e)) W2_e), through gmm
    (x [B, n] bf16; experts: a MoE kind's stacked experts, `index` its layer within the kind)."""
    batch, top_k = expert_ids.shape
    pairs = batch * top_k
    groups, sizes, (w1, w3, w2) = expert_groups(experts, index, expert_ids, cfg)
    order = jnp.argsort(groups, stable=True)  # [B·k]: the pairs by group
    lhs = jnp.zeros((_rows(pairs), x.shape[1]), bf16).at[:pairs].set(x[order // top_k])
    hidden = activation(bf(grouped_product(lhs, w1, sizes, interpret)),
                        bf(grouped_product(lhs, w3, sizes, interpret)), cfg)  # [rows, F]
    y = bf(grouped_product(hidden, w2, sizes, interpret)[:pairs])  # [B·k, n], by group
    y = jnp.zeros_like(y).at[order].set(y)  # back in (row, choice) order
    return ffn.weighted_sum(y.reshape(batch, top_k, -1), expert_ids, expert_weights,
                            unrolled=True)


def _moe(p_stack, stack, index, x, positions, cfg, interpret):
    """The latent MoE layer (`stages.ffn.moe_ffn`) with its routed experts through gmm."""
    del positions
    p = reference.layer_params({k: v for k, v in p_stack.items() if k != "experts"}, index)
    expert_ids, expert_weights = ffn.route(p, x, cfg)
    z = bf(matmul(x, p["w_ld"]))  # [B, Lat]
    rho = bf(routed_experts(p_stack["experts"], index, z, expert_ids, expert_weights, cfg,
                            interpret))
    routed = matmul(rms_norm(rho, p["latent_norm"], cfg.rms_eps, n=cfg.moe_latent), p["w_lu"])
    return _with_shared(p, x, routed, cfg), stack, {"expert_ids": expert_ids}


def _moe_full(p_stack, stack, index, x, positions, cfg, interpret):
    """The MoE layer on the full d (`stages.moe_full`) with its routed experts through gmm."""
    del positions
    p = reference.layer_params({k: v for k, v in p_stack.items() if k != "experts"}, index)
    expert_ids, expert_weights = ffn.route(p, x, cfg)
    routed = routed_experts(p_stack["experts"], index, x, expert_ids, expert_weights, cfg,
                            interpret)
    return _with_shared(p, x, routed, cfg), stack, {"expert_ids": expert_ids}


def _with_shared(p, x, routed, cfg):
    """m = bf(routed + shared) [B, d] bf16 (routed alone without shared experts)."""
    if not cfg.n_shared_experts:
        return bf(routed)
    return bf(routed + ffn.shared_experts(p, x, cfg))


# ---- attention on a contiguous cache: XLA --------------------------------------------------------
def write_entry(stack: jax.Array, index: int, new: jax.Array, positions: jax.Array,
                token_axis: int) -> jax.Array:
    """The stacked cache [L, B, *row] with layer `index`'s row b at slot positions[b] (along
    `token_axis` of a row) set to new[b]: one scatter, in place in a donated state."""
    rows = jnp.arange(new.shape[0])
    where = (index, rows) + (slice(None),) * token_axis + (positions,)
    return stack.at[where].set(new.astype(stack.dtype))


def attend(scores: jax.Array, values: jax.Array, positions: jax.Array) -> jax.Array:
    """Σ_j α_hj v_j over slots 0..p, α = softmax of scores [B, H, S] f32 (one pass, in f32),
    values [B, K, S, n] read by the H / K query heads of each K head -> [B, H, n] f32."""
    batch, heads, slots = scores.shape
    visible = jnp.arange(slots)[None, None, :] <= positions[:, None, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))  # [B, H, S]
    grouped = weights.reshape(batch, values.shape[1], heads // values.shape[1], slots)
    acc = jnp.einsum("bkgs,bksn->bkgn", grouped, values.astype(f32), precision=HIGHEST)
    return acc.reshape(batch, heads, -1) / jnp.sum(weights, axis=-1)[..., None]


def _mla(p_stack, stack, index, x, positions, cfg):
    """Kimi K3's MLA (`stages.mla`), either cache layout."""
    p = reference.layer_params(p_stack, index)
    q_nope, q_extra, c_hat, k_extra = mla.mla_inputs(p, x, cfg)
    scale = cfg.mla_qk_dim ** -0.5
    if cfg.mla_cache_layout == "expanded":
        _, v_new, k_new = mla.expanded_entry(p, c_hat, k_extra, cfg)
        stack = {"k": write_entry(stack["k"], index, k_new, positions, 1),
                 "v": write_entry(stack["v"], index, v_new, positions, 1)}
        pad = jnp.zeros((*q_nope.shape[:2], cfg.mla_k_padded - cfg.mla_qk_dim), bf16)
        q = jnp.concatenate([q_nope, q_extra, pad], axis=-1)  # [B, H, k_padded]: the cache's
        scores = numerics.einsum("bhd,bhsd->bhs", q, stack["k"][index]) * scale
        o = bf(attend(scores, stack["v"][index], positions))  # [B, H, v]
    else:
        stack = {"ckv": write_entry(stack["ckv"], index, c_hat, positions, 0),
                 "kx": write_entry(stack["kx"], index, k_extra, positions, 0)}
        w_kb, w_vb = mla.split_kvb(p, cfg)
        o = _absorbed(q_nope, q_extra, stack["ckv"][index], stack["kx"][index], w_kb, w_vb,
                      positions, scale)
    return mla.gated_output(p, x, o, cfg), stack, {}


def _absorbed(q_nope, q_extra, ckv, kx, w_kb, w_vb, positions, scale):
    """The latent MLA with W_kvb absorbed: q̃ = bf(q^C W_kbᵀ), scores over ĉ and k^X, Σ α ĉ,
    o = bf(bf(Σ α ĉ) W_vb) [B, H, v] (each a product batched over rows and heads)."""
    q_absorbed = bf(numerics.einsum("bhn,rhn->bhr", q_nope, w_kb))
    scores = (numerics.einsum("bhr,bsr->bhs", q_absorbed, ckv)
              + numerics.einsum("bhe,bse->bhs", q_extra, kx)) * scale
    context = bf(attend(scores, ckv[:, None], positions))  # [B, H, rank]
    return bf(numerics.einsum("bhr,rhv->bhv", context, w_vb))


def _mla_rope(p_stack, stack, index, x, positions, cfg):
    """DeepSeek's MLA with the decoupled rope key (`stages.mla_rope`), latent cache."""
    p = reference.layer_params(p_stack, index)
    batch, heads, nope, rank = x.shape[0], cfg.n_heads, cfg.mla_qk_nope, cfg.mla_kv_rank
    q_nope, q_rope, c_hat, k_rope = mla_rope.queries_and_keys(p, x, positions, cfg)
    stack = {"ckv": write_entry(stack["ckv"], index, c_hat, positions, 0),
             "kpe": write_entry(stack["kpe"], index, k_rope, positions, 0)}
    w_kvb = p["w_kvb"].reshape(rank, heads, nope + cfg.mla_v_dim)
    o = _absorbed(q_nope, q_rope, stack["ckv"][index], stack["kpe"][index], w_kvb[..., :nope],
                  w_kvb[..., nope:], positions, rope.attention_scale(cfg, cfg.mla_qk_dim))
    return bf(matmul(o.reshape(batch, heads * cfg.mla_v_dim), p["w_o"])), stack, {}


def _gqa(p_stack, stack, index, x, positions, cfg):
    """GQA (`stages.gqa`) on a contiguous cache."""
    p = reference.layer_params(p_stack, index)
    batch, heads, kv_heads = x.shape[0], cfg.n_heads, cfg.n_kv_heads
    q, k, v = gqa.projections(p, x, positions, cfg)
    stack = {"k": write_entry(stack["k"], index, k, positions, 1),
             "v": write_entry(stack["v"], index, v, positions, 1)}
    groups = q.reshape(batch, kv_heads, heads // kv_heads, cfg.head_dim)  # [B, KV, G, D]
    scores = numerics.einsum("bkgd,bksd->bkgs", groups, stack["k"][index]).reshape(
        batch, heads, -1)
    o = bf(attend(scores * rope.attention_scale(cfg, cfg.head_dim), stack["v"][index],
                  positions))  # [B, H, D]
    return bf(matmul(o.reshape(batch, heads * cfg.head_dim), p["w_o"])), stack, {}


def sublayers(interpret: Any, paged: dict | None = None) -> dict[str, Any]:
    """{kind: sublayer on the kind's stacks} of this backend (`reference.on_stacks`); KDA and the
    dense FFN run the reference's own. paged: the paged step's table and pages (its GQA)."""
    attention_gqa = _gqa if paged is None else functools.partial(_paged_gqa, **paged,
                                                                 interpret=interpret)
    return {"mla": reference.on_stacks(_mla), "mla_rope": reference.on_stacks(_mla_rope),
            "gqa": reference.on_stacks(attention_gqa),
            "moe": reference.on_stacks(functools.partial(_moe, interpret=interpret)),
            "moe_full": reference.on_stacks(functools.partial(_moe_full, interpret=interpret))}


# ---- the step -------------------------------------------------------------------------------------
def step(params: dict[str, Any], state: dict[str, Any], tokens: jax.Array, positions: jax.Array,
         cfg: ModelConfig, interpret: Any = "auto") -> tuple[jax.Array, dict, dict]:
    """One step, unchecked and unjitted (to trace inside a jitted loop): the reference's residual
    loop (`reference.RESIDUAL_STEPS`) with this backend's sublayers. interpret: how the Pallas
    kernels run ("auto": `tpu.interpret_params()` when traced)."""
    interpret = tpu.interpret_params() if interpret == "auto" else interpret
    return reference.RESIDUAL_STEPS[cfg.residual](params, state, tokens, positions, cfg,
                                                  sublayers=sublayers(interpret))


step_jit = jax.jit(step, static_argnames=("cfg", "interpret"), donate_argnums=1)


def decode_step(params: dict[str, Any], state: dict[str, Any], tokens: Any, positions: Any,
                cfg: ModelConfig) -> tuple[jax.Array, dict, dict]:
    """One decode step (`reference.decode_step`'s contract: tokens [B] i32, positions [B] i32,
    the reference's params and state), jitted with cfg static and the state DONATED (pass a copy
    to keep it). Returns (logits [B, V] f32, new state, aux with aux["expert_ids"])."""
    reference.check_step_inputs(state, tokens, positions, cfg)
    return step_jit(params, state, jnp.asarray(tokens, i32), jnp.asarray(positions, i32),
                    cfg=cfg, interpret=tpu.interpret_params())


# ---- a paged GQA cache: ragged paged attention ----------------------------------------------------
def check_paged(cfg: ModelConfig) -> None:
    """ValueError unless every attention layer is GQA (the kind ragged paged attention reads)."""
    spec.check(cfg)
    if set(cfg.attention_kinds) != {"gqa"}:
        raise ValueError(f"ModelConfig.attention={cfg.attention!r} is invalid for the paged "
                         "op-by-op step: 'gqa' (ragged paged attention is GQA's kernel); the "
                         "contiguous step (decode_step) runs every kind")


def paged_state_shapes(cfg: ModelConfig, pages: paged_kv.PagedKVConfig,
                       batch: int) -> dict[str, dict[str, Any]]:
    """The paged state as ragged paged attention reads it: {"gqa": {"kv": [L, n_pages,
    page_size, 2·KV, D] bf16}}, K/V head g's key at 2g and value at 2g + 1 (every other kind's
    leaves as `paged_kv.paged_state_shapes`)."""
    check_paged(cfg)
    shapes = paged_kv.paged_state_shapes(cfg, pages, batch)
    layers, n_pages, kv_heads, size, dim = shapes["gqa"]["k"].shape
    return {**shapes, "gqa": {"kv": jax.ShapeDtypeStruct((layers, n_pages, size, 2 * kv_heads,
                                                          dim), bf16)}}


def init_paged_state(cfg: ModelConfig, pages: paged_kv.PagedKVConfig,
                     batch: int) -> dict[str, Any]:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                        paged_state_shapes(cfg, pages, batch))


def from_paged_kv(state: dict[str, Any]) -> dict[str, Any]:
    """The package's paged state (`paged_kv`: k, v [L, N, KV, P, D]) in this layout."""
    k, v = state["gqa"]["k"], state["gqa"]["v"]
    kv = jnp.stack([k, v], axis=3).transpose(0, 1, 4, 2, 3, 5)  # [L, N, P, KV, 2, D]
    return {**state, "gqa": {"kv": kv.reshape(*kv.shape[:3], -1, kv.shape[-1])}}


def to_paged_kv(state: dict[str, Any]) -> dict[str, Any]:
    """This layout's paged state as the package's (`paged_kv`)."""
    kv = state["gqa"]["kv"]
    pairs = kv.reshape(*kv.shape[:3], -1, 2, kv.shape[-1])  # [L, N, P, KV, 2, D]
    k, v = (pairs[..., i, :].transpose(0, 1, 3, 2, 4) for i in range(2))  # [L, N, KV, P, D]
    return {**state, "gqa": {"k": k, "v": v}}


def rpa_block_sizes(cfg: ModelConfig, pages: paged_kv.PagedKVConfig, batch: int,
                    chip: str | None = None) -> tuple[int, int]:
    """(KV pages, queries) per block of ragged paged attention, as the kernel picks them when
    given none (`get_tuned_block_sizes`), for `chip` (default: the chip traced for; a TPU's or
    `compile_for`'s): its tuned table's entry for these heads, head size, page size, batch and
    table length, else its default of 128 pages and 32 queries; clipped to the table's pages and
    the batch."""
    q_heads, kv_heads = rpa.kernel.get_min_heads_per_blk(cfg.n_heads, 2 * cfg.n_kv_heads, bf16,
                                                         bf16)
    key = rpa.tuned_block_sizes.simplify_key((bf16, bf16, q_heads, kv_heads // 2, cfg.head_dim,
                                              pages.page_size, batch, pages.max_pages_per_row))
    chip = chip or tpu.target_chip()
    device = " ".join(get_chip(chip).device_kind.split()[:2]) if chip else ""
    kv_pages, queries = rpa.tuned_block_sizes.TUNED_BLOCK_SIZES.get(device, {}).get(key, (128, 32))
    return min(pages.max_pages_per_row, kv_pages), min(batch, queries)


def paged_attention(q: jax.Array, pool: jax.Array, kv_lens: jax.Array, tables: jax.Array,
                    cfg: ModelConfig, pages: paged_kv.PagedKVConfig, interpret: Any) -> jax.Array:
    """One query per row over its pages: q [B, H, D] bf16, pool [pages, P, 2·KV, D] (K of head g
    at 2g, V at 2g + 1), kv_lens [B] (tokens each row attends, the new one included), tables
    [B, M] (rows of pool) -> [B, H, D] bf16. Compiled: JAX's ragged paged attention. In interpret
    mode its XLA twin (`paged_attention_xla`): jax 0.10.2 interprets neither that kernel's ref
    reshapes and bitcasts (TPU interpret mode) nor its scalar-prefetch indices (the HLO
    interpreter)."""
    scale = rope.attention_scale(cfg, cfg.head_dim)
    if interpret:
        return paged_attention_xla(q, pool, kv_lens, tables, scale)  # the module docstring
    batch = q.shape[0]
    kv_pages, queries = rpa_block_sizes(cfg, pages, batch)
    return rpa.ragged_paged_attention(
        q, pool, kv_lens, tables, jnp.arange(batch + 1, dtype=i32), jnp.array([batch], i32),
        sm_scale=scale, num_kv_pages_per_block=kv_pages, num_queries_per_block=queries)


def paged_attention_xla(q: jax.Array, pool: jax.Array, kv_lens: jax.Array, tables: jax.Array,
                        scale: float) -> jax.Array:
    """`paged_attention` in XLA, the arithmetic of ragged paged attention's own reference
    (`ref_ragged_paged_attention`, one query per row): every page of the table gathered, slots
    past kv_lens masked, softmax in f32, bf16 out."""
    batch, heads, dim = q.shape
    rows = pool[tables]  # [B, M, P, 2·KV, D]
    rows = rows.reshape(batch, -1, rows.shape[3] // 2, 2, dim)  # [B, S, KV, 2, D]
    keys, values = rows[..., 0, :], rows[..., 1, :]  # [B, S, KV, D]
    groups = q.reshape(batch, keys.shape[2], -1, dim)  # [B, KV, G, D]
    scores = numerics.einsum("bkgd,bskd->bkgs", groups, keys) * scale
    visible = jnp.arange(keys.shape[1])[None, None, None, :] < kv_lens[:, None, None, None]
    weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgs,bskd->bkgd", weights, values.astype(f32), precision=HIGHEST)
    return bf(out.reshape(batch, heads, dim))


def _paged_gqa(p_stack, stack, index, x, positions, cfg, page_table, pages, interpret):
    """GQA on the paged pool: the new K/V written into its page (XLA), then paged attention over
    each row's pages (one query per row). positions -1: a free slot (writes nothing; its output
    means nothing)."""
    p = reference.layer_params(p_stack, index)
    batch, heads = x.shape[0], cfg.n_heads
    live = positions >= 0
    at = jnp.maximum(positions, 0)
    q, k, v = gqa.projections(p, x, at, cfg)  # [B, H, D], [B, KV, D]
    pool = stack["kv"]  # [L, N, P, 2·KV, D]
    layers, n_pages, size = pool.shape[:3]
    flat = pool.reshape(layers * n_pages, *pool.shape[2:])  # every layer's pages: a view
    page = page_table[jnp.arange(batch), at // size]
    target = jnp.where(live, index * n_pages + page, layers * n_pages)  # past the pool: dropped
    entry = jnp.stack([k, v], axis=2).reshape(batch, -1, cfg.head_dim)  # [B, 2·KV, D]
    flat = flat.at[target, at % size].set(entry, mode="drop")
    tables = index * n_pages + jnp.clip(page_table, 0, n_pages - 1)  # entries past a row: unread
    o = paged_attention(q, flat, jnp.where(live, positions + 1, 1).astype(i32),
                        tables.astype(i32), cfg, pages, interpret)  # [B, H, D] bf16
    out = bf(matmul(o.reshape(batch, heads * cfg.head_dim), p["w_o"]))
    return out, {"kv": flat.reshape(pool.shape)}, {}


def paged_step(params, state, tokens, positions, page_table, cfg, pages, interpret="auto"):
    """One paged step, unchecked and unjitted (`step`'s paged twin)."""
    interpret = tpu.interpret_params() if interpret == "auto" else interpret
    paged = {"page_table": page_table, "pages": pages}
    return reference.RESIDUAL_STEPS[cfg.residual](params, state, tokens, positions, cfg,
                                                  sublayers=sublayers(interpret, paged))


paged_step_jit = jax.jit(paged_step, static_argnames=("cfg", "pages", "interpret"),
                         donate_argnums=1)


def paged_decode_step(params: dict[str, Any], state: dict[str, Any], tokens: Any, positions: Any,
                      page_table: Any, cfg: ModelConfig,
                      pages: paged_kv.PagedKVConfig) -> tuple[jax.Array, dict, dict]:
    """One decode step on this layout's paged state (`paged_state_shapes`), as
    `paged_kv.paged_decode_step`: positions [B] (-1 = a free slot), page_table [B, M] covering
    positions + 1 tokens per row. State donated. Returns (logits [B, V] f32, state, aux)."""
    check_paged(cfg)
    # the package's checks, on the package's shapes of this state (no data moved)
    paged_kv.check_paged_inputs(jax.eval_shape(to_paged_kv, state), tokens, positions,
                                page_table, cfg, pages)
    return paged_step_jit(params, state, jnp.asarray(tokens, i32), jnp.asarray(positions, i32),
                          jnp.asarray(page_table, i32), cfg=cfg, pages=pages,
                          interpret=tpu.interpret_params())


# The bound against the reference, measured on CPU (interpret mode, XLA:CPU) by
# `python -m mkresearch.baselines.jax_kernels_sweep --seeds 24`: every mini (Kimi K3's in MXFP4,
# bf16 and FP8 and with the latent cache, DeepSeek's, GLM's, Qwen3's, the paged GQA step of GLM
# and Qwen3), B = 1 and 8, 24 seeds of 4 steps from a random state: 7,776 (row, step) logits.
# - 86 % of them are the reference's to the bit; while a row's routing equals the reference's
#   (7,723), |Δlogit| <= 0.177 (99.9 % <= 0.061): a bf16 rounding that flips in another order of
#   the same sums (one softmax pass, batched products, gmm's tiles), carried on;
# - a MoE layer picked another expert for a row 30 times (a near-tie of router scores); from then
#   on that row's logits differ by whole units (up to 2.4), as between any two orders of the sums;
# - the greedy token differed 29 times: 12 after a routing difference, 17 where the reference's
#   top two logits were within 0.029 of each other.
# The claim (tests/test_jax_kernels.py: each mini cut to its kinds; the exhaustive tier: the
# sweep): while a row's routing equals the reference's, |Δlogit| <= SAME_ROUTING_BOUND, and its
# greedy token is the reference's unless the reference's top two logits are within
# 2 · SAME_ROUTING_BOUND of each other.
SAME_ROUTING_BOUND = 0.2
