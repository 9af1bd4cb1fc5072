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
# # 14 · Porting a family: GPT-OSS, from its config.json to the megakernel
#
# The megakernel runs any model the stage registry can describe (docs/architecture.md §3): a
# family is a preset that picks and orders **stage kinds**, each kind its weights, its reference
# sublayer and its kernel body. Porting a new family is finding what it does that no kind does
# yet, writing those pieces, checking each against an independent implementation, and plugging
# them in. This notebook walks through it with **GPT-OSS** (OpenAI's gpt-oss-20b and -120b,
# docs/families.md §6), the open MoE model that fits a free 16 GB v5e: 21 B parameters with its
# experts in MXFP4.
#
# 1. read its `config.json` and name what differs from the families we have;
# 2. write the new pieces as small kernels, each checked against transformers' code (its
#    `GptOssForCausalLM`, transcribed here in NumPy; tests/test_gpt_oss_hf.py runs transformers
#    itself): **sinks** inside the online softmax, the **sliding window** as a range of KV tiles,
#    the **clamped SwiGLU** with its biases, and (your turn) the router's **softmax over its top-k**;
# 3. see the package's versions of them and plug them into the megakernel: `gpt-oss-mini` decodes
#    through it the reference's tokens;
# 4. read the checkpoint format, MXFP4 experts included, and look at the full model on one v5e.
#
# On a CPU every kernel runs in TPU interpret mode; on a TPU, compiled. The terms this notebook
# uses, from the glossary (notebook 00 shows all of it):

# %%
from mkresearch.views import guide

guide.glossary_view("Attention sink", "Sliding window", "Online softmax", "KV tile", "GQA",
                    "Router", "MXFP4", "E2M1", "RoPE", "Stage", "Megakernel", "Reference", "Ref",
                    "BlockSpec", "Scalar prefetch", "pl.when", "scratch_shapes", ".at[...]",
                    "Race detector", "Checkpoint")

# %%
import functools
import inspect
import math
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import dma, kv_tiles
from mkresearch.kernels.compose import megakernel
from mkresearch.kernels.stages import gqa_sink as sink_kernels

from mkresearch.checkpoint import loader, safetensors_io
from mkresearch.model import hf_config, numerics, reference, roofline, weights
from mkresearch.model.config import get_config, layer_pattern
from mkresearch.model.stages import gqa_sink
from mkresearch.views import exercises, widgets

tpu.interpret_options(detect_races=True, vector_clock_size=16)  # every kernel: races checked
f32, bf16 = jnp.float32, jnp.bfloat16


def bf(x):
    """Round to bf16 and back, in float64 (NumPy): where the model rounds."""
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


# %% [markdown]
# ## 1 · Its config.json, and what differs
#
# The published `config.json` of gpt-oss-20b (its fields as OpenAI ships them; transformers'
# `GptOssConfig` reads the same). `hf_config.config_from_dict` is the reader of every family we
# port: one function per `model_type` (`_gpt_oss` here) that maps the published fields to our
# `ModelConfig`, refusing in one line what our kinds cannot run.

