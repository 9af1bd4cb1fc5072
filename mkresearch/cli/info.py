"""`mkresearch info MODEL`: the layer pattern, the parameters, the bytes of one decode step and its
HBM floor on each chip (`mkresearch.model.roofline`); with `--ranks N` the per-rank byte table,
ours beside the release's layout, and the full-size step (`mkresearch.prediction.full_size`)."""

from __future__ import annotations

import json
from typing import Any

from mkresearch.cli.common import (
    at_least,
    cache_layout_applies,
    context_in_cache,
    human_bytes,
    human_count,
    known_model,
    refusals,
)
from mkresearch.cli.options import (
    add_batch,
    add_cache_layout,
    add_command,
    add_context,
    add_expert_format,
    add_model,
    each_batch,
)
from mkresearch.hardware.chips import CHIPS
from mkresearch.model import kv_cache, roofline
from mkresearch.model.config import MLA_CACHE_LAYOUTS, ModelConfig, layer_pattern
from mkresearch.prediction.full_size import full_size_steps, stand_in_note
from mkresearch.sharding import layout, layout_bytes

EXAMPLES = ("mkresearch info kimi-k3 --batch 8 --context 4096",
            "mkresearch info kimi-k3 --batch 1,8 --cache-layout latent --format released",
            "mkresearch info kimi-k3 --ranks 32   # the per-rank bytes, ours beside the release's")


def add_parser(commands: Any) -> None:
    p = add_command(commands, "info", "layer pattern, parameters, bytes per decode step",
                    EXAMPLES)
    add_model(p)
    add_batch(p)
    add_context(p, 0, "tokens already in each sequence's KV cache (default 0)")
    add_expert_format(p, ("released",), "; released = FP8 gate/up + MXFP4 down")
    add_cache_layout(p)
    p.add_argument("--ranks", type=int, default=1,
                   help="ranks (devices) the model is sharded across: the per-rank byte table, "
                        "ours beside the release's layout (default 1: the whole model)")
    p.add_argument("--json", action="store_true", help="print one JSON object (per batch)")


def run(args: Any) -> int:
    cfg = known_model(args.model)
    context_in_cache(cfg, args.context)
    cache_layout_applies(cfg, args.cache_layout)
    at_least("--ranks", args.ranks, 1)
    return each_batch(args, lambda one: _run_one(cfg, one))


def _run_one(cfg: ModelConfig, args: Any) -> int:
    with refusals():  # e.g. --cache-layout expanded for a model whose MLA caches the latent
        report = info(cfg, args.batch, args.context, args.expert_format, args.cache_layout)
    if args.ranks != 1:
        with refusals():
            layout.check_ranks(cfg, args.ranks)
            mla = cfg.replace(mla_cache_layout=args.cache_layout) if args.cache_layout else cfg
            report["ranks"] = layout_bytes.compare(mla, args.ranks, args.batch, args.context)
            report["full_size"] = [step.as_dict() for step in full_size_steps(
                mla, args.ranks, args.batch, args.context)]
    if args.json:
        print(json.dumps(report))
        return 0
    _print_info(report)
    if "ranks" in report:
        print(layout_bytes.format_table(report["ranks"]))
    for step in report.get("full_size", ()):
        print(step["line"])
    return 0


def info(cfg: ModelConfig, batch: int, context: int, expert_format: str | None,
         cache_layout: str | None) -> dict:
    """What `mkresearch info` prints, as data (`--json`)."""
    total, active = roofline.parameter_counts(cfg)
    step = roofline.step_bytes(cfg, batch, context, expert_format, cache_layout)
    routed = roofline.routed_kind(cfg)  # the FFN kind with routed experts
    floors = {}
    for name in CHIPS:
        floor = roofline.decode_floor(cfg, name, batch, context, expert_format=expert_format,
                                      mla_cache_layout=cache_layout)
        floors[name] = {"ms": floor.seconds * 1e3, "tokens_per_s": floor.tokens_per_s,
                        "memory_bound": floor.memory_bound}
    report = {
        "model": cfg.name,
        "layers": cfg.n_layers,
        "layer_pattern": layer_pattern(cfg),
        "residual": cfg.residual,
        "layers_by_kind": {kind: list(cfg.layers_of(kind)) for kind in cfg.kinds},
        "kda_layers": list(cfg.kda_layers),
        "mla_layers": list(cfg.mla_layers),
        "dense_layers": list(cfg.dense_layers),
        "moe_layers": list(cfg.layers_of(routed.name)) if routed else [],
        "parameters": {"total": total, "active": active,
                       "mtp_modules": roofline.mtp_parameters(cfg), **roofline.as_published(cfg)},
        "step_bytes": step.as_dict(),
        "cache_bytes_per_token": roofline.cache_bytes_per_token(
            cfg.replace(mla_cache_layout=step.mla_cache_layout)),
        "floor_one_chip": floors,
        "hbm_one_device": _hbm_one_device(cfg, batch, context, expert_format),
        "padding_bytes": roofline.padding_bytes(cfg.replace(
            expert_format=step.expert_format) if step.expert_format != "released" else cfg),
    }
    if cfg.mla_layers:  # Kimi's MLA caches either layout: both, side by side
        per_token = {name: roofline.mla_cache_bytes_per_token(cfg, name)
                     for name in MLA_CACHE_LAYOUTS}
        report["mla_cache_bytes_per_token"] = {
            **per_token, "ratio": per_token["expanded"] / per_token["latent"]}
    return report


