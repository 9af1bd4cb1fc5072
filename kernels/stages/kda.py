"""KDA decode attention (docs/kimi-k3.md §4) as one Pallas TPU kernel: x -> sublayer output + state update.

One call does, for a batch of B rows:

  state in      the conv state [B, conv-1, 3, H, D] bf16 and the recurrent state [B, H, D, D] f32
                start flying HBM->VMEM first, so their DMAs hide behind the projections.
  projections   f = bf(x W_fa); g_raw = bf(f W_fb); q̃ k̃ ṽ u = bf(x W_{q,k,v,g}); b = bf(x W_b)
                (every weight streams HBM->VMEM in row blocks through the DMA log)
  per (row, head), all in VMEM:
                λ = bound·σ(exp(A_log_h)·(g_raw + dt_bias))  ∈ (bound, 0), bound = −5
                û = bf(SiLU(Σ_j w_j ⊙ ũ_{t−3+j}))  for q, k, v (causal depthwise conv, size 4)
                q = q̂/‖q̂‖·D^−½, k = k̂/‖k̂‖ (L2, eps 1e-6), β = σ(b)
                S̄ = Diag(e^λ) S; S ← S̄ + β k (v − S̄ᵀk)ᵀ; o = Sᵀ q       (gated delta rule, f32)
                y = bf(RMSNorm_γo(bf(o)) ⊙ bf(σ(u)))
  output        out = y W_o (streamed)
  state out     both states are written back in place (input_output_aliases).

Row vectors are [1, D] (a head's lanes of a [B, H·D] projection). The two column vectors the
delta rule needs (e^λ to scale S's key rows, βk for the rank-1 update) come from one transpose
of an [8, D] block — one vreg — instead of two [D, D] transposes.

`kda_attention_body` works on Refs and allocates its own scratch; `kda_attention` is the thin
`pallas_call` wrapper with the reference's signature (`mkresearch.model.reference.kda_attention`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, chip_log, costs, dma, input_checks, planned
from mkresearch.kernels.base.blocks import bf16, f32
from mkresearch.kernels.base.registry import KernelStage, StageRefs, Streamed, register

from mkresearch.hardware import tpu
from mkresearch.model.config import ModelConfig

# Weights in the order the body takes them (vectors are passed as [1, n]).
WEIGHT_NAMES = ("w_fa", "w_fb", "w_q", "w_k", "w_v", "w_g", "w_b", "conv_w", "a_log", "dt_bias",
                "o_norm", "w_o")
MATRICES = ("w_fa", "w_fb", "w_q", "w_k", "w_v", "w_g", "w_b", "w_o")  # streamed, in body order


def matrices(output_gate_rank: int) -> tuple[str, ...]:
    """MATRICES with the output gate of the config: W_g, or W_ga, W_gb through a rank-r
    bottleneck (Kimi Linear, kda_output_gate_rank > 0)."""
    gate = ("w_ga", "w_gb") if output_gate_rank else ("w_g",)
    return MATRICES[:5] + gate + MATRICES[6:]


def weight_names(cfg: ModelConfig) -> tuple[str, ...]:
    """WEIGHT_NAMES with the output gate of cfg (`matrices`)."""
    return matrices(cfg.kda_output_gate_rank)[:-1] + WEIGHT_NAMES[7:]
LOADED_WHOLE = ("conv_w", "a_log", "dt_bias", "o_norm")  # DMA'd whole after the projections
# DMA-log names of the states' reads and writes (<name>.read, <name>.write), state leaf -> name
STATE_DMAS = {"conv": "kda.conv_state", "recurrent": "kda.state"}


@dataclass(frozen=True)
class KdaPlan:
    """Everything static about one KDA kernel."""

    batch: int
    n_heads: int
    head_dim: int
    d_model: int
    gate_rank: int
    conv_size: int
    decay_bound: float
    rms_eps: float
    l2_eps: float
    rows: tuple[tuple[str, int], ...]  # matrix name -> rows of one streamed block
    # rows sharing one state row (a verify step's K + 1 tokens, in order): row r advances state
    # row r // rows_per_state, and each row's states are also written to refs.steps_out (not in
    # the repr: the recorded compiles are keyed by a decode plan's repr, `mkresearch.measurement.recorded`)
    rows_per_state: int = field(default=1, repr=False)
    # Kimi Linear's KDA (ModelConfig.kda_output_gate_rank, kda_decay), not in the repr for the
    # same reason: Kimi K3's plans keep their keys
    output_gate_rank: int = field(default=0, repr=False)
    decay: str = field(default="bounded", repr=False)

    def block_rows(self, name: str) -> int:
        return dict(self.rows)[name]


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, h, hd = cfg.d_model, cfg.n_heads, cfg.kda_width
    r = cfg.kda_output_gate_rank
    gate = {"w_ga": (d, r), "w_gb": (r, hd)} if r else {"w_g": (d, hd)}
    return {"w_fa": (d, cfg.kda_gate_rank), "w_fb": (cfg.kda_gate_rank, hd), "w_q": (d, hd),
            "w_k": (d, hd), "w_v": (d, hd), **gate, "w_b": (d, h),
            "conv_w": (3, cfg.kda_conv_size, hd), "a_log": (h,), "dt_bias": (hd,),
            "o_norm": (cfg.kda_head_dim,), "w_o": (hd, d)}


WEIGHT_DTYPES = {"a_log": jnp.float32, "dt_bias": jnp.float32}  # the rest are bf16


def make_plan(cfg: ModelConfig, batch: int, *, weight_block_rows: int | None = None) -> KdaPlan:
    """Check block sizes (ValueError naming the parameter) and fix every static size."""
    blocks.check_block_rows(weight_block_rows)
    shapes = weight_shapes(cfg)
    rows = tuple((name, blocks.weight_block_rows(shapes[name], jnp.bfloat16, weight_block_rows))
                 for name in matrices(cfg.kda_output_gate_rank))
    return KdaPlan(batch=batch, n_heads=cfg.n_heads, head_dim=cfg.kda_head_dim,
                   d_model=cfg.d_model, gate_rank=cfg.kda_gate_rank, conv_size=cfg.kda_conv_size,
                   decay_bound=float(cfg.kda_decay_bound), rms_eps=cfg.rms_eps,
                   l2_eps=cfg.l2_eps, rows=rows, output_gate_rank=cfg.kda_output_gate_rank,
                   decay=cfg.kda_decay)


# ---- the body -----------------------------------------------------------------------------------


def kda_attention_body(plan: KdaPlan, refs: StageRefs) -> None:
    """One KDA sublayer for B rows.

    refs.x [B, d] bf16 (VMEM); refs.weights by WEIGHT_NAMES in HBM (a_log [1, H], dt_bias
    [1, H·D], o_norm [1, D]); refs.state_in {"conv" [B, conv-1, 3, H, D] bf16, "recurrent"
    [B, H, D, D] f32} in HBM, refs.state_out the same buffers (aliased); refs.out [B, d] bf16
    (VMEM). refs.indices tag the DMA log.

    A verify step (plan.rows_per_state = K + 1 > 1): x holds R = B (K + 1) rows, row r the token
    r mod (K + 1) of state row r // (K + 1); the rows run in order, so each state row advances
    token by token, and after each row its conv and recurrent states are DMA'd to
    refs.steps_out {"conv" [K+1, B, ...], "recurrent" [K+1, B, ...]} at [r mod (K + 1), b].
    """
    conv_in, state_in = refs.state_in["conv"], refs.state_in["recurrent"]
    pl.run_scoped(functools.partial(_in_vmem, plan, refs),
                  pltpu.VMEM(conv_in.shape, conv_in.dtype),
                  pltpu.VMEM(state_in.shape, state_in.dtype),
                  pltpu.VMEM((plan.batch, 3, plan.n_heads, plan.head_dim), jnp.float32),
                  pltpu.SemaphoreType.DMA((2,)))


class _Vmem(NamedTuple):
    """The body's scoped buffers."""

    conv: Any  # [B, conv-1, 3, H, D] bf16: the conv windows
    state: Any  # [B, H, D, D] f32: the recurrent states
    current: Any  # [B, 3, H, D] f32: this step's pre-conv q/k/v, head h in sublane h
    sems: Any  # [2] DMA: the conv and the recurrent state