# %%
published = {
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "vocab_size": 201088,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "attention_bias": True,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "sliding_window": 128,
    "num_local_experts": 32, "num_experts_per_tok": 4, "swiglu_limit": 7.0, "hidden_act": "silu",
    "rms_norm_eps": 1e-05, "rope_theta": 150000, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
cfg20 = hf_config.config_from_dict(published, "gpt-oss-20b")

# %%
# NBVAL_CHECK_OUTPUT
assert cfg20 == get_config("gpt-oss-20b").replace(kv_tile=cfg20.kv_tile)  # the preset, field for field
print(f"d_model {cfg20.d_model} (config.json {cfg20.d_norm}), {cfg20.n_layers} layers, "
      f"{cfg20.n_heads} query / {cfg20.n_kv_heads} K/V heads of {cfg20.head_dim}, "
      f"experts {cfg20.n_experts} x {cfg20.expert_hidden_checkpoint} ({cfg20.expert_format}), "
      f"top-{cfg20.top_k}")
print(f"layers (W = sliding window of {cfg20.sliding_window}, S = every token): "
      f"{layer_pattern(cfg20)}")
total, active = roofline.parameter_counts(cfg20)
print(f"parameters: {total / 1e9:.2f} B total, {active / 1e9:.2f} B active per token "
      "(the model card: 20.9 B / 3.6 B)")

# %% [markdown]
# Set beside the families we already run (docs/families.md), eight things are new. Each row says
# what it is, who has something like it, and what the port does about it.

# %%
# NBVAL_CHECK_OUTPUT
differences = [
    ("attention sinks", "none",
     "a sink logit per query head in the online softmax: kinds gqa_sink, gqa_sink_window"),
    ("sliding window (128)", "none (every layer reads all tokens)",
     "the window's KV tiles only: the tile loop starts at the window's first tile"),
    ("alternating layers", "Kimi K3's KDA + MLA pattern",
     "a cycle of kinds: attention='gqa_sink_window,gqa_sink'"),
    ("bias on q, k, v, o", "GLM-4.5: q, k, v", "b_o added after W_o"),
    ("clamped SwiGLU, (up + 1)", "SiLU-GLU (DeepSeek, GLM, Qwen)", "activation 'clamped_swiglu'"),
    ("bias on each expert", "none", "b1, b3, b2 fetched with each expert (expert_bias)"),
    ("softmax over the top-k logits", "Qwen3: softmax over all, then top-k",
     "router_score 'topk_softmax', the bias inside the logits"),
    ("2880 wide, head_dim 64", "every width a multiple of 128",
     "padded to 2944 (zeros, norms over 2880); the cache [S, KV x 64]"),
    ("YaRN, truncate: false", "DeepSeek-V3's YaRN (truncated)", "yarn_truncate=False"),
    ("MXFP4 *_blocks / *_scales", "our MXFP4 layout", "bytes reinterpreted, no value decoded"),
]
print(widgets.format_table([{"what GPT-OSS does": a, "closest we had": b, "the port": c}
                            for a, b, c in differences],
                           ["what GPT-OSS does", "closest we had", "the port"]))

# %% [markdown]
# ## 2 · Sinks in the online softmax, and the window as a tile range
#
# transformers' `GptOssAttention` (eager) concatenates one learned logit per query head, the
# **sink**, to the scores, takes the softmax and drops the sink's column: the sink takes some of
# the attention mass and gives back no value. A **sliding-window** layer also masks every cached
# slot `j` with `j <= p − window` (the new token and the `window − 1` before it count).
#
# In a decode kernel the softmax is *online* (notebook 02): a running max `m`, normaliser `l` and
# value sum `acc`, updated tile by tile. The sink is one more logit with no value, so it only
# enters the start: `m = max(s_new, sink)`, `l = e^(s_new − m) + e^(sink − m)`,
# `acc = e^(s_new − m) v_new`. And a tile that lies wholly before the window adds *exactly*
# nothing (correction 1, weights 0), so the kernel need not read it: the window is a **range of KV
# tiles**, from the tile of slot `p − window + 1` to the tile of `p − 1`.
#
# The kernel below attends one row's query heads of one K/V group (`[G, D]`) over its cache. Its
# grid runs over the window's tiles: the **scalar prefetch** of the position (SMEM, before the
# grid) lets the K and V `BlockSpec`s' `index_map` start at the window's first tile; a step past
# the last tile maps to that tile again, which the pipeline does not fetch twice, and the body
# skips it.

# %%
mini = get_config("gpt-oss-mini")
TILE, WINDOW, D = mini.kv_tile, mini.sliding_window, mini.head_dim  # 32, 48, 64
G = mini.n_heads // mini.n_kv_heads  # 4 query heads per K/V head


def first_tile(position, window, tile):
    """The window's first tile: that of slot max(0, p − window + 1); tile 0 without a window."""
    if not window:
        return 0 * position
    return jax.lax.div(jnp.maximum(position - window + 1, 0), tile)


def my_sink_kernel(pos_ref, q_ref, k_new_ref, v_new_ref, sink_ref, k_ref, v_ref, o_ref,
                   m_ref, l_ref, acc_ref, *, tile, window, scale, steps):
    # pos_ref [1] i32 (SMEM); q [G, D] bf16; k_new, v_new [1, D] bf16; sink [G, 1] f32;
    # k_ref, v_ref [T, D] bf16: this step's tile; o [G, D] f32; m, l [G, 1], acc [G, D] scratch
    t, position = pl.program_id(0), pos_ref[0]
    q = q_ref[...].astype(f32)

    @pl.when(t == 0)
    def _():  # the new token and the sink start the state
        s_new = jnp.sum(q * k_new_ref[...].astype(f32), axis=-1, keepdims=True) * scale  # [G, 1]
        sink = sink_ref[...]
        m = jnp.maximum(s_new, sink)
        weight = jnp.exp(s_new - m)
        m_ref[...], l_ref[...] = m, weight + jnp.exp(sink - m)
        acc_ref[...] = weight * v_new_ref[...].astype(f32)

    index = first_tile(position, window, tile) + t
    last = jax.lax.div(position - 1, tile)  # the tile of the newest cached token

    @pl.when(index <= last)  # a step past it maps to `last` again: counted once
    def _():
        scores = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                     preferred_element_type=f32) * scale  # [G, T]
        slot = index * tile + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        valid = slot < position
        if window:
            valid = valid & (slot > position - window)
        scores = jnp.where(valid, scores, -jnp.inf)
        m = m_ref[...]
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))
        correction, weights_ = jnp.exp(m - m_new), jnp.where(valid, jnp.exp(scores - m_new), 0.0)
        l_ref[...] = correction * l_ref[...] + jnp.sum(weights_, axis=-1, keepdims=True)
        acc_ref[...] = correction * acc_ref[...] + jnp.dot(
            weights_, v_ref[...].astype(f32), preferred_element_type=f32,
            precision=jax.lax.Precision.HIGHEST)
        m_ref[...] = m_new

    @pl.when(t == steps - 1)
    def _():
        o_ref[...] = acc_ref[...] / l_ref[...]


