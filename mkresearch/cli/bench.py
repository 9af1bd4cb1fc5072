"""Decode with the megakernel, check it against the reference, time it and predict it on a TPU.

* `decode_megakernel(...)`: what `mkresearch decode --backend megakernel` runs: a random prompt is
  fed step by step (one megakernel call per token), then greedy tokens are generated. The
  reference (`reference.decode_step`) is stepped over the same tokens and state, so agreement is
  per step: the same greedy token, and the max |logit difference|.
* `run_bench(...)`: what `mkresearch bench` runs: for B in {1, 2, 4, 8}, seconds per step of
  both backends on this machine, and the timeline model's prediction for a TPU chip from one
  recorded megakernel step (`mkresearch.prediction.timeline.simulate` over the DMA log), and for a mini
  the full-size step of its full model (`predict_full_size`: `full_size.full_size_step`, the
  figures `info` and `predict` print).

Labels say what each number is: on a machine without a TPU the megakernel runs in TPU interpret
mode (a simulator: its seconds say nothing about a TPU) and the reference is plain XLA on the
CPU; the TPU numbers are the timeline model's predictions. On a TPU both are measured.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import mkresearch  # noqa: F401 - selects the platform before jax is imported
from mkresearch.generation import agreement, loop
from mkresearch.hardware import tpu
from mkresearch.kernels.base import dma
from mkresearch.kernels.compose import megakernel
from mkresearch.measurement import device_time
from mkresearch.model import reference, weights
from mkresearch.model.config import ModelConfig, get_config
from mkresearch.prediction import timeline
from mkresearch.prediction.full_size import full_size_of, full_size_step
from mkresearch.prediction.scaling import scale_log
from mkresearch.sharding import layout

BENCH_BATCHES = (1, 2, 4, 8)
NEAR_TIE_GAP = 0.1  # a top-2 logit gap under 2 x 5e-2 (docs/kimi-k3.md §11 logits tolerance) is a near-tie
# mini preset -> (the one-device stand-in for one rank of its full model, `config.get_config`;
# the full model): where `scale_to_rank` scales a recorded mini step (notebooks 07 and 10). Not
# the full-size step (`full_size.STAND_IN_LABEL`): that is `predict_full_size`'s.
FULL_SIZE_RANK = {f"{full}-mini": (f"{full}-rank", full)
                  for full in ("kimi-k3", "deepseek-v3", "glm-4.5", "qwen3-235b-a22b")}


def backend_label(backend: str) -> str:
    """What a backend's seconds here are: measured on a TPU, or a simulator's / plain XLA's on
    the CPU."""
    import jax

    on_tpu = jax.default_backend() == "tpu"
    if backend == "megakernel":
        return "measured on a TPU" if on_tpu else "TPU interpret mode on CPU (a simulator)"
    return "measured on a TPU" if on_tpu else "plain XLA on CPU"


def predict(log: Any, chip: str, batch: int) -> dict:
    """The timeline model's step time for one recorded megakernel step on `chip`."""
    simulated = timeline.simulate(log, chip)
    return {"chip": chip, "step_s": simulated.total_s, "tokens_per_s": batch / simulated.total_s,
            "hbm_floor_s": simulated.hbm_floor_s,
            "roofline_fraction": simulated.roofline_fraction, "dma_bytes": simulated.dma_bytes,
            "label": "timeline model prediction (mkresearch.prediction.timeline)"}


def scale_to_rank(log: Any, cfg: ModelConfig, batch: int) -> tuple[ModelConfig, list, float]:
    """A recorded step of a mini preset scaled to one rank of its full model (`scale_log`), the
    routed experts to that rank's expected share (its local experts hit by B tokens choosing
    top_k of the full model's experts) -> (rank config, events, unique experts per MoE layer).
    ValueError for a config that has no full-size rank (FULL_SIZE_RANK)."""
    if cfg.name not in FULL_SIZE_RANK:
        raise ValueError(f"cfg={cfg.name!r} has no full-size rank to scale to: one of "
                         f"{', '.join(FULL_SIZE_RANK)}")
    rank, full = (get_config(name) for name in FULL_SIZE_RANK[cfg.name])
    unique = rank.n_experts * (1 - (1 - rank.top_k / full.n_experts) ** batch)
    return rank, scale_log(log, cfg, rank, batch, unique_experts=unique), unique


