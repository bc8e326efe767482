"""The generation loop of one replica: schedule, run the model, sample, repeat.

Every rank of the replica runs this same loop on the same requests (SPMD). The
scheduler is deterministic and every rank samples the same token from the same
gathered logits, so the ranks agree on every step without exchanging a plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from shardlm.engine.block_manager import BlockManager
from shardlm.engine.model_runner import ModelRunner
from shardlm.engine.sampling import SamplingParams, sample
from shardlm.engine.scheduler import Scheduler, SchedulerConfig
from shardlm.engine.sequence import Sequence


@dataclass(frozen=True)
class Request:
    """One prompt, already tokenized, with its sampling parameters and seed."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int


@dataclass
class StepStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0
    first_token_s: float | None = None  # from the start of the run to the first sampled token
    extra: dict = field(default_factory=dict)


TokenCallback = Callable[[int, int], None]  # (request index, token id)


class Engine:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, *, eos_ids: tuple[int, ...],
                 config: SchedulerConfig, device: torch.device):
        self.runner = runner
        self.blocks = blocks
        self.scheduler = Scheduler(blocks, config)
        self.eos_ids = eos_ids
        self.device = device

    def run(self, requests: list[Request], on_token: TokenCallback | None = None) -> tuple[list[Sequence], StepStats]:
        """Generate for every request; returns the finished sequences in request order."""
        seqs = []
        for i, r in enumerate(requests):
            gen = None
            if not r.params.greedy:
                gen = torch.Generator(device="cpu").manual_seed(r.seed)
            seq = Sequence(i, r.prompt_ids, r.params, eos_ids=self.eos_ids, generator=gen)
            self.scheduler.add(seq)
            seqs.append(seq)
        stats = StepStats()
        start = time.perf_counter()
        while self.scheduler.has_work():
            t0 = time.perf_counter()
            batch = self.scheduler.schedule()
            if not batch.seqs:  # add() admits only sequences that fit alone, so this is a bug
                raise RuntimeError("the scheduler found no sequence that can run")
            logits = self.runner.run(batch)
            tokens = sample(logits.cpu(), [s.params for s in batch.seqs], [s.generator for s in batch.seqs])
            self.scheduler.update(batch, tokens)
            dt = time.perf_counter() - t0
            stats.steps += 1
            if batch.is_prefill:
                stats.prefill_s += dt
                stats.prefill_tokens += sum(len(s.prompt_ids) for s in batch.seqs)
            else:
                stats.decode_s += dt
                stats.decode_tokens += len(batch.seqs)
            if stats.first_token_s is None:
                stats.first_token_s = time.perf_counter() - start
            if on_token is not None:
                for seq, tok in zip(batch.seqs, tokens):
                    on_token(seq.id, tok)
        return seqs, stats
