"""Speculative decoding, the reference: verify K drafts per row in one step, accept, roll back.

One speculative step for B rows: a drafter (`mkresearch.decoding.drafters`) proposes K tokens after each
row's last accepted token; the target model scores the K + 1 tokens [last accepted, d_1..d_K]
causally (`verify_step`), an acceptance rule keeps a prefix of the drafts plus one token of the
target's own (`accept_greedy`, `accept_in_call`, `accept_sampled`), and the state is rolled back
to the kept tokens (`rollback`). `speculative_generate` runs the loop; it is lossless: greedy
speculative decoding emits exactly the tokens of plain greedy decoding and ends with the same
caches and states, bit for bit (the reference decode step is batch-invariant, so a row's numbers
do not depend on which other rows or positions share its step).

The reference is the spec: verification IS decoding the K + 1 tokens one by one through
`reference.decode_step` (the same compiled step), keeping every position's logits and the
recurrent state after every position. The megakernel does the same in one call (one weight pass
for all K + 1 tokens per row); `speculative_generate(verify=...)` takes either.

Rollback: what the state must be after acceptance is exactly the state of decoding the kept tokens
one by one. Recurrent leaves (KDA's recurrent state S and its conv window) cannot be un-updated,
so the verify keeps their value after every position (`per_position`, [K + 1, *leaf]) and
rollback picks the one at the last kept token. Caches are written at each token's own slot, so
rollback only zeroes the rows of rejected tokens (slot >= position + kept): plain decoding never
wrote them, and later steps never see them. What keeping per-position states costs is
`per_position_bytes`: for Kimi K3 at full size one KDA layer holds, per row and per position,
6,291,456 B of recurrent state (96 heads x 128 x 128 f32) plus 221,184 B of conv window
(3 x 3 x 96 x 128 bf16) = 6,512,640 B; K = 6 keeps 7 of them, 45,588,480 B per layer and row,
3.15 GB per row over the 69 KDA layers. One rank of the release's layout (3 heads) keeps 203,520 B
per layer, row and position: 1.42 MB per layer and row at K = 6, 98.3 MB per row over the layers
— more than a TPU7x core's 64 MiB of VMEM for one row, since acceptance is known only after the
last layer. So a kernel either writes them to HBM (the per-layer K + 1 states pass through VMEM
one layer at a time) or keeps only the state before the step and recomputes the kept prefix;
tests/test_speculative.py holds these numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkresearch.decoding import acceptance, drafters
from mkresearch.model import reference, sampling, spec
from mkresearch.model.config import ModelConfig
from mkresearch.model.numerics import mix

MAX_DRAFTS = 7  # K: drafts verified per row in one step (issue 16)
MAX_ROWS = 64  # B x (K + 1): the token rows one verify call scores
HIDDEN = "hidden"  # per_position key of the final hidden state after each token (optional)


# ---- checks ----------------------------------------------------------------------------------
def check_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_DRAFTS:
        raise ValueError(f"k={k!r} is invalid: an int in [1, {MAX_DRAFTS}] (drafts per row)")
    return int(k)


def check_rows(batch: int, k: int) -> None:
    if batch * (k + 1) > MAX_ROWS:
        raise ValueError(f"batch x (k + 1) = {batch} x {k + 1} = {batch * (k + 1)} rows is "
                         f"invalid: at most {MAX_ROWS} token rows per verify call")


def _check_verify_inputs(state, tokens, positions, cfg: ModelConfig) -> tuple[int, int]:
    if np.ndim(tokens) != 2 or np.shape(tokens)[1] < 2:
        raise ValueError(f"tokens has shape {np.shape(tokens)}: allowed [B, K + 1] with K in "
                         f"[1, {MAX_DRAFTS}] (the last accepted token, then K drafts)")
    batch, width = np.shape(tokens)
    k = check_k(width - 1)
    check_rows(batch, k)
    if np.shape(positions) != (batch,):
        raise ValueError(f"positions has shape {np.shape(positions)}: allowed ({batch},)")
    reference.check_step_inputs(state, tokens[:, 0], positions, cfg)
    seq = reference.cache_length(state, cfg)
    last = np.asarray(positions) + k
    if seq is not None and last.max() >= seq:
        raise ValueError(f"positions + K = {last.tolist()} is invalid: ints in [0, {seq}) (the "
                         "cache length; the last draft goes there)")
    return batch, k


# ---- verify: K + 1 tokens per row, one by one ------------------------------------------------
def recurrent_leaves(cfg: ModelConfig) -> dict[str, list[str]]:
    """kind -> the state leaves that are not caches (KDA: conv, recurrent): what rollback needs
    per position."""
    return {kind: [name for name, leaf in leaves.items() if leaf.kind != spec.CACHE]
            for kind, leaves in spec.state_table(cfg, 1, 1).items()}


def final_hidden(params: dict, aux: dict, cfg: ModelConfig) -> jax.Array:
    """The last hidden state [B, d] bf16 the LM head reads (before its RMSNorm): the pre-norm
    stream, or Kimi's output mix over the block snapshots and the partial sum."""
    if HIDDEN in aux:
        return aux[HIDDEN]
    return _output_mix(aux["snapshots"], aux["partial"], params["mix_out"], cfg.rms_eps)


