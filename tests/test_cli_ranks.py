"""`mkresearch decode --ranks N` / `bench --ranks N`: bad input is one line and exit 2 before
anything runs; on CPU with one device the command re-runs itself in a child with N simulated
devices (`mkresearch.cli.ranks`), whose sharded decode equals the single-device megakernel."""

import json
import os
import subprocess
import sys

import pytest

from mkresearch.cli import main as cli
from mkresearch.cli import ranks as cli_ranks
from mkresearch.cli import ranks_reference
from mkresearch.model import weights
from mkresearch.model.config import get_config
from mkresearch.sharding import layout, reference_sharded


@pytest.mark.parametrize("args, reason", [
    (["decode", "--ranks", "3"], ("--ranks 3: n_ranks=3 is invalid for kimi-k3-mini: it must "
                                  "divide n_heads=2")),
    (["decode", "--ranks", "32"], "vocab_size=2048"),
    (["decode", "--ranks", "0"], "--ranks must be an int >= 1, got 0"),
    (["decode", "--ranks", "-1"], "--ranks must be an int >= 1"),
    (["decode", "--backend", "reference", "--ranks", "3"], "--ranks 3: n_ranks=3 is invalid"),
    (["decode", "--backend", "reference", "--ranks", "2", "--speculate", "2"],
     "--speculate runs on one device: --ranks 1"),
    (["decode", "--ranks", "x"], "--ranks"),
    (["bench", "--ranks", "3"], "--ranks 3: n_ranks=3 is invalid"),
    (["bench", "--ranks", "0"], "--ranks must be an int >= 1"),
    (["decode", "--ranks", "2", "--collectives", "bogus"],
     ("--collectives: invalid choice: 'bogus' (choose from 'partial-sum', 'exact', "
      "'restructured')")),
    (["decode", "--ranks", "2", "--router", "bogus"],
     "--router: invalid choice: 'bogus' (choose from 'split', 'host', 'sibling', 'replicated')"),
    (["decode", "--ranks", "8", "--etp", "4"],
     ("--etp 4: etp=4 is invalid for kimi-k3-mini on 8 ranks: a divisor of n_ranks with "
      "n_experts=16 divisible by n_ranks / etp and expert_hidden=256 in ETP slices of whole "
      "128-lane tiles (allowed: [1, 2])")),
    (["decode", "--etp", "2"], "--etp 2 needs --ranks N > 1"),
    (["decode", "--expert-slots", "4"],
     "--expert-slots is an option of the sharded megakernel: give --ranks N > 1"),
    (["decode", "--ranks", "2", "--backend", "reference", "--wire", "bf16"],
     "--wire is an option of the sharded megakernel"),
    (["decode", "--ranks", "2", "--expert-slots", "9"],
     "--expert-slots 9 is invalid: an int in [2, 8]"),
    (["decode", "--ranks", "2", "--collectives", "exact", "--wire", "bf16"],
     "--wire bf16 needs partial sums (--collectives partial-sum or restructured)"),
    (["decode", "--ranks", "2", "--wire", "f16"],
     "--wire: invalid choice: 'f16' (choose from 'f32', 'bf16')"),
])
def test_bad_ranks_are_one_line_exit_2(capsys, args, reason):
    """Checked before any device is asked for or any child started: in this process."""
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and reason in lines[0], captured.err
    assert captured.out == ""


def test_child_xla_flags_replace_an_earlier_device_count():
    assert cli_ranks.child_xla_flags("", 4) == "--xla_force_host_platform_device_count=4"
    flags = "--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=1"
    assert cli_ranks.child_xla_flags(flags, 2) == ("--xla_cpu_max_isa=AVX2 "
                                                   "--xla_force_host_platform_device_count=2")


