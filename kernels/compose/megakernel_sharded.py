"""The sharded megakernel: the decode step on every rank of a layout, one `pallas_call` per step
per rank under `jax.shard_map`, the collectives inside the kernel.

Each rank runs the megakernel's own body (`megakernel.megakernel_body` with a `shard` plan) on
its slice of every weight and state (`mkresearch.sharding.layout`): its heads, vocabulary rows, experts,
hidden slices and column chunks. What differs from one device is in three places, all in the
kernel:

  weight stream   a matrix whose input arrives split (the heads' outputs before W_o, a hidden
                  slice before W_down) gets it all-gathered first; a matrix split by its output
                  columns (W_o, W_down, W_lu, W_ld; ours: W_qa, W_kva, the router) gives this
                  rank's column chunk, and the chunks are all-gathered (`sharded_stream.ShardedStream`)
  routed experts  each rank its expert group's experts (EP) and their TP slice (ETP: W1, W3
                  hidden columns, W2 latent columns, the hidden all-gathered in the group); the
                  weighted sum runs down the chain of expert groups in ascending id
                  (`kernels/stages/experts.py` with `StageRefs.shard`, `Collectives.combine_items`)
  embedding, LM   the owner's embedding row all-reduced; each rank's best sampling candidates
  head            and log-sum-exp merged (`kernels/sharded/sharded_stages.py`): the token is the unsharded
                  one for greedy and sampled rows alike

Numbers: no rank adds partial products of a contraction; every value is computed whole on one
rank in the single-device kernel's order, so a step equals the single-device megakernel's to the
bit (on XLA:CPU, whose dot gives a column chunk the bits of the whole product's columns, a
one-column chunk multiplied as a lane of its copies, `numerics.lane_columns`, and a row of a
product padded to 8 rows the same bits whatever the row count: a rank's lone head in the latent
MLA's all-heads products and in GQA's query heads of a K/V head is padded so,
`kv_tiles.rows_dot_t`). Only
the sampling stage's log-sum-exp is combined across vocab shards (top-p cuts, module
`sharded_stages`).

`make_sharded_plan` fixes every static size (a rank's `MegaPlan`, the collectives' `ShardPlan`,
the VMEM plan with the collectives' buffers, the HBM check of one rank); `decode_step` runs a
step on a mesh of n_ranks devices (on CPU: n simulated devices, XLA_FLAGS=
--xla_force_host_platform_device_count=n before JAX starts); `compile_sharded_step` compiles it
for a TPU topology (e.g. 32 TPU7x devices) from shapes only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mkresearch.kernels.base import dma, input_checks, registry, weight_stream
from mkresearch.kernels.compose import megakernel
from mkresearch.kernels.compose import megakernel_plan as mplan
from mkresearch.kernels.compose.megakernel import StepInputs
from mkresearch.kernels.sharded import collectives, sharded_stages
from mkresearch.kernels.sharded import plan as sharding
from mkresearch.kernels.stages import gate_up, sampling

from mkresearch.hardware import distributed, tpu
from mkresearch.hardware.chips import get_chip
from mkresearch.model import reference, roofline, spec
from mkresearch.model import sampling as sampling_ref
from mkresearch.model.config import LANE, RING_MAX_DEPTH, ModelConfig
from mkresearch.sharding import layout as layouts

AXIS = collectives.AXIS
FULL_TOPOLOGY = "tpu7x:2x2x4"  # 16 TPU7x chips, 32 devices: the release's deployment (docs/kimi-k3.md §9)


@dataclass(frozen=True)
class ShardedPlan:
    """Everything static about one sharded megakernel build (hashable: a jit static argument)."""

    layout: layouts.Layout
    mega: mplan.MegaPlan  # one rank's (its config holds one rank's shapes, `kernel_config`)
    shard: collectives.ShardPlan

    @property
    def n_ranks(self) -> int:
        return self.layout.n_ranks


def kernel_config(lay: layouts.Layout) -> ModelConfig:
    """The shapes one rank's kernels see: its heads (and GQA's K/V heads), vocabulary rows (the
    last rank's padded), experts' hidden slice and FFN hidden chunks; n_experts and top_k stay the
    model's (routing is over all experts, the rank then keeps its own, `StageRefs.shard`)."""
    cfg, n = lay.cfg, lay.n_ranks
    return cfg.replace(name=f"{cfg.name}-rank-of-{n}", n_heads=cfg.n_heads // lay.ways(spec.HEADS),
                       n_kv_heads=lay.local_length(spec.KV_HEADS, cfg.n_kv_heads),
                       vocab_size=lay.local_length(spec.VOCAB, cfg.vocab_size),
                       expert_hidden=lay.local_length(spec.EXPERT_TP, cfg.expert_hidden),
                       dense_hidden=_lanes(lay.local_length(spec.FFN_HIDDEN, cfg.dense_hidden)),
                       shared_hidden=_lanes(lay.local_length(spec.FFN_HIDDEN, cfg.shared_hidden)))


def _lanes(width: int) -> int:
    """A rank's hidden slice in whole lanes, as a config holds it (its validation): a slice in
    half-lane chunks streams at its own shape (`_local_streamed`, `gate_up`), not the config's."""
    return -(-width // LANE) * LANE


def _layer_param(cfg: ModelConfig, kind: str, key: str) -> spec.Param:
    return spec.stage(kind).params(cfg)[key]


def _local_streamed(lay: layouts.Layout) -> Any:
    """local(kind, matrices) -> the matrices with one rank's shapes (its layout slices), an
    always-on MLP's gate and up as one where its hidden slice is under whole lanes (`gate_up`)."""
    cfg = lay.cfg

    def one(kind, m):
        shard = layouts.param_shard(lay, _layer_param(cfg, kind, m.key))
        return registry.Streamed(m.key, m.name, layouts.local_shape(lay, m.shape, shard))
    return lambda kind, ms: gate_up.fuse_streamed(tuple(one(kind, m) for m in ms))


# partial-sum mode: the global ring's slots on a rank at least (7 weight blocks in flight while the
# rank waits for a collective, 10 MiB more than the preset's 3 slots at Kimi K3's 2 MiB blocks),
# and at most (the config's own bound): `ring_depth` picks the deepest in between that fits VMEM
PARTIAL_SUM_RING_DEPTH = 8
PARTIAL_SUM_MAX_RING_DEPTH = RING_MAX_DEPTH
# VMEM a ring deepened past PARTIAL_SUM_RING_DEPTH leaves free, beyond plan_vmem's own headroom,
# for Mosaic's temporaries: the plan counts the buffers we declare, not the values Mosaic keeps
# in scoped VMEM, which grow with the rows. Measured on Kimi K3's designs (restructured, experts
# 8 ways, caches 1,024 long; Mosaic's scoped size less the plan's, rings forced past the spare):
# B = 1 under 0.2 MiB, B = 8 1.24 MiB (4 expert slots), B = 16 2.19 (4 slots) and 3.71 (8
# slots). 2 MiB at one row and a quarter MiB more per further row keeps 1.8 to 2.5 MiB above each
# (tests/test_sharded.py compiles the designs' last rows at 1, 8 and 16 rows)
RING_VMEM_SPARE_BYTES = 2 * 2**20
RING_VMEM_SPARE_PER_ROW_BYTES = 2**18


def ring_vmem_spare_bytes(batch: int) -> int:
    """The VMEM a deepened ring leaves free at `batch` rows (RING_VMEM_SPARE_BYTES above)."""
    return RING_VMEM_SPARE_BYTES + (int(batch) - 1) * RING_VMEM_SPARE_PER_ROW_BYTES


@dataclass(frozen=True)
class RingDepth:
    """The global weight ring's depth on a rank of a layout, and why that depth."""

    depth: int
    reason: str
    # False: no kernel plans this step (even the floor over VMEM: `make_sharded_plan` refuses it;
    # or more rows than the kernel plans), a ring the prediction prices anyway
    planned: bool = True

    def describe(self) -> str:
        return f"ring {self.depth} slots: {self.reason}"


@functools.lru_cache(maxsize=256)
def ring_depth(lay: layouts.Layout, batch: int = 1, seq_len: int | None = None,
               options: mplan.MegakernelOptions = mplan.MegakernelOptions(),  # noqa: B008
               wire: str = "f32") -> RingDepth:
    """The global weight ring's depth on a rank of `lay` at `batch` (one source: the kernel's plan,
    `make_sharded_plan`, and the prediction, `scale_out_schedule.our_schedule`). Exact mode (or no
    global stream): cfg.ring_depth, the kernel as built. Partial-sum mode: the deepest ring in
    [PARTIAL_SUM_RING_DEPTH, cap] whose whole VMEM plan (`rank_vmem`: the shard buffers too)
    fits the chip's usable VMEM less `ring_vmem_spare_bytes`, so that more weight blocks keep HBM
    busy while a collective is waited for; cap: the lookahead (depth - 1 blocks) within the
    rank's shortest stage, and PARTIAL_SUM_MAX_RING_DEPTH. If even the floor is over VMEM, the
    floor (`make_sharded_plan` refuses it with the plan)."""
    lay, cfg = _placed(lay, options), lay.cfg
    if not options.global_stream or not lay.partial_sums:
        return RingDepth(cfg.ring_depth, "the config's ring_depth ("
                         + ("exact collectives)" if options.global_stream else "no global ring)"))
    local = _local_streamed(lay)
    shortest = weight_stream.make_stream_plan(cfg.replace(ring_depth=2), local).shortest()
    lookahead_cap = f"the lookahead's cap (a rank's shortest stage streams {shortest} blocks)"
    cap = min(shortest + 1, PARTIAL_SUM_MAX_RING_DEPTH)
    floor = max(2, min(max(cfg.ring_depth, PARTIAL_SUM_RING_DEPTH), cap))
    if floor == shortest + 1:
        return RingDepth(floor, lookahead_cap)
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) \
            or not 1 <= batch <= mplan.MAX_BATCH:  # the prediction's larger batches: no kernel
        return RingDepth(floor, f"the floor (no kernel plan at B = {batch}: at most "
                                f"{mplan.MAX_BATCH} rows)", planned=False)

    def vmem(depth: int) -> mplan.VmemPlan:
        return rank_vmem(lay, int(batch), depth, seq_len, options, wire)

    floor_vmem = vmem(floor)
    if not floor_vmem.fits():
        return RingDepth(floor, "the floor, over VMEM (the plan is refused)", planned=False)
    spare = ring_vmem_spare_bytes(batch)
    budget = floor_vmem.limit_bytes - spare
    best, best_bytes = floor, floor_vmem.total_bytes
    for depth in range(floor + 1, cap + 1):  # the plan grows by a slot per depth: first over ends
        total = vmem(depth).total_bytes
        if total > budget:
            break
        best, best_bytes = depth, total
    if best == cap:
        return RingDepth(best, lookahead_cap if cap == shortest + 1
                         else f"the most slots allowed ({PARTIAL_SUM_MAX_RING_DEPTH})")
    return RingDepth(best, f"the deepest within VMEM ({best_bytes / 2**20:.1f} of "
                           f"{floor_vmem.limit_bytes / 2**20:.0f} MiB, "
                           f"{spare / 2**20:g} MiB kept spare)")


def check_fits_hbm(lay: layouts.Layout, chip: str, batch: int, seq_len: int) -> int:
    """One rank's weights, caches and states against one device's HBM (ValueError if over)."""
    needed = (roofline.tree_bytes(layouts.rank_param_shapes(lay))
              + roofline.tree_bytes(layouts.rank_state_shapes(lay, batch, seq_len)))
    available = int(get_chip(chip).hbm_bytes)
    if needed > available:
        raise ValueError(f"one rank of {lay.cfg.name} on {lay.n_ranks} ranks does not fit the HBM "
                         f"of one {chip} device: it needs {needed:,d} B but {chip} has "
                         f"{available:,d} B: shard across more ranks or lower the batch or the "
                         "cache length (max_seq_len)")
    return needed


def rank_vmem(lay: layouts.Layout, batch: int, depth: int, seq_len: int | None = None,
              options: mplan.MegakernelOptions = mplan.MegakernelOptions(),  # noqa: B008
              wire: str = "f32") -> mplan.VmemPlan:
    """A rank's whole VMEM plan (as `make_sharded_plan` builds it) with a ring of `depth` slots."""
    seq_len = lay.cfg.max_seq_len if seq_len is None else int(seq_len)
    lay = _placed(lay, options)
    return _rank_parts(lay, batch, seq_len, options, wire, depth, _local_streamed(lay))[-1]


def kernel_options(lay: layouts.Layout, batch: int, chip: str = "tpu7x", wire: str = "f32",
                   **fields) -> mplan.MegakernelOptions:
    """The kernel's options for `chip` with its reductions sent as the sharding plan of the
    layout chooses them (`sharding.sharding_plan`: the interconnect model of the chip's slice):
    what the CLI and the recorded compiles build. fields: the other options."""
    chosen = sharding.sharding_plan(lay, batch, wire, chip)
    return mplan.MegakernelOptions(chip=chip, reductions=chosen.algorithms,
                                   ranks_per_host=chosen.ranks_per_host, **fields)


def _rank_parts(lay: layouts.Layout, batch: int, seq_len: int,
                options: mplan.MegakernelOptions, wire: str, depth: int, local: Any) -> tuple:
    """(kcfg, stage plans, vocab tile, stream plan, ShardPlan, VmemPlan) of a rank with a global
    ring of `depth` slots: the VMEM plan is `plan_vmem`'s plus the collectives' buffers."""
    cfg = lay.cfg
    stream = (weight_stream.make_stream_plan(cfg.replace(ring_depth=depth), local)
              if options.global_stream else None)
    kcfg = mplan.check_model(kernel_config(lay).replace(ring_depth=depth))
    stage_plans = tuple((kind, registry.kernel_stage(kind).plan(kcfg, batch, seq_len, options))
                        for kind in kcfg.kinds)
    vocab_tile = sampling.default_vocab_tile(kcfg.d_model, kcfg.vocab_size)
    plan = sharding.with_algorithms(lay, batch, wire, options.reductions, options.ranks_per_host)
    pieces = {"all": [sharded_stages.STATE_LANES],
              "etp": [lay.local_length(spec.EXPERT_TP, cfg.expert_hidden)],
              sharding.ROUTER_CHANNEL: []}
    for rule in plan.rules:
        if rule.gather is not None and rule.gather != spec.EXPERT_TP:
            pieces["all"].append(lay.local_length(rule.gather, rule.k))
        if rule.out == spec.ROUTER_COLS:  # the router placed apart: among its group
            pieces[sharding.ROUTER_CHANNEL].append(lay.local_length(rule.out, rule.n))
        elif rule.out is not None:  # with the chunks joining its gather (`Rule.joins`)
            pieces["all"].append(sum(lay.local_length(r.out, r.n) for r in plan.rules
                                     if r is rule or r.joins == rule.name))
    reduced = [cfg.d_model]  # the embedding
    for r in plan.reductions:
        if r.scatter:  # restructured's ρ: staged whole, each rank's chunk scattered
            reduced.append(r.width)
        elif r.algorithm == sharding.ONE_SHOT:  # the whole [B, n] from every rank, and the
            pieces["all"].append(r.width + r.riders)  # column chunks riding (`Rule.rides`)
    # an expert's output columns on a rank (W2's: the latent, or d for experts on the full d)
    expert_latent = (lay.local_length(spec.EXPERT_TP, layouts.expert_output_width(cfg))
                     if lay.collectives == layouts.EXACT else layouts.expert_output_width(cfg))
    if lay.collectives == layouts.EXACT:
        pieces["all"].append(expert_latent)  # the experts' sum, all-gathered from the last group
    shard = collectives.make_shard_plan(
        plan, pieces, reduced=tuple(reduced),
        expert_items=min(cfg.n_experts // lay.ep, batch * cfg.top_k), expert_latent=expert_latent)
    chip = get_chip(mplan.chip_of(options))
    vmem = mplan.plan_vmem(kcfg, batch, stage_plans, vocab_tile, stream, chip, seq_len, shard=shard)
    vmem = mplan.VmemPlan(vmem.buffers + tuple(
        mplan.vmem_buffer(name, shape, dtype, "kernel") for name, shape, dtype in shard.vmem_buffers()),
        vmem.limit_bytes, vmem.chip)
    return kcfg, stage_plans, vocab_tile, stream, shard, vmem


def _placed(lay: layouts.Layout, options: mplan.MegakernelOptions) -> layouts.Layout:
    """The layout with the router placed as the options say (`layout.place_router`):
    ValueError if `lay` is placed already, otherwise."""
    placed = layouts.place_router(lay, options.router_placement, options.ranks_per_host)
    if lay.router != layouts.ROUTER_SPLIT and lay != placed:
        raise ValueError(f"layout.router={lay.router!r} (over {lay.router_ways} ranks) is invalid "
                         f"with router_placement={options.router_placement!r}: the layout is "
                         "placed by the options (`make_sharded_plan`); pass the layout unplaced")
    return placed


def make_sharded_plan(lay: layouts.Layout, batch: int, seq_len: int | None = None,
                      options: mplan.MegakernelOptions = mplan.MegakernelOptions(),  # noqa: B008
                      wire: str = "f32") -> ShardedPlan:
    """Check sizes and options (ValueError naming them) and fix every static size of one rank.
    The layout's `collectives` picks the collectives (`kernels/sharded/plan.py`); wire: the
    partial sums' format on the wire (`plan.WIRES`); options.reductions and .ranks_per_host: how
    the reductions are sent (`kernel_options`: as the sharding plan chooses for a chip);
    options.router_placement: where the router's columns live (the plan's layout is `lay` with
    them placed, `layout.place_router`: prepare the weights with `plan.layout`)."""
    sharding.check_wire(wire)
    if not isinstance(lay, layouts.Layout):
        raise ValueError(f"layout={lay!r} is invalid: a mkresearch.sharding.layout.Layout")  # noqa: TRY004
    cfg = lay.cfg
    seq_len = cfg.max_seq_len if seq_len is None else int(seq_len)
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or not 1 <= batch <= mplan.MAX_BATCH:
        raise ValueError(f"batch={batch!r} is invalid: an int in [1, {mplan.MAX_BATCH}]")
    options = mplan.check_options(options, cfg)
    if options.expert_plan != "unique":
        raise ValueError(f"expert_plan={options.expert_plan!r} is invalid for a sharded model: "
                         "'unique' (each rank fetches the distinct experts of its group)")
    batch = int(batch)
    lay = _placed(lay, options)
    check_fits_hbm(lay, mplan.chip_of(options), batch, seq_len)

    local = _local_streamed(lay)
    depth = ring_depth(lay, batch, seq_len, options, wire).depth
    if options.global_stream:
        shortest = weight_stream.make_stream_plan(cfg.replace(ring_depth=2), local).shortest()
        if depth - 1 > shortest:
            raise ValueError(f"ModelConfig.ring_depth={cfg.ring_depth} is invalid for {lay.n_ranks}"
                             f" ranks: an int in [2, {shortest + 1}] (a rank's shortest stage "
                             f"streams {shortest} blocks)")
    kcfg, stage_plans, vocab_tile, stream, shard, vmem = _rank_parts(
        lay, batch, seq_len, options, wire, depth, local)
    if not vmem.fits():
        raise mplan.VmemPlanError(
            f"a rank's VMEM plan needs {vmem.total_bytes / 2**20:.2f} MiB but {vmem.chip} has "
            f"{vmem.limit_bytes / 2**20:.2f} MiB usable per TensorCore: lower ring_depth, "
            f"ring_block_bytes, kv_tile, expert_slots or the batch.\n{vmem.table()}")
    mega = mplan.MegaPlan(cfg=kcfg, batch=batch, seq_len=seq_len, options=options,
                          stage_plans=stage_plans, vocab_tile=vocab_tile,
                          layer_table=weight_stream.layer_table(kcfg), stream=stream, vmem=vmem)
    return ShardedPlan(layout=lay, mega=mega, shard=shard)


# ---- weights and state ---------------------------------------------------------------------
def prepare_weights(params: dict, lay: layouts.Layout, mesh: Any = None) -> dict:
    """The parameters as every rank's prepared weights (`megakernel.prepare_weights` of its
    slice), stacked on a leading rank axis and, given a mesh, placed one slice per device (in a
    multi-process run each process prepares and places only its own ranks' slices)."""
    if mesh is not None:
        ranks = distributed.local_ranks(mesh)
        return prepare_rank_weights(layouts.shard_params(params, lay, ranks), lay, mesh)
    kcfg = kernel_config(lay)
    return jax.vmap(lambda p: megakernel.prepare_weights(p, kcfg))(
        layouts.shard_params(params, lay))


def prepare_rank_weights(rank_params: dict, lay: layouts.Layout, mesh: Any) -> dict:
    """This process's ranks' slices (leaves [n_local, ...] in `distributed.local_ranks(mesh)`
    order: `layout.shard_params(params, lay, ranks)`, or a checkpoint read per rank,
    `mkresearch.checkpoint.rank_loader`) prepared and placed on their devices of the mesh."""
    kcfg = kernel_config(lay)
    prepared = jax.vmap(lambda p: megakernel.prepare_weights(p, kcfg))(rank_params)
    return distributed.put_local(prepared, mesh, P(AXIS))


def shard_state(state: dict, lay: layouts.Layout, mesh: Any = None) -> dict:
    """A decode state of the whole model as every rank's slice [n_ranks, ...] (on the mesh)."""
    sliced = jax.tree.map(jnp.asarray, layouts.shard_state(state, lay))
    return sliced if mesh is None else place(sliced, mesh)


def place(tree: Any, mesh: Any) -> Any:
    """Leaves [n_ranks, ...] (the same on every process) one slice per device of the mesh."""
    return distributed.put(tree, mesh, P(AXIS))


def make_mesh(n_ranks: int) -> Any:
    """A 1-D mesh of n_ranks devices, over every process's in a multi-process run, a process's
    consecutive (`distributed.mesh`; ValueError if there are fewer)."""
    return distributed.mesh(n_ranks, AXIS)


# ---- the call --------------------------------------------------------------------------------
def _rank_call(plan: ShardedPlan, interpret: Any, use_gumbel: bool, use_candidates: bool,
               return_logits: bool, inputs: StepInputs, weights: dict, state: dict):
    return megakernel.step_call(plan.mega, interpret, use_gumbel, use_candidates, return_logits,
                                inputs, weights, state, shard=plan.shard)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6), donate_argnums=(9,))
def _call(plan: ShardedPlan, mesh: Any, interpret: Any, recording: bool, use_gumbel: bool,
          use_candidates: bool, return_logits: bool, inputs: StepInputs, weights: dict,
          state: dict):
    del recording  # static only so recorded and silent traces never share a jit cache entry

    def per_rank(inputs, weights, state):
        first = functools.partial(jax.tree.map, lambda a: a[0])
        tokens, overflow, logits, new_state = _rank_call(
            plan, interpret, use_gumbel, use_candidates, return_logits, inputs, first(weights),
            first(state))
        lead = functools.partial(jax.tree.map, lambda a: a[None])
        return lead((tokens, overflow, logits)), lead(new_state)

    return jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                         out_specs=(P(AXIS), P(AXIS)), check_vma=False)(inputs, weights, state)


