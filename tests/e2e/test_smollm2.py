"""The real SmolLM2-135M-Instruct (GGUF, 9 query heads, 3 KV heads) at tp = 1..4 against HF.

HF loads the same GGUF with its own dequantizer and Q/K un-permutation, so both
sides hold identical float32 weights. Tolerance as for the tiny models: greedy
tokens identical, logits within rtol = atol = 1e-4 (reduction order only).
tp = 2 and 4 split the 9 heads unevenly (5+4, 3+2+2+2) and replicate KV heads.
"""

from __future__ import annotations

import pytest
import torch

from harness.multirank import run_ranks
from harness.rankfns import greedy_and_logits, shard_read_elements
from harness.reference import NEW_TOKENS


@pytest.mark.parametrize("tp", [1, *(pytest.param(tp, marks=pytest.mark.slow) for tp in (2, 3, 4))])
def test_smollm2_matches_hf(smollm2, tp):
    path, prompts, ref, total = smollm2
    results = run_ranks(tp, greedy_and_logits, path, tp, prompts, NEW_TOKENS)
    for rank, (tokens, logits, _) in enumerate(results):
        assert tokens == ref.tokens, f"rank {rank} of tp={tp} disagrees with HF"
        torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)
    assert len(ref.tokens[0]) == NEW_TOKENS  # a full-length answer, not an early stop
    assert len({tuple(t) for t in ref.tokens}) == len(prompts)
    # parameter bytes per rank fall as ~1/tp. The excess on the largest rank: 9 heads
    # split 3+2+2+2 at tp=4 put 3/9 of the attention on rank 0 instead of 1/4, plus
    # replicated KV heads and norms: +6.6%
    per_rank = [nbytes for _, _, nbytes in results]
    assert max(per_rank) <= total * 4 / tp * 1.10
    assert sum(per_rank) >= total * 4  # the shards cover the whole model


def test_each_rank_reads_only_what_it_holds(smollm2):
    """No rank materialises the whole model: at tp=4 each reads exactly its own slices."""
    path, total = smollm2[0], smollm2[3]
    for read, held in run_ranks(4, shard_read_elements, path, 4):
        assert read == held
        assert read < total / 2


@pytest.mark.parametrize("layout", [{}, pytest.param(dict(tp=2), marks=pytest.mark.slow)])
def test_stop_strings_end_generation_on_the_ranks(smollm2, layout):
    """A stop string ends the sequence at the token that completes it: the ranks stop generating."""
    from shardlm import LLM, SamplingParams
    from shardlm.models.loader import open_checkpoint

    path, prompts, ref, _ = smollm2
    tok = open_checkpoint(path).tokenizer()
    full = tok.decode(ref.tokens[0])
    # six characters the greedy answer reaches once, past half way
    stop = next(full[i : i + 6] for i in range(len(full) // 2, len(full)) if full.count(full[i : i + 6]) == 1)
    end = next(n for n in range(1, NEW_TOKENS + 1) if stop in tok.decode(ref.tokens[0][:n]))
    with LLM(path, threads=1, **layout) as llm:
        out = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=["zzz-never", stop]))
        text = "The capital of France is"  # a text prompt gets its text back, cut before the stop string
        plain = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].text
        cut = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=plain[8:12]))[0]
    assert cut.text == plain[: plain.find(plain[8:12])] and cut.finish_reason == "stop"
    choice = out[0].outputs[0]
    assert choice.token_ids == ref.tokens[0][:end] and end < NEW_TOKENS
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
