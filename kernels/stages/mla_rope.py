"""DeepSeek-V3's MLA (kind "mla_rope") as one Pallas TPU kernel: x -> sublayer output + in-place
latent cache write. Same contract and arithmetic as `mkresearch.model.stages.mla_rope`.

Kimi K3's latent MLA kernel (`kernels/stages/mla.py`) with three changes, reusing its pieces:
  RoPE      per row, cos/sin of the row's position computed in the kernel from SMEM
            (`rope.cos_sin_row`, YaRN frequencies), applied to each head's q^R (the last
            mla_qk_extra dims of its query) and to the shared rope key k^R, then bf16
  scale     the softmax scale times YaRN's mscale² (`rope.attention_scale`), via the plan
  no gate   o_h = bf(bf(Σ α ĉ) W_vb_h) goes straight to W_o
The latent cache {ckv [B, S, kv_rank] = ĉ, kpe [B, S, rope] = roped k^R} is read in KV tiles by
`mla.latent_partial` (absorbed queries, online softmax seeded by the new token, only the 16-row
groups holding cached tokens) and the new entry written by `kv_update.update_latent`; their DMAs keep
MLA's names ("mla.kv.ckv", "mla.kv.kx" for the rope key, "mla.kv_update.*").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, chip_log, dma, input_checks, kv_tiles, kv_update
from mkresearch.kernels.base.blocks import bf16, f32
from mkresearch.kernels.base.registry import KernelStage, StageRefs, Streamed, register
from mkresearch.kernels.stages import mla, mla_queries

from mkresearch.hardware import tpu
from mkresearch.model import rope
from mkresearch.model.config import ModelConfig

WEIGHT_NAMES = ("w_qa", "q_norm", "w_qb", "w_kva", "kv_norm", "w_kvb", "w_o")  # with the q LoRA


def weight_names(cfg: ModelConfig) -> tuple[str, ...]:
    """WEIGHT_NAMES with the query weights of cfg (`mla_queries`: W_q alone at mla_q_rank 0)."""
    return mla_queries.weight_names(cfg.mla_q_rank) + WEIGHT_NAMES[3:]
CACHE_NAMES = ("ckv", "kpe")


@dataclasses.dataclass(frozen=True)
class MlaRopePlan(mla.MlaPlan):
    """MLA's plan (layout "latent") plus the RoPE and the YaRN-scaled softmax scale."""

    softmax_scale: float = 0.0
    rope: rope.Rope | None = None

    @property
    def scale(self) -> float:  # what mla.latent_partial multiplies the scores by
        return self.softmax_scale


def make_plan(cfg: ModelConfig, batch: int, seq_len: int, *, kv_tile: int | None = None,
              weight_block_rows: int | None = None) -> MlaRopePlan:
    """Check block sizes (ValueError naming the parameter) and fix every static size."""
    base = mla.make_plan(cfg.replace(mla_cache_layout="latent"), batch, seq_len, kv_tile=kv_tile,
                         weight_block_rows=weight_block_rows)
    return MlaRopePlan(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                       softmax_scale=rope.attention_scale(cfg, cfg.mla_qk_dim),
                       rope=rope.of(cfg, cfg.mla_qk_extra))


def mla_rope_body(plan: MlaRopePlan, refs: StageRefs) -> None:
    """One MLA-with-RoPE sublayer for B rows.

    refs.positions [B] i32 (SMEM); refs.x [B, d] bf16 (VMEM); refs.weights by WEIGHT_NAMES in HBM,
    norms as [1, n]; refs.state_in {"ckv" [B, S, kv_rank], "kpe" [B, S, rope]} in HBM and
    refs.state_out the same buffers (aliased); refs.out [B, d] bf16 (VMEM). refs.indices tag the
    DMA log.
    """
    p = plan
    positions_ref, x_ref, out_ref, indices = refs.positions, refs.x, refs.out, refs.indices
    kv_rows = refs.kv_rows or kv_tiles.CONTIGUOUS  # a paged cache: pools, through the table
    kv_norm, w_kvb, w_o = (refs.weights[n] for n in WEIGHT_NAMES[4:])
    ckv_in, kpe_in = refs.state_in["ckv"], refs.state_in["kpe"]
    ckv_out, kpe_out = refs.state_out["ckv"], refs.state_out["kpe"]
    heads, nope, qk, rank, v_dim = p.n_heads, p.qk_nope, p.qk_dim, p.kv_rank, p.v_dim
    stream = functools.partial(blocks.stream_matmul, refs.stream, **indices)

    with dma.phase("mla.project", **indices):
        x = x_ref[...]  # [B, d] bf16
        q, ckv_kpe = mla_queries.project(p, refs.weights, x, refs.stream, indices)  # [B, H·qk]
        ckv_kpe = bf16(ckv_kpe)  # [B, kv_rank + rope]
        c_hat = blocks.rms_norm(f32(ckv_kpe[:, :rank]),
                                blocks.load_whole(kv_norm, name="mla.kv_norm", **indices),
                                p.eps)  # [B, kv_rank] bf16
        k_rope_raw = f32(ckv_kpe[:, rank:])  # [B, rope], bf16 values: roped per row below

    def with_scratch(w_kvb_vmem):  # W_kvb whole in VMEM: both absorbed sides use it
        blocks.load_into(w_kvb, w_kvb_vmem, rows=p.block_rows("w_kvb"), name="mla.w_kvb",
                         **indices)

        def row_step(b, y):  # one batch row; a loop (not unrolled) keeps the kernel small
            position = positions_ref[b]
            s = blocks.state_row(b, p.rows_per_state)  # the row's cache row (mla.py: verify)
            cos, sin = rope.cos_sin_row(position, p.rope)  # [1, rope/2]
            q_b = blocks.select_row(q, b)  # [1, H·qk]
            q_row = [jnp.concatenate(  # per head [q^C | RoPE(q^R)], bf16 values
                [q_b[:, h * qk:h * qk + nope],
                 f32(bf16(rope.rotate(q_b[:, h * qk + nope:(h + 1) * qk], cos, sin)))], axis=1)
                for h in range(heads)]
            k_rope = bf16(rope.rotate(blocks.select_row(k_rope_raw, b), cos, sin))  # [1, rope]
            c_hat_b = blocks.select_row(c_hat, b)  # [1, kv_rank] bf16
            outs = mla.attend_latent(p, s, position, q_row, c_hat_b, k_rope, w_kvb_vmem,
                                      ckv_in, kpe_in, indices, kv_rows)  # per head [1, v] f32
            # the rope key's DMAs keep MLA's names (the latent layout's cache arrays)
            kv_update.update_latent(p, s, position, c_hat_b, k_rope, ckv_in, kpe_in, ckv_out,
                                    kpe_out, mla.CACHE_NAMES["latent"], indices, kv_rows)
            return tuple(blocks.put_row(y_h, b, f32(bf16(o_h))) for y_h, o_h in zip(y, outs))

        y = jax.lax.fori_loop(0, p.batch, row_step, (jnp.zeros((p.batch, v_dim)),) * heads)
        with dma.phase("mla.output", **indices):
            out_ref[...] = bf16(stream(bf16(jnp.concatenate(y, axis=1)), w_o,
                                       rows=p.block_rows("w_o"), name="mla.w_o"))

    pl.run_scoped(with_scratch, pltpu.VMEM((rank, heads * (nope + v_dim)), jnp.bfloat16))