def decode_step(prepared: dict, state: dict, tokens: Any, positions: Any, plan: ShardedPlan, *,
                mesh: Any = None, seed: int = 0, temperature: Any = None, top_k: Any = 0,
                top_p: Any = 1.0, return_logits: bool = False) -> tuple[jax.Array, dict, dict]:
    """One decode step on every rank -> (next tokens [B], the state of every rank, aux).

    prepared: `prepare_weights(params, plan.layout)`; state: `shard_state(...)` of a whole-model
    state (leaves [n_ranks, ...]), donated and updated in place; same contract otherwise as
    `megakernel.decode_step`. aux: "tokens_per_rank" [n_ranks, B] (every rank's choice: they
    agree), "nucleus_overflow" [B], "logits" [B, V] (the ranks' shards side by side) when
    return_logits, "plan"."""
    if not isinstance(plan, ShardedPlan):
        raise ValueError(f"plan={plan!r} is invalid: a ShardedPlan (make_sharded_plan)")  # noqa: TRY004
    cfg, batch = plan.layout.cfg, plan.mega.batch
    if np.shape(tokens) != (batch,) or np.shape(positions) != (batch,):
        raise ValueError(f"tokens and positions have shapes {np.shape(tokens)}, "
                         f"{np.shape(positions)}: allowed ({batch},) each (the plan's batch)")
    tok, pos = np.asarray(tokens), np.asarray(positions)
    reference.check_token_ids("tokens", tok, cfg)
    input_checks.check_each_in("positions", pos, plan.mega.seq_len)
    mesh = make_mesh(plan.n_ranks) if mesh is None else mesh
    sampling_ref.check_seed(seed)
    sp = sampling_ref.check_params(batch, cfg.vocab_size, temperature=temperature, top_k=top_k,
                                   top_p=top_p, candidates=sampling.MAX_CANDIDATES)
    sampled, truncated = sp.temperature > 0, (sp.top_k > 0) | (sp.top_p < 1)
    seed_i32 = np.asarray(np.uint32(int(seed) % 2**32)).view(np.int32).reshape(1)
    inputs = StepInputs(jnp.asarray(tok, jnp.int32), jnp.asarray(pos, jnp.int32),
                        jnp.asarray(seed_i32), jnp.asarray(plan.mega.layer_table, jnp.int32),
                        jnp.asarray(pos + 1, jnp.int32)[:, None],
                        jnp.asarray(sp.temperature)[:, None], jnp.asarray(sp.top_k)[:, None],
                        jnp.asarray(sp.top_p)[:, None])
    inputs = distributed.put(inputs, mesh, P())  # on every device (of every process)
    (tokens_out, overflow, logits), new_state = _call(
        plan, mesh, tpu.interpret_params(), dma.is_recording(), bool(np.any(sampled & ~truncated)),
        bool(np.any(sampled & truncated)), bool(return_logits), inputs, prepared, state)
    aux = {"tokens_per_rank": tokens_out, "nucleus_overflow": overflow[0], "plan": plan}
    if return_logits:
        # vocab shards in order, the last one's padding cut
        aux["logits"] = jnp.moveaxis(logits, 0, 1).reshape(batch, -1)[:, :cfg.vocab_size]
    return tokens_out[0], new_state, aux