def predict_full_size(cfg: ModelConfig, batch: int) -> dict | None:
    """The full-size step of the model a mini stands for (`full_size.full_size_step`: its full
    preset on 32 TPU7x ranks in our layout with our exact collectives, the kernel as built),
    as `info` and `predict` print it. None when cfg stands for no full preset with sharding rules."""
    full = full_size_of(cfg.name)
    if full is None or not layout.has_rules(get_config(full)):
        return None
    return full_size_step(full, batch=batch).as_dict()


class StepClock:
    """Times decode steps: the first call is compile + step, the others are steps."""

    def __init__(self) -> None:
        self.compile_seconds: float | None = None
        self.step_seconds: list[float] = []

    def run(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        import jax

        started = time.perf_counter()
        out = step(*args, **kwargs)
        jax.block_until_ready(out[0])
        elapsed = time.perf_counter() - started
        if self.compile_seconds is None:
            self.compile_seconds = elapsed
        else:
            self.step_seconds.append(elapsed)
        return out

    @property
    def step_s(self) -> float | None:
        """The median step (the compile + first step when there was one call)."""
        import numpy as np

        return float(np.median(self.step_seconds)) if self.step_seconds else self.compile_seconds


def near_tie_rows(ref_logits: Any, tokens: Any, gap: float = NEAR_TIE_GAP) -> list[tuple]:
    """(row, reference top-2 logit gap, token differs) for every row whose greedy token differs
    from the reference's (argmax of ref_logits [B, V]) or whose gap is under `gap`: a near-tie,
    the only place two logit vectors within gap / 2 of each other may pick different tokens."""
    import numpy as np

    ref_logits = np.asarray(ref_logits)
    top2 = np.sort(ref_logits, axis=-1)[:, -2:]
    gaps = top2[:, 1] - top2[:, 0]  # [B]
    differ = np.asarray(tokens) != ref_logits.argmax(-1)
    return [(int(row), float(gaps[row]), bool(differ[row]))
            for row in np.flatnonzero((gaps < gap) | differ)]


def random_prompt(cfg: ModelConfig, batch: int, prompt_len: int, seed: int) -> Any:
    """The random prompt [B, T] i32 of a seed that `decode` feeds (numpy)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    return np.asarray(jax.random.randint(jax.random.PRNGKey(seed), (batch, prompt_len), 0,
                                         cfg.vocab_size, dtype=jnp.int32))


def decode_megakernel(cfg: ModelConfig, prompt_len: int, steps: int, batch: int, seed: int,
                      chip: str | None = None, progress: bool = False) -> dict:
    """Prefill + greedy decode with the megakernel built for `chip` (None: the TPU present,
    else tpu7x) through the library's loop (`generation.loop`: chunks of steps on the device);
    then the reference teacher-forced on the same tokens, and the two compared step by step
    (`generation.agreement`); one more step recorded for the timeline model's prediction.
    A config `chip` cannot run (VMEM plan, HBM) is refused (ValueError) before any work."""
    import jax

    result, run, params, options = decode_and_compare(cfg, prompt_len, steps, batch, seed, chip,
                                                      progress)
    with dma.recording() as log:  # one more step, recorded, for the timeline model
        out, _, _ = megakernel.decode_step(params, run.state, run.next_tokens, run.next_positions,
                                           cfg, options=options)
        jax.block_until_ready(out)
    return {**result, "step_label": backend_label("megakernel"),
            "prediction": predict(log, result["chip"], batch),
            "full_size": predict_full_size(cfg, batch)}


def decode_and_compare(cfg: ModelConfig, prompt_len: int, steps: int, batch: int, seed: int,
                       chip: str | None = None, progress: bool = False,
                       prompt_seed: int | None = None) -> tuple[dict, Any, dict, Any]:
    """`decode_megakernel` without its recorded step: the run's dict (tokens, agreement,
    seconds), the loop's last Run, the parameters and the options. Weights from `seed`, the
    prompt from `prompt_seed` (default `seed`)."""
    import jax
    import numpy as np

    options = megakernel.MegakernelOptions(chip=chip)
    plan = megakernel.make_plan(cfg, batch, cfg.max_seq_len, options)  # refuses before any work
    params = weights.init_params(cfg, seed)
    prepared = megakernel.prepare_weights(params, cfg)  # once, not in each of the loop's calls
    prompt = random_prompt(cfg, batch, prompt_len, seed if prompt_seed is None else prompt_seed)
    started = time.perf_counter()
    first = loop.prefill(prepared, reference.init_state(cfg, batch), prompt, cfg, options=options,
                         return_logits=True, progress=progress)
    jax.block_until_ready(first.tokens)
    prefill_s = time.perf_counter() - started
    run, decode_s = (_timed_decode(prepared, first, cfg, steps - 1, options, progress)
                     if steps > 1 else (first, 0.0))
    later = slice(None) if steps > 1 else slice(0, 0)  # the decode's steps (none after one)
    kernel_logits = np.concatenate([np.asarray(first.logits)[-1:],
                                    np.asarray(run.logits)[later]])  # [steps, B, V]
    generated = np.concatenate([np.asarray(first.tokens)[:, -1:],
                                np.asarray(run.tokens)[:, later]], axis=1)  # [B, steps]
    fed = np.concatenate([prompt, generated[:, :-1]], axis=1)  # what the kernel was fed
    ref = loop.prefill(params, reference.init_state(cfg, batch), fed, cfg, backend="reference",
                       return_logits=True)
    margins = None if ref.margins is None else np.asarray(ref.margins)[prompt_len - 1:]
    agree = agreement.compare(kernel_logits, generated, np.asarray(ref.logits)[prompt_len - 1:],
                              margins)
    result = {
        "model": cfg.name, "backend": "megakernel", "batch": batch, "prompt_len": prompt_len,
        "steps": steps, "seed": seed, "platform": jax.default_backend(),
        "chip": plan.options.chip,
        "prompt": prompt.tolist(), "generated": generated.tolist(),  # [B, N]
        "agreement": agree.as_dict(), "agreement_line": agree.line(),
        "seconds": {"compile_and_prefill": prefill_s, "decode": decode_s,
                    "step": decode_s / max(steps - 1, 1)},
        "vmem_plan_bytes": plan.vmem.total_bytes,
    }
    return result, run, params, options


def _timed_decode(params: Any, first: Any, cfg: ModelConfig, n_steps: int, options: Any,
                  progress: bool) -> tuple[Any, float]:
    """The decode after the prefill, and its wall seconds. On a TPU the chunks are compiled first
    on a copy of the state (so the seconds are steps, not compiles); in interpret mode a compile
    is small beside a step, and not repeated."""
    import jax
    import jax.numpy as jnp

    decode = functools.partial(loop.decode, params, cfg=cfg, n_steps=n_steps, options=options,
                               return_logits=True)
    if jax.default_backend() == "tpu":
        warm = decode(jax.tree.map(jnp.copy, first.state), first.next_tokens, first.next_positions)
        jax.block_until_ready(warm.tokens)
    started = time.perf_counter()
    run = decode(first.state, first.next_tokens, first.next_positions, progress=progress)
    jax.block_until_ready(run.tokens)
    return run, time.perf_counter() - started


def print_run(result: dict, backend: str) -> None:
    """The lines every decode backend prints first: the run, then each row's prompt and tokens."""
    prompt = (f"the checkpoint's prompt of {result['prompt_len']} tokens" if "text" in result
              else f"random prompt of {result['prompt_len']} tokens (seed {result['seed']})")
    print(f"{result['model']}, backend {backend} on {result['platform']}: batch "
          f"{result['batch']}, {prompt}, {result['steps']} greedy steps")
    for row, (prompt, ids) in enumerate(zip(result["prompt"], result["generated"])):
        print(f"  row {row}: prompt {prompt} -> generated {ids}")


