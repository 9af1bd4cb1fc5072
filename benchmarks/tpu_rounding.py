"""Where a TPU rounds otherwise than a CPU: op by op and sublayer by sublayer, the same inputs on
both (docs/tpu.md §5). Run on a TPU machine (it needs the chip and the host's CPU backend):

    .ci/tpu-run python benchmarks/tpu_rounding.py [stages] --json rounding.json

ops: each elementwise op, reduction and product the kernels use, as a small Pallas kernel
compiled by Mosaic on the chip, against the same function jitted by XLA on the CPU and on the
TPU: elements that differ in any bit, and the largest difference. stages: each attention stage
kernel on the chip against the reference sublayer jitted on the CPU and on the TPU (random
weights of the mini, a random cache, B = 8 rows at positions 0 to 63). ffn: each FFN stage
kernel (routed experts alone, and router + experts + shared) in every expert format at B = 1 and
8, the same three ways. step: the megakernel step and the reference step on the chip, each on
its own state, fed an 8-token prompt and then the reference's greedy tokens for 16 steps, each
mini and format, B = 1 and 8 (--batches): per step the logits and the state leaves that differ,
and the first step where they part.

    .ci/tpu-run python benchmarks/tpu_rounding.py stages ffn step --json rounding.json
"""
import json
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from mkresearch.kernels.base import blocks, kv_tiles

import mkresearch  # noqa
from mkresearch.model import numerics

bf16, f32 = jnp.bfloat16, jnp.float32
cpu, dev = jax.devices("cpu")[0], jax.devices()[0]
# --batches 1,8: the step's batch sizes
BATCHES = (tuple(int(b) for b in sys.argv[sys.argv.index("--batches") + 1].split(","))
           if "--batches" in sys.argv else (1, 8))
RES = {"ops": {}, "stages": {}, "ffn": {}, "step": {}}

def save():
    """The results so far to --json FILE (after every record: a run cut by a time limit keeps
    what it measured)."""
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(RES, f, indent=1)


def compare(a, b):
    a = np.asarray(a).astype(np.float32); b = np.asarray(b).astype(np.float32)
    n = int(np.sum(a.view(np.uint32) != b.view(np.uint32)))
    d = np.abs(a - b)
    rel = float(np.max(d / np.maximum(np.abs(a), 1e-30))) if n else 0.0
    return {"ndiff": n, "size": int(a.size), "maxabs": float(d.max()) if d.size else 0.0, "maxrel": rel}

def mosaic(fn, *arrays):
    outs = jax.eval_shape(fn, *arrays)
    def kernel(*refs):
        refs[-1][...] = fn(*[r[...] for r in refs[:-1]])
    call = pl.pallas_call(kernel, out_shape=outs,
                          in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)] * len(arrays),
                          out_specs=pl.BlockSpec(memory_space=pltpu.VMEM))
    return jax.jit(call)(*[jax.device_put(a, dev) for a in arrays])

def op(name, fn, *arrays):
    try:
        m = mosaic(fn, *arrays)
        c = jax.jit(fn)(*[jax.device_put(a, cpu) for a in arrays])
        x = jax.jit(fn)(*[jax.device_put(a, dev) for a in arrays])
        r = {"mosaic_vs_cpu": compare(c, m), "xla_tpu_vs_cpu": compare(c, x), "mosaic_vs_xla_tpu": compare(x, m)}
    except Exception as e:  # noqa: BLE001 (a failing op is a result)
        r = {"error": repr(e)[:300]}
    RES["ops"][name] = r
    print(f"{name:34s}", json.dumps(r), flush=True)
    save()

