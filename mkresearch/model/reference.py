"""The reference decode step in plain JAX: the oracle every kernel is tested against.

This module and the sublayers it composes ARE the spec (docs/kimi-k3.md §2–§6): read them side by
side with it. A model is its layers, each (attention kind, FFN kind), joined by a residual strategy
(`mkresearch.model.spec`); each kind's reference sublayer lives with its weights in `mkresearch.model.stages`
(KDA, MLA, dense and MoE for Kimi K3), the arithmetic they share in `mkresearch.model.numerics`.

Choices where the spec is silent (documented, used by the kernels too):
- Sublayer outputs that feed the bf16 partial sum P are rounded once: attention `a = bf(y W_o)`;
  `routed_experts` returns f32 so `moe_ffn` rounds `bf(routed + shared)` once, as §6.6 says.
- `hidden_rms[ℓ]` is the RMS (f32) of h, the hidden state that enters layer ℓ (docs/kimi-k3.md §3.2, step 1).
- Latent MLA rounds its absorbed query q̃ and its latent context Σαĉ to bf16 (they feed the MXU);
  see `mla_attention` for where that differs from the expanded layout.
- A token's position p is the cache slot it is written to; it attends to slots 0..p.
- Where the spec leaves a summation order open, the order is one a decode kernel streams in, so
  the kernels can match to the bit: MLA's f32 online softmax starts from the new token and then
  takes the cache `cfg.kv_tile` slots at a time (`numerics.online_softmax`); the MoE combine
  Σ w_e y_e adds the experts in ascending id (batch-invariant); the KDA update is
  S̄ + k (β (v − S̄ᵀk))ᵀ.
- Batch invariance: a row's logits, caches and states are the same bits whatever the other rows
  and the batch size. Every reduction is `ordered_sum` (one written-out order) and every matmul
  runs on rows padded to a multiple of 8 (`padded_rows`); per-row products (attention, experts) are
  batched over (row, head) or (row, expert), never stacked along their rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import mkresearch.model.stages  # noqa: F401 - registers the built-in stage kinds
from mkresearch.model import spec
from mkresearch.model.config import ModelConfig
from mkresearch.model.numerics import (  # noqa: F401 - the shared arithmetic, re-exported
    HIGHEST,
    bf,
    bf16,
    f32,
    i32,
    lane_columns,
    matmul,
    mix,
    ordered_sum,
    padded_rows,
    rms_norm,
    situ,
    softmax,
)
from mkresearch.model.sampling import sample
from mkresearch.model.stages.ffn import dense_ffn, moe_ffn, route, routed_experts  # noqa: F401
from mkresearch.model.stages.kda import kda_attention, kda_projections  # noqa: F401
from mkresearch.model.stages.mla import mla_attention  # noqa: F401


def layer_params(stack: dict[str, Any], index: int) -> dict[str, Any]:
    """One layer's weights (or state) from a per-kind stack: `layer_params(params["kda"], i)`."""
    return jax.tree.map(lambda leaf: leaf[index], stack)


class LayerOfStack:
    """Layer `index` of a stacked leaf [L, E, ...] left in the stack: indexing it by expert ids
    copies those experts alone out of the stack, one dynamic slice each. The step's routed
    experts are passed so (`_sublayer`): XLA copies a slice of a stack, and a gather of whole
    experts on a TPU slices every expert too, so every MoE layer's experts taken out (16.4 GB of
    temporaries for Moonlight-16B-A3B at 9 layers) would not fit a v5e beside the weights."""

    def __init__(self, stack: jax.Array, index: int) -> None:
        self.stack, self.index = stack, index
        self.shape, self.dtype = stack.shape[1:], stack.dtype

    def __getitem__(self, ids: jax.Array) -> jax.Array:
        """The experts `ids` [...] of this layer -> [..., *shape[1:]]. As many choices as the
        layer has experts or more (a prefill's tokens): the layer's slice once, then a gather."""
        if ids.size >= self.stack.shape[1]:
            return self.stack[self.index][ids]
        rest = self.stack.shape[2:]

        def one(expert):  # [*rest]: this layer's expert, and no other byte
            start = (self.index, expert) + (0,) * len(rest)
            return jax.lax.dynamic_slice(self.stack, start, (1, 1, *rest))[0, 0]

        return jax.lax.map(one, ids.reshape(-1)).reshape(*ids.shape, *rest)


