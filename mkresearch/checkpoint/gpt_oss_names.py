"""GPT-OSS's published tensors mapped to our parameters (docs/checkpoints.md §6).

    model.embed_tokens.weight [V, 2880], lm_head.weight [V, 2880], model.norm.weight
    model.layers.N.input_layernorm.weight, post_attention_layernorm.weight
    model.layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}, self_attn.sinks [H]
    model.layers.N.mlp.router.{weight [E, 2880], bias [E]}
    model.layers.N.mlp.experts.gate_up_proj [E, 2880, 2 F], gate_up_proj_bias [E, 2 F],
                              down_proj [E, F, 2880], down_proj_bias [E, 2880]      (bf16)
    or, MXFP4 as released (`quantization_config` {"quant_method": "mxfp4"}):
                              gate_up_proj_blocks [E, 2 F, 90, 16] U8, gate_up_proj_scales
                              [E, 2 F, 90] U8, down_proj_blocks [E, 2880, F / 32, 16] U8,
                              down_proj_scales [E, 2880, F / 32] U8, and the biases

The experts' matrices are stored [in, out] (unlike the projections, [out, in]); gate and up are
the even and odd output columns of `gate_up_proj` (transformers' `GptOssExperts._apply_gate`).
Every width of 2880 is zero-padded to our 2944 (`ModelConfig.d_model_checkpoint`) at load and cut
when written. Every entry is `packed`: read in its stored dtype (bf16 stays bf16: the 201,088-row
embedding and LM head are never widened to f32 on the host) and written in ours.

MXFP4 blocks are read straight into our layout, never through bf16: a published block row holds
32 E2M1 values of one output column in 16 bytes, element 2i in the low nibble of byte i (the OCP
MX layout transformers decodes); four consecutive bytes read as a little-endian uint32 are our
word of 8 nibbles, low nibble first (`formats.mxfp4_pack`'s), so the codes are the bytes
reinterpreted and transposed to [K / 8, N]. The E8M0 scales are ours as they are, transposed to
[K / 32, N]. The padding's codes are zero (value 0) and its scales 127 (2^0), what our quantiser
gives a block of zeros.
"""

from __future__ import annotations

import numpy as np

from mkresearch.checkpoint.names import Entry
from mkresearch.model import formats
from mkresearch.model.config import MXFP4_BLOCK, ModelConfig

UNIT_SCALE = 127  # E8M0 2^0: the scale our quantiser gives an all-zero block (the padding)
WORD_BYTES = 4  # one uint32 code word: 8 nibbles
BLOCK_BYTES = MXFP4_BLOCK // 2  # one published block row: 32 nibbles


def _pad(array: np.ndarray, shape: tuple[int, ...], fill: float = 0) -> np.ndarray:
    """`array` at the start of an array of `shape` filled with `fill` (each axis as long or
    longer)."""
    out = np.full(shape, fill, array.dtype)
    out[tuple(slice(0, n) for n in array.shape)] = array
    return out


