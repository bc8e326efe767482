"""Context parallelism (training): every sequence split over the cp ranks, attention over all of it.

Zig-zag sharding: a sequence is cut into 2 * cp equal chunks and cp rank r holds chunks r and
2cp - 1 - r, so under a causal mask every rank has the same amount of attention work (a rank
holding only the last chunk would do most of it). Everything but attention is per token and
runs on the local tokens as it is. Attention all-gathers each layer's keys and values over the
cp group and attends the local queries to them with a causal mask in global positions: the
all-gather form of context parallelism that Llama 3 trains with (Dubey et al. 2024, "The Llama 3
Herd of Models", https://arxiv.org/abs/2407.21783 §3.3.2), whose backward is a reduce-scatter of
the key and value gradients. Ring attention (Liu et al. 2023, https://arxiv.org/abs/2310.01889),
which passes key/value blocks around the ring overlapped with compute, is not built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from shardlm.parallel.comm import all_gather_region, group_rank, group_size
from shardlm.parallel.dims import LayoutError


def zigzag_positions(seq_len: int, cp: int, rank: int) -> Tensor:
    """Positions of a sequence that cp rank ``rank`` holds: chunks rank and 2cp-1-rank of 2cp."""
    if seq_len % (2 * cp):
        raise LayoutError(f"seq_len={seq_len} does not split into 2 x cp = {2 * cp} equal chunks (zig-zag context "
                          f"parallelism); use a multiple of {2 * cp}, e.g. {seq_len // (2 * cp) * 2 * cp or 2 * cp}")
    c = seq_len // (2 * cp)
    mirror = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(mirror * c, (mirror + 1) * c)])


@dataclass
class ContextBatch:
    """A training step's attention layout under cp: ``batch`` sequences of ``seq_len`` tokens, each
    holding ``positions`` on this rank (its tokens are laid out sequence by sequence)."""

    group: object
    batch: int
    positions: Tensor  # [local tokens of one sequence]
    key_positions: Tensor  # [seq_len]: positions of the all-gathered keys, rank by rank

    @classmethod
    def build(cls, group, batch: int, seq_len: int) -> ContextBatch:
        cp, rank = group_size(group), group_rank(group)
        keys = torch.cat([zigzag_positions(seq_len, cp, r) for r in range(cp)])
        return cls(group, batch, zigzag_positions(seq_len, cp, rank), keys)


def context_attention(q: Tensor, k: Tensor, v: Tensor, meta: ContextBatch, heads, scale: float,
                      window: int | None) -> Tensor:
    """q: [tokens, q_heads, d]; k, v: [tokens, kv_heads, d] of this rank's tokens. Returns
    [tokens, q_heads, d]: each local query attends to every earlier key of its sequence."""
    b, n, d = meta.batch, len(meta.positions), q.shape[-1]
    kv = torch.stack([k, v]).view(2, b, n, k.shape[1], d)
    kv = all_gather_region(kv, meta.group, dim=2)  # [2, b, seq_len, kv_heads, d], rank by rank
    qs = heads.group_q(q).view(b, n, -1, d).transpose(1, 2)  # [b, kv * group, n, d]
    ks, vs = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [b, kv_heads, seq_len, d]
    q_pos, k_pos = meta.positions.to(q.device), meta.key_positions.to(q.device)
    mask = k_pos[None, :] <= q_pos[:, None]  # [n, seq_len]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=heads.group > 1)
    return heads.ungroup(o.transpose(1, 2).reshape(b * n, -1, d))  # [tokens, q_heads, d]