def print_agreement(agree: dict) -> None:
    """One line: a decode's tokens and logits against the reference backend, near-ties named."""
    ties = "".join(f"; {'routing differed' if t.get('routing_differed') else 'near-tie'} at "
                   f"step {t['step']} row {t['row']} (top-2 gap {t['top2_gap']:.3f})"
                   for t in agree["near_ties"])
    print(f"agreement with the reference backend: {agree['tokens_equal']}/{agree['tokens']} tokens "
          f"equal, max |logit diff| {agree['max_abs_logit_diff']:.2e}{ties} -> "
          f"{'PASS' if agree['passed'] else 'FAIL'}")


def print_decode(result: dict) -> None:
    print_run(result, "megakernel (one pallas_call per step)")
    print(f"agreement with the reference backend: {result['agreement_line']}")
    seconds, steps = result["seconds"], result["steps"]
    print(f"time here: compile + prefill {seconds['compile_and_prefill']:.2f} s; decode "
          f"{steps - 1} steps in {seconds['decode']:.3f} s = {seconds['step'] * 1e3:.3f} ms per "
          f"step ({result['step_label']})")
    p = result["prediction"]
    print(f"predicted on {p['chip']} ({p['label']}): {p['step_s'] * 1e6:.1f} us/step, "
          f"{p['tokens_per_s']:,.0f} tokens/s, {p['roofline_fraction']:.0%} of the HBM roofline "
          f"({p['dma_bytes'] / 1e6:.1f} MB per step)")
    _print_full_size(result.get("full_size"))


