"""Speculative decoding with n-gram drafts: the proposer, the verifier, and whole runs.

Greedy runs must give exactly the tokens of plain decoding (drafts change how many steps it
takes, never what is generated); sampled runs must keep the target distribution, checked on
the verifier by Monte Carlo. Each test also shows that drafts were accepted, so it cannot
pass by never speculating.
"""

from __future__ import annotations

import pytest
import torch

from harness.multirank import run_ranks
from harness.rankfns import llm_generate
from harness.reference import PROMPTS
from shardlm import LLM, SamplingParams
from shardlm.engine.speculative import SpeculativeConfig, propose, verify
from shardlm.errors import UsageError

NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.mark.parametrize(
    "tokens,limit,want",
    [
        ([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 9, [8, 1, 2]),  # the latest occurrence of the longest suffix
        ([4, 5, 6, 7, 0, 5, 6, 1, 5, 6], 9, [1, 5, 6]),  # "5 6" twice before: the later one wins
        ([4, 5, 6, 7, 0, 9, 6], 9, [7, 0, 9]),  # only the last token occurs before: n = 1
        ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),  # at most ``limit`` drafts
        ([1, 2, 3, 4], 9, []),  # nothing repeats: no draft
        ([7, 256, 0, 5, 1], 9, []),  # token 1's bytes appear inside "256 0" (misaligned): not a match
        ([1, 9, 256, 0, 5, 1], 9, [9, 256, 0]),
        ([3, 3], 9, [3]),  # the continuation may run into the suffix itself
        ([3], 9, []),
    ],
)
def test_propose_finds_what_followed_the_suffix_before(tokens, limit, want):
    assert propose(tokens, NGRAM, limit) == want


def test_propose_respects_prompt_lookup_min():
    assert propose([4, 5, 6, 7, 0, 9, 6], SpeculativeConfig(prompt_lookup_min=2), 9) == []
    assert propose([4, 5, 6, 7, 0, 5, 6], SpeculativeConfig(prompt_lookup_min=2), 9) == [7, 0, 5, 6]


def test_greedy_verify_accepts_drafts_while_the_model_agrees():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 4, 7, 2]):
        logits[row, best] = 1.0
    assert verify(logits, [3, 4, 5], SamplingParams(temperature=0.0), None) == [3, 4, 7]  # third draft wrong: 7 instead
    assert verify(logits, [3, 4, 7], SamplingParams(temperature=0.0), None) == [3, 4, 7, 2]  # all right: one more
    assert verify(logits, [0, 4, 7], SamplingParams(temperature=0.0), None) == [3]


@pytest.mark.slow
def test_sampled_verify_keeps_the_target_distribution():
    """Whatever the draft, each emitted token is distributed as the target's (temperature, top-k
    and top-p applied): 12000 draws (seeded), every token's frequency within 0.015 of its probability
    (3 standard errors at p = 0.5)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 0.2, 0.1, 0.3]])
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.95)
    from shardlm.engine.sampling import probabilities

    want = [probabilities(row, params) for row in logits]
    for draft in (0, 2, 4):  # likely, unlikely, and outside top-k
        first, second = torch.zeros(5), torch.zeros(5)
        n = 12_000
        for _ in range(n):
            out = verify(logits, [draft], params, g)
            first[out[0]] += 1
            if len(out) == 2:
                second[out[1]] += 1
        torch.testing.assert_close(first / n, want[0], atol=0.015, rtol=0)
        if draft == 0:  # accepted most of the time; after it the next token comes from the next row
            torch.testing.assert_close(second / first[0], want[1], atol=0.02, rtol=0)
    # it can fail: always accepting the draft would put all mass on it
    assert want[0][2] < 0.2


@pytest.mark.slow
def test_tiny_models_generate_the_same_greedy_tokens_with_drafts(tiny):
    """One process, tp=2 and pp=2 x tp=2 (the last stage sends each step's verified runs up the
    pipeline): 200 tokens a prompt, so the random model falls into repeats that drafts
    predict."""
    ref = tiny("llama")
    n = [200] * len(PROMPTS)
    plain = LLM(str(ref.path), threads=1).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=200))
    spec = LLM(str(ref.path), threads=1, speculative_config={"num_speculative_tokens": 3})
    out = spec.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=200))
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert [o.token_ids[:32] for o in out] == ref.tokens  # and HF's own greedy tokens
    stats = spec.last_stats
    assert stats.draft_tokens > stats.accepted_tokens > 0, (stats.draft_tokens, stats.accepted_tokens)
    for layout in (dict(tp=2), dict(pp=2, tp=2)):
        world = layout.get("tp", 1) * layout.get("pp", 1)
        for tokens, _ in run_ranks(
            world, llm_generate, str(ref.path), PROMPTS, n, speculative_config={"num_speculative_tokens": 3}, **layout
        ):
            assert tokens == [o.token_ids for o in plain], layout


@pytest.mark.slow
def test_smollm2_repeating_text_takes_fewer_steps_for_the_same_tokens():
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    chat = [{"role": "user", "content": "Repeat this code exactly, then add a mul function:\n" + code}]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    with LLM("smollm2", threads=2) as plain:
        ids = plain.encode_chat(chat)
        want = plain.generate([ids], params)[0].token_ids
    with LLM("smollm2", threads=2, speculative_config={"num_speculative_tokens": 4}) as llm:
        got = llm.generate([ids], params)[0].token_ids
        stats = llm.last_stats
    assert got == want
    assert "return a * b" in llm.tokenizer.decode(got)
    # most of the answer is copied from the prompt: most drafts are accepted
    assert stats.accepted_tokens > 0.5 * stats.draft_tokens > 0, (stats.draft_tokens, stats.accepted_tokens)


@pytest.mark.parametrize(
    "config,match",
    [
        ({"method": "eagle"}, "method='eagle' is not supported"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens=0 must be a positive integer"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min=5 is above prompt_lookup_max=2"),
        ({"num_tokens": 3}, r"unknown keys \['num_tokens'\]"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_speculative_config(config, match):
    from shardlm.engine.config import EngineConfig

    with pytest.raises(UsageError, match=match):
        EngineConfig(speculative_config=config)