def ops():
    rng = np.random.default_rng(0)
    u = lambda *s: jnp.asarray(rng.standard_normal(s), f32)
    b = lambda *s: jnp.asarray(rng.standard_normal(s), bf16)
    neg = jnp.asarray(-np.abs(rng.standard_normal((8, 256))) * 8, f32)
    pos = jnp.asarray(np.abs(rng.standard_normal((8, 256))) * 30 + 0.1, f32)
    op("exp", jnp.exp, neg)
    op("exp_small", jnp.exp, u(8, 256) * 0.01)
    op("sigmoid", jax.nn.sigmoid, u(8, 256) * 4)
    op("softplus", jax.nn.softplus, u(8, 256) * 4)
    op("rsqrt", jax.lax.rsqrt, pos)
    op("sqrt", jnp.sqrt, pos)
    op("divide", lambda a, c: a / c, u(8, 256), pos)
    op("log", jnp.log, pos)
    op("sin", jnp.sin, u(8, 128) * 50)
    op("cos", jnp.cos, u(8, 128) * 50)
    op("ordered_sum_256", lambda a, c: blocks.ordered_sum(a * c, keepdims=True), u(8, 256), u(8, 256))
    op("ordered_sum_32", lambda a: blocks.ordered_sum(a, keepdims=True), u(8, 32))
    op("jnp_sum_axis0", lambda a: jnp.sum(a, axis=0, keepdims=True), u(8, 256))
    op("max", lambda a: jnp.max(a, axis=-1, keepdims=True), u(8, 256))
    op("bf16_round", lambda a: a.astype(bf16).astype(f32), u(8, 256))
    op("dot_t_1row_bf16_K128", kv_tiles.dot_t, b(1, 128), b(256, 128))
    op("dot_t_1row_bf16_K128_N32", kv_tiles.dot_t, b(1, 128), b(32, 128))
    op("rows_dot_t_2row_bf16_K256", kv_tiles.rows_dot_t, b(2, 256), b(32, 256))
    op("dot_f32_HIGHEST_1x32x128", lambda w, v: jnp.dot(w, v, preferred_element_type=f32, precision=numerics.HIGHEST), u(1, 32), u(32, 128))
    op("dot_f32_HIGHEST_8x32x256", lambda w, v: jnp.dot(w, v, preferred_element_type=f32, precision=numerics.HIGHEST), u(8, 32), u(32, 256))
    op("blocks_dot_f32_2x32x256", blocks.dot, u(2, 32), u(32, 256))
    op("dot_f32_bf16vals_HIGHEST", lambda w, v: jnp.dot(w, v.astype(f32), preferred_element_type=f32, precision=numerics.HIGHEST), jnp.abs(u(8, 32)), b(32, 256))
    op("dot_f32_DEFAULT_8x32x256", lambda w, v: jnp.dot(w, v, preferred_element_type=f32), u(8, 32), u(32, 256))
    op("dot_bf16_1row_K256_N128", lambda a, w: jnp.dot(a, w, preferred_element_type=f32, precision=numerics.EXACT_PRODUCTS), b(1, 256), b(256, 128))
    op("blocks_dot_bf16_8x512x512", blocks.dot, b(8, 512), b(512, 512))
    op("blocks_dot_bf16_8x256x256", blocks.dot, b(8, 256), b(256, 256))
    op("rms_norm", lambda x, g: blocks.rms_norm(x, g, 1e-5), u(8, 256), b(1, 256))
    op("exp_minus_max_weights", lambda s: jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), u(8, 32) * 3)

