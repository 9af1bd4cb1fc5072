"""The megakernel's body: one decode step of a whole model on Refs, every stage its own body.

    tokens [B] --DMA row gather--> e = E[token]           R_0 = P = e, R_1.. = 0    (docs/kimi-k3.md §3.1)
    for ℓ in fori_loop(0, L):                              one traced layer body, not L copies
        h  = Mix(𝒜_ℓ; w_attn[ℓ])                          the residual strategy's inputs
        a  = switch(attention kind of ℓ)(RMSNorm(h))       weights: stack.at[index]
        h′ = Mix({R_0..R_n, P}; w_mlp[ℓ])
        m  = switch(FFN kind of ℓ)(RMSNorm(h′))
        P  = bf(P + m)
    tokens = sampling body (final mix, norm, LM head tiles, greedy / Gumbel sampling)

Every stage is the stage kernel's own body function (`kernels/stages/kda.py`, `mla.py`,
`experts.py`, `sampling.py`, ...), called on Refs: per-layer weights are views `stack.at[i]` of
the stacked HBM arrays, with `i` the layer's index within its kind, read from an SMEM layer table.
Caches and states are updated in place (input_output_aliases); activations never leave VMEM.
Weights stream through ONE global ring across stage and layer boundaries
(`kernels/base/weight_stream.py`). The wrapper, `pallas_call` and all, is `megakernel.py`.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, dma, dry_run, kv_tiles, planned, registry, weight_stream
from mkresearch.kernels.base.weight_stream import (
    ATTN_INDEX,
    ATTN_KIND,
    FFN_INDEX,
    FFN_KIND,
    TABLE_FIELDS,
)
from mkresearch.kernels.compose.megakernel_plan import (
    EMBED_ROWS,
    MegaPlan,
    kernel_buffers,
    trunk_scopes,
)
from mkresearch.kernels.sharded import collectives, sharded_stages
from mkresearch.kernels.stages import residuals, sampling

from mkresearch.model import spec


# ---- the step's inputs and outputs (typed Ref bundles) -------------------------------------------
@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "positions", "seed", "table", "sample_positions",
                                "temperature", "top_k", "top_p", "page_table"], meta_fields=[])
@dataclass(frozen=True)
class StepInputs:
    """tokens, positions [B] i32, seed [1] i32 and the layer table [4L] i32 (SMEM scalars);
    sample positions (p + 1), top_k [B, 1] i32, temperature, top_p [B, 1] f32 (VMEM rows); a
    paged step's page table [B · max_pages_per_row] i32 (SMEM, `megakernel_paged.py`), else None."""

    tokens: Any
    positions: Any
    seed: Any
    table: Any
    sample_positions: Any
    temperature: Any
    top_k: Any
    top_p: Any
    page_table: Any = None

    @staticmethod
    def specs(paged: bool = False) -> StepInputs:
        smem, vmem = pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)
        return StepInputs(smem, smem, smem, smem, vmem, vmem, vmem, vmem, smem if paged else None)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "overflow", "logits", "per_position"], meta_fields=[])
@dataclass(frozen=True)
class StepOutputs:
    """tokens, nucleus overflow [B, 1] i32 and, for checking only, logits [B, V] f32 (VMEM); a
    verify step's per-token states {kind: {leaf: [K+1, n_layers, B, ...]}} (HBM), else None."""

    tokens: Any
    overflow: Any
    logits: Any = None
    per_position: Any = None


def per_position_shapes(plan: MegaPlan, state: Any) -> dict | None:
    """A verify step's per-token states: every non-cache leaf [n, B, ...] of `state` (shape
    structs) as [K+1, n, B, ...]; None for a decode step (plan.rows_per_state 1)."""
    if plan.rows_per_state == 1:
        return None
    table = spec.state_table(plan.cfg, plan.state_batch, plan.seq_len)
    return {kind: {leaf: jax.ShapeDtypeStruct((plan.rows_per_state, *a.shape), a.dtype)
                   for leaf, a in leaves.items() if table[kind][leaf].kind != spec.CACHE}
            for kind, leaves in state.items()
            if any(table[kind][leaf].kind != spec.CACHE for leaf in leaves)}