def _layer_weights(stack: dict[str, Any], index: int) -> dict[str, Any]:
    """`layer_params` with the routed experts left in their stack (`LayerOfStack`)."""
    layer = layer_params({k: v for k, v in stack.items() if k != "experts"}, index)
    if "experts" in stack:
        layer["experts"] = jax.tree.map(lambda leaf: LayerOfStack(leaf, index), stack["experts"])
    return layer


def _set_layer(stack: Any, index: int, layer: Any) -> Any:
    """The stacked pytree with entry `index` replaced by `layer` (the inverse of layer_params)."""
    return jax.tree.map(lambda whole, part: whole.at[index].set(part), stack, layer)


# ---- state -----------------------------------------------------------------------------------
def init_state(cfg: ModelConfig, batch: int, max_seq_len: int | None = None) -> dict[str, Any]:
    """Zero decode state for `batch` sequences: {kind: {leaf: [n_layers_of_kind, B, ...]}} for
    every kind with state (DEVELOPERS.md "State"), e.g. state["kda"]["recurrent"]."""
    spec.check(cfg)
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch={batch!r} is invalid: an int >= 1")
    seq = cfg.max_seq_len if max_seq_len is None else max_seq_len
    if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or seq < 1:
        raise ValueError(f"max_seq_len={max_seq_len!r} is invalid: None or an int >= 1")
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                        spec.state_shapes(cfg, int(batch), int(seq)))


def cache_length(state: dict[str, Any], cfg: ModelConfig) -> int | None:
    """Tokens the state's caches hold (None for a model without a cache)."""
    for kind, leaves in spec.state_table(cfg, 1, 1).items():
        for name, leaf in leaves.items():
            if leaf.kind == spec.CACHE:
                return int(state[kind][name].shape[leaf.token_axis])
    return None


# ---- the decode step -------------------------------------------------------------------------
def _sublayer(params, state, layer: int, kind: str, x, positions, cfg, sublayers=None):
    """Run `layer`'s sublayer of `kind` on x; returns (out, state with that layer updated, aux).
    sublayers: {kind: function} run instead of the kind's decode sublayer (`mkresearch.model.prefill`);
    one marked `stacked` (`on_stacks`) is given the kind's whole weight and state stacks and the
    layer's index within its kind, and returns the whole state stack (a backend that writes a
    cache entry in place or hands a kernel the stacked weights, `mkresearch.baselines`)."""
    run = (sublayers or {}).get(kind, spec.stage(kind).sublayer)
    index = cfg.kind_index(layer, kind)
    if getattr(run, "stacked", False):
        out, stack, aux = run(params[kind], state.get(kind, {}), index, x, positions, cfg)
        return out, ({**state, kind: stack} if kind in state else state), aux
    layer_state = layer_params(state[kind], index) if kind in state else {}
    # the kind's own reference sublayer takes its routed experts in their stack (`LayerOfStack`);
    # one given instead (a kernel, a prefill chunk) takes the layer's arrays
    weights = (_layer_weights(params[kind], index) if run is spec.stage(kind).sublayer
               else layer_params(params[kind], index))
    out, layer_state, aux = run(weights, x, layer_state, positions, cfg)
    if kind in state:
        state = {**state, kind: _set_layer(state[kind], index, layer_state)}
    return out, state, aux


def on_stacks(sublayer):
    """Mark a sublayer function (p_stack, state_stack, index, x, positions, cfg) -> (out,
    state_stack, aux) to be given the kind's whole stacks (`_sublayer`)."""
    sublayer.stacked = True
    return sublayer


def _candidates(layer: int, snapshots: list, partial: jax.Array, cfg: ModelConfig) -> jax.Array:
    """𝒜_ℓ: ℓ = 0 → {P}; ℓ = block·n, n ≥ 1 → {R_0..R_{n−1}, P}; otherwise {R_0..R_n, P}."""
    block, offset = divmod(layer, cfg.attn_res_block)
    if layer == 0:
        chosen = []
    elif offset == 0:
        chosen = snapshots[:block]
    else:
        chosen = snapshots[:block + 1]
    return jnp.stack([*chosen, partial])  # [N, B, d]


