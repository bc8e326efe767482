"""Training batches from a text file: its tokens cut into windows of seq_len + 1 (each window's
last token is the next window's first), visited in a seeded random order, epoch after epoch."""

from __future__ import annotations

import torch

from shardlm.errors import UsageError


class Batches:
    def __init__(self, ids: list[int], *, seq_len: int, batch_size: int, seed: int = 0, source: str = "the data"):
        if seq_len < 1 or batch_size < 1:
            raise UsageError(f"seq_len={seq_len} and batch_size={batch_size} must be positive")
        n = (len(ids) - 1) // seq_len
        if n < batch_size:
            raise UsageError(
                f"{source} has {len(ids)} tokens: {n} windows of {seq_len} + 1, fewer than one batch of "
                f"{batch_size}; use a smaller --batch-size or --seq-len, or more text"
            )
        ids_t = torch.tensor(ids[: n * seq_len + 1])
        self.windows = torch.stack([ids_t[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])  # [n, seq_len+1]
        self.batch_size, self.seed = batch_size, seed
        self.per_epoch = n // batch_size  # a partial last batch is dropped

    def __call__(self, step: int) -> torch.Tensor:
        """The global batch of ``step`` (from 0): [batch_size, seq_len + 1] token ids."""
        epoch, i = divmod(step, self.per_epoch)
        order = torch.randperm(len(self.windows), generator=torch.Generator().manual_seed(self.seed + epoch))
        return self.windows[order[i * self.batch_size : (i + 1) * self.batch_size]]

    def in_order(self) -> list[torch.Tensor]:
        """Every whole batch of windows in the text's order (held-out evaluation: the same each time)."""
        b = self.batch_size
        return [self.windows[i * b : (i + 1) * b] for i in range(self.per_epoch)]