def my_sink_attention(q, k_new, v_new, sink, keys, values, position, *, window, tile=TILE):
    """One row, one K/V group: q [G, D], k_new/v_new [1, D], sink [G], keys/values [S, D] (the
    cache) at `position` -> (o [G, D] f32, the tiles the grid reads)."""
    seq = keys.shape[0]
    steps = (window - 2) // tile + 2 if window else seq // tile  # tiles a window spans, at most
    steps = min(steps, seq // tile)

    def kv_block(t, pos_ref):  # the window's first tile + t, never past the last one
        last = jax.lax.div(pos_ref[0] - 1, tile)
        return jnp.minimum(first_tile(pos_ref[0], window, tile) + t, last), 0

    def whole(t, pos_ref):  # a block that is the whole array, every step
        return 0, 0

    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(steps,),
        in_specs=[pl.BlockSpec(q.shape, whole), pl.BlockSpec((1, D), whole),
                  pl.BlockSpec((1, D), whole), pl.BlockSpec((q.shape[0], 1), whole),
                  pl.BlockSpec((tile, D), kv_block), pl.BlockSpec((tile, D), kv_block)],
        out_specs=pl.BlockSpec(q.shape, whole),
        scratch_shapes=[pltpu.VMEM((q.shape[0], 1), f32), pltpu.VMEM((q.shape[0], 1), f32),
                        pltpu.VMEM(q.shape, f32)])
    kernel = functools.partial(my_sink_kernel, tile=tile, window=window,
                                   scale=1 / math.sqrt(D), steps=steps)
    o = pl.pallas_call(kernel, grid_spec=grid, out_shape=jax.ShapeDtypeStruct(q.shape, f32),
                       interpret=tpu.interpret_params())(
        jnp.asarray([position], jnp.int32), q, k_new, v_new, sink.reshape(-1, 1), keys, values)
    pos = jnp.asarray([position], jnp.int32)
    read = sorted({int(kv_block(t, pos)[0]) for t in range(steps)})
    return o, read


