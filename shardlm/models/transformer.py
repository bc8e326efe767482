"""One decoder-only transformer for Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, the MoE
families Mixtral, Qwen2-MoE and Qwen3-MoE (whose MLP is a ``SparseMoE``, see moe.py) and
DeepSeek-V2/V3 (MoE with multi-head latent attention, see mla.py).

Pre-norm blocks: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)) (Touvron et al.
2023, https://arxiv.org/abs/2302.13971). The families differ only in QKV bias
(Qwen2), per-head q/k RMSNorm (Qwen3), RoPE scaling (Llama 3.1) and a sliding
window (Mistral v0.1), all read from ``ModelConfig``.

No collectives here: the parallel layers carry the communication, and the model
is built for one rank of a ``ParallelDims`` (its tp slice and its pipeline layers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.models.attention import AttentionMetadata, GroupedHeads, paged_attention
from shardlm.models.config import ModelConfig
from shardlm.models.mla import LatentAttention
from shardlm.models.moe import SparseMoE
from shardlm.models.rope import Rotary, apply_rotary
from shardlm.parallel.comm import copy_to_region
from shardlm.parallel.context import ContextBatch, context_attention
from shardlm.parallel.dims import LayoutError, ParallelDims
from shardlm.parallel.tensor import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorSource,
    VocabParallelEmbedding,
    attention_sources,
    output_cols,
    partition_heads,
    shard_range,
)


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in float32 (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467).

    ``norm(x)`` returns y; ``norm(x, residual)`` first adds x to the residual stream
    and returns (y, new residual), saving a pass over the activations.
    """

    def __init__(self, source: str, dim: int, eps: float, dtype: torch.dtype, sequence_group=None):
        super().__init__()
        self.source, self.eps = source, eps
        # sequence parallel: each tp rank normalises its own tokens, so the weight's gradient is a
        # partial sum over tp (the copy's backward sums it); None: every rank sees every token
        self.sequence_group = sequence_group
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def whole_tensors(self) -> list[tuple[str, nn.Parameter]]:
        """Checkpoint tensors every tp rank holds whole (parallel/tensor.py's ``whole_tensors``)."""
        return [(f"{self.source}.weight", self.weight)]

    def load(self, src: TensorSource) -> None:
        with torch.no_grad():
            self.weight.copy_(src.read(f"{self.source}.weight"))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = residual = x + residual
        # one fused kernel; it accumulates in float32 (bitwise equal to HF's float32 recipe
        # for float32 inputs, within one bf16 ulp for bfloat16)
        w = self.weight if self.sequence_group is None else copy_to_region(self.weight, self.sequence_group)
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            y = _RMSNormFunction.apply(x, w, self.eps)
        else:
            y = F.rms_norm(x, w.shape, w, self.eps)
        return y if residual is None else (y, residual)


