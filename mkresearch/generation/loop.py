"""The decode loop: inputs checked once, then jitted runs of several steps whose tokens,
positions and state never leave the device.

    run = loop.decode(params, state, tokens, positions, cfg, n_steps=32)      # the megakernel
    run.tokens            # [B, 32] i32 on the device: the token drawn after each step
    run.state             # the state after the 32 steps (the input state was donated)

One call of the compiled chunk runs `steps_per_call` steps in a `lax.scan` (the megakernel's
`pallas_call` or the reference step in its body), each step's sampled token fed to the next at
position + 1, so the host dispatches one call per chunk and never reads a token back: the wall
clock per step approaches the kernel's device time once a chunk is longer than the dispatch
(`mkresearch bench` measures both). `forced` tokens [B, T] are fed instead of the sampled ones
(prefill, teacher forcing), the sampled ones still returned: `prefill` is that.

Backends: "megakernel" (`kernels.compose.megakernel`, the prepared weights made once),
"reference" (`model.reference` + `model.sampling.sample`, the plain-JAX oracle) and
"jax-kernels" (`baselines.jax_kernels`: the op-by-op step on JAX's own TPU kernels, a yardstick). The same
sampling arguments mean the same tokens on both: the megakernel samples in its last stage with
the seed and the position + 1 of each row, as `sampling.sample` does.

A DMA log of a step is recorded by `megakernel.decode_step` under `dma.recording()`, not here:
a chunk is one traced program (on a TPU a log is the kernel run on shapes with known inputs).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mkresearch.baselines import jax_kernels
from mkresearch.hardware import tpu
from mkresearch.kernels.compose import megakernel
from mkresearch.model import reference, sampling
from mkresearch.model.config import ModelConfig

BACKENDS = ("megakernel", "reference", "jax-kernels")
STEPS_PER_CALL = 16  # steps one compiled call runs: dispatch cost / 16 per step


@dataclasses.dataclass(frozen=True)
class Run:
    """What `decode` returns, on the device: tokens [B, N] i32 (the token drawn after each
    step), logits [N, B, V] f32 (when asked), the state after the N steps, and the positions
    [B] and tokens [B] the next step would take; with logits, the reference backend also gives
    each step's routing margins [N, n_moe, B] (`ffn.routing_margin`; None without MoE layers)."""

    tokens: jax.Array
    logits: jax.Array | None
    state: dict
    next_positions: jax.Array
    next_tokens: jax.Array
    margins: jax.Array | None = None


def decode(params: dict, state: dict, tokens: Any, positions: Any, cfg: ModelConfig,
           n_steps: int, *, backend: str = "megakernel", forced: Any = None, seed: int = 0,
           temperature: Any = None, top_k: Any = 0, top_p: Any = 1.0,
           options: megakernel.MegakernelOptions | None = None,
           steps_per_call: int = STEPS_PER_CALL, return_logits: bool = False,
           progress: bool = False) -> Run:
    """n_steps decode steps from tokens [B] at positions [B] (each row's token at its position,
    the next token drawn for position + 1), in compiled chunks of `steps_per_call` steps.

    forced [B, n_steps]: the tokens fed at each step instead of the drawn ones (the first step
    feeds `tokens` either way, so forced[:, 0] must be it; prefill passes the prompt). params:
    the parameters, or the megakernel's prepared weights (`megakernel.prepare_weights`). The
    state is donated. Inputs are checked once here (ValueError naming the argument), never
    inside the loop."""
    _check(backend, n_steps, steps_per_call)
    batch = np.shape(tokens)[0] if np.ndim(tokens) == 1 else None
    seq_len = reference.check_state(state, cfg, batch) if batch else None
    if batch is None:
        raise ValueError(f"tokens has shape {np.shape(tokens)}: allowed [B] (one token per row)")
    positions = np.asarray(positions) if not isinstance(positions, jax.Array) else positions
    _check_positions(positions, batch, n_steps, seq_len)
    forced = _check_forced(forced, tokens, batch, n_steps, cfg)
    step = (_megakernel_chunks(params, state, cfg, batch, seq_len, options, seed, temperature,
                               top_k, top_p, return_logits) if backend == "megakernel"
            else _reference_chunks(params, cfg, seed, temperature, top_k, top_p, return_logits,
                                   backend))
    # handed to the compiled chunk as they are: a host array travels with the call, not as a
    # program of its own (on a TPU each eager op costs ~0.1-0.4 ms of host time per call)
    tokens, positions = _int32(tokens), _int32(positions)
    drawn, logits, margins = [], [], []
    bar = _bar(cfg, backend, n_steps, progress)
    for start in range(0, n_steps, steps_per_call):
        n = min(steps_per_call, n_steps - start)
        chunk_forced = None if forced is None else forced[:, start:start + n]
        tokens, positions, state, chunk_tokens, chunk_logits = step(n, tokens, positions, state,
                                                                     chunk_forced)
        drawn.append(chunk_tokens)
        if return_logits:
            chunk_logits, chunk_margins = (chunk_logits if isinstance(chunk_logits, tuple)
                                           else (chunk_logits, None))
            logits.append(chunk_logits)
            margins.append(chunk_margins)
        if bar is not None:
            jax.block_until_ready(chunk_tokens)  # the bar says what has run, not what is queued
            bar.update(n)
    if bar is not None:
        bar.close()
    has_margins = bool(margins) and margins[0] is not None
    return Run(jnp.concatenate(drawn, axis=1), jnp.concatenate(logits) if return_logits else None,
               state, positions, tokens, jnp.concatenate(margins) if has_margins else None)


