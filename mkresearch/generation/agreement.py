"""The megakernel against the reference, step by step: the bound they agree within, and the only
two places they may part (docs/kimi-k3.md §11).

Per row and step, the kernel's logits are within LOGIT_TOL of the reference's, and its greedy
token is the reference's, except
- at a logit near-tie: the reference's two best logits within NEAR_TIE_GAP = 2 LOGIT_TOL, where
  two logit vectors within LOGIT_TOL of each other may pick different tokens;
- at a router near-tie: in some MoE layer the reference's k-th and (k+1)-th selection scores
  within ROUTER_TIE (`ffn.routing_margin`), where a layer input that differs by float rounding
  may route another expert; the logits then move past LOGIT_TOL. Where the two run on their own
  states (a decode), the row's states differ from then on and the row is left out of the later
  steps ("parted"); where each step starts from the reference's state, only that step is.

On a CPU the kernel reproduces the reference to the bit (tests); on a TPU both round and sum
there in their own ways (the MXU's accumulation order, the exp and the other transcendentals
of XLA and of Mosaic), and this is what holds: measured over a seed sweep
(`benchmarks/tpu_v5e.py agreement`, recorded in docs/tpu.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

LOGIT_TOL = 5e-2  # docs/kimi-k3.md §11: the release's own whole-step bound
NEAR_TIE_GAP = 2 * LOGIT_TOL
# selection scores (sigmoid or softmax, in [0, 1]) this close are a tie to within the float error
# of the router's bf16 input
ROUTER_TIE = 1e-3


@dataclass
class Agreement:
    """What `compare` found. max_abs_logit_diff: over the row-steps compared (not parted);
    near_ties: (step, row, top-2 gap) where the tokens differ at a logit near-tie; parted:
    (step, row, routing margin) where the logits moved past LOGIT_TOL at a router near-tie;
    failures: one line each where neither excuses a difference."""

    tokens_equal: int = 0
    tokens: int = 0
    row_steps: int = 0
    bit_equal: int = 0
    max_abs_logit_diff: float = 0.0
    near_ties: list = field(default_factory=list)
    parted: list = field(default_factory=list)
    failures: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "logit_tol": LOGIT_TOL,
                "near_tie_gap": NEAR_TIE_GAP, "router_tie": ROUTER_TIE}

    def line(self) -> str:
        """One line: tokens, the bound, each excused difference, PASS or FAIL."""
        text = (f"{self.tokens_equal}/{self.tokens} tokens equal, max |logit diff| "
                f"{self.max_abs_logit_diff:.2e} (<= {LOGIT_TOL} where routing agrees), "
                f"{self.bit_equal}/{self.row_steps} row-steps bit-equal")
        text += "".join(f"; near-tie at step {s} row {r} (top-2 gap {g:.3f})"
                        for s, r, g in self.near_ties)
        text += "".join(f"; row {r} parted at step {s} at a router near-tie (margin {m:.1e})"
                        for s, r, m in self.parted)
        text += "".join(f"; {failure}" for failure in self.failures)
        return f"{text} -> {'PASS' if self.passed else 'FAIL'}"


def compare(kernel_logits: Any, kernel_tokens: Any, ref_logits: Any, ref_margins: Any = None,
            *, own_states: bool = True) -> Agreement:
    """The kernel's logits [N, B, V] and greedy tokens [B, N] against the reference's logits
    [N, B, V] and routing margins [N, n_moe, B] (None without MoE layers), step by step.
    own_states: each ran on its own state (a parted row is left out of later steps); False:
    each step started from the reference's state."""
    kernel_logits, ref_logits = np.asarray(kernel_logits), np.asarray(ref_logits)
    kernel_tokens = np.asarray(kernel_tokens)
    steps, batch = ref_logits.shape[:2]
    margins = (np.full((steps, batch), np.inf) if ref_margins is None or not np.size(ref_margins)
               else np.asarray(ref_margins).min(axis=1))  # [N, B]: the closest layer
    result, gone = Agreement(), set()
    for step in range(steps):
        for row in range(batch):
            if row in gone:
                continue
            mine, theirs = kernel_logits[step, row], ref_logits[step, row]
            token, greedy = int(kernel_tokens[row, step]), int(theirs.argmax())
            diff = float(np.abs(mine - theirs).max())
            result.tokens += 1
            result.tokens_equal += token == greedy
            if diff > LOGIT_TOL:
                if margins[step, row] < ROUTER_TIE:
                    result.parted.append((step, row, float(margins[step, row])))
                    if own_states:
                        gone.add(row)
                    continue
                result.failures.append(f"step {step} row {row}: logits {diff:.3g} apart with "
                                       f"routing margin {margins[step, row]:.2g} (no tie)")
                continue
            result.row_steps += 1
            result.bit_equal += bool(np.array_equal(mine, theirs))
            result.max_abs_logit_diff = max(result.max_abs_logit_diff, diff)
            if token != greedy:
                top2 = np.sort(theirs)[-2:]
                gap = float(top2[1] - top2[0])
                if gap < NEAR_TIE_GAP:
                    result.near_ties.append((step, row, gap))
                else:
                    result.failures.append(f"step {step} row {row}: token {token} != {greedy} "
                                           f"off a near-tie (top-2 gap {gap:.3f})")
    return result