def _print_full_size(full: dict | None) -> None:
    """The full-size step's line (predict_full_size), if the model has one."""
    if full:
        print(full["line"])


def print_bench_row(row: dict) -> None:
    """What `mkresearch bench` prints for one batch size (a row of run_bench)."""
    mk, ref, p = row["megakernel"], row["reference"], row["prediction"]

    def measured(backend):
        device = "" if backend["device_s"] is None else f"{backend['device_s'] * 1e6:.1f} us device, "
        return f"{device}{backend['step_s'] * 1e6:.1f} us wall per step ({backend['label']})"

    line = (f"B={row['batch']}: megakernel {measured(mk)}; reference {measured(ref)}; HBM floor "
            f"{row['hbm_floor_s'] * 1e6:.1f} us")
    if mk["device_s"] is not None:
        line += (f" ({row['hbm_floor_s'] / mk['device_s']:.0%} of it reached; "
                 f"{ref['device_s'] / mk['device_s']:.1f}x the reference)")
    if "jax-kernels" in row:  # on a TPU: the yardsticks
        ops = row["jax-kernels"]
        line += (f"; op-by-op on JAX's kernels {ops['device_s'] * 1e6:.1f} us device "
                 f"({ops['device_s'] / mk['device_s']:.1f}x the megakernel's)")
    if "copy" in row:
        copy = row["copy"]
        line += (f"; the step's bytes copied alone {copy['device_s'] * 1e6:.1f} us "
                 f"({copy['bandwidth'] / 1e9:.0f} GB/s; the megakernel at "
                 f"{copy['device_s'] / mk['device_s']:.0%} of that ceiling)")
    print(f"{line}; predicted on {p['chip']}: {p['step_s'] * 1e6:.1f} us/step, "
          f"{p['tokens_per_s']:,.0f} tokens/s ({p['label']})")
    _print_full_size(row.get("full_size"))


# ---- mkresearch bench --------------------------------------------------------------------------
def bench_batch(cfg: ModelConfig, params: dict, batch: int, steps: int, chip: str) -> dict:
    """Both backends at one batch size through the library's loop (`steps` steps per call):
    seconds per step here (on a TPU also the device time, from a profile), the HBM floor, and
    the megakernel's prediction from one recorded step."""
    import jax
    import numpy as np

    row = device_time.measure(cfg, params, batch=batch, steps=steps, chip=chip)
    tokens = (np.arange(batch, dtype=np.int32) * 31 + 7) % cfg.vocab_size
    with dma.recording() as log:  # one step for the timeline model (from shapes on a TPU)
        jax.block_until_ready(megakernel.decode_step(
            params, reference.init_state(cfg, batch), tokens, np.full(batch, 3, np.int32), cfg,
            options=megakernel.MegakernelOptions(chip=chip))[0])
    measured = [b for b in (*device_time.BACKENDS, *device_time.YARDSTICKS) if b in row]
    return {"batch": batch, "hbm_floor_s": row["hbm_floor_s"],
            **{backend: {"step_s": row[backend]["wall_s"],
                         "device_s": row[backend].get("device_s"),
                         "first_call_s": row[backend]["compile_s"],
                         "label": backend_label(backend)} for backend in measured},
            **({"copy": row["copy"]} if "copy" in row else {}),
            "prediction": predict(log, chip, batch),
            "full_size": predict_full_size(cfg, batch)}