class _Projected(NamedTuple):
    """What the delta rule reads of the projections and the small weights."""

    rows: tuple  # q̃, k̃, ṽ, g_raw, u [B, H·D] and b [B, H] f32 (bf16 values)
    taps: Any  # [3, conv, H·D] f32
    decay_rate: Any  # e^A [1, H]
    bias: Any  # dt_bias [1, H·D] f32
    gamma: Any  # o_norm [1, D]


def _in_vmem(p: KdaPlan, refs: StageRefs, conv: Any, state: Any, current: Any, sems: Any) -> None:
    """The sublayer with its buffers (`_Vmem`; their names are the VMEM plan's): both states
    read while the projections stream, the rows in order, the states written back while W_o
    streams."""
    vmem = _Vmem(conv, state, current, sems)
    reads = _state_copies(p, refs, vmem, "read")
    with dma.phase("kda.project", **refs.indices):
        projected = _project(p, refs)
    for copy in reads:
        copy.wait()
    y = jax.lax.fori_loop(0, p.batch, functools.partial(_row_step, p, refs, projected, vmem),
                          (jnp.zeros((p.batch, p.head_dim)),) * p.n_heads)
    y = jnp.concatenate(y, axis=1)  # [B, H·D]: lane-aligned pieces
    writes = _state_copies(p, refs, vmem, "write")
    with dma.phase("kda.output", **refs.indices):
        refs.out[...] = bf16(blocks.stream_matmul(refs.stream, bf16(y), refs.weights["w_o"],
                                                  rows=p.block_rows("w_o"), name="kda.w_o",
                                                  **refs.indices))
    for copy in writes:
        copy.wait()


