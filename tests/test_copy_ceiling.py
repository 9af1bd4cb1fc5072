"""The copy ceiling (kernels/base/copy_stream.py, kernels/compose/copy_ceiling.py): a kernel that
only moves blocks between HBM and VMEM moves exactly the given blocks, in order, with no race;
for a megakernel step, exactly the HBM DMAs its schedule lists; and it compiles with Mosaic for
the v5e."""

import os

import pytest
from cuts import kimi_kinds
from mkresearch.kernels.base import copy_stream, dma, dry_run
from mkresearch.kernels.compose.copy_ceiling import blocks_of, copy_kernel_for
from mkresearch.kernels.compose.megakernel_plan import make_plan
from mkresearch.kernels.compose.schedule import schedule

from mkresearch.hardware import tpu
from mkresearch.model.config import get_config

# libtpu allows one process at a time by default; tests on a shared machine compile concurrently
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

MINIS = ("kimi-k3-mini", "deepseek-v3-mini", "glm-4.5-mini", "qwen3-235b-a22b-mini")
Block = copy_stream.Block
# every way a block moves: whole tiles (the shared ring, of several sizes), other blocks in their
# own shape (a norm row, a bias, a narrow matrix, a 3-D block), both directions, classes that
# come back after others
MIXED = (Block((512, 256), "bfloat16"), Block((1, 512), "float32"),
         Block((2, 16, 128), "bfloat16", write=True), Block((8, 256), "uint8"),
         Block((32, 256), "uint32"), Block((8, 256), "uint8"), Block((1, 2), "float32"),
         Block((3, 4, 256), "bfloat16"), Block((512, 2), "bfloat16"),
         Block((8, 2, 128, 128), "float32"), Block((8, 2, 128, 128), "float32", write=True),
         Block((512, 256), "bfloat16"), Block((1, 512), "float32"))


def _moved(events) -> list[tuple]:
    """(bytes, source space, destination space) of each DMA started, in order."""
    return [(e.nbytes, e.src, e.dst) for e in events if e.kind == "dma_start"]


def _listed(blocks) -> list[tuple]:
    return [(b.nbytes, "vmem" if b.write else "hbm", "hbm" if b.write else "vmem")
            for b in blocks]


@pytest.mark.parametrize("depth", [2, 3])
def test_the_copy_moves_each_block_once_in_order(race_checked, depth):
    kernel = copy_stream.copy_kernel(MIXED, depth)
    with dma.recording() as log:
        *written, count = kernel.fn(*kernel.args)
    assert _moved(log.events) == _listed(MIXED)
    assert int(count[0]) == len(MIXED)
    assert [w.shape for w in written] == [(1, 16, 128), (1, 2048, 128)]
    assert kernel.read_bytes + kernel.written_bytes == sum(b.nbytes for b in MIXED)
    # DMAs in flight: at most depth at any time, each waited for in the order it was started
    in_flight, most = 0, 0
    for event in log.events:
        in_flight += 1 if event.kind == "dma_start" else -1
        most = max(most, in_flight)
    assert most == depth


@pytest.mark.tpu
def test_the_copy_runs_every_block():
    """Compiled on a TPU (interpreted elsewhere): every DMA issued and waited for, the written
    blocks' arrays returned."""
    kernel = copy_stream.copy_kernel(MIXED, 3)
    *written, count = kernel.fn(*kernel.args)
    assert int(count[0]) == len(MIXED)
    assert [w.shape for w in written] == [(1, 16, 128), (1, 2048, 128)]


@pytest.mark.slow
def test_a_steps_copy_moves_the_bytes_its_schedule_lists(race_checked):
    """Kimi K3's two kinds of layer at B = 1: every HBM DMA of the schedule, its bytes and
    direction, in order (the whole minis: the next test, on shapes)."""
    cfg = kimi_kinds(get_config("kimi-k3-mini"))
    sched = schedule(make_plan(cfg, 1, cfg.max_seq_len))
    kernel = copy_kernel_for(sched)
    with dma.recording() as log:
        kernel.fn(*kernel.args)
    assert _moved(log.events) == [(d.nbytes, d.src, d.dst) for d in sched.starts if d.hbm]
    assert kernel.nbytes == sched.total.read + sched.total.written


