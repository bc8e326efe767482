"""A lean GGUF reader: metadata as a plain dict, tensors read slice by slice from a memory map.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (v2 and v3, little-endian).
A file is ``magic, version, tensor_count, kv_count``, then the key/values, then one info per
tensor (name, ggml dims ``ne`` fastest-moving first, ggml type, offset), then -- aligned to
``general.alignment`` (default 32) -- the data section the offsets point into.

Why not ``gguf.GGUFReader``: it builds a numpy view per string, ~4 s for a 49k-token vocabulary
plus merges; here those strings are decoded in one tight ``struct`` loop (~0.1 s), and tensors are
read lazily: ``read(name, rows, cols)`` touches only the rows asked for and, within each row, only
the quantization blocks that cover the requested columns. Dequantization is ``gguf.quants``.

Notes for a weight loader
-------------------------
* Shapes are PyTorch order (reversed ggml ``ne``): a linear weight is ``[out_features, in_features]``,
  so a column-parallel shard is a ``rows`` slice and a row-parallel shard a ``cols`` slice.
* llama.cpp's converter (``LlamaModel.permute`` in ``convert_hf_to_gguf.py``) reorders the rows of
  ``attn_q.weight`` and ``attn_k.weight`` *within each head*, from HF's "rotate_half" layout (the
  first half of a head's dims pairs with the second half) to ggml's interleaved RoPE layout
  (dims ``2i`` and ``2i+1`` pair)::

      gguf = hf.reshape(n_heads, 2, head_dim // 2, in).swapaxes(1, 2).reshape(hf.shape)

  i.e. ``gguf_row[h*D + 2*i + j] = hf_row[h*D + j*D/2 + i]`` for ``i < D/2, j in {0, 1}``.
  ``transformers`` undoes it on load (``LlamaTensorProcessor._reverse_permute_weights`` in
  ``modeling_gguf_pytorch_utils.py``): ``w.reshape(n, D/2, 2, in).swapaxes(1, 2)``, with ``n`` the
  query heads for Q and the *KV* heads for K. ``unpermute_qk`` below is that inverse; it acts on each
  head independently, so it applies to any row block holding whole heads (a TP shard).
  transformers applies it only when ``general.architecture == "llama"`` (Mistral and SmolLM2 GGUFs
  also say "llama"); qwen2/qwen3 converters do not permute.
* GGUF omits ``output.weight`` when the LM head is tied to ``token_embd.weight``.
* Norm weights are F32 and stored as-is for llama/qwen (Gemma stores ``w + 1``).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from shardlm.errors import UsageError
from shardlm.parallel.int4 import INT4_GROUP, Int4Blocks

__all__ = ["GGUFError", "GGUFFile", "TensorInfo", "unpermute_qk"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
# value type id -> struct format of one scalar (8 = string and 9 = array are handled apart)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# plain element types gguf.quants does not dequantize: read as numpy and cast
_PLAIN: dict[int, type[np.generic]] = {
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
    GGMLQuantizationType.F64: np.float64,
}


class GGUFError(UsageError):
    """A file that is not a GGUF this reader can read, or a request it cannot serve."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    """PyTorch order: reversed ggml ``ne``."""
    ggml_type: GGMLQuantizationType | int
    """An int only when the type is newer than the installed ``gguf`` package knows."""
    offset: int
    """Absolute byte offset of the tensor's first block in the file."""

    @property
    def block(self) -> tuple[int, int]:
        """``(elements per block, bytes per block)`` of the ggml type."""
        if self.ggml_type not in GGML_QUANT_SIZES:
            raise GGUFError(
                f"tensor {self.name!r} has ggml type {int(self.ggml_type)}, unknown to gguf "
                f"{_gguf_version()}; upgrade it with `pip install -U gguf`"
            )
        return GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]  # known: checked above

    @property
    def nbytes(self) -> int:
        block_elems, block_bytes = self.block
        return prod(self.shape) // block_elems * block_bytes


