"""Weight-only int4 linear layers: group-wise asymmetric 4-bit weights, multiplied as llama.cpp does.

A weight ``W [out, in]`` is held as 4-bit codes ``q`` in 0..15 and, for every run of ``INT4_GROUP``
(32) consecutive input columns of a row, a ``scale`` and an ``offset``; the weight it stands for is

    W[n, k] = q[n, k] * scale[n, k // 32] + offset[n, k // 32]

which is llama.cpp's 4-bit blocks of 32 (``ggml-common.h``): Q4_1 stores ``w = d * q + m`` (scale
``d``, offset ``m``), Q4_0 ``w = d * (q - 8)`` (offset ``-8 d``), so a GGUF file's Q4_0 and Q4_1
blocks (and Q4_K's sub-blocks of 32) become packed weights without going through float
(``models/gguf.py``, ``GGUFFile.read_int4``). Float checkpoints are quantized by ``int4_groups``:
each group's min and max (asymmetric), ``scale = (max - min) / 15``.

The embedding and LM head (a vocabulary table, read a row at a time and multiplied by every
token) are held in 8 bits alongside: llama.cpp's Q8_0 (``q8_groups``: a float16 scale per 32
columns, codes in -127..127), as SmolLM2's GGUF stores its tied embedding; the LM head then reads
1.06 bytes a weight instead of 2 (``q8_linear``, the same kernel's 8-bit loop).

Held per layer (``pack_int4``): the codes two a byte as in a GGUF block (byte j of a group holds
element j in its low nibble and j + 16 in its high one), ``[out, in / 2]`` uint8, and the scales
and offsets ``[2, out, in / 32]`` float16, as the file stores d and m: 0.625 bytes a weight.
Q4_0/Q4_1 are held exactly; Q4_K's scale d * sc_j (a float16 times a 6-bit integer) is rounded to
float16, at most 2^-11 of itself.

The kernel (``int4_cpu.cpp``, built once with torch's C++ extension builder into
``~/.cache/shardlm/kernels``): for a few rows (decode) it quantizes the activations to int8 per
group of 32 and multiplies in integers (AVX2; llama.cpp's Q4_1 x Q8_1), for many rows
(``GEMM_ROWS``, prefill) it dequantizes slices of the weight to float32 for torch's GEMM. It
replaced torch's own int4 kernel (``_weight_int4pack_mm_for_cpu``), which widens the codes to
bfloat16, and it is faster than the alternatives measured: torch has no integer-dot int4 kernel
for x86 (``_dyn_quant_matmul_4bit`` is a scalar reference loop there) and torchao's wheel has no
x86 CPU kernels (figures: docs/performance.md, "Int4 weights and llama.cpp"). Without a C++
compiler the layer dequantizes its weight at every call (correct, slow) and says so once.

The activations' int8 rounding (1/254 of each group's largest |x|) is the error this path adds
over the dequantized weight: outputs within ~1% of the largest.

On a GPU the same blocks go to torch's tinygemm kernel (``_weight_int4pack_mm``, bfloat16
activations, float32 accumulation): ``pack_int4`` repacks the codes at load into its tiled layout
(``_convert_weight_to_int4pack``, the same 0.5 bytes a weight) and the scales and offsets into its
``[in / 32, out, 2]`` bfloat16 scales and zeros, whose weight is ``(q - 8) * scale + zero``, so
zero = offset + 8 * scale. The embedding and LM head keep the model's dtype there (no GPU kernel
takes Q8_0's scale per 32 values). tinygemm needs an Ampere or newer GPU.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from shardlm.errors import UsageError

LOG = logging.getLogger("shardlm.int4")

INT4_GROUP = 32
"""Input columns per scale and offset: llama.cpp's Q4_0/Q4_1 block and its activations' Q8 block."""

GEMM_ROWS = 32
"""From this many activation rows on, the kernel multiplies dequantized weights by torch's float
GEMM instead of in integers: where the two cost about the same on one thread (docs/performance.md)."""


@dataclass(frozen=True)
class Int4Blocks:
    """Unpacked 4-bit weights: ``q`` uint8 [rows, cols] in 0..15, ``scale`` and ``offset`` float32
    [rows, cols / INT4_GROUP]; the weight is q * scale + offset, group by group."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [rows, cols] (for tests and the reference path)."""
        expand = lambda t: t.repeat_interleave(INT4_GROUP, dim=1)
        return self.q.float() * expand(self.scale) + expand(self.offset)

    def map_rows(self, fn) -> Int4Blocks:
        """The same blocks with ``fn`` applied to the rows of q, scale and offset (e.g. a row permutation)."""
        return Int4Blocks(fn(self.q), fn(self.scale), fn(self.offset))

    @staticmethod
    def cat(parts: list[Int4Blocks]) -> Int4Blocks:
        """Row blocks stacked (a merged QKV or gate/up projection)."""
        return Int4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "offset")))


