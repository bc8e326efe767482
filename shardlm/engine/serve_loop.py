"""The serving loop on the ranks: requests arrive between rounds, tokens stream out.

The leader of each replica (its first stage's tp rank 0) talks to the driver: it
reads new requests and cancellations and streams tokens and finished requests back.
Every round it broadcasts what arrived to all ranks of its replica (one small
collective over the replica's group), so every rank adds and aborts the same
requests at the same point and the schedulers stay identical. No collective spans
replicas. An idle leader still broadcasts at least every ``IDLE_S`` seconds, so the
other ranks never wait long enough in the broadcast to time out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from shardlm.engine.engine import Request
from shardlm.parallel.data import replica_group

IDLE_S = 1.0


@dataclass
class News:
    """What the leader tells its replica at the start of a round."""

    adds: list[tuple[int, Request]] = field(default_factory=list)
    aborts: list[int] = field(default_factory=list)
    stop: bool = False


def serve(worker, link) -> None:
    """Run until the driver says stop. ``link`` is this rank's DriverLink."""
    engine, dims = worker.engine, worker.dims
    group = replica_group(dims)
    leader = dims.pp_rank == 0 and dims.tp_rank == 0
    while True:
        news = News()
        if leader:
            for kind, value in link.poll(0.0 if engine.has_work() else IDLE_S):
                if kind == "add":
                    news.adds.append(value)
                elif kind == "abort":
                    news.aborts.append(value)
                elif kind == "stop":
                    news.stop = True
        if group is not None:
            box = [news]
            dist.broadcast_object_list(box, group=group, group_src=0)  # the leader is the group's first rank
            news = box[0]
        if news.stop:
            break
        for rid, request in news.adds:
            engine.add(rid, request)
        for rid in news.aborts:
            engine.abort(rid)
        if not engine.has_work():
            continue
        tokens: list[tuple[int, int]] = []
        done = engine.step_round(on_token=lambda rid, tok: tokens.append((rid, tok)))
        if leader:
            finished = [(s.id, s.finish_reason, s.num_cached) for s in done]
            link.send("events", (tokens, finished, engine_stats(engine)))
    engine.links.flush()


def engine_stats(engine) -> dict:
    """A snapshot for the server's metrics."""
    blocks = engine.blocks
    return {
        "waiting": sum(len(s.waiting) for s in engine.scheds),
        "running": sum(len(s.running) for s in engine.scheds),
        "kv_blocks_used": blocks.num_used,
        "kv_blocks_total": blocks.num_blocks,
        "prefix_cache_hits": blocks.hits,
        "prefix_cache_queries": blocks.queries,
    }
