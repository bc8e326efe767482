"""Attention over a paged KV cache (Kwon et al. 2023, PagedAttention, https://arxiv.org/abs/2309.06180).

The cache of one layer is ``[2, num_blocks, block_size, kv_heads, head_dim]`` (keys,
values). A step's tokens are flattened, prefill sequences first, then decode
sequences (one token each). Each token's K/V goes to the slot its sequence's block
table names; attention then reads the sequence's blocks back.

GQA with uneven tensor parallelism: a rank's query heads may not split evenly over
its KV heads (9 heads, 3 KV heads, tp=2 gives a rank 5 query heads over 2 KV heads).
Query heads are therefore laid out per KV head and padded to the largest group
(``GroupedHeads``), so every KV head is read once and never copied per query head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.parallel.context_paged import ContextShards, local_key_positions, partial_attention

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
INT8_SCALED = torch.uint8
"""A KV cache of this dtype holds int8 values and one float32 scale (absmax / 127) per token and
head, packed as bytes: each row is head_dim + 4 bytes."""
INT4_GROUPED = torch.int8
"""A KV cache of this dtype holds 4-bit values, two a byte, with a float16 scale and minimum per
group of ``INT4_GROUP`` elements of a token's head (asymmetric: 16 levels between the group's
minimum and maximum; KIVI's group quantization, Liu et al. 2024, https://arxiv.org/abs/2402.02750,
without its per-channel keys): each row is head_dim / 2 + 4 * head_dim / group bytes (40 for
head_dim 64: 3.2x fewer than bfloat16). Errors measured: tests/distributed/test_kv_cache_dtype.py."""
INT4_GROUP = 32


def _int4_group(head_dim: int) -> int:
    return min(INT4_GROUP, head_dim)


@dataclass
class PrefillSeq:
    """A sequence whose new tokens are [start, start+length) of the step and whose
    context after this step is ``context_len`` tokens (cached prefix + new)."""

    start: int
    length: int
    context_len: int
    block_table: torch.Tensor | None  # [blocks] long (None: no cache, training)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor | None  # [tokens] long: cache slot of each new token (None: no cache, training)
    block_size: int
    prefills: list[PrefillSeq] = field(default_factory=list)
    num_prefill_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [decodes, max_blocks] long
    decode_context_lens: torch.Tensor | None = None  # [decodes] long
    decode_max_context: int = 0
    decode_padded: bool = False
    """Decode tables, ``decode_max_context`` and the batch are padded past what the sequences use
    (a CUDA graph's fixed shapes, ``engine/cuda_graphs.py``): every key slot beyond a context is masked."""
    cpu_ops: bool = False
    """Write the cache and attend decode rows with the C++ ops (``native_cache``): the runner sets it
    for a model with int4 weights on the CPU, which loads them (``parallel/int4_cpu.cpp``)."""
    context: ContextShards | None = None
    """Context parallelism (``parallel/context_paged.py``): this rank holds only its stripe of the
    step's tokens (``slot_mapping`` places them), and ``prefills`` lists every sequence of the step,
    decodes too, by its rows among all the step's tokens."""


def causal_metadata(lengths: list[int]) -> AttentionMetadata:
    """A step of whole sequences packed back to back with no KV cache (a training batch):
    each attends causally to itself only."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return AttentionMetadata(
        slot_mapping=None,
        block_size=0,
        num_prefill_tokens=sum(lengths),
        prefills=[PrefillSeq(s, n, n, None) for s, n in zip(starts, lengths)],
    )


class GroupedHeads(nn.Module):
    """Reorders local query heads into [kv_heads, per_kv] with padding, and back. A module, so that
    its index tensors move with the layer that holds it (``engine/offload.py`` builds on the CPU)."""

    to_grouped: torch.Tensor
    from_grouped: torch.Tensor

    def __init__(self, local_kv_of_q: list[int]):
        super().__init__()
        num_q = len(local_kv_of_q)
        num_kv = max(local_kv_of_q) + 1
        groups = [[q for q in range(num_q) if local_kv_of_q[q] == j] for j in range(num_kv)]
        self.num_kv = num_kv
        self.per_kv = max(len(g) for g in groups)
        self.uniform = all(len(g) == self.per_kv for g in groups)
        # index num_q points at an all-zero padding head
        padded = [g + [num_q] * (self.per_kv - len(g)) for g in groups]
        self.register_buffer("to_grouped", torch.tensor([q for g in padded for q in g]), persistent=False)
        from_grouped = [j * self.per_kv + g.index(q) for q in range(num_q) for j, g in enumerate(groups) if q in g]
        self.register_buffer("from_grouped", torch.tensor(from_grouped), persistent=False)

    def group_q(self, q: torch.Tensor) -> torch.Tensor:
        """[..., num_q, d] -> [..., num_kv * group, d]."""
        if self.uniform:
            return q
        pad = q.new_zeros(*q.shape[:-2], 1, q.shape[-1])
        return torch.cat([q, pad], dim=-2).index_select(-2, self.to_grouped.to(q.device))

    def ungroup(self, o: torch.Tensor) -> torch.Tensor:
        """[..., num_kv * group, d] -> [..., num_q, d]."""
        return o if self.uniform else o.index_select(-2, self.from_grouped.to(o.device))


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store the new tokens' keys/values ([tokens, kv_heads, d]) at their slots.

    Called as ``torch.ops.shardlm.write_kv``, an op torch.compile cannot see into: traced,
    the in-place write into a view of the cache becomes a functional update that copies
    the whole cache every step. (``torch.library.Library`` rather than ``custom_op``,
    whose Python wrapper adds tens of microseconds to every call.)"""
    h, row = cache.shape[-2:]
    raw = raw_bytes(cache)
    raw[0].view(-1, h, row).index_copy_(0, slots, encode_kv(k, cache.dtype))
    raw[1].view(-1, h, row).index_copy_(0, slots, encode_kv(v, cache.dtype))


_LIB = torch.library.Library("shardlm", "FRAGMENT")
_LIB.define("write_kv(Tensor(a!) cache, Tensor k, Tensor v, Tensor slots) -> ()")
_LIB.impl("write_kv", write_kv, "CompositeExplicitAutograd")
torch.library.register_fake("shardlm::write_kv")(lambda cache, k, v, slots: None)


def native_cache(cache: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether the step takes the C++ ops (``meta.cpu_ops``) and they take this cache: a [2, blocks,
    block_size, kv_heads, d] cache in the keys' own dtype. They do what ``write_kv`` and
    ``decode_attention`` do, without a Python op's call overhead (docs/performance.md)."""
    return meta.cpu_ops and cache.dtype == x.dtype and cache.shape[0] == 2


def store_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """``write_kv`` at the step's slots, through the C++ op where it takes the cache."""
    assert meta.slot_mapping is not None  # a step with a cache places its tokens
    if native_cache(cache, k, meta):
        torch.ops.shardlm_int4.write_kv(cache, k, v, meta.slot_mapping)
    else:
        torch.ops.shardlm.write_kv(cache, k, v, meta.slot_mapping)


def kv_row(head_dim: int, dtype: torch.dtype) -> int:
    """Elements a KV cache of ``dtype`` stores per token and head."""
    if dtype == INT4_GROUPED:
        return head_dim // 2 + 4 * (head_dim // _int4_group(head_dim))
    return head_dim + 4 if dtype == INT8_SCALED else head_dim


def raw_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as its bytes (torch has no fp8 index_copy / index_select on CPU); others as they are."""
    return cache.view(torch.uint8) if cache.dtype in FP8 else cache


def encode_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values [tokens, heads, d] as a cache of ``dtype`` stores them (see ``raw_bytes``)."""
    if dtype in FP8:
        return x.to(dtype).view(torch.uint8)
    if dtype == INT8_SCALED:
        scale = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-30) / 127  # [tokens, heads, 1]
        q = (x.float() / scale).round_().to(torch.int8).view(torch.uint8)
        return torch.cat([q, scale.view(torch.uint8)], dim=-1)
    if dtype == INT4_GROUPED:
        *lead, d = x.shape
        g = _int4_group(d)
        groups = x.float().view(*lead, d // g, g)
        low = groups.amin(-1, keepdim=True).half()  # [tokens, heads, d/g, 1]
        scale = ((groups.amax(-1, keepdim=True) - low.float()) / 15).clamp_min(1e-4).half()
        q = ((groups - low.float()) / scale.float()).round_().clamp_(0, 15).to(torch.uint8).view(*lead, d)
        packed = q[..., 0::2] | (q[..., 1::2] << 4)  # [tokens, heads, d/2]: element 2i low, 2i+1 high
        params = torch.cat([scale, low], dim=-1).view(*lead, 2 * (d // g))  # float16 pairs
        return torch.cat([packed, params.view(torch.uint8)], dim=-1).view(torch.int8)
    return x.to(dtype)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype, d: int) -> torch.Tensor:
    """cache[:, blocks] as keys and values of ``dtype`` (a quantized cache is widened after the gather)."""
    got = raw_bytes(cache).index_select(1, blocks)
    if cache.dtype in FP8:
        return got.view(cache.dtype).to(dtype)
    if cache.dtype == INT8_SCALED:
        scale = got[..., d:].contiguous().view(torch.float32)  # [..., 1]
        return (got[..., :d].view(torch.int8).float() * scale).to(dtype)
    if cache.dtype == INT4_GROUPED:
        got = got.view(torch.uint8)
        g = _int4_group(d)
        packed = got[..., : d // 2]
        params = got[..., d // 2 :].contiguous().view(torch.float16).float().unflatten(-1, (d // g, 2))
        q = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).float()  # [..., d]: 0..15
        return (q.unflatten(-1, (d // g, g)) * params[..., :1] + params[..., 1:]).flatten(-2).to(dtype)
    return got


def _read_kv(
    cache: torch.Tensor, table: torch.Tensor, length: int, dtype: torch.dtype, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the first ``length`` positions of one sequence: [kv_heads, length, d] each."""
    bs, h = cache.shape[2:4]
    blocks = table[: (length + bs - 1) // bs]
    kv = gather_blocks(cache, blocks, dtype, d).view(2, -1, h, d)[:, :length]  # [2, length, kv_heads, d]
    return kv[0].transpose(0, 1), kv[1].transpose(0, 1)


def _window_mask(q_pos: torch.Tensor, k_len: int, window: int | None) -> torch.Tensor:
    """Boolean [queries, keys]: key j visible to the query at position p iff p - window < j <= p."""
    k_pos = torch.arange(k_len, device=q_pos.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    heads: GroupedHeads,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [tokens, q_heads, d]; k, v: [tokens, kv_heads, d]. Writes k and v to their cache
    slots, then attends. Returns [tokens, q_heads, d]. With no ``cache`` (training, see
    ``causal_metadata``) every sequence attends causally to its own fresh keys.
    """
    if meta.context is not None:
        return _striped(q, k, v, cache, meta, heads, scale, window)
    gqa = heads.per_kv > 1
    if cache is None and window is None and _same_length(meta.prefills):  # a training batch: one call
        b, n, d = len(meta.prefills), meta.prefills[0].length, q.shape[-1]
        qs = heads.group_q(q).view(b, n, -1, d).transpose(1, 2)  # [b, kv * group, n, d]
        ks, vs = k.view(b, n, -1, d).transpose(1, 2), v.view(b, n, -1, d).transpose(1, 2)  # [b, kv, n, d]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        return heads.ungroup(o.transpose(1, 2).reshape(b * n, -1, d))
    if cache is not None:
        store_kv(cache, k, v, meta)
    outputs = []
    for s in meta.prefills:
        qs = heads.group_q(q[s.start : s.start + s.length]).transpose(0, 1)  # [kv*group, L, d]
        if s.context_len == s.length:  # nothing cached before: attend to the fresh keys
            ks = k[s.start : s.start + s.length].transpose(0, 1)  # [kv, L, d]
            vs = v[s.start : s.start + s.length].transpose(0, 1)
        else:
            assert s.block_table is not None  # a cached prefix lives in blocks
            ks, vs = _read_kv(cache, s.block_table, s.context_len, q.dtype, q.shape[-1])  # [kv, S, d]
        if window is None and s.context_len == s.length:
            o = F.scaled_dot_product_attention(
                qs[None], ks[None], vs[None], is_causal=True, scale=scale, enable_gqa=gqa
            )[0]
        else:
            q_pos = torch.arange(s.context_len - s.length, s.context_len, device=q.device)
            mask = _window_mask(q_pos, s.context_len, window)
            o = F.scaled_dot_product_attention(
                qs[None], ks[None], vs[None], attn_mask=mask, scale=scale, enable_gqa=gqa
            )[0]
        outputs.append(heads.ungroup(o.transpose(0, 1)))  # [L, q_heads, d]
    if meta.decode_block_tables is not None:
        outputs.append(_decode(q[meta.num_prefill_tokens :], cache, meta, heads, scale, window))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _striped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    heads: GroupedHeads,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """cp inference: this rank's new keys go to its cache; every query of the step attends to the
    keys this rank holds (its runs of each sequence's group blocks); the partial outputs merge at
    the queries' owners. A fresh prompt (nothing cached before it) is attended by Ulysses (heads
    over the cp ranks) or ring attention (its keys and values around the cp ranks) instead where
    ``ContextShards.prefill`` says so. Returns this rank's tokens' outputs [own tokens, q_heads, d]."""
    shards = meta.context
    assert shards is not None
    store_kv(cache, k, v, meta)
    width, d = heads.num_kv * heads.per_kv, q.shape[-1]
    whole = shards.prefill != "pass-q"  # fresh prompts by Ulysses or the ring
    fresh = [s for s in meta.prefills if whole and s.context_len == s.length]
    cached = [s for s in meta.prefills if not (whole and s.context_len == s.length)]
    mine = torch.zeros((q.shape[0], width, d), dtype=torch.float32, device=q.device)
    if cached:  # pass-Q: every step query to the keys held here (the fresh ones' rows are redone below)
        everyone = shards.gather_queries(q)  # [step tokens, q_heads, d]
        n, bs, cp = everyone.shape[0], meta.block_size, len(shards.counts)
        out = torch.zeros((n, width, d), dtype=torch.float32, device=q.device)
        lse = torch.full((n, width), float("-inf"), device=q.device)
        for s in cached:
            assert s.block_table is not None
            blocks = -(-s.context_len // (bs * cp))  # group blocks; this rank holds one run of each
            ks, vs = _read_kv(cache, s.block_table, blocks * bs, q.dtype, d)  # [kv, blocks * bs, d]
            k_pos = local_key_positions(blocks, bs, cp, shards.rank, q.device)
            q_pos = torch.arange(s.context_len - s.length, s.context_len, device=q.device)
            rows = slice(s.start, s.start + s.length)
            qs = heads.group_q(everyone[rows]).view(s.length, heads.num_kv, heads.per_kv, d).permute(1, 2, 0, 3)
            o, o_lse = partial_attention(qs, ks, vs, q_pos, k_pos, scale, window)  # [kv, group, L, d], [kv, group, L]
            out[rows] = o.permute(2, 0, 1, 3).reshape(s.length, -1, d)
            lse[rows] = o_lse.permute(2, 0, 1).reshape(s.length, -1)
        mine = shards.return_outputs(out, lse)  # [own tokens, kv * group, d]
    if fresh:  # each prompt whole from its fresh keys (no cache to read): Ulysses or the ring
        attend = shards.ulysses_prefill if shards.prefill == "ulysses" else shards.ring_prefill
        covered, o = attend(q, k, v, [(s.start, s.length) for s in fresh], heads, scale, window)
        mine[covered] = o.float()
    return heads.ungroup(mine).to(q.dtype)


def _same_length(prefills: list[PrefillSeq]) -> bool:
    """Whole sequences of one length laid back to back (as ``causal_metadata`` makes them)."""
    n = prefills[0].length if prefills else 0
    return bool(prefills) and all(s.start == i * n and s.length == n == s.context_len for i, s in enumerate(prefills))


def decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    max_context: int,
    scale: float,
    window: int | None,
    padded: bool = False,
) -> torch.Tensor:
    """One new token per sequence: q [B, kv, group, d] (a KV head's query group folded into the
    query axis, so its keys are read once, never repeated) against the sequences' cached keys.
    Returns [B, kv, group, d].

    Called as ``torch.ops.shardlm.decode_attention``, opaque to torch.compile as vLLM's attention
    op is: traced, the gather and the masked softmax became a generated loop several times slower
    than these kernels, and slicing at the context length would
    specialise the graph on it. ``padded``: ``max_context`` only bounds ``lens`` (see
    ``AttentionMetadata.decode_padded``), so one sequence is masked as several are."""
    n, d = q.shape[0], q.shape[-1]
    if n == 1 and not padded:  # its context is max_context: no mask
        ks, vs = _read_kv(cache, tables[0], max_context, q.dtype, d)  # [kv, S, d]
        if window is not None and max_context > window:
            ks, vs = ks[:, -window:], vs[:, -window:]
        return F.scaled_dot_product_attention(q, ks[None], vs[None], scale=scale).contiguous()
    # whole blocks, the unused slots (a block's tail, padding blocks) masked
    bs, h = cache.shape[2], cache.shape[3]
    tables = tables[:, : (max_context + bs - 1) // bs]
    kv = gather_blocks(cache, tables.flatten(), q.dtype, d).view(2, n, -1, h, d).transpose(2, 3)  # [2, B, kv, S, d]
    k_pos = torch.arange(kv.shape[3], device=q.device)
    mask = k_pos[None, :] < lens[:, None]  # [B, S]
    if window is not None:
        mask &= k_pos[None, :] >= (lens - window)[:, None]
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask[:, None, None, :], scale=scale).contiguous()


_LIB.define(
    "decode_attention(Tensor q, Tensor cache, Tensor tables, Tensor lens, SymInt max_context, float scale, "
    "int? window, bool padded=False) -> Tensor"
)
_LIB.impl("decode_attention", decode_attention, "CompositeExplicitAutograd")
# contiguous, as the op returns it: CUDA's SDPA kernels hand back a transposed layout, which the
# compiled graph, planned from this fake, would misread
torch.library.register_fake("shardlm::decode_attention")(lambda q, *args: q.new_empty(q.shape))


def _decode(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, heads: GroupedHeads, scale: float, window: int | None
) -> torch.Tensor:
    n, d = q.shape[0], q.shape[-1]
    qg = heads.group_q(q).view(n, heads.num_kv, heads.per_kv, d)  # [B, kv, group, d]
    if native_cache(cache, q, meta) and cache.shape[-1] == d:
        o = torch.ops.shardlm_int4.decode_attention(
            qg, cache, meta.decode_block_tables, meta.decode_context_lens, scale, window or 0
        )
        return heads.ungroup(o.reshape(n, heads.num_kv * heads.per_kv, d))
    o = torch.ops.shardlm.decode_attention(
        qg,
        cache,
        meta.decode_block_tables,
        meta.decode_context_lens,
        meta.decode_max_context,
        scale,
        window,
        meta.decode_padded,
    )
    return heads.ungroup(o.reshape(n, heads.num_kv * heads.per_kv, d))  # [B, q_heads, d]
