"""Shard-aware loading: each rank reads only the slices of the checkpoint it holds.

Two checkpoint kinds sit behind one ``TensorSource.read(name, rows, cols)``, always in
HF names and HF ``[out, in]`` layout:

* a HF directory: ``config.json`` plus one or many ``*.safetensors`` (with or without
  ``model.safetensors.index.json``); slices come from safetensors ``get_slice``, which
  reads only the requested bytes from the memory-mapped file;
* a ``.gguf`` file: llama.cpp names are mapped to HF names, blocks are dequantized
  only for the requested rows/columns, and Q/K rows are un-permuted back to the HF
  rotate-half layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shardlm.models.config import ConfigError, ModelConfig


class CountingSource:
    """Wraps a source and counts the elements each read returns (for tests and reports)."""

    def __init__(self, inner):
        self.inner, self.elements = inner, 0

    def read(self, name, rows=None, cols=None):
        t = self.inner.read(name, rows, cols)
        self.elements += t.numel()
        return t

    def has(self, name):
        return self.inner.has(name)


class SafetensorsSource:
    def __init__(self, directory: Path):
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise ConfigError(f"no *.safetensors files in {str(directory)!r}; shardlm loads safetensors or GGUF")
        self._handles = {f: safe_open(str(directory / f), framework="pt") for f in files}
        if weight_map is None:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}  # noqa: SIM118 (safe_open is not iterable)
        self._where = weight_map

    def has(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        sl = self._handles[self._where[name]].get_slice(name)
        rows = rows or slice(None)
        return sl[rows, cols] if cols is not None else sl[rows]


_GGUF_NAMES = [
    (r"model\.embed_tokens", "token_embd"),
    (r"model\.norm", "output_norm"),
    (r"lm_head", "output"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj", r"blk.\1.attn_q"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj", r"blk.\1.attn_k"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj", r"blk.\1.attn_v"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj", r"blk.\1.attn_output"),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm", r"blk.\1.attn_q_norm"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm", r"blk.\1.attn_k_norm"),
    (r"model\.layers\.(\d+)\.input_layernorm", r"blk.\1.attn_norm"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm", r"blk.\1.ffn_norm"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj", r"blk.\1.ffn_gate"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj", r"blk.\1.ffn_up"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj", r"blk.\1.ffn_down"),
]


def gguf_name(hf_name: str) -> str:
    module, _, kind = hf_name.rpartition(".")
    for pattern, repl in _GGUF_NAMES:
        if re.fullmatch(pattern, module):
            return f"{re.sub(pattern, repl, module)}.{kind}"
    raise KeyError(f"no GGUF name for {hf_name!r}")


class GGUFSource:
    def __init__(self, gguf, cfg: ModelConfig):
        self.gguf, self.head_dim = gguf, cfg.head_dim
        self._names = set(gguf.tensor_names)
        # llama.cpp permutes Q/K rows only in files of its `llama` architecture (Qwen files are not)
        self._permuted_qk = gguf.metadata.get("general.architecture") == "llama"

    def has(self, name: str) -> bool:
        return gguf_name(name) in self._names

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        from shardlm.models.gguf import unpermute_qk

        t = self.gguf.read(gguf_name(name), rows=rows, cols=cols)
        if self._permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp interleaves each head's rows for its RoPE; the slice holds whole heads
            t = unpermute_qk(t, t.shape[0] // self.head_dim)
        return t

    def holds_int4(self, name: str) -> bool:
        return self.gguf.holds_int4(gguf_name(name))

    def read_int4(self, name: str, rows: slice | None = None, cols: slice | None = None):
        """The Q4_0/Q4_1/Q4_K tensor's rows as ``Int4Blocks`` (Q/K rows un-permuted as in ``read``)."""
        from shardlm.models.gguf import unpermute_qk

        blocks = self.gguf.read_int4(gguf_name(name), rows=rows, cols=cols)
        if self._permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = blocks.q.shape[0] // self.head_dim
            blocks = blocks.map_rows(lambda t: unpermute_qk(t, n))
        return blocks

    def holds_q8(self, name: str) -> bool:
        from gguf import GGMLQuantizationType

        return self.has(name) and self.gguf.info(gguf_name(name)).ggml_type == GGMLQuantizationType.Q8_0

    def read_q8(self, name: str, rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The Q8_0 tensor's rows as (codes, scales) (the embedding / LM head: never permuted)."""
        return self.gguf.read_q8(gguf_name(name), rows=rows)


@dataclass(frozen=True)
class Checkpoint:
    """A resolved model: where it is, what kind, and its architecture."""

    path: Path
    kind: str  # "gguf" or "hf"
    config: ModelConfig

    def source(self):
        if self.kind == "hf":
            return SafetensorsSource(self.path)
        from shardlm.models.gguf import GGUFFile

        return GGUFSource(GGUFFile(self.path), self.config)

    def tokenizer(self):
        from shardlm.models.tokenizer import Tokenizer

        if self.kind == "hf":
            return Tokenizer.from_pretrained(self.path)
        from shardlm.models.gguf import GGUFFile

        return Tokenizer.from_gguf(GGUFFile(self.path))


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def open_checkpoint(model: str | Path) -> Checkpoint:
    """Resolve ``smollm2``, a HF directory, a ``.gguf`` file, or a HF hub id found in the local HF
    cache (never downloaded); read only its metadata."""
    from shardlm.models import registry

    path = registry.resolve(str(model)) if str(model) in registry.MODELS else Path(model)
    if not path.exists() and HUB_ID.fullmatch(str(model)):
        path = from_hub_cache(str(model))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(f"{str(path)!r} has no config.json; give a HF model directory, a .gguf file or 'smollm2'")
        return Checkpoint(path, "hf", ModelConfig.from_json_file(path / "config.json"))
    if path.suffix == ".gguf" and path.is_file():
        from shardlm.models.gguf import GGUFFile

        gguf = GGUFFile(path)
        cfg = ModelConfig.from_gguf(gguf.metadata)
        # GGUF leaves out output.weight when the LM head is the token embedding
        cfg = dataclasses.replace(cfg, tie_word_embeddings="output.weight" not in set(gguf.tensor_names))
        return Checkpoint(path, "gguf", cfg)
    raise ConfigError(
        f"model {str(model)!r} not found: give 'smollm2' (the embedded SmolLM2-135M-Instruct), "
        f"a HF directory with config.json and *.safetensors, or a .gguf file"
    )


def from_hub_cache(repo_id: str) -> Path:
    """The local snapshot of a HF hub model, as ``vllm serve ORG/NAME`` finds it once downloaded
    (``HF_HUB_CACHE`` / ``HF_HOME`` are honoured); shardlm never downloads."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"model {repo_id!r} is not a local path and is not in the HF cache {cache}; shardlm does not "
            f"download: fetch it first (huggingface-cli download {repo_id}) or give its directory"
        ) from None


def load_model(
    ckpt: Checkpoint,
    dims,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    layers: range | Sequence[range] | None = None,
    source=None,
    sequence_parallel: bool = False,
    int4: str | None = None,
):
    """Build this rank's shard of the model and fill it from the checkpoint's slices; ``int4``
    ('int4' or 'gguf', see ``parallel.tensor.Int8Weight.int4``): linear layers load as packed int4."""
    from shardlm.models.transformer import Transformer
    from shardlm.parallel.tensor import prepare_int4

    if int4 == "gguf" and ckpt.kind != "gguf":
        raise ConfigError(
            f"quantization='gguf' keeps a GGUF file's 4-bit blocks, and {str(ckpt.path)!r} is a HF directory; "
            f"use quantization='int4' (group-wise int4 from its float weights) or 'int8'"
        )
    if int4 is not None and torch.device(device).type not in ("cpu", "cuda"):
        raise ConfigError(
            f"quantization={int4!r} runs shardlm's CPU int4 kernel or torch's CUDA one (parallel/int4.py), and "
            f"this run is on {torch.device(device).type}; use quantization='int8' there (or none)"
        )

    with torch.device(device):
        model = Transformer(
            ckpt.config,
            dims,
            dtype=dtype,
            max_positions=max_positions,
            layers=layers,
            sequence_parallel=sequence_parallel,
        )
    if int4 is not None:
        prepare_int4(model, int4)
    model.load(source if source is not None else ckpt.source())
    return model.eval()
