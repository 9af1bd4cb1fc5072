"""How the sharded megakernel sends its partial-sum reductions (`kernels/sharded/levels.py`): the
one order every algorithm adds in, the options that choose the algorithms, and the sharding plan
the CLI, the recorded compiles and the prediction share (`kernels/sharded/plan.py`: one list of
reductions, each with the algorithm the interconnect model chooses, passed to the kernel).
The kernel itself runs in tests/sharded/test_partial_sum.py (8 simulated devices)."""

import jax.numpy as jnp
import pytest
from mkresearch.kernels.compose import megakernel_sharded as ms
from mkresearch.kernels.compose.megakernel_plan import MegakernelOptions
from mkresearch.kernels.sharded import collective_ops as step_collectives
from mkresearch.kernels.sharded import plan as sharding

from mkresearch.cli import main as cli
from mkresearch.hardware import interconnect as links
from mkresearch.model import numerics
from mkresearch.model.config import get_config
from mkresearch.prediction import scale_out
from mkresearch.sharding import layout as layouts


def test_host_ordered_sum_adds_each_host_first():
    """A host's parts in order, then the hosts' sums: not the running sum of all parts (which
    one host gives), as float adds show."""
    parts = [jnp.float32(v) for v in (1e8, 1.0, -1e8, 1.0)]
    flat = numerics.host_ordered_sum(parts)
    by_two = numerics.host_ordered_sum(parts, (0, 0, 1, 1))
    assert float(flat) == 1.0  # ((1e8 + 1) - 1e8) + 1 in f32: 1e8 + 1 rounds to 1e8
    assert float(by_two) == 0.0  # (1e8 + 1) + (-1e8 + 1) in f32: each rounds to +-1e8
    assert float(numerics.host_ordered_sum(parts, (3, 3, 3, 3))) == float(flat)
    with pytest.raises(ValueError, match=r"hosts=\(0, 1\) is invalid: one host per part \(4\)"):
        numerics.host_ordered_sum(parts, (0, 1))


def test_bf16_wire_rounds_each_hosts_sum_and_the_total():
    """With a bf16 wire a host's sum is rounded before the hosts' sums are added, and the total
    after: the values a reduction in levels sends (`kernels/sharded/levels.py`), so one-shot and
    levels give the same bits. 1 + 2^-8 is no bf16 value (1 + 2^-7 is)."""
    tiny = 2.0 ** -8
    parts = [jnp.float32(v) for v in (1.0, tiny, tiny)]
    assert float(numerics.host_ordered_sum(parts, (0, 0, 0), "bf16")) == 1.0 + 2 * tiny
    assert float(numerics.host_ordered_sum(parts, (0, 0, 1), "bf16")) == 1.0  # (1 + 2^-8) -> 1
    assert float(numerics.host_ordered_sum(parts, (0, 0, 1))) == 1.0 + 2 * tiny
    assert float(numerics.host_ordered_sum(parts[:2], (0, 1), "bf16")) == 1.0
    assert float(numerics.reduce_partials([jnp.float32(1.0), jnp.float32(tiny)], (0, 0),
                                          "bf16")) == 1.0


def _mini(n=8):
    return layouts.layout(get_config("kimi-k3-mini"), n, collectives="partial-sum")


def test_options_name_the_bad_value():
    lay = _mini()
    with pytest.raises(ValueError, match=r"reductions=.* is invalid: a tuple of \(reduction "
                                         r"name, algorithm\) pairs, the algorithm one of "
                                         r"\('one-shot', 'two-level', 'rs-ag'\)"):
        ms.make_sharded_plan(lay, 1, options=MegakernelOptions(reductions=(("expert/sum",
                                                                             "ring"),)))
    with pytest.raises(ValueError, match=r"\['w_o/sum'\] are not reductions of this step \(those "
                                         r"are \['dense/w_down/sum', 'expert/sum', "):
        ms.make_sharded_plan(lay, 1, options=MegakernelOptions(reductions=(("w_o/sum",
                                                                             "rs-ag"),)))
    with pytest.raises(ValueError, match=r"ranks_per_host=3 is invalid for 8 ranks: 0 or an int "
                                         "that divides the rank count"):
        ms.make_sharded_plan(lay, 1, options=MegakernelOptions(ranks_per_host=3))
    with pytest.raises(ValueError, match=r"ranks_per_host=-1 is invalid: 0 \(every rank one "
                                         r"host\) or an int >= 1"):
        ms.make_sharded_plan(lay, 1, options=MegakernelOptions(ranks_per_host=-1))


