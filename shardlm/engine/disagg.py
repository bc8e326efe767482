"""Prefill/decode disaggregation: some replicas only prefill, the others only decode.

A prompt's prefill is one long compute-bound step; decoding is many short memory-bound
ones. On one replica a prefill that joins the batch stalls every decode of that step
(chunked prefill bounds the stall, it does not remove it). Disaggregation (DistServe,
Zhong et al. 2024, https://arxiv.org/abs/2401.09670; Splitwise, Patel et al. 2024,
https://arxiv.org/abs/2311.18677; vLLM's and SGLang's prefill/decode split) gives the two
phases their own replicas: the time per output token no longer depends on arriving
prompts, and each pool can be sized (and laid out) for its phase.

The flow of one request (``AsyncLLM`` with ``prefill_replicas=P`` of its dp replicas):
the driver sends it to the least-loaded prefill replica, naming the decode replica it
will go to. The prefill replica computes the prompt and samples the first token (so
the first token streams as soon as the prompt is done), then every one of its ranks
starts sending its shard of the prompt's KV blocks to its counterpart on the decode
replica (``ReplicaLink``; the ranks that sample also send the sampler's state), frees the
blocks (they stay in its prefix cache) and reports a ``Handoff``. The driver forwards the
handoff; every rank of the decode replica receives its shard in the same round, writes it
into blocks of its own, and the sequence goes on decoding as if it had been prefilled
there. A decode replica without free blocks for it queues it instead, to be recomputed from
its tokens (nothing lost).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shardlm.engine.sampling import SamplingParams
from shardlm.engine.scheduler import Scheduler
from shardlm.engine.sequence import Sequence


@dataclass(frozen=True)
class Handoff:
    """A prefilled request on its way to a decode replica (what the driver forwards)."""

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int]  # the first token (sampled by the prefill replica)
    logprobs: list  # its TokenLogprob, when the params ask for logprobs
    num_computed: int  # tokens whose K/V travel (the prompt)
    num_cached: int  # of those, found in the prefill replica's prefix cache
    src: int  # dp rank of the prefill replica
    dst: int  # dp rank of the decode replica
    num_blocks: int  # KV blocks sent (each rank its shard of them)


def hand_off(engine, sched: Scheduler, seq: Sequence) -> Handoff:
    """Send a just-prefilled sequence's KV shard to its decode replica and drop it here. The
    ranks that sample (the last stage's) also send the sampler's state after the first token,
    so seeded sampling goes on where it left off."""
    assert seq.handoff is not None  # the decode replica chosen at arrival
    link = engine.replica_link
    blocks = seq.block_table[: -(-seq.num_computed // engine.blocks.block_size)]
    link.send(engine.runner.read_blocks(blocks), seq.handoff, tag=seq.id)  # a copy: the blocks are freed below
    if seq.generator is not None and engine.links.last:
        link.send(seq.generator.get_state().to(engine.runner.device), seq.handoff, tag=seq.id)
    handoff = Handoff(
        seq.id,
        seq.prompt_ids,
        seq.params,
        list(seq.output_ids),
        list(seq.logprobs),
        seq.num_computed,
        seq.num_cached,
        link.dp_rank,
        seq.handoff,
        len(blocks),
    )
    sched.abort(seq, reason="handoff")  # frees its blocks; their hashes keep them in the prefix cache
    return handoff


def adopt(engine, h: Handoff) -> Sequence:
    """Receive a handed-off sequence's KV shard (every rank of the decode replica, in the order
    the handoffs were sent) and queue it to decode; without room, to be recomputed."""
    runner, link = engine.runner, engine.replica_link
    kv = link.recv(runner.block_shape(h.num_blocks), src=h.src, tag=h.rid)
    gen = None
    if not h.params.greedy and engine.links.last:  # the ranks that sample
        gen = torch.Generator(device="cpu")
        gen.set_state(link.recv(gen.get_state().shape, src=h.src, tag=h.rid).cpu())
    seq = engine.sequence(h.rid, h.prompt_ids, h.params, generator=gen, output_ids=h.output_ids)
    seq.logprobs = list(h.logprobs)
    seq.first_token_time = time.perf_counter()
    seq.num_cached = h.num_cached
    sched = engine.least_loaded()
    if sched.adopt(seq, h.num_computed):
        runner.write_blocks(seq.block_table[: h.num_blocks], kv)
    else:
        engine.recomputed_handoffs += 1
    engine.seqs[h.rid] = seq
    return seq
