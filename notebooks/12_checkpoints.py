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
# # 12 · From a checkpoint on disk to text
#
# Every other notebook draws its weights with `weights.init_params` and feeds random token ids.
# Here a model comes from a checkpoint in the published layout (`config.json`, safetensors
# shards with their index, `tokenizer.json`), a text prompt fills every cache in one jitted call
# per chunk (`mkresearch.model.prefill`), and the megakernel decodes the continuation, streamed as
# text, checked against the reference.
#
# 1. a checkpoint: real weights on a TPU VM (set `MKRESEARCH_CHECKPOINT` to its directory), or
#    on CPU a small one this notebook writes (a DeepSeek-V3-architecture mini, two shards, a
#    byte-level BPE `tokenizer.json` trained here on a few sentences);
# 2. loading: config.json → `ModelConfig`, the shards read lazily through their index;
# 3. prefill: the whole prompt at once, against feeding it one decode step at a time;
# 4. decode with the megakernel, token by token as text, against the reference.
#
# The terms this notebook uses, from the glossary (notebook 00 shows all of it):

# %%
from mkresearch.views import guide

guide.glossary_view("Checkpoint", "Tokenizer (BPE)", "MLA", "Prefill", "Decode step",
                    "Context", "KV tile", "Megakernel", "Interpret mode", "Reference", "Greedy",
                    "bf(x)")

# %%
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mkresearch.checkpoint.loader import load_params, read_config, write_checkpoint
from mkresearch.checkpoint.tokenizer import TextStream, encode, load_tokenizer
from mkresearch.kernels.compose import megakernel as mk
from mkresearch.model import kv_cache, prefill, reference, weights
from mkresearch.model.config import get_config

CHECKPOINT = os.environ.get("MKRESEARCH_CHECKPOINT")  # a real checkpoint's directory, if set
PROMPT = "The megakernel decodes one token per step, and"
N_TOKENS = 6

# %% [markdown]
# ## 1 · A checkpoint
#
# Without `MKRESEARCH_CHECKPOINT`, the notebook writes one: `deepseek-v3-mini` weights from
# `init_params` in DeepSeek-V3's published names and layout (`write_checkpoint`, two shards and
# `model.safetensors.index.json`), and a tokenizer trained on a few sentences (no network).

# %%
CORPUS = ["The megakernel decodes one token per step, and the weights stream from HBM.",
          "A prompt fills every cache and state at once: one jitted call per chunk.",
          "Multi-head latent attention caches the latent; the experts are routed per token."]
if CHECKPOINT is None:
    CHECKPOINT = tempfile.mkdtemp(prefix="mkresearch-checkpoint-")
    written_cfg = get_config("deepseek-v3-mini", expert_format="bf16")  # as config.json reads
    write_checkpoint(CHECKPOINT, weights.init_params(written_cfg, seed=0), written_cfg, shards=2)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(Path(CHECKPOINT) / "tokenizer.json"))
    WRITTEN = True
else:
    WRITTEN = False
print("files:", sorted(p.name for p in Path(CHECKPOINT).iterdir()))

# %% [markdown]
# ## 2 · Loading
#
# `read_config` maps config.json onto a validated `ModelConfig`; `load_params` reads one layer's
# tensors at a time from the shards the index names (a progress bar counts the layers), checks
# every name, shape and dtype first, and converts to our layout (matrices `[in, out]`, per-kind
# stacks). The notebook's own checkpoint must come back as the very weights it wrote.

# %%
cfg = read_config(CHECKPOINT)
tokenizer = load_tokenizer(CHECKPOINT)
prompt_ids = encode(tokenizer, PROMPT, cfg.vocab_size)
cache_len = kv_cache.cache_length(cfg, len(prompt_ids) + N_TOKENS)  # whole KV tiles, as the CLI
cfg = cfg.replace(max_seq_len=cache_len)
params = load_params(CHECKPOINT, cfg, progress=False)  # 4 layers: a few seconds, no bar

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the config read from config.json, the prompt's length; the notebook's own checkpoint
# loads back bit for bit
print(f"{cfg.n_layers} layers, attention {cfg.attention!r}, FFN {cfg.ffn!r}, d_model "
      f"{cfg.d_model}, vocab {cfg.vocab_size}; the prompt is {len(prompt_ids)} tokens")