def transformers_attention(q, keys, values, sink, position, window):
    """transformers' eager_attention_forward (GptOss) for one decode row, in float64: the cache
    rows 0..p (p's the new token), the sliding mask kv > p − window, the sink concatenated to the
    scores and dropped after the softmax."""
    q, keys, values = (np.asarray(a, np.float64) for a in (q, keys, values))
    visible = np.arange(position + 1)
    if window:
        visible = visible[visible > position - window]
    logits = q @ keys[visible].T / math.sqrt(q.shape[-1])  # [G, n]
    combined = np.concatenate([logits, np.asarray(sink, np.float64)[:, None]], axis=-1)
    probs = np.exp(combined - combined.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return probs[:, :-1] @ values[visible]


# %%
# NBVAL_CHECK_OUTPUT
# Checks · my_sink_attention against transformers' formula (float64), full and windowed, at
# positions before, inside and past the window; the tiles each reads; no race
rng = np.random.default_rng(0)
keys = jnp.asarray(rng.standard_normal((mini.max_seq_len, D)), bf16)
values = jnp.asarray(rng.standard_normal((mini.max_seq_len, D)), bf16)
q = jnp.asarray(rng.standard_normal((G, D)), bf16)
sink = jnp.asarray(rng.standard_normal(G) + 1.0, f32)
tpu.reset_races()
worst, rows = 0.0, []
for window in (0, WINDOW):
    for position in (10, 47, 48, 100, 127):
        o, read = my_sink_attention(q, keys[position:position + 1], values[position:position + 1],
                                    sink, keys, values, position, window=window)
        want = transformers_attention(q, keys, values, sink, position, window)
        worst = max(worst, float(np.abs(np.asarray(o) - want).max() / np.abs(want).max()))
        rows.append({"layer": f"window {window}" if window else "full", "position": position,
                     "tiles read": str(read)})
assert worst < 1e-5 and not tpu.races_found()
print("PASS my_sink_attention equals transformers' sinks and window within 1e-5 of the scale "
      "(f32 against float64), no race")
print(widgets.format_table(rows, ["layer", "position", "tiles read"]))
# the sink takes mass: without it the same rows attend differently
no_sink = transformers_attention(q, keys, values, np.full(G, -np.inf), 100, WINDOW)
assert np.abs(no_sink - transformers_attention(q, keys, values, sink, 100, WINDOW)).max() > 1e-3

# %% [markdown]
# At position 100 the window (slots 53..100) needs tiles 1..3; tile 0 is never read. At full size
# (tiles of 128, a window of 128) a sliding layer reads at most two tiles, whatever the context.

# %% [markdown]
# ## 3 · The clamped SwiGLU, with the experts' biases
#
# GPT-OSS's expert (transformers' `GptOssExperts`): one matrix `gate_up_proj` `[d, 2F]` whose even
# columns are the gate and odd ones the up projection, a bias on it and on `down_proj`, and
#
#     gate = min(gate, 7),  up = clip(up, −7, 7),  out = (up + 1) · gate · σ(1.702 · gate)
#
# The `+ 1` on `up` and the clamps are the differences from SwiGLU. We keep gate and up as two
# matrices (W1, W3: the checkpoint's even and odd columns, split at load) so the expert loop
# streams three matrices as for every family, and round as our experts do:
# `g = bf(x W1 + b1)`, `u = bf(x W3 + b3)`, `y = bf(act(g, u) W2 + b2)`.

# %%
def my_expert_kernel(x_ref, w1_ref, b1_ref, w3_ref, b3_ref, w2_ref, b2_ref, y_ref, *, alpha,
                     limit):
    # x [B, d] bf16; w1, w3 [d, F], w2 [F, d] bf16; b1, b3 [1, F], b2 [1, d] bf16 -> y [B, d]
    x = x_ref[...]
    g = (jnp.dot(x, w1_ref[...], preferred_element_type=f32) + b1_ref[...].astype(f32)).astype(bf16)
    u = (jnp.dot(x, w3_ref[...], preferred_element_type=f32) + b3_ref[...].astype(f32)).astype(bf16)
    g32 = jnp.minimum(g.astype(f32), limit)
    u32 = jnp.clip(u.astype(f32), -limit, limit)
    h = ((u32 + 1) * (g32 * jax.nn.sigmoid(g32 * alpha))).astype(bf16)
    y_ref[...] = (jnp.dot(h, w2_ref[...], preferred_element_type=f32)
                  + b2_ref[...].astype(f32)).astype(bf16)


def my_expert(x, w1, b1, w3, b3, w2, b2, cfg):
    kernel = functools.partial(my_expert_kernel, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, bf16),
                          interpret=tpu.interpret_params())(
        x, w1, b1.reshape(1, -1), w3, b3.reshape(1, -1), w2, b2.reshape(1, -1))


