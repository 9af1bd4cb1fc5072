"""From a published checkpoint on disk to our parameters (issue 29, spec/checkpoints.md).

    read_config(dir, *, name=None, **overrides) -> ModelConfig     config.json, validated
    load_params(dir, cfg, *, expert_format=None, ranks=None, progress=True, stats=None) -> params
    write_checkpoint(dir, params, cfg, *, fp8=False, shards=1)     the published layout
    check_checkpoint(dir, cfg=None) -> ModelConfig                  every check, no weight read
    python -m mkresearch.checkpoint DIR                             that check: one line, exit 1
    CheckpointError                                                 bad input, one line
    config_from_dict(raw, name) / config_dict(cfg)                  config.json <-> ModelConfig

Modules: `hf_config` (config.json), `safetensors_io` (lazy shards, FP8 block scales, writing),
`names` (published tensor names <-> our leaves), `loader` (load and write).
"""

from mkresearch.checkpoint.hf_config import (
    CheckpointError,
    config_dict,
    config_from_dict,
    read_config,
)
from mkresearch.checkpoint.loader import check_checkpoint, load_params, write_checkpoint

__all__ = ["CheckpointError", "check_checkpoint", "config_dict", "config_from_dict", "load_params", "read_config",
           "write_checkpoint"]
