"""The layout (`mkresearch.sharding.layout`): per-rank shapes and slices from the kinds' sharding rules,
per-rank bytes at full size (ours vs the release's, docs/kimi-k3.md §9), the one-rank stand-in config, the
CLI table, and bad rank counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mkresearch.cli import main as cli
from mkresearch.model import config, partition, reference, spec, weights
from mkresearch.model import published as presets
from mkresearch.model.config import get_config
from mkresearch.sharding import layout, layout_bytes

MINI = get_config("kimi-k3-mini")
FULL = get_config("kimi-k3")
RELEASE_PER_RANK = 6.97e9  # docs/kimi-k3.md §9: per-rank weight bytes per step at B = 1
GOAL_PER_RANK = 4.6e9  # the goal for ours: not met by the exact layout (see below)
PERFECT_PER_RANK = 137.9e9 / 32  # every byte split 32 ways


def test_full_size_per_rank_bytes_ours_vs_release():
    """B = 1: the release's layout reads ≈ 6.97 GB per rank (its router and attention latent
    projections whole, FP8 gate/up), ours fewer. Ours splits every matrix by its output columns
    (exact: no partial sums) in whole lane tiles: d = 7168 over 32 ranks is 224 columns, read as
    256, and W_fa's 128 columns stay whole: ≈ 4.93 GB, above the issue's goal of 4.6 GB."""
    release = layout_bytes.rank_bytes(layout.layout(FULL, 32, layout.RELEASE))
    ours = layout_bytes.rank_bytes(layout.layout(FULL, 32, layout.OURS))
    print(f"per rank at B=1: release {release.weights / 1e9:.3f} GB (spec ≈ 6.97), ours "
          f"{ours.weights / 1e9:.3f} GB ({(release.weights - ours.weights) / 1e9:.3f} GB, "
          f"{1 - ours.weights / release.weights:.1%} fewer; replicated {ours.replicated_weights:,} "
          f"B), perfect split {PERFECT_PER_RANK / 1e9:.2f} GB, goal {GOAL_PER_RANK / 1e9} GB")
    assert release.weights == pytest.approx(RELEASE_PER_RANK, rel=0.02)
    assert ours.weights <= RELEASE_PER_RANK
    assert ours.weights <= 5.0e9  # what the exact layout reaches (the goal 4.6e9 is not met)
    assert ours.weights >= PERFECT_PER_RANK  # padding to lane tiles costs a little
    # what ours shards that the release keeps whole on every rank
    assert release.replicated_weights > 0.8e9 and ours.replicated_weights < 0.15e9
    # the tpu7x floor of the release's bytes is docs/tpu.md §3's ≈ 1.9 ms
    assert release.floor_s("tpu7x") * 1e3 == pytest.approx(1.9, rel=0.02)
    report = layout_bytes.compare(FULL, 32)
    table = layout_bytes.format_table(report)
    print(table)
    assert f"ours reads {report['ours_saves_bytes'] / 1e9:.3f} GB" in table
    # the table counts ours as the sharded kernel streams it by default (partial sums: W_o,
    # W_down and the experts' W2 split by rows), as the full-size step does
    built = layout_bytes.rank_bytes(layout.layout(FULL, 32, layout.OURS, collectives="partial-sum"))
    assert report["ours_saves_bytes"] == release.weights - built.weights
    assert built.weights < ours.weights


def test_stand_in_config_is_the_release_rank():
    """rank_config(kimi-k3) (= get_config('kimi-k3-rank')) holds one release rank's shapes."""
    rank = layout.rank_config(FULL)
    assert get_config("kimi-k3-rank") == rank and rank.name == "kimi-k3-rank"
    assert (rank.n_heads, rank.vocab_size, rank.n_experts, rank.expert_hidden,
            rank.shared_hidden, rank.dense_hidden) == (3, 5120, 112, 768, 256, 1152)
    assert rank.d_model == FULL.d_model and rank.top_k == FULL.top_k
    with pytest.raises(ValueError, match="n_ranks=32 is invalid for kimi-k3-mini"):
        get_config("kimi-k3-mini-rank")  # mini does not split 32 ways