def _rms(h: jax.Array) -> jax.Array:
    h32 = h.astype(f32)
    return jnp.sqrt(ordered_sum(h32 * h32) / h.shape[-1])  # [B]


def _add(a: jax.Array, b: jax.Array) -> jax.Array:
    return bf(a.astype(f32) + b.astype(f32))


def final_logits(params: dict[str, Any], snapshots: jax.Array, partial: jax.Array,
                 cfg: ModelConfig) -> jax.Array:
    """h_L = Mix({R_0..R_last, P}; w_out); logits = RMSNorm(h_L) W_lm (f32) [B, V] (§3.3),
    soft-capped cap·tanh(l/cap) when cfg.logit_softcap is set (Kimi K3: not set)."""
    h = mix(jnp.concatenate([snapshots, partial[None]], axis=0), params["mix_out"], cfg.rms_eps)
    return head_logits(params, h, cfg)


def head_logits(params: dict[str, Any], h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """logits = RMSNorm(h) W_lm in f32 [B, V], soft-capped when cfg.logit_softcap is set."""
    logits = matmul(rms_norm(h, params["final_norm"], cfg.rms_eps, cfg.d_norm), params["lm_head"])
    if cfg.logit_softcap is not None:
        logits = cfg.logit_softcap * jnp.tanh(logits / cfg.logit_softcap)
    return logits


def _attention_mix_step(params, state, tokens, positions, cfg, sublayers=None):
    """Kimi K3's step skeleton (§3): no classic residual stream; attention residual mixes over
    block snapshots R and the block's partial sum P."""
    eps = cfg.rms_eps
    # 1. e = E[token]; R_0 = e, R_1.. = 0; P = e
    embedded = params["embed"][tokens]  # [B, d] bf16
    snapshots = [embedded] + [jnp.zeros_like(embedded)] * (cfg.n_blocks - 1)
    partial = embedded
    hidden_rms, aux = [], []
    for layer, (attention, ffn) in enumerate(cfg.layers):
        block, offset = divmod(layer, cfg.attn_res_block)
        # 2.1 h = Mix(𝒜_ℓ; w_attn[ℓ])
        h = mix(_candidates(layer, snapshots, partial, cfg), params["mix_attn"][layer], eps)
        hidden_rms.append(_rms(h))
        # 2.2 a new block starts: snapshot the partial sum of the previous one
        if offset == 0:
            snapshots[block] = partial
        # 2.3 a = Attn_ℓ(RMSNorm(h))
        x = rms_norm(h, params["attn_norm"][layer], eps)
        a, state, attention_aux = _sublayer(params, state, layer, attention, x, positions, cfg,
                                             sublayers)
        # 2.4 P ← a at a block start, else bf(P + a)
        partial = a if offset == 0 else _add(partial, a)
        # 2.5 h′ = Mix({R_0..R_n, P}; w_mlp[ℓ])
        h_ffn = mix(jnp.stack([*snapshots[:block + 1], partial]), params["mix_mlp"][layer], eps)
        # 2.6 m = FFN_ℓ(RMSNorm(h′))
        x = rms_norm(h_ffn, params["mlp_norm"][layer], eps)
        m, state, ffn_aux = _sublayer(params, state, layer, ffn, x, positions, cfg, sublayers)
        aux += [attention_aux, ffn_aux]
        # 2.7 P ← bf(P + m)
        partial = _add(partial, m)
    # 3. logits from Mix({R_0..R_last, P}; w_out)
    snapshots = jnp.stack(snapshots)  # [n_blocks, B, d]
    logits = final_logits(params, snapshots, partial, cfg)
    return logits, state, {"snapshots": snapshots, "partial": partial,
                           "hidden_rms": jnp.stack(hidden_rms), **_stack_aux(aux)}


def _prenorm_step(params, state, tokens, positions, cfg, sublayers=None):
    """A classic pre-norm residual stream: h ← bf(h + Attn(RMSNorm(h))), h ← bf(h + FFN(RMSNorm(h)))
    with the stream in bf16, then logits = RMSNorm(h) W_lm (DeepSeek, GLM, Qwen, GPT-OSS; the
    norms divide by cfg.d_norm, the checkpoint's width, where d_model pads it)."""
    eps = cfg.rms_eps
    h = params["embed"][tokens]  # [B, d] bf16
    hidden_rms, aux = [], []
    for layer, (attention, ffn) in enumerate(cfg.layers):
        hidden_rms.append(_rms(h))
        a, state, attention_aux = _sublayer(params, state, layer, attention,
                                            rms_norm(h, params["attn_norm"][layer], eps,
                                                     cfg.d_norm),
                                            positions, cfg, sublayers)
        h = _add(h, a)
        m, state, ffn_aux = _sublayer(params, state, layer, ffn,
                                      rms_norm(h, params["mlp_norm"][layer], eps, cfg.d_norm),
                                      positions, cfg, sublayers)
        h = _add(h, m)
        aux += [attention_aux, ffn_aux]
    return head_logits(params, h, cfg), state, {"hidden": h, "hidden_rms": jnp.stack(hidden_rms),
                                                **_stack_aux(aux)}


RESIDUAL_STEPS = {"attention_mix": _attention_mix_step, "prenorm": _prenorm_step}


def _stack_aux(aux: list[dict]) -> dict[str, jax.Array]:
    """Per-layer aux outputs of the sublayers, stacked in layer order by key (e.g. expert_ids
    [n_moe, B, k])."""
    keys = dict.fromkeys(key for entry in aux for key in entry)
    return {key: jnp.stack([entry[key] for entry in aux if key in entry]) for key in keys}


def decode_step_unchecked(params, state, tokens, positions, cfg):
    return RESIDUAL_STEPS[cfg.residual](params, state, tokens, positions, cfg)


decode_step_jit = jax.jit(decode_step_unchecked, static_argnames="cfg")


def check_state(state: Any, cfg: ModelConfig, batch: int) -> int | None:
    """ValueError naming what is wrong with a decode state for `batch` rows; returns the cache
    length (None without a cache)."""
    expected = spec.state_shapes(cfg, batch, 1)
    if not isinstance(state, dict) or set(state) != set(expected):
        raise ValueError(f"state is invalid: allowed the dict made by init_state(cfg, batch), "
                         f"with keys {sorted(expected)}")
    for kind, leaves in expected.items():
        got = sorted(state[kind]) if isinstance(state[kind], dict) else state[kind]
        if got != sorted(leaves):
            raise ValueError(f"state[{kind!r}] has keys {got}: allowed {sorted(leaves)} for "
                             f"{cfg.name} (mla_cache_layout={cfg.mla_cache_layout!r})")
    seq_len = cache_length(state, cfg)
    shapes = spec.state_shapes(cfg, batch, seq_len or 1)
    for kind, leaves in shapes.items():
        for name, want in leaves.items():
            got = state[kind][name]
            if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
                raise ValueError(f"state[{kind!r}][{name!r}] has shape {tuple(got.shape)} "
                                 f"{got.dtype}: allowed {tuple(want.shape)} {want.dtype} (batch "
                                 f"{batch}, cache length {seq_len})")
    return seq_len


def check_token_ids(name: str, tokens: Any, cfg: ModelConfig) -> None:
    """Concrete token ids (a traced array passes) are ints in [0, vocab_size): an id past the
    embedding table would be clamped by the gather, silently decoding another token."""
    if isinstance(tokens, jax.core.Tracer):
        return
    ids = np.asarray(tokens)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name}.dtype={ids.dtype} is invalid: integer token ids")
    bad = (ids < 0) | (ids >= cfg.vocab_size)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}{list(at)}={int(ids[at])} is invalid: token ids in [0, "
                         f"{cfg.vocab_size}) (vocab_size of {cfg.name})")


