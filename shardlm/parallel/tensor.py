"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053 §3).

Any tp from 1 to the number of query heads works, whether or not it divides the head,
KV-head, MLP or vocabulary sizes:

* query heads are split as evenly as possible (the first ``n % tp`` ranks get one more);
* each rank holds the KV heads its query heads read; a KV head whose query group spans
  two ranks is held (replicated) by both, so GQA never needs a collective;
* MLP rows and vocabulary rows are split the same way, with a remainder.

Each layer knows which rows/columns of which checkpoint tensor it holds (``sources``)
and loads exactly those (``load``), so no rank ever reads the whole model. A module that holds
checkpoint tensors whole on every tp rank (a norm, a router, MLA's down projections) says so with
``whole_tensors()`` (``whole_tensors(module)`` below): training counts their gradients once, and
saving names them.

``sequence_parallel`` (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198 §4.2.2): between
the tp regions activations are split by tokens over the tp ranks instead of replicated, so the
norms and residual adds run on 1/tp of the tokens; a column-parallel layer all-gathers its input
tokens and a row-parallel layer reduce-scatters its output (the same bytes as one all-reduce).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardlm.parallel.comm import (
    all_gather,
    all_gather_region,
    all_reduce,
    copy_to_region,
    gather_from_region,
    group_size,
    reduce_from_region,
    reduce_scatter,
    reduce_scatter_region,
    split_sizes,
)
from shardlm.parallel.dims import LayoutError
from shardlm.parallel.int4 import (
    Int4Blocks,
    check_int4_shape,
    int4_groups,
    int4_linear,
    native_kernel,
    pack_int4,
    q8_groups,
    q8_linear,
    q8_rows,
)


class TensorSource(Protocol):
    """A checkpoint that can read a slice of a tensor without reading the rest."""

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor: ...

    def has(self, name: str) -> bool: ...


def shard_range(n: int, parts: int, index: int) -> slice:
    """The rows [start, stop) that part ``index`` of ``parts`` holds of ``n`` rows."""
    sizes = split_sizes(n, parts)
    start = sum(sizes[:index])
    return slice(start, start + sizes[index])


@dataclass(frozen=True)
class HeadPartition:
    """The query and KV heads one tp rank holds (global head indices, end exclusive)."""

    q: slice
    kv: slice
    q_per_kv: int

    @property
    def num_q(self) -> int:
        return self.q.stop - self.q.start

    @property
    def num_kv(self) -> int:
        return self.kv.stop - self.kv.start

    def local_kv_of_q(self) -> list[int]:
        """For each local query head, the index of its KV head among the local KV heads."""
        return [h // self.q_per_kv - self.kv.start for h in range(self.q.start, self.q.stop)]


def partition_heads(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadPartition:
    if tp > num_heads:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise LayoutError(
            f"tp={tp} is larger than the model's {num_heads} attention heads: every tensor-parallel "
            f"rank needs at least one query head; use tp <= {num_heads} (even splits: {divisors})"
        )
    q = shard_range(num_heads, tp, rank)
    q_per_kv = num_heads // num_kv_heads
    kv = slice(q.start // q_per_kv, (q.stop - 1) // q_per_kv + 1)
    return HeadPartition(q=q, kv=kv, q_per_kv=q_per_kv)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear, but one row of 16-bit weights on CPU goes to the matrix-vector kernel: for
    batch-1 decode torch's CPU GEMV reads bf16 weights faster than its GEMM path does at M=1,
    and under torch.compile inductor's own matrix-vector loop is faster still; for float32 the
    BLAS GEMM is at least as fast (benchmarks/decode.py; docs/performance.md, "Decode, batch 1").
    With ``scale``, ``weight`` is int8 rows (see ``int8_rows``; ``scale`` [out]), packed int4
    (``parallel/int4.py``; ``scale`` is its scales and offsets [2, out, in / 32]) or Q8_0 blocks
    (int8 ``weight``, ``scale`` [out, in / 32]: the LM head with int4 weights)."""
    if scale is not None:
        if scale.dim() >= 2:
            y = (int4_linear if scale.dim() == 3 else q8_linear)(x, weight, scale)
        else:
            y = torch.ops.shardlm.int8_linear(x, weight, scale)
        return y if bias is None else y + bias
    if x.shape[0] == 1 and x.dim() == 2 and x.device.type == "cpu" and weight.element_size() == 2:
        y = torch.mv(weight, x[0]).unsqueeze(0)  # [1, out]
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (weight * scale[:, None])^T for int8 ``weight`` [out, in]; x [..., in].

    Called as ``torch.ops.shardlm.int8_linear``, opaque to torch.compile: inductor's own lowering
    of the int8 kernel failed on a fused input (torch 2.13). torch's int8 weight kernel on CPU is
    vectorised for 16-bit activations only (float32 ran 13x slower at one row), so a float32
    model's rows go through it in bfloat16; it reads rows in steps of 16, and other widths gave
    garbage or a crash, so those layers (and other devices) dequantize instead."""
    if x.device.type != "cpu" or weight.shape[1] % 16:
        return F.linear(x, weight.to(x.dtype)) * scale
    half = x.dtype if x.element_size() == 2 else torch.bfloat16
    rows = x.reshape(-1, x.shape[-1]).to(half).contiguous()
    return torch._weight_int8pack_mm(rows, weight, scale.to(half)).to(x.dtype).view(*x.shape[:-1], -1)


_LIB = torch.library.Library("shardlm", "FRAGMENT")
_LIB.define("int8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor")
_LIB.impl("int8_linear", int8_linear, "CompositeExplicitAutograd")
torch.library.register_fake("shardlm::int8_linear")(lambda x, w, s: x.new_empty(*x.shape[:-1], w.shape[0]))


def int8_rows(w: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8: each output row symmetric, scale = absmax / 127 (``absmax``: the whole
    row's largest |w| when ``w`` holds only part of each row). (int8 [out, in], scale [out])."""
    absmax = w.abs().amax(1) if absmax is None else absmax
    scale = absmax.float().clamp_min(1e-30) / 127
    return (w.float() / scale[:, None]).round_().to(torch.int8), scale.to(w.dtype)


class Int8Weight:
    """For a linear layer: ``quantize_int8`` swaps its weight for int8 rows and their scales,
    the same on every layout (a row split over ranks takes the whole row's scale). With ``int4``
    set (``prepare_int4``, before loading) the layer loads its weight as packed int4 instead."""

    weight: nn.Parameter
    weight_scale: nn.Parameter | None
    int4: str | None = None
    """'int4': packed int4 from the checkpoint's 4-bit blocks where it has them, else quantized from
    float; 'gguf': only from 4-bit blocks (a layer with other parts stays float); None: float."""
    packable: bool = True
    """False for a layer whose weight is read as a matrix elsewhere (MLA's kv_b): int4 leaves it float."""

    def load_int4(self, src: TensorSource, reads: Sequence[tuple[str, slice | None, slice | None]], what: str) -> bool:
        """Fill the weight as packed int4 from ``reads`` (name, rows, cols), stacked by rows; False
        when it stays float (mode 'gguf' and some part is not 4-bit in the file). Never builds a
        float copy of a part the file holds in 4 bits."""
        if self.int4 is None or not self.packable:
            return False
        holds = getattr(src, "holds_int4", lambda name: False)
        in_file = [holds(name) for name, _, _ in reads]
        if self.int4 == "gguf" and not all(in_file):
            return False
        check_int4_shape(what, self.weight.shape[1], next((c.start or 0 for _, _, c in reads if c is not None), 0))
        parts = [
            src.read_int4(name, rows=r, cols=c) if held else int4_groups(src.read(name, rows=r, cols=c))  # type: ignore[attr-defined]
            for (name, r, c), held in zip(reads, in_file, strict=True)
        ]
        codes, scales = pack_int4(Int4Blocks.cat(parts), self.weight.device)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale = nn.Parameter(scales, requires_grad=False)
        return True

    def quantize_int8(self) -> None:
        w = self.weight.detach()
        q, scale = int8_rows(w, self.row_absmax(w))
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def row_absmax(self, w: torch.Tensor) -> torch.Tensor:
        return w.abs().amax(1)


def quantize_int8(model: nn.Module) -> None:
    """Weight-only int8 for every column- and row-parallel linear layer of ``model``; the embedding,
    the LM head and MoE experts keep the model's dtype. Collective: every rank of a tp group calls
    it (row-parallel layers agree on their rows' scales)."""
    for m in model.modules():
        if isinstance(m, Int8Weight):
            m.quantize_int8()


def prepare_int4(model: nn.Module, mode: str) -> None:
    """Before loading: every column- and row-parallel linear layer of ``model`` loads its weight as
    packed int4 (``mode``: 'int4' or 'gguf', see ``Int8Weight.int4``), and the embedding and LM head
    as Q8_0 blocks (``VocabTable``: with 'gguf' only where the file holds Q8_0; on the CPU only: no
    GPU kernel takes Q8_0's scale per 32 values, so on a GPU they keep the model's dtype); MoE
    experts keep the model's dtype."""
    embed = None
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    for m in model.modules():
        if isinstance(m, Int8Weight):
            m.int4 = mode
        if isinstance(m, VocabTable) and on_cpu:
            m.q8 = mode
            m.weight_scale = nn.Parameter(torch.empty(0, dtype=torch.float16), requires_grad=False)
            embed = m if isinstance(m, VocabParallelEmbedding) else embed
    for m in model.modules():
        if isinstance(m, ParallelLMHead) and m.source is None and on_cpu:  # tied: the embedding's scales too
            assert embed is not None
            m.weight_scale = embed.weight_scale


def _scaled(s: slice, k: int) -> slice:
    return slice(s.start * k, s.stop * k)


class ColumnParallelLinear(Int8Weight, nn.Module):
    """y[:, mine] = x @ W[mine, :]^T + b[mine]: input replicated, output split by columns.

    A merged projection (QKV, gate/up) lists several checkpoint tensors in ``sources``,
    each with the rows this rank holds; the local weight is their row blocks stacked.
    """

    def __init__(
        self,
        in_features: int,
        sources: list[tuple[str, slice]],
        *,
        bias: bool,
        group: dist.ProcessGroup | None,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.sources, self.sequence_parallel = sources, sequence_parallel
        self.out_sizes = [s.stop - s.start for _, s in sources]
        self.group = group
        self.weight = nn.Parameter(torch.empty(sum(self.out_sizes), in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(self.out_sizes), dtype=dtype), requires_grad=False) if bias else None
        self.register_parameter("weight_scale", None)  # set by quantize_int8

    def load(self, src: TensorSource) -> None:
        with torch.no_grad():
            reads = [(f"{n}.weight", r, None) for n, r in self.sources]
            if not self.load_int4(src, reads, "+".join(n for n, _ in self.sources)):
                self.weight.copy_(torch.cat([src.read(name, rows=r) for name, r, _ in reads]))
            if self.bias is not None:
                self.bias.copy_(torch.cat([src.read(f"{n}.bias", rows=r) for n, r in self.sources]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gathered = self.sequence_parallel and group_size(self.group) > 1
        if gathered and self.weight_scale is None and torch.is_grad_enabled():  # training
            return _GatheredLinear.apply(x, self.weight, self.bias, self.group)
        if self.sequence_parallel:  # x holds this rank's tokens: gather all (backward: reduce-scatter)
            x = all_gather_region(x, self.group, dim=0)
        else:
            x = copy_to_region(x, self.group)  # backward: gradients of x summed over tp
        return linear(x, self.weight, self.bias, self.weight_scale)  # [tokens, sum(out_sizes)]


class _GatheredLinear(torch.autograd.Function):
    """Sequence parallelism's column-parallel product: all-gather the tokens, multiply. Backward
    needs the gathered input for the weight gradient; it keeps only this rank's tokens and
    all-gathers them again (Korthikanti et al. 2022 §4.2.2), so a layer's column-parallel
    inputs take 1/tp of the memory, and the input's gradient is reduce-scattered back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(all_gather(x, group, dim=0), weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        full = all_gather(x, ctx.group, dim=0)  # [all tokens, in]
        dx = reduce_scatter(grad @ weight, ctx.group, dim=0)
        dw = grad.t() @ full
        return dx, dw, grad.sum(0) if ctx.has_bias else None, None


class RowParallelLinear(Int8Weight, nn.Module):
    """y = sum_r x_r @ W[:, cols_r]^T + b: input split by columns, output all-reduced.

    The bias is added once, after the reduction, not once per rank.
    """

    def __init__(
        self,
        source: str,
        cols: slice,
        out_features: int,
        *,
        bias: bool,
        group: dist.ProcessGroup | None,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.source, self.cols, self.group, self.sequence_parallel = source, cols, group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, cols.stop - cols.start, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.register_parameter("weight_scale", None)  # set by quantize_int8

    def load(self, src: TensorSource) -> None:
        with torch.no_grad():
            if not self.load_int4(src, [(f"{self.source}.weight", None, self.cols)], self.source):
                self.weight.copy_(src.read(f"{self.source}.weight", cols=self.cols))
            if self.bias is not None:
                self.bias.copy_(src.read(f"{self.source}.bias"))

    def row_absmax(self, w: torch.Tensor) -> torch.Tensor:
        """Each output row is split over the tp group: the largest |w| of the whole row."""
        return all_reduce(w.abs().amax(1).float(), self.group, op="max")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(linear(x, self.weight, scale=self.weight_scale))

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial product y = x_r @ W_r^T [tokens, out] summed over tp, plus the bias."""
        if not self.sequence_parallel:
            y = reduce_from_region(y, self.group)
            return y if self.bias is None else y + self.bias
        y = reduce_scatter_region(y, self.group, dim=0)  # [this rank's tokens, out]
        # each rank adds the bias to its own tokens: its gradient is summed over tp
        return y if self.bias is None else y + copy_to_region(self.bias, self.group)


class VocabTable:
    """The embedding and the LM head: a vocabulary table [rows, dim], in the model's dtype or, with
    int4 weights (``prepare_int4``), as Q8_0 blocks: int8 ``weight`` and float16 ``weight_scale``
    [rows, dim / 32]. Loading swaps the shared Parameters' data in place, so a tied head (holding
    the embedding's Parameters) sees the blocks too."""

    source: str | None
    rows: slice
    weight: nn.Parameter
    weight_scale: nn.Parameter  # registered by prepare_int4 (a class default would hide the Parameter)
    q8: str | None = None
    """'int4': Q8_0 blocks, the file's where it holds Q8_0, else quantized from float; 'gguf': only
    the file's Q8_0 blocks (other types stay float); None: float."""

    def load_table(self, src: TensorSource) -> None:
        name = f"{self.source}.weight"
        held = getattr(src, "holds_q8", lambda name: False)(name)
        if self.q8 is not None and (held or self.q8 == "int4"):
            native_kernel()
            codes, scales = src.read_q8(name, rows=self.rows) if held else q8_groups(src.read(name, rows=self.rows))  # type: ignore[attr-defined]
            device = self.weight.device
            self.weight.data, self.weight_scale.data = codes.to(device), scales.to(device)
            return
        with torch.no_grad():
            self.weight.copy_(src.read(name, rows=self.rows))

    def q8_scale(self) -> torch.Tensor | None:
        """The Q8_0 scales when the table is held in 8 bits, else None."""
        return self.weight_scale if self.weight.dtype == torch.int8 else None


class VocabParallelEmbedding(VocabTable, nn.Module):
    """Each rank holds a run of vocabulary rows; ids outside it embed to zero, then all-reduce."""

    def __init__(
        self,
        source: str,
        vocab_size: int,
        dim: int,
        *,
        tp: int,
        tp_rank: int,
        group: dist.ProcessGroup | None,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.source, self.group, self.sequence_parallel = source, group, sequence_parallel
        self.rows = shard_range(vocab_size, tp, tp_rank)
        self.vocab_sizes = split_sizes(vocab_size, tp)
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(self.rows.stop - self.rows.start, dim, dtype=dtype), requires_grad=False)

    def load(self, src: TensorSource) -> None:
        self.load_table(src)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        scale = self.q8_scale()
        if scale is None:
            return F.embedding(ids, self.weight)
        return q8_rows(F.embedding(ids, self.weight), F.embedding(ids, scale), self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if len(self.vocab_sizes) == 1:
            return self.lookup(ids)
        local = ids - self.rows.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = self.lookup(local.masked_fill(outside, 0))  # [tokens, dim]
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:  # each rank keeps the sum for its own tokens
            return reduce_scatter_region(h, self.group, dim=0)
        return reduce_from_region(h, self.group)


class ParallelLMHead(VocabTable, nn.Module):
    """logits = h @ E^T with E split by vocabulary rows; the slices are gathered on every tp rank.

    With tied embeddings the weight is the embedding's own parameter (same rows).
    """

    def __init__(
        self,
        source: str,
        vocab_size: int,
        dim: int,
        *,
        tp: int,
        tp_rank: int,
        group: dist.ProcessGroup | None,
        dtype: torch.dtype,
        tied: nn.Parameter | None = None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.source, self.group, self.sequence_parallel = source, group, sequence_parallel
        self.rows = shard_range(vocab_size, tp, tp_rank)
        self.vocab_sizes = split_sizes(vocab_size, tp)
        if tied is not None:
            self.weight = tied
            self.source = None  # loaded with the embedding
        else:
            shape = (self.rows.stop - self.rows.start, dim)
            self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

    def load(self, src: TensorSource) -> None:
        if self.source is not None:  # None: tied, loaded with the embedding
            self.load_table(src)

    def forward(self, h: torch.Tensor, gather: bool = True) -> torch.Tensor:
        h = all_gather_region(h, self.group, dim=0) if self.sequence_parallel else copy_to_region(h, self.group)
        logits = linear(h, self.weight, None, self.q8_scale())  # [tokens, local vocab]
        if not gather:
            return logits
        return gather_from_region(logits, self.group, dim=-1, sizes=self.vocab_sizes)  # [tokens, vocab]


def whole_tensors(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(checkpoint name, parameter) of the tensors ``module`` itself holds whole on every tp rank
    (its ``whole_tensors`` method; none without one)."""
    method = getattr(module, "whole_tensors", None)
    return method() if callable(method) else []


def attention_sources(prefix: str, part: HeadPartition, head_dim: int) -> list[tuple[str, slice]]:
    """Row slices of q/k/v_proj for one rank: its query heads, and the KV heads they read."""
    return [
        (f"{prefix}.q_proj", _scaled(part.q, head_dim)),
        (f"{prefix}.k_proj", _scaled(part.kv, head_dim)),
        (f"{prefix}.v_proj", _scaled(part.kv, head_dim)),
    ]


def output_cols(part: HeadPartition, head_dim: int) -> slice:
    """Input columns of o_proj that multiply this rank's attention heads."""
    return _scaled(part.q, head_dim)
