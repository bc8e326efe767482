"""Paged KV-cache bookkeeping with prefix caching (vLLM's PagedAttention,
https://arxiv.org/abs/2309.06180 §4, and its automatic prefix caching).

The cache is ``num_blocks`` fixed-size blocks of ``block_size`` token slots. A
sequence owns a block table (block ids in order); token i lives in slot
``block_table[i // block_size] * block_size + i % block_size``.

Prefix caching: a block that holds ``block_size`` tokens is named by a hash of its
tokens and of the blocks before it, so equal prefixes have equal hashes. A new
sequence reuses the cached blocks of its longest cached prefix (their reference count
goes up) and computes only the rest. A freed block keeps its contents and hash until
it is handed out again (least recently freed first), so a system prompt shared by
requests that do not overlap in time is still found.
"""

from __future__ import annotations

from collections import OrderedDict

from shardlm.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be at least 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.ref_counts = [0] * num_blocks
        # free blocks, least recently freed first; never-used ones first of all
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_of: dict[int, int] = {}  # block -> hash of the full block it holds
        self.block_of: dict[int, int] = {}  # hash -> block
        self.hits = 0  # tokens served from the prefix cache
        self.queries = 0  # tokens looked up, per admission (a preempted sequence counts again)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its table covers ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq``'s table to cover ``num_tokens`` tokens (caller checked can_grow)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block, _ = self.free_ids.popitem(last=False)
            self._forget(block)  # its old contents are about to be overwritten
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks at the end of ``seq``'s table beyond ``num_tokens`` tokens (grown
        for speculative drafts that were rejected: their own, never named by a hash)."""
        keep = -(-num_tokens // self.block_size)
        for block in seq.block_table[keep:]:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_ids[block] = None
        del seq.block_table[keep:]

    def reuse_prefix(self, seq: Sequence) -> None:
        """Start a new sequence on the cached blocks of its longest cached prefix.

        At least the last token is left to compute: its logits pick the next token,
        and its K/V must go to a block of this sequence's own.
        """
        if seq.block_table or not self.prefix_caching or seq.scores_prompt:
            return
        tokens = seq.token_ids()
        h = 0
        for i in range((len(tokens) - 1) // self.block_size):
            h = block_hash(h, tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self.block_of.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free_ids[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        seq.num_computed = len(seq.block_table) * self.block_size
        seq.num_cached = seq.num_computed

    def count_lookup(self, seq: Sequence) -> None:
        """Record an admitted sequence's prefix-cache lookup (hit rate = hits / queries)."""
        self.queries += seq.num_tokens
        self.hits += seq.num_cached

    def commit(self, seq: Sequence) -> None:
        """Name the sequence's newly filled blocks by hash so later sequences can reuse them."""
        full = seq.num_computed // self.block_size
        if not self.prefix_caching or full <= len(seq.block_hashes):
            return
        tokens = seq.token_ids()
        h = seq.block_hashes[-1] if seq.block_hashes else 0
        for i in range(len(seq.block_hashes), full):
            h = block_hash(h, tokens[i * self.block_size : (i + 1) * self.block_size])
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.block_of and block not in self.hash_of:
                self.block_of[h], self.hash_of[block] = block, h

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_ids[block] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    def _forget(self, block: int) -> None:
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.block_of[h]


def block_hash(prev: int, tokens: list[int]) -> int:
    """Hash of a full block: its tokens and the hash of everything before it."""
    return hash((prev, tuple(tokens)))