def _state_copies(p: KdaPlan, refs: StageRefs, vmem: _Vmem, direction: str) -> list:
    """Both states' DMAs started, HBM -> VMEM ("read") or back ("write")."""
    out = []
    for i, (leaf, buffer) in enumerate((("conv", vmem.conv), ("recurrent", vmem.state))):
        hbm = (refs.state_in if direction == "read" else refs.state_out)[leaf]
        src, dst = (hbm, buffer) if direction == "read" else (buffer, hbm)
        out.append(dma.Copy(src, dst, vmem.sems.at[i], name=f"{STATE_DMAS[leaf]}.{direction}",
                            buffer=planned.STATE, **refs.indices).start())
    return out


def _project(p: KdaPlan, refs: StageRefs) -> _Projected:
    """f = bf(x W_fa), g_raw = bf(f W_fb); q̃ k̃ ṽ u b = bf(x W_{q,k,v,g,b}) (streamed), then
    the small weights loaded whole."""
    w, x = refs.weights, refs.x[...]  # x [B, d] bf16

    def project(inputs, name):
        return bf16(blocks.stream_matmul(refs.stream, inputs, w[name], rows=p.block_rows(name),
                                         name=f"kda.{name}", **refs.indices))

    g_raw = f32(project(project(x, "w_fa"), "w_fb"))  # [B, H·D]
    pre_conv = [f32(project(x, name)) for name in ("w_q", "w_k", "w_v")]  # bf16 values
    if p.output_gate_rank:  # Kimi Linear: u = bf(bf(x W_ga) W_gb)
        u = f32(project(project(x, "w_ga"), "w_gb"))  # [B, H·D]
    else:
        u = f32(project(x, "w_g"))  # [B, H·D]
    b_logit = f32(project(x, "w_b"))  # [B, H]
    loaded = {name: blocks.load_whole(w[name], name=f"kda.{name}", **refs.indices)
              for name in LOADED_WHOLE}
    return _Projected((*pre_conv, g_raw, u, b_logit), f32(loaded["conv_w"]),
                      jnp.exp(loaded["a_log"]), loaded["dt_bias"], loaded["o_norm"])


def _row_step(p: KdaPlan, refs: StageRefs, projected: _Projected, vmem: _Vmem, b: Any,
              y: tuple) -> tuple:
    """One batch row (a loop, not unrolled: it keeps the kernel small): every head's delta rule
    on the row's state row, then its conv window moved by one. y: per head [B, D]."""
    y = list(y)
    s = blocks.state_row(b, p.rows_per_state)  # the row's state row
    conv_old = f32(vmem.conv[s])  # [conv-1, 3, H, D]
    rows = [blocks.select_row(v, b) for v in projected.rows]
    for h in range(p.n_heads):
        with dma.phase("kda.delta_rule", row=b, head=h, **refs.indices):
            y_h = _head_step(p, b, s, h, conv_old, rows, projected.taps, projected.decay_rate,
                             projected.bias, projected.gamma, vmem.current, vmem.state)
        y[h] = blocks.put_row(y[h], b, y_h)
    # the conv window moves by one: drop the oldest, append this step's pre-conv vectors
    for j in range(p.conv_size - 2):
        vmem.conv[s, j] = vmem.conv[s, j + 1]
    vmem.conv[s, p.conv_size - 2] = bf16(vmem.current[b])
    if p.rows_per_state > 1:  # a verify row: its states, kept for the rollback
        _write_steps(p, refs, vmem, b, s)
    return tuple(y)