def test_too_few_devices_in_a_child_is_refused(monkeypatch, capsys):
    """A child that still has too few devices (XLA ignored the flag) refuses: no second child."""
    monkeypatch.setenv(cli_ranks.CHILD_ENV, "1")
    assert cli.main(["decode", "--ranks", "2", "--prompt-len", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ranks 2 needs 2 devices but this cpu backend has 1" in err[0]


@pytest.mark.slow
def test_reference_with_experts_split_2_ways_on_8_ranks_in_a_child_json(capfd, monkeypatch):
    """decode --backend reference --ranks 8 --etp 2 (kimi-k3-mini's 16 experts in 4 groups, each
    expert's hidden over 2 ranks, W2 by its rows): on the mesh each rank computes its hidden
    slice's partial output, every rank's sum all-gathered and added in rank order; the logits
    bit-equal to the single-device sharded reference's at every step."""
    result = run_child_json(["decode", "kimi-k3-mini", "--backend", "reference", "--ranks", "8",
                             "--etp", "2", "--collectives", "partial-sum", "--prompt-len", "1",
                             "--batch", "2", "--steps", "2"], capfd, monkeypatch)  # 2 steps
    single = result["single_device"]
    print(f"8 ranks, ETP 2: {result['layout']}; logits bit-equal to the sharded reference at "
          f"{single['logits_bit_equal_steps']} of {single['steps']} steps")
    assert "expert_tp 2 ways" in result["layout"] and "experts 4 ways" in result["layout"]
    assert single["passed"] and single["logits_bit_equal_steps"] == single["steps"] >= 2


@pytest.mark.parametrize("collectives", layout.COLLECTIVES)
def test_the_reference_backend_is_held_to_its_own_mode(collectives):
    """`decode --backend reference --collectives C` steps the single-device reference of C beside
    the mesh (`ranks_reference.SingleDeviceCheck`): exact, the reference's own weights; partial
    sums, W_o and W_sd as the ranks' partials; restructured, W_lu too as the ranks' latent rows
    (issue 79: restructured ran, and was held to, the exact mode; the mesh's step of each mode
    against its kernel: tests/sharded/test_partial_sum.py)."""
    cfg = get_config("kimi-k3-mini")
    lay = layout.layout(cfg, 2, collectives=collectives)
    params = weights.init_params(cfg, 0)
    held = ranks_reference.SingleDeviceCheck(params, lay, 1).params
    kinds = {type(held[kind][key]).__name__ for kind in ("kda", "moe") for key in held[kind]}
    assert ({"Partials", "ExpertGroups", "NormedRows"} & kinds) == {
        layout.EXACT: set(), layout.PARTIAL_SUM: {"Partials", "ExpertGroups"},
        layout.RESTRUCTURED: {"Partials", "ExpertGroups", "NormedRows"}}[collectives]


def run_child_json(args: list[str], capfd, monkeypatch) -> dict:
    """`mkresearch <args> --json` from this process (`cli.main`; a fresh parent process would
    only start Python and JAX again), which runs its --ranks child with the child's devices: the
    result the child printed (on this process's stdout, which the child inherits)."""
    monkeypatch.delenv(cli_ranks.CHILD_ENV, raising=False)
    status = cli.main([*args, "--json"])
    captured = capfd.readouterr()
    assert status == 0, captured.err[-4000:]
    return json.loads(captured.out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.exhaustive  # make test runs the same child path on a checkpoint's Qwen3 mini, with
# these checks (tests/test_cli_checkpoint.py); Kimi K3 on simulated ranks: tests/sharded
def test_decode_on_2_ranks_in_a_child_json():
    """One device here: the command re-runs itself with 2 simulated devices; with the default
    partial-sum collectives its logits equal the sharded reference's at every step (the exact
    schedule's bit-equality with the single device: tests/sharded) and keep the partial-sum claim
    against the reference; per-rank bytes from the recorded step."""
    env = {k: v for k, v in os.environ.items() if k != cli_ranks.CHILD_ENV}
    done = subprocess.run([sys.executable, "-m", "mkresearch", "decode", "--ranks", "2",
                           "--prompt-len", "2", "--steps", "2", "--batch", "2", "--json"],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)  # one JSON object: no progress bar, the child's stdout
    assert result["ranks"] == 2 and result["devices"] == 2 and result["backend"] == "megakernel"
    assert len(result["generated"]) == 2 and all(len(row) == 2 for row in result["generated"])
    agree, single = result["agreement"], result["single_device"]
    print(f"2 ranks: {agree['tokens_equal']}/{agree['tokens']} tokens equal to the reference, "
          f"max |logit diff| {agree['max_abs_logit_diff']:.3g}; single device: "
          f"{single['tokens_equal']}/{single['tokens']} tokens, logits bit-equal at "
          f"{single['logits_bit_equal_steps']}/{single['steps']} steps")
    assert agree["tokens_equal"] + len(agree["near_ties"]) == agree["tokens"] == 4
    assert single["steps"] == 3
    check_sharded_decode(result)
    ranks = result["per_rank"]
    assert ranks[0]["weight_bytes"] == ranks[1]["weight_bytes"]  # the same slices' sizes


@pytest.mark.exhaustive  # another child decode (~40 s here); the kernel's modes and options run
# in tests/sharded (test_partial_sum.py: the bf16 wire; test_router_placement.py)
def test_decode_with_the_designs_in_a_child_json(capsys):
    """decode --ranks runs the designs of `predict --designs` that are kernel options: the
    restructured mode on a bf16 wire, the router on every rank, 3 expert slots, the expert reads
    first, the experts to the MXU as fp8. Its logits equal the sharded reference's (rounding as
    the bf16 wire does) at every step and keep the bf16 wire's claim against the reference."""
    env = {k: v for k, v in os.environ.items() if k != cli_ranks.CHILD_ENV}
    done = subprocess.run([sys.executable, "-m", "mkresearch", "decode", "--ranks", "2",
                           "--collectives", "restructured", "--wire", "bf16", "--router",
                           "replicated", "--expert-slots", "3", "--expert-reads-first",
                           "--expert-mxu", "fp8", "--prompt-len", "2", "--steps", "2",
                           "--batch", "2", "--json"],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert (result["wire"], result["router"], result["expert_slots"],
            result["expert_reads_first"], result["expert_mxu"]) == \
        ("bf16", "replicated", 3, True, "fp8")
    check_sharded_decode(result, "restructured")
    cli_ranks.print_decode(result)
    assert ("designs: --wire bf16, --expert-slots 3, --expert-reads-first, --expert-mxu fp8"
            in capsys.readouterr().out)


@pytest.mark.exhaustive  # another child decode (~30 s here); the kernel's placements run in
# tests/sharded/test_router_placement.py (the mini's 16 experts leave its router whole anyway)
def test_decode_with_the_router_placed_in_a_child_json():
    env = {k: v for k, v in os.environ.items() if k != cli_ranks.CHILD_ENV}
    done = subprocess.run([sys.executable, "-m", "mkresearch", "decode", "--ranks", "2",
                           "--router", "host", "--prompt-len", "2", "--steps", "2", "--batch",
                           "2", "--json"],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["router"] == "host"
    check_sharded_decode(result)


def check_sharded_decode(result: dict, collectives: str = "partial-sum") -> None:
    """The checks of `decode --ranks 2 --json` (cli.ranks.decode_sharded, the path of every
    `--ranks` run): the logits and every rank's slice of every state leaf bit-equal to the
    sharded reference's at every step, the partial-sum claim of its wire against the reference
    (`reference_sharded`), and a row per rank whose bytes add up."""
    agree, single = result["agreement"], result["single_device"]
    assert result["collectives"] == collectives and result["backend"] == "megakernel"
    bound = reference_sharded.SAME_ROUTING_BOUND[result.get("wire", "f32")]
    assert agree["passed"] and agree["max_abs_logit_diff_same_routing"] <= bound == \
        agree["bound_same_routing"]
    for tie in agree["near_ties"]:  # another greedy token: at a near-tie or after a routing flip
        assert tie["routing_differed"] or tie["top2_gap"] < 2 * agree["bound_same_routing"]
    assert single["passed"] and single["sharded_reference_bit_equal_steps"] == single["steps"]
    assert single["state_bit_equal_steps"] == single["steps"] and not single["state_mismatches"]
    assert result["passed"]
    ranks = result["per_rank"]
    assert [row["rank"] for row in ranks] == [0, 1]
    for row in ranks:
        assert row["hbm_bytes"] >= row["weight_bytes"] + row["routed_expert_bytes"] > 0
        assert row["remote_bytes"] > 0 and row["remote_copies"] > 0
        assert row["predicted_step_s"] > 0


@pytest.mark.slow
@pytest.mark.exhaustive  # the child's decode path runs in test_decode_on_2_ranks_in_a_child_json
def test_bench_on_2_ranks_adds_per_rank_rows(tmp_path):
    """bench --ranks 2: the single device's rows as before, then the sharded rows (printed and in
    decode_bench.json) with one entry per rank."""
    env = {k: v for k, v in os.environ.items() if k != cli_ranks.CHILD_ENV}
    done = subprocess.run([sys.executable, "-m", "mkresearch", "bench", "--ranks", "2",
                           "--batch", "1", "--steps", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "B=1, 2 ranks: sharded megakernel" in done.stdout
    assert "rank 0: HBM" in done.stdout and "rank 1: HBM" in done.stdout
    result = json.loads((tmp_path / "decode_bench.json").read_text())
    assert [row["batch"] for row in result["rows"]] == [1]
    sharded = result["sharded"]
    assert sharded["ranks"] == 2 and [row["batch"] for row in sharded["rows"]] == [1]
    ranks = sharded["rows"][0]["per_rank"]
    assert [row["rank"] for row in ranks] == [0, 1]
    assert all(row["remote_bytes"] > 0 and row["weight_bytes"] > 0 for row in ranks)
    assert (tmp_path / "decode_bench.png").exists()