def transformers_expert(x, gate_up, gate_up_bias, down, down_bias, alpha=1.702, limit=7.0):
    """GptOssExperts for one expert, float64, bf16 where our experts round."""
    gate_up = bf(x @ gate_up + gate_up_bias)  # [B, 2F]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    glu = gate / (1 + np.exp(-gate * alpha))
    return bf(bf((up + 1) * glu) @ down + down_bias)


# %%
# NBVAL_CHECK_OUTPUT
# Checks · my_expert against transformers' expert (float64) on gpt-oss-mini's expert 3 of layer
# 0, its projections scaled so both clamps bite; the same bits as the reference's arithmetic
params = weights.init_params(mini, seed=0)
ex = jax.tree.map(lambda a: a[0], params["moe_full"]["experts"])
w1, w3, w2 = (weights.dequantize(jax.tree.map(lambda a: a[3], ex[m]), "mxfp4")
              for m in ("w1", "w3", "w2"))
w1, w3 = (w * 8 for w in (w1, w3))  # exact in bf16 (a power of two): gates and ups beyond ±7
b1, b3, b2 = (ex[b][3] for b in ("b1", "b3", "b2"))
x = jnp.asarray(np.random.default_rng(1).standard_normal((8, mini.d_model)), bf16).at[
    :, mini.d_norm:].set(0)
tpu.reset_races()
y = my_expert(x, w1, b1, w3, b3, w2, b2, mini)
gate_up = np.empty((mini.d_model, 2 * mini.expert_hidden))  # the checkpoint's interleaving
gate_up[:, ::2], gate_up[:, 1::2] = np.asarray(w1, np.float64), np.asarray(w3, np.float64)
gate_up_bias = np.empty(2 * mini.expert_hidden)
gate_up_bias[::2], gate_up_bias[1::2] = np.asarray(b1, np.float64), np.asarray(b3, np.float64)
want = transformers_expert(np.asarray(x, np.float64), gate_up, gate_up_bias,
                           np.asarray(w2, np.float64), np.asarray(b2, np.float64))
err = np.abs(np.asarray(y, np.float64) - want)
assert err.max() <= 2 ** -6 * np.abs(want).max() and not tpu.races_found()
g = np.asarray(x, np.float64) @ np.asarray(w1, np.float64) + np.asarray(b1, np.float64)
print(f"PASS my_expert equals transformers' expert within a bf16 rounding of its scale "
      f"(gates over 7: {int((g > 7).sum())} of {g.size}); no race")
ours = numerics.clamped_swiglu(
    numerics.bf(numerics.matmul(x, w1) + b1.astype(f32)),
    numerics.bf(numerics.matmul(x, w3) + b3.astype(f32)), mini.swiglu_alpha, mini.swiglu_limit)
ref_y = numerics.bf(numerics.matmul(ours, w2) + b2.astype(f32))
assert (np.asarray(ref_y) == np.asarray(y)).all()
print("PASS my_expert gives the reference's bits (numerics.clamped_swiglu, the same roundings)")

# %% [markdown]
# ### Your turn: the router's softmax over its top-k
#
# GPT-OSS's router is a linear layer *with a bias*: `r = x W_r + b`. It takes the k largest `r`
# (the lower expert id wins a tie) and weights them by a **softmax over those k logits alone**,
# `w_i = e^(r_i − r_max) / Σ_j e^(r_j − r_max)` over the k picks. (Qwen3 takes a softmax over all
# experts first and renormalises the top k: the same weights in exact arithmetic, other floats;
# and there the bias, when a router has one, only selects.)
#
# Write `my_topk_softmax(logits, bias, top_k=)`: `logits` `[B, E]` f32 (`x W_r`), `bias` `[1, E]`
# f32; return `(ids [B, k] i32, weights [B, k] f32)`. Vector operations only, as notebook 03's
# router: k rounds of "max, the lowest index holding it, mask it out", then the softmax. The check
# runs it inside a kernel on 16 rows of gpt-oss-mini's layer 0 against `reference.route`.

