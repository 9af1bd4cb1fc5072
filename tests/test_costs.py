"""The cost every kernel declares to XLA (`pallas_call(cost_estimate=...)`, read off its body by
`kernels/base/costs.py`) against measurements that do not come from it, at mini shapes, B = 1
and 2, compiled for TPU7x.

* bytes: the HBM bytes of the DMA log of an interpret-mode run (every DMA the body issues
  itself) plus the pallas_call's VMEM/SMEM operands and results, which Pallas copies in and out
  around the body and which are not in the log (x, positions, the output: a few kB; for quant
  decode the bf16 result, 4x its MXFP4 input; for the BlockSpec GEMV all of it, its pipeline),
  equal to the declared bytes, in the worst case the estimate assumes;
* the compiled HLO: the Mosaic custom call's cost estimate as it stands in the HLO compiled for
  TPU7x at the same shapes (`CompileResult.mosaic_cost`) is the derived one (`costs.declared`:
  the traced call's), FLOPs, transcendentals and bytes;
* FLOPs: at least the FLOPs the body logs for its phases (the streamed matmuls, experts, LM head
  tiles, final mix; attention and the delta rule log none), and the compiled program's at least
  the declared.

The compiled program's total `bytes_accessed` is not compared: it is the declared bytes plus what
XLA adds around the custom call. At mini shapes XLA prefetches small operands, weights of a few MB
included, into VMEM with copy-start/copy-done pairs that it counts as reads and writes, so the
total runs up to ~4x the kernel's own traffic; it is asserted to contain the declared bytes.

Each run is in the worst case the estimate assumes: every MLA row at the cache's last position;
every row of the sequence-sharded partial past its shard; no expert shared by two rows, so
min(E, B·k) distinct experts (engineered router weights for the MoE layer; in the megakernel,
whose routing comes from its own layers, the experts the rows share, which the run does not
fetch, are the bytes the log lacks: min(E, B·k) per routed layer minus those it fetched).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mkresearch.kernels.base import costs, dma, dry_run, gemv, quant
from mkresearch.kernels.compose import megakernel as mk
from mkresearch.kernels.compose import megakernel_sharded as sharded
from mkresearch.kernels.compose import schedule
from mkresearch.kernels.sharded import collectives, mla_sharded
from mkresearch.kernels.stages import experts, kda, mla, router, sampling

from mkresearch.hardware import tpu
from mkresearch.measurement import logs
from mkresearch.model import config, reference, weights
from mkresearch.model.config import get_config
from mkresearch.prediction import timeline as tl
from mkresearch.sharding import layout as layouts

MINI = config.get_config("kimi-k3-mini")
BATCHES = (1, 2)
# Engineered routing for the MoE layer: row b's normalised input is the unit vector e_b, and the
# router weights give row b's experts a logit of √d and every other expert 0: disjoint sets.
ROUTED = [[0, 5, 10, 15], [1, 6, 11, 12]]


def size(*arrays):
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(arrays))


def normalised(batch, seed):
    x = jax.random.normal(jax.random.key(seed), (batch, MINI.d_model))
    return reference.rms_norm(x, jnp.ones((MINI.d_model,), jnp.bfloat16), MINI.rms_eps)


def random_cache(cfg, batch, seed):
    shapes = mla.cache_shapes(cfg, batch, cfg.max_seq_len)
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {name: jax.random.normal(key, shape).astype(jnp.bfloat16)
            for (name, shape), key in zip(shapes.items(), keys)}


# ---- the stages: (run, args, bytes Pallas moves around the body given (args, out, log)) --------
def kda_stage(params, B):
    h, d = MINI.n_heads, MINI.kda_head_dim
    args = (reference.layer_params(params["kda"], 0), normalised(B, 1),
            jnp.zeros((B, MINI.kda_conv_size - 1, 3, h, d), jnp.bfloat16),
            jnp.zeros((B, h, d, d), jnp.float32))
    return (lambda p, x, c, s: kda.kda_attention(p, x, c, s, MINI), args,
            lambda a, out, log: size(a[1], out[0]))  # x in, the output out


def mla_stage(params, B, layout):
    cfg = MINI.replace(mla_cache_layout=layout)
    positions = jnp.full((B,), cfg.max_seq_len - 1, jnp.int32)  # the estimate's assumption
    args = (reference.layer_params(params["mla"], 0), normalised(B, 2), random_cache(cfg, B, 3),
            positions)
    return (lambda p, x, c, pos: mla.mla_attention(p, x, c, pos, cfg), args,
            lambda a, out, log: size(a[1], a[3], out[0]))  # x, positions, the output


def mla_partial_stage(params, B):
    cfg = MINI.replace(mla_cache_layout="latent")
    keys = jax.random.split(jax.random.key(4), 2)
    q = jax.random.normal(keys[0], (B, cfg.n_heads, cfg.mla_kv_rank)).astype(jnp.bfloat16)
    q_x = jax.random.normal(keys[1], (B, cfg.n_heads, cfg.mla_qk_extra)).astype(jnp.bfloat16)
    shard = {name: a[:, :32] for name, a in random_cache(cfg, B, 5).items()}  # tokens 0..31
    positions = jnp.array([40, 100][:B], jnp.int32)  # past the shard: every row reads all of it
    return (lambda q, q_x, c, pos: mla_sharded.mla_latent_partial(q, q_x, c, pos, 0, cfg),
            (q, q_x, shard, positions),
            lambda a, out, log: size(a[0], a[1], a[3], out))  # queries, counts, the states


def router_stage(params, B):
    return (lambda p, x: router.route(p, x, MINI),
            (reference.layer_params(params["moe"], 0), normalised(B, 6)),
            lambda a, out, log: size(a[1], out, out))  # x; ids and weights in VMEM and SMEM


def moe_stage(params, B):
    p = reference.layer_params(params["moe"], 0)
    w_router = np.zeros((MINI.d_model, MINI.n_experts), np.float32)
    for row, chosen in enumerate(ROUTED[:B]):
        w_router[row, chosen] = 1.0
    p = {**p, "w_router": jnp.asarray(w_router, jnp.bfloat16),
         "router_bias": jnp.zeros_like(p["router_bias"])}
    x = reference.rms_norm(jnp.eye(B, MINI.d_model), jnp.ones((MINI.d_model,), jnp.bfloat16),
                           MINI.rms_eps)
    ids, _ = reference.route(p, x, MINI)
    assert [sorted(row) for row in np.asarray(ids).tolist()] == ROUTED[:B]  # min(E, B·k) experts
    return (lambda p, x: experts.moe_ffn(p, x, MINI), (p, x),
            lambda a, out, log: size(a[1], out))


def dense_stage(params, B):
    return (lambda p, x: experts.dense_ffn(p, x, MINI),
            (reference.layer_params(params["dense"], 0), normalised(B, 7)),
            lambda a, out, log: size(a[1], out))


def sampling_stage(params, B):
    snapshots = jnp.full((MINI.n_blocks, B, MINI.d_model), 0.1, jnp.bfloat16)
    args = (snapshots, normalised(B, 8), params["mix_out"], params["final_norm"],
            params["lm_head"])

    def run(*a):
        return sampling.sample_stage(*a, cfg=MINI, seed=0, positions=np.arange(B)).tokens

    # seed [1], positions, temperature, top_k, top_p [B, 1] (4 B each), the mix inputs and norm;
    # tokens and nucleus_overflow [B, 1] i32
    return run, args, lambda a, out, log: 4 + 4 * 4 * B + size(a[:4]) + 2 * 4 * B


GEMV = (8, 1024, 256, 256)  # B, K, N, block_k


def gemv_stage(params, _batch, variant):  # GEMV's own batch
    batch, k, n, block_k = GEMV
    x = jnp.ones((batch, k), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(9), (k, n)) / 32).astype(jnp.bfloat16)
    if variant == "stream":
        return (lambda x, w: gemv.gemv_stream(x, w, block_k=block_k), (x, w),
                lambda a, out, log: size(a[0], out))  # x (as [K/bk, B, bk]) and the output

    def pipeline(a, out, log):  # a BlockSpec kernel logs no DMA: its pipeline's copies
        events = tl.blockspec_log(log, gemv.blockspec_block_bytes(batch, block_k, n),
                                  out_bytes=size(out))
        return sum(e.nbytes for e in events if e.kind == "dma_start")

    return lambda x, w: gemv.gemv_blockspec(x, w, block_k=block_k), (x, w), pipeline


def decode_stage(params, _batch):  # no batch
    k, n = 256, 256
    keys = jax.random.split(jax.random.key(10), 2)
    parts = {"codes": jax.random.bits(keys[0], (k // 8, n), jnp.uint32),
             "scales": jax.random.randint(keys[1], (k // 32, n), 120, 130).astype(jnp.uint8)}
    return (lambda w: quant.decode(w, "mxfp4"), (parts,),
            lambda a, out, log: size(out))  # the bf16 [K, N] result


STAGES = {  # name -> (the stage at batch B, whether it has a batch: the GEMVs and decode do not)
    "kda": (kda_stage, True),
    "mla-expanded": (lambda params, b: mla_stage(params, b, "expanded"), True),
    "mla-latent": (lambda params, b: mla_stage(params, b, "latent"), True),
    "mla-latent-partial": (mla_partial_stage, True),
    "router": (router_stage, True),
    "moe-layer": (moe_stage, True),
    "dense-ffn": (dense_stage, True),
    "sampling": (sampling_stage, True),
    "gemv-stream": (lambda params, b: gemv_stage(params, b, "stream"), False),
    "gemv-blockspec": (lambda params, b: gemv_stage(params, b, "blockspec"), False),
    "quant-decode": (decode_stage, False),
}
CASES = [(stage, b) for stage, (_, batched) in STAGES.items() for b in (BATCHES if batched else (None,))]


@pytest.fixture(scope="module")
def mini_params():
    return weights.init_params(MINI, 0)


def check_declared(name, compiled, derived, moved, log):
    """The assertions of the module docstring, with the numbers printed."""
    declared = compiled.mosaic_cost
    logged_flops = sum(e.flops for e in log.select("phase_start"))
    print(f"{name}: declared {declared['bytes_accessed']:,} B, moved {moved:,} B; program total "
          f"{compiled.bytes_accessed:,.0f} B; flops declared {declared['flops']:,}, program "
          f"{compiled.flops:,.0f}, logged {logged_flops:,}; transcendentals "
          f"{declared['transcendentals']:,}")
    assert compiled.n_mosaic_kernels == 1
    assert declared == {"flops": derived.flops, "transcendentals": derived.transcendentals,
                        "bytes_accessed": derived.bytes_accessed}
    assert declared["bytes_accessed"] == moved
    assert compiled.bytes_accessed >= declared["bytes_accessed"]
    # XLA's cost analysis adds its counts as f32 floats: the program's total is the declared
    # count rounded to f32 (a spacing of 32 at 3e8 FLOPs) when nothing else adds FLOPs
    assert logged_flops <= declared["flops"] and np.float32(declared["flops"]) <= compiled.flops


@pytest.mark.slow
@pytest.mark.parametrize("stage, batch", CASES)
def test_declared_cost_is_what_the_stage_moves(race_checked, mini_params, stage, batch):
    run, args, around = STAGES[stage][0](mini_params, batch or 2)
    with dma.recording() as log:
        out = jax.block_until_ready(run(*args))
    moved = logs.hbm_bytes(log) + around(args, out, log)
    check_declared(stage, tpu.compile_for(run, *args, chip="tpu7x"), costs.declared(run, *args),
                   moved, log)


@pytest.mark.slow
@pytest.mark.parametrize("batch", BATCHES)
def test_declared_cost_is_what_the_megakernel_moves(race_checked, mini_params, batch):
    """One greedy step with every row at the cache's last position: the step's kernel, every
    stage body over its layers, the embedding rows, the per-layer vectors and the sampling
    stage. Its routing is its own: the experts its rows share are not fetched (the estimate
    assumes min(E, B·k) per routed layer), which the log lacks."""
    prepared = mk.prepare_weights(mini_params, MINI)
    tokens = np.array([7, 11][:batch], np.int32)
    positions = np.full((batch,), MINI.max_seq_len - 1, np.int32)
    with dma.recording() as log:
        jax.block_until_ready(mk.decode_step(prepared, reference.init_state(MINI, batch), tokens,
                                             positions, MINI)[0])
    compiled, plan = mk.compile_step(MINI, batch, chip="tpu7x")
    inputs, weights_shapes, state = mk.step_shapes(plan)
    derived = costs.declared(
        lambda i, w, s: mk.step_call(plan, None, False, False, False, i, w, s), inputs,
        weights_shapes, state)
    # tokens, positions, seed [1], the layer table; sample positions, temperature, top_k, top_p
    # [B, 1]; tokens and overflow [B, 1]: 4 bytes each
    around = 4 * (2 * batch + 1 + len(plan.layer_table) + 4 * batch + 2 * batch)
    routed_layers = len(schedule.routed_layers(plan))
    worst_experts = routed_layers * min(MINI.n_experts, batch * MINI.top_k)
    shared = worst_experts * weights.expert_nbytes(MINI) - log.dma_bytes(experts.EXPERT_DMA_PREFIX)
    assert batch > 1 or shared == 0  # one row's k choices are distinct
    check_declared("megakernel", compiled, derived, logs.hbm_bytes(log) + around + shared, log)


@pytest.mark.slow
def test_moe_layer_at_rank_shapes_declares_the_whole_layer():
    """The issue's example, at kimi-k3-rank shapes (no interpret run: GBs of weights), compiled
    for TPU7x as one Mosaic kernel (the MoE layer of test_expert_kernel's full rank). At B = 8
    every one of the rank's 112 experts can be routed (min(112, 8·16)), so the declared bytes
    are exactly one MoE layer's parameters (mkresearch.model.weights.param_shapes) plus x and the
    output; the compiled program's bytes_accessed, a few kB before, holds them."""
    cfg = get_config("kimi-k3-rank")
    layer = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype),
                         weights.param_shapes(cfg)["moe"])
    x = jax.ShapeDtypeStruct((8, cfg.d_model), jnp.bfloat16)
    compiled = tpu.compile_for(lambda p, x: experts.moe_ffn(p, x, cfg), layer, x, chip="tpu7x")
    print(f"MoE layer at {cfg.name}, B=8: declared {compiled.mosaic_cost}, program "
          f"{compiled.bytes_accessed:,.0f} B")
    assert compiled.mosaic_cost["bytes_accessed"] == size(layer) + 2 * size(x)
    assert compiled.bytes_accessed >= size(layer)
    assert compiled.n_mosaic_kernels == 1  # the whole MoE layer is one kernel (test_expert_kernel)


