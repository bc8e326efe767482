"""compile=True: decode steps through torch.compile give HF's greedy tokens, and compile once
per shape class (one sequence, several), never again as contexts and batches change.

Reference: HF transformers' greedy tokens (float32, identical), as in test_tp_models.
Slow: each shape class compiles with inductor (C++), ~50 s on 2 cores; the model has 2
layers since the compiled graph unrolls every layer and compile time grows with it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.moe_reference import cached_tiny_moe
from harness.multirank import run_ranks
from harness.rankfns import compiled_runs, llm_greedy
from harness.reference import NEW_TOKENS, PROMPTS, build_tiny
from shardlm import LLM
from shardlm.errors import UsageError


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return build_tiny("mistral", tmp_path_factory.mktemp("mistral"), num_hidden_layers=2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_compiled_decode_matches_hf_and_never_recompiles(mistral, layout):
    """Mistral: grouped KV heads and a sliding window inside the compiled graph. tp=2: the
    all-reduces and the head's all-gather are ops in the graph; pp=2: each stage compiles its own
    layers, the second starting from the hidden state it receives, with micro-batches in flight."""
    ref = mistral
    for rank, (runs, classes, graphs) in enumerate(
        run_ranks(2, compiled_runs, str(ref.path), PROMPTS, NEW_TOKENS, **layout)
    ):
        assert classes == {False, True} and graphs == 2, f"rank {rank}: {graphs} graphs (a graph break?)"
        for indices, max_tokens, tokens in runs:
            expected = [ref.tokens[i][:n] for i, n in zip(indices, max_tokens)]
            assert tokens == expected, f"rank {rank} of {layout}: prompts {indices} disagree with HF"
    assert len({tuple(t) for t in ref.tokens}) == len(PROMPTS)  # distinct answers: a mix-up would show


@pytest.mark.slow
def test_compiled_decode_with_int8_weights_and_cache(mistral):
    """The quantized paths are opaque ops too (the int8 weight kernel, the byte-packed KV cache):
    compiled decode gives eager's tokens with one graph per shape class."""
    options = dict(quantization="int8", kv_cache_dtype="int8")
    [(runs, classes, graphs)] = run_ranks(1, compiled_runs, str(mistral.path), PROMPTS, NEW_TOKENS, **options)
    [(eager, _, _)] = run_ranks(1, llm_greedy, str(mistral.path), PROMPTS, NEW_TOKENS, block_size=4, **options)
    assert classes == {False, True} and graphs == 2
    indices, _, tokens = runs[0]  # every prompt, decoded together
    assert tokens == [eager[i] for i in indices]
    assert eager != mistral.tokens  # quantized: not HF's float32 answers, so the options took effect


def test_ranks_that_do_not_compile_never_import_dynamo():
    """torch._dynamo costs every rank ~2 s of start-up; only the compiling runner imports it."""
    code = (
        "import sys, shardlm.engine.llm, shardlm.engine.worker, shardlm.launch, shardlm.server.cli; "
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_compile_refuses_moe(tmp_path_factory):
    ref = cached_tiny_moe("mixtral", tmp_path_factory)
    with pytest.raises(UsageError, match="mixture of experts.*drop --compile"):
        LLM(str(ref.path), compile=True)
