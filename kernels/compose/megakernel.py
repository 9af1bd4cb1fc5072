"""The megakernel: one grid-less `pallas_call` per decode step of a whole model.

    tokens, state, aux = megakernel.decode_step(params, state, tokens, positions, cfg)

The step's body, every stage the stage kernel's own body on Refs, is `megakernel_body.py`; this
module builds its call: the parameters prepared once as the body reads them (`prepare_weights`),
the step's inputs (tokens, positions, the sampling arguments, the layer table), the
`pallas_call` with the state aliased in place and XLA's cost estimate (`step_call`), and the
compiles for a TPU from shapes (`compile_step`).

Options and plan live in `kernels/compose/megakernel_plan.py`: `plan_vmem` computes every VMEM buffer
with its bytes before the kernel is built, and `decode_step` refuses a plan over the chip's VMEM
with a message listing it — and, first, a config whose weights, caches and states exceed the
chip's HBM per device (`roofline.check_fits_hbm`). Every DMA a step issues is data before it runs
(`kernels/compose/schedule.py`: the kernel run on shapes); what a recorded step says (bytes against
the minimum) is read by `mkresearch.measurement.logs`, HLO kernel counts by
`mkresearch.measurement.hlo`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import chip_log, costs, dma, dry_run, input_checks, registry

# the body's names are the megakernel's API too
from mkresearch.kernels.compose.megakernel_body import (
    StepInputs,
    StepOutputs,
    megakernel_body,
    per_position_shapes,
)

# the plan's names are the megakernel's API too
from mkresearch.kernels.compose.megakernel_plan import (  # noqa: F401
    EMBED_ROWS,
    MAX_BATCH,
    MegakernelOptions,
    MegaPlan,
    make_plan,
    routing_by_layer,
    sampled_outputs,
)
from mkresearch.kernels.sharded import collectives
from mkresearch.kernels.stages import (  # the kinds: megakernel_plan registers
    residuals,
    router,
    sampling,
)

from mkresearch.hardware import tpu
from mkresearch.model import reference, roofline, spec, weights
from mkresearch.model import sampling as sampling_ref
from mkresearch.model.config import BF16_SUBLANE, ModelConfig


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


# the jitted step, public for the verify step (`megakernel_verify.py`: one compile per plan); its
# name `_call` is the one every compiled step's HLO holds (the recorded compiles')
call_step = _call


def step_call(plan: MegaPlan, interpret: Any, use_gumbel: bool, use_candidates: bool,
              return_logits: bool, inputs: StepInputs, weights: dict, state: dict,
              shard: Any = None, pages: Any = None, live: dict | None = None) -> tuple:
    """The step's pallas_call -> (tokens [B], overflow [B], logits or None, state). shard: one
    rank's collectives plan (`collectives.ShardPlan`, kernels/compose/megakernel_sharded.py): its
    buffers and semaphores as scratch, and a barrier semaphore (collective_id)."""
    cfg, batch = plan.cfg, plan.batch
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    logits = jax.ShapeDtypeStruct((batch, cfg.vocab_size), jnp.float32) if return_logits else None
    per_position = per_position_shapes(plan, state)
    # the sampled tokens and overflow: the VMEM plan's list (`sampled_outputs`)
    outputs = StepOutputs(*(s for _, s in sampled_outputs(batch)), logits, per_position)
    # read off the step's body (`step_cost`); + the SMEM/VMEM operands and results (none in a
    # dry run's trace: the cost's own, or the schedule's; none in interpret mode: `costs.wanted`)
    cost = None if dry_run.tracing() or not costs.wanted(interpret) else step_cost(
        plan, inputs, weights, state, use_gumbel=use_gumbel, use_candidates=use_candidates,
        return_logits=return_logits, shard=shard, pages=pages, live=live).estimate(inputs, outputs)
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


# the kernel arguments a dry run gives values: the step's SMEM inputs (`StepInputs`, in order)
STEP_INPUTS = {f.name: i for i, f in enumerate(dataclasses.fields(StepInputs))}


def worst_case(plan: MegaPlan, shard: Any = None, rank: int = 0) -> tuple[dict, dict]:
    """(inputs, given) of a dry run of the step in the cost estimate's worst case
    (`kernels/base/costs.py`): every row at the cache's last position, min(E, B·k) distinct
    experts in every routed layer; token 0 in every row and the routing from expert 0 on. On
    `rank` of a sharded build (`shard`: its collectives.ShardPlan) the same case as that rank's
    own: every row's token the first row of its vocab shard (it fetches the embedding rows) and
    the routing from its first expert on (it fetches min(E / EP, B·k) experts of its own)."""
    cfg, batch = plan.cfg, plan.batch
    token, first_expert, n_experts = 0, 0, cfg.n_experts
    if shard is not None:
        lay = shard.layout
        token = lay.split(spec.VOCAB).index(rank) * cfg.vocab_size  # cfg: the rank's shard
        n_experts = lay.cfg.n_experts
        first_expert = lay.split(spec.EXPERTS).index(rank) * (n_experts // max(lay.ep, 1))
    inputs = {STEP_INPUTS["tokens"]: np.full(batch, token, np.int32),
              STEP_INPUTS["positions"]: costs.worst_positions(batch, plan.seq_len),
              STEP_INPUTS["table"]: np.asarray(plan.layer_table, np.int32)}
    routing = router.worst_routing(n_experts, batch, cfg.top_k)
    if n_experts:
        routing = ((routing + first_expert) % n_experts).astype(np.int32)
    return inputs, {router.ROUTING: lambda layer: routing}


def step_cost(plan: MegaPlan, inputs: Any, weights: Any, state: Any, *, use_gumbel: bool = False,
              use_candidates: bool = False, return_logits: bool = False, shard: Any = None,
              pages: Any = None, live: dict | None = None) -> costs.Cost:
    """The step's cost (its body's: every stage over its layers, the embedding rows, the
    per-layer vectors, the sampling stage), read off the step's kernel: its `pallas_call`
    traced on shapes and dry-run in the worst case (`worst_case`). A rank of a sharded build
    declares rank 0's own worst case (one program serves every rank; XLA's estimate is per
    device): rank 0 holds the first vocabulary rows and the first experts and is the most any
    rank's own worst case moves (tests/test_costs.py runs every rank of kimi-k3-mini on 8 ranks,
    both modes; kimi-k3 on 32 ranks in partial sums: 11.81-11.98 GB, rank 0 the most). Every
    rank's own run is `rank_costs`: at full size ~3 s each, too slow for every build.
    Arguments: `step_call`'s (arrays or shapes)."""
    def case(rank):
        given_inputs, given = worst_case(plan, shard, rank)
        if pages is not None:  # a paged step: every row's pages are page 0 (the same bytes)
            leaf = jax.tree.leaves(inputs)[STEP_INPUTS["page_table"]]
            given_inputs[STEP_INPUTS["page_table"]] = np.zeros(leaf.shape, np.int32)
        return given_inputs, given

    kernel = traced_step(plan, inputs, weights, state, use_gumbel=use_gumbel,
                         use_candidates=use_candidates, return_logits=return_logits, shard=shard,
                         pages=pages, live=live, every_loop=True)
    return costs.kernel_cost(kernel, *case(0), rank=None if shard is None else 0)


