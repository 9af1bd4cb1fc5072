"""Speed targets, measured and printed, never asserted in a test (`make bench-speed`).

A wall-clock limit inside `make test` is a coin toss on a shared 2-core machine, so the speed
figures the tests once asserted live here: each is timed several times and the median is printed
beside its target. The tests check the structure that makes each fast (no allocation, one
collection per lane, ...); this table says how fast it is on the machine at hand.
"""

import statistics
import sys
import time

import jax
import numpy as np

from mkresearch.hardware import tpu

tpu.select_platform()

from mkresearch.model import prefill, reference, weights  # noqa: E402
from mkresearch.model.config import get_config  # noqa: E402
from mkresearch.prediction import timeline  # noqa: E402
from mkresearch.views import widgets  # noqa: E402

MINI, FULL = get_config("kimi-k3-mini"), get_config("kimi-k3")
BLOCK = 256 * 1024


def seconds(run, repeats=5) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return times


def init_params_first_call():
    jax.clear_caches()  # the first call of a fresh process: compile included
    jax.block_until_ready(weights.init_params(MINI, seed=5))


def reference_mini_step():
    params = weights.init_params(MINI, seed=0)
    state, tokens = reference.init_state(MINI, 2), np.array([1, 2])
    positions = np.array([0, 3], np.int32)
    jax.block_until_ready(reference.decode_step(params, state, tokens, positions, MINI))  # compile
    return lambda: jax.block_until_ready(
        reference.decode_step(params, state, tokens, positions, MINI))


def prefill_512(cfg, first_call=False):
    """A 512-token prompt (B = 1) through `prefill.prefill`: two 256-token jitted calls."""
    params = weights.init_params(cfg, seed=0)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 512))

    def run():
        if first_call:
            jax.clear_caches()
        state = reference.init_state(cfg, 1, max_seq_len=512)
        jax.block_until_ready(prefill.prefill(params, state, prompt, cfg))
    if not first_call:
        run()  # compile
    return run


def gantt_draw(n_blocks):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = timeline.simulate(timeline.stream_log(n_blocks, BLOCK, 2e6, 2), "tpu7x")

    def draw():
        fig, ax = plt.subplots(figsize=(11, 3.2), layout="constrained")
        widgets.plot_gantt(tl, ax)
        fig.canvas.draw()
        plt.close(fig)
    return draw


def main() -> int:
    rows = []  # (what, median s, target text, met)
    t = statistics.median(seconds(init_params_first_call, 3))
    rows.append(("weights.init_params(kimi-k3-mini), first call", t, "< 5 s", t < 5.0))
    t = statistics.median(seconds(lambda: weights.param_shapes(FULL)))
    rows.append(("weights.param_shapes(kimi-k3): 2.78 T parameters, no allocation", t, "< 2 s",
                 t < 2.0))
    t = statistics.median(seconds(reference_mini_step()))
    rows.append(("reference.decode_step, kimi-k3-mini, B = 2 (compiled)", t, "< 1 s", t < 1.0))
    for name in ("kimi-k3-mini", "deepseek-v3-mini", "glm-4.5-mini", "qwen3-235b-a22b-mini"):
        cfg = get_config(name)
        t = statistics.median(seconds(prefill_512(cfg, first_call=True), 1))
        rows.append((f"prefill.prefill, {name}, 512-token prompt, compile included", t, "< 60 s",
                     t < 60.0))
        t = statistics.median(seconds(prefill_512(cfg), 3))
        rows.append((f"prefill.prefill, {name}, 512-token prompt (compiled)", t, "< 10 s",
                     t < 10.0))
    small = min(seconds(gantt_draw(50), 3))
    large = min(seconds(gantt_draw(6500), 3))
    rows.append(("plot_gantt + draw, 13,000 spans vs 100 spans", large,
                 f"< 5 x {small:.3f} s + 0.05 s", large < 5 * small + 0.05))
    width = max(len(r[0]) for r in rows)
    print(f"{'what':<{width}}  {'median':>9}  target")
    for what, t, target, met in rows:
        print(f"{what:<{width}}  {t:>8.3f}s  {target}  {'met' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