@pytest.mark.parametrize("kernel", ["gemv-stream", "megakernel"])
def test_an_estimate_only_where_xla_reads_it(kernel):
    """Interpret mode drops a pallas_call's cost estimate (jax's interpret_pallas_call deletes
    it), so a kernel built for it declares none and its body is not traced a second time for
    one (`costs.wanted`); built for Mosaic (`tpu.compiling`, as `tpu.compile_for` and
    `costs.declared` build) it declares the cost read off its body."""
    if kernel == "gemv-stream":
        run, args, _ = gemv_stage(None, None, "stream")
    else:
        plan = mk.make_plan(MINI, 1, MINI.max_seq_len)
        args = mk.step_shapes(plan)

        def run(i, w, s):
            return mk.step_call(plan, tpu.interpret_params(), False, False, False, i, w, s)
    shapes = costs.shapes(args)
    assert tpu.interpret_params() is not None  # this machine: interpret mode
    traced = dry_run.kernel_call(run, *shapes)
    assert traced.params["cost_estimate"] is None
    with tpu.compiling():  # a new function: make_jaxpr would reuse run's interpret-mode trace
        built = dry_run.kernel_call(lambda *a: run(*a), *shapes)
    estimate = built.params["cost_estimate"]
    assert estimate.bytes_accessed == costs.declared(run, *shapes).bytes_accessed > 0