def traced_step(plan: MegaPlan, inputs: Any, weights: Any, state: Any, *, use_gumbel: bool = False,
                use_candidates: bool = False, return_logits: bool = False, shard: Any = None,
                pages: Any = None, live: dict | None = None,
                every_loop: bool = False) -> dry_run.Kernel:
    """The step's kernel traced for dry runs (`dry_run.trace_kernel`; arguments: `step_call`'s,
    arrays or shapes). The program is kept: the step's cost and its schedule
    (`schedule.schedule`) read one trace of a plan (Kimi K3 at full size: ~13 s here)."""
    leaves, tree = jax.tree.flatten(costs.shapes((inputs, weights, state)))
    return _step_kernel((plan, use_gumbel, use_candidates, return_logits, shard, pages,
                         None if live is None else tuple(sorted(live.items())), tree,
                         tuple(leaves)), every_loop)


@functools.lru_cache(maxsize=8)
def _step_kernel(program: tuple, every_loop: bool) -> dry_run.Kernel:
    """The kernel and its runs' compiled slices, kept for every run (a plan's schedules)."""
    return dry_run.kernel_of(_step_program(*program), every_loop)


@functools.lru_cache(maxsize=4)
def _step_program(plan: MegaPlan, use_gumbel: bool, use_candidates: bool, return_logits: bool,
                  shard: Any, pages: Any, live: tuple | None, tree: Any, leaves: tuple) -> Any:
    def step(inputs, weights, state):
        return step_call(plan, None, use_gumbel, use_candidates, return_logits, inputs, weights,
                         state, shard=shard, pages=pages, live=None if live is None else dict(live))

    axis = () if shard is None else ((collectives.AXIS, shard.n_ranks),)
    return dry_run.trace_kernel(step, *jax.tree.unflatten(tree, leaves), axis_env=axis).jaxpr