class _RMSNormFunction(torch.autograd.Function):
    """F.rms_norm's forward, keeping for backward only the input and 1/rms per token. Autograd
    through F.rms_norm keeps the input widened to float32 and the float32 normalised input as
    well: 8 bytes an element where 2 (bfloat16) or 4 (float32) suffice (docs/train.md,
    "Activations")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)  # [tokens, 1] float32
        ctx.save_for_backward(x, w, rstd)
        return F.rms_norm(x, w.shape, w, eps)  # the very kernel inference runs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        g = grad.float()
        dw = (g * xhat).reshape(-1, x.shape[-1]).sum(0).to(w.dtype)
        gx = g * w.float()  # the gradient of xhat
        dx = rstd * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
        return dx.to(x.dtype), dw, None


class QKNorm(nn.Module):
    """Qwen3's RMSNorm over head_dim of every q and k head, q_norm's weight on the q heads and
    k_norm's on the k heads, applied to both at once. Training: each weight's gradient is summed
    over its heads (autograd, through the expand) and over the tp ranks that hold the heads."""

    def __init__(self, prefix: str, part, cfg: ModelConfig, dtype: torch.dtype, group=None):
        super().__init__()
        self.prefix, self.eps, self.num_q, self.num_kv = prefix, cfg.rms_norm_eps, part.num_q, part.num_kv
        self.group = group
        self.q_weight = nn.Parameter(torch.empty(cfg.head_dim, dtype=dtype), requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(cfg.head_dim, dtype=dtype), requires_grad=False)

    def whole_tensors(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"{self.prefix}.q_norm.weight", self.q_weight), (f"{self.prefix}.k_norm.weight", self.k_weight)]

    def load(self, src: TensorSource) -> None:
        with torch.no_grad():
            for name, p in self.whole_tensors():
                p.copy_(src.read(name))

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        q_w: torch.Tensor = self.q_weight
        k_w: torch.Tensor = self.k_weight
        if torch.is_grad_enabled() and q_w.requires_grad:  # each tp rank's heads give part of the gradient
            q_w, k_w = copy_to_region(q_w, self.group), copy_to_region(k_w, self.group)
        d = q_w.shape[0]
        w = torch.cat([q_w.expand(self.num_q, d), k_w.expand(self.num_kv, d)])  # [heads, d]
        return F.rms_norm(qk, qk.shape[-1:], None, self.eps) * w  # [tokens, heads, d]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dims: ParallelDims, prefix: str, dtype: torch.dtype, sp: bool = False):
        super().__init__()
        part = partition_heads(cfg.num_heads, cfg.num_kv_heads, dims.tp, dims.tp_rank)
        self.num_q, self.num_kv, self.head_dim = part.num_q, part.num_kv, cfg.head_dim
        self.heads = GroupedHeads(part.local_kv_of_q())
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.sliding_window
        group = dims.tp_group
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size,
            attention_sources(prefix, part, cfg.head_dim),
            bias=cfg.qkv_bias,
            group=group,
            dtype=dtype,
            sequence_parallel=sp,
        )
        self.o = RowParallelLinear(
            f"{prefix}.o_proj",
            output_cols(part, cfg.head_dim),
            cfg.hidden_size,
            bias=cfg.o_bias,
            group=group,
            dtype=dtype,
            sequence_parallel=sp,
        )
        self.qk_norm = QKNorm(prefix, part, cfg, dtype, group) if cfg.qk_norm else None

    def cache_layout(self) -> tuple[int, int, int]:
        """(planes, heads, elements a row) of this layer's KV cache: keys and values of its KV heads."""
        return 2, self.num_kv, self.head_dim

    def forward(self, x, rope, meta: AttentionMetadata, cache: torch.Tensor) -> torch.Tensor:
        d, nq, nkv = self.head_dim, self.num_q, self.num_kv
        qkv = self.qkv(x)  # [tokens, (q_heads + 2 kv_heads) * d] (all tokens, also under sequence parallel)
        t = qkv.shape[0]
        qk = qkv[:, : (nq + nkv) * d].view(t, nq + nkv, d)  # q heads, then k heads: rotated together
        v = qkv[:, (nq + nkv) * d :].view(t, nkv, d)
        if torch.is_grad_enabled():  # saved for backward as a view, v would keep all of qkv alive
            v = v.contiguous()
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        qk = apply_rotary(qk, *rope)
        q, k = qk[:, :nq], qk[:, nq:]  # [tokens, q_heads, d], [tokens, kv_heads, d]
        if isinstance(meta, ContextBatch):  # training with the sequence split over cp ranks
            o = context_attention(q, k, v, meta, self.heads, self.scale, self.window)
        else:
            o = paged_attention(q, k, v, cache, meta, self.heads, self.scale, self.window)
        return self.o(o.reshape(t, self.num_q * d))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (Shazeer 2020, https://arxiv.org/abs/2002.05202)."""

    def __init__(self, cfg: ModelConfig, dims: ParallelDims, prefix: str, dtype: torch.dtype, sp: bool = False):
        super().__init__()
        rows = shard_range(cfg.intermediate_size, dims.tp, dims.tp_rank)
        sources = [(f"{prefix}.gate_proj", rows), (f"{prefix}.up_proj", rows)]
        self.gate_up = ColumnParallelLinear(
            cfg.hidden_size, sources, bias=cfg.mlp_bias, group=dims.tp_group, dtype=dtype, sequence_parallel=sp
        )
        self.down = RowParallelLinear(
            f"{prefix}.down_proj",
            rows,
            cfg.hidden_size,
            bias=cfg.mlp_bias,
            group=dims.tp_group,
            dtype=dtype,
            sequence_parallel=sp,
        )

    recompute_act = False
    """Training: keep only gate and up for backward and recompute silu(gate) * up there (set by
    the trainer's ``recompute="selective"``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.recompute_act and torch.is_grad_enabled() and self.down.weight_scale is None:
            return self.down.reduce(_SwiGLUDown.apply(gate_up, self.down.weight))
        gate, up = gate_up.chunk(2, dim=-1)  # [tokens, local intermediate] each
        return self.down(F.silu(gate) * up)


class _SwiGLUDown(torch.autograd.Function):
    """(silu(gate) * up) @ W_down^T, keeping for backward only [gate, up] and the weight: the
    activation (silu(gate) and the product, half of a SwiGLU MLP's stored activations) is
    recomputed in backward, a few elementwise ops against a matrix product (as Megatron-Core's
    activation recomputation)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up, weight)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate_up, weight = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        act = gate * sig  # silu(gate)
        dw = grad.reshape(-1, grad.shape[-1]).t() @ (act * up).reshape(-1, up.shape[-1])
        dh = grad @ weight  # the product's gradient
        d_gate = dh * up * (sig * (1 + gate * (1 - sig)))  # silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g)))
        return torch.cat([d_gate, dh * act], dim=-1), dw


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dims: ParallelDims, index: int, dtype: torch.dtype, sp: bool = False):
        super().__init__()
        p = f"model.layers.{index}"
        seq = dims.tp_group if sp else None
        self.input_norm = RMSNorm(f"{p}.input_layernorm", cfg.hidden_size, cfg.rms_norm_eps, dtype, seq)
        if cfg.is_mla:
            self.attn: Attention | LatentAttention = LatentAttention(cfg, dims, f"{p}.self_attn", dtype)
        else:
            self.attn = Attention(cfg, dims, f"{p}.self_attn", dtype, sp)
        self.post_norm = RMSNorm(f"{p}.post_attention_layernorm", cfg.hidden_size, cfg.rms_norm_eps, dtype, seq)
        self.mlp = SparseMoE(cfg, dims, p, dtype) if cfg.is_moe_layer(index) else MLP(cfg, dims, f"{p}.mlp", dtype, sp)

    def forward(self, h, residual, rope, meta, cache):
        if residual is None:  # first layer of the model: the residual stream starts here
            h, residual = self.input_norm(h), h
        else:
            h, residual = self.input_norm(h, residual)
        h = self.attn(h, rope, meta, cache)
        h, residual = self.post_norm(h, residual)
        return self.mlp(h), residual


