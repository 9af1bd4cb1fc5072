"""GQA decode attention (kind "gqa": GLM-4.5, Qwen3) as one Pallas TPU kernel: x -> sublayer
output + in-place KV cache write. Same contract and arithmetic as `mkresearch.model.stages.gqa`.

One call does, for a batch of B rows each at its own position p_b:

  projections   q = bf(x W_q + b_q), k = bf(x W_k + b_k), v = bf(x W_v + b_v)  (weights streamed
                by DMA, `blocks.stream_matmul`; biases when the model has them)
  per row b     this row's heads go to VMEM scratch [H, D] / [KV, D] (head h in sublane h):
                QK-norm per head (RMSNorm over the lanes), RoPE at p_b with cos/sin computed in
                the kernel from the SMEM position (`rope.cos_sin_row`), bf16
  attention     per K/V head g, its G = H / KV query heads together: scores [G, D] x [T, D]ᵀ
                per KV tile (G padded to 8 rows: a head's bits whatever G, on one device or a
                rank), f32 online softmax seeded by the new token, tiles of T cached
                tokens read by a double-buffered DMA ring (`kv_tiles.tile_loop`: only the
                16-row groups of the last tile holding tokens < p_b); one DMA per tile carries
                every K/V head of the row
  output        out = bf(bf(o) W_o) (streamed)
  cache update  the roped k and v of the new token: the aligned 16-row block around p_b is read,
                patched in VMEM and written back (`kv_update.patch_blocks`; input_output_aliases)

`gqa_attention_body` works on Refs (weights as a dict) and allocates its own scratch, so a
megakernel can call it as it is; `gqa_attention` is the thin `pallas_call` wrapper.

The same body runs GPT-OSS's kinds (`kernels/stages/gqa_sink.py`, `mkresearch.model.stages.gqa_sink`)
with three switches of its plan: `sinks` (each query head's learned sink seeds the online softmax
beside the new token, `numerics.sink_seed`), `window` (a sliding window: the tile loop starts at the
window's first tile, `kv_tiles.window_first_tile`, so only the window's tiles are read, and the
softmax masks the slots before it) and `out_bias` (b_o added to the output projection).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, chip_log, dma, input_checks
from mkresearch.kernels.base.blocks import bf16, f32
from mkresearch.kernels.base.kv_tiles import (
    CONTIGUOUS,
    online_softmax_step,
    rows_dot_t,
    tile_loop,
    window_first_tile,
)
from mkresearch.kernels.base.kv_update import UPDATE_ROWS, patch_blocks
from mkresearch.kernels.base.registry import KernelStage, StageRefs, Streamed, register

from mkresearch.hardware import tpu
from mkresearch.model import numerics, rope, spec
from mkresearch.model.config import ModelConfig
from mkresearch.model.stages import gqa_sink as gqa_sink_stage

MATRICES = ("w_q", "w_k", "w_v", "w_o")
CACHE_NAMES = ("k", "v")


@dataclass(frozen=True)
class GqaPlan:
    """Everything static about one GQA kernel: shapes, options, block sizes."""

    batch: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_model: int
    seq_len: int  # S: cache length
    kv_tile: int  # T: tokens per KV tile
    bias: bool
    qk_norm: bool
    eps: float
    scale: float  # the softmax scale
    rope: rope.Rope
    rows: tuple[tuple[str, int], ...]  # matrix name -> rows of one streamed block
    # rows sharing one cache row (a verify step's K + 1 tokens, in order, as in mla.py); not in
    # the repr: the recorded compiles are keyed by a decode plan's repr
    rows_per_state: int = field(default=1, repr=False)
    # GPT-OSS's kinds (module docstring); out of the repr as above, at GQA's defaults
    prefix: str = field(default="gqa", repr=False)  # the DMA-log names' prefix: the kind
    sinks: bool = field(default=False, repr=False)
    window: int = field(default=0, repr=False)
    out_bias: bool = field(default=False, repr=False)
    # the cache [B, S, KV·D]: a token's K/V heads side by side in its lanes (GPT-OSS's kinds,
    # `stages.gqa_sink.state`), so head_dim 64 fills lanes; else [B, KV, S, D]
    lane_dense: bool = field(default=False, repr=False)

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def block_rows(self, name: str) -> int:
        return dict(self.rows)[name]


def weight_shapes(cfg: ModelConfig, kind: str = "gqa") -> dict[str, tuple[int, ...]]:
    """One layer's weights by name (the stage's table: "gqa", or GPT-OSS's "gqa_sink" and
    "gqa_sink_window"; bf16 but the sinks)."""
    return {name: param.shape for name, param in spec.stage(kind).params(cfg).items()}


def make_plan(cfg: ModelConfig, batch: int, seq_len: int, *, kv_tile: int | None = None,
              weight_block_rows: int | None = None, kind: str = "gqa") -> GqaPlan:
    """Check block sizes (ValueError naming the parameter) and fix every static size."""
    kv_tile = cfg.kv_tile if kv_tile is None else kv_tile
    blocks.check_kv_tile(kv_tile, seq_len)
    blocks.check_block_rows(weight_block_rows)
    shapes = weight_shapes(cfg, kind)
    rows = tuple((name, blocks.weight_block_rows(shapes[name], jnp.bfloat16, weight_block_rows))
                 for name in MATRICES)
    return GqaPlan(batch=batch, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                   head_dim=cfg.head_dim, d_model=cfg.d_model, seq_len=seq_len, kv_tile=kv_tile,
                   bias=cfg.attention_bias, qk_norm=cfg.qk_norm, eps=float(cfg.rms_eps),
                   scale=rope.attention_scale(cfg, cfg.head_dim),
                   rope=rope.of(cfg, cfg.rope_dim), rows=rows, prefix=kind,
                   sinks=kind != "gqa", window=gqa_sink_stage.window_of(kind, cfg),
                   out_bias=kind != "gqa" and cfg.attention_bias, lane_dense=kind != "gqa")


# ---- the body -----------------------------------------------------------------------------------


def gqa_attention_body(plan: GqaPlan, refs: StageRefs) -> None:
    """One GQA sublayer for B rows.

    refs.positions [B] i32 (SMEM); refs.x [B, d] bf16 (VMEM); refs.weights {name: HBM ref}
    (matrices [in, out], biases and norms as [1, n]); refs.state_in {"k", "v"} [B, KV, S, D]
    bf16 in HBM and refs.state_out the same buffers (aliased); refs.out [B, d] bf16 (VMEM).
    refs.indices tag the DMA log. refs.kv_rows: a paged cache (pools [N, KV, P, D] read and
    written through the page table, `kv_tiles.KvRows`), else None (contiguous).
    """
    p, indices = plan, refs.indices
    with dma.phase(f"{p.prefix}.project", **indices):
        qkv, gammas = _project(p, refs)
        sinks = (blocks.load_whole(refs.weights["sinks"], name=f"{p.prefix}.sinks", **indices)
                 if p.sinks else None)  # [1, H] f32
    y = pl.run_scoped(functools.partial(_rows, p, refs, qkv, gammas, sinks),
                      pltpu.VMEM((p.n_heads, p.head_dim), jnp.float32),
                      pltpu.VMEM((p.n_kv_heads, p.head_dim), jnp.float32))
    with dma.phase(f"{p.prefix}.output", **indices):
        out = blocks.stream_matmul(
            refs.stream, bf16(jnp.concatenate(y, axis=1)), refs.weights["w_o"],
            rows=p.block_rows("w_o"), name=f"{p.prefix}.w_o", **indices)
        if p.out_bias:
            out = out + f32(blocks.load_whole(refs.weights["b_o"], name=f"{p.prefix}.b_o",
                                              **indices))
        refs.out[...] = bf16(out)


def _project(p: GqaPlan, refs: StageRefs) -> tuple[tuple, list | None]:
    """((q [B, H·D], k, v [B, KV·D]) bf16 = bf(x W + b) each, the QK-norm gains [1, D] or None)."""
    x, weights, indices = refs.x[...], refs.weights, refs.indices  # x [B, d] bf16

    def project(name: str) -> jax.Array:  # bf(x W + b)
        y = blocks.stream_matmul(refs.stream, x, weights[f"w_{name}"],
                                 rows=p.block_rows(f"w_{name}"), name=f"{p.prefix}.w_{name}",
                                 **indices)
        if p.bias:
            y = y + f32(blocks.load_whole(weights[f"b_{name}"], name=f"{p.prefix}.b_{name}",
                                          **indices))
        return bf16(y)

    qkv = (project("q"), project("k"), project("v"))
    gammas = ([blocks.load_whole(weights[n], name=f"{p.prefix}.{n}", **indices)
               for n in ("q_norm", "k_norm")] if p.qk_norm else None)  # [1, D] each
    return qkv, gammas


def _rows(p: GqaPlan, refs: StageRefs, qkv: tuple, gammas: list | None, sinks: Any,
          q_scratch: Any, k_scratch: Any) -> tuple:
    """Every row in turn (a loop, not unrolled: it keeps the kernel small) -> per query head
    [B, D] f32. q_scratch [H, D], k_scratch [KV, D] f32: one row's heads, one per sublane;
    sinks [1, H] f32 or None."""
    step = functools.partial(_row_step, p, refs, qkv, gammas, sinks, q_scratch, k_scratch)
    return jax.lax.fori_loop(0, p.batch, step, (jnp.zeros((p.batch, p.head_dim)),) * p.n_heads)


def _row_step(p: GqaPlan, refs: StageRefs, qkv: tuple, gammas: list | None, sinks: Any,
              q_scratch: Any, k_scratch: Any, b: Any, y: tuple) -> tuple:
    """Row b: its heads QK-normed and roped at its position, attending over its cache row, its
    entry written."""
    dim, position = p.head_dim, refs.positions[b]
    q_b, k_b, v_b = (blocks.select_row(t, b) for t in qkv)  # [1, ··D]
    for h in range(p.n_heads):
        q_scratch[h:h + 1, :] = f32(q_b[:, h * dim:(h + 1) * dim])
    for g in range(p.n_kv_heads):
        k_scratch[g:g + 1, :] = f32(k_b[:, g * dim:(g + 1) * dim])
    q_heads, k_heads = q_scratch[...], k_scratch[...]
    if p.qk_norm:  # RMSNorm per head over its D lanes, before RoPE
        q_heads = f32(blocks.rms_norm(q_heads, gammas[0], p.eps))
        k_heads = f32(blocks.rms_norm(k_heads, gammas[1], p.eps))
    cos, sin = rope.cos_sin_row(position, p.rope)  # [1, R/2]
    q_heads = f32(bf16(rope.rotate(q_heads, cos, sin)))  # [H, D], bf16 values
    k_new = bf16(rope.rotate(k_heads, cos, sin))  # [KV, D]: what the cache gets
    v_new = [v_b[:, g * dim:(g + 1) * dim] for g in range(p.n_kv_heads)]  # [1, D] bf16 each
    s = blocks.state_row(b, p.rows_per_state)  # the row's cache row
    k_in, v_in = refs.state_in["k"], refs.state_in["v"]
    kv_rows = refs.kv_rows or CONTIGUOUS
    outs = _attend(p, s, position, q_heads, k_new, v_new, k_in, v_in, refs.indices, kv_rows,
                   sinks)
    _update_cache(p, s, position, k_new, v_new, k_in, v_in, refs.state_out["k"],
                  refs.state_out["v"], refs.indices, kv_rows)
    y = list(y)  # per head [B, D]
    for h in range(p.n_heads):
        g, j = divmod(h, p.group)
        y[h] = blocks.put_row(y[h], b, f32(bf16(outs[g][j:j + 1, :])))
    return tuple(y)


def _attend(p: GqaPlan, b, position, q_heads, k_new, v_new, k_hbm, v_hbm, indices, kv_rows,
            sinks=None):
    """Per K/V head g: its G query heads q_heads[gG:(g+1)G] [G, D] over the new token and the
    cached tiles [KV, T, D] (a window's only). Returns o_g = Σ α v [G, D] f32 per K/V head."""
    group = p.group
    carry = []
    for g in range(p.n_kv_heads):  # the new token seeds the softmax: m = its score, norm = 1
        q_g = q_heads[g * group:(g + 1) * group, :]
        score = blocks.ordered_sum(q_g * f32(k_new[g:g + 1, :]), keepdims=True) * p.scale
        value = jnp.broadcast_to(f32(v_new[g]), q_g.shape)
        if sinks is None:
            carry.append((score, jnp.ones_like(score), value))
        else:  # and the group's sinks [G, 1]: a logit each, no value
            carry.append(numerics.sink_seed(score, _sink_column(sinks, g * group, group), value))

    def head(tile, g):  # K/V head g of a tile: [T, D]
        return tile[:, g * p.head_dim:(g + 1) * p.head_dim] if p.lane_dense else tile[g]

    def update(t, tiles, carry):
        k_tile, v_tile = tiles
        new = []
        for g in range(p.n_kv_heads):  # [G, D] x [T, D]ᵀ: the group shares the tile
            q_g = bf16(q_heads[g * group:(g + 1) * group, :])
            # G rows: 4 query heads of Qwen3's mini on one device, 1 on each of its 4 or 8
            # ranks; padded to 8 rows, so a head gets the same bits either way (rows_dot_t,
            # and the weights' product with the values: padded)
            scores = rows_dot_t(q_g, head(k_tile, g)) * p.scale  # [G, T]
            new.append(online_softmax_step(p, t, position, scores, f32(head(v_tile, g)),
                                           carry[g], padded=True))
        return new

    first = window_first_tile(p, position, p.window) if p.window else None

    def scoped(k_buffers, v_buffers, sems):
        rings = (dma.Ring(k_buffers, sems.at[0], name=f"{p.prefix}.kv.k"),
                 dma.Ring(v_buffers, sems.at[1], name=f"{p.prefix}.kv.v"))
        return tile_loop(p, b, position, rings, (k_hbm, v_hbm), update, carry, indices,
                         phase=f"{p.prefix}.attend", kv_rows=kv_rows,
                         first_tile=first)  # tiles [KV, T, D] (lane-dense: [T, KV·D]) each

    tile = ((2, p.kv_tile, p.n_kv_heads * p.head_dim) if p.lane_dense
            else (2, p.n_kv_heads, p.kv_tile, p.head_dim))
    final = pl.run_scoped(scoped, pltpu.VMEM(tile, jnp.bfloat16), pltpu.VMEM(tile, jnp.bfloat16),
                          pltpu.SemaphoreType.DMA((2, 2)))
    return [acc / norm for _, norm, acc in final]


def _sink_column(sinks: jax.Array, first: int, count: int) -> jax.Array:
    """Query heads first..first+count-1 of sinks [1, H] as a column [count, 1] (selects over
    sublanes: no lane-to-sublane relayout)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (count, 1), 0)
    column = jnp.zeros((count, 1), jnp.float32)
    for j in range(count):
        column = jnp.where(rows == j, sinks[:, first + j:first + j + 1], column)
    return column


def _update_cache(p: GqaPlan, b, position, k_new, v_new, k_in, v_in, k_out, v_out, indices,
                  kv_rows):
    """Write the new token's roped k and v at `position` for every K/V head."""
    if p.lane_dense:  # [1, KV·D]: the heads side by side
        k_entry = jnp.concatenate([k_new[g:g + 1, :] for g in range(p.n_kv_heads)], axis=1)
        v_entry = jnp.concatenate(v_new, axis=1)
    else:
        k_entry = jnp.stack([k_new[g:g + 1, :] for g in range(p.n_kv_heads)])  # [KV, 1, D]
        v_entry = jnp.stack(v_new)  # [KV, 1, D]

    def scoped(k_block, v_block, sems):  # [KV, 16, D] (lane-dense: [16, KV·D]) each
        def patch(block, entry):
            def write(is_new):
                block[...] = jnp.where(is_new, entry, block[...])
            return write

        patch_blocks(b, position, ((k_in, k_out), (v_in, v_out)), (k_block, v_block), sems,
                     (patch(k_block, k_entry), patch(v_block, v_entry)),
                     (f"{p.prefix}.kv_update.k", f"{p.prefix}.kv_update.v"), indices, kv_rows)

    block = ((UPDATE_ROWS, p.n_kv_heads * p.head_dim) if p.lane_dense
             else (p.n_kv_heads, UPDATE_ROWS, p.head_dim))
    pl.run_scoped(scoped, pltpu.VMEM(block, jnp.bfloat16), pltpu.VMEM(block, jnp.bfloat16),
                  pltpu.SemaphoreType.DMA((2,)))


# ---- the wrapper --------------------------------------------------------------------------------


def cache_shapes(cfg: ModelConfig, batch: int, seq_len: int,
                 kind: str = "gqa") -> dict[str, tuple[int, ...]]:
    """The layer's cache by leaf: the kind's state (`spec.Stage.state`) for `batch` rows."""
    return {name: (batch, *leaf.shape)
            for name, leaf in spec.stage(kind).state(cfg, seq_len).items()}


def check_inputs(p: dict, x: Any, cache: dict, positions: Any, cfg: ModelConfig,
                 kind: str = "gqa") -> int:
    """ValueError naming the parameter for bad shapes, dtypes or positions; returns the cache
    length."""
    batch = input_checks.check_x(x, cfg.d_model)
    expected = weight_shapes(cfg, kind)
    input_checks.check_keys(p, "p", expected, f" (attention_bias={cfg.attention_bias}, "
                                        f"qk_norm={cfg.qk_norm})")
    input_checks.check_arrays(p, "p", expected, {name: param.dtype for name, param in
                                                 spec.stage(kind).params(cfg).items()})
    input_checks.check_keys(cache, "cache", CACHE_NAMES)
    token_axis = spec.stage(kind).state(cfg, 1)["k"].token_axis + 1  # of [B, ...]
    ndim = len(cache_shapes(cfg, 1, 1, kind)["k"])
    seq_len = cache["k"].shape[token_axis] if cache["k"].ndim == ndim else 0
    input_checks.check_arrays(cache, "cache", cache_shapes(cfg, batch, seq_len, kind),
                        note=f" (batch {batch}, length {seq_len})")
    input_checks.check_positions(positions, batch, seq_len)
    return seq_len


def gqa_attention(p: dict, x: jax.Array, cache: dict, positions: jax.Array, cfg: ModelConfig, *,
                  kv_tile: int | None = None, weight_block_rows: int | None = None,
                  kind: str = "gqa", **indices: int) -> tuple[jax.Array, dict]:
    """The GQA sublayer as a Pallas kernel; same contract as `stages.gqa.gqa_attention`.

    x [B, d] bf16 (normalised), one layer's weights, the layer's cache {"k", "v"}
    [B, KV, S, D] bf16, positions [B] i32 -> (out [B, d] bf16, updated cache), in place when the
    caller donates it. kv_tile overrides cfg.kv_tile (a multiple of 16 dividing S);
    weight_block_rows caps the rows of one streamed weight block (a multiple of 128). kind:
    "gqa", or GPT-OSS's "gqa_sink" / "gqa_sink_window" (`stages.gqa_sink.sink_attention`'s
    twin: its weights add b_o and the sinks).
    """
    seq_len = check_inputs(p, x, cache, positions, cfg, kind)
    plan = make_plan(cfg, x.shape[0], seq_len, kv_tile=kv_tile,
                     weight_block_rows=weight_block_rows, kind=kind)
    weights = {name: w.reshape(1, -1) if w.ndim == 1 else w for name, w in p.items()}
    return chip_log.run(
        lambda *args: _call(plan, tpu.interpret_params(), dma.is_recording(),
                            tuple(sorted(indices.items())), *args),
        positions, x, weights, {"k": cache["k"], "v": cache["v"]})


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _call(plan: GqaPlan, interpret: Any, recording: bool, indices: tuple, positions, x, weights,
          cache):
    del recording  # a static argument only so recorded and silent traces are cached apart
    return blocks.cache_stage_call(gqa_attention_body, plan, interpret, indices, positions, x,
                                   weights, cache)


# ---- the kind in the kernel registry (what the megakernel composes) ----------------------------
def prepare_stack(stack: dict, cfg: ModelConfig) -> dict:
    """The GQA layers' stacked weights as the body reads them: biases, norms (and GPT-OSS's
    sinks) as [n, 1, x]."""
    return {name: w.reshape(w.shape[0], 1, -1) if w.ndim == 2 and name not in MATRICES else w
            for name, w in stack.items()}


def streamed_matrices(cfg: ModelConfig, kind: str = "gqa") -> tuple[Streamed, ...]:
    """The matrices the body streams, in its order, named as its DMAs (`<kind>.w_q`, ...)."""
    shapes = weight_shapes(cfg, kind)
    return tuple(Streamed(name, f"{kind}.{name}", shapes[name]) for name in MATRICES)


KERNEL = register(KernelStage(
    name="gqa",
    plan=lambda cfg, batch, seq_len, options: make_plan(cfg, batch, seq_len,
                                                        kv_tile=options.kv_tile),
    prepare=prepare_stack, streamed=streamed_matrices, body=gqa_attention_body,
    scope=lambda plan: "GQA"))
