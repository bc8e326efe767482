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


def gather_replicas(local: list, dims: ParallelDims) -> list[list]:
    """Every replica's results, indexed by dp rank (one collective over dp, after decoding)."""
    if dims.dp == 1:
        return [local]
    out: list = [None] * dims.dp
    dist.all_gather_object(out, local, group=dims.dp_group)
    return out