def rank_costs(step: Any, args: tuple, shard: Any, case: Any) -> list:
    """[Cost] of every rank of a sharded step, each dry-run in its own worst case
    (`case(rank)`: (inputs, given)), the kernel traced once (what shows that rank 0's, which
    `step_cost` declares, is the most)."""
    kernel = dry_run.trace_kernel(step, *costs.shapes(args),
                                  axis_env=((collectives.AXIS, shard.n_ranks),), every_loop=True)
    return [costs.kernel_cost(kernel, *case(rank), rank=rank) for rank in range(shard.n_ranks)]


def check_state(state: Any, cfg: ModelConfig, batch: int) -> int:
    """ValueError naming what is wrong with the state; returns the cache length."""
    return reference.check_state(state, cfg, batch)


def decode_step(params: dict, state: dict, tokens: Any, positions: Any, cfg: ModelConfig, *,
                seed: int = 0, temperature: Any = None, top_k: Any = 0, top_p: Any = 1.0,
                options: MegakernelOptions = MegakernelOptions(),  # noqa: B008 - frozen
                return_logits: bool = False,
                expert_ids: Any = None) -> tuple[jax.Array, dict, dict]:
    """One decode step of the whole model in ONE pallas_call -> (next tokens [B], state, aux).

    Same contract as `reference.decode_step` followed by `sampling.sample(logits, seed=seed,
    positions=positions + 1, ...)` (the next token is drawn for position p + 1, as in
    `reference.generate`). The state is donated and updated in place. aux: "nucleus_overflow"
    [B] bool, "logits" [B, V] f32 when return_logits (checking only), "plan" (the MegaPlan).

    Recorded on a TPU (`dma.recording()`), the step's log is its kernel run on shapes
    (`chip_log`), given the routing: expert_ids [n_routed_layers, B, k], or None for the
    reference's on the same inputs (the kernel's own but at a router near-tie; that needs the
    parameters, not `prepare_weights`' output).
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
    input_checks.check_each_in("positions", positions, seq_len,
                               f" — the cache holds {seq_len} tokens (init_state(cfg, batch, "
                               "max_seq_len=...) for a longer one)")
    reference.check_token_ids("tokens", tokens, cfg)
    plan = make_plan(cfg, batch, seq_len, options)
    tpu.check_runs_here(plan.options.chip)
    inputs, use_gumbel, use_candidates = step_inputs(plan, tokens, positions, seed, temperature,
                                                     top_k, top_p)
    given = (log_routing(plan, params, state, tokens, positions, expert_ids)
             if dma.logs_from_shapes() else None)
    tokens_out, overflow, logits, new_state = chip_log.run(
        lambda *args: _call(plan, tpu.interpret_params(), dma.is_recording(), use_gumbel,
                            use_candidates, bool(return_logits), *args),
        inputs, prepare_weights(params, cfg), state, given=given)
    aux = {"nucleus_overflow": overflow, "plan": plan}
    if return_logits:
        aux["logits"] = logits
    return tokens_out, new_state, aux


def log_routing(plan: MegaPlan, params: dict, state: dict, tokens: Any, positions: Any,
                expert_ids: Any = None) -> dict:
    """What a step's log from shapes is given (`chip_log.run`): its routing by layer, expert_ids
    [n_routed_layers, B, k] or the reference's on the same inputs (run before the step, which
    donates the state)."""
    if expert_ids is None and plan.cfg.n_experts:
        check_routable(params, "a step", "B")
        expert_ids = reference.decode_step(params, jax.tree.map(jnp.copy, state), tokens,
                                           positions, plan.cfg)[2]["expert_ids"]
    routing = {} if expert_ids is None else routing_by_layer(plan, expert_ids)
    return {router.ROUTING: lambda layer: routing[layer]}


def check_routable(params: dict, step: str, rows: str) -> None:
    """ValueError for prepared weights where a log on a TPU needs the reference's routing (the
    reference routes the parameters, not `prepare_weights`' output)."""
    if is_prepared(params):
        raise ValueError(f"expert_ids=None with prepared weights: {step} recorded on a TPU logs "
                         "the routing it is given; pass the parameters (the reference routes "
                         f"them) or expert_ids [n_routed_layers, {rows}, k]")