def prefill(params: dict, state: dict, prompt: Any, cfg: ModelConfig, **kwargs: Any) -> Run:
    """Feed prompt [B, T] at positions 0..T-1 (`decode` with the prompt forced): run.tokens[:, -1]
    is the first generated token (drawn after the last prompt token), run.next_positions T."""
    prompt = np.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt has shape {prompt.shape}: allowed [B, T] with T >= 1")
    return decode(params, state, prompt[:, 0], np.zeros(prompt.shape[0], np.int32), cfg,
                  prompt.shape[1], forced=prompt, **kwargs)


# ---- checks, once ------------------------------------------------------------------------------
def _check(backend: Any, n_steps: Any, steps_per_call: Any) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid: one of {', '.join(BACKENDS)}")
    for name, value in (("n_steps", n_steps), ("steps_per_call", steps_per_call)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: an int >= 1")


def _check_positions(positions: Any, batch: int, n_steps: int, seq_len: int | None) -> None:
    if np.shape(positions) != (batch,):
        raise ValueError(f"positions has shape {np.shape(positions)}: allowed ({batch},)")
    if seq_len is None or isinstance(positions, jax.core.Tracer):
        return
    last = np.asarray(positions).max() + n_steps - 1  # read once, before the loop
    if np.asarray(positions).min() < 0 or last >= seq_len:
        raise ValueError(f"positions={np.asarray(positions).tolist()} with n_steps={n_steps} is "
                         f"invalid: every step's position in [0, {seq_len}) (the cache length; "
                         "init_state(cfg, batch, max_seq_len=...) for a longer one)")


def _check_forced(forced: Any, tokens: Any, batch: int, n_steps: int, cfg: ModelConfig) -> Any:
    reference.check_token_ids("tokens", tokens, cfg)
    if forced is None:
        return None
    forced = np.asarray(forced)
    if forced.shape != (batch, n_steps):
        raise ValueError(f"forced has shape {forced.shape}: allowed ({batch}, {n_steps}), the "
                         "token fed at each step")
    reference.check_token_ids("forced", forced, cfg)
    if not np.array_equal(forced[:, 0], np.asarray(tokens)):
        raise ValueError("forced[:, 0] differs from tokens: the first step feeds tokens")
    return forced.astype(np.int32)  # host ints: each chunk's slice travels with its call


def _int32(values: Any) -> Any:
    """Token ids or positions as int32: a device array stays on the device, host values become a
    numpy array (the jitted chunk takes it with the call)."""
    if isinstance(values, jax.Array):
        return values if values.dtype == jnp.int32 else values.astype(jnp.int32)
    return np.asarray(values, np.int32)


def _bar(cfg: ModelConfig, backend: str, n_steps: int, progress: bool) -> Any:
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=n_steps, desc=f"{cfg.name} {backend}", unit="step", file=sys.stderr,
                leave=False)