@functools.partial(jax.jit, static_argnames="eps")
def _output_mix(snapshots, partial, w, eps):
    return mix(jnp.concatenate([snapshots, partial[None]], axis=0), w, eps)


def feed(params: dict, state: dict, tokens: Any, positions: Any, cfg: ModelConfig,
         keep_states: bool = True) -> tuple[jax.Array, dict, dict]:
    """Decode tokens [B, n] at positions + 0..n-1 one by one (`reference.decode_step`).

    Returns (logits [B, n, V] f32, state after all n, per_position): per_position[kind][leaf]
    [n, *leaf] for every recurrent leaf (when keep_states), and per_position["hidden"] [n, B, d]
    (`final_hidden` after each token).
    """
    tokens = np.asarray(tokens, np.int32)
    positions = np.asarray(positions, np.int32)
    keep = recurrent_leaves(cfg) if keep_states else {}
    logits, hidden, kept = [], [], {kind: {name: [] for name in names}
                                    for kind, names in keep.items()}
    for j in range(tokens.shape[1]):
        step_logits, state, aux = reference.decode_step(params, state, tokens[:, j],
                                                        positions + j, cfg)
        logits.append(step_logits)
        hidden.append(final_hidden(params, aux, cfg))
        for kind, names in keep.items():
            for name in names:
                kept[kind][name].append(state[kind][name])
    per_position = {kind: {name: jnp.stack(values) for name, values in leaves.items()}
                    for kind, leaves in kept.items()}
    per_position[HIDDEN] = jnp.stack(hidden)
    return jnp.stack(logits, axis=1), state, per_position


def verify_step(params: dict, state: dict, tokens: Any, positions: Any,
                cfg: ModelConfig) -> tuple[jax.Array, dict, dict]:
    """Score tokens [B, K + 1] (the last accepted token, then K drafts) at positions [B] (of
    tokens[:, 0]) + 0..K, causally within each row: verification is decoding them one by one.

    Returns (logits [B, K + 1, V] f32: logits[:, j] predicts the token after tokens[:, j];
    state_all: the state after all K + 1 tokens, caches holding all K + 1 rows; per_position:
    {kind: {leaf: [K + 1, *leaf]}} for every leaf that is not a cache (KDA's recurrent and conv
    states) after each token, and "hidden" [K + 1, B, d], the final hidden state after each token
    (optional for other verifies: only the MTP drafter reads it)). ValueError on K outside
    [1, 7], B x (K + 1) > 64 rows, or positions + K beyond the cache.
    """
    _check_verify_inputs(state, tokens, positions, cfg)
    return feed(params, state, tokens, positions, cfg)


# ---- rollback --------------------------------------------------------------------------------
def _rollback(state_all, per_position, positions, kept, cfg):
    table = spec.state_table(cfg, 1, 1)
    state = {}
    for kind, leaves in table.items():
        state[kind] = {}
        for name, leaf in leaves.items():
            value = state_all[kind][name]  # [n, B, ...]
            if leaf.kind == spec.CACHE:
                # rows of rejected tokens (slot >= position + kept) back to zero
                slots = jnp.arange(value.shape[leaf.token_axis])
                keep = slots[None, :] < (positions + kept)[:, None]  # [B, S]
                shape = [1] * value.ndim
                shape[1], shape[leaf.token_axis] = value.shape[1], value.shape[leaf.token_axis]
                state[kind][name] = jnp.where(keep.reshape(shape), value, jnp.zeros_like(value))
            else:
                stacked = per_position[kind][name]  # [K + 1, n, B, ...]
                index = (kept - 1).reshape((1, 1, -1) + (1,) * (stacked.ndim - 3))
                state[kind][name] = jnp.take_along_axis(stacked, index, axis=0)[0]
    return state