# %%
def my_topk_softmax(logits, bias, *, top_k):
    # logits [B, E] f32, bias [1, E] f32 -> (ids [B, k] i32, weights [B, k] f32). Yours here.
    raise NotImplementedError("write the top-k softmax router")


# %%
router_p = reference.layer_params(params["moe_full"], 0)
router_p = {**router_p, "router_bias": router_p["router_bias"] * 20}  # a bias that changes picks
router_x = jnp.asarray(np.random.default_rng(2).standard_normal((16, mini.d_model)), bf16)


def my_router(topk_softmax, p, x, cfg):
    def kernel(x_ref, w_ref, bias_ref, ids_ref, weights_ref):
        logits = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=f32)
        ids_ref[...], weights_ref[...] = topk_softmax(logits, bias_ref[...], top_k=cfg.top_k)

    batch = x.shape[0]
    return pl.pallas_call(kernel, out_shape=(
        jax.ShapeDtypeStruct((batch, cfg.top_k), jnp.int32),
        jax.ShapeDtypeStruct((batch, cfg.top_k), f32)), interpret=tpu.interpret_params())(
        x, p["w_router"], p["router_bias"].reshape(1, -1).astype(f32))


def check_router(topk_softmax):
    tpu.reset_races()
    ids, w = my_router(topk_softmax, router_p, router_x, mini)
    want_ids, want_w = reference.route(router_p, router_x, mini)
    wrong = int((np.asarray(ids) != np.asarray(want_ids)).any(-1).sum())
    assert wrong == 0, f"{wrong} of 16 rows pick other experts than the reference"
    assert np.allclose(w, want_w, rtol=1e-6, atol=0), "the weights differ"
    assert not tpu.races_found(), "the race detector flagged an access"


exercises.check("top-k softmax router", lambda: check_router(my_topk_softmax));


# %% cellView="form" jupyter={"source_hidden": true}
#@title Solution: the top-k softmax router (double-click to open)
# NBVAL_CHECK_OUTPUT
def topk_softmax_solution(logits, bias, *, top_k):
    select = logits + bias  # the bias is in the logit: it moves choices and weights
    n_experts = select.shape[1]
    expert = jax.lax.broadcasted_iota(jnp.int32, select.shape, 1)
    ids, picked = [], []
    for _ in range(top_k):
        best = jnp.max(select, axis=-1, keepdims=True)
        index = jnp.min(jnp.where(select == best, expert, n_experts), axis=-1, keepdims=True)
        ids.append(index)
        picked.append(best)
        select = jnp.where(expert == index, -jnp.inf, select)
    top = jnp.concatenate(picked, axis=-1)  # [B, k], descending: top[:, :1] is the max
    e = jnp.exp(top - top[:, :1])
    return jnp.concatenate(ids, axis=-1), e / jnp.sum(e, axis=-1, keepdims=True)


assert exercises.check("top-k softmax router", lambda: check_router(topk_softmax_solution))
unbiased = reference.route({**router_p, "router_bias": router_p["router_bias"] * 0}, router_x,
                           mini)[0]
moved = int((np.asarray(unbiased) != np.asarray(reference.route(router_p, router_x, mini)[0]))
            .any(-1).sum())
assert moved > 0
print(f"the bias changes the picks of {moved} of 16 rows")

# %% [markdown]
# ## 4 · The package's pieces, and the megakernel
#
# The package's kernels are the same ideas inside the bodies the megakernel composes (imported,
# not pasted): `numerics.sink_seed` starts the online softmax with the sink (the reference and the
# kernel call it), `kv_tiles.window_first_tile` starts GQA's tile loop at the window's first tile
# (`kernels/stages/gqa.py` with the plan's `sinks`, `window`, `out_bias` and `lane_dense`
# switches; `kernels/stages/gqa_sink.py` registers the two kinds), the expert loop fetches each
# expert's biases into slots of their own beside its MXFP4 parts (`kernels/stages/experts.py`),
# and the router's `topk_softmax` is a branch of `kernels/stages/router.py`. GQA's cache
# `[KV, S, D]` would give each 64-wide head a whole 128-lane tile in HBM; GPT-OSS's kinds keep the
# cache `[S, KV·D]`, a token's heads side by side.