def _write_steps(p: KdaPlan, refs: StageRefs, vmem: _Vmem, b: Any, s: Any) -> None:
    """A verify row's states to refs.steps_out at [its token, s], waited for at once: the next
    row updates the same buffers."""
    token = jax.lax.rem(b, p.rows_per_state)
    copies = [dma.Copy(source.at[s], refs.steps_out[leaf].at[token, s], vmem.sems.at[i],
                       name=f"{STATE_DMAS[leaf]}.step", buffer=planned.STATE, row=b,
                       **refs.indices).start()
              for i, (leaf, source) in enumerate((("conv", vmem.conv), ("recurrent", vmem.state)))]
    for copy in copies:
        copy.wait()


def _head_step(p: KdaPlan, b, s, h, conv_old, rows, taps, decay_rate, bias, gamma, current_vmem,
               state_vmem) -> jax.Array:
    """Conv, norms, gated delta rule, output norm and gate for row b (state row s), head h
    -> y [1, D].

    rows: this batch row of the projections (q̃, k̃, ṽ, g_raw, u [1, H·D]; b [1, H]).
    """
    d = p.head_dim
    lanes = slice(h * d, (h + 1) * d)
    *pre_conv, g_raw, u, b_logit = rows

    # short causal depthwise conv for q, k, v: window = [3 cached (oldest first) ; current]
    conv_outs = []
    for c in range(3):
        current = pre_conv[c][:, lanes]  # [1, D]
        current_vmem[b, c, h:h + 1, :] = current
        window = [conv_old[j, c, h:h + 1, :] for j in range(p.conv_size - 1)] + [current]
        mixed = sum(taps[c, j:j + 1, lanes] * window[j] for j in range(p.conv_size))
        conv_outs.append(f32(bf16(jax.nn.silu(mixed))))
    q_hat, k_hat, v = conv_outs

    # L2 norms (q also scaled by D^-½), β = σ(b), log decay λ ∈ (bound, 0) per key channel
    q = q_hat * jax.lax.rsqrt(blocks.ordered_sum(q_hat * q_hat, keepdims=True) + p.l2_eps) * d ** -0.5
    k = k_hat * jax.lax.rsqrt(blocks.ordered_sum(k_hat * k_hat, keepdims=True) + p.l2_eps)
    beta = jax.nn.sigmoid(b_logit[:, h:h + 1])  # [1, 1]
    g = g_raw[:, lanes] + bias[:, lanes]  # [1, D]
    if p.decay == "softplus":  # Kimi Linear: λ = −e^A softplus(g) < 0
        log_decay = -decay_rate[:, h:h + 1] * jax.nn.softplus(g)
    else:  # Kimi K3: λ = bound·σ(e^A g) ∈ (bound, 0)
        log_decay = p.decay_bound * jax.nn.sigmoid(decay_rate[:, h:h + 1] * g)

    # column vectors e^λ and k from one [8, D] -> [D, 8] transpose (rows 0 and 1, rest zero)
    sublane = jax.lax.broadcasted_iota(jnp.int32, (8, d), 0)
    stacked = jnp.where(sublane == 0, jnp.exp(log_decay), jnp.where(sublane == 1, k, 0.0))
    columns = stacked.T  # [D, 8]
    decay_col, k_col = columns[:, 0:1], columns[:, 1:2]  # [D, 1] each

    state = state_vmem[s, h]  # [D (key), D (value)] f32
    decayed = decay_col * state  # S̄ = Diag(e^λ) S
    # both products in 8 rows (`blocks.dot`): a one-row product rounds otherwise on a TPU
    predicted = blocks.dot(k, decayed)  # S̄ᵀk  [1, D], f32 operands: HIGHEST
    state = decayed + k_col * (beta * (v - predicted))  # S̄ + β k (v − S̄ᵀk)ᵀ
    state_vmem[s, h] = state
    o = blocks.dot(q, state)  # Sᵀq  [1, D], f32 operands: HIGHEST

    gate = f32(bf16(jax.nn.sigmoid(u[:, lanes])))
    normed = f32(blocks.rms_norm(f32(bf16(o)), gamma, p.rms_eps))
    return f32(bf16(normed * gate))


# ---- the wrapper --------------------------------------------------------------------------------