@pytest.mark.parametrize("name", MINIS)
def test_the_copy_of_each_minis_step_plans_its_schedules_dmas(name):
    """The copy kernel run on shapes (its dry run, as the schedule is made): its DMAs are the
    B = 8 step's HBM DMAs, bytes and direction in order, block shapes as the schedule lists them."""
    cfg = get_config(name)
    sched = schedule(make_plan(cfg, 8, cfg.max_seq_len))
    kernel = copy_kernel_for(sched, allocate=False)
    planned = dry_run.run(dry_run.trace_kernel(kernel.fn, *kernel.arg_shapes),
                          {0: kernel.layout.order_array()})
    assert _moved(planned) == [(d.nbytes, d.src, d.dst) for d in sched.starts if d.hbm]
    assert [b.shape for b in kernel.blocks] == [d.shape for d in sched.starts if d.hbm]
    assert kernel.layout.depth == cfg.ring_depth


@pytest.mark.exhaustive
@pytest.mark.parametrize("name", MINIS)
def test_each_minis_copy_runs_its_schedule_without_a_race(race_checked, name):
    """The whole mini's B = 8 step run in interpret mode (about 3 minutes each here)."""
    cfg = get_config(name)
    sched = schedule(make_plan(cfg, 8, cfg.max_seq_len))
    kernel = copy_kernel_for(sched)
    with dma.recording() as log:
        kernel.fn(*kernel.args)
    assert _moved(log.events) == [(d.nbytes, d.src, d.dst) for d in sched.starts if d.hbm]


@pytest.mark.slow
def test_the_copy_compiles_for_the_v5e():
    """Mosaic for the v5e (libtpu, no TPU): a mini's step, every kind of block, and a stream of
    64 MiB; the cost each declares is its bytes."""
    cfg = get_config("kimi-k3-mini")
    for kernel in (copy_kernel_for(make_plan(cfg, 8, cfg.max_seq_len), allocate=False),
                   copy_stream.copy_kernel(MIXED, 3, allocate=False),
                   copy_stream.stream(64 << 20, 256 << 10, 4, allocate=False)):
        result = tpu.compile_for(kernel.fn, *kernel.arg_shapes, chip="v5e")
        print(f"{len(kernel.blocks)} DMAs, {kernel.nbytes} bytes: {result}")
        assert result.n_mosaic_kernels == 1
        assert result.mosaic_cost["bytes_accessed"] == kernel.nbytes


def test_stream_cuts_the_bytes_into_blocks():
    kernel = copy_stream.stream(10 * 4096, 4 * 4096, allocate=False)
    assert [b.nbytes for b in kernel.blocks] == [16384, 16384, 8192]
    assert [s.shape for s in kernel.arg_shapes] == [(2, 32, 128), (1, 16, 128)]
    assert kernel.layout.vmem_bytes == 3 * 16384


def test_blocks_of_a_schedule_are_its_hbm_dmas():
    cfg = get_config("qwen3-235b-a22b-mini")
    sched = schedule(make_plan(cfg, 2, cfg.max_seq_len))
    blocks = blocks_of(sched)
    hbm = [d for d in sched.starts if d.hbm]
    assert len(blocks) == len(hbm) < len(sched.starts)  # the routing's VMEM -> SMEM copies: out
    assert [b.write for b in blocks] == [d.written for d in hbm]
    assert sum(b.nbytes for b in blocks) == sched.total.read + sched.total.written


@pytest.mark.parametrize("call,message", [
    (lambda: copy_stream.copy_kernel(MIXED, 1), "depth=1 is invalid"),
    (lambda: copy_stream.copy_kernel([], 2), "blocks=() is invalid"),
    (lambda: copy_stream.Block((0, 128), "bfloat16"), "Block.shape=(0, 128) is invalid"),
    (lambda: copy_stream.Block((8, 128), "bfloat17"), "Block.dtype='bfloat17' is invalid"),
    (lambda: copy_stream.stream(1000, 4096), "nbytes=1000 is invalid"),
    (lambda: copy_stream.stream(8192, 0), "block_bytes=0 is invalid"),
    (lambda: copy_kernel_for("kimi-k3-mini"), "plan='kimi-k3-mini' is invalid"),
    (lambda: copy_stream.copy_kernel([Block((2048, 2048), "float32")], 16, allocate=False,
                                     chip="v5e"), "depth=16 is invalid for these blocks on v5e"),
])
def test_bad_input_is_one_line_naming_it(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        call()
