"""A broken collective is caught: the sharded megakernel with one semaphore wait skipped (the race
detector flags the read of a receive slot before the data landed), and with one remote copy
skipped (the receiver waits forever: the step never finishes; run in a child process with a
deadline). Test helpers patch `kernels/sharded/collectives.py` at trace time; nothing in the library
knows about them."""

import os
import subprocess
import sys
import textwrap
import time
from unittest import mock

import jax
import numpy as np
import pytest
from cuts import kimi_kinds
from mkresearch.kernels.base import dry_run
from mkresearch.kernels.compose import megakernel_sharded as ms
from mkresearch.kernels.sharded import collectives

from mkresearch.hardware import tpu
from mkresearch.model import config, reference, weights
from mkresearch.sharding import layout

MINI = config.get_config("kimi-k3-mini")
# kimi-k3-mini cut to 2 layers (KDA + dense, MLA + MoE; tests/cuts.py): the skipped wait
# of the sampling merge is at the step's end, after every layer, which it does not depend on
CUT_2_LAYERS = kimi_kinds(MINI)
# the broken step is given this long: a working 2-rank step (trace, compile, run) takes ~35 s here
HANG_SECONDS = 240


def one_step(n_ranks=2, batch=1, cfg=MINI):
    params = weights.init_params(cfg, 0)
    lay = layout.layout(cfg, n_ranks)
    plan = ms.make_sharded_plan(lay, batch, cfg.max_seq_len)
    mesh = ms.make_mesh(n_ranks)
    state = ms.shard_state(reference.init_state(cfg, batch), lay, mesh)
    tokens, positions = np.arange(batch, dtype=np.int32) + 5, np.full(batch, 3, np.int32)
    out, _, _ = ms.decode_step(ms.prepare_weights(params, lay, mesh), state, tokens, positions,
                               plan, mesh=mesh)
    return np.asarray(jax.block_until_ready(out))


def skipped_wait_races(wait_name, run, method="_wait_all", owner=None):
    """run() with the receive wait of the collective `wait_name` skipped (at trace time) and DMAs
    executed when they start -> (the waits skipped, whether a race was found, the error the
    broken kernel raised or None). owner.method: what waits (default `Collectives._wait_all`;
    `levels.LevelReductions.wait`: one level of a reduction, `wait_name` "<name>/<level>")."""
    owner = owner or collectives.Collectives
    original = getattr(owner, method)
    calls = []

    def skip_first_receive(self, *args, **kwargs):
        *head, received, sent, c, name = args
        if name == wait_name:  # trace time: that collective's wait for its receives
            if not dry_run.tracing():  # the step's trace, not its cost estimate's dry run
                calls.append(name)
            received = 0
        return original(self, *head, received, sent, c, name, **kwargs)

    previous = tpu.current_interpret_options()
    # DMAs executed when they start (by default the simulator runs a DMA when its receive
    # semaphore is waited on: a skipped wait then leaves the slot stale, which the comparison
    # with the single-device step catches instead: test_skipped_wait_gives_stale_values)
    tpu.interpret_options(detect_races=True, vector_clock_size=16, dma_execution_mode="eager")
    tpu.reset_races()
    error = None
    try:
        with mock.patch.object(owner, method, skip_first_receive):
            run()
    except Exception as raised:  # noqa: BLE001 - what the broken kernel does is the point
        error = raised
    finally:
        raced = tpu.races_found()
        tpu.reset_interpret_state()
        tpu.reset_interpret_options()
        tpu.interpret_options(**previous)
    print(f"skipped wait of {wait_name}: race detected {raced}; the step "
          f"{'raised ' + str(error).splitlines()[-1][:200] if error else 'finished'}")
    return calls, raced, error


def test_skipped_semaphore_wait_is_a_race():
    """The merge of the vocab shards' sampling states (kimi-k3-mini's 2-layer cut on 2 ranks)
    reads its receive slots without waiting for them: a race. (A wait skipped earlier in the step feeds unlanded values to the router:
    the kernel then fails on an out-of-range expert id before the race is reported.)"""
    calls, raced, _ = skipped_wait_races("sampling_state", lambda: one_step(cfg=CUT_2_LAYERS))
    assert calls == ["sampling_state"]
    assert raced, "the race detector did not see the read before the remote copy landed"


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    from unittest import mock
    from mkresearch.kernels import collectives
    import test_faults

    original = collectives.Collectives._copy

    class Skipped:
        def start(self):
            return self

    def skip_first(self, *args, **kwargs):
        if not getattr(skip_first, "done", False):  # trace time: the first collective's sends
            skip_first.done = True
            return Skipped()
        return original(self, *args, **kwargs)

    print("broken step: tracing", flush=True)
    with mock.patch.object(collectives.Collectives, "_copy", skip_first):
        test_faults.one_step()
    print("broken step: finished", flush=True)
""")


@pytest.mark.skipif(os.environ.get("MKRESEARCH_SHARDED_FULL") != "1",
                    reason="waits HANG_SECONDS for a step that never finishes: opt-in with "
                           "MKRESEARCH_SHARDED_FULL=1")
def test_skipped_remote_copy_never_finishes():
    """Skipping the embedding all-reduce's sends leaves every receiver waiting: the step does not
    finish (on a TPU it would hang the same way); the child is stopped at the deadline."""
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(here=os.path.dirname(__file__))],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=os.environ.copy())
    deadline = time.monotonic() + HANG_SECONDS
    try:
        out = []
        while time.monotonic() < deadline and child.poll() is None:
            time.sleep(2)
        finished = child.poll() is not None
    finally:
        child.kill()
        out = child.communicate()[0]
    print(out[-2000:])
    assert "broken step: tracing" in out
    assert "broken step: finished" not in out, "a skipped remote copy went unnoticed"
    assert not finished or child.returncode != 0
