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
# Setup: works on Colab, on a TPU VM and on a laptop. Installs mkresearch if it is missing, and
# only what this runtime lacks: mkresearch[plots] (the library with JAX; matplotlib and ipywidgets 8
# unless here; on a TPU also the tpu extra), never Jupyter, ipykernel or a notebook server, which a
# hosted runtime brings and depends on. The runtime's own jax and numpy stay if recent enough.
# From this checkout, else the git URL in MKRESEARCH_REPO. If the install replaces a package this
# kernel has imported, the kernel must restart: on Colab this cell restarts it, elsewhere it stops
# and says so; then run the notebook again.
import glob
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import subprocess
import sys


class _SetupStop(Exception):  # ends the cell with one line instead of a traceback
    def _render_traceback_(self):
        return [f"setup: {self}"]


def _versions():
    return {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version
            for d in importlib.metadata.distributions()}


_had = _versions()
_lacking = [name for name in ("mkresearch", "matplotlib") if importlib.util.find_spec(name) is None]
if int(_had.get("ipywidgets", "0").split(".")[0]) < 8:  # the explorers' controls are ipywidgets 8
    _lacking.append("ipywidgets 8")
if _lacking:
    _root = pathlib.Path("..").resolve()
    _local = (_root / "pyproject.toml").is_file() and \
        'name = "mkresearch"' in (_root / "pyproject.toml").read_text()
    _repo = os.environ.get("MKRESEARCH_REPO", "https://github.com/mkresearch/mkresearch")
    _extras = "plots,tpu" if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") else "plots"
    _source = _root.as_uri() if _local else f"git+{_repo}"
    _pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                           f"mkresearch[{_extras}] @ {_source}"],
                          capture_output=True, text=True, check=False)
    if _pip.returncode:
        _errors = [line for line in _pip.stderr.splitlines() if line.startswith("ERROR")]
        raise _SetupStop(f"pip could not install mkresearch[{_extras}]: "
                         f"{(_errors or _pip.stderr.splitlines() or ['no message'])[0]}")
    importlib.invalidate_caches()
    _now = _versions()
    _new = [f"{name} {version}" for name, version in sorted(_now.items()) if name not in _had]
    _replaced = {name: f"{name} {_had[name]} -> {version}" for name, version in sorted(_now.items())
                 if _had.get(name, version) != version}
    for _name in _replaced:  # why: the floor mkresearch (or its tpu extra) asks of it
        _asks = [r.split(";")[0].replace(" ", "") for r in importlib.metadata.requires("mkresearch")
                 or () if re.match(rf"{_name}(\[[^]]*\])?\s*[<>=!~]",
                                   re.sub(r"[-_.]+", "-", r), re.I)]
        _replaced[_name] += f" (mkresearch asks {' and '.join(_asks)})" if _asks else ""
    _kept = [f"{name} {_had[name]}" for name in ("jax", "numpy") if name in _had and name in _now
             and name not in _replaced]
    print(f"setup: {', '.join(_lacking)} lacking; installed from "
          f"{'this checkout' if _local else _repo}: {', '.join(_new) or 'nothing new'}"
          + (f"; replaced {', '.join(_replaced.values())}" if _replaced else "")
          + (f"; kept this runtime's {', '.join(_kept)}" if _kept else ""))
    _imported = {re.sub(r"[-_.]+", "-", dist).lower() for module, dists
                 in importlib.metadata.packages_distributions().items()
                 if module in sys.modules for dist in dists}
    _stale = [_replaced[name] for name in _replaced if name in _imported]
    if _stale:  # only a new kernel imports the new versions
        _colab = "google.colab" in sys.modules
        if _colab:  # Colab brings a kernel that shut down this way back by itself
            import IPython

            IPython.Application.instance().kernel.do_shutdown(True)
        raise _SetupStop(f"{', '.join(_stale)} replaced a package this kernel had imported: "
                         f"{'restarting' if _colab else 'restart'} the kernel, then run the "
                         "notebook again")
else:
    print("setup: nothing to install (mkresearch, matplotlib and ipywidgets are here)")
