"""The generation loop of one replica: schedule, run the model, sample, repeat.

Every rank of the replica runs this same loop on the same requests (SPMD). The
schedulers are deterministic and every rank learns every sampled token, so the ranks
agree on every step without exchanging a plan.

Pipeline stages keep ``micro_batches`` independent batches in flight (vLLM's
"virtual engines"): the requests are split between micro-batches, each with its own
scheduler, visited round-robin. A stage runs micro-batch j's step, sends the hidden
states on and moves to micro-batch j+1 while the next stage works on j. Micro-batch
j's next step waits only for j's own tokens, which come back from the last stage
(see ``StageLinks``). With one stage this is the plain loop with one micro-batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from shardlm.engine.block_manager import BlockManager
from shardlm.engine.model_runner import ModelRunner
from shardlm.engine.sampling import SamplingParams, sample
from shardlm.engine.scheduler import Batch, Scheduler, SchedulerConfig
from shardlm.engine.sequence import Sequence
from shardlm.parallel.data import assign
from shardlm.parallel.pipeline import StageLinks


@dataclass(frozen=True)
class Request:
    """One prompt, already tokenized, with its sampling parameters and seed."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int


@dataclass
class RunStats:
    """Timing of one ``Engine.run`` (seconds from its start)."""

    elapsed_s: float = 0.0
    first_token_s: float | None = None  # until the first sampled token of the run
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_s: float = 0.0  # from the first sampled token to the end
    decode_tokens: int = 0  # tokens generated after each sequence's first
    busy_s: float = 0.0  # this rank computing (model and sampling), not waiting on other stages

    @property
    def decode_tok_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None


TokenCallback = Callable[[int, int], None]  # (request index, token id)


class Engine:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, *, eos_ids: tuple[int, ...],
                 config: SchedulerConfig, links: StageLinks, micro_batches: int = 1):
        self.runner = runner
        self.blocks = blocks
        self.config = config
        self.links = links
        self.micro_batches = micro_batches
        self.eos_ids = eos_ids

    def run(self, requests: dict[int, Request], on_token: TokenCallback | None = None) -> tuple[list[Sequence], RunStats]:
        """Generate for requests keyed by their index; returns sequences in key order."""
        seqs = []
        for i, r in sorted(requests.items()):
            gen = None if r.params.greedy else torch.Generator(device="cpu").manual_seed(r.seed)
            seqs.append(Sequence(i, r.prompt_ids, r.params, eos_ids=self.eos_ids, generator=gen))
        m = max(1, min(self.micro_batches, len(seqs)))
        scheds = [Scheduler(self.blocks, self.config) for _ in range(m)]
        for seq, j in zip(seqs, assign([s.num_tokens + s.params.max_tokens for s in seqs], m)):
            scheds[j].add(seq)
        start = time.perf_counter()
        self.busy_s = 0.0
        pending: list[tuple[Batch, list[int] | None] | None] = [None] * m
        while True:
            stepped = False
            for j, sched in enumerate(scheds):
                if pending[j] is not None:  # this micro-batch's previous step: learn its tokens
                    batch, tokens = pending[j]
                    pending[j] = None
                    if tokens is None:  # sampled by the last stage
                        tokens = self.links.recv_tokens(len(batch.seqs), self.runner.device)
                    sched.update(batch, tokens)
                    if on_token is not None:
                        for seq, tok in zip(batch.seqs, tokens):
                            on_token(seq.id, tok)
                if not sched.has_work():
                    continue
                batch = sched.schedule()
                if batch.seqs:  # empty: it waits for KV blocks another micro-batch holds
                    pending[j] = (batch, self._step(batch))
                    stepped = True
            if not any(pending):
                if not any(s.has_work() for s in scheds):
                    break
                if not stepped:  # add() admits only sequences that fit alone, so this is a bug
                    raise RuntimeError("no micro-batch found a sequence that can run")
        self.links.flush()
        stats = _stats(seqs, start)
        stats.busy_s = self.busy_s
        return seqs, stats

    def _step(self, batch: Batch) -> list[int] | None:
        """Run this stage's part of one step; the last stage samples (and sends) the tokens."""
        hidden = None
        if not self.links.first:
            shape = (2, batch.num_tokens(), self.runner.model.cfg.hidden_size)
            hidden = self.links.recv_hidden(shape, self.runner.dtype, self.runner.device)
        t0 = time.perf_counter()
        out = self.runner.run(batch, hidden)
        if not self.links.last:
            hidden = torch.stack(out)  # [2 (hidden, residual), tokens, hidden]
            self.busy_s += time.perf_counter() - t0
            self.links.send_hidden(hidden)
            return None
        tokens = sample(out.cpu(), [s.params for s in batch.seqs], [s.generator for s in batch.seqs])
        self.busy_s += time.perf_counter() - t0
        self.links.send_tokens(tokens, self.runner.device)
        return tokens


def _stats(seqs: list[Sequence], start: float) -> RunStats:
    end = time.perf_counter()
    firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
    stats = RunStats(elapsed_s=end - start, prompt_tokens=sum(len(s.prompt_ids) for s in seqs),
                     generated_tokens=sum(len(s.output_ids) for s in seqs))
    if firsts:
        stats.first_token_s = min(firsts) - start
        stats.decode_s = end - min(firsts)
        stats.decode_tokens = sum(max(0, len(s.output_ids) - 1) for s in seqs)
    return stats
