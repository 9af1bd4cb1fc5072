# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %%
# Setup: works on Colab, on a TPU VM and on a laptop. Installs mkresearch if it is missing.
import importlib.util, os, subprocess, sys
if importlib.util.find_spec("mkresearch") is None:
    root = os.path.abspath("..")
    source = (f"file://{root}" if os.path.exists(os.path.join(root, "pyproject.toml"))
              else "git+" + os.environ.get("MKRESEARCH_REPO", "https://github.com/mkresearch/mkresearch"))
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", f"mkresearch[notebooks] @ {source}"])
import mkresearch  # sets JAX_PLATFORMS=cpu when this machine has no TPU
from mkresearch import tpu
print(tpu.describe_backend())  # compiled on a TPU, TPU interpret mode elsewhere

# %% [markdown]
# # 09 · Predicting the release: where its 4.0 ms go, and what our layout would reach
#
# The release publishes Kimi K3 on 16 TPU7x chips (32 cores): 249 / 392 / 515 / 865 tok/s at
# B = 1 / 2 / 4 / 8, i.e. 4.0 / 5.1 / 7.8 / 9.25 ms per step. Each core reads ≈ 6.97 GB per step
# at B = 1: an HBM floor of ≈ 1.9 ms. **Where do the other 2.1 ms go?** And what would our layout
# (notebook 08: 4.9 GB per rank) reach on the same 16 chips?
#
# The timeline model of notebooks 01 and 07 simulates one core from its DMA log. Here it runs
# **every rank's program together** (`mkresearch.timeline_ranks`): each rank streams its weights
# through its own HBM and DMA engines, and at a collective it waits for its slowest peer, then
# for the messages of the collective's algorithm over the links between cores
# (`mkresearch.interconnect`). The programs come from a layout and a schedule
# (`mkresearch.scale_out`): the bytes of each rank's slice, a ring of weight blocks in flight,
# the routed experts fetched after routing (counted from a seeded routing: ranks differ), and the
# collectives between stages.
#
# Everything here is pure Python arithmetic: no JAX, the same numbers on any machine.
#
# 1. the links and what a collective costs;
# 2. the calibration: the release's layout and schedule against its published steps;
# 3. the release's second model (3.26 ms, ≈ 55 µs per layer + 195 µs fixed);
# 4. our layout and schedule on the same hardware;
# 5. an explorer: batch, ranks, layout, schedule, link bandwidth and latency.

# %%
from mkresearch import calibration, scale_out, scale_out_plots, widgets
from mkresearch import interconnect as links
from mkresearch.config import get_config
from mkresearch.timeline_ranks import PARTS

cfg = get_config("kimi-k3")

# %% [markdown]
# ## 1 · Links and collectives
#
# Two links leave a TPU7x core: to its **sibling** core on the same chip, and over **ICI** to
# the other chips. The release measured both: ≈ 45 GB/s per core per direction across chips, and
# a sibling copy at 101 GB/s for 256 KiB and 610 GB/s for 16 MiB. A line
# `t = latency + bytes / bandwidth` through the two sibling points gives the sibling link; no
# public figure gives the ICI latency, so it is an **assumption** (the sibling fit's: a DMA's
# issue and completion cost). Every figure carries its source:

# %%
# NBVAL_CHECK_OUTPUT
inter = links.interconnect("tpu7x")
print(f"sibling: latency {inter.sibling_latency * 1e6:.2f} µs, bandwidth "
      f"{inter.sibling_bandwidth / 1e9:.0f} GB/s")
print(f"ICI:     latency {inter.ici_latency * 1e6:.2f} µs, bandwidth "
      f"{inter.ici_bandwidth / 1e9:.0f} GB/s")
for field, source in inter.sources.items():
    print(f"  {field}: {source}")
for nbytes, rate in links.SIBLING_MEASURED:
    assert abs(nbytes / inter.sibling.seconds(nbytes) / rate - 1) < 1e-9

# %% [markdown]
# A collective is priced from its messages (`links.price`): a round lasts
# `max over links (latency + bytes sent on it / bandwidth)`, rounds run one after another.
# One-shot sends everything at once; a ring takes n − 1 (or 2(n − 1)) small rounds; two-level
# adds the sibling's vector first, then each core sends its half to the 15 other chips, then the
# siblings swap halves. The release combines a [B, 7168] vector of partial sums after every
# sublayer: ≈ 186 all-reduces per step. Over 32 ranks, per all-reduce:

