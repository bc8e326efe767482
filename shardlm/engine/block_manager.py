"""Paged KV-cache bookkeeping (vLLM's PagedAttention, https://arxiv.org/abs/2309.06180 §4).

The cache is ``num_blocks`` fixed-size blocks of ``block_size`` token slots. A
sequence owns a block table (block ids in order); token i lives in slot
``block_table[i // block_size] * block_size + i % block_size``. Blocks carry
reference counts so that sequences can share them.
"""

from __future__ import annotations

from collections import deque

from shardlm.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be at least 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its table covers ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq``'s table to cover ``num_tokens`` tokens (caller checked can_grow)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block = self.free_ids.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_ids.append(block)
        seq.block_table = []
        seq.num_computed = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