# ---- compiling for a TPU topology on this machine -----------------------------------------
def make_mesh_on(topology: str, n_ranks: int) -> Any:
    """The mesh a run on n_ranks devices of a TPU `topology` builds (`make_mesh`: a multi-host
    slice's hosts each a process, their devices consecutive), from the topology's devices."""
    devices = tpu.topology_devices(topology)
    if len(devices) < n_ranks:
        raise ValueError(f"topology={topology!r} has {len(devices)} devices: n_ranks={n_ranks} "
                         "needs as many")
    return distributed.mesh(n_ranks, AXIS, devices)


def step_shapes(plan: ShardedPlan) -> tuple:
    """Shape structs of (inputs, weights [n, ...], state [n, ...]): nothing allocated."""
    lay, n, batch = plan.layout, plan.n_ranks, plan.mega.batch
    kcfg = plan.mega.cfg
    lead = functools.partial(jax.tree.map, lambda s: jax.ShapeDtypeStruct((n, *s.shape), s.dtype))
    weights = jax.eval_shape(jax.vmap(lambda p: megakernel.prepare_weights(p, kcfg)),
                             lead(layouts.rank_param_shapes(lay)))
    state = lead(layouts.rank_state_shapes(lay, batch, plan.mega.seq_len))
    inputs = megakernel.step_shapes(plan.mega)[0]
    return inputs, weights, state


