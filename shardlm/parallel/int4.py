"""Weight-only int4 linear layers: group-wise asymmetric 4-bit weights in torch's packed CPU layout.

A weight ``W [out, in]`` is held as 4-bit codes ``q`` in 0..15 and, for every run of ``INT4_GROUP``
(32) consecutive input columns of a row, a ``scale`` and a ``zero``; the weight it stands for is

    W[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]

which is the form of torch's int4 kernel (``aten._weight_int4pack_mm_for_cpu``, "tinygemm"). It is
exactly llama.cpp's 4-bit blocks of 32 (``ggml-common.h``): Q4_1 stores ``w = d * q + m`` (scale
``d``, zero ``m + 8 d``), Q4_0 ``w = d * (q - 8)`` (scale ``d``, zero 0), so a GGUF file's Q4_0 and
Q4_1 blocks (and Q4_K's sub-blocks of 32) become packed weights without going through float (``models/gguf.py``,
``GGUFFile.read_int4``). Float checkpoints are quantized by ``int4_groups``: each group's min and
max (asymmetric), ``scale = (max - min) / 15``.

Held per layer: the codes two a byte (``_convert_weight_to_int4pack_for_cpu``'s layout, which
depends on the CPU's vector width, so it is made on the rank that runs it) and ``scales_and_zeros
[in / 32, out, 2]`` in bfloat16: torch's kernel is vectorised for bfloat16 activations only, and it
reads scales of the activations' dtype (float32 and float16 run its scalar loop, far slower:
docs/performance.md). Rounding d (a float16 in the file) to bfloat16 moves a weight by
at most 2^-9 of its scale and zero: a sixty-fourth of a quantization step for a zero of 8 d.

Constraints of the kernel: a layer's rows (out-features on this rank) in multiples of 16 and its
in-features in groups of 32; layers that do not fit are refused with the sizes (``pack_int4``),
never silently left in float. On a GPU torch has the same kernel in another layout
(``_weight_int4pack_mm``); it is not wired here (no GPU to test it), so int4 is refused off CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm.errors import UsageError

INT4_GROUP = 32
"""Input columns per scale and zero: llama.cpp's Q4_0/Q4_1 block, and the smallest group torch's kernel takes."""


@dataclass(frozen=True)
class Int4Blocks:
    """Unpacked 4-bit weights: ``q`` uint8 [rows, cols] in 0..15, ``scale`` and ``zero`` float32
    [rows, cols / INT4_GROUP]; the weight is (q - 8) * scale + zero, group by group."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [rows, cols] (for tests and the reference path)."""
        expand = lambda t: t.repeat_interleave(INT4_GROUP, dim=1)
        return (self.q.float() - 8) * expand(self.scale) + expand(self.zero)

    def map_rows(self, fn) -> Int4Blocks:
        """The same blocks with ``fn`` applied to the rows of q, scale and zero (e.g. a row permutation)."""
        return Int4Blocks(fn(self.q), fn(self.scale), fn(self.zero))

    @staticmethod
    def cat(parts: list[Int4Blocks]) -> Int4Blocks:
        """Row blocks stacked (a merged QKV or gate/up projection)."""
        return Int4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "zero")))


def int4_groups(w: torch.Tensor) -> Int4Blocks:
    """Group-wise asymmetric int4 of a float weight [rows, cols]: per group of INT4_GROUP columns,
    min and max map to codes 0 and 15 (``cols`` must be a multiple of INT4_GROUP)."""
    rows, cols = w.shape
    g = w.detach().float().reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)  # [rows, groups]
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8).reshape(rows, cols)
    return Int4Blocks(q, scale, lo + 8 * scale)


def check_int4_shape(what: str, rows: int, cols: int, col_offset: int = 0) -> None:
    """Refuse a weight torch's int4 kernel cannot hold: rows not a multiple of 16, or in-features
    (starting at ``col_offset`` of the whole row, for a row-parallel shard) not whole groups."""
    if cols % INT4_GROUP or col_offset % INT4_GROUP:
        raise UsageError(
            f"int4 weights: {what} holds in-features [{col_offset}, {col_offset + cols}) on this rank, which do not "
            f"split into groups of {INT4_GROUP} (a group may not straddle the tensor-parallel split); use a tp that "
            f"splits them into multiples of {INT4_GROUP}, or quantization='int8'"
        )
    if rows % 16:
        raise UsageError(
            f"int4 weights: {what} holds {rows} output rows on this rank, and torch's int4 kernel packs rows in "
            f"multiples of 16; use a tp that splits them so, or quantization='int8'"
        )


def pack_int4(blocks: Int4Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes uint8 [rows, cols / 2] in torch's CPU layout, scales_and_zeros bfloat16
    [cols / INT4_GROUP, rows, 2]) for ``int4_linear``. The int32 codes torch's packer takes live
    only during the call."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32), 2)
    sz = torch.stack([blocks.scale.t(), blocks.zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, sz


def int4_linear(x: torch.Tensor, weight: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W^T for a packed int4 ``weight`` (``pack_int4``); the result in x's dtype.

    Called as ``torch.ops.shardlm.int4_linear``, opaque to torch.compile (as int8_linear): rows go
    through torch's kernel in bfloat16, the only activation dtype it vectorises on CPU."""
    group = x.shape[-1] // scales_zeros.shape[0]
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight, group, scales_zeros)
    return y.to(x.dtype).view(*x.shape[:-1], -1)


_LIB = torch.library.Library("shardlm", "FRAGMENT")
_LIB.define("int4_linear(Tensor x, Tensor weight, Tensor scales_zeros) -> Tensor")
_LIB.impl("int4_linear", int4_linear, "CompositeExplicitAutograd")
torch.library.register_fake("shardlm::int4_linear")(lambda x, w, sz: x.new_empty(*x.shape[:-1], sz.shape[1]))
