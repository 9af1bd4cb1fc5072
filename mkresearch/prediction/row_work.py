"""The work a rank does once per batch row: the scale-out model's batch-dependent compute terms
(docs/prediction.md §4, "What grows with the batch").

Below the MXU's 256 rows a weight tile costs the MXU the same at any batch
(`TimelineChip.mxu_seconds_per_byte`), so a rank's per-row work is what is *not* a weight tile:
the element-wise work on each row's own vectors and states. Each term below is counted from the
body's shapes (docs/kimi-k3.md §3-§6, the kernels' own loops) as f32 element-wise operations per
row on one rank, and runs at the chip's vector rate (`TimelineChip.vpu_flops`: ASSUMPTION, bf16
peak / 16, in `--validate`'s sensitivity set). The same terms, counted the same way, are in
both sides' programs (ours and the release's: `scale_out._rank_program`), each at its point of
the stage (`POINTS`):

  residual mix   every rank holds the whole [B, d] residual (docs/kimi-k3.md §3): per layer the
                 two Mixes over N candidates (⟨v, w⟩, mean(v²), Σ α v: 6 d per candidate) and
                 the two RMSNorms (square, sum, scale, γ: 4 d); a pre-norm model's two residual
                 adds (d) and norms
  delta rule     a KDA head's state update beside its two products (docs/kimi-k3.md §4):
                 S̄ = Diag(e^λ) S (D²) and S̄ + β k (v − S̄ᵀk)ᵀ (a multiply and an add, 2 D²),
                 per head on the rank. The two products S̄ᵀk and Sᵀq (4 D²) take the state as
                 an MXU tile; they are priced with the state's read, which the program multiplies
                 on landing: 4 D² bytes at one bf16 pass of 2 x (D² weights) x 256 rows / peak
                 each, the same seconds
  softmax        an attention head's scores over the cached tokens and the new one: scale, max,
                 exp, sum (4 per score), per head on the rank (the scores' products: with the
                 cache's read, as above)
  top-k          the router's sigmoid (1 per expert) and k serial picks over the scores, each a
                 compare, an index select and a mask over every expert (3 per expert); the
                 scores are whole on every rank (docs/collectives.md §1: the latent gather starts
                 "after the 3rd pick"). Counted as throughput: a pick's latency (its cross-lane
                 reduction) is not published, so this is a lower bound

Not per row (so not here): decoding MXFP4 / FP8 experts is work per weight, paid once per
distinct expert fetched whatever the rows routed to it; the expert count already grows with the
batch (`scale_out.routed_experts`), and the release's report measured its int4 expert dots
DMA-bound (~1.3 us per 3.19 MiB expert, as `second_model` quotes it), so unpacking adds no time
beyond the expert's read. Per-row collective payloads are the collectives' own
(`interconnect.price`). What these terms leave of the published steps' growth with the batch, and
why no public figure closes it: docs/prediction.md §4.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from mkresearch.model import spec
from mkresearch.model.config import ModelConfig

# per candidate of a Mix: ⟨v, w⟩ (2 d), mean(v²) (2 d), Σ α v (2 d)
MIX_PER_CANDIDATE = 6
RMS_NORM = 4  # square, sum, scale, γ: per channel
DELTA_RULE = 3  # per D² of a head: the decay's multiply, the rank-1 update's multiply and add
SOFTMAX = 4  # per score: scale, max, exp, sum
PICK = 3  # per expert per pick: compare, index select, mask
SIGMOID = 1  # per expert score
TERMS = ("residual mix", "delta rule", "softmax", "top-k")
# where each term runs in a stage's program: before the output projection (the attention's
# per-row work), before the routed experts' fetch (top-k), at the layer's start (the mixes)
POINTS = {"delta rule": "w_o", "softmax": "w_o", "top-k": "experts", "residual mix": "layer"}


@dataclass(frozen=True)
class RowWork:
    """One term's element-wise FLOPs per row on one rank, per layer it runs in and per step."""

    term: str
    kind: str  # the stage kind it runs in ("" for the residual mixes: every layer)
    per_layer: tuple[float, ...]  # FLOPs per row, one entry per layer of that kind
    formula: str

    @property
    def per_step(self) -> float:
        return float(sum(self.per_layer))


