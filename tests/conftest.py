"""Shared fixtures: tiny HF reference models, built once per session."""

from __future__ import annotations

import math

import pytest

from harness.reference import SMOLLM2_QUESTIONS, build_tiny, load_hf_smollm2, smollm2_reference


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(name) -> Reference: a saved random HF model and HF's outputs on PROMPTS."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_tiny(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_smollm2():
    return load_hf_smollm2()


@pytest.fixture(scope="session")
def smollm2(hf_smollm2, tmp_path_factory):
    """(GGUF path, chat prompts as ids, HF's greedy reference, parameter count of the model)."""
    from shardlm.models.gguf import GGUFFile
    from shardlm.models.loader import open_checkpoint

    ckpt = open_checkpoint("smollm2")
    tok = ckpt.tokenizer()
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in SMOLLM2_QUESTIONS]
    gguf = GGUFFile(ckpt.path)
    total = sum(math.prod(gguf.shape(n)) for n in gguf.tensor_names)  # elements of the whole model
    return str(ckpt.path), prompts, smollm2_reference(hf_smollm2, tmp_path_factory.mktemp("smollm2"), prompts), total
