"""From a published checkpoint on disk to our parameters (issue 29, docs/checkpoints.md). The API
is `mkresearch.checkpoint.loader`'s:

    read_config(dir, *, name=None, **overrides) -> ModelConfig     config.json, validated
    load_params(dir, cfg, *, expert_format=None, ranks=None, progress=True, stats=None) -> params
    write_checkpoint(dir, params, cfg, *, fp8=False, shards=1)     the published layout
    check_checkpoint(dir, cfg=None) -> ModelConfig                  every check, no weight read
    python -m mkresearch.checkpoint DIR                             that check: one line, exit 1
    CheckpointError                                                 bad input, one line
    config_from_dict(raw, name) / config_dict(cfg)                  config.json <-> ModelConfig

Modules: `safetensors_io` (lazy shards, FP8 block scales, writing), `names` (published tensor
names <-> our leaves), `loader` (load and write), `tokenizer` (tokenizer.json). config.json itself
is read by `mkresearch.model.hf_config` and the small real models' presets are
`mkresearch.model.published`: configs belong to the model, below the layouts that name them.

Imports: mkresearch.hardware, mkresearch.model, mkresearch.sharding.
"""

