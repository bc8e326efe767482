"""Context parallelism (training): every sequence split over the cp ranks, attention over all of it.

Zig-zag sharding: a sequence is cut into 2 * cp equal chunks and cp rank r holds chunks r and
2cp - 1 - r, so under a causal mask every rank has the same amount of attention work (a rank
holding only the last chunk would do most of it). Everything but attention is per token and
runs on the local tokens as it is. Attention over the whole sequence comes in two forms:

- "all-gather": each layer all-gathers the keys and values over the cp group and attends the
  local queries to them with a causal mask in global positions, as Llama 3 trains (Dubey et al.
  2024, https://arxiv.org/abs/2407.21783 §3.3.2); backward reduce-scatters the key and value
  gradients. Simple and fast when keys and values are small (GQA), but every rank holds, and
  saves for backward, the whole sequence's keys and values.
- "ring": ring attention (Liu et al. 2023, https://arxiv.org/abs/2310.01889). The key/value
  blocks travel around the ring, one hop a step, the next hop in flight while the current block
  is attended; partial results merge by their log-sum-exp (online softmax, as flash attention
  merges tiles). A rank only ever holds two blocks and saves only its own for backward, which
  passes the blocks around again with their key/value gradients travelling alongside, so the
  gradient of every block arrives back at its owner.
- "ulysses": DeepSpeed-Ulysses (Jacobs et al. 2023, https://arxiv.org/abs/2309.14509): an
  all-to-all turns the sequence-sharded q, k, v into head-sharded whole-sequence ones, each rank
  attends its heads over the whole sequence, and a second all-to-all turns the output back
  (backward: the reverse all-to-alls). A rank moves 1/cp of q, k, v and the output each way, so
  the bytes per rank do not grow with cp, but cp may not exceed the KV heads (a KV head whose
  query group splits over r ranks is copied to each; its key/value gradients sum back).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from shardlm.parallel.comm import all_gather_region, all_to_all_region, group_rank, group_size, shift
from shardlm.parallel.dims import LayoutError
from shardlm.parallel.tensor import partition_heads


def zigzag_positions(seq_len: int, cp: int, rank: int) -> Tensor:
    """Positions of a sequence that cp rank ``rank`` holds: chunks rank and 2cp-1-rank of 2cp."""
    if seq_len % (2 * cp):
        raise LayoutError(
            f"seq_len={seq_len} does not split into 2 x cp = {2 * cp} equal chunks (zig-zag context "
            f"parallelism); use a multiple of {2 * cp}, e.g. {seq_len // (2 * cp) * 2 * cp or 2 * cp}"
        )
    c = seq_len // (2 * cp)
    mirror = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(mirror * c, (mirror + 1) * c)])


ALGORITHMS = ("all-gather", "ring", "ulysses")


def ulysses_copies(num_kv: int, group: int, cp: int) -> int:
    """Ulysses over ``cp`` ranks with ``num_kv`` KV heads of ``group`` query heads each (one tp
    rank's): how many ranks each KV head's query group is split over (its keys and values copied
    to each); raises when the heads do not split over cp."""
    if num_kv % cp == 0:
        return 1
    r = cp // num_kv
    if cp % num_kv == 0 and group % r == 0:
        return r
    ok = sorted(
        {c for c in range(1, num_kv * group + 1) if num_kv % c == 0 or (c % num_kv == 0 and group % (c // num_kv) == 0)}
    )
    raise LayoutError(
        f"cp={cp}: Ulysses splits attention heads over the cp ranks, and {num_kv} KV heads of {group} query "
        f"heads each (per tp rank) do not split {cp} ways; use cp in {ok}, or another cp attention"
    )


def check_ulysses(num_heads: int, num_kv_heads: int, tp: int, cp: int) -> None:
    """Raise unless Ulysses splits every tp rank's heads over ``cp`` (``ulysses_copies``); a rank's
    query heads are laid out per KV head and padded to the largest group, as ``GroupedHeads`` does."""
    for r in range(tp):
        kv_of_q = partition_heads(num_heads, num_kv_heads, tp, r).local_kv_of_q()
        ulysses_copies(max(kv_of_q) + 1, max(kv_of_q.count(j) for j in set(kv_of_q)), cp)


def ulysses_units(q: Tensor, k: Tensor, v: Tensor, heads, cp: int) -> Tensor:
    """A rank's q [tokens, q_heads, d] and k, v [tokens, kv_heads, d] as Ulysses' units:
    [tokens, units, per + 2, d], a unit being one KV head (or a copy of it) with its share ``per``
    of the query group, then its key and value; ``units`` splits evenly over ``cp``."""
    t, d = q.shape[0], q.shape[-1]
    r = ulysses_copies(heads.num_kv, heads.per_kv, cp)
    units, per = heads.num_kv * r, heads.per_kv // r
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)  # [tokens, units, d]
    return torch.cat([heads.group_q(q).view(t, units, per, d), k[:, :, None], v[:, :, None]], dim=2)


def causal_attention(x: Tensor, scale: float, window: int | None) -> Tensor:
    """Attention of Ulysses' units x [..., units, per + 2, seq, d] over whole sequences in position
    order: [..., units * per, seq, d]; causal (fused, no mask) or within a sliding window (a mask)."""
    per, n = x.shape[-3] - 2, x.shape[-2]
    mask = None
    if window is not None:
        pos = torch.arange(n, device=x.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    return F.scaled_dot_product_attention(
        x[..., :per, :, :].flatten(-4, -3),
        x[..., per, :, :],
        x[..., per + 1, :, :],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=per > 1,
    )


@dataclass
class ContextBatch:
    """A training step's attention layout under cp: ``batch`` sequences of ``seq_len`` tokens, each
    holding ``positions`` on this rank (its tokens are laid out sequence by sequence)."""

    group: dist.ProcessGroup | None  # the cp group
    batch: int
    positions: Tensor  # [local tokens of one sequence]
    key_positions: Tensor  # [seq_len]: positions of the all-gathered keys, rank by rank
    algorithm: str = "all-gather"  # or "ring"
    tiles: dict = field(default_factory=dict, repr=False)  # ring attention's work list per block

    @classmethod
    def build(cls, group, batch: int, seq_len: int, algorithm: str = "all-gather", device="cpu") -> ContextBatch:
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"cp attention {algorithm!r} is not one of {ALGORITHMS}; 'ring' passes key/value "
                "blocks around the ring (less memory), 'all-gather' gathers them at once, 'ulysses' "
                "moves heads instead of keys"
            )
        cp, rank = group_size(group), group_rank(group)
        keys = torch.cat([zigzag_positions(seq_len, cp, r) for r in range(cp)]).to(device)
        return cls(group, batch, zigzag_positions(seq_len, cp, rank).to(device), keys, algorithm)


def context_attention(
    q: Tensor, k: Tensor, v: Tensor, meta: ContextBatch, heads, scale: float, window: int | None
) -> Tensor:
    """q: [tokens, q_heads, d]; k, v: [tokens, kv_heads, d] of this rank's tokens. Returns
    [tokens, q_heads, d]: each local query attends to every earlier key of its sequence."""
    b, n, d = meta.batch, len(meta.positions), q.shape[-1]
    if meta.algorithm == "ulysses":
        return _ulysses(q, k, v, meta, heads, scale, window)
    if meta.algorithm == "ring":
        qs = heads.group_q(q).view(b, n, heads.num_kv, heads.per_kv, d).permute(0, 2, 3, 1, 4)  # [b, kv, g, n, d]
        ks, vs = (t.view(b, n, -1, d).transpose(1, 2) for t in (k, v))  # [b, kv, n, d]
        o = _RingAttention.apply(qs, ks, vs, meta, scale, window)  # [b, kv, g, n, d]
        return heads.ungroup(o.permute(0, 3, 1, 2, 4).reshape(b * n, -1, d))
    kv = torch.stack([k, v]).view(2, b, n, k.shape[1], d)
    kv = all_gather_region(kv, meta.group, dim=2)  # [2, b, seq_len, kv_heads, d], rank by rank
    qs = heads.group_q(q).view(b, n, -1, d).transpose(1, 2)  # [b, kv * group, n, d]
    ks, vs = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [b, kv_heads, seq_len, d]
    q_pos, k_pos = meta.positions.to(q.device), meta.key_positions.to(q.device)
    mask = k_pos[None, :] <= q_pos[:, None]  # [n, seq_len]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=heads.per_kv > 1)
    return heads.ungroup(o.transpose(1, 2).reshape(b * n, -1, d))  # [tokens, q_heads, d]


def _ulysses(q: Tensor, k: Tensor, v: Tensor, meta: ContextBatch, heads, scale: float, window: int | None) -> Tensor:
    """Ulysses: heads over cp for attention, tokens over cp elsewhere (two all-to-alls each way)."""
    cp, t, d = group_size(meta.group), q.shape[0], q.shape[-1]
    x = ulysses_units(q, k, v, heads, cp).transpose(0, 1)  # [units, tokens, per + 2, d]
    units, per = x.shape[0], x.shape[2] - 2
    mine, b, n = units // cp, meta.batch, t // meta.batch
    x = all_to_all_region(x.contiguous(), meta.group, [mine] * cp, [mine] * cp)  # [cp * mine, ...]
    # [cp (source rank), mine, b, n, per + 2, d] -> [b, mine, per + 2, cp * n, d]: whole sequences, keys rank by rank
    x = x.view(cp, mine, b, n, per + 2, d).permute(2, 1, 4, 0, 3, 5).reshape(b, mine, per + 2, cp * n, d)
    # the sequence in position order (it arrives rank by rank, zig-zag): plain causal attention,
    # no mask kept for backward unless a window needs one
    order = torch.argsort(meta.key_positions).to(q.device)
    o = causal_attention(x.index_select(3, order), scale, window)  # [b, mine * per, cp * n, d]
    o = o.index_select(2, torch.argsort(order))  # back to rank by rank
    o = o.view(b, mine, per, cp, n, d).permute(3, 1, 0, 4, 2, 5).reshape(cp * mine, t, per, d)
    o = all_to_all_region(o.contiguous(), meta.group, [mine] * cp, [mine] * cp)  # [units, tokens, per, d]
    return heads.ungroup(o.transpose(0, 1).reshape(t, units * per, d))  # [tokens, q_heads, d]


TILE, KEY_TILE = 256, 1024
"""Ring attention works on tiles of at most TILE queries x KEY_TILE keys: a tile's scores are
[TILE, KEY_TILE] per head, so memory stays bounded however long the sequence (flash attention's
tiling, in plain torch)."""


def _tiles(meta: ContextBatch, src: int, window: int | None) -> list[tuple[slice, slice, bool]]:
    """The work of this rank's queries on the keys of cp rank ``src``: (query rows, keys, whether
    some of those keys are hidden from some of those rows). A rank's positions increase along
    its tokens, so each query sees one contiguous run of keys, found by binary search; tiles no
    query sees are left out (under zig-zag, half of every block off the diagonal and the upper
    triangle of the diagonal one). Cached on ``meta``: every layer, forward and backward, asks."""
    key = (src, window)
    if key in meta.tiles:
        return meta.tiles[key]
    q_pos = meta.positions
    k_pos = meta.key_positions.view(group_size(meta.group), -1)[src]
    hi = torch.searchsorted(k_pos, q_pos, right=True).tolist()  # row i sees keys [lo[i], hi[i])
    lo = [0] * len(q_pos) if window is None else torch.searchsorted(k_pos, q_pos - window, right=True).tolist()
    tiles = []
    for a in range(0, len(q_pos), TILE):
        z = min(a + TILE, len(q_pos))  # rows [a, z); the key ranges move right with the row
        for c in range(lo[a], hi[z - 1], KEY_TILE):
            e = min(c + KEY_TILE, hi[z - 1])
            first, last = bisect_right(hi, c, a, z), bisect_left(lo, e, a, z)  # rows that see [c, e)
            if first < last:
                tiles.append((slice(first, last), slice(c, e), not (lo[last - 1] <= c and hi[first] >= e)))
    meta.tiles[key] = tiles
    return tiles


def _mask(meta: ContextBatch, src: int, rows: slice, cols: slice, window: int | None) -> Tensor:
    """[rows, cols] bool: which of these keys of cp rank ``src`` each of these queries sees."""
    q_pos = meta.positions[rows, None]
    k_pos = meta.key_positions.view(group_size(meta.group), -1)[src, cols][None, :]
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)


def ring_blocks(x: Tensor, group, shapes: Sequence[Sequence[int]] | None = None) -> Iterator[tuple[int, Tensor]]:
    """Ring attention's pass of the cp ranks' blocks (Liu et al. 2023): yields (source rank, its
    block) cp times, this rank's own ``x`` first, then rank - 1's, rank - 2's, ... Each hop every
    rank sends the block it holds to rank + 1 and receives rank - 1's; the next block is already
    in flight while the caller works on the current one (its work between two yields overlaps one
    hop). ``shapes[r]``: rank r's block shape, where the blocks differ (striped inference prompts)."""
    cp, rank = group_size(group), group_rank(group)
    for step in range(cp):
        src = (rank - step) % cp
        if step < cp - 1:  # the next block travels while this one is worked on
            nxt, works = shift(x, group, tag=0, recv_shape=None if shapes is None else shapes[(src - 1) % cp])
        yield src, x
        if step < cp - 1:
            for w in works:
                w.wait()
            x = nxt


