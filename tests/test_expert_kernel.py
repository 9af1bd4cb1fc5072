"""FFN stage kernel (mkresearch.kernels.stages.experts) and in-VMEM decode (mkresearch.kernels.base.quant).

Against mkresearch.model.reference (routed_experts, moe_ffn, dense_ffn) and mkresearch.model.weights
(mxfp4_unpack, fp8_unpack), in TPU interpret mode with the race detector on:
- outputs within a bf16 tolerance (they are in fact bit-equal on these shapes) for B in {1, 4, 8},
  all three weight formats, duplicate experts across rows, every fetch plan / slot count;
- expert bytes in the DMA log = unique experts x bytes of one expert, to the byte;
- the slot ring overlaps: the next expert's DMA starts before the current one is waited on;
- MXFP4 / FP8 decoded in the kernel equal the unpacked reference exactly, MXFP4 by both decode
  paths (native float4 bitcast, built for TPU7x; integer bit operations, built for v5e/v6e/v5p);
- bad input -> ValueError naming the parameter; compiles for every chip at mini shapes (each
  format) and for TPU7x at per-rank shapes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuts import kimi_kinds
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import dma, quant
from mkresearch.kernels.stages import experts

from mkresearch.hardware import tpu
from mkresearch.hardware.chips import CHIPS
from mkresearch.model import config, formats, reference, weights
from mkresearch.model.config import get_config
from mkresearch.model.numerics import block_scaled_matmul, sequence_sum

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

FORMATS = ("bf16", "fp8", "mxfp4")
# a chip of each MXFP4 decode path: "native" (float4 bitcast) and "integer" (bit operations)
DECODE_PATH_CHIPS = {"native": "tpu7x", "integer": "v5e"}


def skip_unless_runs_here(chip):
    """A kernel built for `chip` runs in interpret mode (a CPU) or on that chip; on a TPU of
    another kind it is refused (`quant.check_runs_here`: a TPU7x's float4 decode does not compile
    on a v5e), and test_compiles_for_every_chip_mini compiles it for `chip` instead."""
    present = tpu.present_chip()
    if present is not None and present != chip:
        pytest.skip(f"a kernel built for {chip} cannot run on this {present}: interpret mode runs "
                    "it, the compile tests compile it")
# bf16 tolerance of a [B, d] output whose entries are O(1): a few bf16 ulps of the largest entry.
RTOL = 2**-7


def mini(fmt):
    return config.get_config("kimi-k3-mini", expert_format=fmt)


def first_layers_params(cfg, seed=0):
    """init_params of the mini cut to its first dense and MoE layers (tests/cuts.py): their
    weights are the whole mini's layer 0 ones, bit for bit (the kernels take the whole mini's
    cfg)."""
    return weights.init_params(kimi_kinds(cfg), seed=seed)


@pytest.fixture(scope="module")
def layers():
    """One MoE layer (and the dense layer) of the mini model in each expert format."""
    out = {}
    for fmt in FORMATS:
        params = first_layers_params(mini(fmt), seed=0)
        out[fmt] = (reference.layer_params(params["moe"], 0),
                    reference.layer_params(params["dense"], 0))
    return out


def activations(batch, seed=1):
    d = mini("bf16").d_model
    return jnp.asarray(np.random.default_rng(seed).standard_normal((batch, d)), jnp.bfloat16)


def assert_close(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL * scale)


def run_routed(p, x, ids, w, cfg, **kwargs):
    with dma.recording() as log:
        out = experts.routed_experts(p, x, ids, w, cfg, **kwargs)
    return out, log


def expert_bytes_of(cfg):
    lat, hidden, fmt = cfg.moe_latent, cfg.expert_hidden, cfg.expert_format
    return 2 * quant.matrix_nbytes(fmt, lat, hidden) + quant.matrix_nbytes(fmt, hidden, lat)


@pytest.mark.slow
# ---- outputs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [  # B = 4 here; B = 1 and 8 (the megakernel checks both): exhaustive
    pytest.param(1, marks=pytest.mark.exhaustive), 4, pytest.param(8, marks=pytest.mark.exhaustive)])
def test_routed_matches_reference_bf16(race_checked, layers, batch):
    cfg = mini("bf16")
    p, _ = layers["bf16"]
    x = activations(batch)
    ids, w = reference.route(p, x, cfg)
    out, log = run_routed(p, x, ids, w, cfg)
    assert out.shape == (batch, cfg.d_model) and out.dtype == jnp.float32
    assert_close(out, reference.routed_experts(p, x, ids, w, cfg))
    n_unique = len(np.unique(np.asarray(ids)))
    assert log.dma_bytes(experts.EXPERT_DMA_PREFIX) == n_unique * weights.expert_nbytes(cfg)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.slow
def test_routed_matches_reference_quantised(race_checked, layers, fmt):
    cfg = mini(fmt)
    p, _ = layers[fmt]
    x = activations(4, seed=2)
    ids, w = reference.route(p, x, cfg)
    out, log = run_routed(p, x, ids, w, cfg)
    assert_close(out, reference.routed_experts(p, x, ids, w, cfg))
    n_unique = len(np.unique(np.asarray(ids)))
    assert weights.expert_nbytes(cfg) == expert_bytes_of(cfg)
    assert log.dma_bytes(experts.EXPERT_DMA_PREFIX) == n_unique * weights.expert_nbytes(cfg)


@pytest.mark.parametrize("path", DECODE_PATH_CHIPS)
@pytest.mark.slow
def test_mxfp4_both_decode_paths_bit_equal_to_reference(race_checked, layers, path):
    """The kernel built for either path gives the reference's bits: each decoded chunk is the
    whole bf16 [rows, N] weight block and the dot over it is the same as before."""
    skip_unless_runs_here(DECODE_PATH_CHIPS[path])
    cfg = mini("mxfp4")
    p, _ = layers["mxfp4"]
    x = activations(4, seed=2)
    ids, w = reference.route(p, x, cfg)
    out = experts.routed_experts(p, x, ids, w, cfg, chip=DECODE_PATH_CHIPS[path])
    want = reference.routed_experts(p, x, ids, w, cfg)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), np.asarray(want).view(np.uint32))


@pytest.mark.parametrize("fmt, path, batch", [
    ("mxfp4", "native", 3), pytest.param("mxfp4", "integer", 1, marks=pytest.mark.exhaustive),
    ("fp8", "native", 3)])
@pytest.mark.slow
def test_fp8_mxu_bit_equal_to_reference(race_checked, layers, fmt, path, batch):
    """expert_mxu="fp8": the kernel hands the MXU each chunk's values as e4m3 (MXFP4's E2M1 codes
    converted by either decode path) and scales the blocks' partial products after the dot; the
    reference's `formats.mxu_matmul` computes the same, to the bit."""
    skip_unless_runs_here(DECODE_PATH_CHIPS[path])
    cfg = config.get_config("kimi-k3-mini", expert_format=fmt, expert_mxu="fp8")
    p, _ = layers[fmt]
    x = activations(batch, seed=2)
    ids, w = reference.route(p, x, cfg)
    out = experts.routed_experts(p, x, ids, w, cfg, chip=DECODE_PATH_CHIPS[path])
    want = reference.routed_experts(p, x, ids, w, cfg)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), np.asarray(want).view(np.uint32))
    decoded = reference.routed_experts(p, x, ids, w, mini(fmt))  # expert_mxu="bf16"
    assert_close(want, decoded)


