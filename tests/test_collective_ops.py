"""The step's collectives as data (`kernels/sharded/collective_ops.py`, from the sharding plan,
`kernels/sharded/plan.py`): every collective of one rank's step, for the exact mode the kernel
builds and the partial-sum mode, from shapes alone, for every preset (minis on 8 ranks, full
size on 32)."""

import pytest
from mkresearch.kernels.base import registry
from mkresearch.kernels.compose import megakernel_plan  # noqa: F401 - registers the stage kinds
from mkresearch.kernels.sharded import collective_ops as cs
from mkresearch.kernels.sharded import plan as sharding

from mkresearch.model.config import get_config
from mkresearch.sharding import layout

FAMILIES = ("kimi-k3", "deepseek-v3", "glm-4.5", "qwen3-235b-a22b")
CASES = [(f"{m}-mini", 8) for m in FAMILIES] + [(m, 32) for m in FAMILIES]


def _layout(model, n):
    return layout.layout(get_config(model), n, layout.OURS)


def ops_of(lay, batch, mode="partial-sum", wire="f32", **fields):
    """Rank `fields['rank']`'s ops of the layout's model in `mode`, every reduction one-shot."""
    moded = layout.layout(lay.cfg, lay.n_ranks, lay.name, collectives=mode)
    return cs.collective_ops(sharding.sharding_plan(moded, batch, wire, chip=None), **fields)


@pytest.mark.parametrize("model, n_ranks", CASES)
def test_every_preset_both_modes(model, n_ranks):
    """Each op is well formed (its kind, a group holding the rank, bytes, a wire dtype), layers in
    order; partial-sum: no chain, at most 3 reductions per layer (attention, routed, shared),
    fewer collectives than exact; each mode's matrices are the kernel's own rules."""
    lay = _layout(model, n_ranks)
    counts = {}
    for mode in cs.MODES:
        for batch in (1, 3):
            for rank in (0, n_ranks - 1):
                ops = ops_of(lay, batch, mode, rank=rank)
                assert [op.layer for op in ops] == sorted(op.layer for op in ops)
                for op in ops:
                    assert op.kind in cs.KINDS and rank in op.group and op.payload_bytes > 0
                    assert op.dtype in sharding.WIRES and op.count >= 1
                    assert set(op.summed) <= set(op.group)
                counts[mode] = cs.summary(ops)
    part = ops_of(lay, 1, "partial-sum")
    assert not [op for op in part if op.kind == "chain"]
    assert counts["partial-sum"]["reductions_critical_max"] <= 3
    assert counts["partial-sum"]["collectives"] < counts["exact"]["collectives"]
    for mode in cs.MODES:
        ops = ops_of(lay, 1, mode)
        rules = sharding.collective_rules(layout.layout(lay.cfg, n_ranks, collectives=mode))
        served = {op.matrix for op in ops if op.matrix} | {m for op in ops for m in op.carries}
        assert served == {r.name for r in rules}
    print(f"{model} on {n_ranks}: exact {counts['exact']}, partial-sum {counts['partial-sum']}")


def test_full_kimi_k3_partial_sum_counts():
    """Kimi K3 on 32 ranks, partial-sum: per layer the attention's W_o partials reduced (MLA's
    W_qa and W_kva chunks gathered first, in one all-gather); per MoE layer the router's and
    W_ld's chunks gathered in one all-gather before top-k, the experts' latent partials reduced
    (no chain, no expert hidden gathered), the shared expert's W_down partials reduced with
    W_lu's chunks in the same messages (no gather of their own): 3 reductions per MoE layer.
    396 collectives per rank and step (512 before the two fused gathers)."""
    cfg = get_config("kimi-k3")
    lay = _layout("kimi-k3", 32)
    ops = ops_of(lay, 1)
    moe = [op.name for op in ops if op.stage == "moe" and op.layer == cfg.moe_layers[0]]
    assert moe == ["router/w_router+latent/w_ld", "expert/sum", "shared/w_down/sum"]
    fused = next(op for op in ops if op.name == "router/w_router+latent/w_ld")
    assert fused.carries == ("router/w_router",) and fused.wait_before == cs.EXPERTS
    assert next(op.carries for op in ops if op.name == "shared/w_down/sum") == ("latent/w_lu",)
    attention = [op.name for op in ops if op.layer == cfg.mla_layers[0] and op.stage == "mla"]
    assert attention == ["mla.w_qa+mla.w_kva", "mla.w_o/sum"]
    expected = 2 + len(cfg.layers) + len(cfg.dense_layers) + len(cfg.mla_layers) \
        + 3 * len(cfg.moe_layers)
    summary = cs.summary(ops)
    exact = cs.summary(ops_of(lay, 1, "exact", expert_counts=(2,) * 92))
    print(f"kimi-k3 on 32 ranks: partial-sum {summary}; exact (2 experts per group and layer) "
          f"{exact}")
    assert summary["collectives"] == expected == 396
    assert summary["reductions_critical_max"] == 3