def run_bench(cfg: ModelConfig, batches=BENCH_BATCHES, steps: int = 3, chip: str | None = None,
              seed: int = 0, out_json: str | Path | None = None,
              figure: str | Path | None = None) -> dict:
    """Decode steps for each batch size on both backends (the megakernel built for `chip`); JSON
    and figure if paths are given. A batch `chip` cannot run is refused before any work."""
    import jax

    chip = chip or tpu.default_chip()
    for batch in batches:
        megakernel.make_plan(cfg, batch, cfg.max_seq_len, megakernel.MegakernelOptions(chip=chip))
    params = weights.init_params(cfg, seed)
    rows = [bench_batch(cfg, params, batch, steps, chip) for batch in batches]
    result = {"model": cfg.name, "platform": jax.default_backend(), "chip": chip,
              "steps_timed": steps, "rows": rows,
              "note": ("seconds per step measured on this machine through the library's loop "
                       "(step_s: wall; device_s: from a profile, on a TPU); on a CPU the megakernel "
                       "runs in TPU interpret mode, a simulator whose times say nothing about a "
                       "TPU. predicted: the timeline model's, from a recorded DMA log.")}
    if out_json is not None:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(result, indent=1))
    if figure is not None:
        plot_bench(result, figure)
    return result


def plot_bench(result: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = bench_figure(result)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_figure(result: dict):
    """The bench's rows: seconds per step here (both backends), and the predicted TPU step with
    its tok/s written under each point."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    rows = result["rows"]
    batches = [r["batch"] for r in rows]
    fig, (here, tpu) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for backend, marker in (("megakernel", "o"), ("reference", "s")):
        label = f"{backend}: {rows[0][backend]['label']}"
        here.plot(batches, [r[backend]["step_s"] for r in rows], marker=marker, label=label)
        if rows[0][backend].get("device_s") is not None:  # on a TPU: the profile's device time
            here.plot(batches, [r[backend]["device_s"] for r in rows], marker=marker,
                      linestyle="--", label=f"{backend}: device time (profile)")
    here.set(xscale="log", yscale="log", xlabel="batch B", ylabel="seconds per step",
             title=f"{result['model']}: measured on {result['platform']}")
    here.legend(fontsize=8)
    predicted = [r["prediction"] for r in rows]
    steps_us = [p["step_s"] * 1e6 for p in predicted]
    tpu.plot(batches, steps_us, marker="o", label="megakernel step (timeline model prediction)")
    tpu.plot(batches, [p["hbm_floor_s"] * 1e6 for p in predicted], linestyle="--",
             label="HBM floor of the same bytes")
    tpu.set(xscale="log", xlabel="batch B", ylabel="microseconds per step",
            title=f"{result['model']} on {result['chip']}: predicted, not measured")
    tpu.set_ylim(0, max(steps_us) * 1.3)  # room above the line for the legend
    for i, (b, p, y) in enumerate(zip(batches, predicted, steps_us, strict=True)):
        # off the rising line: below and right of each point, the last one above and left
        last = i == len(batches) - 1
        tpu.annotate(f"{p['tokens_per_s']:,.0f} tok/s", (b, y), fontsize=7,
                     textcoords="offset points", xytext=(-6, 6) if last else (5, -10),
                     ha="right" if last else "left", va="bottom" if last else "top")
    tpu.legend(fontsize=8, loc="upper left")
    for ax in (here, tpu):
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.xaxis.set_minor_formatter(NullFormatter())
    # plain numbers at 1, 2, 5 per decade instead of 10^-1 and labelled minor ticks (6x10^-1)
    here.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    here.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    here.yaxis.set_minor_formatter(NullFormatter())
    return fig


def plot_decode_bench(path: str | Path) -> None:
    """figures/decode_bench.png (the figure registry): from decode_bench.json beside it when it
    exists (`mkresearch bench` writes both), else from a short bench of kimi-k3-mini."""
    path = Path(path)
    data = path.with_suffix(".json")
    if data.exists():
        plot_bench(json.loads(data.read_text()), path)
    else:
        run_bench(get_config("kimi-k3-mini"), steps=1, out_json=data, figure=path)