@pytest.mark.parametrize("mode", ["partial-sum", "exact"])
@pytest.mark.parametrize("batch", BATCHES)
def test_sharded_step_declares_the_most_any_rank_moves(mode, batch):
    """One program serves every rank of a sharded build and XLA's estimate is per device: the
    step declares rank 0's own worst case, the most any rank's own worst case moves. Every
    rank's own dry run, shapes only (no devices): its rows' token in its vocab shard, its own
    experts routed (kimi-k3-mini on 8 ranks: in partial sums the ranks move different bytes)."""
    n = 8
    plan = sharded.make_sharded_plan(layouts.layout(MINI, n, collectives=mode), batch)
    inputs, *stacked = sharded.step_shapes(plan)
    one_rank = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), stacked)

    def step(*args):
        return mk.step_call(plan.mega, None, False, False, False, *args, shard=plan.shard)

    def case(rank):
        return mk.worst_case(plan.mega, plan.shard, rank)

    moved = [c.bytes_accessed for c in mk.rank_costs(step, (inputs, *one_rank), plan.shard, case)]
    assert mode == "exact" or len(set(moved)) > 1  # partial sums: the ranks differ
    declared = mk.step_cost(plan.mega, inputs, *one_rank, shard=plan.shard)
    assert declared.bytes_accessed == moved[0] == max(moved)
