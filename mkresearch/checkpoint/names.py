"""Each published tensor name mapped to our parameters (docs/checkpoints.md §1).

Published linear weights are [out, in] (PyTorch); ours are [in, out] (DEVELOPERS.md
"Parameters"), so every matrix is transposed. DeepSeek-V3's rope columns are stored interleaved
(pairs 2i, 2i+1, `rope_interleave` in transformers' config, true by default); ours rotate halves
(`mkresearch.rope`), so the rope columns of W_qb (each head) and W_kva are de-interleaved at load
(`rope.deinterleave`; Moonlight's W_q likewise) and interleaved again when written. Routed experts, one tensor per expert
as published, are stacked into [E, in, out] and quantised into our expert format.

`layer_entries(cfg, layer)` lists one layer's entries, `trunk_entries(cfg)` the embedding, LM
head and final norm: each says which of our leaves (kind, name, stack index) it fills, from which
published names and shapes, and how (`to_ours` / `to_published`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mkresearch.model import rope
from mkresearch.model.config import ModelConfig

Transform = Callable[[list[np.ndarray]], np.ndarray]
TENSOR = "tensor"  # an axis of ours that runs over the entry's published tensors (stacked)


@dataclass(frozen=True)
class Source:
    """Where one axis of our leaf comes from: published axis `axis` (TENSOR: the entry's
    published tensors, in `names` order), our index j at published index order[j] (None: j),
    our indices from `length` on zero padding (None: none). Published axes no axis of ours names
    have length 1 (read at 0). What a rank's slice reads (`mkresearch.checkpoint.rank_loader`)."""

    axis: int | str
    order: tuple[int, ...] | None = None
    length: int | None = None


def _identity(ndim: int) -> tuple[Source, ...]:
    return tuple(Source(axis) for axis in range(ndim))


@dataclass(frozen=True)
class Entry:
    """Our leaf `key` (a path into the params, at stack `index` when per layer) from the published
    `names` (shapes `shapes`): `to_ours(arrays)` -> our f32 array, `to_published(ours)` -> the
    published arrays in `names` order."""

    key: tuple[str, ...]
    index: int | None
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    to_ours: Transform
    to_published: Callable[[np.ndarray], list[np.ndarray]]
    quantized: bool = False  # routed experts: stored in cfg.expert_format
    linear: bool = False  # a projection the FP8 release stores in FP8 with block scales
    # each axis of our array (one layer's): where `to_ours` takes it from; read by slices
    sources: tuple[Source, ...] = ()
    # `to_ours` takes the tensors as stored (not f32) and gives our value as it is kept: a
    # subtree (GPT-OSS's experts, `gpt_oss_names`), MXFP4 matrices as our parts; `to_published`
    # takes that subtree as our params hold it
    packed: bool = False
    dtypes: tuple[str | None, ...] = ()  # per name: the stored dtype required (None: a float)


def _copy(key, index, name, shape) -> Entry:
    return Entry(key, index, (name,), (shape,), lambda a: a[0], lambda w: [w],
                 sources=_identity(len(shape)))


def _linear(key, index, name, n_in, n_out, permute=None) -> Entry:
    """A published [out, in] weight as our [in, out], columns permuted by `permute`."""
    order = np.arange(n_out) if permute is None else permute
    inverse = np.argsort(order)
    return Entry(key, index, (name,), ((n_out, n_in),),
                 lambda a: np.ascontiguousarray(a[0].T[:, order]),
                 lambda w: [np.ascontiguousarray(w[:, inverse].T)], linear=True,
                 sources=(Source(1), Source(0, None if permute is None else
                                            tuple(int(i) for i in order))))


def _padded(key, index, name, n_in, n_out, published_in, published_out) -> Entry:
    """A published [published_out, published_in] weight as our [n_in, n_out] (a lane multiple),
    zero-padded at load and cut when written. Exact for a gated MLP's hidden: SiLU(0) * 0 = 0."""
    def to_ours(arrays):
        ours = np.zeros((n_in, n_out), np.float32)
        ours[:published_in, :published_out] = arrays[0].T
        return ours

    return Entry(key, index, (name,), ((published_out, published_in),), to_ours,
                 lambda w: [np.ascontiguousarray(w[:published_in, :published_out].T)], linear=True,
                 sources=(Source(1, None, published_in), Source(0, None, published_out)))


def _experts(key, index, names, n_in, n_out) -> Entry:
    return Entry(key, index, tuple(names), ((n_out, n_in),) * len(names),
                 lambda a: np.stack([w.T for w in a]),
                 lambda w: [np.ascontiguousarray(m.T) for m in w], quantized=True, linear=True,
                 sources=(Source(TENSOR), Source(1), Source(0)))


