"""The prediction reads the kernel's collective schedule (`scale_out_contract`), each collective
priced by the algorithm `collective_choice` picks for it, and says why."""

import pytest
from mkresearch.kernels import collective_schedule as cs

from mkresearch import collective_choice as choice
from mkresearch import interconnect as links
from mkresearch import layout as layouts
from mkresearch import scale_out
from mkresearch.config import get_config

US = 1e-6


@pytest.fixture(scope="module")
def inter():
    return links.interconnect("tpu7x", n_ranks=32)


@pytest.mark.parametrize("kind, group, nbytes, algorithm, why", [
    # a few hundred bytes over 4 hosts: one phase beats two
    ("all-reduce", tuple(range(32)), 1024, "one-shot", "latency"),
    # B = 1's hidden vector in bf16 over 4 hosts: 31 messages per core cost more than a phase
    ("all-reduce", tuple(range(32)), 7168 * 2, "two-level", "injection"),
    # B = 8's in f32: each message a 1/n piece
    ("all-reduce", tuple(range(32)), 8 * 7168 * 4, "rs-ag", "large payload"),
    # an all-gather has nothing to scatter: one phase, whatever the size
    ("all-gather", tuple(range(32)), 8 * 7168 * 4, "one-shot", "latency"),
    # inside one host, two-level is one-shot: the tie goes to one-shot
    ("all-reduce", tuple(range(8)), 7168 * 2, "one-shot", "one host"),
    ("all_gather", (0, 1), 4096, "one-shot", "one host"),
    ("chain", (0, 4, 8), 4096, "chain", "serial"),
])
def test_each_algorithm_is_chosen_where_the_model_says(inter, kind, group, nbytes, algorithm,
                                                       why):
    c = choice.choose(inter, kind, group, nbytes)
    print(f"{kind} over {len(group)} ranks, {nbytes} B: {c.reason}")
    assert c.algorithm == algorithm and why in c.reason
    # the choice is the cheapest candidate, priced by interconnect.price
    assert c.seconds == min(s for _, s in c.candidates)
    if kind != "chain":
        assert c.seconds == pytest.approx(links.price(
            inter, choice.KIND_ALIASES.get(kind, kind), algorithm, group, nbytes).seconds)


def test_bad_kind_is_refused(inter):
    with pytest.raises(ValueError, match="kind"):
        choice.choose(inter, "broadcast", (0, 1), 8)


@pytest.mark.parametrize("mode", cs.MODES)
def test_the_program_is_the_kernels_collective_schedule(mode):
    """Rank 0's program starts exactly the contract's collectives, in its order, over its groups
    (an op run `count` times started that often); the prediction counts them."""
    cfg = get_config("kimi-k3")
    lay = layouts.layout(cfg, 32)
    _, programs = scale_out.rank_programs(cfg, 32, "ours", 1,
                                          schedule=scale_out.our_schedule(cfg, mode))
    started = [(op[1].split("#")[0], op[4]) for op in programs[0] if op[0] == "start"]
    counts = tuple(int(c) for c in scale_out.routed_experts(cfg, lay, 1)[:, 0])
    ops = cs.collective_schedule(lay, 1, mode, rank=0, expert_counts=counts)
    assert started == [(op.name, op.group) for op in ops for _ in range(op.count)]
    p = scale_out.predict(cfg, 32, "ours", 1, collectives=mode)
    assert p["collectives_per_rank"] == len(started)


def test_kimi_k3_partial_sum_beats_the_release_at_every_batch():
    """Partial sums: fewer collectives than the exact mode, every batch below the release's
    published step, as the model stands (the parts sum to the step)."""
    cfg = get_config("kimi-k3")
    for batch in (1, 2, 4, 8):
        part = scale_out.predict(cfg, 32, "ours", batch)
        exact = scale_out.predict(cfg, 32, "ours", batch, collectives="exact")
        print(f"B={batch}: partial-sum {part['step_s'] * 1e3:.2f} ms "
              f"({part['collectives_per_rank']} collectives), exact {exact['step_s'] * 1e3:.2f} "
              f"ms ({exact['collectives_per_rank']}), published "
              f"{part['published_step_s'] * 1e3:.2f} ms")
        assert part["algorithm"] == "auto" and part["schedule"]["collectives"] == "partial-sum"
        assert part["step_s"] < part["published_step_s"] < exact["step_s"]
        assert part["collectives_per_rank"] < exact["collectives_per_rank"] / 2
        assert sum(part["parts_s"].values()) == pytest.approx(part["step_s"], rel=1e-9)
    b1 = scale_out.predict(cfg, 32, "ours", 1)
    assert 3.0e-3 < b1["step_s"] < 4.0e-3  # the goal (2.5 ms) is not reached: see the issue