# %%
print(inspect.getsource(numerics.sink_seed))
print(inspect.getsource(kv_tiles.window_first_tile))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the package's sink attention kernel against the reference, bit for bit, and the KV
# tiles its DMA log reads: a window layer's, a full layer's
positions = jnp.asarray([47, 100], jnp.int32)
rows_x = jnp.asarray(np.random.default_rng(3).standard_normal((2, mini.d_model)), bf16)
shape = (2, mini.max_seq_len, mini.n_kv_heads * D)
cache = {n: jnp.asarray(np.random.default_rng(4).standard_normal(shape), bf16) for n in "kv"}
tpu.reset_races()
read = {}
for kind in (gqa_sink.WINDOW, gqa_sink.FULL):
    p = reference.layer_params(params[kind], 0)
    want, _ = gqa_sink.sink_attention(p, rows_x, cache, positions, mini,
                                      gqa_sink.window_of(kind, mini))
    with dma.recording() as log:
        got, _ = sink_kernels.sink_attention(p, rows_x, cache, positions, mini, kind)
    assert (np.asarray(got) == np.asarray(want)).all()
    read[kind] = {row: sorted({e.indices["tile"] for e in log.select("dma_start")
                               if e.name == f"{kind}.kv.k" and e.indices["row"] == row})
                  for row in range(2)}
assert not tpu.races_found()
print("PASS the package's sink attention equals the reference bit for bit, both kinds, no race")
for kind, tiles in read.items():
    print(f"{kind:16s} tiles read: position 47 -> {tiles[0]}, position 100 -> {tiles[1]}")

# %% [markdown]
# Plugged in, the megakernel decodes `gpt-oss-mini` (4 layers, window and full in turn, MXFP4
# experts with biases, 352 wide padded to 384) in one `pallas_call` per step. Teacher-forced from
# the reference's state at rows before and past the window's first skipped tile, its tokens,
# logits and caches are the reference's bits.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the megakernel on gpt-oss-mini: three steps of 2 rows, tokens and logits the
# reference's; the KV bytes of one step by layer kind
state = jax.tree.map(lambda a: jnp.asarray(np.random.default_rng(5).standard_normal(a.shape),
                                           a.dtype), reference.init_state(mini, 2))
tokens, step_positions = jnp.asarray([7, 1500], jnp.int32), np.asarray([47, 100], np.int32)
tpu.reset_races()
for step in range(3):
    ref_logits, ref_state, _ = reference.decode_step(params, state, tokens, step_positions, mini)
    with dma.recording() as log:
        got, _, aux = megakernel.decode_step(params, jax.tree.map(jnp.copy, state), tokens,
                                             step_positions, mini, return_logits=True)
    assert (np.asarray(aux["logits"]) == np.asarray(ref_logits)).all()
    assert np.asarray(got).tolist() == np.asarray(ref_logits).argmax(-1).tolist()
    state, tokens, step_positions = ref_state, jnp.asarray(got), step_positions + 1
assert not tpu.races_found()
print("PASS 3 megakernel steps: tokens and logits equal the reference's, no race")
kv = {kind: log.dma_bytes(f"{kind}.kv.") for kind in (gqa_sink.WINDOW, gqa_sink.FULL)}
print(f"KV bytes of the last step (rows at 49 and 102): window layers {kv[gqa_sink.WINDOW]:,} B, "
      f"full layers {kv[gqa_sink.FULL]:,} B")

# %% [markdown]
# ## 5 · The checkpoint, MXFP4 as released
#
# The experts ship as `*_blocks` (uint8, 16 bytes = 32 E2M1 values of one output column, value
# `2i` in the low nibble of byte `i`) and `*_scales` (E8M0). Our MXFP4 layout packs 8 values in a
# uint32 word, low nibble first, along K: four consecutive bytes of a block row *are* one of our
# words, so the loader reinterprets and transposes the bytes and never decodes a value
# (docs/checkpoints.md §6). `write_checkpoint` writes our experts back in that layout.