_rollback_jit = jax.jit(_rollback, static_argnames="cfg")


def rollback(state_all: dict, per_position: dict, positions: Any, kept: Any,
             cfg: ModelConfig) -> dict:
    """The state of decoding only the first `kept` [B] (1..K + 1) of the K + 1 verified tokens.

    Recurrent leaves take their per-position value at kept - 1; cache rows at slots >= positions
    + kept are zeroed (as plain decoding left them). Exactly the state of plain decoding.
    """
    kept = np.asarray(kept)
    width = _width(per_position)
    if kept.ndim != 1 or np.any(kept < 1) or np.any(kept > width):
        raise ValueError(f"kept={kept.tolist()!r} is invalid: [B] ints in [1, K + 1 = {width}] "
                         "(the last accepted token plus the accepted drafts)")
    recurrent = {kind: leaves for kind, leaves in per_position.items() if kind != HIDDEN}
    return _rollback_jit(state_all, recurrent, jnp.asarray(positions, jnp.int32),
                         jnp.asarray(kept, jnp.int32), cfg=cfg)


def _width(per_position: dict) -> int:
    """K + 1: the positions per_position holds (K + 1 = 8 when it holds none)."""
    for kind, leaves in per_position.items():
        for value in (leaves.values() if kind != HIDDEN else [leaves]):
            return int(value.shape[0])
    return MAX_DRAFTS + 1


def per_position_bytes(cfg: ModelConfig, k: int) -> dict[str, int]:
    """What keeping every position's recurrent state costs, from `spec.state_table`:
    {"per_layer_per_position": bytes of one layer's non-cache leaves for one row (each kind with
    such leaves: the KDA layer's), "per_layer": that x (K + 1), "per_row": x the layers too}."""
    check_k(k)
    table = spec.state_table(cfg, 1, 1)
    one, total = 0, 0
    for leaves in table.values():
        layer = sum(int(np.prod(leaf.shape[2:])) * np.dtype(leaf.dtype).itemsize
                    for leaf in leaves.values() if leaf.kind != spec.CACHE)
        count = next(iter(leaves.values())).shape[0]
        one = max(one, layer)
        total += layer * count
    return {"per_layer_per_position": one, "per_layer": one * (k + 1),
            "per_row": total * (k + 1)}


# ---- the loop --------------------------------------------------------------------------------
def _select_rows(active: np.ndarray, new: dict, old: dict) -> dict:
    """new for the active rows [B], old for the others; every state leaf is [n, B, ...]."""
    return _select_rows_jit(jnp.asarray(active), new, old)


@jax.jit
def _select_rows_jit(keep, new, old):
    return jax.tree.map(lambda a, b: jnp.where(keep.reshape((1, -1) + (1,) * (a.ndim - 2)), a, b),
                        new, old)


