"""The notebook-01 GEMV: every variant against jnp.dot, its DMA log, and its timeline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mkresearch.kernels.base import dma, gemv

from mkresearch.prediction import timeline as tl

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

B, K, N, BLOCK_K = 8, 1024, 256, 256  # 4 row blocks of 128 KiB


@pytest.fixture(scope="module")
def operands():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (B, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (K, N), jnp.float32) / 32).astype(jnp.bfloat16)
    return x, w, jnp.dot(x, w, preferred_element_type=jnp.float32)


def test_blockspec_matches_jnp_dot(race_checked, operands):
    x, w, expected = operands
    with dma.recording() as log:
        y = gemv.gemv_blockspec(x, w, block_k=BLOCK_K)
    assert y.shape == (B, N) and y.dtype == jnp.float32
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    # Pallas issues the block copies itself: the log has one phase per grid step, no DMA
    assert [e.kind for e in log.events] == ["phase_start", "phase_end"] * (K // BLOCK_K)
    pipeline = tl.blockspec_log(log, gemv.blockspec_block_bytes(B, BLOCK_K, N),
                                out_bytes=B * N * 4)
    timeline = tl.simulate(pipeline, "v5e")
    assert timeline.dma_bytes == w.size * 2 + x.size * 2 + B * N * 4


@pytest.mark.parametrize("n_buffers", [1, 2, 3])
def test_stream_matches_jnp_dot_and_logs_every_weight_byte(race_checked, operands, n_buffers):
    x, w, expected = operands
    with dma.recording() as log:
        y = gemv.gemv_stream(x, w, block_k=BLOCK_K, n_buffers=n_buffers)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    n_blocks = K // BLOCK_K
    starts = log.select("dma_start", gemv.WEIGHT_NAME)
    assert [e.indices["k"] for e in starts] == list(range(n_blocks))
    assert [e.slot for e in starts] == [k % n_buffers for k in range(n_blocks)]
    assert log.dma_bytes(gemv.WEIGHT_NAME) == w.size * w.dtype.itemsize
    # the program order of the ring: n_buffers - 1 blocks ahead of the one being computed
    kinds = [e.kind for e in log.events]
    assert kinds == [e.kind for e in tl.stream_log(n_blocks, 1, 1.0, n_buffers)]

    timeline = tl.simulate(log, "tpu7x")
    assert timeline.dma_bytes == w.size * w.dtype.itemsize
    assert timeline.flops == 2 * B * K * N
    assert timeline.peak_vmem_bytes == n_buffers * BLOCK_K * N * 2


def test_more_buffers_never_slow_the_modelled_stream(race_checked, operands):
    x, w, _ = operands
    totals = []
    for n_buffers in (1, 2, 3):
        with dma.recording() as log:
            gemv.gemv_stream(x, w, block_k=BLOCK_K, n_buffers=n_buffers)
        totals.append(tl.simulate(log, "v5e").total_s)
    assert totals[0] > totals[1] >= totals[2]


@pytest.mark.parametrize("kwargs,match", [
    ({"block_k": 100}, "block_k=100"),
    ({"block_k": 384}, "block_k=384"),
    ({"n_buffers": 4}, "n_buffers=4"),
])
def test_bad_arguments_raise_before_tracing(operands, kwargs, match):
    x, w, _ = operands
    with pytest.raises(ValueError, match=match):
        gemv.gemv_stream(x, w, **{"block_k": BLOCK_K, **kwargs})


def test_bad_operands_raise(operands):
    x, w, _ = operands
    with pytest.raises(ValueError, match="bfloat16"):
        gemv.gemv_blockspec(x.astype(jnp.float32), w)
    with pytest.raises(ValueError, match="first dim"):
        gemv.gemv_blockspec(x, w[:512])


@pytest.mark.slow
@pytest.mark.parametrize("n_buffers", [0, 1, 3])
def test_compiles_for_tpu7x(n_buffers):
    """The real Mosaic compiler accepts both kernels (layout, tiling, VMEM); 0 = BlockSpec."""
    from mkresearch.hardware import tpu

    def f(x, w):
        if n_buffers == 0:
            return gemv.gemv_blockspec(x, w, block_k=512)
        return gemv.gemv_stream(x, w, block_k=512, n_buffers=n_buffers)

    result = tpu.compile_for(f, jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16),
                             jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16), chip="tpu7x")
    assert result.n_mosaic_kernels == 1
    # the compiler's cost model reads W (operand 1) exactly once, like the DMA log says
    assert result.cost["bytes accessed1{}"] == 4096 * 1024 * 2
