"""Which sequences run in the next step, and how many of their tokens (pure Python).

Continuous batching (Yu et al. 2022, Orca, OSDI) with chunked prefill (Agrawal et al.
2023, Sarathi, https://arxiv.org/abs/2308.16369): every step has a budget of
``max_num_batched_tokens``. Decoding sequences come first, one token each, so a long
prompt never stalls them; the rest of the budget goes to prompts, in chunks when a
prompt is longer than what is left. New sequences join between steps.

When a decoding sequence needs a KV block and none is free, the newest running
sequence is preempted: its blocks are freed and it goes back to the front of the
queue to be recomputed later, with nothing it generated lost.

Speculative decoding (``speculative``, see speculative.py): a decoding sequence may feed
its last token and up to k draft tokens in one step, when the budget and free blocks
allow (drafts never preempt anyone); the step then emits one to k + 1 tokens for it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from shardlm.engine.block_manager import BlockManager
from shardlm.engine.sampling import TokenLogprob
from shardlm.engine.sequence import Sequence, Status
from shardlm.engine.speculative import SpeculativeConfig, propose
from shardlm.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most sequences in one step."""
    max_num_batched_tokens: int = 8192
    """Most prompt tokens fed through the model in one step (longer prompts are prefilled in
    chunks); decoding sequences always get their one token, bounded by max_num_seqs."""
    speculative: SpeculativeConfig | None = None
    """Draft tokens for decoding sequences (n-gram lookup, or a draft model's proposals that the
    sampling ranks made at the sequence's previous step), verified in the same step."""