def _cut(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return np.ascontiguousarray(array[tuple(slice(0, n) for n in shape)])


def _vector(key, index, name, width: int, ours: int) -> Entry:
    """A published vector [width] (a norm's gain, a bias) as ours [ours], zero-padded."""
    return Entry(key, index, (name,), ((width,),), lambda a: _pad(a[0], (ours,)),
                 lambda w: [_cut(w, (width,))], packed=True)


def _projection(key, index, name, n_in: int, n_out: int, ours: tuple[int, int]) -> Entry:
    """A published projection [out, in] as our [in, out], each axis zero-padded to `ours`."""
    return Entry(key, index, (name,), ((n_out, n_in),), lambda a: _pad(a[0].T, ours),
                 lambda w: [_cut(w, (n_in, n_out)).T.copy()], packed=True)


# ---- MXFP4 blocks <-> our codes ------------------------------------------------------------------
def blocks_to_codes(blocks: np.ndarray, scales: np.ndarray, k: int, n: int) -> dict:
    """Published MXFP4 blocks [E, N', G, 16] U8 and scales [E, N', G] U8 (output column N', K'
    = 32 G values each) -> our {"codes": uint32 [E, k / 8, n], "scales": uint8 [E, k / 32, n]},
    the padding past K' and N' zero codes and unit scales. No value is decoded."""
    experts, columns, groups, _ = blocks.shape
    words = np.ascontiguousarray(blocks).reshape(experts, columns, groups * BLOCK_BYTES)
    words = words.view("<u4").astype(np.uint32)  # [E, N', K'/8]: bytes 4j..4j+3 -> word j
    return {"codes": _pad(words.transpose(0, 2, 1), (experts, k // 8, n)),
            "scales": _pad(scales.transpose(0, 2, 1), (experts, k // MXFP4_BLOCK, n),
                           UNIT_SCALE)}


def codes_to_blocks(packed: dict, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Our {"codes" [E, K/8, N], "scales" [E, K/32, N]} -> the published blocks [E, n, k/32, 16]
    and scales [E, n, k/32] of its first k rows and n columns (the inverse of blocks_to_codes)."""
    codes, scales = np.asarray(packed["codes"]), np.asarray(packed["scales"])
    experts = codes.shape[0]
    words = np.ascontiguousarray(codes[:, :k // 8, :n].transpose(0, 2, 1)).astype("<u4")
    blocks = words.view(np.uint8).reshape(experts, n, k // MXFP4_BLOCK, BLOCK_BYTES)
    return blocks, np.ascontiguousarray(scales[:, :k // MXFP4_BLOCK, :n].transpose(0, 2, 1))


# ---- the experts: one entry per layer, every leaf of our experts subtree -------------------------
def _experts(cfg: ModelConfig, index: int, prefix: str, mxfp4: bool) -> Entry:
    """The layer's experts subtree {w1, w3, w2, b1, b3, b2} (`Entry.packed`: our values as they
    are stored; MXFP4 matrices as our parts, bf16 ones in f32 for the loader to put into
    cfg.expert_format)."""
    e, d, f = cfg.n_experts, cfg.d_model, cfg.expert_hidden
    dc, fc = cfg.d_norm, cfg.expert_hidden_checkpoint or cfg.expert_hidden
    p = prefix + "experts."
    biases = {"gate_up_proj_bias": (e, 2 * fc), "down_proj_bias": (e, dc)}

    def bias_tree(gate_up_bias, down_bias):
        return {"b1": _pad(gate_up_bias[:, 0::2], (e, f)), "b3": _pad(gate_up_bias[:, 1::2], (e, f)),
                "b2": _pad(down_bias, (e, d))}

    def published_biases(ours):
        b1, b3, b2 = (np.asarray(ours[b]) for b in ("b1", "b3", "b2"))
        gate_up = np.empty((e, 2 * fc), b1.dtype)
        gate_up[:, 0::2], gate_up[:, 1::2] = _cut(b1, (e, fc)), _cut(b3, (e, fc))
        return [gate_up, _cut(b2, (e, dc))]

    if not mxfp4:
        shapes = {"gate_up_proj": (e, dc, 2 * fc), **{k: v for k, v in biases.items()
                                                      if k.startswith("gate")},
                  "down_proj": (e, fc, dc), "down_proj_bias": biases["down_proj_bias"]}

        def to_ours(arrays):
            gate_up, gate_up_bias, down, down_bias = arrays
            return {"w1": _pad(gate_up[..., 0::2], (e, d, f)),
                    "w3": _pad(gate_up[..., 1::2], (e, d, f)), "w2": _pad(down, (e, f, d)),
                    **bias_tree(gate_up_bias, down_bias)}

        def to_published(ours):
            w = {m: np.asarray(formats.dequantize(ours[m], cfg.expert_format))  # bf16
                 for m in ("w1", "w3", "w2")}
            gate_up = np.empty((e, dc, 2 * fc), w["w1"].dtype)
            gate_up[..., 0::2], gate_up[..., 1::2] = _cut(w["w1"], (e, dc, fc)), _cut(
                w["w3"], (e, dc, fc))
            gate_up_bias, down_bias = published_biases(ours)
            return [gate_up, gate_up_bias, _cut(w["w2"], (e, fc, dc)), down_bias]

        return Entry(("moe_full", "experts"), index, tuple(p + n for n in shapes),
                     tuple(shapes.values()), to_ours, to_published, packed=True)

    shapes = {"gate_up_proj_blocks": (e, 2 * fc, dc // MXFP4_BLOCK, BLOCK_BYTES),
              "gate_up_proj_scales": (e, 2 * fc, dc // MXFP4_BLOCK),
              "gate_up_proj_bias": biases["gate_up_proj_bias"],
              "down_proj_blocks": (e, dc, fc // MXFP4_BLOCK, BLOCK_BYTES),
              "down_proj_scales": (e, dc, fc // MXFP4_BLOCK),
              "down_proj_bias": biases["down_proj_bias"]}
    dtypes = tuple("U8" if n.endswith(("_blocks", "_scales")) else None for n in shapes)

    def to_ours_mxfp4(arrays):
        gu_blocks, gu_scales, gu_bias, down_blocks, down_scales, down_bias = arrays
        return {"w1": blocks_to_codes(gu_blocks[:, 0::2], gu_scales[:, 0::2], d, f),
                "w3": blocks_to_codes(gu_blocks[:, 1::2], gu_scales[:, 1::2], d, f),
                "w2": blocks_to_codes(down_blocks, down_scales, f, d),
                **bias_tree(gu_bias, down_bias)}

    def to_published_mxfp4(ours):
        gate, up = (codes_to_blocks(_as_mxfp4(ours[m], cfg), dc, fc) for m in ("w1", "w3"))
        gu_blocks = np.empty((e, 2 * fc, *gate[0].shape[2:]), np.uint8)
        gu_scales = np.empty((e, 2 * fc, gate[1].shape[2]), np.uint8)
        gu_blocks[:, 0::2], gu_blocks[:, 1::2] = gate[0], up[0]
        gu_scales[:, 0::2], gu_scales[:, 1::2] = gate[1], up[1]
        down = codes_to_blocks(_as_mxfp4(ours["w2"], cfg), fc, dc)
        gate_up_bias, down_bias = published_biases(ours)
        return [gu_blocks, gu_scales, gate_up_bias, down[0], down[1], down_bias]

    return Entry(("moe_full", "experts"), index, tuple(p + n for n in shapes),
                 tuple(shapes.values()), to_ours_mxfp4, to_published_mxfp4, packed=True,
                 dtypes=dtypes)


def _as_mxfp4(weight, cfg: ModelConfig) -> dict:
    """One expert matrix in our MXFP4 parts (quantised from cfg.expert_format if it is not)."""
    if cfg.expert_format == "mxfp4":
        return weight
    return formats.mxfp4_pack(formats.dequantize(weight, cfg.expert_format))


# ---- every entry ----------------------------------------------------------------------------------
def trunk_entries(cfg: ModelConfig) -> list[Entry]:
    d, dc, v = cfg.d_model, cfg.d_norm, cfg.vocab_size
    return [Entry(("embed",), None, ("model.embed_tokens.weight",), ((v, dc),),
                  lambda a: _pad(a[0], (v, d)), lambda w: [_cut(w, (v, dc))], packed=True),
            _projection(("lm_head",), None, "lm_head.weight", dc, v, (d, v)),
            _vector(("final_norm",), None, "model.norm.weight", dc, d)]


def layer_entries(cfg: ModelConfig, layer: int, *, mxfp4: bool) -> list[Entry]:
    """One layer's entries: its norms, its attention (either sink kind) and its experts."""
    d, dc = cfg.d_model, cfg.d_norm
    p = f"model.layers.{layer}."
    kind, i = cfg.attention_kinds[layer], cfg.attention_index(layer)
    a = p + "self_attn."
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = [_vector(("attn_norm",), layer, p + "input_layernorm.weight", dc, d),
           _vector(("mlp_norm",), layer, p + "post_attention_layernorm.weight", dc, d),
           _projection((kind, "w_q"), i, a + "q_proj.weight", dc, q, (d, q)),
           _projection((kind, "w_k"), i, a + "k_proj.weight", dc, kv, (d, kv)),
           _projection((kind, "w_v"), i, a + "v_proj.weight", dc, kv, (d, kv)),
           _projection((kind, "w_o"), i, a + "o_proj.weight", q, dc, (q, d)),
           _vector((kind, "sinks"), i, a + "sinks", cfg.n_heads, cfg.n_heads)]
    if cfg.attention_bias:
        out += [_vector((kind, f"b_{n}"), i, a + f"{n}_proj.bias", w, w)
                for n, w in (("q", q), ("k", kv), ("v", kv))]
        out.append(_vector((kind, "b_o"), i, a + "o_proj.bias", dc, d))
    m, j = p + "mlp.", cfg.ffn_index(layer)
    return [*out, _projection(("moe_full", "w_router"), j, m + "router.weight", dc, cfg.n_experts,
                              (d, cfg.n_experts)),
            _vector(("moe_full", "router_bias"), j, m + "router.bias", cfg.n_experts,
                    cfg.n_experts),
            _experts(cfg, j, m, mxfp4)]


def is_gpt_oss(cfg: ModelConfig) -> bool:
    """Whether cfg's tensors are named as GPT-OSS's (its attention kinds)."""
    return any(kind.startswith("gqa_sink") for kind in cfg.attention_kinds)
