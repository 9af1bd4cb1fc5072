"""The megakernel: one grid-less `pallas_call` per decode step of a whole Kimi K3 stack.

    tokens [B] --DMA row gather--> e = E[token]           R_0 = P = e, R_1.. = 0    (spec §3.1)
    for ℓ in fori_loop(0, L):                              one traced layer body, not L copies
        h  = Mix(𝒜_ℓ; w_attn[ℓ])                          lax.switch on the candidate count
        R_n ← P  if ℓ mod block == 0
        a  = lax.cond(is_mla[ℓ], MLA body, KDA body)(RMSNorm(h))   weights: stack.at[index]
        P  = a  or  bf(P + a)
        h′ = Mix({R_0..R_n, P}; w_mlp[ℓ])
        m  = lax.cond(is_moe[ℓ], router + FFN stage body, dense FFN stage body)(RMSNorm(h′))
        P  = bf(P + m)
    tokens = sampling body (final mix, norm, LM head tiles, greedy / Gumbel sampling)

Every stage is the stage kernel's own body function (`kernels/stages/kda.py`, `mla.py`, `router.py`,
`experts.py`, `sampling.py`), called on Refs: per-layer weights are views `stack.at[i]` of the
stacked HBM arrays, with `i` the layer's index within its kind, read from an SMEM layer table.
Caches and states are updated in place (input_output_aliases); activations never leave VMEM.

Weights stream HBM->VMEM through ONE global ring (`kernels/base/weight_stream.py`) that runs across
stage and layer boundaries: the bodies' `blocks.stream_matmul` calls draw from it while it is
active, so the next stage's and the next layer's first blocks are already in flight while the
current stage computes. Expert weights keep their own slot ring (issued right after routing),
KV tiles and the KDA state their own double buffers.

Options and plan live in `kernels/compose/megakernel_plan.py`: `plan_vmem` computes every VMEM buffer
with its bytes before the kernel is built, and `decode_step` refuses a plan over the chip's VMEM
with a message listing it — and, first, a config whose weights, caches and states exceed the
chip's HBM per device (`roofline.check_fits_hbm`). Every DMA a step issues is data before it is
traced (`kernels/compose/schedule.py`: the trunk below has its twin there); what a recorded step says
(bytes against the minimum) is read by `mkresearch.measurement.logs`, HLO kernel counts by `mkresearch.measurement.hlo`.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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

# the plan's names are the megakernel's API too
from mkresearch.kernels.compose.megakernel_plan import (
    EMBED_ROWS,
    MAX_BATCH,
    MegakernelOptions,
    MegaPlan,
    make_plan,
    step_cost,
)
from mkresearch.kernels.sharded import collectives, sharded_stages
from mkresearch.kernels.stages import (  # noqa: F401 - kda, mla, experts register their kinds
    experts,
    ffn_kinds,
    gqa,
    kda,
    mla,
    mla_rope,
    moe_full,
    residuals,
    sampling,
)

from mkresearch.hardware import tpu
from mkresearch.model import reference, roofline, spec, weights
from mkresearch.model import sampling as sampling_ref
from mkresearch.model.config import BF16_SUBLANE, ModelConfig


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


# ---- the body ----------------------------------------------------------------------------------
def _layer_refs(tree: Any, index: Any) -> Any:
    """One layer's view `.at[index]` of every stacked Ref of a kind."""
    return jax.tree.map(lambda ref: ref.at[index], tree)


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
    if shard is None:
        return _step(plan, use_gumbel, use_candidates, inputs, w, state_in, outputs, state_out,
                     pages=pages, live=live)
    coll = collectives.Collectives(shard, scratch)
    with dma.on_rank(coll.rank):
        coll.barrier()
        return _step(plan, use_gumbel, use_candidates, inputs, w, state_in, outputs, state_out,
                     coll)