# ---- the wrapper --------------------------------------------------------------------------------


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = mla.weight_shapes(cfg)
    return {name: shapes[name] for name in weight_names(cfg)}


def cache_shapes(cfg: ModelConfig, batch: int, seq_len: int) -> dict[str, tuple[int, ...]]:
    return {"ckv": (batch, seq_len, cfg.mla_kv_rank), "kpe": (batch, seq_len, cfg.mla_qk_extra)}


def check_inputs(p: dict, x: Any, cache: dict, positions: Any, cfg: ModelConfig) -> int:
    """ValueError naming the parameter for bad shapes, dtypes or positions; returns the cache
    length."""
    batch = input_checks.check_x(x, cfg.d_model)
    input_checks.check_arrays(p, "p", weight_shapes(cfg))
    input_checks.check_keys(cache, "cache", CACHE_NAMES)
    seq_len = cache["ckv"].shape[1] if cache["ckv"].ndim == 3 else 0
    input_checks.check_arrays(cache, "cache", cache_shapes(cfg, batch, seq_len),
                        note=f" (batch {batch}, length {seq_len})")
    input_checks.check_positions(positions, batch, seq_len)
    return seq_len


def mla_rope_attention(p: dict, x: jax.Array, cache: dict, positions: jax.Array,
                       cfg: ModelConfig, *, kv_tile: int | None = None,
                       weight_block_rows: int | None = None,
                       **indices: int) -> tuple[jax.Array, dict]:
    """The MLA-with-RoPE sublayer as a Pallas kernel; same contract as
    `stages.mla_rope.mla_rope_attention`: x [B, d] bf16 (normalised), one layer's weights, the
    layer's cache {"ckv" [B, S, kv_rank], "kpe" [B, S, rope]} bf16, positions [B] i32 ->
    (out [B, d] bf16, updated cache), in place when the caller donates it."""
    seq_len = check_inputs(p, x, cache, positions, cfg)
    plan = make_plan(cfg, x.shape[0], seq_len, kv_tile=kv_tile,
                     weight_block_rows=weight_block_rows)
    weights = {name: p[name].reshape(1, -1) if p[name].ndim == 1 else p[name]
               for name in weight_names(cfg)}
    return chip_log.run(
        lambda *args: _call(plan, tpu.interpret_params(), dma.is_recording(),
                            tuple(sorted(indices.items())), *args),
        positions, x, weights, {"ckv": cache["ckv"], "kpe": cache["kpe"]})


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _call(plan: MlaRopePlan, interpret: Any, recording: bool, indices: tuple, positions, x,
          weights, cache):
    del recording  # a static argument only so recorded and silent traces are cached apart
    return blocks.cache_stage_call(mla_rope_body, plan, interpret, indices, positions, x,
                                   weights, cache)


# ---- the kind in the kernel registry (what the megakernel composes) ----------------------------
def _prepare(stack: dict, cfg: ModelConfig) -> dict:
    """The layers' stacked weights as the body reads them: norm gains as [n, 1, x] rows."""
    return {name: stack[name].reshape(stack[name].shape[0], 1, -1) if stack[name].ndim == 2
            else stack[name] for name in weight_names(cfg)}


def _streamed(cfg: ModelConfig) -> tuple[Streamed, ...]:
    """In the body's order; W_kvb is loaded whole into VMEM (both absorbed sides use it)."""
    shapes = weight_shapes(cfg)
    return tuple(Streamed(name, f"mla.{name}", shapes[name])
                 for name in (*mla_queries.streamed_names(cfg.mla_q_rank), "w_o"))


KERNEL = register(KernelStage(
    name="mla_rope",
    plan=lambda cfg, batch, seq_len, options: make_plan(cfg, batch, seq_len,
                                                        kv_tile=options.kv_tile),
    prepare=_prepare, streamed=_streamed, body=mla_rope_body,
    scope=lambda plan: "MLA (rope, latent)"))
