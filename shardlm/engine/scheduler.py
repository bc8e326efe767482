"""Which sequences run in the next step (pure Python; unit-tested without ranks).

Continuous batching (Yu et al. 2022, Orca, OSDI): sequences join and leave the
running batch between steps. A step is either a prefill of newly admitted
sequences (as many as the token budget and free KV blocks allow) or one decode
token for every running sequence. When a decode step runs out of blocks, the
newest running sequence is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed later, with nothing it generated lost.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shardlm.engine.block_manager import BlockManager
from shardlm.engine.sequence import Sequence, Status
from shardlm.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most sequences in one step."""
    max_num_batched_tokens: int = 8192
    """Most prompt tokens prefilled in one step (a longer single prompt still runs alone)."""


@dataclass
class Batch:
    seqs: list[Sequence]
    is_prefill: bool

    def num_tokens(self) -> int:
        """Tokens this step feeds through the model."""
        return sum(s.num_tokens - s.num_computed for s in self.seqs) if self.is_prefill else len(self.seqs)


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig = SchedulerConfig()):
        self.blocks = blocks
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; refuse one that could not finish even with the whole cache."""
        # its last decode step holds K/V for every token but the final sampled one
        need = seq.num_tokens + seq.params.max_tokens - len(seq.output_ids) - 1
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if need > capacity:
            raise UsageError(
                f"a request of {len(seq.prompt_ids)} prompt tokens and up to {seq.params.max_tokens} new ones "
                f"needs {need} KV-cache slots but the cache holds {capacity}; raise kv_cache_memory "
                f"or lower max_tokens"
            )
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        admitted: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.config.max_num_seqs:
            seq = self.waiting[0]
            new = seq.num_tokens - seq.num_computed
            if admitted and tokens + new > self.config.max_num_batched_tokens:
                break
            if not self.blocks.can_grow(seq, seq.num_tokens):
                break
            self.blocks.grow(seq, seq.num_tokens)
            seq.status = Status.RUNNING
            admitted.append(self.waiting.popleft())
            tokens += new
        if admitted:
            self.running.extend(admitted)
            return Batch(admitted, is_prefill=True)
        decoding: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted below
            while not self.blocks.can_grow(seq, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq, seq.num_tokens)
                decoding.append(seq)
        return Batch(decoding, is_prefill=False)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def update(self, batch: Batch, tokens: list[int]) -> list[Sequence]:
        """Record one sampled token per sequence; returns the sequences that finished."""
        done = []
        for seq, token in zip(batch.seqs, tokens):
            seq.num_computed = seq.num_tokens
            seq.append(token)
            if seq.status is Status.FINISHED:
                self.blocks.free(seq)
                self.running.remove(seq)
                done.append(seq)
        return done