class GGUFFile:
    """One GGUF file: ``metadata`` (dict), tensor ``shape``s, and ``read`` for float32 slices."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"GGUF file {str(self.path)!r} does not exist (or is not a file)")
        with open(self.path, "rb") as f:
            size = self.path.stat().st_size
            if size < 24:
                raise GGUFError(f"{str(self.path)!r} is {size} bytes, too short to be a GGUF file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                self.version, self.metadata, infos, data_start = _parse(buf, str(self.path))
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, type_id, rel in infos:
            try:
                ggml_type: GGMLQuantizationType | int = GGMLQuantizationType(type_id)
            except ValueError:
                ggml_type = type_id
            info = TensorInfo(name, tuple(reversed(ne)), ggml_type, data_start + rel)
            if ggml_type in GGML_QUANT_SIZES and info.offset + info.nbytes > size:
                raise GGUFError(
                    f"{str(self.path)!r} is truncated: tensor {name!r} ends at byte {info.offset + info.nbytes}, "
                    f"the file has {size}; download it again"
                )
            self.tensors[name] = info
        self.data_offset = data_start
        # The whole file as bytes; pages are read from disk only when a slice is materialised.
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r") if self.tensors else np.empty(0, np.uint8)

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"

    @property
    def tensor_names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            names = list(self.tensors)
            shown = ", ".join(names[:8]) + (f", … ({len(names)} in all)" if len(names) > 8 else "")
            raise GGUFError(f"no tensor {name!r} in {str(self.path)!r}; it has: {shown or 'no tensors'}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """PyTorch-order shape, e.g. ``(out_features, in_features)`` for a linear weight."""
        return self.info(name).shape

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """``tensor[rows, ..., cols]`` as float32, reading only the bytes that hold it.

        ``rows`` slices dim 0 and ``cols`` the last dim (for a 1-D tensor ``rows`` slices its only
        dim). Steps other than 1 are not supported. Column slices need not align to quant blocks:
        the covering blocks are read and dequantized, then trimmed.
        """
        info = self.info(name)
        shape = info.shape
        if len(shape) == 1:
            if cols is not None:
                raise GGUFError(f"{name!r} is 1-D {list(shape)}; slice it with rows=, not cols=")
            shape, rows, cols = (1, shape[0]), None, rows
        block_elems, block_bytes = info.block
        n_rows, n_cols, inner = shape[0], shape[-1], prod(shape[1:-1])
        r0, r1 = _span(rows, n_rows, "rows", name)
        c0, c1 = _span(cols, n_cols, "cols", name)
        if n_cols % block_elems:
            raise GGUFError(f"{name!r}: last dim {n_cols} is not a multiple of its block size {block_elems}")
        out_shape = (r1 - r0, *info.shape[1:-1], c1 - c0) if len(info.shape) > 1 else (c1 - c0,)
        if r0 == r1 or c0 == c1:
            return torch.empty(out_shape, dtype=torch.float32)  # gguf.quants cannot dequantize zero blocks
        row_bytes = n_cols // block_elems * block_bytes
        table = self._data[info.offset : info.offset + info.nbytes].reshape(n_rows, inner, row_bytes)
        b0, b1 = c0 // block_elems, -(-c1 // block_elems)  # blocks covering [c0, c1)
        raw = np.array(table[r0:r1, :, b0 * block_bytes : b1 * block_bytes])  # the copy reads the pages
        # [r, inner, (b1 - b0) * block_elems]
        values = _dequantize(raw, info.ggml_type)[..., c0 - b0 * block_elems : c1 - b0 * block_elems]
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(out_shape)

    def holds_int4(self, name: str) -> bool:
        """Whether ``name`` is stored in 4-bit blocks that map exactly onto int4 groups (Q4_0, Q4_1, Q4_K)."""
        return self.info(name).ggml_type in _INT4_TYPES

    def read_int4(self, name: str, rows: slice | None = None, cols: slice | None = None) -> Int4Blocks:
        """``tensor[rows, cols]`` of a Q4_0, Q4_1 or Q4_K tensor (2-D) as int4 codes, scales and
        offsets, straight from its blocks (no float weight); ``w = q * scale + offset`` is

        * Q4_1's ``d * q + m``: scale = d, offset = m;
        * Q4_0's ``d * (q - 8)``: scale = d, offset = -8 d;
        * Q4_K's ``d * sc_j * q - dmin * m_j`` in each sub-block j of 32 of a 256-block (6-bit
          sc_j, m_j): scale = d sc_j, offset = -dmin m_j.

        Layouts: llama.cpp's ``ggml-common.h`` (Q4_0/Q4_1: float16 d [, m], then 16 bytes, element j
        in the low nibble of byte j, 16 + j in its high nibble; Q4_K: float16 d, dmin, 12 bytes of
        packed scales and mins, then 4 runs of 32 bytes, run c holding sub-block 2c in its low and
        2c + 1 in its high nibbles). ``cols`` must start and end on a multiple of 32 (the covering
        blocks are read, then trimmed). scale and offset are float32, exact: the float16 fields
        and their products with the 6-bit integers."""
        info = self.info(name)
        if info.ggml_type not in _INT4_TYPES or len(info.shape) != 2:
            raise GGUFError(
                f"{name!r} is {_type_name(info.ggml_type)} {list(info.shape)}; read_int4 reads 2-D Q4_0/Q4_1/Q4_K"
            )
        n_rows, n_cols = info.shape
        r0, r1 = _span(rows, n_rows, "rows", name)
        c0, c1 = _span(cols, n_cols, "cols", name)
        if c0 % INT4_GROUP or c1 % INT4_GROUP:
            raise GGUFError(f"{name!r}: cols [{c0}, {c1}) do not hold whole blocks of {INT4_GROUP}")
        block_elems, block_bytes = info.block
        b0, b1 = c0 // block_elems, -(-c1 // block_elems)  # blocks covering [c0, c1)
        table = self._data[info.offset : info.offset + info.nbytes].reshape(n_rows, n_cols // block_elems, block_bytes)
        raw = torch.from_numpy(np.array(table[r0:r1, b0:b1]))  # [r, blocks, bytes]: only these pages are read
        half = lambda at: raw[..., at : at + 2].contiguous().view(torch.float16)[..., 0].float()
        d = half(0)  # [r, blocks]
        if info.ggml_type == GGMLQuantizationType.Q4_K:
            sc, mins = (
                torch.from_numpy(t.astype(np.float32))
                for t in Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12).numpy())
            )
            scale = d[..., None] * sc.reshape(*d.shape, 8)  # [r, blocks, 8 sub-blocks]
            offset = -half(2)[..., None] * mins.reshape(*d.shape, 8)
            qs = raw[..., 16:].reshape(*d.shape, 4, 1, 32)  # [r, blocks, run, 1, 32]
            q = torch.cat([qs & 0x0F, qs >> 4], dim=-2)  # [r, blocks, run, nibble, 32]: sub-block 2 run + nibble
        else:
            scale = d[..., None]  # [r, blocks, 1]
            offset = half(2)[..., None] if info.ggml_type == GGMLQuantizationType.Q4_1 else -8 * scale
            qs = raw[..., -16:]  # [r, blocks, 16]
            q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [r, blocks, 32]
        g0 = c0 // INT4_GROUP - b0 * block_elems // INT4_GROUP  # first wanted group among those read
        g1 = g0 + (c1 - c0) // INT4_GROUP
        groups = lambda t: t.reshape(r1 - r0, -1)[:, g0:g1]
        q = q.reshape(r1 - r0, -1)[:, g0 * INT4_GROUP : g1 * INT4_GROUP]  # [r, cols] in 0..15
        return Int4Blocks(q.contiguous(), groups(scale).contiguous(), groups(offset).contiguous())

    def read_q8(self, name: str, rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``tensor[rows]`` of a 2-D Q8_0 tensor as its blocks: (int8 codes [r, cols], float16
        scales [r, cols / 32]), the file's bytes (Q8_0: a float16 d, then 32 int8 codes)."""
        info = self.info(name)
        if info.ggml_type != GGMLQuantizationType.Q8_0 or len(info.shape) != 2:
            raise GGUFError(f"{name!r} is {_type_name(info.ggml_type)} {list(info.shape)}; read_q8 reads 2-D Q8_0")
        n_rows, n_cols = info.shape
        r0, r1 = _span(rows, n_rows, "rows", name)
        block_elems, block_bytes = info.block
        table = self._data[info.offset : info.offset + info.nbytes].reshape(n_rows, n_cols // block_elems, block_bytes)
        raw = torch.from_numpy(np.array(table[r0:r1]))  # [r, blocks, 34]
        scales = raw[..., :2].contiguous().view(torch.float16)[..., 0]
        codes = raw[..., 2:].contiguous().view(torch.int8).reshape(r1 - r0, n_cols)
        return codes, scales.contiguous()


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head RoPE row permutation of ``attn_q``/``attn_k`` (see module doc).

    ``w``: ``[n_heads * head_dim, ...]`` rows in GGUF order, whole heads only (pass the KV head
    count for K, or the heads of the shard for a TP slice). Returns rows in HF order.
    """
    if n_heads <= 0 or w.shape[0] % (2 * n_heads):
        raise GGUFError(
            f"unpermute_qk: {w.shape[0]} rows do not split into {n_heads} heads of even head_dim; "
            f"pass the number of whole heads the block holds (query heads for Q, KV heads for K)"
        )
    half = w.shape[0] // n_heads // 2
    # [heads, half, 2, ...] -> [heads, 2, half, ...]: pair (2i, 2i+1) goes back to (i, i + half)
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)


def _type_name(ggml_type: GGMLQuantizationType | int) -> str:
    return ggml_type.name if isinstance(ggml_type, GGMLQuantizationType) else f"ggml type {ggml_type}"


def _span(s: slice | None, n: int, what: str, name: str) -> tuple[int, int]:
    if s is None:
        return 0, n
    if not isinstance(s, slice):
        raise GGUFError(f"{what}= must be a slice or None, got {s!r} for {name!r}; use e.g. slice(0, 64)")
    start, stop, step = s.indices(n)
    if step != 1:
        raise GGUFError(f"{what}={s!r} for {name!r}: only step 1 is supported")
    return start, max(start, stop)


def _dequantize(raw: np.ndarray, ggml_type: GGMLQuantizationType | int) -> np.ndarray:
    if ggml_type in _PLAIN:
        return raw.view(_PLAIN[ggml_type]).astype(np.float32)
    try:
        return dequantize(raw, cast(GGMLQuantizationType, ggml_type))
    except NotImplementedError:
        raise GGUFError(
            f"gguf {_gguf_version()} cannot dequantize {GGMLQuantizationType(ggml_type).name}; "
            f"try `pip install -U gguf`"
        ) from None


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def _parse(buf: mmap.mmap, where: str) -> tuple[int, dict[str, Any], list, int]:
    """``(version, metadata, [(name, ne, type_id, relative_offset)], data_start)``."""
    if buf[:4] != _MAGIC:
        raise GGUFError(f"{where!r} is not a GGUF file: it starts with {bytes(buf[:4])!r}, not {_MAGIC!r}")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in _VERSIONS:
        swapped = struct.unpack_from(">I", buf, 4)[0]
        hint = "it is big-endian; convert it to little-endian" if swapped in _VERSIONS else "re-convert it"
        raise GGUFError(f"{where!r} is GGUF version {version}; this reader supports {_VERSIONS}: {hint}")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    unpack = struct.unpack_from
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = unpack("<Q", buf, pos)
        pos += 8 + n
        return buf[pos - n : pos].decode("utf-8", errors="replace")

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype == 8:
            return string()
        if vtype == 9:
            etype, count = unpack("<IQ", buf, pos)
            pos += 12
            if etype in _SCALAR:  # fixed-width elements: one unpack for the whole array
                fmt = f"<{count}{_SCALAR[etype]}"
                items = list(unpack(fmt, buf, pos))
                pos += struct.calcsize(fmt)
                return items
            if etype == 8:  # the tight loop: ~100k vocab and merge strings
                out: list[str] = []
                append, p = out.append, pos
                for _ in range(count):
                    (n,) = unpack("<Q", buf, p)
                    p += 8
                    append(buf[p : p + n].decode("utf-8", errors="replace"))
                    p += n
                pos = p
                return out
            return [value(etype) for _ in range(count)]  # arrays of arrays
        if vtype not in _SCALAR:
            raise GGUFError(f"{where!r}: unknown metadata value type {vtype} at byte {pos}; is the file corrupt?")
        fmt = "<" + _SCALAR[vtype]
        (v,) = unpack(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v

    metadata: dict[str, Any] = {}
    try:
        for _ in range(n_kv):
            key = string()
            (vtype,) = unpack("<I", buf, pos)
            pos += 4
            metadata[key] = value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = unpack("<I", buf, pos)
            ne = unpack(f"<{n_dims}Q", buf, pos + 4)
            type_id, offset = unpack("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, ne, type_id, offset))
    except struct.error as e:
        raise GGUFError(f"{where!r} ends inside its header ({e}); the file is truncated or corrupt") from None
    align = metadata.get("general.alignment", 32)
    data_start = -(-pos // align) * align
    return version, metadata, infos, data_start