@pytest.mark.parametrize("n_ranks", [2, 4, 8])
def test_mini_slices_put_back_together(n_ranks):
    """Every rank's slice has the layout's per-rank shape; concatenating the slices of a split
    axis (dropping the zero padding) gives the whole parameter back; replicated leaves are
    whole on every rank."""
    lay = layout.layout(MINI, n_ranks)
    params = weights.init_params(MINI, 0)
    sharded = layout.shard_params(params, lay)
    shapes = layout.rank_param_shapes(lay)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(sharded),
                                 jax.tree.leaves(shapes)):
        assert got.shape == (n_ranks, *want.shape), jax.tree_util.keystr(path)
    # each kind of split: heads (2 heads of 128 columns; replicated beyond 2 ranks)
    full = np.asarray(params["kda"]["w_q"])
    heads = lay.split(spec.HEADS)
    width = full.shape[-1] // heads.ways
    for r in range(n_ranks):
        h = heads.index(r)
        np.testing.assert_array_equal(sharded["kda"]["w_q"][r], full[..., h * width:(h + 1) * width])
    model_cols = lay.split(spec.MODEL_COLS)  # in slice order (our layout rotates: `rotations`)
    cols = np.concatenate([sharded["kda"]["w_o"][model_cols.rank_of(i)]
                           for i in range(model_cols.ways)], axis=-1)[..., :MINI.d_model]
    np.testing.assert_array_equal(cols, np.asarray(params["kda"]["w_o"]))
    assert sharded["moe"]["w_router"].shape[-1] == MINI.n_experts  # one lane tile: whole
    for r in range(n_ranks):
        np.testing.assert_array_equal(sharded["final_norm"][r], np.asarray(params["final_norm"]))
    codes = np.asarray(params["moe"]["experts"]["w2"]["codes"])  # experts x latent columns
    e_local = MINI.n_experts // lay.ep
    for r in range(n_ranks):
        g, f = lay.split(spec.EXPERTS).index(r), lay.split(spec.EXPERT_TP).index(r)
        n = codes.shape[3] // lay.etp
        np.testing.assert_array_equal(sharded["moe"]["experts"]["w2"]["codes"][r],
                                      codes[:, g * e_local:(g + 1) * e_local, :, f * n:(f + 1) * n])
    state = reference.init_state(MINI, 2)
    state = jax.tree.map(lambda a: jnp.arange(a.size).reshape(a.shape).astype(a.dtype), state)
    per_rank = layout.shard_state(state, lay)
    want = layout.rank_state_shapes(lay, 2, MINI.max_seq_len)
    jax.tree.map(lambda a, s: (a.shape == (n_ranks, *s.shape)) or pytest.fail(str(a.shape)),
                 per_rank, want)


