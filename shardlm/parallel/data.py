"""Data parallelism for inference: replicas, each a full pp x tp model, serve disjoint requests.

Routing is least outstanding work: each request goes to the replica (or, inside a
replica, the pipeline micro-batch) with the fewest tokens still to process, counting
prompt and requested output. It is a pure function of the request list, so every rank
computes the same assignment without talking. A replica is independent: no
collective spans replicas while it decodes; results are gathered once at the end.
Disaggregated serving is the exception: prefill replicas hand each prompt's KV cache
to a decode replica, point to point (``ReplicaLink``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardlm.parallel import comm
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


def gather_replicas(local: Any, dims: ParallelDims) -> list:
    """Every replica's results, indexed by dp rank (one collective over dp, after decoding)."""
    if dims.dp == 1:
        return [local]
    out: list = [None] * dims.dp
    dist.all_gather_object(out, local, group=dims.dp_group)
    return out


class ReplicaLink:
    """Point-to-point transfers between the ranks at the same (pp, tp) place of two replicas:
    the KV cache of a prompt travels from the rank that prefilled it to the rank that will
    decode it (prefill/decode disaggregation; every rank sends or receives its own shard).

    Sends are asynchronous: the prefill replica never waits for a decode replica, which
    receives (blocking, the data already on its way) when the driver tells it a handoff
    arrived. Payloads are bytes (uint8), so any cache element type (fp8 too) crosses gloo.
    NCCL pairs messages between two ranks in the order they are posted, which both sides
    keep (handoffs from one replica are adopted in the order they were sent); gloo also
    matches the tag (the request id), so a mismatch times out rather than mixes caches.
    """

    def __init__(self, dims: ParallelDims, prefill_replicas: int, device: torch.device):
        self.group = dims.dp_group
        self.dp_rank = dims.dp_rank
        self.device = device
        self.in_flight: list[tuple[dist.Work, torch.Tensor]] = []  # sends and the buffers they read
        # NCCL may create a pair's communicator on its first message, blocking both ranks; a first
        # one-sided send would wait for a receiver that is not listening yet. Every pair
        # exchanges one element at start-up on the cache's device, in one order on every rank.
        for src in range(prefill_replicas):
            for dst in range(prefill_replicas, dims.dp):
                if self.dp_rank == src:
                    comm.send(torch.zeros(1, device=device), dst, self.group)
                elif self.dp_rank == dst:
                    comm.recv((1,), torch.float32, src, self.group, device)

    def send(self, payload: torch.Tensor, dst: int, tag: int) -> None:
        """Start sending ``payload`` (uint8, contiguous; kept alive until sent) to replica ``dst``."""
        self.in_flight = [(w, d) for w, d in self.in_flight if not w.is_completed()]
        self.in_flight.append((comm.isend(payload, dst, self.group, _tag(tag)), payload))

    def recv(self, shape: tuple[int, ...], src: int, tag: int) -> torch.Tensor:
        """Bytes of this shape from replica ``src`` (blocks until they are here)."""
        return comm.recv(shape, torch.uint8, src, self.group, self.device, _tag(tag))


def _tag(rid: int) -> int:
    return rid % (1 << 31)