def stages():
    from mkresearch.kernels.stages import kda, mla, mla_rope

    from mkresearch.model import reference, weights
    from mkresearch.model.config import get_config
    rng = np.random.default_rng(1)
    for name, kind, over in [("kimi-k3-mini", "mla", {"mla_cache_layout": "expanded"}),
                             ("kimi-k3-mini", "mla", {"mla_cache_layout": "latent"}),
                             ("deepseek-v3-mini", "mla_rope", {}),
                             ("kimi-k3-mini", "kda", {})]:
        try:
            cfg = get_config(name, **over)
            with jax.default_device(cpu):
                params = weights.init_params(cfg, 0)
            p = reference.layer_params(params[kind], 0)
            B = 8
            x = reference.rms_norm(jnp.asarray(rng.standard_normal((B, cfg.d_model)), f32), jnp.ones((cfg.d_model,), bf16), cfg.rms_eps)
            positions = jnp.array([0, 1, 16, 31, 32, 33, 47, 63], jnp.int32)
            if kind == "kda":
                st = reference.init_state(cfg, B)["kda"]
                conv = jnp.asarray(rng.standard_normal(st["conv"].shape[1:]), bf16)
                rec = jnp.asarray(rng.standard_normal(st["recurrent"].shape[1:]) * 0.1, f32)
                args = (p, x, conv, rec)
                kfn = lambda p, x, c, r, cfg=cfg: kda.kda_attention(p, x, c, r, cfg)
                rfn = lambda p, x, c, r, cfg=cfg: reference.kda_attention(p, x, c, r, cfg)
            else:
                shapes = mla.cache_shapes(cfg, B, cfg.max_seq_len) if kind == "mla" else {k: v.shape[1:] for k, v in reference.init_state(cfg, B)[kind].items()}
                cache = {k: jnp.asarray(rng.standard_normal(s), bf16) for k, s in shapes.items()}
                if "k" in cache:
                    cache["k"] = cache["k"].at[..., cfg.mla_qk_dim:].set(0)
                args = (p, x, cache, positions)
                kern = mla.mla_attention if kind == "mla" else mla_rope.mla_rope_attention
                from mkresearch.model.stages import mla_rope as rmr
                reff = reference.mla_attention if kind == "mla" else rmr.mla_rope_attention
                kfn = lambda p, x, c, pos, cfg=cfg, kern=kern: kern(p, x, c, pos, cfg)
                rfn = lambda p, x, c, pos, cfg=cfg, reff=reff: reff(p, x, c, pos, cfg)
            on = lambda d, args=args: jax.tree.map(lambda a: jax.device_put(a, d), args)
            k_t = kfn(*on(dev))
            r_t = jax.jit(rfn)(*on(dev))
            with jax.default_device(cpu):
                r_c = jax.jit(rfn)(*on(cpu))
            lk, lt, lc = jax.tree.leaves(k_t), jax.tree.leaves(r_t), jax.tree.leaves(r_c)
            rec_ = {"kernel_tpu_vs_ref_cpu": [compare(c, k) for c, k in zip(lc, lk)],
                    "ref_tpu_vs_ref_cpu": [compare(c, t) for c, t in zip(lc, lt)],
                    "kernel_tpu_vs_ref_tpu": [compare(t, k) for t, k in zip(lt, lk)]}
        except Exception as e:  # noqa: BLE001 (a failing stage is a result)
            traceback.print_exc(); rec_ = {"error": repr(e)[:300]}
        key = f"{name}:{kind}:{over}"
        RES["stages"][key] = rec_
        print(key, json.dumps(rec_), flush=True)
        save()

def three_ways(kfn, rfn, args):
    """The kernel on the chip, the reference jitted on the chip and on the CPU, compared."""
    on = lambda d: jax.tree.map(lambda a: jax.device_put(a, d), args)
    k_t = kfn(*on(dev))
    r_t = jax.jit(rfn)(*on(dev))
    with jax.default_device(cpu):
        r_c = jax.jit(rfn)(*on(cpu))
    lk, lt, lc = jax.tree.leaves(k_t), jax.tree.leaves(r_t), jax.tree.leaves(r_c)
    return {"kernel_tpu_vs_ref_cpu": [compare(c, k) for c, k in zip(lc, lk)],
            "ref_tpu_vs_ref_cpu": [compare(c, t) for c, t in zip(lc, lt)],
            "kernel_tpu_vs_ref_tpu": [compare(t, k) for t, k in zip(lt, lk)]}


def ffn():
    from mkresearch.kernels.stages import experts
    from mkresearch.kernels.stages import moe_full as k_moe_full

    from mkresearch.model import reference, weights
    from mkresearch.model.config import get_config
    from mkresearch.model.stages import ffn as r_ffn
    from mkresearch.model.stages import moe_full as r_moe_full
    rng = np.random.default_rng(2)
    for name in ("kimi-k3-mini", "glm-4.5-mini"):
        for fmt in ("mxfp4", "fp8", "bf16"):
            try:
                cfg = get_config(name, expert_format=fmt)
            except ValueError:
                continue
            kind = "moe" if "moe" in cfg.kinds else "moe_full"
            with jax.default_device(cpu):
                params = weights.init_params(cfg, 0)
            p = reference.layer_params(params[kind], 0)
            for B in (1, 8):
                x = jnp.asarray(rng.standard_normal((B, cfg.d_model)), bf16)
                key = f"{name}:{fmt}:B={B}"
                try:
                    if kind == "moe":
                        ids, w = r_ffn.route(p, x, cfg)
                        RES["ffn"][key + ":routed"] = rec = three_ways(
                            lambda p, x, i, w, cfg=cfg: experts.routed_experts(p, x, i, w, cfg),
                            lambda p, x, i, w, cfg=cfg: r_ffn.routed_experts(p, x, i, w, cfg),
                            (p, x, ids, w))
                        print(key + ":routed", json.dumps(rec), flush=True)
                        save()
                        kfn = lambda p, x, cfg=cfg: experts.moe_ffn(p, x, cfg)
                        rfn = lambda p, x, cfg=cfg: r_ffn.moe_ffn(p, x, cfg)
                    else:
                        kfn = lambda p, x, cfg=cfg: k_moe_full.moe_full_ffn(p, x, cfg)
                        rfn = lambda p, x, cfg=cfg: r_moe_full.moe_full_ffn(p, x, cfg)
                    RES["ffn"][key] = rec = three_ways(kfn, rfn, (p, x))
                except Exception as e:  # noqa: BLE001 (a failing stage is a result)
                    traceback.print_exc(); rec = RES["ffn"][key] = {"error": repr(e)[:300]}
                print(key, json.dumps(rec), flush=True)
                save()