def check_inputs(p: dict, x: Any, conv: Any, state: Any, cfg: ModelConfig) -> None:
    """ValueError naming the parameter for bad shapes or dtypes."""
    batch, h, d = input_checks.check_x(x, cfg.d_model), cfg.n_heads, cfg.kda_head_dim
    input_checks.check_arrays(p, "p", weight_shapes(cfg), WEIGHT_DTYPES)
    conv_shape = (batch, cfg.kda_conv_size - 1, 3, h, d)
    if tuple(getattr(conv, "shape", ())) != conv_shape:
        raise ValueError(f"conv has shape {getattr(conv, 'shape', None)}: expected {conv_shape}")
    if conv.dtype != jnp.bfloat16:
        raise ValueError(f"conv.dtype={conv.dtype} is invalid: bfloat16")
    state_shape = (batch, h, d, d)
    if tuple(getattr(state, "shape", ())) != state_shape:
        raise ValueError(f"state has shape {getattr(state, 'shape', None)}: expected {state_shape}")
    if state.dtype != jnp.float32:
        raise ValueError(f"state.dtype={state.dtype} is invalid: float32")


def kda_attention(p: dict, x: jax.Array, conv: jax.Array, state: jax.Array, cfg: ModelConfig, *,
                  weight_block_rows: int | None = None,
                  **indices: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The KDA sublayer as a Pallas kernel; same contract as `reference.kda_attention`.

    x [B, d] bf16 (normalised), one layer's weights, conv [B, conv-1, 3, H, D] bf16, state
    [B, H, D, D] f32 -> (out [B, d] bf16, new conv, new state), the states updated in place when
    the caller donates them. weight_block_rows caps the rows of one streamed weight block.
    """
    check_inputs(p, x, conv, state, cfg)
    plan = make_plan(cfg, x.shape[0], weight_block_rows=weight_block_rows)
    out, state = chip_log.run(
        lambda *args: _call(plan, tpu.interpret_params(), dma.is_recording(),
                            tuple(sorted(indices.items())), *args),
        x, prepare_layer(p), {"conv": conv, "recurrent": state})
    return out, state["conv"], state["recurrent"]


def prepare_layer(p: dict) -> dict:
    """One layer's weights as the body reads them: vectors as [1, n] rows (a VMEM row)."""
    names = [name for name in ("w_ga", "w_gb", *WEIGHT_NAMES) if name in p]  # W_g or W_ga, W_gb
    return {name: p[name].reshape(1, -1) if p[name].ndim == 1 else p[name] for name in names}


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _call(plan: KdaPlan, interpret: Any, recording: bool, indices: tuple, x, weights, state):
    del recording  # a static argument only so recorded and silent traces are cached apart
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    out = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    state_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    n_in = 1 + len(jax.tree.leaves(weights))  # then conv, recurrent (a dict flattens sorted)

    def kernel(x_ref, weight_refs, state_in, out_ref, state_out):
        kda_attention_body(plan, StageRefs(x=x_ref, out=out_ref, weights=weight_refs,
                                           state_in=state_in, state_out=state_out,
                                           stream=blocks.LOCAL_STREAM, indices=dict(indices)))

    call = functools.partial(
        pl.pallas_call, kernel,
        out_shape=(out, state_shapes),
        in_specs=(vmem, jax.tree.map(lambda _: hbm, weights), jax.tree.map(lambda _: hbm, state)),
        out_specs=(vmem, jax.tree.map(lambda _: hbm, state)),
        input_output_aliases={n_in: 1, n_in + 1: 2},
        interpret=interpret)
    # read off the body (kernels/base/costs.py)
    return costs.costed_call(call, x, weights, state, io=(x, out))


# ---- the kind in the kernel registry (what the megakernel composes) ----------------------------
def _prepare(stack: dict, cfg: ModelConfig) -> dict:
    """The KDA layers' stacked weights as the body reads them: vectors as [n, 1, x] rows."""
    return {name: stack[name].reshape(stack[name].shape[0], 1, -1) if stack[name].ndim == 2
            else stack[name] for name in weight_names(cfg)}


def _streamed(cfg: ModelConfig) -> tuple[Streamed, ...]:
    shapes = weight_shapes(cfg)
    return tuple(Streamed(name, f"kda.{name}", shapes[name])
                 for name in matrices(cfg.kda_output_gate_rank))


KERNEL = register(KernelStage(
    name="kda", plan=lambda cfg, batch, seq_len, options: make_plan(cfg, batch),
    prepare=_prepare, streamed=_streamed, body=kda_attention_body,
    scope=lambda plan: "KDA"))