def _step(plan: MegaPlan, use_gumbel: bool, use_candidates: bool, inputs: StepInputs, w: dict,
          state_in: dict, outputs: StepOutputs, state_out: dict, coll: Any = None,
          pages: Any = None, live: dict | None = None) -> None:
    cfg, batch = plan.cfg, plan.batch
    kv_rows = None if pages is None else kv_tiles.KvRows(inputs.page_table, pages.page_size,
                                                         pages.max_pages_per_row)
    d = cfg.d_model
    residual = residuals.RESIDUALS[cfg.residual]
    kinds = [(kind, registry.kernel_stage(kind)) for kind in cfg.kinds]
    scratch_shapes = [shape for _, stage in kinds for _, shape in stage.scratch(cfg, batch)]
    n_hidden = len(residual.vmem(cfg, batch))

    def scoped(x_ref, out_ref, vectors, sems, *rest):
        hidden, rest = rest[:n_hidden], rest[n_hidden:]
        scratch, ring = {}, rest[len(scratch_shapes):]
        for kind, stage in kinds:
            count = len(stage.scratch(cfg, batch))
            scratch[kind], rest = stage.scratch_bundle(tuple(rest[:count])), rest[count:]
        stream = (weight_stream.GlobalStream(plan.stream, *ring, w, inputs.table, cfg.n_layers,
                                             live=coll.live(plan.stream) if coll else live)
                  if plan.stream is not None else None)
        # 1. e = E[token]. HBM is tiled in 16-row bf16 groups: a DMA window must start on one, so
        # each row's aligned 16-row block is fetched and the row picked in VMEM (exact: one hit).
        def gather(blocks_vmem):  # [B, 16, d] bf16
            if coll is not None:  # a vocab shard: the owner's row, all-reduced
                embedded = sharded_stages.embed(coll, w["embed"], inputs.tokens, blocks_vmem,
                                                sems, batch)
                return residual.start(hidden, embedded.astype(jnp.bfloat16))
            copies = []
            for b in range(batch):
                token = inputs.tokens[b]
                start = pl.multiple_of(lax.div(token, EMBED_ROWS) * EMBED_ROWS, EMBED_ROWS)
                copies.append(dma.Copy(w["embed"].at[pl.ds(start, EMBED_ROWS), :],
                                       blocks_vmem.at[b], sems.at[b], name="embed",
                                       buffer=planned.EMBEDDING, row=b))
                copies[-1].start()
            with dma.phase("embed"):
                embedded = jnp.zeros((batch, d), jnp.float32)
                for b, copy in enumerate(copies):
                    copy.wait()
                    row = blocks.select_row(blocks_vmem[b], lax.rem(inputs.tokens[b], EMBED_ROWS))
                    embedded = blocks.put_row(embedded, b, row)
                residual.start(hidden, embedded.astype(jnp.bfloat16))  # [B, d], exactly E[token]

        if stream is not None and coll is not None:  # a rank: layer 0's first weight blocks
            stream.prologue()  # fly while the embedding's all-reduce is waited for
        with dry_run.owned_by("embedding"):
            pl.run_scoped(gather, pltpu.VMEM((batch, EMBED_ROWS, d), jnp.bfloat16))
        if stream is not None and coll is None:  # layer 0's first weight blocks fly from the start
            stream.prologue()

        def load_vectors(layer):  # this layer's residual weights and norm gains, [1, d] each
            copies = [dma.Copy(w[n].at[layer], vectors.at[i], sems.at[i], name=n,
                               buffer=planned.LAYER_VECTORS, layer=layer)
                      for i, n in enumerate(residual.vectors)]
            for copy in copies:
                copy.start()
            for copy in copies:
                copy.wait()

        def run_stage(layer, kind_id, index, stage_kinds):
            """The stage body of this layer's kind (a switch on the table's kind id)."""
            def branch(kind):
                def run():
                    stage = registry.kernel_stage(kind)
                    context = (stream.stage(kind, layer, index) if stream is not None
                               else contextlib.nullcontext(blocks.LOCAL_STREAM))
                    with context as stage_stream, dry_run.owned_by(kind, layer):
                        if coll is not None:  # row-split matrices: partial sums all-reduced
                            stage_stream = coll.stream(stage_stream)
                        stage.body(plan.stage_plan(kind), registry.StageRefs(
                            x=x_ref, out=out_ref, weights=_layer_refs(w[kind], index),
                            state_in=_layer_refs(state_in.get(kind, {}), index),
                            state_out=_layer_refs(state_out.get(kind, {}), index),
                            positions=inputs.positions, stream=stage_stream,
                            scratch=scratch[kind], indices={"layer": layer}, shard=coll,
                            steps_out=jax.tree.map(lambda ref: ref.at[:, index],
                                                   (outputs.per_position or {}).get(kind, {})),
                            kv_rows=kv_rows))
                return run

            if len(stage_kinds) == 1:
                branch(stage_kinds[0])()
            else:
                lax.switch(kind_id, [branch(kind) for kind in stage_kinds])

        def layer_step(layer, carry):
            row = layer * len(TABLE_FIELDS)
            with dry_run.owned_by("residual", layer):
                load_vectors(layer)
            x_ref[...] = residual.attention_input(hidden, layer, vectors, cfg)
            run_stage(layer, inputs.table[row + ATTN_KIND], inputs.table[row + ATTN_INDEX],
                      plan.attention_kinds)
            x_ref[...] = residual.ffn_input(hidden, layer, vectors, out_ref[...], cfg)
            run_stage(layer, inputs.table[row + FFN_KIND], inputs.table[row + FFN_INDEX],
                      plan.ffn_kinds)
            residual.after_ffn(hidden, out_ref[...])
            return carry

        lax.fori_loop(0, cfg.n_layers, layer_step, 0)

        # 3. the final mix (if any), norm, LM head tiles and sampling: the sampling stage's body
        snapshots, last = residual.head_inputs(hidden)

        def with_head(final_norm_ref, tile_slots, tile_sems, *mix_out):
            targets = {"final_norm": final_norm_ref, **({"mix_out": mix_out[0]} if mix_out else {})}
            copies = [dma.Copy(w[name], targets[name], sems.at[i], name=name,
                               buffer=planned.HEAD_VECTORS)
                      for i, name in enumerate(residual.head_vectors)]
            for copy in copies:
                copy.start()
            for copy in copies:
                copy.wait()
            rest = ([outputs.logits] if outputs.logits is not None else []) + [tile_slots,
                                                                                tile_sems]
            shard = {} if coll is None else {  # a vocab shard: global indices, states merged
                "index_offset": coll.index(spec.VOCAB) * cfg.vocab_size,
                "vocab_limit": coll.vocab_limit(),
                "merge": sharded_stages.merge_shards(coll, use_candidates)}
            sampling.sampling_body(inputs.seed, inputs.sample_positions, inputs.temperature,
                                   inputs.top_k, inputs.top_p, snapshots, last,
                                   mix_out[0] if mix_out else None, final_norm_ref,
                                   w["lm_head"], outputs.tokens, outputs.overflow, *rest,
                                   vocab_tile=plan.vocab_tile, candidates=sampling.MAX_CANDIDATES,
                                   eps=cfg.rms_eps, softcap=cfg.logit_softcap,
                                   use_gumbel=use_gumbel, use_candidates=use_candidates,
                                   return_logits=outputs.logits is not None,
                                   rows_per_key=plan.rows_per_state, **shard)

        mix_out = [pltpu.VMEM((1, d), jnp.float32)] if "mix_out" in residual.head_vectors else []
        with dry_run.owned_by("sampling"):
            pl.run_scoped(with_head, pltpu.VMEM((1, d), jnp.bfloat16),
                      pltpu.VMEM((2, d, plan.vocab_tile), jnp.bfloat16),
                      pltpu.SemaphoreType.DMA((2,)), *mix_out)

    ring = ([pltpu.VMEM((plan.stream.depth, *plan.stream.slot_shape), jnp.bfloat16),
             pltpu.SemaphoreType.DMA((plan.stream.depth,)), pltpu.SMEM((1,), jnp.int32)]
            if plan.stream is not None else [])
    hidden = [pltpu.VMEM(shape, dtype) for _, shape, dtype in residual.vmem(cfg, batch)]
    n_vectors = len(residual.vectors)
    pl.run_scoped(scoped, pltpu.VMEM((batch, d), jnp.bfloat16),
                  pltpu.VMEM((batch, d), jnp.bfloat16), pltpu.VMEM((n_vectors, 1, d), jnp.float32),
                  pltpu.SemaphoreType.DMA((max(n_vectors, batch),)),  # one per embedding row
                  *hidden, *scratch_shapes, *ring)