def check_step_inputs(state: Any, tokens: Any, positions: Any, cfg: ModelConfig) -> None:
    spec.check(cfg)
    if np.ndim(tokens) != 1:
        raise ValueError(f"tokens has shape {np.shape(tokens)}: allowed [B] (one token per row)")
    check_token_ids("tokens", tokens, cfg)
    batch = np.shape(tokens)[0]
    if np.shape(positions) != (batch,):
        raise ValueError(f"positions has shape {np.shape(positions)}: allowed ({batch},)")
    seq = check_state(state, cfg, batch)
    if not isinstance(positions, jax.core.Tracer) and seq is not None:
        pos = np.asarray(positions)
        if pos.min() < 0 or pos.max() >= seq:
            raise ValueError(f"positions={pos.tolist()} is invalid: ints in [0, {seq}) "
                             "(the cache length)")


def decode_step(params: dict[str, Any], state: dict[str, Any], tokens: jax.Array,
                positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, dict, dict]:
    """One decode step (§3), jitted with cfg static. tokens [B] i32, positions [B] i32.

    Returns (logits [B, V] f32, new state, aux): aux["snapshots"] [n_blocks, B, d] bf16 (R after
    the step), aux["hidden_rms"] [L, B] f32 (RMS of each layer's input h) and, with MoE layers,
    aux["expert_ids"] [n_moe, B, top_k] i32 (the routing of each MoE layer) and
    aux["routing_margin"] [n_moe, B] f32 (how far each from another choice: `ffn.routing_margin`).
    """
    check_step_inputs(state, tokens, positions, cfg)
    return decode_step_jit(params, state, jnp.asarray(tokens, i32), jnp.asarray(positions, i32),
                            cfg=cfg)