# ---- the body ----------------------------------------------------------------------------------
def megakernel_body(plan: MegaPlan, use_gumbel: bool, use_candidates: bool,
                    inputs: StepInputs, w: dict, state_in: dict, outputs: StepOutputs,
                    state_out: dict, *scratch: Any, shard: Any = None, pages: Any = None,
                    live: dict | None = None) -> None:
    """The whole decode step, on Refs: the step's inputs (SMEM scalars and VMEM rows), the
    prepared weights and the state (HBM; the state's outputs are the same buffers). On a rank of
    a sharded model (`shard`: a collectives.ShardPlan, its buffers in `scratch`): this rank's
    weights and state, the collectives inside (`kernels/compose/megakernel_sharded.py`). pages: a
    paged KV cache's PagedKVConfig (the cache leaves are pools, read through inputs.page_table).
    live: {ring matrix name: False} for the matrices whose slice is only padding on the rank whose
    shapes a dry run plans on one device (`schedule.rank_live`)."""
    step = functools.partial(_step, plan, use_gumbel, use_candidates, inputs, w, state_in, outputs,
                             state_out)
    if shard is None:
        return step(pages=pages, live=live)
    coll = collectives.Collectives(shard, scratch)
    with dma.on_rank(coll.rank):
        coll.barrier()
        return step(coll)


def _step(plan: MegaPlan, use_gumbel: bool, use_candidates: bool, inputs: StepInputs, w: dict,
          state_in: dict, outputs: StepOutputs, state_out: dict, coll: Any = None,
          pages: Any = None, live: dict | None = None) -> None:
    """Allocate the kernel-wide VMEM (stage input and output, layer vectors, the residual
    strategy's hidden state, each kind's scratch, the weight ring) and run the step in it."""
    cfg, batch = plan.cfg, plan.batch
    residual = residuals.RESIDUALS[cfg.residual]
    stages = [registry.kernel_stage(kind) for kind in cfg.kinds]
    scratch_shapes = [shape for stage in stages for _, shape in stage.scratch(cfg, batch)]
    kv_rows = None if pages is None else kv_tiles.KvRows(inputs.page_table, pages.page_size,
                                                         pages.max_pages_per_row)

    buffers = kernel_buffers(cfg, batch, plan.stream)  # the VMEM plan's kernel-wide ones
    n_hidden = len(residual.vmem(cfg, batch))

    def scoped(x_ref, out_ref, vectors, sems, *rest):
        hidden, rest = rest[:n_hidden], rest[n_hidden:]
        scratch, ring = {}, rest[len(scratch_shapes):]
        for stage in stages:
            count = len(stage.scratch(cfg, batch))
            scratch[stage.name], rest = stage.scratch_bundle(tuple(rest[:count])), rest[count:]
        stream = (weight_stream.GlobalStream(plan.stream, *ring, w, inputs.table, cfg.n_layers,
                                             live=coll.live(plan.stream) if coll else live,
                                             experts_first=plan.options.expert_reads_first)
                  if plan.stream is not None else None)
        trunk = _Trunk(plan, residual, inputs, w, state_in, state_out, outputs, x_ref, out_ref,
                       vectors, sems, tuple(hidden), scratch, stream, coll, kv_rows)
        trunk.embed()
        lax.fori_loop(0, cfg.n_layers, trunk.layer_step, 0)
        trunk.sample(use_gumbel, use_candidates)

    pl.run_scoped(scoped, *(shape for _, shape in buffers))


def _layer_refs(tree: Any, index: Any) -> Any:
    """One layer's view `.at[index]` of every stacked Ref of a kind."""
    return jax.tree.map(lambda ref: ref.at[index], tree)


