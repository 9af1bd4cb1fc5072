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

Every stage is the stage kernel's own body function (`kernels/kda.py`, `mla.py`, `router.py`,
`experts.py`, `sampling.py`), called on Refs: per-layer weights are views `stack.at[i]` of the
stacked HBM arrays, with `i` the layer's index within its kind, read from an SMEM layer table.
Caches and states are updated in place (input_output_aliases); activations never leave VMEM.

Weights stream HBM->VMEM through ONE global ring (`kernels/weight_stream.py`) that runs across
stage and layer boundaries: the bodies' `blocks.stream_matmul` calls draw from it while it is
active, so the next stage's and the next layer's first blocks are already in flight while the
current stage computes. Expert weights keep their own slot ring (issued right after routing),
KV tiles and the KDA state their own double buffers.

Options and plan live in `kernels/megakernel_plan.py`: `plan_vmem` computes every VMEM buffer
with its bytes before the kernel is built, and `decode_step` refuses a plan over the chip's VMEM
with a message listing it — and, first, a config whose weights, caches and states exceed the
chip's HBM per device (`roofline.check_fits_hbm`). What a recorded step says (late prefetches,
bytes against the minimum) is read by `mkresearch.logs`; HLO kernel counts by `mkresearch.hlo`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels import blocks, costs, dma, experts, kda, mla, quant, sampling, weight_stream
from mkresearch.kernels.megakernel_plan import (  # the plan's names are the megakernel's API too
    EMBED_ROWS,
    MAX_BATCH,
    MegakernelOptions,
    MegaPlan,
    make_plan,
)
from mkresearch.kernels.weight_stream import ATTN_INDEX, FFN_INDEX, IS_MLA, IS_MOE, TABLE_FIELDS

from mkresearch import reference, roofline, tpu, weights
from mkresearch import sampling as sampling_ref
from mkresearch.config import BF16_SUBLANE, ModelConfig


# ---- the body ----------------------------------------------------------------------------------
def _mix(n_snapshots, snapshots_ref, partial, w, eps, n_blocks):
    """reference.mix over {R_0..R_{n-1}, P} with a traced n: one static branch per count."""
    def branch(k):
        def mixed():
            parts = ([snapshots_ref[0:k]] if k else []) + [partial[None]]
            return reference.mix(jnp.concatenate(parts, axis=0), w, eps)  # [B, d] bf16
        return mixed

    return lax.switch(n_snapshots, [branch(k) for k in range(n_blocks + 1)])