def masked_scores(q: Tensor, k: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    """float32 scores of q [b, kv, g, n, d] against k [b, kv, m, d]: [b, kv, g, n, m]; masked -inf.
    16-bit inputs are widened first, so the scores are not rounded before the softmax (as SDPA)."""
    s = (q.float() @ k.float().unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask.to(s.device), float("-inf"))


class _RingAttention(torch.autograd.Function):
    """Attention of this rank's queries to the whole sequence, the key/value blocks passed around
    the cp ring. Forward keeps a running max ``m``, sum ``l`` and unnormalised output per query,
    rescaled as each block arrives; backward recomputes each block's probabilities from the saved
    log-sum-exp."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, meta: ContextBatch, scale: float, window: int | None):
        acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        m = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        l = torch.zeros(q.shape[:-1], device=q.device)  # noqa: E741 (the paper's m and l)
        for src, kv in ring_blocks(torch.stack([k, v]), meta.group):
            for rows, cols, masked in _tiles(meta, src, window):
                mask = _mask(meta, src, rows, cols, window) if masked else None
                s = masked_scores(q[..., rows, :], kv[0][..., cols, :], scale, mask)
                m_new = torch.maximum(m[..., rows], s.amax(-1))
                m_new = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row that has seen no key yet
                p = torch.exp(s - m_new[..., None])  # masked keys: exp(-inf) = 0
                alpha = torch.exp(m[..., rows] - m_new)
                l[..., rows] = l[..., rows] * alpha + p.sum(-1)
                pv = p.to(v.dtype) @ kv[1][..., cols, :].unsqueeze(2)
                acc[..., rows, :] = acc[..., rows, :] * alpha[..., None] + pv
                m[..., rows] = m_new
        # every query sees at least its own key, so l > 0
        out = (acc / l[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, m + torch.log(l))
        ctx.meta, ctx.scale, ctx.window = meta, scale, window
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        meta, scale = ctx.meta, ctx.scale
        cp = group_size(meta.group)
        grad = grad.contiguous()
        delta = (grad.float() * out.float()).sum(-1)  # [b, kv, g, n]: rowsum(dO * O)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        arriving: tuple[Tensor, list] | None = None  # (the block's gradient so far, its receive handles)
        for src, kv in ring_blocks(torch.stack([k, v]), meta.group):
            dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
            for rows, cols, masked in _tiles(meta, src, ctx.window):
                mask = _mask(meta, src, rows, cols, ctx.window) if masked else None
                kb, vb = kv[0][..., cols, :], kv[1][..., cols, :]
                qr, gr = q[..., rows, :], grad[..., rows, :]
                p = torch.exp(masked_scores(qr, kb, scale, mask) - lse[..., rows, None])  # [b, kv, g, n, m]
                dkv[1][..., cols, :] += (p.to(v.dtype).transpose(-1, -2) @ gr).float().sum(2)
                dp = gr.float() @ vb.float().unsqueeze(2).transpose(-1, -2)
                ds = p * (dp - delta[..., rows, None]) * scale
                dq[..., rows, :] += ds.to(q.dtype) @ kb.unsqueeze(2)
                dkv[0][..., cols, :] += (ds.to(q.dtype).transpose(-1, -2) @ qr).float().sum(2)
            if arriving is not None:  # the block's gradient from the ranks it visited before
                for w in arriving[1]:
                    w.wait()
                dkv += arriving[0]
            # on to the rank that attends this block next (one rank: it is home already)
            arriving = shift(dkv, meta.group, tag=1) if cp > 1 else (dkv, [])
        assert arriving is not None  # cp >= 1 steps ran
        for w in arriving[1]:
            w.wait()
        dkv = arriving[0]  # after cp hops: every rank's gradient of this rank's own block
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None
