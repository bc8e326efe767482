"""Data parallelism for inference: replicas, each a full pp x tp model, serve disjoint requests.

Routing is least outstanding work: each request goes to the replica (or, inside a
replica, the pipeline micro-batch) with the fewest tokens still to process, counting
prompt and requested output. It is a pure function of the request list, so every rank
computes the same assignment without talking. A replica is independent: no
collective spans replicas while it decodes; results are gathered once at the end.
"""

from __future__ import annotations

import torch.distributed as dist

from shardlm.parallel.dims import ParallelDims


def assign(work: list[int], buckets: int) -> list[int]:
    """Bucket of each item: in order, the one with the least work so far (ties: the lowest)."""
    load = [0] * buckets
    out = []
    for w in work:
        b = min(range(buckets), key=lambda i: load[i])
        load[b] += w
        out.append(b)
    return out


def replica_group(dims: ParallelDims) -> dist.ProcessGroup | None:
    """The group of every rank of this rank's replica (all its stages and tp ranks).

    Creating groups is collective over the world: every rank calls this, in the same order.
    Ranks of one replica are consecutive (dp is the outermost mesh axis).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    n = dist.get_world_size() // dims.dp
    mine, _ = dist.new_subgroups_by_enumeration([list(range(d * n, (d + 1) * n)) for d in range(dims.dp)])
    return mine


def gather_replicas(local: list, dims: ParallelDims) -> list[list]:
    """Every replica's results, indexed by dp rank (one collective over dp, after decoding)."""
    if dims.dp == 1:
        return [local]
    out: list = [None] * dims.dp
    dist.all_gather_object(out, local, group=dims.dp_group)
    return out
