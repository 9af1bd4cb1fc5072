"""Drafters for speculative decoding: who proposes the K tokens a verify step checks.

A drafter is pluggable (`Drafter`): `propose(history, lengths, k) -> drafts [B, k]`, where
history[b, :lengths[b]] is row b's tokens so far (prompt, then emitted tokens; the last one is the
pending token the target has not consumed yet, at position lengths[b] - 1). A deterministic drafter
(all here) has a one-hot draft distribution; a stochastic one sets `deterministic = False` and
returns its probabilities from `propose_probs`. `prepare` runs once before decoding and `observe`
after every step the target consumed tokens (the MTP drafter keeps its own cache from them).

By name (`get_drafter`):
* `forced:A` — the release's benchmark mode: exactly A drafts accepted per step under greedy
  decoding (A <= K). It peeks at an oracle, the plain greedy continuation computed by the
  reference, proposes its next A tokens, then a wrong token (the oracle's + 1 mod V).
* `ngram` — prompt lookup: find the last n tokens of the history earlier in it (n = 3, 2, 1, the
  latest occurrence) and propose what followed; pad with a repeat of the last proposed token, and
  with the last token when nothing matches. No second model.
* `mtp` — DeepSeek-V3's multi-token-prediction module (`mkresearch.model.mtp`) as the draft model, for
  configs with n_mtp_layers > 0: drafts greedily, k tokens by chaining the module on its own output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkresearch.model import mtp, reference, weights
from mkresearch.model.config import ModelConfig

DRAFTERS = ("forced:A", "ngram", "mtp")  # the names get_drafter takes (A an int >= 0)
NGRAM_SIZES = (3, 2, 1)


@dataclass
class DraftSetup:
    """What a drafter may read before decoding: the target, its starting state and the run."""

    params: dict
    state: dict
    prompt: np.ndarray  # [B, T]
    n_tokens: int
    k: int
    cfg: ModelConfig


class Drafter:
    """The drafter interface (see the module docstring); subclasses override `propose`."""

    name = "drafter"
    deterministic = True  # a one-hot draft distribution

    def prepare(self, setup: DraftSetup) -> None:
        """Called once before decoding."""

    def observe(self, tokens: np.ndarray, positions: np.ndarray, hidden: Any,
                kept: np.ndarray) -> None:
        """The target consumed tokens[b, :kept[b]] [B, n] at positions[b] + 0.. (kept 0: none);
        hidden [n, B, d] its final hidden state after each (None when the verify gives none)."""

    def propose(self, history: np.ndarray, lengths: np.ndarray, k: int) -> np.ndarray:
        raise NotImplementedError

    def propose_probs(self, history: np.ndarray, lengths: np.ndarray, k: int,
                      key: Any) -> tuple[np.ndarray, jax.Array]:
        """(drafts [B, k], their distributions q [B, k, V]) for a stochastic drafter."""
        raise NotImplementedError(f"drafter {self.name!r} is deterministic: use propose")


class ForcedDrafter(Drafter):
    """Forced acceptance of length A (greedy): the oracle's next A tokens, then a wrong one."""

    def __init__(self, accept: int, oracle: Any = None) -> None:
        self.accept = accept
        self.name = f"forced:{accept}"
        self.oracle = None if oracle is None else np.asarray(oracle)  # [B, T + n] tokens

    def prepare(self, setup: DraftSetup) -> None:
        if self.accept > setup.k:
            raise ValueError(f"drafter={self.name!r} is invalid for k={setup.k}: forced:A with "
                             f"A in [0, {setup.k}]")
        if self.oracle is None:  # the plain greedy continuation, k tokens past the end
            generated, _ = reference.generate(setup.params, setup.state, setup.prompt,
                                              setup.n_tokens + setup.k, setup.cfg)
            self.oracle = np.concatenate([setup.prompt, np.asarray(generated)], axis=1)
        self.vocab = setup.cfg.vocab_size

    def propose(self, history: np.ndarray, lengths: np.ndarray, k: int) -> np.ndarray:
        batch = len(lengths)
        drafts = np.zeros((batch, k), np.int32)
        for b, length in enumerate(lengths):
            follow = self.oracle[b, length:length + k]
            follow = np.concatenate([follow, np.full(k - len(follow), follow[-1] if len(follow)
                                                     else self.oracle[b, -1])])
            right = np.arange(k) < self.accept
            drafts[b] = np.where(right, follow, (follow + 1) % self.vocab)
        return drafts


