"""A recorded sharded step against the step's collectives (`kernels/sharded/collective_ops.py`, from
the sharding plan the prediction reads): every rank's remote copies, collective by collective."""

from mkresearch.kernels.sharded import collective_ops, plan

from mkresearch.model import spec
from mkresearch.sharding import layout


def check(log, lay, batch, expert_ids, options=None) -> int:
    """Each rank's remote copies in the log are its schedule's collectives in order (the exact
    mode's per-expert gathers counted from the step's routing `expert_ids` [n_moe, B, k]; the
    reductions sent as `options` (a MegakernelOptions) says) -> the number of collectives of
    rank 0."""
    reductions = options.reductions if options is not None else ()
    host = (options.ranks_per_host if options is not None else 0) or lay.n_ranks
    for rank in range(lay.n_ranks):
        ops = ops_of(lay, batch, reductions, rank, expert_counts(lay, expert_ids, rank))
        got, want = recorded_collectives(log, rank), expected_collectives(ops, rank, host)
        assert got == want, (rank, [(a, b) for a, b in zip(got, want) if a != b][:3], len(got), len(want))
        if rank == 0:
            count = sum(op.count for op in ops)
    return count


def ops_of(lay, batch, reductions, rank, counts):
    """Rank's ops of the plan with the kernel's reductions ((name, algorithm) pairs)."""
    sharding = plan.with_algorithms(lay, batch, "f32", reductions)
    return collective_ops.collective_ops(sharding, rank=rank, expert_counts=counts)


def expert_counts(lay, ids, rank):
    """Per MoE layer, the distinct experts of the batch in rank's expert group."""
    per_group = lay.cfg.n_experts // lay.ep
    group = lay.split(spec.EXPERTS).index(rank)
    return tuple(len({int(e) for e in layer.ravel() if int(e) // per_group == group})
                 for layer in ids)


def recorded_collectives(log, rank):
    """[name, copies sent] of rank's remote copies, consecutive copies of one name together."""
    runs = []
    for e in log.of_rank(rank).events:
        if e.kind == "dma_start" and e.remote:
            if runs and runs[-1][0] == e.name:
                runs[-1][1] += 1
            else:
                runs.append([e.name, 1])
    return runs


def expected_collectives(ops, rank, ranks_per_host=0):
    """The same from the schedule: a one-shot collective sends to every other member; the
    exact mode's all-reduce is a reduce-scatter then an all-gather; a chain sends down the
    chain but from its last member; a reduction in levels sends to the other members of its
    host, then to the same member of the other hosts, then (rs-ag) to its host again; a
    reduce-scatter sends each other member its chunk."""
    runs = []
    for op in ops:
        peers = len(op.group) - 1
        host = ranks_per_host or len(op.group)
        hosts = len(op.group) // host
        if op.algorithm in ("two-level", "rs-ag"):
            sent = [(f"{op.name}/local", host - 1), (f"{op.name}/across", hosts - 1)]
            sent += [(f"{op.name}/local_gather", host - 1)] if op.algorithm == "rs-ag" else []
        elif op.kind == "chain":
            sent = [(f"{op.name}", int(rank != op.group[-1]))]
        elif op.kind == "reduce-scatter":  # restructured's ρ: one phase, a chunk to each peer
            sent = [(f"{op.name}/reduce_scatter", peers)]
        elif op.algorithm.startswith("reduce-scatter"):
            sent = [(f"{op.name}/reduce_scatter", peers), (f"{op.name}/all_gather", peers)]
        else:
            sent = [(f"{op.name}/all_gather", peers * op.count)]
        for name, n in sent:
            if not n:
                continue
            if runs and runs[-1][0] == name:
                runs[-1][1] += n
            else:
                runs.append([name, n])
    return runs


def check_reduction_bytes(log, lay, batch, wire, reductions=()) -> dict:
    """Each one-shot reduction's remote copies move the bytes the step's collectives price
    (`Reduction.payload_bytes`: the partial sums at the wire's bytes a value, the riders' chunks
    as f32), and a reduce-scatter's each peer's chunk at the wire's bytes a value (the op's
    payload), on every rank -> {reduction name: bytes per copy}."""
    sharding = plan.with_algorithms(lay, batch, wire, reductions)
    priced = {f"{r.name}/all_gather": r.payload_bytes(batch, wire) for r in sharding.reductions
              if r.algorithm == plan.ONE_SHOT and not r.scatter}
    priced.update({f"{op.name}/reduce_scatter": op.payload_bytes
                   for op in collective_ops.collective_ops(sharding)
                   if op.kind == "reduce-scatter"})
    seen = {}
    for rank in range(lay.n_ranks):
        for e in log.of_rank(rank).events:
            name = e.name
            if e.kind == "dma_start" and e.remote and name in priced:
                assert e.nbytes == priced[name], (rank, e.name, e.nbytes, priced[name])
                seen[name] = e.nbytes
    assert set(seen) == set(priced), (sorted(seen), sorted(priced))
    return seen


def check_level_bytes(log, lay, batch, wire, options) -> dict:
    """Each reduction sent in levels (`options.reductions`, hosts of `options.ranks_per_host`)
    moves, on every rank and at every level, its values at the wire's bytes a value (the
    partial sums, a host's sum, rs-ag's summed chunk) and its riders' chunks as f32, in whole
    lanes -> {"<reduction>/<level>": bytes per copy}."""
    h = options.ranks_per_host
    sharding = plan.with_algorithms(lay, batch, wire, options.reductions, h)
    want = {}
    for r in sharding.reductions:
        if r.algorithm == plan.ONE_SHOT or r.scatter:
            continue
        piece = r.width if r.algorithm == plan.TWO_LEVEL else layout.chunk_length(r.width, h)
        values = piece * plan.WIRE_BYTES[wire] // plan.F32  # in f32 slots
        want[f"{r.name}/local"] = batch * plan.F32 * plan.lanes(values + r.riders)
        if lay.n_ranks > h:
            want[f"{r.name}/across"] = batch * plan.F32 * plan.lanes(values + h * r.riders)
        if r.algorithm == plan.RS_AG:
            want[f"{r.name}/local_gather"] = batch * plan.F32 * plan.lanes(values)
    seen = {}
    for rank in range(lay.n_ranks):
        for e in log.of_rank(rank).events:
            if e.kind == "dma_start" and e.remote and e.name in want:
                assert e.nbytes == want[e.name], (rank, e.name, e.nbytes, want[e.name])
                seen[e.name] = e.nbytes
    assert set(seen) == set(want), (sorted(seen), sorted(want))
    return seen