# %%
# NBVAL_CHECK_OUTPUT
rows = []
for batch in (1, 8):
    nbytes = batch * cfg.d_model * 4  # f32 partial sums (an ASSUMPTION)
    for algorithm in links.ALGORITHMS:
        price = links.price(inter, "all_reduce", algorithm, tuple(range(32)), nbytes)
        rows.append({"B": batch, "algorithm": algorithm, "rounds": price.rounds,
                     "messages": price.messages, "µs": price.seconds * 1e6})
print(widgets.format_table(rows, ["B", "algorithm", "rounds", "messages", "µs"], digits=1))
by = {(r["B"], r["algorithm"]): r["µs"] for r in rows}
assert by[1, "two-level"] < by[1, "one-shot"] < by[1, "ring"]

# %% [markdown]
# Latency dominates at B = 1: two-level pays three message latencies (≈ 6.6 µs) for 28 KiB. 186
# of them is ≈ 2.1 ms — as much as the HBM floor — unless the weight stream hides them: the ring
# keeps weight blocks in flight while the program waits in a collective, so HBM keeps moving
# until the ring is full.
#
# ## 2 · Calibration: the release's layout and schedule against its published steps
#
# The release's program (`scale_out.RELEASE_SCHEDULE`): its layout's bytes per rank (spec §9,
# EP 8 × ETP 4), 12 × 2 MiB weight banks in flight and 4 expert slots after routing (published
# for its second model; assumed for K3), partial sums all-reduced in f32 after every sublayer.
# Nothing below is fitted to the published numbers: every input is a measurement or a stated
# assumption. Each published step is split into the model's parts on the slowest rank: the
# HBM floor (its bytes at full bandwidth), waiting for peers, collective messages, compute while
# HBM idles, and bubbles; what the model does not explain is the rest.

# %%
release = calibration.release_table(cfg)
columns = ["B", "published ms", "predicted ms", "floor", "peers", "coll.", "comp.", "bubble",
           "unexplained"]
print(widgets.format_table([
    {"B": r["batch"], "published ms": r["published_ms"], "predicted ms": r["predicted_ms"],
     "floor": r["parts_ms"]["hbm_floor"], "peers": r["parts_ms"]["waiting_for_peers"],
     "coll.": r["parts_ms"]["collective_messages"], "comp.": r["parts_ms"]["compute"],
     "bubble": r["parts_ms"]["bubble"], "unexplained": r["unexplained_ms"]} for r in release],
    columns, digits=2))

# %%
# NBVAL_CHECK_OUTPUT
for r in release:
    verdict = "within 20 %" if r["within"] else "MISSED by more than 20 %"
    print(f"B={r['batch']}: predicted / published = {r['predicted_ms'] / r['published_ms']:.2f} "
          f"({verdict}); {r['collectives_per_rank']} collectives per rank")
    if not r["within"]:
        print(f"  the assumption that would have to change: {r['assumption']}")
    assert r["within"] == ("assumption" not in r)
assert release[0]["within"]  # B = 1: the release's 4.0 ms within 20 %

# %% [markdown]
# At B = 1, 2 and 4 the model lands within 10 % of the published step with nothing tuned: the
# release's missing 2.1 ms at B = 1 are its ≈ 186 all-reduces (≈ 1.5 ms of exposed messages,
# 0.15 ms of waiting for the rank with the most experts) plus small bubbles and compute. At B = 8
# it predicts far too slow a step: the all-reduce's bytes grow with B, and the model sends all of
# a core's ICI messages through one 45 GB/s link. The published step needs about twice that: a
# torus spreads the messages over several links (or the release moves bf16 partial sums).
#
# ## 3 · The release's second model
#
# For its other model (816B-A42B, 62 layers, 4 chips) only totals are public: 3.26 ms at B = 1,
# ≈ 55 µs per layer + 195 µs fixed, HBM floor 2.19 ms. Its program is therefore uniform
# (`calibration.uniform_logs`): equal layers, two all-reduced sublayers each, d = 7168 assumed.

# %%
# NBVAL_CHECK_OUTPUT
second = calibration.second_model()
print(f"{second['model']}: predicted / published step = "
      f"{second['predicted_ms'] / second['published_ms']:.2f}; per layer "
      f"{second['per_layer_us']:.0f} µs predicted vs {second['published_per_layer_us']:.0f} µs; fixed "
      f"{second['fixed_us']:.0f} µs vs {second['published_fixed_us']:.0f} µs")
