"""The library's decode loop (`mkresearch.generation.loop`): its tokens equal step-by-step
decoding on both backends, it makes no device-to-host transfer between its first and last step
(a transfer guard is on while it runs), and its inputs are checked once, in one line.

Kimi K3's mini cut to its two kinds of layer (`cuts.kimi_kinds`), B = 2, a 3-token prompt: the
prefill runs in chunks of 2 steps and the decode in chunks of 3, so both a full and a short
chunk run. The megakernel runs in TPU interpret mode with the race detector on.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuts import kimi_kinds

from mkresearch.generation import loop
from mkresearch.model import reference, weights
from mkresearch.model.config import get_config

# compiled on the chip present too (make test-tpu): see tests/conftest.py
pytestmark = pytest.mark.tpu

CFG = kimi_kinds(get_config("kimi-k3-mini"))
PROMPT = np.asarray([[3, 5, 7], [11, 13, 17]], np.int32)  # [B, T]
N_STEPS = 5
CACHE = 64


@pytest.fixture(scope="module")
def params():
    return weights.init_params(CFG, 0)


@pytest.fixture(scope="module")
def step_by_step(params):
    """Greedy tokens [B, 1 + N_STEPS] of `reference.decode_step` called one step at a time, and
    the logits [N_STEPS, B, V] of the decode steps."""
    batch, length = PROMPT.shape
    state, token, drawn, decode_logits = reference.init_state(CFG, batch, CACHE), PROMPT[:, 0], [], []
    for t in range(length + N_STEPS):
        logits, state, _ = reference.decode_step(params, state, token, np.full(batch, t), CFG)
        token = np.asarray(jnp.argmax(logits, -1)).astype(np.int32)
        if t >= length:
            decode_logits.append(np.asarray(logits))
        if t + 1 < length:
            token = PROMPT[:, t + 1]
        else:
            drawn.append(token)
    return np.stack(drawn, axis=1), np.stack(decode_logits)


def run_loop(params, backend):
    state = reference.init_state(CFG, PROMPT.shape[0], CACHE)
    first = loop.prefill(params, state, PROMPT, CFG, backend=backend, steps_per_call=2)
    with jax.transfer_guard_device_to_host("disallow"):  # no token read back between steps
        run = loop.decode(params, first.state, first.next_tokens, first.next_positions, CFG,
                          N_STEPS, backend=backend, steps_per_call=3, return_logits=True)
        jax.block_until_ready(run.tokens)
    return np.asarray(first.tokens)[:, -1], jax.device_get(run)


def test_reference_loop_equals_step_by_step(params, step_by_step):
    first, run = run_loop(params, "reference")
    tokens, logits = step_by_step
    assert first.tolist() == tokens[:, 0].tolist()
    assert np.asarray(run.tokens).tolist() == tokens[:, 1:].tolist()
    assert np.array_equal(run.logits, logits)  # the same step in a scan: the same bits
    assert np.asarray(run.next_positions).tolist() == [PROMPT.shape[1] + N_STEPS] * 2


@pytest.mark.slow
def test_megakernel_loop_equals_step_by_step(params, step_by_step, race_checked):
    first, run = run_loop(params, "megakernel")
    tokens, _ = step_by_step
    assert first.tolist() == tokens[:, 0].tolist()
    assert np.asarray(run.tokens).tolist() == tokens[:, 1:].tolist()


@pytest.mark.parametrize(("change", "message"), [
    ({"n_steps": 0}, "n_steps=0 is invalid: an int >= 1"),
    ({"steps_per_call": -1}, "steps_per_call=-1 is invalid"),
    ({"backend": "stages"}, "backend='stages' is invalid: one of megakernel, reference"),
    ({"positions": [60, 0]}, r"positions=\[60, 0\] with n_steps=5 is invalid"),
    ({"tokens": [1, 99999]}, r"tokens\[1\]=99999 is invalid"),
    ({"forced": np.zeros((2, 4), np.int32)}, r"forced has shape \(2, 4\)"),
])
def test_inputs_are_checked_once_in_one_line(params, change, message):
    args = {"tokens": [1, 2], "positions": [0, 0], "n_steps": N_STEPS, "backend": "reference",
            **change}
    state = reference.init_state(CFG, 2, CACHE)
    with pytest.raises(ValueError, match=message):
        loop.decode(params, state, np.asarray(args.pop("tokens")), np.asarray(args.pop("positions")),
                    CFG, args.pop("n_steps"), **args)


@pytest.mark.parametrize("backend", ["reference", "megakernel"])
def test_a_call_is_one_compiled_program(params, backend):
    """After its first call, a call of the loop dispatches the chunk's compiled program and no
    other program or transfer of its own: host tokens and positions go into it with the call,
    and the next step's sampling positions are made inside it (on the v5e each eager op around
    it cost 0.1-0.4 ms of host time per call: docs/tpu.md §5). The megakernel is given its
    prepared weights, as a caller that decodes more than once does (`prepare_weights` is
    eager: once per call with the parameters). From a profile of the call (the Python tracer's
    events)."""
    import glob
    import tempfile

    from jax.profiler import ProfileData
    from mkresearch.kernels.compose import megakernel

    weights_ = megakernel.prepare_weights(params, CFG) if backend == "megakernel" else params
    state = reference.init_state(CFG, 2, CACHE)
    tokens, positions = PROMPT[:, 0], np.zeros(2, np.int32)
    state = loop.decode(weights_, state, tokens, positions, CFG, 2, backend=backend).state
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir):
            jax.block_until_ready(loop.decode(weights_, state, tokens, positions, CFG, 2,
                                              backend=backend).tokens)
        data = ProfileData.from_file(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)[0])
    events = [event for plane in data.planes for line in plane.lines for event in line.events]
    programs = {event.name for event in events if event.name.startswith("PjitFunction(")}
    assert programs == {f"PjitFunction(_{backend}_run)"}, programs
    calls = [(e.start_ns, e.start_ns + e.duration_ns) for e in events
             if e.name == f"PjitFunction(_{backend}_run)"]
    transfers = [e.start_ns for e in events if e.name.endswith(" device_put")]  # jax.device_put
    # (inside the call only: interpret mode's callbacks put an effect token on the device)
    assert all(any(a <= t <= b for a, b in calls) for t in transfers)
