"""Reading compiled XLA programs: how many kernels one step launches (HLO text of a CompileResult),
and what a traced step is made of (the primitives of its jaxpr)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

_HLO_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_HLO_CALLS = re.compile(r"(?:body|condition|true_computation|false_computation|to_apply_loop)=%?([\w.\-]+)"
                        r"|branch_computations=\{([^}]*)\}")
# Opcodes XLA emits as kernels of their own on a TPU (everything else is fused or free).
_KERNEL_OPCODES = {"fusion", "custom-call", "copy", "convolution", "dot", "sort", "all-reduce",
                   "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "scatter",
                   "gather", "reduce", "dynamic-update-slice", "dynamic-slice", "copy-start"}


def count_xla_kernels(hlo_text: str) -> int:
    """Kernels a compiled XLA program launches per step: the fusions, custom calls (Mosaic
    kernels among them) and other un-fused ops of the entry computation and of the computations
    it runs as loops and branches (not those inside fusions), each counted once per program."""
    computations, current = {}, None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
            computations[current] = []
        elif current is not None and line.startswith("}"):
            current = None
        elif current is not None:
            computations[current].append(line)
    seen, todo, count = set(), ["ENTRY"], 0
    while todo:
        name = todo.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        for line in computations[name]:
            match = _HLO_OPCODE.match(line)
            if match and match.group(1) in _KERNEL_OPCODES:
                count += 1
            for single, branches in _HLO_CALLS.findall(line):
                todo += [single] if single else [b.strip().lstrip("%") for b in branches.split(",")]
    return count


def jaxpr_primitives(jaxpr: Any) -> Iterator[str]:
    """The name of every equation's primitive in a (closed) jaxpr, nested jaxprs included (a
    megakernel step: `list(...).count("pallas_call") == 1`)."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn.primitive.name
        for value in eqn.params.values():
            for sub in (value if isinstance(value, (tuple, list)) else [value]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxpr_primitives(inner)