def test_level_buffers_are_planned_only_for_reductions_in_levels():
    """One-shot reductions need the whole partial from every rank in the channel's inbox; in
    levels they need the level buffers instead (less VMEM on 32 ranks: a deeper ring)."""
    lay = _mini()
    flat = ms.make_sharded_plan(lay, 1)
    assert flat.shard.levels is None and flat.shard.algorithms == ()
    levels = ms.make_sharded_plan(lay, 1, options=MegakernelOptions(
        reductions=(("expert/sum", "two-level"), ("shared/w_down/sum", "rs-ag"),
                    ("kda.w_o/sum", "one-shot")), ranks_per_host=4))
    assert levels.shard.algorithms == (("expert/sum", "two-level"), ("shared/w_down/sum", "rs-ag"))
    assert levels.shard.algorithm("kda.w_o/sum") == "one-shot"
    assert (levels.shard.levels.host_size, levels.shard.levels.hosts) == (4, 2)
    assert any(name.startswith("collectives levels: ") for name, *_ in
               levels.shard.vmem_buffers())


@pytest.mark.slow  # ~12 s: the full-size sharding plan at B = 1 and 8, plan's listing
def test_the_kernel_the_cli_and_the_prediction_send_reductions_one_way(capsys):
    """kimi-k3 on 32 TPU7x cores: each reduction of the sharding plan as `choose` prices fastest
    on the slice (hosts of 8 cores); the kernel's options, the ops, the prediction's schedule
    and `plan`'s listing all carry that choice."""
    cfg = get_config("kimi-k3")
    lay = layouts.layout(cfg, 32, collectives="partial-sum")
    inter = links.interconnect("tpu7x", n_ranks=32)
    for batch in (1, 8):
        plan = sharding.sharding_plan(lay, batch)
        assert plan.ranks_per_host == 8
        options = ms.kernel_options(lay, batch)
        assert (options.reductions, options.ranks_per_host) == (plan.algorithms, 8)
        sums = {op.name: op for op in step_collectives.collective_ops(plan) if op.role == "sum"}
        for r in plan.reductions:
            best = links.choose(inter, "all-reduce", sums[r.name].group,
                                sums[r.name].payload_bytes).algorithm
            assert sums[r.name].algorithm == r.algorithm == best, r.name
        row = scale_out.predict(cfg, 32, "ours", batch)
        assert row["schedule"]["reductions"] == plan.algorithms
        assert row["schedule"]["ranks_per_host"] == 8
    b1 = dict(sharding.sharding_plan(lay, 1).algorithms)
    print(f"kimi-k3 on 32 ranks, B = 1: {b1}")
    assert b1["expert/sum"] == "two-level" and b1["shared/w_down/sum"] == "rs-ag"
    assert sharding.sharding_plan(layouts.layout(cfg, 32, collectives="exact"), 1).algorithms \
        == ()
    assert cli.main(["plan", "kimi-k3", "--ranks", "32"]) == 0
    out = capsys.readouterr().out
    assert ("reductions in levels over hosts of 8 ranks: dense/w_down/sum rs-ag, expert/sum "
            "two-level, kda.w_o/sum rs-ag") in out
    assert " expert/sum                         all-reduce all 32              14336  1 two-level" \
        in out


def test_restructured_w_lu_rides_the_reduction_its_parameter_names():
    """W_lu's partial sums travel beside the reduction `Param.beside` names (the shared experts'
    W_down), which the sharded reference reads too; a latent MoE without it is refused by name."""
    cfg = get_config("kimi-k3-mini")
    lay = layouts.layout(cfg, 8, layouts.OURS, collectives=layouts.RESTRUCTURED)
    beside = {r.name: r.beside for r in sharding.collective_rules(lay) if r.beside}
    assert beside == {"latent/w_lu": sharding.SHARED_DOWN}
    alone = layouts.layout(cfg.replace(n_shared_experts=0), 8, layouts.OURS,
                           collectives=layouts.RESTRUCTURED)
    with pytest.raises(ValueError, match="latent/w_lu has no reduction of w_sd"):
        sharding.collective_rules(alone)