def check_prompt(prompt: Any, cfg: ModelConfig) -> None:
    if np.ndim(prompt) != 2 or np.shape(prompt)[1] < 1:
        raise ValueError(f"prompt has shape {np.shape(prompt)}: allowed [B, T] with T >= 1")
    check_token_ids("prompt", prompt, cfg)


def prefill(params: dict[str, Any], state: dict[str, Any], prompt: jax.Array, cfg: ModelConfig,
            *, start: Any = 0, expert_ids: bool = False) -> tuple:
    """Teacher-forced decode of prompt [B, T] at positions start .. start+T-1 (start: int or [B]).

    One `decode_step` per prompt token (the same compiled step as decoding: no second compile).
    Returns (logits [B, T, V] f32, the logits after each prompt token, and the new state), and
    with expert_ids each token's routing, [B, T, n_moe, top_k] i32 (aux["expert_ids"]).
    """
    check_prompt(prompt, cfg)
    batch, length = np.shape(prompt)
    start = np.broadcast_to(np.asarray(start, np.int32), (batch,))
    check_step_inputs(state, np.zeros(batch, np.int32), start + length - 1, cfg)
    prompt = jnp.asarray(prompt, i32)
    all_logits, routing = [], []
    for t in range(length):
        logits, state, aux = decode_step(params, state, prompt[:, t], start + t, cfg)
        all_logits.append(logits)
        routing.append(aux.get("expert_ids", jnp.zeros((0, batch, 0), i32)).swapaxes(0, 1))
    if expert_ids:
        return jnp.stack(all_logits, axis=1), state, jnp.stack(routing, axis=1)
    return jnp.stack(all_logits, axis=1), state


def generate(params: dict[str, Any], state: dict[str, Any], prompt: jax.Array, n_steps: int,
             cfg: ModelConfig, *, seed: int = 0, temperature: Any = None, top_k: Any = 0,
             top_p: Any = 1.0) -> tuple[jax.Array, dict]:
    """Prefill prompt [B, T] at positions 0..T-1, then sample n_steps tokens with
    mkresearch.model.sampling.sample (temperature None = greedy, else > 0, per row or scalar); token i
    is drawn with position T + i.

    Returns (tokens [B, n_steps] i32, state). The state has consumed the prompt and all generated
    tokens but the last (which has not been fed back yet).
    """
    if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or n_steps < 1:
        raise ValueError(f"n_steps={n_steps!r} is invalid: an int >= 1")
    check_prompt(prompt, cfg)
    batch, length = np.shape(prompt)
    check_step_inputs(state, np.zeros(batch, np.int32),
                       np.full(batch, length + n_steps - 2, np.int32), cfg)
    logits, state = prefill(params, state, prompt, cfg)
    logits = logits[:, -1]
    tokens = []
    for i in range(n_steps):
        position = np.full(batch, length + i, np.int32)
        tokens.append(sample(logits, seed=seed, positions=position, temperature=temperature,
                             top_k=top_k, top_p=top_p))
        if i + 1 < n_steps:  # feed the token back (the last one is only returned)
            logits, state, _ = decode_step(params, state, tokens[-1], position, cfg)
    return jnp.stack(tokens, axis=1), state
