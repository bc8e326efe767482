"""A trained model back in the checkpoint's own names: the pieces of HF tensors a rank holds.

Each parallel layer knows which rows or columns of which checkpoint tensor it holds (the same
``sources`` it loads from), so the pieces of all tp ranks put together are the HF tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardlm.models.transformer import RMSNorm
from shardlm.parallel.tensor import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding


@dataclass
class Piece:
    """``tensor`` is ``name``[rows, cols] of the checkpoint (None: the whole dim)."""

    name: str
    rows: slice | None
    cols: slice | None
    tensor: torch.Tensor


def pieces(model: nn.Module) -> list[Piece]:
    """This rank's parameters as pieces of checkpoint tensors (copies, detached)."""
    out = []
    for m in model.modules():
        if isinstance(m, ColumnParallelLinear):
            start = 0
            for (name, rows), n in zip(m.sources, m.out_sizes):
                out.append(Piece(f"{name}.weight", rows, None, m.weight[start:start + n]))
                if m.bias is not None:
                    out.append(Piece(f"{name}.bias", rows, None, m.bias[start:start + n]))
                start += n
        elif isinstance(m, RowParallelLinear):
            out.append(Piece(f"{m.source}.weight", None, m.cols, m.weight))
            if m.bias is not None:
                out.append(Piece(f"{m.source}.bias", None, None, m.bias))
        elif isinstance(m, (VocabParallelEmbedding, ParallelLMHead)) and m.source is not None:
            out.append(Piece(f"{m.source}.weight", m.rows, None, m.weight))
        elif isinstance(m, RMSNorm):
            out.append(Piece(f"{m.source}.weight", None, None, m.weight))
    for p in out:
        p.tensor = p.tensor.detach().clone()
    return out