@dataclass
class Batch:
    """One step: ``seqs[i]`` feeds ``counts[i]`` tokens, starting at its ``num_computed``: its
    own tokens, then ``drafts[i]`` (speculative decoding; the drafts count in ``counts``).
    Prefill chunks and sequences with drafts come first, then single-token decodes."""

    seqs: list[Sequence]
    counts: list[int]
    drafts: list[list[int]] | None = None  # None: no drafts this step

    def draft(self, i: int) -> list[int]:
        return self.drafts[i] if self.drafts else []

    def num_tokens(self) -> int:
        """Tokens this step feeds through the model."""
        return sum(self.counts)

    def prompt_rows(self, i: int) -> range:
        """Positions of ``seqs[i]``'s prompt this step whose logits score the next prompt token
        (prompt logprobs): those not scored yet, up to the second-to-last prompt token."""
        seq = self.seqs[i]
        if not seq.scores_prompt:
            return range(0)
        start = max(seq.num_computed, len(seq.prompt_logprobs))
        return range(start, min(seq.num_computed + self.counts[i], len(seq.prompt_ids) - 1))

    def samples(self) -> list[bool]:
        """Whether each sequence reaches its last token this step (so a token is sampled)."""
        return [
            s.num_computed + n - len(self.draft(i)) == s.num_tokens
            for i, (s, n) in enumerate(zip(self.seqs, self.counts))
        ]


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig = SchedulerConfig()):
        self.blocks = blocks
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.draft_tokens = 0  # speculative decoding: drafts fed so far
        self.accepted_tokens = 0  # of those, the ones the target model accepted
        self.preemptions = 0  # running sequences sent back to the queue for lack of blocks

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

    def adopt(self, seq: Sequence, num_computed: int) -> bool:
        """Take a sequence whose first ``num_computed`` tokens' K/V another replica computed
        (disaggregated serving): running, with blocks for them and its next token, whose first
        ones the caller fills, when a place and the blocks are free (True); else queued to be
        recomputed from its tokens (False)."""
        if len(self.running) >= self.config.max_num_seqs or not self.blocks.can_grow(seq, seq.num_tokens):
            self.add(seq)
            return False
        self.blocks.grow(seq, seq.num_tokens)
        seq.num_computed = num_computed
        self.blocks.commit(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

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
        drafted: dict[Sequence, list[int]] = {}
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
        plain = []
        for seq in decodes:  # drafts take only what every decode's next token left over
            if drafts := self._drafts(seq, budget):
                drafted[seq] = drafts
                budget -= len(drafts)
            else:
                plain.append(seq)
        decodes = plain
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
            seq.scheduled_time = seq.scheduled_time or time.perf_counter()
            seq.status = Status.RUNNING
            self.running.append(self.waiting.popleft())
            chunks.append((seq, n))
            budget -= n
        # the runner wants prefill chunks first, then single-token steps over a cached context
        # (a prompt whose last token is all that is left after a cache hit is one of those)
        decodes += [s for s, n in chunks if n == 1 and s.is_decoding]
        chunks = [(s, n) for s, n in chunks if not (n == 1 and s.is_decoding)]
        chunks += [(s, 1 + len(d)) for s, d in drafted.items()]
        seqs = [s for s, _ in chunks] + decodes
        return Batch(
            seqs, [n for _, n in chunks] + [1] * len(decodes), [drafted.get(s, []) for s in seqs] if drafted else None
        )

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for a decoding sequence that has its slot for the next token: as many as
        the budget, its remaining max_tokens (the step emits one more than it accepts) and free
        blocks allow; free blocks only, no one is preempted for a draft."""
        spec = self.config.speculative
        if spec is None or budget < 1:
            return []
        bs = self.blocks.block_size
        slots = (len(seq.block_table) + self.blocks.num_free) * bs - seq.num_tokens  # free slots after its own
        room = min(budget, seq.params.max_tokens - len(seq.output_ids) - 1, slots)
        if spec.drafts_with_model:  # drafted for the current history after its last step (draft.py)
            drafts, seq.proposed = seq.proposed[: max(room, 0)], []
        else:
            drafts = propose(seq.token_ids(), spec, room)
        if not drafts:
            return []
        self.blocks.grow(seq, seq.num_tokens + len(drafts))
        self.draft_tokens += len(drafts)
        return drafts

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
        self.preemptions += 1
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.draft_computed = 0  # the draft model's cache of it goes with its blocks
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Drop a sequence wherever it is (client gone, or handed to a decode replica); its
        blocks are freed."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.finish(reason)

    def update(
        self,
        batch: Batch,
        tokens: list[int | list[int] | None],
        logprobs: list[list[TokenLogprob] | None] | None = None,
        prompt_logprobs: list[list[TokenLogprob] | None] | None = None,
    ) -> list[Sequence]:
        """Record a step: ``tokens[i]`` is the token sampled for ``batch.seqs[i]`` (None for a
        prompt chunk that did not reach the end; with drafts, the accepted drafts and the token
        after them), ``logprobs[i]`` their logprobs where asked for, ``prompt_logprobs[i]`` those
        of its ``batch.prompt_rows(i)``. Returns the sequences that finished."""
        done: list[Sequence] = []
        for i, (seq, n, token) in enumerate(zip(batch.seqs, batch.counts, tokens)):
            if seq.status is Status.FINISHED:  # aborted while its step was in flight
                continue
            if scored := (prompt_logprobs[i] if prompt_logprobs else None):
                seq.prompt_logprobs += scored
            emitted = [] if token is None else token if isinstance(token, list) else [token]
            given = logprobs[i] if logprobs else None
            entries: list[TokenLogprob | None] = list(given) if given else [None] * len(emitted)
            drafts = batch.draft(i)
            if drafts:
                self.accepted_tokens += len(emitted) - 1
            kept = 0
            for t, entry in zip(emitted, entries):
                seq.append(t, entry)
                kept += 1
                if seq.status is Status.FINISHED:
                    break  # a stop token or max_tokens: the rest are dropped
            # the cache holds the fed tokens and the kept drafts (rejected ones: slots overwritten later)
            seq.num_computed += n - len(drafts) + max(kept - 1, 0)
            if drafts and seq.status is not Status.FINISHED:
                self.blocks.trim(seq, seq.num_tokens)  # blocks grown for rejected drafts go back
            self.blocks.commit(seq)
            if seq.status is Status.FINISHED:
                self.blocks.free(seq)
                self.running.remove(seq)
                done.append(seq)
        return done
