"""`generation.agreement.compare`: the bound, the two excuses (a logit near-tie, a router near-tie)
and what fails, on made-up logits; and the reference's routing margin it reads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mkresearch.generation import agreement
from mkresearch.generation.agreement import LOGIT_TOL, NEAR_TIE_GAP, ROUTER_TIE
from mkresearch.model import reference, weights
from mkresearch.model.config import get_config
from mkresearch.model.stages import ffn

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

STEPS, BATCH, VOCAB = 3, 2, 8


def logits_with_gap(gap):
    """[STEPS, BATCH, VOCAB] logits whose best two differ by `gap` (token 1 first)."""
    base = np.zeros((STEPS, BATCH, VOCAB), np.float32)
    base[..., 1], base[..., 2] = 1.0, 1.0 - gap
    return base


def test_equal_logits_pass_bit_equal():
    ref = logits_with_gap(1.0)
    result = agreement.compare(ref, np.ones((BATCH, STEPS), np.int32), ref)
    assert result.passed and result.bit_equal == STEPS * BATCH
    assert result.tokens_equal == result.tokens == STEPS * BATCH
    assert result.line().endswith("-> PASS")


def test_token_differs_only_at_a_logit_near_tie():
    ref = logits_with_gap(NEAR_TIE_GAP / 2)
    tokens = np.ones((BATCH, STEPS), np.int32)
    tokens[1, 2] = 2  # the runner-up, half a near-tie gap behind
    result = agreement.compare(ref + LOGIT_TOL / 4, tokens, ref)
    assert result.passed and result.near_ties == [(2, 1, pytest.approx(NEAR_TIE_GAP / 2))]
    far = agreement.compare(logits_with_gap(1.0), tokens, logits_with_gap(1.0))
    assert not far.passed and "off a near-tie" in far.failures[0]


def test_logits_past_the_bound_need_a_router_near_tie():
    ref = logits_with_gap(1.0)
    kernel = ref.copy()
    kernel[1, 0, 5] += 3 * LOGIT_TOL  # row 0 moves at step 1
    tokens = np.ones((BATCH, STEPS), np.int32)
    margins = np.full((STEPS, 2, BATCH), 0.5, np.float32)  # [N, n_moe, B]
    assert not agreement.compare(kernel, tokens, ref, margins).passed
    margins[1, 1, 0] = ROUTER_TIE / 2
    kernel[2, 0, 5] += 1.0  # after parting, its own state may move it anywhere
    result = agreement.compare(kernel, tokens, ref, margins)
    assert result.passed and result.parted == [(1, 0, pytest.approx(ROUTER_TIE / 2))]
    assert result.row_steps == STEPS * BATCH - 2  # row 0 left out from step 1 on
    from_reference = agreement.compare(kernel, tokens, ref, margins, own_states=False)
    assert not from_reference.passed  # each step from the reference's state: step 2 has no tie


def test_routing_margin_is_the_gap_after_the_kth_score():
    cfg = get_config("kimi-k3-mini")
    params = weights.init_params(cfg, 0)
    p = reference.layer_params(params["moe"], 0)
    x = jax.random.normal(jax.random.key(0), (3, cfg.d_model), jnp.bfloat16)
    selection = np.sort(np.asarray(ffn.router_scores(p, x, cfg)[1]), axis=-1)[:, ::-1]
    expected = selection[:, cfg.top_k - 1] - selection[:, cfg.top_k]
    np.testing.assert_array_equal(np.asarray(ffn.routing_margin(p, x, cfg)), expected)
    _, _, aux = reference.decode_step(params, reference.init_state(cfg, 3), np.arange(3),
                                      np.zeros(3, np.int32), cfg)
    assert aux["routing_margin"].shape == (len(cfg.layers_of("moe")), 3)


def test_reference_never_slices_an_expert_stack():
    """The structure that lets the reference run wherever its weights fit: each chosen expert is
    a dynamic slice of its stack, and no stack is sliced, squeezed or gathered whole (a layer's
    experts sliced out are copied: 16.4 GB of temporaries for Moonlight-16B-A3B at 9 layers on a
    v5e, 34 MB since, compiled from shapes)."""
    cfg = get_config("kimi-k3-mini")
    shapes = weights.param_shapes(cfg)
    stacks = {tuple(s.shape) for s in jax.tree.leaves(shapes["moe"]["experts"])}
    state = jax.eval_shape(lambda: reference.init_state(cfg, 2))
    ids = jax.ShapeDtypeStruct((2,), jnp.int32)
    closed = jax.make_jaxpr(lambda p, s, t, q: reference.decode_step_unchecked(p, s, t, q, cfg))(
        shapes, state, ids, ids)
    uses = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if tuple(getattr(v.aval, "shape", ())) in stacks:
                    uses.setdefault(eqn.primitive.name, 0)
                    uses[eqn.primitive.name] += 1
            for value in eqn.params.values():
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(item, "jaxpr", item)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    assert uses and set(uses) <= {"dynamic_slice", "scan", "pjit", "jit"}, uses