def heads_per_rank(cfg: ModelConfig, n_ranks: int) -> int:
    """A rank's attention heads: both layouts split the heads over every rank
    (docs/kimi-k3.md §9: 3 heads per rank of 32)."""
    return math.ceil(cfg.n_heads / n_ranks)


def mix_candidates(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(N before the attention, N before the FFN) of a layer's Mixes (docs/kimi-k3.md §3)."""
    block, offset = divmod(layer, cfg.attn_res_block)
    before_attention = 1 if layer == 0 else block + 1 if offset == 0 else block + 2
    return before_attention, block + 2


@functools.lru_cache(maxsize=256)  # a scale-out prediction asks once per stage of every rank
def terms(cfg: ModelConfig, n_ranks: int, context: int = 0) -> tuple[RowWork, ...]:
    """Every per-row term of one rank's step (FLOPs per row; `context` cached tokens)."""
    d, heads = cfg.d_model, heads_per_rank(cfg, n_ranks)
    out = []
    if cfg.residual == "attention_mix":
        mixes = tuple(MIX_PER_CANDIDATE * d * sum(mix_candidates(cfg, layer)) + 2 * RMS_NORM * d
                      for layer in range(cfg.n_layers))
        formula = f"{MIX_PER_CANDIDATE} d N per Mix (two per layer) + 2 x {RMS_NORM} d"
    else:
        mixes = (2 * d + 2 * RMS_NORM * d,) * cfg.n_layers
        formula = f"2 d (residual adds) + 2 x {RMS_NORM} d"
    out.append(RowWork("residual mix", "", mixes, formula))
    for kind in dict.fromkeys(cfg.attention_kinds):
        count = len(cfg.layers_of(kind))
        has_state = spec.stage(kind).state_component is not None
        has_cache = spec.keeps_cache(cfg, kind)
        if has_state and not has_cache:  # a recurrent state (KDA): the delta rule
            dim = cfg.kda_head_dim
            out.append(RowWork("delta rule", kind, (DELTA_RULE * heads * dim * dim,) * count,
                               f"{DELTA_RULE} D² per head, {heads} heads, D = {dim}"))
        elif has_cache:
            out.append(RowWork("softmax", kind, (SOFTMAX * heads * (context + 1),) * count,
                               f"{SOFTMAX} per score, {heads} heads x (context + 1)"))
    for kind in dict.fromkeys(ffn for _, ffn in cfg.layers):
        if spec.stage(kind).routed:  # a routed FFN: its router's top-k on every row
            e, k = cfg.n_experts, cfg.top_k
            per_layer = (SIGMOID * e + PICK * k * e,) * len(cfg.layers_of(kind))
            out.append(RowWork("top-k", kind, per_layer,
                               f"{SIGMOID} E + {PICK} k E, E = {e}, k = {k}"))
    return tuple(out)


def stage_flops(cfg: ModelConfig, n_ranks: int, context: int, kind: str) -> dict[str, float]:
    """{point (`POINTS`): FLOPs per row} of one layer of stage `kind`: the terms that run in
    that stage (the residual mixes run at each layer's start, by layer: `terms`)."""
    out: dict[str, float] = {}
    for t in terms(cfg, n_ranks, context):
        if t.kind == kind:
            out[POINTS[t.term]] = out.get(POINTS[t.term], 0.0) + t.per_layer[0]
    return out


def table(cfg: ModelConfig, n_ranks: int, batches, vpu_flops: float, context: int = 0
          ) -> list[dict]:
    """Per term: its formula, FLOPs per row per step on a rank, and seconds per step at each
    batch (rows x FLOPs / vpu_flops): what `predict --explain` and `--json` print."""
    return [{"term": t.term, "kind": t.kind or "every layer", "formula": t.formula,
             "flops_per_row": t.per_step,
             "seconds": {b: b * t.per_step / vpu_flops for b in batches}}
            for t in terms(cfg, n_ranks, context)]