def megakernel_body(plan: MegaPlan, treedef: Any, use_gumbel: bool, use_candidates: bool,
                    *refs: Any) -> None:
    """The whole decode step. refs (inputs, outputs) in the order `_call` builds them:

    tokens, positions [B] i32, seed [1] i32, layer table [4L] i32 (SMEM); positions + 1, top_k
    [B, 1] i32, temperature, top_p [B, 1] f32 (VMEM); the weight pytree leaves (HBM); kda_conv,
    kda_state, mla cache a, b (HBM, aliased) -> tokens, overflow [B, 1] i32 (VMEM), [logits
    [B, V] f32], then the aliased state outputs.
    """
    cfg, batch = plan.cfg, plan.batch
    n_leaves = treedef.num_leaves
    (tokens_smem, positions_smem, seed_smem, table_smem, sample_pos_ref, temperature_ref,
     top_k_ref, top_p_ref) = refs[:8]
    w = jax.tree.unflatten(treedef, refs[8:8 + n_leaves])
    conv_in, kstate_in, cache_a_in, cache_b_in = refs[8 + n_leaves:12 + n_leaves]
    outs = refs[12 + n_leaves:]
    tokens_out, overflow_out = outs[:2]
    logits_out = outs[2] if len(outs) == 7 else None
    conv_out, kstate_out, cache_a_out, cache_b_out = outs[-4:]
    eps, d, n_blocks = cfg.rms_eps, cfg.d_model, cfg.n_blocks

    def scoped(snapshots, partial_ref, x_ref, out_ref, vectors, ids_ref, weights_ref, ids_smem,
               weights_smem, sems, *ring):
        stream = (weight_stream.GlobalStream(plan.stream, *ring, w, table_smem, cfg.n_layers)
                  if plan.stream is not None else None)
        # 1. e = E[token]. HBM is tiled in 16-row bf16 groups: a DMA window must start on one, so
        # each row's aligned 16-row block is fetched and the row picked in VMEM (exact: one hit).
        def gather(blocks_vmem):  # [B, 16, d] bf16
            copies = []
            for b in range(batch):
                start = pl.multiple_of(lax.div(tokens_smem[b], EMBED_ROWS) * EMBED_ROWS, EMBED_ROWS)
                copies.append(dma.Copy(w["embed"].at[pl.ds(start, EMBED_ROWS), :],
                                       blocks_vmem.at[b], sems.at[b], name="embed", row=b))
                copies[-1].start()
            with dma.phase("embed"):
                embedded = jnp.zeros((batch, d), jnp.float32)
                for b, copy in enumerate(copies):
                    copy.wait()
                    row = blocks.select_row(blocks_vmem[b], lax.rem(tokens_smem[b], EMBED_ROWS))
                    embedded = blocks.put_row(embedded, b, row)
                embedded = embedded.astype(jnp.bfloat16)  # [B, d], exactly E[token]
                partial_ref[...] = embedded
                snapshots[...] = jnp.zeros(snapshots.shape, snapshots.dtype)
                snapshots[0] = embedded

        pl.run_scoped(gather, pltpu.VMEM((batch, EMBED_ROWS, d), jnp.bfloat16))
        if stream is not None:  # layer 0's first weight blocks fly from the start
            stream.prologue()

        def load_vectors(layer):  # this layer's mix weights and norm gains, [1, d] each
            names = ("mix_attn", "attn_norm", "mix_mlp", "mlp_norm")
            copies = [dma.Copy(w[n].at[layer], vectors.at[i], sems.at[i], name=n, layer=layer)
                      for i, n in enumerate(names)]
            for copy in copies:
                copy.start()
            for copy in copies:
                copy.wait()

        def layer_step(layer, carry):
            row = layer * len(TABLE_FIELDS)
            is_mla, attn_i = table_smem[row + IS_MLA], table_smem[row + ATTN_INDEX]
            is_moe, ffn_i = table_smem[row + IS_MOE], table_smem[row + FFN_INDEX]
            block, offset = lax.div(layer, cfg.attn_res_block), lax.rem(layer, cfg.attn_res_block)
            block_start = offset == 0
            load_vectors(layer)
            # 2.1 h = Mix(𝒜_ℓ): ℓ = 0 → {P}; block start → {R_0..R_{n-1}, P}; else {R_0..R_n, P}
            with dma.phase("mix_attn", layer=layer):
                n_attn = jnp.where(layer == 0, 0, jnp.where(block_start, block, block + 1))
                h = _mix(n_attn, snapshots, partial_ref[...], vectors[0], eps, n_blocks)

                @pl.when(block_start)  # 2.2 a new block: snapshot the previous block's sum
                def _():
                    snapshots[block] = partial_ref[...]

                x_ref[...] = reference.rms_norm(h, vectors[1].astype(jnp.bfloat16), eps)

            # 2.3 a = Attn_ℓ(x): the stage bodies on this layer's slices of the stacks
            def kda_branch():
                p = w["kda"]
                layer_weights = [p[n].at[attn_i] for n in kda.WEIGHT_NAMES]
                kda.kda_attention_body(plan.kda_plan, x_ref, *layer_weights, conv_in.at[attn_i],
                                       kstate_in.at[attn_i], out_ref, conv_out.at[attn_i],
                                       kstate_out.at[attn_i], layer=layer)

            def mla_branch():
                p = w["mla"]
                layer_weights = [p[n].at[attn_i] for n in mla.WEIGHT_NAMES]
                mla.mla_attention_body(plan.mla_plan, positions_smem, x_ref, *layer_weights,
                                       cache_a_in.at[attn_i], cache_b_in.at[attn_i], out_ref,
                                       cache_a_out.at[attn_i], cache_b_out.at[attn_i],
                                       layer=layer)

            lax.cond(is_mla == 1, _staged(stream, "mla", mla_branch, layer, attn_i),
                     _staged(stream, "kda", kda_branch, layer, attn_i))
            # 2.4 P ← a at a block start, else bf(P + a); 2.5 h′ = Mix({R_0..R_n, P})
            with dma.phase("mix_mlp", layer=layer):
                a = out_ref[...]
                partial = jnp.where(block_start, a, (partial_ref[...].astype(jnp.float32)
                                                     + a.astype(jnp.float32)).astype(jnp.bfloat16))
                partial_ref[...] = partial
                h = _mix(block + 1, snapshots, partial, vectors[2], eps, n_blocks)
                x_ref[...] = reference.rms_norm(h, vectors[3].astype(jnp.bfloat16), eps)

            # 2.6 m = FFN_ℓ(x): router + routed/shared experts, or the dense MLP
            def moe_branch():
                p = w["moe"]
                routed = {"w_ld": p["w_ld"].at[ffn_i], "latent_norm": p["latent_norm"].at[ffn_i],
                          "w_lu": p["w_lu"].at[ffn_i],
                          "experts": {m: tuple(part.at[ffn_i] for part in p["experts"][m])
                                      for m in experts.EXPERT_MATRICES}}
                shared = ({"w_gate": p["w_sg"].at[ffn_i], "w_up": p["w_su"].at[ffn_i],
                           "w_down": p["w_sd"].at[ffn_i]} if cfg.n_shared_experts else None)
                experts.moe_layer_body(x_ref, p["w_router"].at[ffn_i], p["router_bias"].at[ffn_i],
                                       routed, shared, out_ref, ids_ref, weights_ref, ids_smem,
                                       weights_smem, options=plan.stage_options,
                                       router_options=dict(plan.router_options))

            def dense_branch():
                p = w["dense"]
                always_on = {"w_gate": p["w_gate"].at[ffn_i], "w_up": p["w_up"].at[ffn_i],
                             "w_down": p["w_down"].at[ffn_i]}
                experts.ffn_stage_body(None, x_ref, None, None, None, always_on, out_ref,
                                       options=plan.dense_options)

            lax.cond(is_moe == 1, _staged(stream, "moe", moe_branch, layer, ffn_i),
                     _staged(stream, "dense", dense_branch, layer, ffn_i))
            # 2.7 P ← bf(P + m)
            partial_ref[...] = (partial_ref[...].astype(jnp.float32)
                                + out_ref[...].astype(jnp.float32)).astype(jnp.bfloat16)
            return carry

        if stream is None:
            lax.fori_loop(0, cfg.n_layers, layer_step, 0)
        else:  # the stage bodies' stream_matmul calls draw from the global ring
            with blocks.global_weight_stream(stream):
                lax.fori_loop(0, cfg.n_layers, layer_step, 0)

        # 3. final mix, norm, LM head tiles and sampling: the sampling stage's body
        def with_head(mix_out_ref, final_norm_ref, tile_slots, tile_sems):
            copies = [dma.Copy(w["mix_out"], mix_out_ref, sems.at[0], name="mix_out"),
                      dma.Copy(w["final_norm"], final_norm_ref, sems.at[1], name="final_norm")]
            for copy in copies:
                copy.start()
            for copy in copies:
                copy.wait()
            rest = ([logits_out] if logits_out is not None else []) + [tile_slots, tile_sems]
            sampling.sampling_body(seed_smem, sample_pos_ref, temperature_ref, top_k_ref,
                                   top_p_ref, snapshots, partial_ref, mix_out_ref, final_norm_ref,
                                   w["lm_head"], tokens_out, overflow_out, *rest,
                                   vocab_tile=plan.vocab_tile, candidates=sampling.MAX_CANDIDATES,
                                   eps=eps, softcap=cfg.logit_softcap, use_gumbel=use_gumbel,
                                   use_candidates=use_candidates,
                                   return_logits=logits_out is not None)

        pl.run_scoped(with_head, pltpu.VMEM((1, d), jnp.float32), pltpu.VMEM((1, d), jnp.bfloat16),
                      pltpu.VMEM((2, d, plan.vocab_tile), jnp.bfloat16),
                      pltpu.SemaphoreType.DMA((2,)))

    ring = ([pltpu.VMEM((plan.stream.depth, *plan.stream.slot_shape), jnp.bfloat16),
             pltpu.SemaphoreType.DMA((plan.stream.depth,)), pltpu.SMEM((1,), jnp.int32)]
            if plan.stream is not None else [])
    k = cfg.top_k
    pl.run_scoped(scoped, pltpu.VMEM((n_blocks, batch, d), jnp.bfloat16),
                  pltpu.VMEM((batch, d), jnp.bfloat16), pltpu.VMEM((batch, d), jnp.bfloat16),
                  pltpu.VMEM((batch, d), jnp.bfloat16), pltpu.VMEM((4, 1, d), jnp.float32),
                  pltpu.VMEM((batch, k), jnp.int32), pltpu.VMEM((batch, k), jnp.float32),
                  pltpu.SMEM((batch, k), jnp.int32), pltpu.SMEM((batch, k), jnp.float32),
                  pltpu.SemaphoreType.DMA((max(4, batch),)), *ring)  # one per embedding row