def step(n_steps: int = 16):
    """The megakernel and the reference stepped one call at a time, each on its own state from
    an empty one, fed an 8-token prompt and then the reference's greedy tokens (the loop's check
    without the loop): per step the logits and every state leaf compared, and the first step
    where they part."""
    from mkresearch.kernels.compose import megakernel as mk

    from mkresearch.model import reference, weights
    from mkresearch.model.config import get_config
    for name, over in [("kimi-k3-mini", {"expert_format": f}) for f in ("mxfp4", "fp8", "bf16")] + [
            ("kimi-k3-mini", {"mla_cache_layout": "latent"}), ("deepseek-v3-mini", {}),
            ("glm-4.5-mini", {}), ("qwen3-235b-a22b-mini", {})]:
        cfg = get_config(name, **over)
        params = weights.init_params(cfg, 0)
        prepared = mk.prepare_weights(params, cfg)
        for B in BATCHES:
            key = f"{name}:{over}:B={B}"
            try:
                prompt = np.asarray(jax.random.randint(jax.random.key(7), (B, 8), 0, cfg.vocab_size))
                state = reference.init_state(cfg, B)
                mine, tokens, rec = jax.tree.map(jnp.copy, state), prompt[:, 0], {"steps": []}
                for t in range(8 + n_steps):  # the prompt, then the reference's greedy tokens
                    positions = np.full(B, t, np.int32)
                    ref_logits, state, _ = reference.decode_step(params, state, tokens, positions, cfg)
                    _, mine, kaux = mk.decode_step(prepared, mine, tokens, positions, cfg,
                                                   return_logits=True)
                    a, b = np.asarray(ref_logits), np.asarray(kaux["logits"])
                    leaves = {jax.tree_util.keystr(path): int(np.sum(
                        np.ascontiguousarray(x).view(np.uint8) != np.ascontiguousarray(y).view(np.uint8)))
                        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(mine))}
                    rec["steps"].append({"logits_differ": int(np.sum(a != b)),
                                         "rows_differ": [int(r) for r in np.flatnonzero(np.any(a != b, -1))],
                                         "max": float(np.abs(a - b).max()),
                                         "state_leaves_differ": {k: v for k, v in leaves.items() if v}})
                    tokens = prompt[:, t + 1] if t + 1 < 8 else a.argmax(-1).astype(np.int32)
                rec["first_logits"] = next((t for t, r in enumerate(rec["steps"]) if r["logits_differ"]), None)
                rec["first_state"] = next((t for t, r in enumerate(rec["steps"]) if r["state_leaves_differ"]), None)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(); rec = {"error": repr(e)[:300]}
            RES["step"][key] = rec
            print(key, "first logits", rec.get("first_logits"), "first state", rec.get("first_state"),
                  json.dumps(rec.get("steps", [{}])[-1])[:300], flush=True)
            save()


if __name__ == "__main__":
    print(jax.devices(), jax.__version__, flush=True)
    parts = [a for a in sys.argv[1:] if a in ("stages", "ffn", "step")]
    if not parts:
        ops()
        parts = ["stages"]
    for part in parts:
        {"stages": stages, "ffn": ffn, "step": step}[part]()
    save()