# %%
# NBVAL_CHECK_OUTPUT
# Checks · a gpt-oss-mini checkpoint written in the released layout and read back bit for bit
directory = tempfile.mkdtemp(prefix="gpt-oss-mini-")
loader.write_checkpoint(directory, params, mini)
shards = safetensors_io.Shards(directory)
for name in sorted(n for n in shards.names() if n.startswith("model.layers.0.mlp.experts.")):
    print(f"{name:48s} {list(shards.shape(name))!s:18s} {shards.dtype(name)}")
read_cfg = loader.read_config(directory, name="gpt-oss-mini")
loaded = loader.load_params(directory, read_cfg, progress=False)
assert read_cfg.replace(kv_tile=mini.kv_tile) == mini
same = jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), params, loaded)
assert all(jax.tree.leaves(same))
print(f"PASS config.json and {len(shards.names())} tensors read back bit for bit "
      f"(expert format {read_cfg.expert_format})")

# %% [markdown]
# ## 6 · The full model on one v5e
#
# gpt-oss-20b in MXFP4: 14.30 GB of weights (536 MB of them the zero padding of 2880 to 2944)
# and, at 8 rows of 4,096 tokens, 1.66 GB of KV caches: one 16 GB v5e holds both
# (`mkresearch info gpt-oss-20b --batch 8 --context 4096`). Compiled for it with the state donated,
# as a step runs, XLA counts 15.5 GiB of the 15.75 GiB the runtime leaves for one step
# (tests/test_gpt_oss_kernels.py, exhaustive; the decode loop's call of 16 steps, 15.7 GiB);
# `benchmarks/gpt_oss_v5e.py` runs it there with random weights drawn in MXFP4 on the device.
# From shapes, here:

# %%
# NBVAL_CHECK_OUTPUT
fit = roofline.hbm_footprint(cfg20, "v5e", 8, 4224)
floor = roofline.decode_floor(cfg20, "v5e", 8, 4096)
print(f"gpt-oss-20b on one v5e, B = 8 x 4,224 tokens: weights {fit.weights / 1e9:.2f} GB + "
      f"caches {fit.states / 1e9:.2f} GB = {fit.needed / 1e9:.2f} GB of {fit.available / 1e9:.2f}"
      f" GB: {'fits' if fit.fits() else 'does not fit'}")
print(f"its HBM floor at B = 8, context 4,096: {floor.seconds * 1e3:.2f} ms per step "
      f"({floor.tokens_per_s:.0f} tokens/s)")
assert fit.fits()

# %%
# The mini compiled for a v5e with Mosaic (head_dim 64, the window's tiles, the integer MXFP4
# decode): one kernel, where this runtime can compile for a TPU
if tpu.can_compile():
    result, plan = megakernel.compile_step(mini, 2, chip="v5e")
    assert result.n_mosaic_kernels == 1
    print(f"gpt-oss-mini for v5e: {result.n_mosaic_kernels} Mosaic kernel, VMEM plan "
          f"{plan.vmem.total_bytes / 2**20:.1f} MiB")
else:
    print("skipped: this runtime has no libtpu to compile for a TPU")

# %% [markdown]
# ## What a port needs, in the end
#
# - the family's `config.json` reader (`mkresearch/model/hf_config.py`) and its preset with a
#   `-mini` that keeps every feature (`mkresearch/model/model_config.py`);
# - a kind per new sublayer (`mkresearch/model/stages/gqa_sink.py`): weights, state, reference;
#   options of existing kinds where the difference is small (an activation, a router score, the
#   experts' biases);
# - each kind's kernel body (`kernels/stages/`), checked against the reference bit for bit under
#   the race detector, and the megakernel's plan reads it from the registry;
# - the checkpoint's names (`mkresearch/checkpoint/gpt_oss_names.py`) and a test against
#   transformers (tests/test_gpt_oss_hf.py).