if "google.colab" in sys.modules:  # Colab draws ipywidgets 8 through its custom widget manager
    from google.colab import output as _colab_output
    _colab_output.enable_custom_widget_manager()
import mkresearch  # sets JAX_PLATFORMS=cpu when this machine has no TPU
from mkresearch.hardware import tpu

print(tpu.describe_backend())  # compiled on a TPU, TPU interpret mode elsewhere


# %% [markdown]
# # 11 · Speculative decoding: one weight pass verifies k + 1 tokens per row
#
# The release's headline — 709 tok/s for Kimi K3 on 16 TPU7x — is measured with speculative
# decoding. A drafter proposes k tokens after each row's last accepted token; ONE megakernel call
# scores the k + 1 tokens of every row causally against the cache (the **verify step**); the
# longest prefix of drafts the target agrees with is kept, plus one token of the target's own.
# The weights are read once for all B (k + 1) verify rows: decode is bound by HBM, so the extra
# rows are nearly free.
#
# A hybrid model makes it hard: KDA is recurrent. Its state after a rejected draft must not
# survive, so the verify call keeps the state after every position and the rollback picks the
# last kept one; MLA's cache entries of rejected drafts are cleared.
#
# 1. one verify call, row by row: targets, acceptance, the bonus token;
# 2. the rollback, checked bit for bit against decoding the kept tokens one by one;
# 3. a whole speculative decode, lossless against plain greedy decoding;
# 4. one verify step: one weight pass for k + 1 tokens (its bytes, its modelled timeline);
# 5. the full model: modelled tok/s against acceptance length, beside the published numbers.
#
# The terms this notebook uses, from the glossary (notebook 00 shows all of it):

# %%
from mkresearch.views import guide

guide.glossary_view("Speculative decoding, verify step", "Drafter", "Acceptance length",
                    "Pending token", "Bonus token", "Rollback", "Lossless", "KDA", "MLA",
                    "Batch invariance", "Greedy", "Prefill", "DMA log", "Modelled", "Rank",
                    "Layout (ours, release)")

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from mkresearch.kernels.base import dma
from mkresearch.kernels.compose import megakernel as mk
from mkresearch.kernels.compose import megakernel_verify as mv

from mkresearch.decoding import speculative
from mkresearch.measurement import logs
from mkresearch.model import reference, spec, weights
from mkresearch.model.config import get_config
from mkresearch.prediction import scale_out, speculative_predict
from mkresearch.sharding import layout
from mkresearch.views import scale_out_plots, speculative_plots, widgets
from mkresearch.views.label_plots import label_problems
from mkresearch.views.widgets import TableView, show_figure
from tqdm import tqdm

# kimi-k3-mini cut to its first 2 layers (a KDA + dense layer, an MLA + MoE layer, two residual
# blocks): every feature of the family, at a third of the interpret-mode time per call
cfg = get_config("kimi-k3-mini").replace(name="kimi-k3-mini-2l", n_layers=2, mla_first=1,
                                         attn_res_block=1)
params = weights.init_params(cfg, 0)
B, K, PROMPT_LEN = 2, 3, 12
prompt = np.asarray(jax.random.randint(jax.random.key(1), (B, PROMPT_LEN), 0, cfg.vocab_size))

# %% [markdown]
# ## 1 · One verify call
#
# The prompt but its last token is prefilled; the last one is the **pending** token (accepted, not
# yet fed) at position 11. Plain greedy decoding, one megakernel step per token, gives the
# continuation; the drafts copy it and then go wrong on purpose — after 2 tokens in row 0, after 1
# in row 1 (forced acceptance, the release's benchmark mode). The verify call scores
# `[pending, d1, d2, d3]` per row: 8 verify rows in one `pallas_call`.

# %%
_, prefilled = reference.prefill(params, reference.init_state(cfg, B), prompt[:, :-1], cfg)
pending = prompt[:, -1].astype(np.int32)
positions = np.full(B, PROMPT_LEN - 1, np.int32)