def test_ep_times_etp():
    """The release's EP 8 x ETP 4 on 32 ranks; a group of 4 consecutive ranks shares experts."""
    lay = layout.layout(FULL, 32, layout.RELEASE)
    assert (lay.ep, lay.etp) == (8, 4)
    assert [lay.split(spec.EXPERTS).index(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [lay.split(spec.EXPERT_TP).index(r) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    mini = layout.layout(MINI, 8, etp=2)
    assert (mini.ep, mini.etp, mini.head_replicas) == (4, 2, 4)


@pytest.mark.parametrize("cfg, n_ranks, field", [
    (MINI, 3, "n_heads=2"), (MINI, 32, "vocab_size=2048"),
    (MINI.replace(n_experts=10), 8, "n_experts=10"), (FULL, 64, "n_heads=96")])
def test_rank_count_that_does_not_split_is_refused(cfg, n_ranks, field):
    with pytest.raises(ValueError, match=rf"n_ranks={n_ranks} is invalid for {cfg.name}: .*"
                                         rf"{field}.*allowed rank counts: 1, 2, 4"):
        layout.layout(cfg, n_ranks)


def test_bad_etp_and_name():
    with pytest.raises(ValueError, match=r"etp=4 is invalid for kimi-k3-mini on 8 ranks.*"
                                         r"allowed: \[1, 2\]"):
        layout.layout(MINI, 8, etp=4)
    with pytest.raises(ValueError, match="layout name='mine' is invalid: one of ours, release"):
        layout.layout(MINI, 2, "mine")


@pytest.mark.parametrize("name", ["kimi-k3-mini", "deepseek-v3-mini", "glm-4.5-mini",
                                  "qwen3-235b-a22b-mini", "kimi-k3"])
def test_every_default_layout_builds_its_ranks_in_every_expert_format(name):
    """For each expert format and every rank count the layout allows (up to 32), in both
    collective modes: the default ETP gives a rank config its checks accept (fp8: each rank's
    expert hidden whole 256-value scale blocks). Before, kimi-k3-mini with fp8 experts took
    ETP 2 on 16 ranks and the sharded plan failed on a per-rank expert_hidden=128 the user never
    set; lane tiles were the only unit checked."""
    from mkresearch.kernels.compose import megakernel_sharded

    for fmt in ("bf16", "fp8", "mxfp4"):
        cfg = get_config(name, expert_format=fmt)
        for n_ranks in layout.allowed_ranks(cfg, 32):
            for mode in layout.COLLECTIVES:
                lay = layout.layout(cfg, n_ranks, collectives=mode)
                megakernel_sharded.kernel_config(lay)  # validated: raises on a bad share
                assert cfg.expert_hidden // lay.etp % partition.hidden_unit(cfg) == 0


def test_fp8_experts_with_etp_pick_whole_scale_blocks():
    """kimi-k3-mini with fp8 experts on 16 ranks: ETP 1 (its hidden, 256, is one FP8 scale
    block), and the sharded plan builds; ETP 2 asked for is one line naming etp and the scale
    blocks."""
    from mkresearch.kernels.compose import megakernel_sharded

    cfg = get_config("kimi-k3-mini", expert_format="fp8")
    lay = layout.layout(cfg, 16)
    assert lay.etp == 1 and layout.layout(MINI, 16).etp == 2  # bf16: 128-lane slices allowed
    megakernel_sharded.make_sharded_plan(lay, 1, cfg.max_seq_len)
    with pytest.raises(ValueError, match=r"etp=2 is invalid for kimi-k3-mini on 16 ranks: .*"
                                         r"expert_hidden=256 in ETP slices of whole 256-value "
                                         r"fp8 scale blocks.*allowed: \[1\]") as caught:
        layout.layout(cfg, 16, etp=2)
    assert "\n" not in str(caught.value)


def test_a_kind_without_sharding_rules_is_refused():
    toy = spec.Stage(name="toy_unsharded", role=spec.FFN, sublayer=None,
                     params=lambda cfg: {"w": spec.matrix(cfg.d_model, cfg.d_model)})
    spec.register(toy)
    try:
        cfg = MINI.replace(ffn="dense+toy_unsharded")
        layout.layout(cfg, 1)  # one rank: nothing to split
        with pytest.raises(ValueError, match=r"parameter \['toy_unsharded'\]\['w'\] of "
                                             r"kimi-k3-mini has no sharding rule"):
            layout.layout(cfg, 2)
    finally:
        spec.unregister("toy_unsharded")


def test_info_ranks_prints_the_table(capsys):
    assert cli.main(["info", "kimi-k3", "--ranks", "32"]) == 0
    out = capsys.readouterr().out
    assert "kimi-k3 on 32 ranks, per rank and step" in out and "ours reads" in out
    assert "tpu7x  ours" in out
    assert cli.main(["info", "kimi-k3-mini", "--ranks", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "n_ranks=3 is invalid" in err[0]


def test_rank_names_from_the_kinds_rules():
    """'<preset>-rank' is offered for every full-size preset, never a preset of its own: one rank
    of the release layout (every kind declares sharding rules, the families' too), had from
    `get_config` like every other name."""
    names = config.config_names()
    ranks = {"kimi-k3-rank", "deepseek-v3-rank", "glm-4.5-rank", "qwen3-235b-a22b-rank"}
    published = set(presets.PUBLISHED)  # the small real models' presets, no rank of their own
    on_chip = set(config.on_chip.ON_CHIP)  # real-size models cut to fill one chip
    assert set(names) - set(config.PRESETS) - published - on_chip == ranks
    assert not ranks & set(config.PRESETS) and published <= set(names)
    assert get_config("kimi-k3-rank") == layout.rank_config(FULL)
    glm = get_config("glm-4.5")
    assert layout.has_rules(glm)
    assert get_config("glm-4.5-rank") == layout.rank_config(glm)
    assert get_config("glm-4.5-rank", max_seq_len=4096) == layout.rank_config(glm).replace(
        max_seq_len=4096)
    with pytest.raises(ValueError, match=r"unknown model 'kimi-k9': choose one of kimi-k3, "):
        get_config("kimi-k9")
