"""Which sequences run in the next step, and how many of their tokens (pure Python).

Continuous batching (Yu et al. 2022, Orca, OSDI) with chunked prefill (Agrawal et al.
2023, Sarathi, https://arxiv.org/abs/2308.16369): every step has a budget of
``max_num_batched_tokens``. Decoding sequences come first, one token each, so a long
prompt never stalls them; the rest of the budget goes to prompts, in chunks when a
prompt is longer than what is left. New sequences join between steps.

When a decoding sequence needs a KV block and none is free, the newest running
sequence is preempted: its blocks are freed and it goes back to the front of the
queue to be recomputed later, with nothing it generated lost.
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
    """Most prompt tokens fed through the model in one step (longer prompts are prefilled in
    chunks); decoding sequences always get their one token, bounded by max_num_seqs."""


@dataclass
class Batch:
    """One step: ``seqs[i]`` feeds ``counts[i]`` tokens, starting at its ``num_computed``.
    Prefill chunks come first, then single-token decodes."""

    seqs: list[Sequence]
    counts: list[int]

    def num_tokens(self) -> int:
        """Tokens this step feeds through the model."""
        return sum(self.counts)

    def samples(self) -> list[bool]:
        """Whether each sequence reaches its last token this step (so a token is sampled)."""
        return [s.num_computed + n == s.num_tokens for s, n in zip(self.seqs, self.counts)]


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
        """The next step. If running sequences hold every block and none can grow (prompt chunks
        waiting for blocks, possibly held by another micro-batch sharing the cache), the newest
        is preempted and the step rebuilt without admitting anyone, so the freed blocks go to
        the others; add() guarantees that any one sequence fits, so the oldest always finishes."""
        admit = True
        while True:
            batch = self._build(admit)
            if batch.seqs or not self.running:
                return batch
            self._preempt(self.running[-1])
            admit = False

    def _build(self, admit: bool) -> Batch:
        budget = self.config.max_num_batched_tokens
        decodes: list[Sequence] = []
        chunks: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted below
            if not seq.is_decoding:  # a prompt prefilled in chunks: continue it below
                continue
            if len(decodes) >= self.config.max_num_seqs:
                break
            if self._make_room(seq, seq.num_tokens):
                decodes.append(seq)
                budget -= 1
        for seq in self.running:  # prompts already started, in admission order
            if seq.status is Status.RUNNING and not seq.is_decoding and budget > 0:
                n = min(seq.num_tokens - seq.num_computed, budget)
                if self.blocks.can_grow(seq, seq.num_computed + n):
                    self.blocks.grow(seq, seq.num_computed + n)
                    chunks.append((seq, n))
                    budget -= n
        while admit and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            self.blocks.reuse_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.blocks.can_grow(seq, seq.num_computed + n):
                self.blocks.free(seq)  # give back the prefix it borrowed; try again next step
                break
            self.blocks.grow(seq, seq.num_computed + n)
            self.blocks.count_lookup(seq)
            seq.status = Status.RUNNING
            self.running.append(self.waiting.popleft())
            chunks.append((seq, n))
            budget -= n
        # the runner wants prefill chunks first, then single-token steps over a cached context
        # (a prompt whose last token is all that is left after a cache hit is one of those)
        decodes += [s for s, n in chunks if n == 1 and s.is_decoding]
        chunks = [(s, n) for s, n in chunks if not (n == 1 and s.is_decoding)]
        return Batch([s for s, _ in chunks] + decodes, [n for _, n in chunks] + [1] * len(decodes))

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq`` to ``num_tokens``, preempting the newest running sequences as needed."""
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (client gone); its blocks are freed."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.finish("abort")

    def update(self, batch: Batch, tokens: list[int | None]) -> list[Sequence]:
        """Record a step: ``tokens[i]`` is the token sampled for ``batch.seqs[i]`` (None for a
        prompt chunk that did not reach the end). Returns the sequences that finished."""
        done = []
        for seq, n, token in zip(batch.seqs, batch.counts, tokens):
            if seq.status is Status.FINISHED:  # aborted while its step was in flight
                continue
            seq.num_computed += n
            self.blocks.commit(seq)
            if token is None:
                continue
            seq.append(token)
            if seq.status is Status.FINISHED:
                self.blocks.free(seq)
                self.running.remove(seq)
                done.append(seq)
        return done