# plain decoding, one token at a time: the continuation, and the state after each fed token.
# Every kernel call here runs with its DMA log recorded (section 4 reads the logs), so each
# kernel is traced once: recording is part of what a kernel is compiled for.
one_by_one, token, state = [], pending, prefilled
for j in tqdm(range(K + 1), desc="plain decoding, a megakernel step per token", unit="step"):
    with dma.recording() as decode_log:
        token, state, _ = mk.decode_step(params, jax.tree.map(jnp.copy, state), token,
                                         positions + j, cfg)
    one_by_one.append((np.asarray(token), state, decode_log))
continuation = np.stack([t for t, _, _ in one_by_one], axis=1)  # [B, K + 1]

forced = np.array([2, 1])  # drafts accepted per row
drafts = continuation[:, :K].copy()
for b in range(B):
    drafts[b, forced[b]] = (drafts[b, forced[b]] + 1) % cfg.vocab_size  # the first wrong draft
fed = np.concatenate([pending[:, None], drafts], axis=1)  # [B, K + 1]

with dma.recording() as verify_log:
    targets, state_all, per_position, aux = mv.verify_step(
        params, jax.tree.map(jnp.copy, prefilled), fed, positions, cfg, return_logits=True)
targets, n_accepted = np.asarray(targets), np.asarray(aux["n_accepted"])

# %%
def verdict(b, j):
    if j == 0:
        return "pending"
    return ("accepted" if j <= n_accepted[b] else "REJECTED" if j == n_accepted[b] + 1
            else "not checked")


rows = [{"row": b, "j": j, "position": int(positions[b] + j), "fed": int(fed[b, j]),
         "fed as": verdict(b, j), "target after it": int(targets[b, j])}
        for b in range(B) for j in range(K + 1)]
print(f"bonus tokens {[int(targets[b, n_accepted[b]]) for b in range(B)]}, drawn in the call")
TableView(rows, list(rows[0]))  # token ids: not a checked output (below)

# %% [markdown]
# Row r = b (k + 1) + j is batch row b's token j at position p_b + j. MLA's rows run in order:
# each writes its cache entry before the next attends, and a row sees the cache up to its own
# position, so draft j never sees draft j + 1. KDA's rows advance the shared state token by
# token. The targets equal plain decoding's tokens to the bit (the megakernel is
# batch-invariant), and the reference's logits agree within docs/kimi-k3.md §11's tolerance:

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the accepted drafts are the forced ones; up to the bonus token the targets are plain
# decoding's; the megakernel's verify against the reference's
plain_prefix = all((targets[b, :n_accepted[b] + 1] == continuation[b, :n_accepted[b] + 1]).all()
                   for b in range(B))
print(f"n_accepted {n_accepted.tolist()} (forced {forced.tolist()}); targets up to the bonus "
      f"token equal plain decoding's: {plain_prefix}")
assert n_accepted.tolist() == forced.tolist() and plain_prefix
ref_logits, _, _ = speculative.verify_step(params, prefilled, fed, positions, cfg)
diff = float(np.abs(np.asarray(aux["logits"]) - np.asarray(ref_logits)).max())
same_argmax = bool((np.asarray(ref_logits).argmax(-1) == targets).all())
print(f"megakernel vs reference verify: max |logit diff| <= 5e-2: {diff <= 5e-2}; "
      f"greedy targets equal: {same_argmax}")
assert diff <= 5e-2 and same_argmax

# %% [markdown]
# ## 2 · The rollback
#
# Row 0 keeps 3 of its 4 fed tokens (pending + 2 drafts), row 1 keeps 2. The KDA recurrent and
# conv states are taken at each row's last kept position (`per_position`, written by the verify
# call as outputs: one state per position), and the MLA cache entries of rejected drafts are
# cleared. The result must be the state of plain decoding of exactly the kept tokens:

# %%
kept = n_accepted + 1
rolled = speculative.rollback(state_all, per_position, positions, kept, cfg)
expected = jax.tree.map(lambda *after_j: jnp.stack([after_j[kept[b] - 1][:, b] for b in range(B)],
                                                   axis=1),
                        *[s for _, s, _ in one_by_one])
pairs = list(zip(jax.tree.leaves(rolled), jax.tree.leaves(expected), strict=True))
names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(rolled)]
print(f"per-position state bytes, one KDA layer and one verify row: "
      f"{mv.per_position_bytes(cfg)}; at full size {mv.per_position_bytes(get_config('kimi-k3'))}")

