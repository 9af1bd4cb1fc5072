"""Which drafts a verify step accepts, and the token the target adds (speculative decoding).

Given drafts d_1..d_K [B, K] and the target's logits [B, K + 1, V] after [last accepted, d_1..d_K]
(`speculative.verify_step`), each rule returns (n_accepted [B] in 0..K, next_token [B]): the row
emits d_1..d_n then next_token, the target's own token at position n (a correction after a
rejection, the bonus token when all K are accepted).

* `accept_greedy`: accept while the draft equals the argmax; next = the argmax at n.
* `accept_sampled`: the standard rejection-sampling rule (Leviathan et al. 2023, Chen et al. 2023)
  for a draft distribution q: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the
  first rejection sample from norm(max(0, p_n - q_n)); when all K are accepted sample the bonus
  from p_K. The emitted tokens are then distributed exactly as the target's own samples.
  p comes from the package's sampling transform (`target_probs`: temperature, top-k, top-p of
  `mkresearch.model.sampling`), so the output distribution equals plain sampled decoding's.
* `accept_in_call`: for a one-hot q (a deterministic drafter) the rule above is exactly "sample
  y_j ~ p_j and accept while y_j equals the draft": accepting with probability p_j(d_j) and else
  drawing from p_j with d_j removed is one draw y_j ~ p_j. This is what the megakernel does in
  its call: y_j is `sampling.sample` at position p + j + 1 (the decode step's Gumbel-max with its
  seed / row / position counter), so a sampled speculative decode emits exactly the tokens of
  plain sampled decoding with the same seed, not just the same distribution.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkresearch.model import sampling


def _check_drafts(drafts: Any, target: Any) -> tuple[int, int]:
    if np.ndim(drafts) != 2:
        raise ValueError(f"drafts has shape {np.shape(drafts)}: allowed [B, K]")
    batch, k = np.shape(drafts)
    if np.shape(target)[:2] != (batch, k + 1):
        raise ValueError(f"the target has shape {np.shape(target)}: allowed [B={batch}, "
                         f"K + 1={k + 1}, ...] (one entry per verified token)")
    return batch, k


def accept_matching(drafts: Any, target_tokens: Any) -> tuple[jax.Array, jax.Array]:
    """Accept while drafts [B, K] equal the target's tokens [B, K + 1]; next = target at n."""
    _check_drafts(drafts, target_tokens)
    return _accept_matching(jnp.asarray(drafts, jnp.int32), jnp.asarray(target_tokens, jnp.int32))


@jax.jit
def _accept_matching(drafts, target_tokens):
    match = drafts == target_tokens[:, :-1]  # [B, K]
    n_accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)  # [B]
    next_token = jnp.take_along_axis(target_tokens, n_accepted[:, None], axis=1)[:, 0]
    return n_accepted.astype(jnp.int32), next_token


def accept_greedy(drafts: Any, target_logits: Any) -> tuple[jax.Array, jax.Array]:
    """Greedy: accept while the draft is the argmax (lowest index among ties, as
    `sampling.sample`); next = the argmax at the first mismatch (or the bonus position K)."""
    _check_drafts(drafts, target_logits)
    return _accept_greedy(jnp.asarray(drafts, jnp.int32), jnp.asarray(target_logits))


@jax.jit
def _accept_greedy(drafts, target_logits):
    return _accept_matching(drafts, jnp.argmax(target_logits, axis=-1).astype(jnp.int32))


def in_call_tokens(target_logits: Any, positions: Any, *, seed: Any, temperature: Any = None,
                   top_k: Any = 0, top_p: Any = 1.0) -> jax.Array:
    """y [B, K + 1]: y_j = `sampling.sample` of logits[:, j] at positions + j + 1 (the position
    of the token it chooses), the decode step's own sampler and counter."""
    positions = np.asarray(positions, np.int32)
    return jnp.stack([sampling.sample(target_logits[:, j], seed=seed, positions=positions + j + 1,
                                      temperature=temperature, top_k=top_k, top_p=top_p)
                      for j in range(np.shape(target_logits)[1])], axis=1)


def accept_in_call(drafts: Any, target_logits: Any, positions: Any, *, seed: Any,
                   temperature: Any = None, top_k: Any = 0,
                   top_p: Any = 1.0) -> tuple[jax.Array, jax.Array]:
    """The rejection rule for a one-hot draft distribution as the megakernel runs it: sample
    y_j ~ p_j (Gumbel-max, `in_call_tokens`) and accept while y_j equals the draft. positions
    [B]: of the last accepted token (tokens[:, 0] of the verify). Greedy when temperature is
    None (then it is `accept_greedy`)."""
    _check_drafts(drafts, target_logits)
    return accept_matching(drafts, in_call_tokens(target_logits, positions, seed=seed,
                                                  temperature=temperature, top_k=top_k,
                                                  top_p=top_p))


def target_probs(target_logits: Any, *, temperature: Any, top_k: Any = 0,
                 top_p: Any = 1.0) -> jax.Array:
    """p [B, K + 1, V] f32: the distribution `sampling.sample` draws from at each position
    (`sampling.truncated_distribution`: temperature > 0, top-k, top-p)."""
    return jnp.stack([sampling.truncated_distribution(target_logits[:, j], temperature=temperature,
                                                      top_k=top_k, top_p=top_p)
                      for j in range(np.shape(target_logits)[1])], axis=1)


@jax.jit
def _accept_sampled(drafts, draft_probs, target_probs, key):
    batch, k = drafts.shape
    accept_key, sample_key = jax.random.split(key)
    uniforms = jax.random.uniform(accept_key, (batch, k))  # [B, K] in [0, 1)
    p_draft = jnp.take_along_axis(target_probs[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    accepted = uniforms * q_draft < p_draft  # u < p / q: probability min(1, p / q)
    n_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)  # [B]
    # q is zero at the bonus position K, so the residual there is p_K itself
    q_padded = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
    rows = jnp.arange(batch)
    p_n, q_n = target_probs[rows, n_accepted], q_padded[rows, n_accepted]  # [B, V]
    residual = jnp.maximum(p_n - q_n, 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    # residual mass 0 only if p_n == q_n, where no rejection can happen: sample p_n then
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p_n)
    next_token = jax.random.categorical(sample_key, jnp.log(residual), axis=-1)
    return n_accepted.astype(jnp.int32), next_token.astype(jnp.int32)


def accept_sampled(drafts: Any, draft_probs: Any, target_probs: Any,
                   key: Any) -> tuple[jax.Array, jax.Array]:
    """The standard rejection-sampling rule. drafts [B, K] i32 drawn from draft_probs q
    [B, K, V] (one-hot for a deterministic drafter), target_probs p [B, K + 1, V] (`target_probs`),
    key: a jax PRNG key (vmap over keys for many draws). Returns (n_accepted [B], next_token [B])."""
    batch, k = _check_drafts(drafts, target_probs)
    if np.shape(draft_probs) != (batch, k, np.shape(target_probs)[2]):
        raise ValueError(f"draft_probs has shape {np.shape(draft_probs)}: allowed [B={batch}, "
                         f"K={k}, V={np.shape(target_probs)[2]}]")
    return _accept_sampled(jnp.asarray(drafts, jnp.int32), jnp.asarray(draft_probs, jnp.float32),
                           jnp.asarray(target_probs, jnp.float32), key)
