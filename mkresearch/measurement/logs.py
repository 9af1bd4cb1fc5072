"""What a recorded DMA log says (`mkresearch.kernels.base.dma.recording`): the bytes a step moved
against the least it could, the KV tokens an MLA run read (rescaled to other shapes and to one
rank of a pod), and the runs that record the logs of notebooks 02 and 04 and of the figures.
The megakernel's schedule (its DMA order, the prefetch checks) is data before the step runs:
`mkresearch.kernels.compose.schedule`, which a recorded step equals event for event.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkresearch.kernels.base import dma
from mkresearch.kernels.stages import router
from mkresearch.kernels.stages.experts import EXPERT_DMA_PREFIX, routed_experts
from mkresearch.kernels.stages.mla import cache_shapes, mla_attention
from mkresearch.model import kv_cache, reference, roofline, spec, weights
from mkresearch.model.config import MLA_CACHE_LAYOUTS, ModelConfig
from mkresearch.model.kv_cache import kv_bytes_per_token


# ---- bytes: what a step moves against the least it could ----------------------------------------
def hbm_bytes(log: dma.DmaLog) -> int:
    """Bytes of the DMAs of a recorded step that touch HBM (VMEM->SMEM copies excluded)."""
    return sum(e.nbytes for e in log.select("dma_start") if "hbm" in (e.src, e.dst))


# DMA-log names -> the roofline component (`spec.components`) they read, first match wins
COMPONENT_PREFIXES = (
    ("kda_state", ("kda.conv_state.", "kda.state.")), ("kda", ("kda.",)),
    ("mla_cache", ("mla.kv.", "mla.kv_update.")), ("mla", ("mla.",)),
    ("gqa_cache", ("gqa.kv.", "gqa.kv_update.")), ("gqa", ("gqa.",)), ("dense", ("dense/",)),
    ("routed_experts", ("expert/",)), ("moe_nonrouted", ("router/", "latent/", "shared/")),
    ("lm_head", ("lm_head",)), ("embedding_rows", ("embed",)),
    ("norms_and_mix", ("mix_", "attn_norm", "mlp_norm", "final_norm")))


def hbm_bytes_by_component(log: dma.DmaLog) -> dict[str, int]:
    """The HBM bytes of a recorded step (or of one rank's events, `DmaLog.of_rank`) by roofline
    component, from the DMA names; anything else under "other"."""
    out: dict[str, int] = {}
    for e in log.select("dma_start"):
        if "hbm" not in (e.src, e.dst) or e.remote:
            continue
        name = next((component for component, prefixes in COMPONENT_PREFIXES
                     if e.name.startswith(prefixes)), "other")
        out[name] = out.get(name, 0) + e.nbytes
    return out


@dataclass(frozen=True)
class MinimumBytes:
    """The least HBM traffic of one step: each weight once, each unique routed expert once, the
    cached tokens' KV rows of every cache kind in whole 16-row HBM tiles
    (`kv_cache.rows_read`), the recurrent state (KDA's) read and written, the new KV entries
    written, one embedding row per sequence."""

    weights: int
    embedding_rows: int
    routed_experts: int
    kv_tiles: int
    recurrent_state: int
    kv_entries: int

    @property
    def total(self) -> int:
        return (self.weights + self.embedding_rows + self.routed_experts + self.kv_tiles
                + self.recurrent_state + self.kv_entries)

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {getattr(self, k):,d}" for k in
                          ("weights", "embedding_rows", "routed_experts", "kv_tiles",
                           "recurrent_state", "kv_entries"))
        return f"minimum {self.total:,d} B = {parts}"


def minimum_step_bytes(cfg: ModelConfig, batch: int, positions: Any,
                       expert_ids: Any) -> MinimumBytes:
    """positions [B] of the step; expert_ids [n_moe, B, k] its routing (reference aux).

    Any model of the stage registry: the weights are every component of `roofline.step_bytes`
    but the routed experts, the embedding rows and the states; each cache kind (MLA expanded or
    latent, MLA with RoPE, GQA) reads Σ_b rows_read(p_b) tokens at its bytes per token
    (`roofline.cache_bytes_per_token`, every layer with a cache) and writes one per row."""
    step = roofline.step_bytes(cfg, batch)  # context 0: the states read are the recurrent ones
    routed = {kind.routed_component[0] for kind in spec.stages_of(cfg) if kind.routed}
    apart = routed | set(step.state_components) | {"embedding_rows"}
    unique = sum(len(np.unique(layer)) for layer in np.asarray(expert_ids))
    per_token = roofline.cache_bytes_per_token(cfg)
    tokens = sum(kv_cache.rows_read(int(position)) for position in np.asarray(positions))
    return MinimumBytes(
        weights=sum(v for name, v in step.read.items() if name not in apart),
        embedding_rows=step.read["embedding_rows"],
        routed_experts=unique * roofline.expert_bytes(cfg),
        kv_tiles=tokens * per_token,
        recurrent_state=2 * batch * roofline.recurrent_state_bytes(cfg),
        kv_entries=batch * per_token)


# ---- MLA KV traffic --------------------------------------------------------------------------
def kv_bytes_at(log: dma.DmaLog, recorded: ModelConfig, target: ModelConfig) -> int:
    """The KV tile bytes of a recorded run, rescaled to another config's per-token bytes.

    The log counts the tokens read (its KV tile bytes over `recorded`'s bytes per token); the
    same tokens at `target`'s shapes (heads, ranks, layout) cost `target`'s bytes per token.
    """
    return tokens_read(log, recorded) * kv_bytes_per_token(target)


def tokens_read(log: dma.DmaLog, recorded: ModelConfig, row: int | None = None) -> int:
    """The tokens whose KV tiles a recorded run read (all rows, or batch row `row`): its KV tile
    bytes over `recorded`'s bytes per token; ValueError if that is not a whole number."""
    nbytes = log.dma_bytes("mla.kv.") if row is None else kv_bytes_by_row(log).get(row, 0)
    tokens, remainder = divmod(nbytes, kv_bytes_per_token(recorded))
    if remainder:
        raise ValueError(f"recorded={recorded.name!r} does not match the log: its KV bytes are not "
                         f"a whole number of {recorded.mla_cache_layout} tokens")
    return tokens


def kv_bytes_by_row(log: dma.DmaLog) -> dict[int, int]:
    """KV tile bytes each batch row read, from the log's `row` index."""
    by_row: dict[int, int] = {}
    for event in log.select("dma_start", "mla.kv."):
        by_row[event.indices["row"]] = by_row.get(event.indices["row"], 0) + event.nbytes
    return by_row


def kv_bytes_per_rank(logs: dict, recorded: ModelConfig, target: ModelConfig, n_ranks: int,
                      row: int) -> dict[str, int]:
    """KV bytes one rank reads per MLA layer per step at `target` (per-rank shapes, context
    target.max_seq_len), scaled from the DMA logs of a run at `recorded` (mini) shapes.

    logs: "expanded" and "latent" — `mla_attention` runs (heads sharded: a rank reads every token
    for its heads); "latent-sequence" — a list of `mla_latent_partial` runs, one per shard. `row`
    is a batch row at the last position, so it attends to the whole recorded context. Each log
    gives the share of that context one rank reads (its busiest shard for "latent-sequence", as a
    share of len(shards) shards rescaled to n_ranks); `target` prices that share of its context
    at its bytes per token (heads of target.n_heads for expanded, the whole latent otherwise).
    """
    def share(log, layout):
        return Fraction(tokens_read(log, recorded.replace(mla_cache_layout=layout), row),
                        recorded.max_seq_len)

    shards = logs["latent-sequence"]
    shares = {"expanded": share(logs["expanded"], "expanded"),
              "latent": share(logs["latent"], "latent"),
              "latent-sequence": max(share(log, "latent") for log in shards)
              * Fraction(len(shards), n_ranks)}
    tokens = {name: value * target.max_seq_len for name, value in shares.items()}
    if any(value.denominator != 1 for value in tokens.values()):
        raise ValueError(f"target.max_seq_len={target.max_seq_len} is invalid: the shares "
                         f"{ {k: str(v) for k, v in shares.items()} } of it must be whole tokens")
    return {name: int(tokens[name]) * kv_bytes_per_token(
        target.replace(mla_cache_layout="expanded" if name == "expanded" else "latent"))
        for name in tokens}


FIGURE_POSITIONS = (0, 17, 32, 45, 64, 90, 100, 127)  # 0, tile boundaries and in-between


def record_kv_logs(cfg: ModelConfig, positions=FIGURE_POSITIONS, seed: int = 0) -> dict:
    """Run both layouts once at `cfg` (mini) shapes, one row per position; their DMA logs."""
    params = reference.layer_params(weights.init_params(cfg, seed)["mla"], 0)
    batch = len(positions)
    x = jax.random.normal(jax.random.key(seed), (batch, cfg.d_model)).astype(jnp.bfloat16)
    logs = {}
    for layout in MLA_CACHE_LAYOUTS:
        layout_cfg = cfg.replace(mla_cache_layout=layout)
        cache = {name: jnp.zeros(shape, jnp.bfloat16)
                 for name, shape in cache_shapes(layout_cfg, batch, cfg.max_seq_len).items()}
        with dma.recording() as logs[layout]:
            jax.block_until_ready(mla_attention(params, x, cache, jnp.asarray(positions, jnp.int32),
                                                layout_cfg))
    return logs


# ---- routed-expert bytes vs batch (notebook 04 and `make figures`) -----------------------------
def expert_bytes_by_batch(cfg: ModelConfig, batches=(1, 2, 4, 8), seed: int = 0) -> list[dict]:
    """Run the routed stage (router kernel -> plan "unique", 2 slots) for each batch size on
    random normalised rows; per batch: unique experts and the expert bytes of the DMA log."""
    p = reference.layer_params(weights.init_params(cfg, seed)["moe"], 0)
    rows = []
    for batch in batches:
        x = jnp.asarray(np.random.default_rng(seed + batch).standard_normal((batch, cfg.d_model)),
                        jnp.bfloat16)
        ids, w = router.route(p, x, cfg)
        with dma.recording() as log:
            routed_experts(p, x, ids, w, cfg, plan="unique", n_slots=2)
        rows.append({"batch": batch, "unique": len(np.unique(np.asarray(ids))),
                     "choices": batch * cfg.top_k,
                     "expert_bytes": log.dma_bytes(EXPERT_DMA_PREFIX)})
    return rows
