"""Prefill/decode disaggregation: prefill replicas hand each prompt's KV cache to a decode
replica, which decodes as if it had computed the prompt itself.

Tolerance: greedy tokens identical to HF's (a decode replica that got wrong or missing KV
would continue differently within a few tokens); seeded sampling identical to colocated
serving with the same seeds (the sampler's state travels with the first token); every block
freed at the end on both sides. Each test also checks that handoffs happened, so a layout
that silently served colocated could not pass.
"""

from __future__ import annotations

import asyncio

import pytest

from harness.reference import _COMMON, PROMPTS, TINY_MODELS
from shardlm import LLM, SamplingParams
from shardlm.engine.async_llm import AsyncLLM
from shardlm.errors import UsageError

MAX_TOKENS = [20, 3, 12, 7]


async def _collect(engine, ids, params, stop_after: int | None = None) -> list[int]:
    out = []
    async for chunk in engine.generate(ids, params):
        out += chunk.token_ids
        if stop_after is not None and len(out) >= stop_after:
            break  # the client goes away: the request is aborted wherever it is
    return out


def serve(path: str, params: list[SamplingParams], cancelled: int = 0, **layout) -> tuple[list[list[int]], dict]:
    """Every prompt with its params at once (and ``cancelled`` extra copies of the longest prompt
    whose client leaves after the first token); the answers and the engine's final stats."""
    engine = AsyncLLM(path, threads=1, timeout_s=60, **layout)

    async def run():
        leaving = [
            _collect(engine, PROMPTS[-1], SamplingParams(temperature=0.0, max_tokens=50), stop_after=1)
            for _ in range(cancelled)
        ]
        out = await asyncio.gather(*[_collect(engine, p, sp) for p, sp in zip(PROMPTS, params)], *leaving)
        for _ in range(100):  # aborts are applied in the replicas' next round
            if engine.stats["running"] == engine.stats["waiting"] == engine.stats["kv_blocks_used"] == 0:
                break
            await asyncio.sleep(0.05)
        return out[: len(PROMPTS)]

    try:
        return asyncio.run(run()), engine.stats
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "layout",
    [dict(dp=2), *(pytest.param(lay, marks=pytest.mark.slow) for lay in (dict(dp=2, tp=2), dict(dp=3)))],
    ids=["dp2", "dp2-tp2", "dp3"],
)
def test_disaggregated_serving_matches_hf(tiny, layout):
    """One prefill replica (and one or two decode replicas; pp: the seeded test); greedy answers
    equal HF's, also for clients that leave right after their first token (aborted on whichever
    side they are then)."""
    ref = tiny("llama")
    tokens, stats = serve(
        str(ref.path),
        [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS],
        cancelled=2,
        prefill_replicas=1,
        **layout,
    )
    assert tokens == [t[:n] for t, n in zip(ref.tokens, MAX_TOKENS)]
    assert stats["kv_handoffs"] >= len(PROMPTS), stats  # every answer longer than one token was handed off
    assert stats["kv_transfer_bytes"] > 0 and stats["handoffs_recomputed"] == 0, stats
    assert stats["running"] == stats["waiting"] == stats["kv_blocks_used"] == 0, stats  # everything freed


@pytest.mark.parametrize(
    "layout", [dict(dp=2), pytest.param(dict(dp=2, pp=2), marks=pytest.mark.slow)], ids=["dp2", "dp2-pp2"]
)
def test_seeded_sampling_continues_on_the_decode_replica(tiny, layout):
    """The first token is sampled on the prefill replica, the rest on the decode replica from the
    same generator state (with pp, the last stage's: the one that samples): the answers equal
    the offline engine's for the same seeds."""
    ref = tiny("llama")
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=100 + i) for i in range(len(PROMPTS))]
    with LLM(str(ref.path), threads=1) as llm:
        offline = [o.token_ids for o in llm.generate(PROMPTS, params)]
    tokens, stats = serve(str(ref.path), params, prefill_replicas=1, **layout)
    assert tokens == offline
    assert any(t != g[:12] for t, g in zip(offline, ref.tokens)), "sampling should leave greedy's path"
    assert stats["kv_handoffs"] == len(PROMPTS), stats


def test_decode_replica_without_room_recomputes(tiny):
    """A decode replica whose cache is full queues what arrives, to recompute it from its tokens:
    answers unchanged. Blocks of 4 tokens, 16 blocks a replica: the four answers need ~40."""
    ref = tiny("llama")
    tokens, stats = serve(
        str(ref.path),
        [SamplingParams(temperature=0.0, max_tokens=30)] * len(PROMPTS),
        dp=2,
        prefill_replicas=1,
        block_size=4,
        kv_cache_memory=16 * _block_bytes(),
    )
    assert tokens == [t[:30] for t in ref.tokens]
    assert stats["handoffs_recomputed"] > 0, stats
    assert stats["running"] == stats["waiting"] == stats["kv_blocks_used"] == 0, stats


def _block_bytes(block_size: int = 4) -> int:
    """Bytes of one KV block of the whole tiny llama at float32: K and V, every layer."""
    cfg = {**_COMMON, **TINY_MODELS["llama"][1]}
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * head_dim * 4


def test_bad_layouts_are_refused(tiny):
    ref = tiny("llama")
    with pytest.raises(UsageError, match=r"prefill_replicas=2 must leave at least one of the dp=2"):
        AsyncLLM(str(ref.path), dp=2, prefill_replicas=2)
    with pytest.raises(UsageError, match="is a serving layout"):
        LLM(str(ref.path), dp=2, prefill_replicas=1)