def int4_groups(w: torch.Tensor) -> Int4Blocks:
    """Group-wise asymmetric int4 of a float weight [rows, cols]: per group of INT4_GROUP columns,
    min and max map to codes 0 and 15 (``cols`` must be a multiple of INT4_GROUP). The scale and
    offset are float16 values (what ``pack_int4`` holds; the scale at least 2^-14, float16's
    smallest normal), and the codes are rounded against them."""
    rows, cols = w.shape
    g = w.detach().float().reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)  # [rows, groups]
    scale = ((hi - lo) / 15).clamp_min(2.0**-14).half().float()
    offset = lo.half().float()
    q = ((g - offset[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8).reshape(rows, cols)
    return Int4Blocks(q, scale, offset)


def check_int4_shape(what: str, cols: int, col_offset: int = 0) -> None:
    """Refuse a weight whose in-features on this rank (starting at ``col_offset`` of the whole row,
    for a row-parallel shard) are not whole groups."""
    if cols % INT4_GROUP or col_offset % INT4_GROUP:
        raise UsageError(
            f"int4 weights: {what} holds in-features [{col_offset}, {col_offset + cols}) on this rank, which do not "
            f"split into groups of {INT4_GROUP} (a group may not straddle the tensor-parallel split); use a tp that "
            f"splits them into multiples of {INT4_GROUP}, or quantization='int8'"
        )


def pack_int4(blocks: Int4Blocks, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [rows, cols / 2], two a byte as in a GGUF block; scales float16 [2, rows,
    cols / INT4_GROUP]: the scales, then the offsets) for ``int4_linear``; on a CUDA ``device``,
    tinygemm's layout instead (``pack_int4_cuda``)."""
    if torch.device(device).type == "cuda":
        return pack_int4_cuda(blocks, torch.device(device))
    native_kernel()  # built at load, not in the first forward (nor in a compiled graph)
    rows, cols = blocks.q.shape
    q = blocks.q.reshape(rows, cols // INT4_GROUP, 2, INT4_GROUP // 2)
    codes = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()
    return codes, torch.stack([blocks.scale, blocks.offset]).half().contiguous()


def inner_k_tiles(cols: int) -> int:
    """tinygemm's inner K tiles for ``cols`` input columns: the most of 8, 4, 2 whose 16-column
    tiles divide them (more is faster; 2 always fits whole groups of 32)."""
    return next(t for t in (8, 4, 2) if cols % (16 * t) == 0)


def pack_int4_cuda(blocks: Int4Blocks, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tinygemm's packed int32 codes, bfloat16 scales and zeros [cols / 32, rows, 2]) on ``device``."""
    rows, cols = blocks.q.shape
    if torch.cuda.get_device_capability(device) < (8, 0):
        raise UsageError(
            f"int4 weights on a GPU run torch's tinygemm kernel, which needs compute capability 8.0 (Ampere) or "
            f"newer, and {torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}; "
            "use quantization='int8' there"
        )
    if rows % 8:
        raise UsageError(
            f"int4 weights on a GPU: a layer of {rows} out-features on this rank, and torch's int4 kernel takes "
            "them in tiles of 8; use a tp that gives each rank a multiple of 8, or quantization='int8'"
        )
    q = blocks.q.to(device, torch.uint8)
    pairs = (q[:, 0::2] << 4 | q[:, 1::2]).contiguous()  # [rows, cols / 2], the even column in the high nibble
    codes = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles(cols))
    zeros = blocks.offset + 8 * blocks.scale  # (q - 8) * scale + zero = q * scale + offset
    scales = torch.stack([blocks.scale, zeros], dim=-1).transpose(0, 1).contiguous()  # [groups, rows, 2]
    return codes, scales.to(device, torch.bfloat16)


def unpack_int4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [rows, cols] a packed layer stands for (``pack_int4``'s inverse)."""
    rows = codes.shape[0]
    by_group = codes.reshape(rows, -1, 1, INT4_GROUP // 2)
    q = torch.cat([by_group & 0x0F, by_group >> 4], dim=2).reshape(rows, -1)
    return Int4Blocks(q, scales[0].float(), scales[1].float()).dequantize()


NATIVE: bool | None = None
"""Whether ``int4_cpu.cpp`` is loaded (``torch.ops.shardlm_int4``); None until ``native_kernel``
first runs (at load: ``pack_int4`` and ``q8_groups`` call it, so a compiled graph only reads it)."""


def openmp_flags() -> list[str]:
    """-fopenmp where torch itself runs on GCC's OpenMP (Linux, a GCC compiler): ``at::parallel_for``
    is OpenMP pragmas in a header, which a build without the flag ignores (every loop then runs on
    one thread). No -lgomp: the GOMP symbols resolve, by their soname, to the libgomp torch has
    already loaded, so there is one OpenMP runtime in the process. Elsewhere (macOS's clang, LLVM's
    or Intel's OpenMP) none: the kernel builds and runs serially."""
    if sys.platform != "linux" or "OpenMP" not in torch.__config__.parallel_info():
        return []
    try:
        cxx = shlex.split(os.environ.get("CXX", "c++"))
        version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout
    except OSError:  # no compiler to ask: keep the flag, so a kernel already built with it still loads
        return ["-fopenmp"]
    return [] if "clang" in version.lower() else ["-fopenmp"]


def native_kernel() -> bool:
    """Build (first time only) and load ``int4_cpu.cpp``: into ~/.cache/shardlm/kernels/torch-<version>
    (``SHARDLM_KERNEL_CACHE`` overrides), reused after; ranks starting together build it once
    (torch's builder locks the folder). False, with a warning, where it cannot be built."""
    global NATIVE
    if NATIVE is not None:
        return NATIVE
    from torch.utils import cpp_extension

    root = Path(os.environ.get("SHARDLM_KERNEL_CACHE", Path.home() / ".cache" / "shardlm" / "kernels"))
    folder = root / f"torch-{torch.__version__}"
    source = Path(__file__).with_name("int4_cpu.cpp")
    if not (folder / "shardlm_int4.so").exists():
        LOG.warning("building shardlm's int4 CPU kernel into %s (once, under a minute)", folder)
    base = ["-O3", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
    threaded = openmp_flags()
    error: Exception | None = None
    for flags in [base + threaded] + ([base] if threaded else []):  # without OpenMP if it fails with it
        try:
            folder.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name="shardlm_int4",
                sources=[str(source)],
                extra_cflags=flags,
                build_directory=str(folder),
                is_python_module=False,
                verbose=False,
            )
            break
        except Exception as e:  # no compiler, no ninja, no writable folder: correct but slow
            error = e
    else:
        LOG.warning(
            "int4 weights: could not build %s (%s); layers dequantize their weights at every call", source, error
        )
        NATIVE = False
        return NATIVE
    if threaded and flags == base:
        LOG.warning("int4 weights: %s built without OpenMP (%s): its loops run on one thread", source, error)
    for op in ("linear", "q8_linear"):  # shapes for torch.compile, which calls the ops in its graph
        torch.library.register_fake(f"shardlm_int4::{op}")(
            lambda x, codes, scales, gemm_rows, simd=True: x.new_empty(x.shape[0], codes.shape[0], dtype=torch.float32)
        )
    torch.library.register_fake("shardlm_int4::write_kv")(lambda cache, k, v, slots: None)
    torch.library.register_fake("shardlm_int4::decode_attention")(lambda q, *args: q.new_empty(q.shape))
    NATIVE = True
    return NATIVE


def q8_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 of a float table [rows, cols]: per group of INT4_GROUP columns a float16
    scale max|w| / 127 and codes in -127..127: (int8 codes [rows, cols], float16 scales [rows,
    cols / INT4_GROUP]), the form the embedding and LM head are held in with int4 weights."""
    native_kernel()
    rows, cols = w.shape
    g = w.detach().float().reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    scale = (g.abs().amax(-1) / 127).clamp_min(2.0**-24).half()
    q = (g / scale.float()[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return q.reshape(rows, cols), scale


def q8_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Q8_0 rows [..., cols] (an embedding lookup's) in ``dtype``."""
    q = codes.unflatten(-1, (-1, INT4_GROUP)).float() * scales.float()[..., None]
    return q.flatten(-2).to(dtype)


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W^T for Q8_0 blocks (``q8_groups``): the LM head with int4 weights."""
    rows = x.reshape(-1, x.shape[-1])
    if NATIVE:
        y = torch.ops.shardlm_int4.q8_linear(rows, codes, scales, GEMM_ROWS)
    else:
        y = F.linear(rows.float(), q8_rows(codes, scales, torch.float32))
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W^T for a packed int4 weight (``pack_int4``); the result in x's dtype. Under
    torch.compile the kernel is an opaque op of the graph and the casts around it are fused."""
    rows = x.reshape(-1, x.shape[-1])
    if codes.is_cuda:  # tinygemm (pack_int4_cuda): bfloat16 in and out
        y = torch.ops.aten._weight_int4pack_mm(rows.to(torch.bfloat16), codes, INT4_GROUP, scales)
    elif NATIVE:
        y = torch.ops.shardlm_int4.linear(rows, codes, scales, GEMM_ROWS)
    else:
        y = F.linear(rows.float(), unpack_int4(codes, scales))
    return y.to(x.dtype).view(*x.shape[:-1], -1)