# ---- the wrapper -------------------------------------------------------------------------------
def _vector_rows(stack: Any) -> Any:
    """A stacked vector [n, x] -> [n, 1, x], so that `stack.at[i]` is a [1, x] row (VMEM tiles)."""
    return stack.reshape(stack.shape[0], 1, -1)


def is_prepared(weights: Any) -> bool:
    """Whether `weights` is already the kernel's pytree (`prepare_weights`), not the parameters."""
    final_norm = weights.get("final_norm") if isinstance(weights, dict) else None
    return getattr(final_norm, "ndim", None) == 2  # the parameters' final_norm is [d]


def prepare_weights(params: dict, cfg: ModelConfig) -> dict:
    """The parameter pytree as the kernel takes it, made once (not per step): the trunk's vectors
    as [n, 1, x] rows (a VMEM row per layer), each kind's stack as its kernel reads it
    (`KernelStage.prepare`). Every leaf stays in HBM; the kernel DMAs what each layer needs."""
    if is_prepared(params):
        return params
    out = {"embed": params["embed"], "lm_head": params["lm_head"],
           "final_norm": params["final_norm"].reshape(1, -1)}
    if "mix_out" in params:
        out["mix_out"] = params["mix_out"].reshape(1, -1)
    for name in residuals.RESIDUALS[cfg.residual].vectors:  # per-layer residual vectors, f32
        out[name] = _vector_rows(params[name].astype(jnp.float32))
    for kind in cfg.kinds:
        out[kind] = registry.kernel_stage(kind).prepare(params[kind], cfg)
    return out


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5), donate_argnums=(8,))
def _call(plan: MegaPlan, interpret: Any, recording: bool, use_gumbel: bool, use_candidates: bool,
          return_logits: bool, inputs: StepInputs, weights: dict, state: dict):
    del recording  # static only so recorded and silent traces never share a jit cache entry
    return step_call(plan, interpret, use_gumbel, use_candidates, return_logits, inputs, weights,
                     state)