# %%
# To the bit on this machine's default XLA:CPU (tests/test_megakernel_verify.py holds it there):
# its dot gives a row the same bits in a block of 2 rows or of 8. Another dot library may sum
# a different block size in another order, so this count is not a checked output.
equal = sum(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
            for a, b in pairs)
print(f"{equal}/{len(pairs)} state leaves equal to the bit")

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the rolled-back state is plain decoding's of the kept tokens; rejected drafts' MLA
# entries cleared
def relative_error(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


close = all(relative_error(a, b) <= 2.0**-7 for a, b in pairs)
# the cache entries of rejected drafts (positions >= p + kept) hold zeros, as plain decoding left
cache_len, table = reference.cache_length(rolled, cfg), spec.state_table(cfg, B, 1)["mla"]
cleared = all(not np.take(np.asarray(rolled["mla"][leaf])[:, b],
                          np.arange(positions[b] + kept[b], cache_len),
                          axis=table[leaf].token_axis - 1).any()  # [layers, B, ...]: b dropped
              for leaf in rolled["mla"] for b in range(B))
print(f"rollback: {names} equal plain decoding's within relative error 2^-7: {close}; rejected "
      f"drafts' MLA entries cleared: {cleared}")
assert close and cleared

# %% [markdown]
# ## 3 · A whole speculative decode
#
# `speculative.speculative_generate` runs the loop: draft, verify, accept, roll back. The verify
# call is pluggable; here it is the megakernel's. With forced acceptance 2 every verify step
# emits 3 tokens; the tokens must be plain greedy decoding's, exactly.

# %%
N_TOKENS = 7
plain, _ = reference.generate(params, reference.init_state(cfg, B), prompt, N_TOKENS, cfg)
with dma.recording():
    tokens, _, stats = speculative.speculative_generate(
        params, reference.init_state(cfg, B), prompt, N_TOKENS, cfg, k=K, drafter="forced:2",
        verify=mv.as_verify())
print(f"{N_TOKENS} tokens x {B} rows in {stats['steps']} verify steps, "
      f"{stats['tokens_per_step']:.2f} tokens per row and step")

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the speculative decode is lossless: plain greedy decoding's tokens, exactly
lossless = bool((np.asarray(tokens) == np.asarray(plain)).all())
print(f"{N_TOKENS} tokens x {B} rows in {stats['steps']} verify steps, "
      f"{stats['tokens_per_step']:.2f} tokens per row and step; lossless vs plain greedy: "
      f"{lossless}")
assert lossless

# %% [markdown]
# ## 4 · The timeline of one verify step
#
# The DMA logs of section 1: the verify call against the first plain decode step (same state,
# same position). The weights are the same bytes, read once, for 2 rows or for 8 (checked
# below).
#
# At full size, one verify step of Kimi K3 with k = 7 at B = 1 is 8 verify rows on each of the
# release's 32 cores. The scale-out timeline of notebook 09 (`scale_out.predict` at 8 rows: the
# same weight stream, the routed experts of 8 rows, per-row collective messages) draws its first
# layers, modelled: the dense weight stream is the same as a plain step's; what grows with the
# rows is the routed experts fetched after routing (8 rows choose up to 8 x 16 of 896) and the
# messages of the all-reduces.

# %%
decode_log = one_by_one[0][2]
STATE_PARTS = ("kda_state", "mla_cache", "routed_experts", "embedding_rows")
weight_bytes = {name: sum(v for part, v in logs.hbm_bytes_by_component(log).items()
                          if part not in STATE_PARTS)
                for name, log in (("verify", verify_log), ("decode", decode_log))}
full = get_config("kimi-k3")
verify_8 = scale_out.predict(full, 32, layout.RELEASE, 8, keep_timeline=True)
plain_1 = scale_out.predict(full, 32, layout.RELEASE, 1)
fig, ax = plt.subplots(figsize=(11, 3.2), layout="constrained")
scale_out_plots.plot_ranks(verify_8["timeline"], ax, window_us=(0, 400))
ax.set_title("one verify step (8 rows), modelled: the first 400 µs of the release's ranks")
verify_figure = fig
show_figure(fig)  # described: an HTML export gives the picture its title

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the verify step reads the decode step's weights once for 4x the rows; a modelled
# 8-row verify step costs less than 8 plain steps; the chart reads
print(f"weights read: verify step ({B * (K + 1)} rows) {weight_bytes['verify']:,d} B, decode "
      f"step ({B} rows) {weight_bytes['decode']:,d} B")
assert weight_bytes["verify"] == weight_bytes["decode"]
ratio = verify_8["step_s"] / plain_1["step_s"]
print(f"a verify step of 8 rows costs {ratio:.2f}x a plain step of 1 row (< 8x: {ratio < 8})")
print(f"bytes per rank: {plain_1['rank_bytes'] / 1e9:.2f} GB -> {verify_8['rank_bytes'] / 1e9:.2f}"
      f" GB: the dense weights once, the routed experts of 8 rows instead of 1")
assert ratio < 8
assert not label_problems(verify_figure)  # no label runs into another, none is cut

# %% [markdown]
# ## 5 · The full model: tok/s against acceptance length
#
# `mkresearch.prediction.speculative_predict` predicts a verify step of B (k + 1) rows with the scale-out
# timeline of notebook 09 (32 TPU7x cores, the release's layout and schedule). **Reading the
# published numbers**: with acceptance length a = tokens per verify step (accepted drafts and the
# bonus token), both published points imply the same step, 3 / 350 = 8.57 ms and 6 / 709 =
# 8.46 ms — as forced acceptance with one draft length should; reading a as accepted drafts
# (a + 1 tokens) gives 11.4 vs 9.9 ms. So: one verify step of 8 rows (k = 7), B = 1
# (assumptions, stated in the module). Note `forced:A` above counts accepted drafts: the
# release's a is `forced:(a - 1)`.

# %%
table = []
for r in speculative_predict.release_rows(full):
    table.append({"a": r["acceptance"], "rows": r["verify_rows"],
                  "modelled verify ms": f"{r['verify_step_s'] * 1e3:.1f}",
                  "modelled draft ms": f"{r['draft_step_s'] * 1e3:.2f}",
                  "modelled tok/s": round(r["tokens_per_s"] / 10) * 10,
                  "published tok/s": r["published_tok_s"],
                  "within 15 %": abs(r["ratio"] - 1) <= 0.15})
TableView(table, list(table[0]))

# %% [markdown]
# A speculative step is the verify step of 8 rows (one sequence's: its cache and states read
# once) plus the drafter's pass (the release's DSpark drafter, five layers split over the 32
# ranks, as its public source configures it; nothing fitted to a step time). The table prints
# how close each point lands; `mkresearch predict kimi-k3 --validate` prints both with their
# ranges over every assumption. How tok/s grows with the acceptance length, under two draft
# policies:

# %%
points = speculative_predict.acceptance_curve(full, 32, layout.RELEASE,
                                              acceptances=(1, 2, 3, 4, 6, 8))
fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
speculative_plots.plot_acceptance(points, ax, plain_tok_s=points[0]["exact_tokens_per_s"],
                                  title="Kimi K3 on 32 TPU7x cores, release layout (modelled)")
acceptance_figure = fig
show_figure(fig)  # described: an HTML export gives the picture its title

# %%
# NBVAL_CHECK_OUTPUT
# Checks · both published speculative points within 15 % (nothing fitted); tok/s rises with every
# accepted token; the chart reads
print(widgets.format_table(table, list(table[0]), digits=1))
assert all(row["within 15 %"] for row in table)
best = max(points, key=lambda p: p["k7_tokens_per_s"])
print(f"k = 7: tok/s rises with every accepted token (linear in a): "
      f"{all(a['k7_tokens_per_s'] < b['k7_tokens_per_s'] for a, b in zip(points, points[1:]))}; "
      f"best at a = {best['acceptance']}")
assert best["acceptance"] == 8
assert not label_problems(acceptance_figure)  # no label runs into another, none is cut