def _rope_columns(cfg: ModelConfig, width: int, start: int, every: int, interleaved: bool):
    """Column order de-interleaving the rope dims at `start` of each `every` columns."""
    order = np.arange(width)
    if not interleaved:
        return order
    perm = rope.deinterleave(cfg.mla_qk_extra)
    for base in range(0, width, every):
        order[base + start:base + start + cfg.mla_qk_extra] = base + start + perm
    return order


def _attention(cfg: ModelConfig, layer: int, interleaved: bool) -> list[Entry]:
    kind = cfg.attention_kinds[layer]
    i, p, d = cfg.attention_index(layer), f"model.layers.{layer}.self_attn.", cfg.d_model
    if kind == "gqa":
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        out = [_linear((kind, "w_q"), i, p + "q_proj.weight", d, q),
               _linear((kind, "w_k"), i, p + "k_proj.weight", d, kv),
               _linear((kind, "w_v"), i, p + "v_proj.weight", d, kv),
               _linear((kind, "w_o"), i, p + "o_proj.weight", q, d)]
        if cfg.attention_bias:
            out += [_copy((kind, f"b_{n}"), i, p + f"{n}_proj.bias", (w,))
                    for n, w in (("q", q), ("k", kv), ("v", kv))]
        if cfg.qk_norm:
            out += [_copy((kind, f"{n}_norm"), i, p + f"{n}_norm.weight", (cfg.head_dim,))
                    for n in ("q", "k")]
        return out
    if kind == "kda":
        return _kda(cfg, i, p)
    if kind == "mla" and cfg.mla_output_gate:
        raise NotImplementedError("Kimi K3's gated MLA has no published tensor names")
    if kind in ("mla_rope", "mla"):  # Kimi Linear's MLA: no RoPE (mla_use_nope), no gate
        interleaved = interleaved and kind == "mla_rope"
        heads, rank = cfg.n_heads, cfg.mla_kv_rank
        qb = cfg.n_heads * cfg.mla_qk_dim
        kva = rank + cfg.mla_qk_extra
        q_columns = _rope_columns(cfg, qb, cfg.mla_qk_nope, cfg.mla_qk_dim, interleaved)
        if cfg.mla_q_rank == 0:  # Moonlight: the query projected directly, no q LoRA
            queries = [_linear((kind, "w_q"), i, p + "q_proj.weight", d, qb, q_columns)]
        else:
            queries = [
                _linear((kind, "w_qa"), i, p + "q_a_proj.weight", d, cfg.mla_q_rank),
                _copy((kind, "q_norm"), i, p + "q_a_layernorm.weight", (cfg.mla_q_rank,)),
                _linear((kind, "w_qb"), i, p + "q_b_proj.weight", cfg.mla_q_rank, qb, q_columns)]
        return [
            *queries,
            _linear((kind, "w_kva"), i, p + "kv_a_proj_with_mqa.weight", d, kva,
                    _rope_columns(cfg, kva, rank, kva, interleaved)),
            _copy((kind, "kv_norm"), i, p + "kv_a_layernorm.weight", (rank,)),
            _linear((kind, "w_kvb"), i, p + "kv_b_proj.weight", rank,
                    heads * (cfg.mla_qk_nope + cfg.mla_v_dim)),
            _linear((kind, "w_o"), i, p + "o_proj.weight", heads * cfg.mla_v_dim, d)]
    raise NotImplementedError(f"attention kind {kind!r} has no published tensor names")


def _kda(cfg: ModelConfig, i: int, p: str) -> list[Entry]:
    """Kimi Linear's KDA (fla's KimiDeltaAttention): short convs [H·D, 1, K] (tap K-1 the current
    token, as ours), A_log [1, 1, H, 1], the low-rank decay and output gates."""
    kind, d, hd, heads = "kda", cfg.d_model, cfg.kda_width, cfg.n_heads
    convs = tuple(p + f"{n}_conv1d.weight" for n in "qkv")
    if cfg.kda_output_gate_rank:
        gate = [_linear((kind, "w_ga"), i, p + "g_a_proj.weight", d, cfg.kda_output_gate_rank),
                _linear((kind, "w_gb"), i, p + "g_b_proj.weight", cfg.kda_output_gate_rank, hd)]
    else:
        gate = [_linear((kind, "w_g"), i, p + "g_proj.weight", d, hd)]
    return [*(_linear((kind, f"w_{n}"), i, p + f"{n}_proj.weight", d, hd) for n in "qkv"),
            Entry((kind, "conv_w"), i, convs, ((hd, 1, cfg.kda_conv_size),) * 3,
                  lambda a: np.stack([w[:, 0, :].T for w in a]),
                  lambda w: [np.ascontiguousarray(m.T[:, None, :]) for m in w],
                  sources=(Source(TENSOR), Source(2), Source(0))),
            _linear((kind, "w_fa"), i, p + "f_a_proj.weight", d, cfg.kda_gate_rank),
            _linear((kind, "w_fb"), i, p + "f_b_proj.weight", cfg.kda_gate_rank, hd),
            *gate, _linear((kind, "w_b"), i, p + "b_proj.weight", d, heads),
            Entry((kind, "a_log"), i, (p + "A_log",), ((1, 1, heads, 1),),
                  lambda a: a[0].reshape(heads), lambda w: [w.reshape(1, 1, heads, 1)],
                  sources=(Source(2),)),
            _copy((kind, "dt_bias"), i, p + "dt_bias", (hd,)),
            _copy((kind, "o_norm"), i, p + "o_norm.weight", (cfg.kda_head_dim,)),
            _linear((kind, "w_o"), i, p + "o_proj.weight", hd, d)]


