"""Peak host memory while loading a GPT-OSS MXFP4 checkpoint, measured (docs/checkpoints.md §6).

    python benchmarks/gpt_oss_load_memory.py [--layers 2] [--dir DIR]

Writes a checkpoint with gpt-oss-20b's exact tensor names, shapes and dtypes (2880 wide, 32
experts in MXFP4 `*_blocks` / `*_scales`, the full 201,088-token vocabulary) but `--layers` of its
24 layers and random bytes for values (no model is initialised: the files are written tensor by
tensor), then loads it in a fresh child process with `mkresearch.checkpoint.load_params` and
prints the child's peak resident memory (`ru_maxrss`) beside the bytes of what it loaded. On a
CPU the parameters themselves live in host memory: the peak minus the parameters is what the
loader holds on top (one layer's blocks and scales as read, and their parts). A bf16 copy of one
layer's experts would be 1.7 GB; of the model's, 41 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import numpy as np


def write(directory: str, layers: int) -> None:
    """gpt-oss-20b's config.json with `layers` layers, and its tensors as random bytes."""
    import ml_dtypes

    from mkresearch.checkpoint import safetensors_io
    from mkresearch.model.config import get_config
    from mkresearch.model.hf_config import config_dict

    cfg = get_config("gpt-oss-20b", n_layers=layers, attention="gqa_sink_window,gqa_sink"
                     if layers > 1 else "gqa_sink_window")
    raw = config_dict(cfg)
    raw["layer_types"] = raw["layer_types"][:layers]
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(raw, handle)
    rng = np.random.default_rng(0)
    d, v, e, f = 2880, cfg.vocab_size, cfg.n_experts, 2880
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def floats(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    tensors = {"model.embed_tokens.weight": floats(v, d), "lm_head.weight": floats(v, d),
               "model.norm.weight": floats(d)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "input_layernorm.weight": floats(d), p + "post_attention_layernorm.weight":
            floats(d), p + "self_attn.q_proj.weight": floats(q, d),
            p + "self_attn.k_proj.weight": floats(kv, d), p + "self_attn.v_proj.weight":
            floats(kv, d), p + "self_attn.o_proj.weight": floats(d, q),
            p + "self_attn.q_proj.bias": floats(q), p + "self_attn.k_proj.bias": floats(kv),
            p + "self_attn.v_proj.bias": floats(kv), p + "self_attn.o_proj.bias": floats(d),
            p + "self_attn.sinks": floats(cfg.n_heads), p + "mlp.router.weight": floats(e, d),
            p + "mlp.router.bias": floats(e),
            p + "mlp.experts.gate_up_proj_blocks": rng.integers(0, 256, (e, 2 * f, d // 32, 16),
                                                                np.uint8),
            p + "mlp.experts.gate_up_proj_scales": rng.integers(118, 124, (e, 2 * f, d // 32),
                                                                np.uint8),
            p + "mlp.experts.gate_up_proj_bias": floats(e, 2 * f),
            p + "mlp.experts.down_proj_blocks": rng.integers(0, 256, (e, d, f // 32, 16),
                                                             np.uint8),
            p + "mlp.experts.down_proj_scales": rng.integers(118, 124, (e, d, f // 32),
                                                             np.uint8),
            p + "mlp.experts.down_proj_bias": floats(e, d)})
    safetensors_io.write_file(os.path.join(directory, safetensors_io.SINGLE_FILE), tensors)


def load(directory: str) -> None:
    """The child: load, then print the peak resident memory and the loaded bytes as JSON."""
    import jax

    from mkresearch.checkpoint import loader
    from mkresearch.model import weights

    cfg = loader.read_config(directory, max_seq_len=4096)
    params = jax.block_until_ready(loader.load_params(directory, cfg, progress=False))
    print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "params": weights.nbytes(params), "layers": cfg.n_layers,
                      "format": cfg.expert_format}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write it (default: a temp dir)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        load(args.child)
        return 0
    directory = args.dir or tempfile.mkdtemp(prefix="gpt-oss-mxfp4-")
    os.makedirs(directory, exist_ok=True)
    write(directory, args.layers)
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    out = subprocess.run([sys.executable, __file__, "--child", directory], env=env,
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()
    result = json.loads(out[-1])
    peak, params = result["peak_rss"], result["params"]
    print(f"gpt-oss-20b's tensors, {result['layers']} of 24 layers, MXFP4 experts: files "
          f"{size / 1e9:.2f} GB; loaded parameters {params / 1e9:.2f} GB (experts "
          f"{result['format']}); peak resident memory of the loading process {peak / 1e9:.2f} GB"
          f", {(peak - params) / 1e9:.2f} GB above the parameters (Python, JAX and the loader's "
          "one layer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
