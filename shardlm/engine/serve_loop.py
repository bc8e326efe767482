"""The serving loop on the ranks: requests arrive between rounds, tokens stream out.

The leader of each replica (its first stage's cp and tp rank 0) talks to the driver: it
reads new requests and cancellations and streams tokens and finished requests back.
Every round it broadcasts what arrived to all ranks of its replica (one small
collective over the replica's group), so every rank adds and aborts the same
requests at the same point and the schedulers stay identical. No collective spans
replicas, unless their MoE layers exchange tokens across replicas: then the replicas
also agree each round whether any has work (and step together, see Engine) and when to
stop. Disaggregated serving adds one kind of news, a request another replica prefilled
(``adopt``: every rank receives its KV shard from its counterpart there), and one kind
of event, the requests this replica prefilled and handed on. An idle leader still
broadcasts at least every ``IDLE_S`` seconds, so the other ranks never wait long enough
in the broadcast to time out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardlm.engine.disagg import Handoff
from shardlm.engine.engine import Request
from shardlm.engine.sampling import TokenLogprob
from shardlm.parallel import comm
from shardlm.parallel.expert_stats import collect_load, rebalance_experts

IDLE_S = 1.0
LOAD_EVERY = 32  # rounds between expert-load reports (MoE models)


@dataclass
class News:
    """What the leader tells its replica at the start of a round."""

    adds: list[tuple[int, Request]] = field(default_factory=list)
    adopts: list[Handoff] = field(default_factory=list)  # prefilled by another replica (disaggregation)
    aborts: list[int] = field(default_factory=list)
    stop: bool = False


def serve(worker, link) -> None:
    """Run until the driver says stop. ``link`` is this rank's DriverLink."""
    engine, dims = worker.engine, worker.dims
    group = dims.replica_group()
    leader = dims.pp_rank == dims.cp_rank == dims.tp_rank == 0
    rounds = 0
    load = None
    while True:
        news = News()
        if leader:
            for kind, value in link.poll(0.0 if engine.has_work() else IDLE_S):
                if kind == "add":
                    news.adds.append(value)
                elif kind == "adopt":
                    news.adopts.append(value)
                elif kind == "abort":
                    news.aborts.append(value)
                elif kind == "stop":
                    news.stop = True
            news.stop |= link.closing  # the driver is closing without a stop: a rank failed elsewhere
        if group is not None:
            box = [news]
            dist.broadcast_object_list(box, group=group, group_src=0)  # the leader is the group's first rank
            news = box[0]
        for rid, request in news.adds:
            engine.add(rid, request)
        for handoff in news.adopts:  # before aborts: a client may have left while its KV travelled
            engine.adopt(handoff)
        for rid in news.aborts:
            engine.abort(rid)
        work, stop = engine.has_work(), news.stop
        if engine.lockstep is not None:  # replicas that share expert collectives move together
            flags = comm.all_reduce(
                torch.tensor([int(work), int(stop)], device=engine.runner.device), engine.lockstep, op="max"
            ).tolist()
            work, stop = bool(flags[0]), bool(flags[1])
        if stop:
            break
        if not work:
            continue
        tokens: list[tuple[int, int, TokenLogprob | None]] = []
        done = engine.step_round(on_token=lambda rid, tok, logprob: tokens.append((rid, tok, logprob)))
        rounds += 1
        eplb = worker.config.eplb_interval
        if worker.moe and (rounds % LOAD_EVERY == 0 or (eplb and rounds % eplb == 0)):  # same round on every rank
            observed = collect_load(worker.model, dims, across_dp=engine.lockstep is not None)
            if eplb and rounds % eplb == 0:  # identical load on every rank that shares a placement
                rebalance_experts(worker.model, observed, worker.checkpoint.source(), worker.config.eplb_redundant)
            load = observed.to_dict()
            load["all_replicas"] = engine.lockstep is not None
        handoffs, engine.handoffs = engine.handoffs, []
        scored, engine.prompt_logprobs_out = engine.prompt_logprobs_out, []
        if leader:
            finished = [(s.id, s.finish_reason, s.num_cached, s.stop_reason, queue_time(s)) for s in done]
            link.send("events", (tokens, finished, engine_stats(engine, load), handoffs, scored))
    engine.links.flush()


def queue_time(seq) -> float | None:
    """Seconds from its arrival on this replica to its first step (None: never scheduled)."""
    return None if seq.scheduled_time is None else seq.scheduled_time - seq.arrival


def engine_stats(engine, expert_load: dict | None) -> dict:
    """A snapshot for the server's metrics (expert_load: this replica's, or all replicas' in lockstep)."""
    blocks = engine.blocks
    return {
        "expert_load": expert_load,
        "waiting": sum(len(s.waiting) for s in engine.scheds),
        "running": sum(len(s.running) for s in engine.scheds),
        "kv_blocks_used": blocks.num_used,
        "kv_blocks_total": blocks.num_blocks,
        "prefix_cache_hits": blocks.hits,
        "prefix_cache_queries": blocks.queries,
        "handoffs_recomputed": engine.recomputed_handoffs,
        "num_preemptions": sum(s.preemptions for s in engine.scheds),
        **dict(zip(("spec_draft_tokens", "spec_accepted_tokens"), engine.speculation())),
    }