def _ffn(cfg: ModelConfig, layer: int, dense_published: int | None) -> list[Entry]:
    kind = cfg.ffn_kinds[layer]
    i, p, d = cfg.ffn_index(layer), f"model.layers.{layer}.mlp.", cfg.d_model
    if kind == "dense":
        f, g = cfg.dense_hidden, dense_published or cfg.dense_hidden
        return [_padded((kind, "w_gate"), i, p + "gate_proj.weight", d, f, d, g),
                _padded((kind, "w_up"), i, p + "up_proj.weight", d, f, d, g),
                _padded((kind, "w_down"), i, p + "down_proj.weight", f, d, g, d)]
    if kind != "moe_full":
        raise NotImplementedError(f"FFN kind {kind!r} has no published tensor names")
    e, f = cfg.n_experts, cfg.expert_hidden
    kimi = "kda" in cfg.kinds  # Kimi Linear: block_sparse_moe, experts w1 (gate) w3 (up) w2
    if kimi:
        p = f"model.layers.{layer}.block_sparse_moe."
    router = _linear((kind, "w_router"), i, p + "gate.weight", d, e)
    out = [Entry(router.key, i, router.names, router.shapes, router.to_ours, router.to_published,
                 sources=router.sources)]
    if cfg.router_bias:
        out.append(_copy((kind, "router_bias"), i, p + "gate.e_score_correction_bias", (e,)))
    out += [_experts((kind, "experts", ours), i,
                     [f"{p}experts.{x}.{ours if kimi else theirs}.weight" for x in range(e)],
                     *dims)
            for ours, theirs, dims in (("w1", "gate_proj", (d, f)), ("w3", "up_proj", (d, f)),
                                       ("w2", "down_proj", (f, d)))]
    if cfg.n_shared_experts:
        s = cfg.shared_hidden
        out += [_linear((kind, "w_sg"), i, p + "shared_experts.gate_proj.weight", d, s),
                _linear((kind, "w_su"), i, p + "shared_experts.up_proj.weight", d, s),
                _linear((kind, "w_sd"), i, p + "shared_experts.down_proj.weight", s, d)]
    return out


def layer_entries(cfg: ModelConfig, layer: int, *, interleaved: bool = True,
                  dense_published: int | None = None) -> list[Entry]:
    """Every entry of one layer: its two norms, its attention and its FFN. `dense_published`: the
    checkpoint's dense hidden (`intermediate_size`) when ours is it rounded up to 128 lanes."""
    p, d = f"model.layers.{layer}.", cfg.d_model
    return [_copy(("attn_norm",), layer, p + "input_layernorm.weight", (d,)),
            _copy(("mlp_norm",), layer, p + "post_attention_layernorm.weight", (d,)),
            *_attention(cfg, layer, interleaved), *_ffn(cfg, layer, dense_published)]


def trunk_entries(cfg: ModelConfig) -> list[Entry]:
    d, v = cfg.d_model, cfg.vocab_size
    head = _linear(("lm_head",), None, "lm_head.weight", d, v)
    return [_copy(("embed",), None, "model.embed_tokens.weight", (v, d)),
            Entry(head.key, None, head.names, head.shapes, head.to_ours, head.to_published,
                  sources=head.sources),
            _copy(("final_norm",), None, "model.norm.weight", (d,))]


def check_supported(cfg: ModelConfig) -> None:
    """ValueError naming the field when cfg has a kind without published names."""
    if cfg.residual != "prenorm":
        raise ValueError(f"ModelConfig.residual={cfg.residual!r} has no published tensor names: "
                         "'prenorm' (DeepSeek-V3, Qwen3-MoE, GLM-4.5, Kimi Linear)")
    if "mla" in cfg.attention_kinds and cfg.mla_output_gate:
        raise ValueError("ModelConfig.mla_output_gate=True has no published tensor names: False "
                         "(Kimi Linear's MLA)")
    for field, kinds, allowed in (("attention", cfg.attention_kinds,
                                   ("gqa", "mla_rope", "kda", "mla")),
                                  ("ffn", cfg.ffn_kinds, ("dense", "moe_full"))):
        for kind in set(kinds) - set(allowed):
            raise ValueError(f"ModelConfig.{field}={getattr(cfg, field)!r} has no published tensor "
                             f"names for kind {kind!r}: kinds {', '.join(allowed)}")