if WRITTEN:
    same = jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()),
                                     params, weights.init_params(written_cfg, seed=0)))
    print(f"loaded weights equal the written ones, bit for bit: {same}")
    assert same

# %% [markdown]
# ## 3 · Prefill
#
# The prompt's tokens go through the model as one batch of rows: the projections, norms and
# experts of every token at once, and each attention layer writes the chunk's cache entries,
# then lets every token attend over the cache causally (`mkresearch.model.prefill`). Against feeding
# the prompt one decode step at a time (`reference.prefill`): the softmax is one f32 pass instead
# of the decode step's online one, so caches may differ by a bf16 ulp or two past the first
# attention layer; the next token must not.

# %%
prompt = np.asarray([prompt_ids], np.int32)  # [1, T]
started = time.perf_counter()
logits, state = prefill.prefill(params, reference.init_state(cfg, 1), prompt, cfg)
jax.block_until_ready(state)
print(f"prefill of {prompt.shape[1]} tokens: one call per {prefill.DEFAULT_CHUNK}-token chunk, "
      f"{time.perf_counter() - started:.1f} s with its compile")
step_logits, step_state = reference.prefill(params, reference.init_state(cfg, 1), prompt, cfg)


def relative(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


worst = max(relative(a, b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(step_state)))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the prefill's next token is the one of feeding the prompt step by step
same_next = int(np.asarray(logits)[0, -1].argmax()) == int(np.asarray(step_logits)[0, -1].argmax())
print(f"the next token is the same as one step at a time: {same_next}")
assert same_next

# %%
# Measured, not a checked fact: summed in another order (another CPU, XLA's YNNPACK dots), a
# bf16 rounding can flip one routing choice, which moves the later layers' caches (0.33 of their
# range seen that way, against 0 here); tests/test_prefill.py bounds them on this machine.
print(f"caches vs one step at a time: max |diff| / max = {worst:.1e}")

# %% [markdown]
# ## 4 · Decode with the megakernel
#
# The first new token is the prefill's greedy choice; from there one megakernel call per token
# (`megakernel.decode_step`: the whole model in one `pallas_call`, TPU interpret mode on CPU),
# each token's text printed as it arrives (`TextStream`: a character split over several tokens
# comes out whole). The reference decodes from the same prefilled state; the tokens must match.
# On the notebook's checkpoint the weights are random, so the text is gibberish: most ids fall
# past the tiny tokenizer's 400 pieces (the model's vocabulary is 2048) and print as `<id>`.

# %%
prepared = mk.prepare_weights(params, cfg)
stream = TextStream(tokenizer, prompt_ids)
token = int(np.asarray(logits)[0, -1].argmax())
tokens, mk_state = [token], jax.tree.map(lambda x: x.copy(), state)
print(PROMPT, end="")
print(stream.push(token), end="", flush=True)
for i in range(N_TOKENS - 1):
    position = np.asarray([len(prompt_ids) + i], np.int32)
    next_token, mk_state, _ = mk.decode_step(prepared, mk_state, np.asarray([token], np.int32),
                                             position, cfg)
    token = int(np.asarray(next_token)[0])
    tokens.append(token)
    print(stream.push(token), end="", flush=True)
print(stream.end())  # a character the tokens stop inside comes out as replacement characters

# %%
ref_tokens, ref_state = [int(np.asarray(logits)[0, -1].argmax())], state
for i in range(N_TOKENS - 1):
    position = np.asarray([len(prompt_ids) + i], np.int32)
    step, ref_state, _ = reference.decode_step(params, ref_state,
                                               np.asarray([ref_tokens[-1]], np.int32), position, cfg)
    ref_tokens.append(int(np.asarray(step)[0].argmax()))

# %%
# NBVAL_CHECK_OUTPUT
# Checks · the megakernel's tokens are the reference's
print(f"megakernel tokens equal the reference's: {tokens == ref_tokens} ({len(tokens)} tokens)")
assert tokens == ref_tokens
