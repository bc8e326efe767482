"""int4 weights in one process: GGUF Q4_0/Q4_1 blocks read as int4 codes, scales and offsets (no
float weight), shardlm's int4 kernel against the dequantized weights, and the refusals.

Tolerances: the mapping (scale d, offset m) reproduces ``gguf.quants.dequantize`` up to float32
rounding of d * q + m (2^-22 of the block's |m| + 16 |d|), and exactly on the files here; the
re-encoded blocks (codes, float16 d and m) equal the file's bytes exactly. The kernel rounds the
activations to int8 per group of 32 (1/254 of each group's largest |x|): 1e-2 of the largest output.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from shardlm.errors import UsageError
from shardlm.models.gguf import GGUFError, GGUFFile
from shardlm.models.registry import smollm2_gguf_path
from shardlm.parallel.int4 import (
    GEMM_ROWS,
    INT4_GROUP,
    Int4Blocks,
    check_int4_shape,
    int4_groups,
    native_kernel,
    pack_int4,
    q8_groups,
    unpack_int4,
)
from shardlm.parallel.tensor import linear


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory) -> tuple[GGUFFile, dict[str, np.ndarray]]:
    """A GGUF file with a Q4_0, a Q4_1 and a Q8_0 tensor [48, 128] (blocks quantized by gguf-py)."""
    path = tmp_path_factory.mktemp("q4") / "q4.gguf"
    w = GGUFWriter(str(path), "llama")
    g = np.random.default_rng(0)
    raw = {}
    for name, qtype in (("a.weight", Q.Q4_0), ("b.weight", Q.Q4_1), ("c.weight", Q.Q8_0)):
        x = (g.standard_normal((48, 128)) * 0.05 + g.standard_normal((48, 1)) * 0.02).astype(np.float32)
        raw[name] = quantize(x, qtype)
        w.add_tensor(name, raw[name], raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path), raw


def encode(blocks: Int4Blocks, qtype: Q) -> np.ndarray:
    """``blocks`` back to ggml's block bytes: d, [m,] then the codes two a byte."""
    rows, cols = blocks.q.shape
    q = blocks.q.reshape(rows, cols // 32, 2, 16)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).numpy()  # element j low nibble, 16 + j high nibble
    d = blocks.scale.half().numpy()[..., None].view(np.uint8)
    parts = [d]
    if qtype == Q.Q4_1:
        parts.append(blocks.offset.half().numpy()[..., None].view(np.uint8))
    else:
        assert torch.equal(blocks.offset, -8 * blocks.scale)
    return np.concatenate([*parts, qs], axis=-1).reshape(rows, -1)


@pytest.mark.parametrize(("name", "qtype"), [("a.weight", Q.Q4_0), ("b.weight", Q.Q4_1)])
def test_q4_blocks_map_exactly_onto_int4_groups(q4_file, name, qtype):
    gguf, raw = q4_file
    blocks = gguf.read_int4(name)
    assert blocks.q.dtype == torch.uint8 and int(blocks.q.max()) <= 15
    # the codes, d and m are the file's bytes, bit for bit
    assert np.array_equal(encode(blocks, qtype), raw[name])
    want = torch.from_numpy(dequantize(raw[name], qtype))
    tol = 2.0**-22 * (blocks.offset.abs() + 16 * blocks.scale.abs()).repeat_interleave(INT4_GROUP, 1)
    assert torch.all((blocks.dequantize() - want).abs() <= tol)
    assert torch.equal(blocks.dequantize(), want)  # and exactly, on this file
    # a rank's slice: its rows' blocks only, the same values
    part = gguf.read_int4(name, rows=slice(16, 32), cols=slice(32, 96))
    assert torch.equal(part.dequantize(), want[16:32, 32:96])


def test_q4_k_blocks_map_onto_int4_groups(tmp_path):
    """Q4_K (gguf-py cannot quantize to it): random blocks, each sub-block of 32 with its own 6-bit
    scale and min; a column window crossing super-blocks reads the covering blocks and trims."""
    rng = np.random.default_rng(1)
    rows, cols = 32, 512
    raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    raw[..., 0:4] = (rng.standard_normal((rows, cols // 256, 2)) * 1e-3).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    w = GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("k.weight", raw, raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gguf = GGUFFile(tmp_path / "k.gguf")
    want = torch.from_numpy(dequantize(raw, Q.Q4_K))
    blocks = gguf.read_int4("k.weight")
    tol = 2.0**-22 * (blocks.offset.abs() + 16 * blocks.scale.abs()).repeat_interleave(INT4_GROUP, 1)
    assert torch.all((blocks.dequantize() - want).abs() <= tol)
    part = gguf.read_int4("k.weight", rows=slice(8, 24), cols=slice(192, 320))
    assert torch.equal(part.dequantize(), blocks.dequantize()[8:24, 192:320])


def test_smollm2_q4_1_layers_read_as_int4_equal_the_dequantized_file():
    gguf = GGUFFile(smollm2_gguf_path())
    for name in ("blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_gate.weight"):
        assert gguf.holds_int4(name)
        assert torch.equal(gguf.read_int4(name, rows=slice(0, 64)).dequantize(), gguf.read(name, rows=slice(0, 64)))
    assert not gguf.holds_int4("token_embd.weight")  # Q8_0: dequantized, never int4


def test_read_int4_refuses_other_types_and_split_blocks(q4_file):
    gguf, _ = q4_file
    with pytest.raises(GGUFError, match="'c.weight' is Q8_0 \\[48, 128\\]; read_int4 reads 2-D Q4_0/Q4_1/Q4_K"):
        gguf.read_int4("c.weight")
    with pytest.raises(GGUFError, match=r"cols \[16, 64\) do not hold whole blocks of 32"):
        gguf.read_int4("b.weight", cols=slice(16, 64))


@pytest.mark.parametrize("rows", [1, 5, GEMM_ROWS + 3])
def test_int4_linear_matches_its_dequantized_weights(rows):
    """40 output rows and 3 groups of in-features: any row count, and an odd group out of the
    kernel's two-a-turn loop; 1 and 5 rows take the integer path, GEMM_ROWS + 3 the float GEMM."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 96, generator=g), torch.randn(rows, 96, generator=g)
    blocks = int4_groups(w)
    deq = blocks.dequantize()
    assert (deq - w).abs().max() <= blocks.scale.max() / 2 + 1e-3  # round to nearest (float16 offsets: ~2^-11 |min|)
    codes, scales = pack_int4(blocks)
    assert codes.dtype == torch.uint8 and codes.shape == (40, 48) and scales.shape == (2, 40, 3)
    assert torch.equal(unpack_int4(codes, scales), deq)
    want = x @ deq.T
    got = linear(x, codes, None, scales)
    assert got.dtype == torch.float32
    err = (got - want).abs().max()
    if rows < GEMM_ROWS:  # activations rounded to int8: close, not exact
        assert 1e-5 * want.abs().max() < err <= 1e-2 * want.abs().max()
    else:
        assert err <= 1e-5 * want.abs().max()
    # the old zero convention (offset + 8 scale) is caught
    bad_codes, bad_scales = pack_int4(Int4Blocks(blocks.q, blocks.scale, blocks.offset + 8 * blocks.scale))
    assert (linear(x, bad_codes, None, bad_scales) - want).abs().max() > 0.1 * want.abs().max()


@pytest.mark.parametrize("cols", [160, 352])
def test_int4_portable_loop_agrees_with_the_avx2_one(cols):
    """The loop for CPUs without AVX2 (forced here) against the vectorised one on this CPU; 6 rows
    (a tile of 4, then single rows), and 5 or 11 groups of in-features: the vectorised loop's
    eight groups a turn, the pairs left and an odd last group."""
    if not native_kernel() or not torch.ops.shardlm_int4.vectorised():
        pytest.skip("no vectorised kernel on this machine to compare with")
    g = torch.Generator().manual_seed(1)
    codes, scales = pack_int4(int4_groups(torch.randn(24, cols, generator=g)))
    x = torch.randn(6, cols, generator=g)
    simd = torch.ops.shardlm_int4.linear(x, codes, scales, GEMM_ROWS, True)
    portable = torch.ops.shardlm_int4.linear(x, codes, scales, GEMM_ROWS, False)
    torch.testing.assert_close(portable, simd, rtol=1e-5, atol=1e-5 * simd.abs().max().item())


def test_the_kernel_splits_its_loops_over_torchs_threads():
    """Built with OpenMP: at::parallel_for is pragmas in a header, which a build without -fopenmp
    ignores (every loop then ran on one thread, whatever torch.set_num_threads said)."""
    if not native_kernel():
        pytest.skip("no C++ kernel on this machine")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.ops.shardlm_int4.parallel_threads() == 2
        torch.set_num_threads(1)
        assert torch.ops.shardlm_int4.parallel_threads() == 1
        # layers large enough to split (over 2^19 multiply-adds; 16 x 18 blocks of activations to
        # quantize): each output column is one thread's, so two threads give one thread's bits
        g = torch.Generator().manual_seed(2)
        codes, scales = pack_int4(int4_groups(torch.randn(1000, 576, generator=g)))
        for rows in (1, 16):
            x = torch.randn(rows, 576, generator=g)
            one = torch.ops.shardlm_int4.linear(x, codes, scales, GEMM_ROWS)
            torch.set_num_threads(2)
            assert torch.equal(torch.ops.shardlm_int4.linear(x, codes, scales, GEMM_ROWS), one)
            torch.set_num_threads(1)
    finally:
        torch.set_num_threads(before)


def test_int4_shapes_the_kernel_cannot_hold_are_refused():
    check_int4_shape("blk.0.down", 128, col_offset=256)  # whole groups
    with pytest.raises(UsageError, match=r"down holds in-features \[48, 96\) on this rank.*groups of 32"):
        check_int4_shape("down", 48, col_offset=48)


def test_int4_off_cpu_and_cuda_is_refused():
    from shardlm.models.loader import load_model, open_checkpoint
    from shardlm.parallel.dims import ParallelDims

    ckpt = open_checkpoint(smollm2_gguf_path())
    with pytest.raises(UsageError, match="quantization='gguf' runs shardlm's CPU int4 kernel or torch's CUDA one"):
        load_model(ckpt, ParallelDims(), device="meta", int4="gguf")


def test_tinygemm_packing_keeps_the_weight():
    """pack_int4_cuda's arithmetic, checked on the CPU: the even column in the high nibble, and the
    zero tinygemm adds to (q - 8) x scale restores q x scale + offset."""
    from shardlm.parallel.int4 import inner_k_tiles

    blocks = int4_groups(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)))
    q = blocks.q
    pairs = q[:, 0::2] << 4 | q[:, 1::2]
    assert torch.equal(torch.stack([pairs >> 4, pairs & 15], dim=-1).reshape(q.shape), q)
    zero = blocks.offset + 8 * blocks.scale
    tiny = (q.float() - 8) * blocks.scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    torch.testing.assert_close(tiny, blocks.dequantize())
    assert [inner_k_tiles(k) for k in (32, 64, 96, 128, 576, 1536)] == [2, 4, 2, 8, 4, 8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_native_kv_write_and_decode_attention_equal_the_python_ops(dtype, window):
    """The C++ cache write and one-token attention (taken with int4 weights) against the Python
    ops on the same paged cache: three sequences of 9, 1 and 14 tokens over scattered blocks of 4."""
    from shardlm.models.attention import decode_attention, write_kv

    if not native_kernel():
        pytest.skip("no C++ compiler here: the Python ops run instead")
    g = torch.Generator().manual_seed(2)
    blocks, bs, kv, group, d = 12, 4, 2, 3, 32
    tables = torch.tensor([[7, 2, 9, 0], [5, 0, 0, 0], [1, 11, 3, 8]])
    lens = torch.tensor([9, 1, 14])
    slots = torch.cat(
        [tables[b, torch.arange(n) // bs] * bs + torch.arange(n) % bs for b, n in enumerate(lens.tolist())]
    )
    k, v = (torch.randn(len(slots), kv, d, generator=g).to(dtype) for _ in range(2))
    python, cpp = (torch.zeros(2, blocks, bs, kv, d, dtype=dtype) for _ in range(2))
    write_kv(python, k, v, slots)
    torch.ops.shardlm_int4.write_kv(cpp, k, v, slots)
    assert torch.equal(python, cpp)
    q = torch.randn(3, kv, group, d, generator=g).to(dtype)
    want = decode_attention(q, python, tables, lens, int(lens.max()), 0.125, window, padded=True)
    got = torch.ops.shardlm_int4.decode_attention(q, cpp, tables, lens, 0.125, window or 0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # float32 sums either way; bfloat16 outputs rounded
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    other = torch.ops.shardlm_int4.decode_attention(q, cpp, tables, lens, 0.125, 3 if window is None else 0)
    assert (other - want).abs().max() > 10 * tol  # a different window is caught


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [None, 280])
def test_native_decode_attention_merges_the_stretches_of_a_long_context(threads, window):
    """One sequence of 300 tokens and one kv head: the C++ op splits an attended span of 256 or
    more positions into stretches (enough tasks for two a thread) and merges their partial
    softmaxes; equal to the Python op."""
    from shardlm.models.attention import decode_attention

    if not native_kernel():
        pytest.skip("no C++ compiler here: the Python ops run instead")
    g = torch.Generator().manual_seed(3)
    bs, n, group, d = 16, 300, 4, 64
    tables = torch.randperm(24, generator=g)[None, :19]
    cache = torch.randn(2, 24, bs, 1, d, generator=g)
    q = torch.randn(1, 1, group, d, generator=g)
    lens = torch.tensor([n])
    want = decode_attention(q, cache, tables, lens, n, 0.125, window, padded=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.ops.shardlm_int4.decode_attention(q, cache, tables, lens, 0.125, window or 0)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_the_kernel_layers_widen_their_weights(monkeypatch):
    """No C++ compiler: int4 and Q8_0 layers multiply their widened weights in float (exactly)."""
    from shardlm.parallel import int4

    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(24, 64, generator=g), torch.randn(2, 64, generator=g)
    blocks = int4_groups(w)
    codes, scales = pack_int4(blocks)
    q8, d8 = q8_groups(w)
    monkeypatch.setattr(int4, "NATIVE", False)
    torch.testing.assert_close(linear(x, codes, None, scales), x @ blocks.dequantize().T)
    widened = (q8.float().view(24, 2, 32) * d8.float()[..., None]).view(24, 64)
    torch.testing.assert_close(linear(x, q8, None, d8), x @ widened.T)