def step_call(plan: MegaPlan, interpret: Any, use_gumbel: bool, use_candidates: bool,
              return_logits: bool, inputs: StepInputs, weights: dict, state: dict,
              shard: Any = None, pages: Any = None, live: dict | None = None) -> tuple:
    """The step's pallas_call -> (tokens [B], overflow [B], logits or None, state). shard: one
    rank's collectives plan (`collectives.ShardPlan`, kernels/compose/megakernel_sharded.py): its
    buffers and semaphores as scratch, and a barrier semaphore (collective_id)."""
    cfg, batch = plan.cfg, plan.batch
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    column = lambda dtype: jax.ShapeDtypeStruct((batch, 1), dtype)  # noqa: E731
    logits = jax.ShapeDtypeStruct((batch, cfg.vocab_size), jnp.float32) if return_logits else None
    per_position = per_position_shapes(plan, state)
    outputs = StepOutputs(column(jnp.int32), column(jnp.int32), logits, per_position)
    # every stage body over its layers (kernels/base/costs.py); + the SMEM/VMEM operands and results
    cost = step_cost(plan, weights, state).estimate(inputs, outputs)
    state_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    n_in = len(jax.tree.leaves(inputs)) + len(jax.tree.leaves(weights))
    n_out = len(jax.tree.leaves(outputs))
    sharded = {} if shard is None else {"collective_id": 0}
    outs, new_state = pl.pallas_call(
        functools.partial(megakernel_body, plan, use_gumbel, use_candidates, shard=shard,
                          pages=pages, live=live),
        out_shape=(outputs, state_shapes),
        in_specs=(StepInputs.specs(pages is not None), jax.tree.map(lambda _: hbm, weights),
                  jax.tree.map(lambda _: hbm, state)),
        out_specs=(StepOutputs(vmem, vmem, vmem if return_logits else None,
                               jax.tree.map(lambda _: hbm, per_position)),
                   jax.tree.map(lambda _: hbm, state)),
        scratch_shapes=() if shard is None else [shape for _, shape in shard.scratch()],
        input_output_aliases={n_in + i: n_out + i for i in range(len(jax.tree.leaves(state)))},
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=plan.vmem.limit_bytes, **sharded),
        cost_estimate=cost,
        interpret=interpret,
    )(inputs, weights, state)
    if per_position is not None:  # a verify step (kernels/compose/megakernel_verify.py)
        return outs.tokens[:, 0], outs.overflow[:, 0] != 0, outs.logits, new_state, (
            outs.per_position)
    return outs.tokens[:, 0], outs.overflow[:, 0] != 0, outs.logits, new_state