def compile_sharded_step(cfg: ModelConfig, n_ranks: int = 32, name: str = layouts.OURS,
                         batch: int = 1, *, chip: str = "tpu7x", topology: str = FULL_TOPOLOGY,
                         seq_len: int | None = None, collectives: str = layouts.DEFAULT_COLLECTIVES,
                         options: mplan.MegakernelOptions | None = None, wire: str = "f32",
                         etp: int | None = None) -> tuple[Any, ShardedPlan]:
    """Compile the sharded step of `cfg` for n_ranks devices of a TPU `topology` from shapes only
    -> (tpu.CompileResult: one device's program, its Mosaic kernels, plan); `collectives` as
    `decode --ranks N --collectives` (partial sums by default); options: the kernel's (default
    MegakernelOptions(chip=chip): every reduction one-shot); wire: the partial sums' (`plan.WIRES`);
    etp: the experts' expert-tensor ways (None: the layout's default)."""
    lay = layouts.layout(cfg, n_ranks, name, collectives=collectives, etp=etp)
    plan = make_sharded_plan(lay, batch, seq_len, options or mplan.MegakernelOptions(chip=chip),
                             wire)
    mesh = make_mesh_on(topology, n_ranks)

    def step(inputs, weights, state):
        return _call(plan, mesh, tpu.interpret_params(), False, False, False, False, inputs,
                     weights, state)

    shardings = (NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS)),
                 NamedSharding(mesh, P(AXIS)))
    return tpu.compile_for(step, *step_shapes(plan), chip=chip, shardings=shardings), plan