if not second["within"]:
    print(f"  the assumption that would have to change: {second['assumption']}")
assert second["within"] == ("assumption" not in second)

# %% [markdown]
# On 8 ranks the all-reduces are cheap (4 chips) and the 12 banks hide most of them: the model
# says this model should run close to its floor. It does not: ≈ 18 µs per layer go to something
# the model lacks — a per-sublayer handshake, or a message latency twice the sibling fit's. The
# per-layer fixed cost is the open question of the calibration; K3's collectives, 4× as many
# ranks, happen to cover it.
#
# ## 4 · Our layout and schedule on the same hardware
#
# Our megakernel as built (notebook 08) is **bit-equal** to one device: every matrix splits by
# output columns and its chunks are all-gathered; each expert's hidden slice is gathered in its
# ETP group; the experts' sum runs down the chain of expert groups. That is ≈ 1,071 collectives
# per rank per step at B = 1 instead of 188. Beside it: our layout (30 % fewer bytes per rank)
# under the release's schedule — partial sums, 12 banks, 4 expert slots — a schedule our kernel
# does not run yet.

# %%
ours = calibration.ours_table(cfg)
table = []
for row in ours:
    b = row["batch"]
    table.append({"B": b, "published tok/s": row["published_tok_s"],
                  "16xGB200 tok/s": row["gb200_tok_s"],
                  "release predicted tok/s": b / release[[r["batch"] for r in release].index(b)][
                      "predicted_ms"] * 1e3,
                  "ours as built tok/s": row["ours"]["tok_s"],
                  "our layout + release schedule tok/s": row["ours_release_schedule"]["tok_s"]})
print(widgets.format_table(table, list(table[0]), digits=0))

# %%
# NBVAL_CHECK_OUTPUT
for row in ours:
    published_ms = 1e3 * row["batch"] / row["published_tok_s"]
    built, summed = row["ours"], row["ours_release_schedule"]
    print(f"B={row['batch']}: ours as built / published step = {built['step_ms'] / published_ms:.2f} "
          f"(dominant beyond the floor: {built['dominant']}, {built['collectives_per_rank']} "
          f"collectives per rank); our layout + the release's schedule / published = "
          f"{summed['step_ms'] / published_ms:.2f}")
first = ours[0]
assert first["ours"]["dominant"] == "collective_messages"
assert first["ours_release_schedule"]["step_ms"] < 1e3 / first["published_tok_s"]

# %% [markdown]
# **The honest answer.** Our kernel as built would *not* beat the release at full size: its
# bit-exact design pays a collective around every split matrix, ≈ 5.7 ms of exposed messages at
# B = 1 against a 1.35 ms floor. Our layout's bytes would beat it — 3.1 ms at B = 1 (−22 %)
# under the release's own schedule — but not the 2.5 ms target: at 32 ranks the all-reduce's
# three message latencies dominate the step either way. The picture (`make figures` writes it
# as figures/scale_out.png):

# %%
from mkresearch.label_plots import label_problems

figure = scale_out_plots.scale_out_figure(release, ours)
assert not label_problems(figure)  # no label runs into another, none is cut
widgets.show_figure(figure)  # described: an HTML export gives the picture its title

# %% [markdown]
# ## 5 · Explorer
#
# One rank per expert-parallel group (ranks of a group run the same program), the first 200 µs
# of the step: blue (upper half of a row) where HBM moves weights, orange where a rank waits for
# its slowest peer, red where collective messages fly. Blue over red is the ring at work: the
# 12 banks issued before an all-reduce keep HBM busy for its first ≈ 6 µs; the rest of its
# ≈ 11 µs nothing moves. Change the batch, the ranks, the layout, the schedule, or the
# link bandwidth and latency (the assumptions) and it redraws from the model.

# %%
explorer = scale_out_plots.ScaleOutExplorer(batch=1, n_ranks=32, layout="release")
explorer

# %%
# NBVAL_CHECK_OUTPUT
p = explorer.prediction
print(f"explorer data: {p['layout']} layout, {p['n_ranks']} ranks, B={p['batch']}: parts sum to "
      f"the step: {abs(sum(p['parts_s'].values()) - p['step_s']) < 1e-9}; "
      f"{len(p['timeline'].ranks)} programs simulated")
assert abs(sum(p["parts_s"].values()) - p["step_s"]) < 1e-9
