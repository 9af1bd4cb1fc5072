"""An always-on MLP's gate and up projections streamed as one matrix, where a rank's hidden slice is
narrower than whole lane tiles.

HBM keeps a bf16 matrix in tiles of 16 rows x 128 lanes, so a [d, S] slice with S not a multiple
of 128 is stored, and read, as [d, ceil(S / 128) 128]. The partial-sum layout splits the FFN
hidden in half-lane chunks (`layout.Layout.local_length`: Kimi K3's shared experts are 192 of
6,144 columns on each of 32 ranks, every rank real data, where whole-lane chunks of 256 left 8
ranks only padding and the other 24 a third more bytes); the rank's gate and up columns, side by
side, fill whole lanes: [d, 2 S]. One streamed matrix, one product [B, 2 S] f32 whose columns are
the two products' (the same bits: a column chunk of a product is the product's columns), split at
S. Its W_down slice [S, d] is S rows: whole sublane tiles, streamed in blocks of whole sublanes
(`blocks.weight_block_rows`).

Prepared weights hold the fused matrix under `FUSED_KEYS[gate key]`, and the body, its planned
DMAs, its cost and the weight ring find it there (`parts`); a model's own hidden sizes are whole
lanes (the config validates them), so one device never fuses.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from mkresearch.kernels.base.registry import Streamed

from mkresearch.model.config import LANE

GATE_UP = "w_gate_up"  # the part name (and DMA-log suffix) of the fused [d, 2 S] matrix
PARTS = ("w_gate", "w_up", "w_down")  # an always-on MLP's parts, in the body's order
SHARED_KEYS = {"w_gate": "w_sg", "w_up": "w_su", "w_down": "w_sd"}  # MoE weights' keys by part
DENSE_KEYS = {part: part for part in PARTS}  # the dense FFN's
FUSED_KEYS = {"w_sg": "w_sgu", "w_gate": "w_gate_up"}  # the fused matrix's key <- the gate's
# the fused matrix's key -> (the gate's, the up's): the parameters it comes from
FUSED_FROM = {FUSED_KEYS[keys["w_gate"]]: (keys["w_gate"], keys["w_up"])
              for keys in (SHARED_KEYS, DENSE_KEYS)}


def param_key(key: str) -> str:
    """The parameter a prepared weight's key reads its shard rule from (a fused gate + up: the
    gate's, whose split the up shares)."""
    return FUSED_FROM[key][0] if key in FUSED_FROM else key


def fuses(hidden: int) -> bool:
    """Whether an always-on MLP of this (per-rank) hidden width streams gate and up as one."""
    return hidden % LANE != 0


def fuse(stack: dict, keys: dict) -> dict:
    """A kind's stacked weights with the gate and up (`keys[part]`) as one [..., d, 2 S] matrix
    where `fuses(S)`; otherwise (or without an always-on MLP) as given."""
    gate, up = keys["w_gate"], keys["w_up"]
    if gate not in stack or not fuses(stack[gate].shape[-1]):
        return stack
    out = {key: value for key, value in stack.items() if key not in (gate, up)}
    out[FUSED_KEYS[gate]] = jnp.concatenate([stack[gate], stack[up]], axis=-1)
    return out


def parts(weights: dict, keys: dict) -> dict | None:
    """The always-on MLP's matrices in prepared `weights` by part: {"w_gate", "w_up", "w_down"},
    or {GATE_UP, "w_down"} where fused; None if the kind has none."""
    fused = FUSED_KEYS[keys["w_gate"]]
    if fused in weights:
        return {GATE_UP: weights[fused], "w_down": weights[keys["w_down"]]}
    if keys["w_gate"] in weights:
        return {part: weights[key] for part, key in keys.items()}
    return None


def fuse_streamed(matrices: tuple[Streamed, ...]) -> tuple[Streamed, ...]:
    """A kind's streamed matrices (one rank's shapes) with a gate and its up replaced by the fused
    matrix where `fuses(S)`: what the body streams, in its order."""
    out, skip = [], set()
    for m in matrices:
        if m.key in FUSED_KEYS and fuses(m.shape[1]):
            fused = FUSED_KEYS[m.key]
            out.append(Streamed(fused, f"{m.name.rsplit('/', 1)[0]}/{GATE_UP}",
                                (m.shape[0], 2 * m.shape[1])))
            skip.add(FUSED_FROM[fused][1])  # the up it carries
        elif m.key not in skip:
            out.append(m)
    return tuple(out)


def split(product: Any, hidden: int) -> tuple[Any, Any]:
    """The fused product [B, 2 S] -> (gate, up) [B, S] each, bf16 (as the two products are)."""
    return (product[:, :hidden].astype(jnp.bfloat16),
            product[:, hidden:].astype(jnp.bfloat16))