def _staged(stream, kind, branch, layer, index):
    """A cond branch running one stage body inside the global stream's bracket for that stage."""
    def run():
        with stream.stage(kind, layer, index) if stream is not None else contextlib.nullcontext():
            branch()
    return run


# ---- the wrapper -------------------------------------------------------------------------------
def _vector_rows(stack: Any) -> Any:
    """A stacked vector [n, x] -> [n, 1, x], so that `stack.at[i]` is a [1, x] row (VMEM tiles)."""
    return stack.reshape(stack.shape[0], 1, -1)


def is_prepared(weights: Any) -> bool:
    """Whether `weights` is already the kernel's pytree (`prepare_weights`), not the parameters."""
    try:
        return isinstance(weights["moe"]["experts"]["w1"], tuple)
    except (KeyError, TypeError):
        return False


def prepare_weights(params: dict, cfg: ModelConfig) -> dict:
    """The parameter pytree as the kernel takes it, made once (not per step): stacked matrices as
    they are, vectors as [n, 1, x] rows (a VMEM row per layer), expert matrices as tuples of their
    stored parts. Every leaf stays in HBM; the kernel DMAs what each layer needs."""
    if is_prepared(params):
        return params
    kda_p = {n: (_vector_rows(params["kda"][n]) if params["kda"][n].ndim == 2 else params["kda"][n])
             for n in kda.WEIGHT_NAMES}
    mla_p = {n: (_vector_rows(params["mla"][n]) if params["mla"][n].ndim == 2
                 and n in ("q_norm", "kv_norm") else params["mla"][n]) for n in mla.WEIGHT_NAMES}
    moe = params["moe"]
    moe_p = {"w_router": moe["w_router"],
             "router_bias": _vector_rows(moe["router_bias"].astype(jnp.float32)),
             "w_ld": moe["w_ld"], "latent_norm": _vector_rows(moe["latent_norm"]),
             "w_lu": moe["w_lu"],
             "experts": {m: tuple(quant.split_parts(moe["experts"][m], cfg.expert_format))
                         for m in experts.EXPERT_MATRICES}}
    if cfg.n_shared_experts:
        moe_p.update(w_sg=moe["w_sg"], w_su=moe["w_su"], w_sd=moe["w_sd"])
    return {"embed": params["embed"], "lm_head": params["lm_head"],
            "final_norm": params["final_norm"].reshape(1, -1),
            "mix_out": params["mix_out"].reshape(1, -1),
            "mix_attn": _vector_rows(params["mix_attn"]), "mix_mlp": _vector_rows(params["mix_mlp"]),
            "attn_norm": _vector_rows(params["attn_norm"].astype(jnp.float32)),
            "mlp_norm": _vector_rows(params["mlp_norm"].astype(jnp.float32)),
            "kda": kda_p, "mla": mla_p, "dense": dict(params["dense"]), "moe": moe_p}


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5), donate_argnums=(15,))
def _call(plan: MegaPlan, interpret: Any, recording: bool, use_gumbel: bool, use_candidates: bool,
          return_logits: bool, tokens, positions, seed, table, sample_positions, temperature,
          top_k, top_p, weights, state):
    del recording  # static only so recorded and silent traces never share a jit cache entry
    cfg, batch = plan.cfg, plan.batch
    leaves, treedef = jax.tree.flatten(weights)
    names = mla.CACHE_NAMES[cfg.mla_cache_layout]
    state_leaves = [state["kda"]["conv"], state["kda"]["recurrent"], state["mla"][names[0]],
                    state["mla"][names[1]]]
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    column = lambda dtype: jax.ShapeDtypeStruct((batch, 1), dtype)
    out_shape = [column(jnp.int32), column(jnp.int32)]
    if return_logits:
        out_shape.append(jax.ShapeDtypeStruct((batch, cfg.vocab_size), jnp.float32))
    # every stage body over its layers (kernels/costs.py); + the SMEM/VMEM operands and results
    cost = costs.megakernel(plan, weights, state).estimate(
        tokens, positions, seed, table, sample_positions, temperature, top_k, top_p, out_shape)
    out_shape += [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in state_leaves]
    n_in = 8 + len(leaves)
    outs = pl.pallas_call(
        functools.partial(megakernel_body, plan, treedef, use_gumbel, use_candidates),
        out_shape=out_shape,
        in_specs=[smem] * 4 + [vmem] * 4 + [hbm] * (len(leaves) + 4),
        out_specs=[vmem] * (3 if return_logits else 2) + [hbm] * 4,
        input_output_aliases={n_in + i: len(out_shape) - 4 + i for i in range(4)},
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=plan.vmem.limit_bytes),
        cost_estimate=cost,
        interpret=interpret,
    )(tokens, positions, seed, table, sample_positions, temperature, top_k, top_p, *leaves,
      *state_leaves)
    new_state = {"kda": {"conv": outs[-4], "recurrent": outs[-3]},
                 "mla": {names[0]: outs[-2], names[1]: outs[-1]}}
    return outs[0][:, 0], outs[1][:, 0] != 0, (outs[2] if return_logits else None), new_state


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
    sampling_ref._check_seed(seed)
    sp = sampling_ref.check_params(batch, cfg.vocab_size, temperature=temperature, top_k=top_k,
                                   top_p=top_p, candidates=sampling.MAX_CANDIDATES)
    sampled = sp.temperature > 0
    truncated = (sp.top_k > 0) | (sp.top_p < 1)
    seed_i32 = np.asarray(np.uint32(int(seed) % 2**32)).view(np.int32).reshape(1)
    positions = jnp.asarray(positions, jnp.int32)
    tokens_out, overflow, logits, new_state = _call(
        plan, tpu.interpret_params(), dma.is_recording(), bool(np.any(sampled & ~truncated)),
        bool(np.any(sampled & truncated)), bool(return_logits),
        jnp.asarray(tokens, jnp.int32), positions, jnp.asarray(seed_i32),
        jnp.asarray(plan.layer_table, jnp.int32), (positions + 1)[:, None],
        jnp.asarray(sp.temperature)[:, None], jnp.asarray(sp.top_k)[:, None],
        jnp.asarray(sp.top_p)[:, None], prepare_weights(params, cfg), state)
    aux = {"nucleus_overflow": overflow, "plan": plan}
    if return_logits:
        aux["logits"] = logits
    return tokens_out, new_state, aux