def ngram_lookup(sequence: np.ndarray, k: int) -> np.ndarray:
    """k tokens after the latest earlier occurrence of the sequence's last n tokens (n = 3..1)."""
    length = len(sequence)
    for n in NGRAM_SIZES:
        if length <= n:
            continue
        suffix = sequence[length - n:]
        for start in range(length - n - 1, -1, -1):  # the latest occurrence first
            if np.array_equal(sequence[start:start + n], suffix):
                follow = sequence[start + n:start + n + k]
                return np.concatenate([follow, np.full(k - len(follow), follow[-1])])
    return np.full(k, sequence[-1])


class NgramDrafter(Drafter):
    """Prompt lookup over the row's own history (no second model)."""

    name = "ngram"

    def propose(self, history: np.ndarray, lengths: np.ndarray, k: int) -> np.ndarray:
        return np.stack([ngram_lookup(np.asarray(history[b, :length]), k)
                         for b, length in enumerate(lengths)]).astype(np.int32)


class MtpDrafter(Drafter):
    """DeepSeek-V3's MTP module (`mkresearch.model.mtp`, weights from `weights.init_mtp_params`),
    greedy, chained: draft j + 1 comes from the module's own hidden state at draft j.

    Its cache slot j holds the module's entry for (h_j, t_{j+1}): the target's final hidden state
    at position j and the token after it. `observe` rewrites the slots of consumed tokens from the
    target's true hidden states (the chained drafts wrote them from the module's own); `propose`
    starts at the slot before the pending token and chains k steps.
    """

    name = "mtp"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def prepare(self, setup: DraftSetup) -> None:
        mtp.check(setup.cfg)
        self.cfg, self.params = setup.cfg, setup.params
        self.module = mtp.module_params(weights.init_mtp_params(setup.cfg, self.seed), 0)
        batch = setup.prompt.shape[0]
        self.state = mtp.init_state(setup.cfg, batch, reference.cache_length(setup.state,
                                                                             setup.cfg))
        self.last_hidden = None  # [B, d]: the target's hidden state at the pending token - 1

    def _step(self, hidden, tokens, positions):
        return mtp.mtp_step(self.module, self.params["embed"], self.params["lm_head"], hidden,
                            jnp.asarray(tokens, jnp.int32), self.state,
                            jnp.asarray(positions, jnp.int32), self.cfg)

    def observe(self, tokens: np.ndarray, positions: np.ndarray, hidden: Any,
                kept: np.ndarray) -> None:
        if hidden is None:
            raise ValueError("drafter='mtp' needs the target's final hidden state of each "
                             "verified token: per_position['hidden'] from the verify (the "
                             "reference's speculative.verify_step gives it)")
        kept = np.asarray(kept)
        rows = np.arange(len(kept))
        if self.last_hidden is None:
            self.last_hidden = hidden[0]
        # slot j <- (h_j, t_{j+1}) for the consumed tokens whose successor is consumed too
        for j in range(int(kept.max(initial=0)) - 1):
            active = jnp.asarray(j + 1 < kept)[:, None]
            _, _, state = self._step(hidden[j], tokens[:, j + 1], positions + j)
            self.state = mtp.select_rows(active, state, self.state)
        last = jnp.asarray(hidden)[np.maximum(kept - 1, 0), rows]  # [B, d]
        self.last_hidden = jnp.where(jnp.asarray(kept > 0)[:, None], last, self.last_hidden)

    def propose(self, history: np.ndarray, lengths: np.ndarray, k: int) -> np.ndarray:
        rows = np.arange(len(lengths))
        token = history[rows, lengths - 1]  # the pending token t_P, P = lengths - 1
        hidden, drafts = self.last_hidden, []
        for j in range(k):  # slot P - 1 + j: (h_{P-1+j}, t_{P+j}) -> t_{P+j+1}
            logits, hidden, self.state = self._step(hidden, token, lengths - 2 + j)
            token = np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int32)
            drafts.append(token)
        return np.stack(drafts, axis=1)


def get_drafter(name: Any, **options: Any) -> Drafter:
    """A Drafter by name: 'forced:A' (A an int >= 0), 'ngram' or 'mtp'; a Drafter passes through.
    options: ForcedDrafter's oracle, MtpDrafter's seed. Unknown name -> ValueError."""
    if isinstance(name, Drafter):
        return name
    if isinstance(name, str) and name.startswith("forced:"):
        accept = name[len("forced:"):]
        if accept.isdigit():
            return ForcedDrafter(int(accept), options.get("oracle"))
    elif name == "ngram":
        return NgramDrafter()
    elif name == "mtp":
        return MtpDrafter(options.get("seed", 0))
    raise ValueError(f"drafter={name!r} is unknown: one of {', '.join(DRAFTERS)} (A an int >= 0) "
                     "or a mkresearch.decoding.drafters.Drafter")
