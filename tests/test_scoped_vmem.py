"""A stage kind's scoped VMEM is its body's: the VMEM plan reads the `run_scoped` allocations of
the body traced on shapes (`kernels/compose/scoped_vmem.py`); no kind lists them a second time."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, registry
from mkresearch.kernels.compose import megakernel_plan, scoped_vmem

from mkresearch.model.config import get_config


def _kernel_jaxpr(body):
    """The program of a pallas_call whose kernel is body(x_ref, o_ref), x and o [8, 128] f32."""
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    closed = jax.make_jaxpr(pl.pallas_call(body, out_shape=x))(x)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "pallas_call"]
    return eqn.params["jaxpr"]


def test_nested_scopes_add_up_and_siblings_do_not():
    """The peak is the heaviest chain of nested scopes: a sibling scope is freed before the next
    starts, SMEM and semaphores are not VMEM."""
    def body(x_ref, o_ref):
        def outer(big, sem):
            def inner(small):
                small[...] = x_ref[...]
                big[0] = small[...]
            pl.run_scoped(inner, pltpu.VMEM((8, 128), jnp.float32))
            o_ref[...] = big[0]

        def sibling(other, ids):
            other[0] = x_ref[...]

        pl.run_scoped(outer, pltpu.VMEM((4, 8, 128), jnp.float32), pltpu.SemaphoreType.DMA((2,)))
        pl.run_scoped(sibling, pltpu.VMEM((2, 8, 128), jnp.float32), pltpu.SMEM((4,), jnp.int32))

    nbytes, buffers = scoped_vmem.peak(_kernel_jaxpr(body))
    assert buffers == (("test_scoped_vmem.body: big", (4, 8, 128), "float32"),
                       ("test_scoped_vmem.outer: small", (8, 128), "float32"))
    assert nbytes == 5 * 8 * 128 * 4


@pytest.mark.parametrize("model", ["kimi-k3-mini", "deepseek-v3-mini", "glm-4.5-mini",
                                   "kimi-linear-48b-a3b"])
def test_each_kinds_vmem_scope_is_its_bodys_allocations(model):
    """Every kind of the model: its scope of the VMEM plan is what its body allocates at its peak
    (the kind registers no list), the same at any ring depth (the ring is kernel-wide)."""
    cfg = get_config(model)
    plan = megakernel_plan.make_plan(cfg, 2, cfg.max_seq_len, check_fits=False)
    assert not hasattr(registry.KernelStage, "vmem")
    for kind, stage_plan in plan.stage_plans:
        scope = registry.kernel_stage(kind).scope(stage_plan)
        ring = plan.stream.ring_names(kind)
        planned = tuple((b.name, b.shape, b.dtype) for b in plan.vmem.buffers if b.scope == scope)
        traced = scoped_vmem.peak(scoped_vmem.trace_body(kind, stage_plan, cfg, 2, plan.seq_len,
                                                         ring))[1]
        assert planned == traced
        deeper = cfg.replace(ring_depth=3)
        assert scoped_vmem.peak(scoped_vmem.trace_body(kind, stage_plan, deeper, 2, plan.seq_len,
                                                       ring))[1] == traced
        assert plan.vmem.stage_bytes(scope) == sum(blocks.nbytes(shape, dtype)
                                                   for _, shape, dtype in traced)


def test_sibling_buffers_are_not_counted_together():
    """GQA attends through K/V tile rings, then writes the new entry through update blocks: two
    sibling scopes, so the plan counts the tiles (the larger) and not the blocks; a matrix off the
    global ring streams through a local ring of its own before the attention, not beside it."""
    cfg = get_config("glm-4.5-mini")
    plan = megakernel_plan.make_plan(cfg, 1, cfg.max_seq_len, check_fits=False)
    names = [b.name for b in plan.vmem.buffers if b.scope == "GQA"]
    assert names == ["gqa.gqa_attention_body: q_scratch", "gqa.gqa_attention_body: k_scratch",
                     "gqa._attend: k_buffers", "gqa._attend: v_buffers"]
