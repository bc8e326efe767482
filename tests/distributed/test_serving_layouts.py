"""The serving engine (``AsyncLLM``) on every kind of layout, against HF's greedy tokens.

Requests of different lengths arrive together, so replicas and micro-batches need
different numbers of steps; outputs must equal HF's greedy tokens (prefixes for shorter
max_tokens). Dense: pipeline stages, replicas, and both with tensor parallelism. MoE: dp
replicas in lockstep when experts span them, with and without expert re-placement every
few rounds.
"""

from __future__ import annotations

import asyncio

import pytest

from harness.moe_reference import cached_tiny_moe
from harness.reference import PROMPTS
from shardlm import SamplingParams
from shardlm.engine.async_llm import AsyncLLM

MAX_TOKENS = [20, 3, 12, 7]


def serve_all(path: str, max_tokens=MAX_TOKENS, **layout) -> tuple[list[list[int]], dict]:
    engine = AsyncLLM(path, threads=1, timeout_s=60, **layout)

    async def one(ids, n):
        out = []
        async for chunk in engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=n)):
            out += chunk.token_ids
        return out

    async def run():
        return await asyncio.gather(*[one(p, n) for p, n in zip(PROMPTS, max_tokens)])

    try:
        return asyncio.run(run()), engine.stats
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "layout",
    # dp2 x pp2 (~7 s) in the slow tier: make test's budget
    [
        dict(pp=2),
        dict(pp=3, micro_batches=2),
        dict(dp=2),
        dict(tp=2, pp=2),
        pytest.param(dict(dp=2, pp=2), marks=pytest.mark.slow),
    ],
    ids=["pp2", "pp3-mb2", "dp2", "tp2-pp2", "dp2-pp2"],
)
def test_dense_serving_matches_hf(tiny, layout):
    ref = tiny("llama")
    tokens, stats = serve_all(str(ref.path), **layout)
    assert tokens == [t[:n] for t, n in zip(ref.tokens, MAX_TOKENS)]
    assert stats["running"] == stats["waiting"] == stats["kv_blocks_used"] == 0  # everything freed


def test_speculative_serving_streams_the_offline_tokens(tiny):
    """n-gram drafts over two replicas: verified runs stream several tokens a step, and the
    answers are plain greedy decoding's (200 tokens, so the random model repeats itself)."""
    from shardlm import LLM

    ref = tiny("llama")
    plain = [
        o.token_ids
        for o in LLM(str(ref.path), threads=1).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=200))
    ]
    tokens, stats = serve_all(
        str(ref.path), [200] * len(PROMPTS), dp=2, speculative_config={"num_speculative_tokens": 3}
    )
    assert tokens == plain
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0, stats
    assert stats["running"] == stats["waiting"] == stats["kv_blocks_used"] == 0


@pytest.mark.parametrize(
    "name, layout",
    [
        pytest.param("qwen3_moe", dict(dp=2, ep=2), marks=pytest.mark.slow),
        pytest.param("qwen3_moe", dict(dp=2, ep=2, eplb_interval=3, eplb_redundant=2), marks=pytest.mark.slow),
        ("qwen3_moe", dict(tp=2, dp=2, ep=2, eplb_interval=3)),
        ("deepseek_v3", dict(tp=2, pp=2, ep=2)),
        pytest.param("deepseek_v2", dict(dp=2, ep=2, eplb_interval=3), marks=pytest.mark.slow),
    ],
    ids=["lockstep", "lockstep+eplb", "replicated+eplb", "deepseek_v3-tp2-pp2-ep2", "deepseek_v2-lockstep+eplb"],
)
def test_moe_serving_matches_hf(tmp_path_factory, name, layout):
    ref = cached_tiny_moe(name, tmp_path_factory)
    tokens, stats = serve_all(str(ref.path), **layout)
    assert tokens == [t[:n] for t, n in zip(ref.tokens, MAX_TOKENS)]
    assert stats["running"] == stats["waiting"] == stats["kv_blocks_used"] == 0  # everything freed


def test_best_of_is_refused_and_the_engine_serves_on(tiny):
    """AsyncLLM streams every completion it generates, so best_of > n (keep the best, drop the
    rest) is the caller's to do: refused in one line, and the next request is served."""
    from shardlm.errors import UsageError

    ref = tiny("llama")
    engine = AsyncLLM(str(ref.path), threads=1, timeout_s=60)

    async def tokens(params):
        return [t async for chunk in engine.generate_choices([PROMPTS[0]], params) for t in chunk.token_ids]

    try:
        with pytest.raises(UsageError, match="best_of=3.*ask for n=3"):
            asyncio.run(tokens(SamplingParams(n=1, best_of=3)))
        assert asyncio.run(tokens(SamplingParams(temperature=0.0, max_tokens=4))) == ref.tokens[0][:4]
    finally:
        engine.shutdown()