def _hbm_one_device(cfg: ModelConfig, batch: int, context: int,
                    expert_format: str | None) -> dict:
    """Whether the whole model, with the KV caches a decode at `context` allocates for `batch`
    rows (`kv_cache.cache_length`), fits one device of each chip (`roofline.hbm_footprint`)."""
    if expert_format not in (None, "released"):
        cfg = cfg.replace(expert_format=expert_format)
    seq_len = kv_cache.cache_length(cfg, context + 1)
    out = {}
    for name in CHIPS:
        footprint = roofline.hbm_footprint(cfg, name, batch, seq_len)
        out[name] = {"needed": footprint.needed, "weights": footprint.weights,
                     "states": footprint.states, "available": footprint.available,
                     "seq_len": seq_len, "fits": footprint.fits()}
    return out


def _print_info(report: dict) -> None:
    step = report["step_bytes"]
    kinds = report["layers_by_kind"]
    if report["residual"] == "attention_mix":
        print(f"{report['model']}: {report['layers']} layers, pattern (K = KDA, M = MLA; "
              f"attention-residual blocks):")
    else:
        print(f"{report['model']}: {report['layers']} layers, {report['residual']} residual "
              f"stream, pattern (G = GQA, R = MLA with RoPE, S = GQA with sinks, W = the same "
              "over a sliding window):")
    print(f"  {report['layer_pattern']}")
    if stand_in_note(report["model"]):
        print(f"  {stand_in_note(report['model'])}")
    print("  " + "; ".join(f"{kind} {len(layers)} layers" + (
        f" ({', '.join(map(str, layers))})" if len(layers) < min(8, report["layers"]) else "")
        for kind, layers in kinds.items()))
    params = report["parameters"]
    mtp = (f" (+ {human_count(params['mtp_modules'])} in multi-token-prediction modules, not "
           "part of the step)" if params["mtp_modules"] else "")
    print(f"parameters: total {human_count(params['total'])}, "
          f"active per token {human_count(params['active'])}{mtp}")
    if "publisher_rule" in params:  # the publisher's figures, counted its way
        rule, n = params["publisher_rule"], human_count
        print(f"  as published (embedding {'in' if rule['embedding_active'] else 'out'}, LM head "
              f"{'in' if rule['lm_head_active'] else 'out'} of active): total {n(rule['total'])}, "
              f"active {n(rule['active'])} (published {n(rule['published'][0])} / "
              f"{n(rule['published'][1])})")
    print(f"bytes per decode step: batch {step['batch']}, context {step['context']}, experts "
          f"{step['expert_format']}" + (f", MLA cache {step['mla_cache_layout']}"
                                        if "mla_cache_bytes_per_token" in report else "")
          + f" ({step['unique_experts_per_layer']:.1f} unique experts per MoE layer):")
    for name, label in step["components"].items():
        read, written = step["read"][name], step["written"].get(name, 0)
        extra = f"  (+ {human_bytes(written)} written)" if written else ""
        print(f"  {label:42s} {human_bytes(read):>10}{extra}")
    print(f"  {'total read + written':42s} {human_bytes(step['total']):>10}")
    print(f"KV cache per context token (all layers): {report['cache_bytes_per_token']:,} B")
    if "mla_cache_bytes_per_token" in report:
        cache = report["mla_cache_bytes_per_token"]
        print(f"MLA cache per context token: expanded {cache['expanded']:,} B, latent "
              f"{cache['latent']:,} B ({cache['ratio']:.0f}x fewer)")
    print("HBM floor on one chip (bytes / bandwidth):")
    for chip, floor in report["floor_one_chip"].items():
        print(f"  {chip:6s} {floor['ms']:10.2f} ms/step  {floor['tokens_per_s']:10.1f} tokens/s")
    hbm = report["hbm_one_device"]
    first = next(iter(hbm.values()))
    print(f"HBM of one device: weights {human_bytes(first['weights'])} + KV caches and states "
          f"{human_bytes(first['states'])} (batch {step['batch']} x {first['seq_len']} tokens)"
          + (f"; {human_bytes(report['padding_bytes'])} of the weights are the zero padding of "
             "widths rounded up to whole lanes" if report["padding_bytes"] else "") + ":")
    for chip, one in hbm.items():
        verdict = (f"fits, {human_bytes(one['available'] - one['needed'])} spare" if one["fits"]
                   else f"does not fit, {human_bytes(one['needed'] - one['available'])} over")
        print(f"  {chip:6s} {human_bytes(one['available']):>10} per device: {verdict}")