# ---- the megakernel's chunk ---------------------------------------------------------------------
def _megakernel_chunks(params, state, cfg, batch, seq_len, options, seed, temperature, top_k,
                       top_p, return_logits):
    """chunk(n, tokens, positions, state, forced) -> the same and (tokens [B, n], logits) for the
    megakernel, its plan and sampling inputs made once."""
    options = megakernel.MegakernelOptions() if options is None else options
    plan = megakernel.make_plan(cfg, batch, seq_len, options)  # made once per arguments
    tpu.check_runs_here(plan.options.chip)
    weights = megakernel.prepare_weights(params, cfg)
    inputs, use_gumbel, use_candidates = _sampling_inputs(plan, seed, _static(temperature),
                                                          _static(top_k), _static(top_p))
    interpret = tpu.interpret_params()

    def chunk(n, tokens, positions, state, forced):
        return _megakernel_run(plan, interpret, use_gumbel, use_candidates, bool(return_logits),
                               n, inputs, tokens, positions, weights, state, forced)

    return chunk


@functools.lru_cache(maxsize=32)
def _sampling_inputs(plan: Any, seed: int, temperature: Any, top_k: Any, top_p: Any) -> tuple:
    """The step's inputs but tokens and positions, checked and made once per plan and sampling
    arguments (10 ms of host work for kimi-k3-mini: not to be paid per call)."""
    zeros = np.zeros(plan.batch, np.int32)
    return megakernel.step_inputs(plan, zeros, zeros, seed, temperature, top_k, top_p)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5), donate_argnums=(10,))
def _megakernel_run(plan, interpret, use_gumbel, use_candidates, return_logits, n, inputs,
                    tokens, positions, weights, state, forced):
    # the chunk's tokens and positions [B] (int32, `_int32`) into the step's inputs here, in
    # the compiled call
    inputs = dataclasses.replace(inputs, tokens=tokens, positions=positions,
                                 sample_positions=(positions + 1)[:, None])

    def step(carry, fed):
        inputs, state = carry
        if fed is not None:
            inputs = dataclasses.replace(inputs, tokens=fed)
        drawn, _, logits, state = megakernel.step_call(plan, interpret, use_gumbel,
                                                       use_candidates, return_logits, inputs,
                                                       weights, state)
        nxt = dataclasses.replace(inputs, tokens=drawn, positions=inputs.positions + 1,
                                  sample_positions=inputs.sample_positions + 1)
        return (nxt, state), (drawn, logits)

    fed = None if forced is None else forced.T  # [n, B]
    (inputs, state), (drawn, logits) = lax.scan(step, (inputs, state), fed, length=n)
    return inputs.tokens, inputs.positions, state, drawn.T, logits


# ---- the reference's chunk ----------------------------------------------------------------------
def _reference_chunks(params, cfg, seed, temperature, top_k, top_p, return_logits, backend):
    """The chunk of a plain-JAX step: the reference's, or the op-by-op step on JAX's kernels."""
    if megakernel.is_prepared(params):
        raise ValueError(f"backend={backend!r} takes the parameters, not prepare_weights' output")
    sample = _Sampler(seed, _static(temperature), _static(top_k), _static(top_p))
    step = (reference.decode_step_unchecked if backend == "reference"
            else functools.partial(jax_kernels.step, interpret=tpu.interpret_params()))

    def chunk(n, tokens, positions, state, forced):
        return _reference_run(cfg, step, sample, bool(return_logits), n, params, tokens,
                              positions, state, forced)

    return chunk


def _static(value: Any) -> Any:
    """A sampling argument as a hashable static value (a per-row list as a tuple)."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(None if v is None else v.item() if hasattr(v, "item") else v
                     for v in np.asarray(value, object).tolist())
    return value


@dataclasses.dataclass(frozen=True)
class _Sampler:
    """`sampling.sample` with its arguments fixed: a static argument of the compiled chunk."""

    seed: int
    temperature: Any
    top_k: Any
    top_p: Any

    def __call__(self, logits: jax.Array, *, positions: jax.Array) -> jax.Array:
        return sampling.sample(logits, seed=self.seed, positions=positions,
                               temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(8,))
def _reference_run(cfg, decode_step, sample, return_logits, n, params, tokens, positions, state,
                   forced):
    def step(carry, fed):
        tokens, positions, state = carry
        if fed is not None:
            tokens = fed
        logits, state, aux = decode_step(params, state, tokens, positions, cfg)
        drawn = sample(logits, positions=positions + 1)
        seen = (logits, aux.get("routing_margin")) if return_logits else None
        return (drawn, positions + 1, state), (drawn, seen)

    fed = None if forced is None else forced.T
    (tokens, positions, state), (drawn, logits) = lax.scan(step, (tokens, positions, state), fed,
                                                           length=n)
    return tokens, positions, state, drawn.T, logits