# a mini whose W2 contracts over K = 1024 (the minis' 256 has one chunk only): its fp8 MXU chunk
# is 256 (`formats.mxu_k_chunk`), not k_chunk's 1024; at B = 12 k_chunk's would pass the MXU's rows
WIDE_HIDDEN = {"expert_hidden": 1024}
WIDE_BATCH = 12


def test_wide_mini_bites():
    assert formats.k_chunk("mxfp4", 1024) == 1024
    assert formats.mxu_k_chunk("mxfp4", 1024) == 256


@pytest.mark.slow
def test_fp8_mxu_chunks_bit_equal_to_reference_whatever_the_batch(race_checked):
    """The kernel hands the MXU K chunks of `formats.mxu_k_chunk`'s rows; the reference's
    `formats.mxu_matmul` takes the same, to the bit, and a row alone gives the row of the batch.
    Built for the chip present (tpu7x in interpret mode): both MXFP4 paths decode the same bits."""
    cfg = config.get_config("kimi-k3-mini", expert_mxu="fp8", **WIDE_HIDDEN)
    p = reference.layer_params(first_layers_params(cfg, seed=0)["moe"], 0)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((WIDE_BATCH, cfg.d_model)),
                    jnp.bfloat16)
    ids, w = reference.route(p, x, cfg)
    out = experts.routed_experts(p, x, ids, w, cfg)
    want = reference.routed_experts(p, x, ids, w, cfg)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), np.asarray(want).view(np.uint32))
    alone = experts.routed_experts(p, x[5:6], ids[5:6], w[5:6], cfg)
    np.testing.assert_array_equal(np.asarray(alone).view(np.uint32),
                                  np.asarray(out[5:6]).view(np.uint32))
    decoded = reference.routed_experts(p, x, ids, w, cfg.replace(expert_mxu="bf16"))
    assert_close(want, decoded)


