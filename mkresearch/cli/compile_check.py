"""`mkresearch compile MODEL [--chip C] [--batch B[,B...]] [--record]`: one megakernel step
compiled for a TPU chip from shapes (libtpu, no TPU needed). With `--ranks N` the sharded step of the model on
N devices of a TPU topology instead (`megakernel_sharded.compile_sharded_step`): by default the
TPU VM slice of the chip, `v5e:2x4` / `v6e:2x4` (8 chips), or the release's `tpu7x:2x2x4` (32
devices), where the small real models (Moonlight, Qwen3-30B-A3B, GLM-4.5-Air, Kimi Linear) and the
big ones are meant to run. `--context C` sets the length of the cache the step is compiled for
(default the model's max_seq_len: Kimi Linear's 1M-token latent cache alone outgrows a v5e's
HBM). `--batch 1,8` compiles at each batch size in turn. A plan over the VMEM or a rank over the
HBM is one line naming what it needs and what the chip has.
"""

from __future__ import annotations

from typing import Any

from mkresearch.cli.common import (
    CHIP_DEFAULT_HELP,
    UsageError,
    at_least,
    known_chip,
    known_model,
    megakernel_batch,
)
from mkresearch.cli.options import (
    add_batch,
    add_command,
    add_context,
    add_model,
    each_batch,
)
from mkresearch.hardware.chips import CHIPS
from mkresearch.kernels.compose import megakernel
from mkresearch.kernels.compose import megakernel_sharded as sharded
from mkresearch.measurement import recorded
from mkresearch.sharding import layout

# a chip's slice for --ranks: a TPU VM of 8 single-core chips, or the release's TPU7x pod slice
DEFAULT_TOPOLOGY = {"v5e": "v5e:2x4", "v6e": "v6e:2x4", "v5p": "v5p:2x2x2",
                    "tpu7x": sharded.FULL_TOPOLOGY}
EXAMPLES = ("mkresearch compile kimi-k3-rank --chip tpu7x --batch 1,8",
            "mkresearch compile kimi-k3-mini --context 4096",
            "mkresearch compile qwen3-30b-a3b --chip v5e --ranks 8 --context 4096")


def add_parser(commands: Any) -> None:
    p = add_command(commands, "compile", "compile one megakernel step for a TPU chip from shapes "
                                         "(libtpu, no TPU needed)", EXAMPLES)
    add_model(p)
    add_batch(p)
    p.add_argument("--chip", default=None,
                   help=f"TPU chip to compile for, from shapes: one of "
                        f"{', '.join(CHIPS)} ({CHIP_DEFAULT_HELP})")
    p.add_argument("--record", action="store_true",
                   help="write the result where notebooks read it (mkresearch/measurement/recorded/)")
    p.add_argument("--ranks", type=int, default=None,
                   help="the sharded step on N devices of a TPU topology instead")
    p.add_argument("--topology", default=None,
                   help="with --ranks: the TPU topology (default: v5e:2x4, v6e:2x4 or "
                        "tpu7x:2x2x4 by --chip)")
    add_context(p, None, "tokens of context the step is compiled for: the length of its cache "
                         "(default: the model's max_seq_len)", old=True)


def run(args: Any) -> int:
    cfg = known_model(args.model)
    for batch in args.batch:
        megakernel_batch("--batch", batch)
    chip = known_chip(args.chip)
    if args.context is not None and (args.context < cfg.kv_tile or args.context % cfg.kv_tile):
        tile = cfg.kv_tile  # the kernels read the cache in whole tiles
        raise UsageError(f"--context {args.context} is invalid for {cfg.name}: a multiple of its "
                         f"KV tile of {tile} tokens (cfg.kv_tile), e.g. "
                         f"{max(tile, -(-args.context // tile) * tile)}")
    if args.ranks is None and args.topology is not None:
        raise UsageError("--topology is an option of --ranks N: give both")
    if args.ranks is not None and args.record:
        raise UsageError("--record with --ranks: `make recorded` records the sharded compiles")
    return each_batch(args, lambda one: _run_one(one, cfg, chip))


def _run_one(args: Any, cfg: Any, chip: str) -> int:
    """One batch size (args.batch an int)."""
    if args.ranks is not None:
        return _run_sharded(args, cfg, chip)
    try:
        result, plan = megakernel.compile_step(cfg, args.batch, chip=chip, seq_len=args.context)
    except ValueError as error:  # a model the megakernel does not build, a plan over VMEM
        raise UsageError(f"compile {cfg.name}: {str(error).splitlines()[0]}") from None
    print(plan.vmem.table())
    print(result)
    if args.record:
        path = recorded.record_compile(result, plan,
                                       recorded.compile_path(cfg.name, args.batch, chip))
        print(f"wrote {path}")
    return 0


def _run_sharded(args: Any, cfg: Any, chip: str) -> int:
    at_least("--ranks", args.ranks, 2)
    topology = args.topology or DEFAULT_TOPOLOGY[chip]
    if not topology.startswith(f"{chip}:"):
        raise UsageError(f"--topology {topology!r} is invalid with --chip {chip}: a {chip} "
                         f"topology, e.g. {DEFAULT_TOPOLOGY[chip]}")
    try:  # the reductions sent as the sharding plan chooses for the slice (`kernel_options`)
        lay = layout.layout(cfg, args.ranks, collectives=layout.DEFAULT_COLLECTIVES)
        options = sharded.kernel_options(lay, args.batch, chip)
        result, plan = sharded.compile_sharded_step(cfg, args.ranks, batch=args.batch, chip=chip,
                                                    topology=topology, seq_len=args.context,
                                                    options=options)
    except (ValueError, RuntimeError) as error:  # ranks the layout cannot split, a rank over
        # VMEM or HBM: our plan's refusal, or XLA's RESOURCE_EXHAUSTED (its HBM count of a rank
        # runs a few GB over the plan's: GLM-4.5-Air's 131072-token cache on v6e)
        if isinstance(error, RuntimeError) and "RESOURCE_EXHAUSTED" not in str(error):
            raise
        raise UsageError(f"compile {cfg.name} --ranks {args.ranks}: "
                         f"{str(error).splitlines()[0]}") from None
    hosts = len({d.process_index for d in sharded.make_mesh_on(topology, args.ranks).devices.flat})
    print(f"{cfg.name} on {args.ranks} devices of {topology} ({hosts} host(s), one process "
          f"each: a multi-controller run; {plan.layout.describe()}), batch {args.batch}, cache "
          f"{plan.mega.seq_len} tokens: one rank's program")
    print(plan.mega.vmem.table())
    print(result)
    return 0