class Transformer(nn.Module):
    """The layers ``layers`` of the model on one rank; the embedding lives with layer 0
    and the final norm and LM head with the last layer (pipeline stages hold a run, or under the
    interleaved schedule several runs, its chunks, each run through ``forward(chunk=c)``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dims: ParallelDims,
        *,
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        layers: range | Sequence[range] | None = None,
        sequence_parallel: bool = False,
    ):
        """``sequence_parallel``: hidden states between the tp regions hold 1/tp of the tokens
        (see parallel/tensor.py); a step's token count must split evenly over tp."""
        super().__init__()
        cfg.check_supported()
        self.cfg = cfg
        sp = sequence_parallel and dims.tp > 1
        if sp and (cfg.is_moe or cfg.is_mla):
            raise LayoutError("sequence parallelism is not supported for MoE or MLA models yet; leave it off")
        self.chunks = (
            (range(cfg.num_layers),) if layers is None else (layers,) if isinstance(layers, range) else tuple(layers)
        )
        self.first = self.chunks[0].start == 0  # holds the embedding (the first chunk of the first stage)
        self.last = self.chunks[-1].stop == cfg.num_layers
        tp = dict(tp=dims.tp, tp_rank=dims.tp_rank, group=dims.tp_group, dtype=dtype, sequence_parallel=sp)
        self.rotary = Rotary(cfg, max_positions or cfg.max_position_embeddings)
        self.embed = None
        if self.first or (self.last and cfg.tie_word_embeddings):
            self.embed = VocabParallelEmbedding("model.embed_tokens", cfg.vocab_size, cfg.hidden_size, **tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dims, i, dtype, sp) for run in self.chunks for i in run)
        self.norm: RMSNorm | None = None
        self.lm_head: ParallelLMHead | None = None
        if self.last:
            self.norm = RMSNorm("model.norm", cfg.hidden_size, cfg.rms_norm_eps, dtype, dims.tp_group if sp else None)
            tied = None
            if cfg.tie_word_embeddings:
                assert self.embed is not None  # built above for a tied last stage
                tied = self.embed.weight
            self.lm_head = ParallelLMHead("lm_head", cfg.vocab_size, cfg.hidden_size, tied=tied, **tp)

    def load(self, src: TensorSource) -> None:
        for module in self.modules():
            if module is not self and callable(load := getattr(module, "load", None)):
                load(src)

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters (a tied head counted once)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        caches: list[torch.Tensor | None],
        logits_indices: torch.Tensor | None = None,
        local_logits: bool = False,
        chunk: int = 0,
    ):
        """x: token ids [tokens] into the first layer, else hidden states [tokens, hidden].

        Runs the layers of ``chunk`` (``caches``: one per layer of the chunk). Returns logits
        [len(logits_indices), vocab] after the last layer (``local_logits``: only this tp
        rank's vocabulary slice, for a vocab-parallel loss), else (hidden, residual) to send to
        the next stage.
        """
        run = self.chunks[chunk]
        if run.start == 0:
            assert self.embed is not None  # the first stage holds the embedding
            h, residual = self.embed(x), None
        else:
            h, residual = x[0], x[1]
        rope = self.rotary.at(positions, h.dtype)
        offset = sum(len(r) for r in self.chunks[:chunk])
        for layer, cache in zip(self.layers[offset : offset + len(run)], caches):
            h, residual = layer(h, residual, rope, meta, cache)
        if run.stop != self.cfg.num_layers:
            return h, residual
        assert self.norm is not None and self.lm_head is not None  # the last stage holds them
        h, _ = self.norm(h, residual)
        if logits_indices is not None:
            h = h[logits_indices]
        if (shards := getattr(meta, "context", None)) is not None:  # cp inference: every cp rank gets every row
            h = shards.gather_rows(h)
        return self.lm_head(h, gather=not local_logits)
