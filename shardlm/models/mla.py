"""Multi-head latent attention (MLA; DeepSeek-V2, https://arxiv.org/abs/2405.04434 §2.1).

Keys and values come from one compressed latent per token: c = RMSNorm(W_DKV x) of width
``kv_lora_rank``, expanded per head by kv_b = [W_UK; W_UV] (k_nope = W_UK c, v = W_UV c), plus a
rotary key k_pe = RoPE(W_KR x) of width ``qk_rope_head_dim`` that all heads share. Queries are
[q_nope, q_pe] per head, projected from x directly or through a low-rank q_a / q_b pair.

The paged KV cache stores only [c, k_pe] per token: ``kv_lora_rank + qk_rope_head_dim`` elements
a layer, whatever the number of heads (the whole point of MLA). Its layout is one plane
``[1, blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``.

* Prefill expands the latent of the context into per-head keys and values and runs ordinary
  attention (the expansion is cheap next to attention over a long prompt).
* Decode uses the absorbed form (§2.1.2): q_nope . k_nope = (W_UK^T q_nope) . c, so each head's
  query is folded into the latent space and attends over the cached [c, k_pe] rows directly, as
  multi-query attention with one shared "head" of width kv_lora_rank + rope; the output, a
  mixture of latents, goes through W_UV afterwards. The cache is never expanded.

Tensor parallelism splits the heads (q_b / q_proj rows, kv_b rows, o_proj columns); the down
projections (q_a, kv_a) and the latent are replicated on every tp rank, as in vLLM and SGLang.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.models.attention import AttentionMetadata, encode_kv, gather_blocks, raw_bytes
from shardlm.models.config import ModelConfig
from shardlm.models.rope import apply_rotary, deinterleave, yarn_factor, yarn_mscale
from shardlm.parallel.comm import copy_to_region
from shardlm.parallel.dims import LayoutError, ParallelDims
from shardlm.parallel.tensor import ColumnParallelLinear, RowParallelLinear, TensorSource, linear, shard_range


class Replicated(nn.Module):
    """A weight every tp rank holds whole (a down projection, a norm)."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype):
        super().__init__()
        self.name = name
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

    def whole_tensors(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"{self.name}.weight", self.weight)]

    def load(self, src: TensorSource) -> None:
        with torch.no_grad():
            self.weight.copy_(src.read(f"{self.name}.weight"))


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(q/k head width), times YaRN's mscale squared when the config scales RoPE with
    ``mscale_all_dim`` (DeepSeek's long-context attention temperature)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(yarn_factor(cfg), scaling["mscale_all_dim"]) ** 2
    return scale


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dims: ParallelDims, prefix: str, dtype: torch.dtype):
        super().__init__()
        if cfg.qkv_bias:
            raise LayoutError("MLA with attention_bias=True is not supported; DeepSeek's checkpoints have none")
        heads = shard_range(cfg.num_heads, dims.tp, dims.tp_rank)
        self.num_q = heads.stop - heads.start
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        self.interleaved, self.eps, self.scale = cfg.rope_interleave, cfg.rms_norm_eps, softmax_scale(cfg)
        self.group = dims.tp_group
        qk, h, group = self.nope + self.rope, cfg.hidden_size, dims.tp_group
        q_rows = slice(heads.start * qk, heads.stop * qk)
        self.q_a: Replicated | None = None
        self.q_a_norm: Replicated | None = None
        if cfg.q_lora_rank:
            self.q_a = Replicated(f"{prefix}.q_a_proj", (cfg.q_lora_rank, h), dtype)
            self.q_a_norm = Replicated(f"{prefix}.q_a_layernorm", (cfg.q_lora_rank,), dtype)
            self.q = ColumnParallelLinear(
                cfg.q_lora_rank, [(f"{prefix}.q_b_proj", q_rows)], bias=False, group=group, dtype=dtype
            )
        else:
            self.q = ColumnParallelLinear(h, [(f"{prefix}.q_proj", q_rows)], bias=False, group=group, dtype=dtype)
        self.kv_a = Replicated(f"{prefix}.kv_a_proj_with_mqa", (self.latent + self.rope, h), dtype)
        self.kv_a_norm = Replicated(f"{prefix}.kv_a_layernorm", (self.latent,), dtype)
        per_head = self.nope + self.v_dim
        self.kv_b = ColumnParallelLinear(
            self.latent,
            [(f"{prefix}.kv_b_proj", slice(heads.start * per_head, heads.stop * per_head))],
            bias=False,
            group=group,
            dtype=dtype,
        )
        self.kv_b.packable = False  # _absorbed reads its weight as a matrix: int4 leaves it float
        self.o = RowParallelLinear(
            f"{prefix}.o_proj",
            slice(heads.start * self.v_dim, heads.stop * self.v_dim),
            h,
            bias=False,
            group=group,
            dtype=dtype,
        )

    def cache_layout(self) -> tuple[int, int, int]:
        """(planes, heads, elements a row) of this layer's KV cache: one plane, one row of
        [c, k_pe] per token for all heads."""
        return 1, 1, self.latent + self.rope

    def forward(self, x: torch.Tensor, rope, meta: AttentionMetadata, cache: torch.Tensor | None) -> torch.Tensor:
        t, n = x.shape[0], self.num_q
        if self.q_a is not None:
            assert self.q_a_norm is not None  # built together
            qa = linear(x, self.q_a.weight)
            x_q = F.rms_norm(qa, qa.shape[-1:], self.q_a_norm.weight, self.eps)
        else:
            x_q = x
        q = self.q(x_q).view(t, n, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        kv = linear(x, self.kv_a.weight)  # [tokens, latent + rope]
        c = F.rms_norm(kv[:, : self.latent], (self.latent,), self.kv_a_norm.weight, self.eps)
        k_pe = kv[:, None, self.latent :]  # [tokens, 1, rope]
        if torch.is_grad_enabled() and self.kv_a.weight.requires_grad:  # each rank's heads: part of its gradient
            k_pe = copy_to_region(k_pe, self.group)
        if self.interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = apply_rotary(q_pe, *rope), apply_rotary(k_pe, *rope)
        latent = torch.cat([c, k_pe[:, 0]], dim=-1)  # [tokens, latent + rope]: what the cache keeps
        if cache is not None and meta.slot_mapping is not None:
            # [c, k_pe] as one row of one head (a quantized cache: one scale for both)
            plane = raw_bytes(cache)[0]
            plane.view(-1, 1, plane.shape[-1]).index_copy_(
                0, meta.slot_mapping, encode_kv(latent[:, None], cache.dtype)
            )
        outputs = []
        for s in meta.prefills:
            rows = slice(s.start, s.start + s.length)
            if s.context_len == s.length:  # nothing cached before: the fresh latents
                ctx = latent[rows]
            else:
                assert s.block_table is not None and cache is not None  # a cached prefix lives in blocks
                ctx = read_latent(cache, s.block_table, s.context_len, x.dtype, self.latent + self.rope)
            outputs.append(self._expanded(q_nope[rows], q_pe[rows], ctx))
        if meta.decode_block_tables is not None:
            assert cache is not None  # decode reads the cache
            d = meta.num_prefill_tokens
            outputs.append(self._absorbed(q_nope[d:], q_pe[d:], cache, meta))
        o = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [tokens, heads, v]
        return self.o(o.reshape(t, n * self.v_dim))

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """One prompt's queries [L, heads, *] over its context's latents [S, latent + rope], the
        latents expanded per head; causal, the queries being the context's last L positions."""
        length, size = q_nope.shape[0], ctx.shape[0]
        kv = self.kv_b(ctx[:, : self.latent]).view(size, self.num_q, self.nope + self.v_dim)
        k_pe = ctx[:, None, self.latent :].expand(size, self.num_q, self.rope)
        k = torch.cat([kv[..., : self.nope], k_pe], dim=-1).transpose(0, 1)  # [heads, S, nope + rope]
        v = kv[..., self.nope :].transpose(0, 1)  # [heads, S, v]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [heads, L, nope + rope]
        if length == size:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            mask = torch.ones(length, size, dtype=torch.bool, device=q.device).tril(size - length)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o.transpose(0, 1)  # [L, heads, v]

    def _absorbed(self, q_nope, q_pe, cache, meta: AttentionMetadata) -> torch.Tensor:
        """One new token per sequence [B, heads, *] over the cached latents, W_UK folded into the
        query and W_UV applied after attention."""
        w: torch.Tensor = self.kv_b.weight
        if self.kv_b.weight_scale is not None:  # --quantization int8: each row's scale
            w = w.to(q_nope.dtype) * self.kv_b.weight_scale[:, None].to(q_nope.dtype)
        w = w.view(self.num_q, self.nope + self.v_dim, self.latent)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # [heads, nope, latent], [heads, v, latent]
        q_latent = torch.einsum("bhn,hnl->bhl", q_nope, w_uk)
        q = torch.cat([q_latent, q_pe], dim=-1)  # [B, heads, latent + rope]
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        assert tables is not None and lens is not None  # a decode batch has both
        o = latent_decode_attention(q, cache, tables, lens, meta.decode_max_context, self.scale, self.latent)
        return torch.einsum("bhl,hvl->bhv", o, w_uv)


def read_latent(cache: torch.Tensor, table: torch.Tensor, length: int, dtype: torch.dtype, row: int) -> torch.Tensor:
    """The first ``length`` cached [c, k_pe] rows (``row`` elements each) of one sequence: [length, row]."""
    bs = cache.shape[2]
    blocks = table[: (length + bs - 1) // bs]
    return gather_blocks(cache, blocks, dtype, row).view(-1, row)[:length]


def latent_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    max_context: int,
    scale: float,
    latent: int,
) -> torch.Tensor:
    """q [B, heads, latent + rope] (absorbed queries) over each sequence's cached rows: a row is a
    key whole, and its first ``latent`` elements are the value. Multi-query attention: every head
    reads the same rows, once. Returns [B, heads, latent]."""
    n, row, bs = q.shape[0], q.shape[-1], cache.shape[2]
    tables = tables[:, : (max_context + bs - 1) // bs]  # whole blocks; the slots past a context masked
    keys = gather_blocks(cache, tables.flatten(), q.dtype, row).view(n, 1, -1, row)  # [B, 1, S, row]
    mask = torch.arange(keys.shape[2], device=q.device)[None, :] < lens[:, None]  # [B, S]
    o = F.scaled_dot_product_attention(
        q[:, None], keys, keys[..., :latent], attn_mask=mask[:, None, None, :], scale=scale
    )  # [B, 1, heads, latent]
    return o[:, 0]