@pytest.mark.parametrize("mode", cs.MODES)
def test_where_the_moe_reductions_are_waited(mode):
    """Kimi K3 streams its shared experts before W_lu (`ffn_kinds._moe_streamed`). Restructured:
    ρ's reduce-scatter is issued after the routed experts and waited for before W_lu, so the
    shared experts run while it flies; the other modes' reduction of the experts is waited for
    right after it. The shared experts' reduction, carrying W_lu's chunks or partial products,
    is issued after W_lu, at the stage's end."""
    cfg = get_config("kimi-k3")
    ops = ops_of(_layout("kimi-k3", 32), 1, mode)
    names = [m.name for m in registry.kernel_stage("moe").streamed(cfg)]
    assert names.index("latent/w_lu") == len(names) - 1
    layer = [op for op in ops if op.stage == "moe" and op.layer == cfg.moe_layers[0]]
    routed = next(op for op in layer if op.name in ("expert/sum", "expert/chain"))
    assert routed.issue_after in (cs.EXPERTS, "the group's experts")
    if mode == layout.RESTRUCTURED:
        assert routed.kind == "reduce-scatter" and routed.wait_before == "latent/w_lu"
    else:
        assert routed.wait_before in (names[names.index("latent/w_ld") + 1], sharding.EXPERT_SUM)
    shared = [op for op in layer if op.name == "shared/w_down/sum"]
    if mode != "exact":
        assert [(op.issue_after, op.wait_before) for op in shared] == [("latent/w_lu", "moe end")]
        assert layer[-1] is shared[0]  # issued last


def test_wire_and_expert_counts():
    """bf16 on the wire halves every all-reduced partial sum's bytes (gathers move values, the
    embedding's all-reduce adds zeros to one row, chunks riding with a reduction are values: f32
    both ways; restructured's reduce-scatter halves too, its chunks sent as bf16);
    the exact mode's expert hidden gathers run once per expert the group computes."""
    lay = layout.layout(get_config("kimi-k3"), 32, layout.OURS)
    f32, bf16 = (ops_of(lay, 2, wire=w) for w in sharding.WIRES)
    for a, b in zip(f32, bf16, strict=True):
        halved = a.role == "sum"
        riders = 2 * 4 * 256 * len(a.carries)  # B = 2, f32, W_lu's chunk of 7168 / 32 -> 256
        assert (b.payload_bytes - riders) * (2 if halved else 1) == a.payload_bytes - riders
        assert b.dtype == ("bf16" if halved else "f32")
    f32, bf16 = (ops_of(lay, 2, layout.RESTRUCTURED, wire=w) for w in sharding.WIRES)
    scatters = [(a, b) for a, b in zip(f32, bf16, strict=True) if a.kind == "reduce-scatter"]
    assert scatters and {(a.payload_bytes, b.payload_bytes, b.dtype) for a, b in scatters} == {
        (2 * 128 * 4, 2 * 128 * 2, "bf16")}
    n_moe = len(lay.cfg.moe_layers)
    ops = ops_of(lay, 1, "exact", expert_counts=(3,) * n_moe)
    hidden = [op for op in ops if op.name == "expert/h"]
    assert len(hidden) == n_moe and {op.count for op in hidden} == {3}


@pytest.mark.parametrize("kwargs, field", [({"mode": "ring"}, "collectives"),
                                          ({"wire": "fp8"}, "wire"),
                                          ({"batch": 0}, "batch"), ({"rank": 8}, "rank")])
def test_bad_arguments(kwargs, field):
    args = {"lay": _layout("kimi-k3-mini", 8), "batch": 1, **kwargs}
    with pytest.raises(ValueError, match=field):
        ops_of(**args)