@dataclass(frozen=True)
class _Trunk:
    """What the step's pieces work on: the plan, the step's Refs and the kernel-wide buffers
    (x_ref, out_ref [B, d] bf16: a stage's input and output; vectors [n, 1, d] f32: this layer's
    residual weights; sems: one DMA semaphore per vector or embedding row; hidden: the residual
    strategy's state; scratch: each kind's, by kind; stream: the global ring or None; coll: a
    rank's collectives or None; kv_rows: a paged cache's page table or None)."""

    plan: MegaPlan
    residual: Any
    inputs: StepInputs
    w: dict
    state_in: dict
    state_out: dict
    outputs: StepOutputs
    x_ref: Any
    out_ref: Any
    vectors: Any
    sems: Any
    hidden: tuple
    scratch: dict
    stream: Any
    coll: Any
    kv_rows: Any

    # -- 1. e = E[token] -------------------------------------------------------------------------
    def embed(self) -> None:
        """The embedding rows into the residual state; the weight ring's first blocks fly from
        the start (on a rank, while the embedding's all-reduce is waited for)."""
        if self.stream is not None and self.coll is not None:
            self.stream.prologue()
        with dry_run.owned_by("embedding"):
            pl.run_scoped(self._gather, *self._scope("embedding"))
        if self.stream is not None and self.coll is None:
            self.stream.prologue()

    def _gather(self, blocks_vmem: Any) -> None:
        """HBM is tiled in 16-row bf16 groups: a DMA window must start on one, so each row's
        aligned 16-row block is fetched and the row picked in VMEM (exact: one hit).
        blocks_vmem [B, 16, d] bf16."""
        w, tokens, batch = self.w, self.inputs.tokens, self.plan.batch
        if self.coll is not None:  # a vocab shard: the owner's row, all-reduced
            embedded = sharded_stages.embed(self.coll, w["embed"], tokens, blocks_vmem,
                                            self.sems, batch)
            return self.residual.start(self.hidden, embedded.astype(jnp.bfloat16))
        copies = []
        for b in range(batch):
            start = pl.multiple_of(lax.div(tokens[b], EMBED_ROWS) * EMBED_ROWS, EMBED_ROWS)
            copies.append(dma.Copy(w["embed"].at[pl.ds(start, EMBED_ROWS), :],
                                   blocks_vmem.at[b], self.sems.at[b], name="embed",
                                   buffer=planned.EMBEDDING, row=b))
            copies[-1].start()
        with dma.phase("embed"):
            embedded = jnp.zeros((batch, self.plan.cfg.d_model), jnp.float32)
            for b, copy in enumerate(copies):
                copy.wait()
                row = blocks.select_row(blocks_vmem[b], lax.rem(tokens[b], EMBED_ROWS))
                embedded = blocks.put_row(embedded, b, row)
            self.residual.start(self.hidden, embedded.astype(jnp.bfloat16))  # exactly E[token]
        return None

    # -- 2. the layers ----------------------------------------------------------------------------
    def layer_step(self, layer: Any, carry: Any) -> Any:
        """One layer: its residual vectors, the attention stage, the FFN stage (each the body of
        the kind the layer table names), the residual update."""
        cfg, residual, table, hidden = self.plan.cfg, self.residual, self.inputs.table, self.hidden
        row = layer * len(TABLE_FIELDS)
        with dry_run.owned_by("residual", layer):
            self._load_vectors(layer)
        self.x_ref[...] = residual.attention_input(hidden, layer, self.vectors, cfg)
        self._run_stage(layer, table[row + ATTN_KIND], table[row + ATTN_INDEX],
                        self.plan.attention_kinds)
        self.x_ref[...] = residual.ffn_input(hidden, layer, self.vectors, self.out_ref[...], cfg)
        self._run_stage(layer, table[row + FFN_KIND], table[row + FFN_INDEX], self.plan.ffn_kinds)
        residual.after_ffn(hidden, self.out_ref[...])
        return carry

    def _load_vectors(self, layer: Any) -> None:
        """This layer's residual weights and norm gains, [1, d] each."""
        copies = [dma.Copy(self.w[n].at[layer], self.vectors.at[i], self.sems.at[i], name=n,
                           buffer=planned.LAYER_VECTORS, layer=layer)
                  for i, n in enumerate(self.residual.vectors)]
        for copy in copies:
            copy.start()
        for copy in copies:
            copy.wait()

    def _run_stage(self, layer: Any, kind_id: Any, index: Any, stage_kinds: tuple) -> None:
        """The stage body of this layer's kind (a switch on the table's kind id)."""
        branches = [functools.partial(self._run_body, kind, layer, index) for kind in stage_kinds]
        if len(branches) == 1:
            branches[0]()
        else:
            lax.switch(kind_id, branches)

    def _run_body(self, kind: str, layer: Any, index: Any) -> None:
        """Layer `layer` of kind `kind` (its `index`-th): the kind's body on its Refs, its weight
        blocks drawn from the global ring (or each matrix's own ring without one)."""
        context = (self.stream.stage(kind, layer, index) if self.stream is not None
                   else contextlib.nullcontext(blocks.LOCAL_STREAM))
        with context as stage_stream, dry_run.owned_by(kind, layer):
            if self.coll is not None:  # row-split matrices: partial sums all-reduced
                stage_stream = self.coll.stream(stage_stream)
            registry.kernel_stage(kind).body(self.plan.stage_plan(kind),
                                             self._stage_refs(kind, layer, index, stage_stream))

    def _stage_refs(self, kind: str, layer: Any, index: Any, stream: Any) -> registry.StageRefs:
        steps_out = (self.outputs.per_position or {}).get(kind, {})
        return registry.StageRefs(
            x=self.x_ref, out=self.out_ref, weights=_layer_refs(self.w[kind], index),
            state_in=_layer_refs(self.state_in.get(kind, {}), index),
            state_out=_layer_refs(self.state_out.get(kind, {}), index),
            positions=self.inputs.positions, stream=stream, scratch=self.scratch[kind],
            indices={"layer": layer}, shard=self.coll,
            steps_out=jax.tree.map(lambda ref: ref.at[:, index], steps_out),
            kv_rows=self.kv_rows)

    # -- 3. the final mix (if any), norm, LM head tiles and sampling ------------------------------
    def sample(self, use_gumbel: bool, use_candidates: bool) -> None:
        """The sampling stage's body on the residual strategy's head inputs."""
        head = self.residual.head_inputs(self.hidden)  # (snapshots, the last partial sum)
        with dry_run.owned_by("sampling"):
            pl.run_scoped(functools.partial(self._with_head, use_gumbel, use_candidates, head),
                          *self._scope("sampling"))

    def _scope(self, scope: str) -> tuple:
        """The buffers of one of the trunk's scopes (`trunk_scopes`: the VMEM plan's list)."""
        scopes = trunk_scopes(self.plan.cfg, self.plan.batch, self.plan.vocab_tile)
        return tuple(shape for _, shape in scopes[scope])

    def _with_head(self, use_gumbel: bool, use_candidates: bool, head: tuple,
                   final_norm_ref: Any, tile_slots: Any, tile_sems: Any, *mix_out: Any) -> None:
        snapshots, last = head
        self._load_head_vectors({"final_norm": final_norm_ref,
                                 **({"mix_out": mix_out[0]} if mix_out else {})})
        plan, cfg, inputs, outputs = self.plan, self.plan.cfg, self.inputs, self.outputs
        rest = ([outputs.logits] if outputs.logits is not None else []) + [tile_slots, tile_sems]
        sampling.sampling_body(inputs.seed, inputs.sample_positions, inputs.temperature,
                               inputs.top_k, inputs.top_p, snapshots, last,
                               mix_out[0] if mix_out else None, final_norm_ref,
                               self.w["lm_head"], outputs.tokens, outputs.overflow, *rest,
                               vocab_tile=plan.vocab_tile, candidates=sampling.MAX_CANDIDATES,
                               eps=cfg.rms_eps, softcap=cfg.logit_softcap,
                               norm_width=cfg.d_model_checkpoint or None,
                               use_gumbel=use_gumbel, use_candidates=use_candidates,
                               return_logits=outputs.logits is not None,
                               rows_per_key=plan.rows_per_state,
                               **self._vocab_shard(use_candidates))

    def _load_head_vectors(self, targets: dict) -> None:
        copies = [dma.Copy(self.w[name], targets[name], self.sems.at[i], name=name,
                           buffer=planned.HEAD_VECTORS)
                  for i, name in enumerate(self.residual.head_vectors)]
        for copy in copies:
            copy.start()
        for copy in copies:
            copy.wait()

    def _vocab_shard(self, use_candidates: bool) -> dict:
        """On a rank: its vocab shard's global indices and the shards' states merged."""
        coll = self.coll
        if coll is None:
            return {}
        return {"index_offset": coll.index(spec.VOCAB) * self.plan.cfg.vocab_size,
                "vocab_limit": coll.vocab_limit(),
                "merge": sharded_stages.merge_shards(coll, use_candidates)}