def check_state(state: Any, cfg: ModelConfig, batch: int) -> int:
    """ValueError naming what is wrong with the state; returns the cache length."""
    return reference.check_state(state, cfg, batch)


def decode_step(params: dict, state: dict, tokens: Any, positions: Any, cfg: ModelConfig, *,
                seed: int = 0, temperature: Any = None, top_k: Any = 0, top_p: Any = 1.0,
                options: MegakernelOptions = MegakernelOptions(),  # noqa: B008 - frozen
                return_logits: bool = False) -> tuple[jax.Array, dict, dict]:
    """One decode step of the whole model in ONE pallas_call -> (next tokens [B], state, aux).

    Same contract as `reference.decode_step` followed by `sampling.sample(logits, seed=seed,
    positions=positions + 1, ...)` (the next token is drawn for position p + 1, as in
    `reference.generate`). The state is donated and updated in place. aux: "nucleus_overflow"
    [B] bool, "logits" [B, V] f32 when return_logits (checking only), "plan" (the MegaPlan).
    """
    if np.ndim(tokens) != 1:
        raise ValueError(f"tokens has shape {np.shape(tokens)}: allowed [B] (one token per row)")
    batch = np.shape(tokens)[0]
    if np.shape(positions) != (batch,):
        raise ValueError(f"positions has shape {np.shape(positions)}: allowed ({batch},)")
    if isinstance(cfg, ModelConfig) and batch > MAX_BATCH:
        raise ValueError(f"batch={batch} is invalid: an int in [1, {MAX_BATCH}] (the megakernel "
                         f"holds the [B, d] activations in one {BF16_SUBLANE}-row bf16 tile; "
                         "split larger batches into several calls)")
    seq_len = check_state(state, cfg, batch)
    if not isinstance(positions, jax.core.Tracer):
        pos = np.asarray(positions)
        if pos.min() < 0 or pos.max() >= seq_len:
            raise ValueError(f"positions={pos.tolist()} is invalid: each in [0, {seq_len}) — the "
                             f"cache holds {seq_len} tokens (init_state(cfg, batch, max_seq_len=...)"
                             " for a longer one)")
    if not isinstance(tokens, jax.core.Tracer):
        tok = np.asarray(tokens)
        if tok.min() < 0 or tok.max() >= cfg.vocab_size:
            raise ValueError(f"tokens={tok.tolist()} is invalid: each in [0, {cfg.vocab_size})")
    plan = make_plan(cfg, batch, seq_len, options)
    inputs, use_gumbel, use_candidates = step_inputs(plan, tokens, positions, seed, temperature,
                                                     top_k, top_p)
    tokens_out, overflow, logits, new_state = _call(
        plan, tpu.interpret_params(), dma.is_recording(), use_gumbel, use_candidates,
        bool(return_logits), inputs, prepare_weights(params, cfg), state)
    aux = {"nucleus_overflow": overflow, "plan": plan}
    if return_logits:
        aux["logits"] = logits
    return tokens_out, new_state, aux