def routing_of_rows(route_step: Any, state: dict, tokens: Any, positions: Any) -> np.ndarray:
    """The routing of tokens [B, W] fed one by one from positions [B] (a position -1, a free
    slot, stays -1) on a copy of the state: route_step(state, tokens [B], positions [B]) ->
    (state, expert_ids [n_routed_layers, B, k]). Returns [n_routed_layers, B W, k], row b W + j
    for token j of row b: a verify step's rows."""
    tokens, positions = np.asarray(tokens), np.asarray(positions, np.int32)
    state, per_token = jax.tree.map(jnp.copy, state), []
    for j in range(tokens.shape[1]):
        at = np.where(positions >= 0, positions + j, -1).astype(np.int32)
        state, ids = route_step(state, tokens[:, j], at)
        per_token.append(np.asarray(ids))  # [n, B, k]
    ids = np.stack(per_token, axis=2)  # [n, B, W, k]
    return ids.reshape(ids.shape[0], -1, ids.shape[-1])


def step_inputs(plan: MegaPlan, tokens: Any, positions: Any, seed: int, temperature: Any,
                top_k: Any, top_p: Any) -> tuple[StepInputs, bool, bool]:
    """The step's inputs for tokens and positions [rows] (checked), the sampling arguments given
    per state row (ValueError naming the bad one) and each repeated for the plan.rows_per_state
    rows that share it -> (StepInputs, use_gumbel, use_candidates): the static sampling paths."""
    sampling_ref.check_seed(seed)
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
    column = lambda dtype: s((batch, 1), dtype)
    inputs = StepInputs(s((batch,), jnp.int32), s((batch,), jnp.int32), s((1,), jnp.int32),
                        s((len(plan.layer_table),), jnp.int32), column(jnp.int32),
                        column(jnp.float32), column(jnp.int32), column(jnp.float32))
    return inputs, prepared, state


def compile_step(cfg: ModelConfig, batch: int = 1, *, chip: str | None = None,
                 options: MegakernelOptions | None = None, seq_len: int | None = None):
    """Compile one megakernel decode step for `chip` (None: `tpu.default_chip()`) from shapes
    only -> (CompileResult, plan). `options.chip`, if set, must be `chip`: the plan is built for
    it."""
    chip = tpu.default_chip() if chip is None else chip
    options = MegakernelOptions(chip=chip) if options is None else options
    if getattr(options, "chip", None) is None:
        options = dataclasses.replace(options, chip=chip)
    if options.chip != chip:
        raise ValueError(f"options.chip={options.chip!r} differs from chip={chip!r}: the plan "
                         "(VMEM, MXFP4 decode path) is built for options.chip; pass the same chip")
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    plan = make_plan(cfg, batch, seq_len, options)
    return tpu.compile_for(step_fn(plan), *step_shapes(plan), chip=chip), plan


def compile_reference_step(cfg: ModelConfig, batch: int = 1, *, chip: str | None = None):
    """Compile `reference.decode_step` (plain XLA) for `chip` (None: `tpu.default_chip()`)
    -> CompileResult."""
    chip = tpu.default_chip() if chip is None else chip
    roofline.check_fits_hbm(cfg, chip, batch)
    state = jax.eval_shape(lambda: reference.init_state(cfg, batch))
    ids = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return tpu.compile_for(lambda p, s, t, q: reference.decode_step_unchecked(p, s, t, q, cfg),
                           weights.param_shapes(cfg), state, ids, ids, chip=chip)
