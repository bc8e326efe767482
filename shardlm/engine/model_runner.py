"""Runs one scheduled step of the model on this rank (SPMD: every rank the same step).

It owns this rank's KV cache (one ``[2, blocks, block_size, kv_heads, head_dim]``
tensor per local layer), flattens the step's tokens (prefills first, then decodes),
builds the attention metadata and returns the logits of each sequence's last token.
"""

from __future__ import annotations

import torch

from shardlm.engine.scheduler import Batch
from shardlm.models.attention import AttentionMetadata, PrefillSeq


class ModelRunner:
    def __init__(self, model, *, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        attn = model.layers[0].attn if len(model.layers) else None
        shape = (2, num_blocks, block_size, attn.num_kv, attn.head_dim) if attn else (0,)
        # torch.empty only reserves address space: pages are touched as tokens arrive
        self.caches = [torch.empty(shape, dtype=dtype, device=device) for _ in model.layers]
        self.zeroed_blocks = 0  # blocks [0, zeroed_blocks) have been zeroed or written

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        if not len(model.layers):
            return 0
        attn = model.layers[0].attn
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * len(model.layers) * block_size * attn.num_kv * attn.head_dim * elem

    def _zero_new_blocks(self, highest: int) -> None:
        """Zero blocks on their first use. Batched decode pads key slots (a block's unused
        tail, and block 0 in padded tables) and masks them, but a masked slot still
        multiplies its value by a zero weight, and 0 * NaN from never-written memory is NaN.
        Blocks are handed out in increasing order first, so a high-water mark suffices."""
        if highest >= self.zeroed_blocks:
            for cache in self.caches:
                cache[:, self.zeroed_blocks:highest + 1].zero_()
            self.zeroed_blocks = highest + 1

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flat token ids, positions, metadata and the row of each sequence's last token."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        bs = self.block_size
        meta = AttentionMetadata(slot_mapping=None, block_size=bs)
        dev = self.device
        if batch.is_prefill:
            for seq in batch.seqs:
                start, total = seq.num_computed, seq.num_tokens
                table = seq.block_table
                meta.prefills.append(PrefillSeq(start=len(ids), length=total - start, context_len=total,
                                                block_table=torch.tensor(table, device=dev)))
                ids.extend(seq.token_ids()[start:])
                positions.extend(range(start, total))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, total))
                last_rows.append(len(ids) - 1)
            meta.num_prefill_tokens = len(ids)
        else:
            max_blocks = max(len(s.block_table) for s in batch.seqs)
            for seq in batch.seqs:
                p = seq.num_tokens - 1
                ids.append(seq.output_ids[-1])  # decode follows a prefill, which sampled a token
                positions.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
                last_rows.append(len(ids) - 1)
            meta.decode_block_tables = torch.tensor(
                [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in batch.seqs], device=dev)
            meta.decode_context_lens = torch.tensor([s.num_tokens for s in batch.seqs], device=dev)
            meta.decode_max_context = max(s.num_tokens for s in batch.seqs)
        self._zero_new_blocks(max(max(s.block_table) for s in batch.seqs))
        meta.slot_mapping = torch.tensor(slots, device=dev)
        return (torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta,
                torch.tensor(last_rows, device=dev))

    @torch.inference_mode()
    def run(self, batch: Batch, hidden: torch.Tensor | None = None, all_positions: bool = False):
        """This stage's part of one step. The first stage starts from token ids, the others
        from the previous stage's ``hidden`` ([2 (hidden, residual), tokens, dim]).

        Returns float32 logits [seqs, vocab] for each sequence's next token on the last
        stage (with ``all_positions``: [tokens, vocab]), else (hidden, residual).
        """
        ids, positions, meta, last_rows = self.prepare(batch)
        out = self.model(ids if hidden is None else hidden, positions, meta, self.caches,
                         None if all_positions else last_rows)
        return out.float() if self.model.last else out
