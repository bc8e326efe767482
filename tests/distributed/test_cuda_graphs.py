"""CUDA graphs of decode steps: every step (decodes, and prompt tokens as decode rows) padded
to its shape class (batch 1, 2, 4, 8, 16, ...; power-of-two block tables) gives HF's greedy
tokens; on a GPU the classes are captured and replayed (the default there), on a CPU the same
padded inputs run eagerly, which checks the padding (masking past each context, padding rows
confined to the scratch block) and the prompt rows in CI.

Tolerance: float32 greedy tokens identical to HF's, as in test_tp_models.
"""

from __future__ import annotations

import pytest
import torch

from harness.multirank import run_ranks, run_ranks_on
from harness.rankfns import graph_runs, llm_greedy
from harness.reference import NEW_TOKENS, PROMPTS
from shardlm import LLM, SamplingParams
from shardlm.engine.cuda_graphs import DecodeGraphs, batch_class, blocks_class, prompt_rows_fit

THREE = PROMPTS[:3]
"""Decoded as a batch of 4 from the start, so the padding row runs while every block is in use."""
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_shape_classes():
    assert [batch_class(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33)] == [1, 2, 4, 8, 8, 16, 16, 24, 40]
    assert [blocks_class(n) for n in (1, 2, 3, 4, 5, 9)] == [2, 2, 4, 4, 8, 16]
    graphs = DecodeGraphs(None, device=torch.device("cpu"), block_size=16, scratch_block=0, max_batch=250)
    assert graphs.max_batch == 256 and graphs.fits(256) and not graphs.fits(257)
    assert prompt_rows_fit(72, 8, 16)  # a prompt joining 32 decodes
    assert not prompt_rows_fit(256, 512, 16)  # a prompt chunk deep into a long context: eager


def _check(ref, runs, classes):
    for indices, max_tokens, tokens in runs:
        assert tokens == [ref.tokens[i][:n] for i, n in zip(indices, max_tokens)], f"prompts {indices}"
    # padding rows (the runs of 3 sequences ran as 4) and tables that grew through several widths
    assert {1, 2, 4} <= {b for b, _ in classes} and len({w for _, w in classes}) >= 3, classes


@pytest.mark.parametrize(
    "layout", [dict(max_num_batched_tokens=8), dict(pp=2, micro_batches=1)], ids=["tp1-chunked", "pp2"]
)
def test_padded_steps_match_hf(tiny, layout):
    """Llama: grouped KV heads. Prompts are computed as rows of the same graphs; chunked (8 prompt
    tokens a step): steps that mix prompt chunks and decodes. pp=2: the second stage's input is
    the hidden state, padded too (one micro-batch, so that batches of 3 reach it whole)."""
    ref = tiny("llama")
    for runs, classes, captured in run_ranks(
        1 + ("pp" in layout), graph_runs, str(ref.path), THREE, NEW_TOKENS, device="cpu", **layout
    ):
        _check(ref, runs, classes)
        assert captured == 0  # no GPU: run eagerly


def test_padded_steps_with_a_sliding_window(tiny):
    ref = tiny("mistral")
    [(runs, classes, _)] = run_ranks(1, graph_runs, str(ref.path), THREE, NEW_TOKENS, device="cpu")
    _check(ref, runs, classes)


def test_quantized_cache_keeps_prompts_eager(tiny):
    """With an int8 KV cache an eager prompt attends to its own keys at full precision, a decode
    row to the cache's: prompt steps stay out of the graphs, decodes use them, tokens are eager's."""
    ref = tiny("llama")
    options = dict(device="cpu", kv_cache_dtype="int8")
    [(runs, classes, _)] = run_ranks(1, graph_runs, str(ref.path), THREE, NEW_TOKENS, **options)
    [(eager, _, _)] = run_ranks(1, llm_greedy, str(ref.path), THREE, NEW_TOKENS, block_size=4, **options)
    assert runs[0][2] == eager
    assert {b for b, _ in classes} == {1, 2, 4}, classes  # prompts as rows would add a class of 24


@needs_cuda
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_cuda_graphs_match_hf(tiny, name):
    """On the GPU: each class captured once, replayed for every later step of its shape."""
    ref = tiny(name)
    [(runs, classes, captured)] = run_ranks_on(
        "nccl", 1, graph_runs, str(ref.path), THREE, NEW_TOKENS, device="cuda", dtype="float32"
    )
    _check(ref, runs, classes)
    assert captured == len(classes)


@needs_cuda
def test_enforce_eager_captures_nothing(tiny):
    ref = tiny("llama")
    with LLM(str(ref.path), device="cuda", dtype="float32", enforce_eager=True) as llm:
        assert llm.worker.runner.graphs is None
        out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [o.token_ids for o in out] == ref.tokens
