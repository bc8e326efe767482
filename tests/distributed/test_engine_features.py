"""Chunked prefill and prefix caching change how work is scheduled, never what is generated.

Reference: HF transformers' greedy tokens (float32, identical), as in test_tp_models.
"""

from __future__ import annotations

import pytest
import torch

from harness.multirank import run_ranks
from harness.rankfns import llm_greedy
from harness.reference import NEW_TOKENS, PROMPTS
from shardlm import LLM, SamplingParams


def hf_greedy(path, prompts, new_tokens=NEW_TOKENS):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens)
            out.append(g[0, len(p) :].tolist())
    return out


def record_batches(llm: LLM) -> list:
    """Wrap every scheduler of the in-process engine to record (counts, decoding flags) per step."""
    seen = []
    for sched in llm.worker.engine.scheds:
        original = sched.schedule

        def spy(original=original):
            batch = original()
            seen.append((list(batch.counts), [s.is_decoding for s in batch.seqs]))
            return batch

        sched.schedule = spy
    return seen


def test_chunked_prefill_matches_hf(tiny):
    ref = tiny("llama")
    llm = LLM(str(ref.path), threads=1, max_num_batched_tokens=8, block_size=4)
    seen = record_batches(llm)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [o.token_ids for o in out] == ref.tokens
    # the 17- and 33-token prompts were cut into chunks of at most the budget...
    assert all(sum(counts) <= 8 for counts, _ in seen)  # 4 sequences never need more than the budget
    assert any(c > 1 for counts, _ in seen for c in counts)
    # ...while other sequences kept decoding in the same steps
    assert any(any(flags) and any(c > 1 for c in counts) for counts, flags in seen)


def test_prefix_cache_reuses_blocks_and_matches_hf(tiny):
    ref = tiny("qwen2")
    shared = PROMPTS[3][:24]  # six blocks of 4 tokens
    prompts = [shared + [9, 8, 7], shared + [1, 2], shared[:13] + [42]]
    want = hf_greedy(ref.path, prompts)
    llm = LLM(str(ref.path), threads=1, block_size=4)
    first = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    blocks = llm.worker.engine.blocks
    hits_before = blocks.hits
    rest = llm.generate(prompts[1:], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [o.token_ids for o in first + rest] == want
    # the second prompt found its 24 shared tokens (6 blocks) and the third its first 3 blocks
    assert blocks.hits - hits_before == 24 + 12
    assert want[0] != want[1]  # different tails lead to different answers: a mix-up would show


@pytest.mark.parametrize("layout", [dict(tp=2, pp=2)])
def test_chunks_and_cache_across_ranks(tiny, layout):
    ref = tiny("llama")
    for tokens, _, _ in run_ranks(
        4, llm_greedy, str(ref.path), PROMPTS * 2, NEW_TOKENS, block_size=4, max_num_batched_tokens=8, **layout
    ):
        assert tokens == ref.tokens * 2  # the repeats hit the cache and still give HF's tokens


def test_a_prompt_must_have_a_token_and_fit_max_model_len(tiny):
    """``LLM.encode`` refuses what no step could run, naming the numbers (the CLI's run of the same
    refusal is in the slow tier)."""
    from shardlm.errors import UsageError

    llm = LLM(str(tiny("llama").path), threads=1, max_model_len=8)
    assert llm.encode(list(range(7))) == list(range(7))
    with pytest.raises(UsageError, match=r"prompt of 8 tokens does not fit the context of 8 tokens \(max_model_len\)"):
        llm.encode(list(range(8)))
    with pytest.raises(UsageError, match="an empty prompt has no token"):
        llm.encode([])