# ---- compiling for a TPU on this machine -------------------------------------------------------
def step_fn(plan: MegaPlan):
    """(weights, state, tokens [B], positions [B], seed [1], layer table, sample positions,
    temperature, top_k, top_p [B, 1]) -> (tokens, overflow, None, state): the greedy step of `plan`
    on prepared weights, for `tpu.compile_for` (interpret_params() is None there)."""
    def step(weights, state, tokens, positions, seed, table, sample_positions, temperature,
             top_k, top_p):
        return _call(plan, tpu.interpret_params(), False, False, False, False, tokens, positions,
                     seed, table, sample_positions, temperature, top_k, top_p, weights, state)

    return step


def step_shapes(plan: MegaPlan) -> tuple:
    """Shape structs of every argument of `step_fn(plan)` (no allocation: full size is safe)."""
    cfg, batch = plan.cfg, plan.batch
    params = weights.param_shapes(cfg)
    prepared = jax.eval_shape(lambda p: prepare_weights(p, cfg), params)
    state = jax.eval_shape(lambda: reference.init_state(cfg, batch, plan.seq_len))
    i32, f32 = jnp.int32, jnp.float32
    s = jax.ShapeDtypeStruct
    column = lambda dtype: s((batch, 1), dtype)
    return (prepared, state, s((batch,), i32), s((batch,), i32), s((1,), i32),
            s((len(plan.layer_table),), i32), column(i32), column(f32), column(i32), column(f32))


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