def _mxu_product_kernel(x_ref, *refs, fmt):
    *parts, out = refs
    out[...] = quant.matmul(x_ref[...], parts, fmt, mxfp4_decode=quant.mxfp4_decode_path(),
                            mxu_input="fp8")  # the path of the chip present (tpu7x interpreted)


@pytest.mark.parametrize("fmt, k, batch", [("mxfp4", 1024, WIDE_BATCH), ("fp8", 4096, 80)])
@pytest.mark.slow
def test_fp8_mxu_product_in_a_kernel_takes_the_rules_chunks(race_checked, fmt, k, batch):
    """The stage rounds each product to bf16, which hides most f32 differences of summation order;
    the kernel's `quant.matmul` alone (f32 out) shows them: its bits are `formats.mxu_matmul`'s
    with the rule's chunks (256), not those of `k_chunk`'s."""
    rng = np.random.default_rng(3)
    stored = weights.quantize(jnp.asarray(rng.normal(0, 0.05, (k, 128)), jnp.float32), fmt)
    x = jnp.asarray(rng.normal(0, 1, (batch, k)), jnp.bfloat16)
    chunk, wide = formats.mxu_k_chunk(fmt, k), formats.k_chunk(fmt, k)
    assert chunk == 256 < wide
    parts = quant.split_parts(stored, fmt)
    vmem = pl.BlockSpec(memory_space=pltpu.MemorySpace.VMEM)
    got = pl.pallas_call(functools.partial(_mxu_product_kernel, fmt=fmt),
                         out_shape=jax.ShapeDtypeStruct((batch, 128), jnp.float32),
                         in_specs=[vmem] * (1 + len(parts)), out_specs=vmem,
                         interpret=tpu.interpret_params())(x, *parts)
    got = np.asarray(got).view(np.uint32)
    np.testing.assert_array_equal(got, np.asarray(formats.mxu_matmul(x, stored, fmt)).view(np.uint32))
    values, scales = formats.mxu_parts(stored, fmt)
    block = formats.EXPERT_BLOCKS[fmt]
    in_wide_chunks = sequence_sum(  # k_chunk's order: the chunks show in the bits
        block_scaled_matmul(x[:, r:r + wide], values[r:r + wide],
                            scales[r // block:(r + wide) // block]) for r in range(0, k, wide))
    assert np.any(got != np.asarray(in_wide_chunks).view(np.uint32))


def duplicated_routing(cfg):
    """4 rows sharing experts: rows 0 and 1 pick the same set (in another order), row 2 overlaps
    them in two experts, row 3 is row 0 again. 6 unique experts for 16 choices."""
    ids = np.array([[1, 7, 3, 12], [12, 3, 7, 1], [7, 1, 0, 15], [1, 7, 3, 12]], np.int32)
    w = np.random.default_rng(7).uniform(0.1, 1.0, ids.shape).astype(np.float32)
    return jnp.asarray(ids), jnp.asarray(w / w.sum(-1, keepdims=True)), 6


@pytest.mark.parametrize("fmt", FORMATS)
def test_duplicate_experts_loaded_once(race_checked, layers, fmt):
    cfg = mini(fmt)
    p, _ = layers[fmt]
    x = activations(4, seed=3)
    ids, w, n_unique = duplicated_routing(cfg)
    out, log = run_routed(p, x, ids, w, cfg, plan="unique", n_slots=2)
    assert_close(out, reference.routed_experts(p, x, ids, w, cfg))
    assert log.dma_bytes(experts.EXPERT_DMA_PREFIX) == n_unique * weights.expert_nbytes(cfg)
    loaded = {e.indices["item"] for e in log.select("dma_start", experts.EXPERT_DMA_PREFIX)}
    assert loaded == set(range(n_unique))


@pytest.mark.parametrize("plan, n_slots, n_loads", [("all", 1, 16), ("routed", 1, 16),
                                                   ("routed", 3, 16), ("unique", 1, 6)])
@pytest.mark.slow
def test_every_plan_and_ring_depth(race_checked, layers, plan, n_slots, n_loads):
    cfg = mini("mxfp4")
    p, _ = layers["mxfp4"]
    x = activations(4, seed=3)
    ids, w, _ = duplicated_routing(cfg)
    out, log = run_routed(p, x, ids, w, cfg, plan=plan, n_slots=n_slots)
    assert_close(out, reference.routed_experts(p, x, ids, w, cfg))
    assert log.dma_bytes(experts.EXPERT_DMA_PREFIX) == n_loads * weights.expert_nbytes(cfg)


def test_ring_overlaps_dma_with_compute(race_checked, layers):
    cfg = mini("mxfp4")
    p, _ = layers["mxfp4"]
    x = activations(4, seed=3)
    ids, w, n_unique = duplicated_routing(cfg)
    _, log = run_routed(p, x, ids, w, cfg, plan="unique", n_slots=2)
    order = [(e.kind, e.name, e.indices.get("item")) for e in log.events]

    def first(kind, name, item=None):
        return next(n for n, (k, nm, it) in enumerate(order)
                    if k == kind and nm.startswith(name) and (item is None or it == item))

    # expert 0 is issued before the latent down-projection's weights are even waited on
    assert first("dma_start", "expert/", 0) < first("dma_wait", "latent/w_ld")
    # while item i computes, item i+1 is already in flight
    for i in range(n_unique - 1):
        assert first("dma_start", "expert/", i + 1) < first("phase_start", "expert/compute", i)
    slots = {e.slot for e in log.select("dma_start", experts.EXPERT_DMA_PREFIX)}
    assert slots == {0, 1}


@pytest.mark.slow
def test_moe_layer_one_kernel(race_checked, layers):
    cfg = mini("mxfp4")
    p, _ = layers["mxfp4"]
    x = activations(8, seed=4)
    with dma.recording() as log:
        out = experts.moe_ffn(p, x, cfg)
    assert out.dtype == jnp.bfloat16
    assert_close(out, reference.moe_ffn(p, x, cfg))
    ids, _ = reference.route(p, x, cfg)
    n_unique = len(np.unique(np.asarray(ids)))
    assert log.dma_bytes(experts.EXPERT_DMA_PREFIX) == n_unique * weights.expert_nbytes(cfg)
    shared = sum(weights.nbytes(p[k]) for k in ("w_sg", "w_su", "w_sd"))
    assert log.dma_bytes("shared/") == shared


def test_dense_layer_is_the_stage_with_one_always_on_expert(race_checked, layers):
    cfg = mini("bf16")
    _, dense = layers["bf16"]
    x = activations(4, seed=5)
    with dma.recording() as log:
        out = experts.dense_ffn(dense, x, cfg)
    assert_close(out, reference.dense_ffn(dense, x, cfg))
    assert log.dma_bytes() == weights.nbytes(dense)  # every dense weight byte, once


# ---- in-VMEM decode ------------------------------------------------------------------------------
def all_codes_mxfp4(k=256, n=128):
    """Every E2M1 code in every nibble position, E8M0 scales across 2..254 (2^-125..2^127).

    Exponents 0 and 1 are left out: 0.5 x 2^-126 is an f32 subnormal, which the TPU (and XLA on
    CPU) flush to zero, so no f32 decode is exact there; the packer only makes them for blocks
    whose largest |w| is below ~1e-37."""
    rng = np.random.default_rng(11)
    nibbles = rng.integers(0, 16, (k, n)).astype(np.uint32)
    nibbles[:16, 0] = np.arange(16)
    codes = np.zeros((k // 8, n), np.uint32)
    for j in range(8):
        codes |= nibbles[j::8] << np.uint32(4 * j)
    scales = rng.choice(np.array([2, 3, 64, 120, 127, 134, 200, 253, 254], np.uint8),
                        (k // 32, n))
    # docs/kimi-k3.md §7's value, in float64 then rounded once to bf16
    magnitude = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])[nibbles & 7]
    value = np.where(nibbles & 8, -magnitude, magnitude) * np.ldexp(
        1.0, np.repeat(scales, 32, axis=0).astype(int) - 127)
    with np.errstate(over="ignore"):  # 6 x 2^127 is inf in bf16, in the kernel too
        expected = value.astype(jnp.bfloat16).astype(np.float32)
    return {"codes": jnp.asarray(codes), "scales": jnp.asarray(scales)}, expected


def bits(a):
    """bf16 values as their 16-bit patterns: -0 and NaNs compared exactly."""
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_in_kernel_is_exact(race_checked, layers, fmt):
    p, _ = layers[fmt]
    for name in ("w1", "w2"):
        stored = jax.tree.map(lambda a: a[3], p["experts"][name])  # expert 3, [K, N]
        got = np.asarray(quant.decode(stored, fmt), np.float32)
        want = np.asarray(weights.dequantize(stored, fmt), np.float32)
        np.testing.assert_array_equal(got, want)
    if fmt == "mxfp4":
        stored, expected = all_codes_mxfp4()
        got = np.asarray(quant.decode(stored, fmt), np.float32)
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(got, np.asarray(weights.mxfp4_unpack(stored, jnp.bfloat16),
                                                      np.float32))
    if fmt == "fp8":
        stored = jax.tree.map(lambda a: a[3], p["experts"]["w1"])
        np.testing.assert_array_equal(
            np.asarray(quant.decode(stored, fmt), np.float32),
            np.asarray(weights.fp8_unpack(stored, jnp.float32)))


@pytest.mark.parametrize("path", DECODE_PATH_CHIPS)
def test_mxfp4_decode_paths_give_mxfp4_unpack_bits(race_checked, layers, path):
    """Every code in every nibble position (-0 included) and an expert's real weights: the
    kernel built for a chip of each path decodes to mxfp4_unpack's bits."""
    chip = DECODE_PATH_CHIPS[path]
    assert quant.mxfp4_decode_path(chip) == path
    skip_unless_runs_here(chip)
    p, _ = layers["mxfp4"]
    stored_expert = jax.tree.map(lambda a: a[3], p["experts"]["w2"])  # [F, Lat]
    for stored in (all_codes_mxfp4()[0], stored_expert):
        got = quant.decode(stored, "mxfp4", chip=chip)
        np.testing.assert_array_equal(bits(got), bits(weights.mxfp4_unpack(stored, jnp.bfloat16)))


def test_mxfp4_decode_path_per_chip():
    """One place decides: Chip.native_fp4; inside compile_for the chip compiled for, on a TPU
    that TPU, and in interpret mode tpu7x (the default chip of compile_for and
    MegakernelOptions)."""
    paths = {"v5e": "integer", "v6e": "integer", "v5p": "integer", "tpu7x": "native"}
    assert {name: quant.mxfp4_decode_path(name) for name in CHIPS} == paths
    assert quant.mxfp4_decode_path() == paths[tpu.present_chip() or "tpu7x"]
    with tpu.compiling("v6e"):
        assert quant.mxfp4_decode_path() == "integer"
    with pytest.raises(ValueError, match="unknown chip 'h100'"):
        quant.decode(all_codes_mxfp4()[0], "mxfp4", chip="h100")


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bad_input(layers):
    cfg = mini("bf16")
    p, _ = layers["bf16"]
    x = activations(2)
    ids, w = reference.route(p, x, cfg)
    with pytest.raises(ValueError, match="expert_format"):
        experts.routed_experts(p, x, ids, w, _unsupported(cfg))
    with pytest.raises(ValueError, match="expert_ids"):
        experts.routed_experts(p, x, ids[:, :2].reshape(-1), w, cfg)  # 1-D
    with pytest.raises(ValueError, match="expert_ids"):
        experts.routed_experts(p, x, ids[:1], w[:1], cfg)  # wrong batch
    with pytest.raises(ValueError, match="expert_ids"):
        experts.routed_experts(p, x, ids + 16, w, cfg)  # ids out of range
    with pytest.raises(ValueError, match="expert_weights"):
        experts.routed_experts(p, x, ids, w[:, :2], cfg)
    with pytest.raises(ValueError, match="plan"):
        experts.routed_experts(p, x, ids, w, cfg, plan="some")
    with pytest.raises(ValueError, match="n_slots"):
        experts.routed_experts(p, x, ids, w, cfg, n_slots=0)
    with pytest.raises(ValueError, match="expert_format='fp8'"):  # weights not in that format
        experts.routed_experts(p, x, ids, w, mini("fp8"))
    with pytest.raises(ValueError, match="expert_format"):
        quant.decode(p["experts"]["w1"][0], "nf4")
    with pytest.raises(ValueError, match="top_k"):
        experts.moe_ffn(p, x, _top_k_too_large(cfg))


def _unsupported(cfg):
    """A config object whose expert_format is unsupported (ModelConfig itself refuses to exist
    with one, so bypass its validation to reach the kernel's own check)."""
    bad = cfg.replace()
    object.__setattr__(bad, "expert_format", "int4")
    return bad


def _top_k_too_large(cfg):
    bad = cfg.replace()
    object.__setattr__(bad, "top_k", cfg.n_experts + 1)
    return bad


# ---- compiling for TPUs -------------------------------------------------------------------------
def layer_shapes(cfg, kind="moe"):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype),
                        weights.param_shapes(cfg)[kind])


@pytest.mark.parametrize("chip", list(CHIPS))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.slow
def test_compiles_for_every_chip_mini(fmt, chip):
    """The whole MoE layer in every format for every chip: MXFP4 decodes by the chip's path
    (compile_for tells the wrapper which chip), FP8 e4m3 values lower everywhere."""
    cfg = mini(fmt)
    x = jax.ShapeDtypeStruct((8, cfg.d_model), jnp.bfloat16)
    result = tpu.compile_for(lambda p, x: experts.moe_ffn(p, x, cfg), layer_shapes(cfg), x,
                             chip=chip)
    print(f"{fmt} on {chip}: {result}")
    assert result.n_mosaic_kernels == 1


@pytest.mark.parametrize("name, fmt", [
    ("kimi-k3-mini", "fp8"), ("kimi-k3-mini", "mxfp4"),
    pytest.param("kimi-k3-rank", "mxfp4", marks=pytest.mark.exhaustive)])  # ~6 s
@pytest.mark.slow
def test_fp8_mxu_compiles_for_tpu7x(name, fmt):
    """expert_mxu="fp8" lowers for TPU7x (a bf16 x e4m3 dot over the block-diagonal rows), at mini
    shapes and at Kimi K3's per-rank shapes, B = 8: one Mosaic kernel."""
    cfg = get_config(name, expert_format=fmt, expert_mxu="fp8")
    x = jax.ShapeDtypeStruct((8, cfg.d_model), jnp.bfloat16)
    result = tpu.compile_for(lambda p, x: experts.moe_ffn(p, x, cfg), layer_shapes(cfg), x)
    print(f"{name} {fmt} expert_mxu=fp8: {result}")
    assert result.n_mosaic_kernels == 1


@pytest.mark.parametrize("name, overrides, batch", [
    ("kimi-k3-mini", WIDE_HIDDEN, WIDE_BATCH),
    pytest.param("kimi-k3-rank", {}, 16, marks=pytest.mark.exhaustive)])
@pytest.mark.slow
def test_fp8_mxu_smaller_chunk_compiles_for_tpu7x(name, overrides, batch):
    """The fp8 MXU path's K chunks of 256 lower for TPU7x: the wide mini at B = 12 (W2 in chunks
    of 256, not 1024) and Kimi K3's per-rank shapes at B = 16 (W2's K = 768 in chunks of 256):
    one Mosaic kernel."""
    cfg = get_config(name, expert_mxu="fp8", **overrides)
    assert formats.mxu_k_chunk(cfg.expert_format, cfg.expert_hidden) < formats.k_chunk(
        cfg.expert_format, cfg.expert_hidden)
    x = jax.ShapeDtypeStruct((batch, cfg.d_model), jnp.bfloat16)
    result = tpu.compile_for(lambda p, x: experts.moe_ffn(p, x, cfg), layer_shapes(cfg), x)
    print(f"{name} {overrides} B={batch} expert_mxu=fp8: {result}")
    assert result.n_mosaic_kernels == 1


@pytest.mark.slow
def test_compiles_for_tpu7x_full_rank():
    """Kimi K3 per-rank shapes (112 local experts, a 768-wide slice of the expert hidden), MXFP4
    as in the checkpoint: the dense layer 0, B = 8, one Mosaic kernel. The whole MoE layer at
    these shapes compiles once, in tests/test_costs.py (one kernel, its declared bytes)."""
    cfg = get_config("kimi-k3-rank")
    assert (cfg.n_experts, cfg.expert_hidden, cfg.expert_format) == (112, 768, "mxfp4")
    x = jax.ShapeDtypeStruct((8, cfg.d_model), jnp.bfloat16)
    dense = tpu.compile_for(lambda p, x: experts.dense_ffn(p, x, cfg),
                            layer_shapes(cfg, "dense"), x)
    assert dense.n_mosaic_kernels == 1