def speculative_generate(params: dict, state: dict, prompt: Any, n_tokens: int, cfg: ModelConfig,
                         *, k: int, drafter: Any, seed: int = 0, temperature: Any = None,
                         top_k: Any = 0, top_p: Any = 1.0,
                         verify: Callable = verify_step) -> tuple[jax.Array, dict, dict]:
    """`reference.generate` with speculative steps: prefill prompt [B, T] at positions 0..T-1,
    then emit n_tokens per row, each verify step scoring the pending token plus k drafts.

    drafter: a name of `drafters.get_drafter` ('forced:A', 'ngram', 'mtp') or a Drafter. Greedy
    (temperature None): `accept_greedy`; sampled with a deterministic drafter: `accept_in_call`
    (the same tokens as plain sampled decoding with this seed); with a stochastic drafter:
    `accept_sampled`. verify: `verify_step` or a drop-in with its contract; a verify with
    `samples_in_call = True` (the megakernel's, `megakernel_verify.as_verify`) also takes seed,
    temperature, top_k, top_p and returns a 4th item, the tokens [B, K + 1] it drew in the call
    (accepted by matching for a deterministic drafter). The prompt is prefilled by the
    reference's decode step (`feed`) whichever verify runs.

    Returns (tokens [B, n_tokens] i32, state, stats): the state has consumed the prompt and all
    emitted tokens but the last, exactly as `reference.generate` leaves it. stats: "steps" (verify
    calls), "tokens_per_step" (emitted per row and step, the first token from the prefill aside),
    "mean_accepted" (drafts accepted per row and step, before the last step's cut to n_tokens),
    "acceptance_rate" (that / k), "accepted" [steps, B] (-1 for rows already done).
    """
    k = check_k(k)
    prompt, drafter = _check_generate(state, prompt, n_tokens, cfg, k, drafter)
    batch, length = prompt.shape
    sampler = {"seed": seed, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    sampling.check_params(batch, cfg.vocab_size, temperature=temperature, top_k=top_k,
                          top_p=top_p)
    drafter.prepare(drafters.DraftSetup(params, state, prompt, int(n_tokens), k, cfg))
    history, state = _prefill(params, state, prompt, n_tokens, cfg, k, drafter, sampler)
    lengths = np.full(batch, length + 1)
    key = jax.random.key(seed)
    accepted_log, emitted_per_step = [], []
    while np.any(active := lengths - length < n_tokens):
        positions = np.where(active, lengths - 1, 0).astype(np.int32)  # of the pending token
        drafts, draft_probs, key, accept_key = _propose(drafter, history, lengths, k, key)
        fed = np.concatenate([history[np.arange(batch), lengths - 1][:, None], drafts], axis=1)
        n_accepted, next_token, state_all, per_position = _verify_and_accept(
            params, state, fed, positions, cfg, verify, drafter, draft_probs, accept_key,
            sampler)
        # keep the pending token and the accepted drafts, no more than n_tokens asks for
        kept = np.where(active, np.minimum(n_accepted + 1, length + n_tokens - lengths), 1)
        state = _select_rows(active, rollback(state_all, per_position, positions, kept, cfg),
                             state)
        drafter.observe(fed, positions, per_position.get(HIDDEN), np.where(active, kept, 0))
        _emit(history, lengths, active, drafts, n_accepted, next_token, kept)
        lengths = lengths + np.where(active, kept, 0)
        accepted_log.append(np.where(active, n_accepted, -1))
        emitted_per_step.append(kept[active])
    stats = _stats(accepted_log, emitted_per_step, batch, k)
    return jnp.asarray(history[:, length:length + n_tokens]), state, stats


def _check_generate(state: dict, prompt: Any, n_tokens: Any, cfg: ModelConfig, k: int,
                    drafter: Any) -> tuple[np.ndarray, Any]:
    """`speculative_generate`'s checks before any tracing: (the prompt [B, T] as i32, the
    Drafter); B x (K + 1) rows in one call, n_tokens an int >= 1, the last verify in the cache."""
    reference.check_prompt(prompt, cfg)
    prompt = np.asarray(prompt, np.int32)
    batch, length = prompt.shape
    check_rows(batch, k)
    drafter = drafters.get_drafter(drafter)
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1:
        raise ValueError(f"n_tokens={n_tokens!r} is invalid: an int >= 1")
    seq = reference.check_state(state, cfg, batch)
    last = length + n_tokens - 2 + k  # the last verify: the (n-1)-th emitted token + k drafts
    if seq is not None and max(last, length - 1) >= seq:
        raise ValueError(f"n_tokens={n_tokens} is invalid with a prompt of {length} and k={k}: "
                         f"the last verify reaches position {last}, past the cache ({seq} "
                         "tokens)")
    return prompt, drafter


def _prefill(params: dict, state: dict, prompt: np.ndarray, n_tokens: int, cfg: ModelConfig,
             k: int, drafter: Any, sampler: dict) -> tuple[np.ndarray, dict]:
    """The prompt fed through the reference's decode step and the first token sampled from its
    last logits: (history [B, T + n_tokens + k + 1] i32 holding the prompt then that token, the
    state after the prompt)."""
    batch, length = prompt.shape
    logits, state, per_position = feed(params, state, prompt, np.zeros(batch, np.int32), cfg,
                                       keep_states=False)
    drafter.observe(prompt, np.zeros(batch, np.int32), per_position.get(HIDDEN),
                    np.full(batch, length))
    first = sampling.sample(logits[:, -1], positions=np.full(batch, length), **sampler)
    history = np.zeros((batch, length + n_tokens + k + 1), np.int32)  # prompt, then emitted
    history[:, :length], history[:, length] = prompt, np.asarray(first)
    return history, state


def _propose(drafter: Any, history: np.ndarray, lengths: np.ndarray, k: int,
             key: jax.Array) -> tuple[np.ndarray, Any, jax.Array, Any]:
    """The drafter's k tokens after each row's last one: (drafts [B, k] i32, their probabilities
    (a stochastic drafter's, else None), the next key, the acceptance's key (else None)); only a
    stochastic drafter splits the key."""
    if drafter.deterministic:
        return np.asarray(drafter.propose(history, lengths, k), np.int32), None, key, None
    key, draft_key, accept_key = jax.random.split(key, 3)
    drafts, draft_probs = drafter.propose_probs(history, lengths, k, draft_key)
    return np.asarray(drafts, np.int32), draft_probs, key, accept_key


def _verify_and_accept(params: dict, state: dict, fed: np.ndarray, positions: np.ndarray,
                       cfg: ModelConfig, verify: Callable, drafter: Any, draft_probs: Any,
                       accept_key: Any, sampler: dict) -> tuple[np.ndarray, np.ndarray, dict,
                                                                dict]:
    """One verify call over fed [B, K + 1] (the pending token, then the drafts) and the rule that
    accepts a prefix of the drafts: (n_accepted [B], next_token [B], state_all, per_position)."""
    drafts = fed[:, 1:]
    if getattr(verify, "samples_in_call", False):
        # the verify call draws the target's token at every position itself (greedy, or
        # the decode step's seed rule): for a one-hot q the rejection rule is matching
        logits, state_all, per_position, in_call = verify(params, state, fed, positions, cfg,
                                                          **sampler)
    else:
        logits, state_all, per_position = verify(params, state, fed, positions, cfg)
        in_call = None
    if in_call is not None and drafter.deterministic:
        n_accepted, next_token = acceptance.accept_matching(drafts, in_call)
    elif sampler["temperature"] is None:
        n_accepted, next_token = acceptance.accept_greedy(drafts, logits)
    elif drafter.deterministic:
        n_accepted, next_token = acceptance.accept_in_call(drafts, logits, positions, **sampler)
    else:
        probs = acceptance.target_probs(logits, temperature=sampler["temperature"],
                                        top_k=sampler["top_k"], top_p=sampler["top_p"])
        n_accepted, next_token = acceptance.accept_sampled(drafts, draft_probs, probs,
                                                           accept_key)
    return np.asarray(n_accepted), np.asarray(next_token), state_all, per_position


def _emit(history: np.ndarray, lengths: np.ndarray, active: np.ndarray, drafts: np.ndarray,
          n_accepted: np.ndarray, next_token: np.ndarray, kept: np.ndarray) -> None:
    """Write each active row's kept tokens after its last one in history (in place): the accepted
    drafts d_1..d_n, then the target's token, cut to kept."""
    for b in np.flatnonzero(active):
        new = np.append(drafts[b, :n_accepted[b]], next_token[b])[:kept[b]]
        history[b, lengths[b]:lengths[b] + kept[b]] = new


def _stats(accepted_log: list, emitted_per_step: list, batch: int, k: int) -> dict:
    """`speculative_generate`'s stats from the drafts accepted per step and row (-1 for rows
    already done) and the tokens emitted per step by the active rows."""
    accepted = np.array(accepted_log, np.int32).reshape(-1, batch)  # [steps, B]
    live = accepted[accepted >= 0]
    emitted = np.concatenate(emitted_per_step) if emitted_per_step else np.zeros(0)
    return {"steps": len(accepted_log), "accepted": accepted,
            "tokens_per_step": float(emitted.mean()) if emitted.size else 0.0,
            "mean_accepted": float(live.mean()) if live.size else 0.0,
            "acceptance_rate": float(live.mean()) / k if live.size else 0.0}