def step_inputs(plan: MegaPlan, tokens: Any, positions: Any, seed: int, temperature: Any,
                top_k: Any, top_p: Any) -> tuple[StepInputs, bool, bool]:
    """The step's inputs for tokens and positions [rows] (checked), the sampling arguments given
    per state row (ValueError naming the bad one) and each repeated for the plan.rows_per_state
    rows that share it -> (StepInputs, use_gumbel, use_candidates): the static sampling paths."""
    sampling_ref._check_seed(seed)
    sp = sampling_ref.check_params(plan.state_batch, plan.cfg.vocab_size, temperature=temperature,
                                   top_k=top_k, top_p=top_p, candidates=sampling.MAX_CANDIDATES)
    sampled = sp.temperature > 0
    truncated = (sp.top_k > 0) | (sp.top_p < 1)
    seed_i32 = np.asarray(np.uint32(int(seed) % 2**32)).view(np.int32).reshape(1)
    positions = jnp.asarray(positions, jnp.int32)

    def per_row(values):  # [rows, 1]
        return jnp.asarray(np.repeat(values, plan.rows_per_state))[:, None]

    inputs = StepInputs(jnp.asarray(tokens, jnp.int32), positions, jnp.asarray(seed_i32),
                        jnp.asarray(plan.layer_table, jnp.int32), (positions + 1)[:, None],
                        per_row(sp.temperature), per_row(sp.top_k), per_row(sp.top_p))
    return inputs, bool(np.any(sampled & ~truncated)), bool(np.any(sampled & truncated))


# ---- compiling for a TPU on this machine -------------------------------------------------------
def step_fn(plan: MegaPlan):
    """(inputs: StepInputs, weights, state) -> (tokens, overflow, None, state): the greedy step of
    `plan` on prepared weights, for `tpu.compile_for` (interpret_params() is None there)."""
    def step(inputs, weights, state):
        return _call(plan, tpu.interpret_params(), False, False, False, False, inputs, weights,
                     state)

    return step


def step_shapes(plan: MegaPlan) -> tuple:
    """Shape structs of every argument of `step_fn(plan)` (no allocation: full size is safe)."""
    cfg, batch = plan.cfg, plan.batch
    params = weights.param_shapes(cfg)
    prepared = jax.eval_shape(lambda p: prepare_weights(p, cfg), params)
    # the state's rows: a verify step's R rows share B = R / (K + 1) of them
    state = jax.eval_shape(lambda: reference.init_state(cfg, plan.state_batch, plan.seq_len))
    s = jax.ShapeDtypeStruct
    column = lambda dtype: s((batch, 1), dtype)  # noqa: E731
    inputs = StepInputs(s((batch,), jnp.int32), s((batch,), jnp.int32), s((1,), jnp.int32),
                        s((len(plan.layer_table),), jnp.int32), column(jnp.int32),
                        column(jnp.float32), column(jnp.int32), column(jnp.float32))
    return inputs, prepared, state


def compile_step(cfg: ModelConfig, batch: int = 1, *, chip: str = "tpu7x",
                 options: MegakernelOptions | None = None, seq_len: int | None = None):
    """Compile one megakernel decode step for `chip` from shapes only -> (CompileResult, plan).
    `options.chip`, if options are given, must be `chip`: the plan is built for it."""
    options = MegakernelOptions(chip=chip) if options is None else options
    if getattr(options, "chip", chip) != chip:
        raise ValueError(f"options.chip={options.chip!r} differs from chip={chip!r}: the plan "
                         "(VMEM, MXFP4 decode path) is built for options.chip; pass the same chip")
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    plan = make_plan(cfg, batch, seq_len, options)
    return tpu.compile_for(step_fn(plan), *step_shapes(plan), chip=chip), plan


def compile_reference_step(cfg: ModelConfig, batch: int = 1, *, chip: str = "tpu7x"):
    """Compile `reference.decode_step` (plain XLA) for `chip` -> CompileResult."""
    roofline.check_fits_hbm(cfg, chip, batch)
    state = jax.eval_shape(lambda: reference.init_state(cfg, batch))
    ids = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return tpu.compile_for(lambda p, s, t, q: reference._decode_step(p, s, t, q, cfg),
                           weights.param_shapes(cfg), state, ids, ids, chip=chip)
