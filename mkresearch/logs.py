"""What a recorded DMA log says (`mkresearch.kernels.dma.recording`): the megakernel's schedule,
the bytes a step moved against the least it could.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mkresearch import roofline
from mkresearch.config import ModelConfig
from mkresearch.kernels import dma, mla


# ---- the schedule, read back from a recorded step ---------------------------------------------
def late_prefetches(log: dma.DmaLog, n_layers: int) -> dict[str, list[int]]:
    """Where the global weight stream did NOT run ahead in a recorded step (empty lists: it always did).

    ffn: layers whose FFN's first weight block was not issued before attention's last block was
    waited for; next_layer: layers l whose layer l+1's first block was not issued before l's FFN
    ends; experts: MoE calls (in order) whose first expert DMA did not come right after routing,
    before the latent down-projection was waited for."""
    events = log.events

    def first(kind, names, layer):
        return next(i for i, e in enumerate(events) if e.kind == kind and e.name in names
                    and e.indices.get("layer") == layer)

    def last(kind, names, layer):
        return max(i for i, e in enumerate(events) if e.kind == kind and e.name in names
                   and e.indices.get("layer") == layer)

    late = {"ffn": [], "next_layer": [], "experts": []}
    for layer in range(n_layers):
        if first("dma_start", {"latent/w_ld", "dense/w_gate"}, layer) > last(
                "dma_wait", {"kda.w_o", "mla.w_o"}, layer):
            late["ffn"].append(layer)
        if layer + 1 < n_layers and first("dma_start", {"kda.w_fa", "mla.w_qa"}, layer + 1) > last(
                "dma_wait", {"shared/w_down", "dense/w_down"}, layer):
            late["next_layer"].append(layer)
    routed = [i for i, e in enumerate(events)
              if e.name == "router/weights_to_smem" and e.kind == "dma_wait"]
    for call, i in enumerate(routed):
        expert = next(j for j in range(i, len(events)) if events[j].name.startswith("expert/"))
        latent = next(j for j in range(i, len(events))
                      if events[j].name == "latent/w_ld" and events[j].kind == "dma_wait")
        if events[expert].kind != "dma_start" or expert > latent:
            late["experts"].append(call)
    return late


# ---- bytes: what a step moves against the least it could ----------------------------------------
def hbm_bytes(log: dma.DmaLog) -> int:
    """Bytes of the DMAs of a recorded step that touch HBM (VMEM->SMEM copies excluded)."""
    return sum(e.nbytes for e in log.select("dma_start") if "hbm" in (e.src, e.dst))


@dataclass(frozen=True)
class MinimumBytes:
    """The least HBM traffic of one step: each weight once, each unique routed expert once, the
    cached tokens' KV rows in whole 16-row HBM tiles (`mla.kv_tile_bytes_needed`), the
    recurrent/conv state read and written, the new KV entries written, one embedding row per
    sequence."""

    weights: int
    embedding_rows: int
    routed_experts: int
    kv_tiles: int
    kda_state: int
    kv_entries: int

    @property
    def total(self) -> int:
        return (self.weights + self.embedding_rows + self.routed_experts + self.kv_tiles
                + self.kda_state + self.kv_entries)

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {getattr(self, k):,d}" for k in
                          ("weights", "embedding_rows", "routed_experts", "kv_tiles", "kda_state",
                           "kv_entries"))
        return f"minimum {self.total:,d} B = {parts}"


def minimum_step_bytes(cfg: ModelConfig, batch: int, positions: Any,
                       expert_ids: Any) -> MinimumBytes:
    """positions [B] of the step; expert_ids [n_moe, B, k] its routing (reference aux)."""
    step = roofline.step_bytes(cfg, batch)  # every weight but the routed experts and embedding
    weights = sum(step.read[name] for name in ("kda", "mla", "dense", "moe_nonrouted", "lm_head",
                                               "norms_and_mix"))
    unique = sum(len(np.unique(layer)) for layer in np.asarray(expert_ids))
    n_mla = len(cfg.mla_layers)
    return MinimumBytes(
        weights=weights, embedding_rows=step.read["embedding_rows"],
        routed_experts=unique * roofline.expert_bytes(cfg),
        kv_tiles=n_mla * mla.kv_tile_bytes_needed(positions, cfg),
        kda_state=step.read["kda_state"] + step.written["kda_state"],
        kv_entries=n_mla * batch * mla.kv_bytes_per_token(cfg))
