"""Context parallelism at inference (parallel/context_paged.py): every sequence and its KV cache
striped over the cp ranks by runs of a block, queries all-gathered, partial outputs merged at their
owners. Greedy tokens equal HF's at every layout (float32: the merge by log-sum-exp reorders
the softmax sums, ~1e-6 on logits, far below the references' top-2 gaps); a quantized cache gives
the one-process quantized cache's logits; a prompt one rank's KV budget cannot hold runs over two.

Blocks of 4 tokens (2 for dp2 x cp2) make even the short prompts span several runs on every rank.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_kv_cache_dtype import MEAN_ERROR, TOP1_SAME

from harness.moe_reference import cached_tiny_moe
from harness.multirank import run_ranks
from harness.rankfns import cache_read_logits, llm_greedy
from harness.reference import NEW_TOKENS, PROMPTS, build_tiny
from shardlm import LLM, SamplingParams
from shardlm.engine.async_llm import AsyncLLM
from shardlm.errors import UsageError


@pytest.mark.parametrize(
    "layout",
    [
        dict(cp=2),
        dict(cp=3),
        dict(cp=4),
        dict(cp=2, tp=2),
        dict(cp=2, pp=2),
        dict(dp=2, cp=2, block_size=2),
        dict(cp=2, max_num_batched_tokens=8),  # chunked: later chunks read earlier ones from every rank
    ],
    ids=["cp2", "cp3", "cp4", "cp2-tp2", "cp2-pp2", "dp2-cp2", "cp2-chunked"],
)
def test_striped_layouts_match_hf(tiny, layout):
    ref = tiny("llama")
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout["cp"] * layout.get("tp", 1)
    layout = {"block_size": 4, **layout}
    for tokens, _, _ in run_ranks(world, llm_greedy, str(ref.path), PROMPTS, NEW_TOKENS, **layout):
        assert tokens == ref.tokens


@pytest.mark.parametrize("name", ["mistral", "qwen3", "qwen2"])
def test_families_match_hf_at_cp2(tiny, name):
    """Mistral's sliding window (7 tokens: a query's window spans both ranks' runs), Qwen3's q/k
    norms, Qwen2's biases; chunked, so prefills read the cache too."""
    ref = tiny(name)
    for tokens, _, _ in run_ranks(
        2, llm_greedy, str(ref.path), PROMPTS, NEW_TOKENS, cp=2, block_size=4, max_num_batched_tokens=8
    ):
        assert tokens == ref.tokens


@pytest.mark.parametrize(
    "name, layout",
    [
        ("llama", dict(cp=2)),
        ("mistral", dict(cp=2)),  # the window as a mask over the whole prompt
        ("qwen3", dict(cp=4)),  # 2 KV heads of 2 over 4 ranks: each KV head copied to two
        ("llama", dict(cp=2, pp=2)),
        ("llama", dict(cp=2, max_num_batched_tokens=8)),  # first chunks by Ulysses, later ones by pass-Q
    ],
    ids=["llama-cp2", "mistral-cp2", "qwen3-cp4", "llama-cp2-pp2", "llama-cp2-chunked"],
)
def test_ulysses_prefill_matches_hf(tiny, name, layout):
    """cp_attention="ulysses": a prompt that arrives whole is attended with the heads split over the
    cp ranks (its keys and values still cached striped, where decode reads them)."""
    ref = tiny(name)
    world = layout.get("pp", 1) * layout["cp"]
    results = run_ranks(
        world, llm_greedy, str(ref.path), PROMPTS, NEW_TOKENS, block_size=4, cp_attention="ulysses", **layout
    )
    for tokens, _, _ in results:
        assert tokens == ref.tokens


def test_ulysses_prefill_needs_heads_that_split(tiny):
    with pytest.raises(UsageError, match=r"cp=2: Ulysses splits attention heads .* use cp in \[1, 3\]"):
        LLM(str(tiny("llama").path), cp=2, tp=2, cp_attention="ulysses")  # a tp rank: 1 KV head of 3 queries


@pytest.mark.parametrize("layout", [dict(cp=2), dict(cp=2, tp=2, ep=2)], ids=["cp2", "cp2-tp2-ep2"])
def test_moe_matches_hf_at_cp2(tmp_path_factory, layout):
    """Experts see each cp rank's own tokens (a rank that holds none of a step's still joins the
    expert all-to-all)."""
    ref = cached_tiny_moe("qwen3_moe", tmp_path_factory)
    world = layout["cp"] * layout.get("tp", 1)
    for tokens, _, _ in run_ranks(world, llm_greedy, str(ref.path), PROMPTS, NEW_TOKENS, block_size=4, **layout):
        assert tokens == ref.tokens


def test_int8_cache_error_is_bounded_as_on_one_rank(tiny):
    """Teacher-forced (every step reads every earlier key back): each rank quantizes the keys it
    holds, so the error is the one-process int8 cache's (test_kv_cache_dtype.py's bounds; here
    every key is read back quantized, a step's own too, where one process attends its first
    token's own key at full precision: measured mean |dlogit| 0.053 at cp=2, as at cp=1)."""
    ref = tiny("llama")
    for logits in run_ranks(
        2, cache_read_logits, str(ref.path), 1, PROMPTS[-1], kv_cache_dtype="int8", cp=2, block_size=4
    ):
        err = (logits - ref.logits).abs()
        assert 1e-3 < err.mean() < MEAN_ERROR["int8"], f"mean |dlogit| {err.mean():.4f}"
        assert (logits.argmax(-1) == ref.logits.argmax(-1)).float().mean() >= TOP1_SAME["int8"]


def test_a_prompt_too_long_for_one_rank_runs_striped_over_two(tmp_path):
    """A 3000-token prompt; a KV budget per rank of ~2000 tokens: cp=1 refuses it and names cp=2,
    which holds it and gives HF's tokens."""
    import transformers

    ref = build_tiny("llama", tmp_path, max_position_embeddings=4096, num_hidden_layers=2)
    prompt = torch.randint(0, 251, (3000,), generator=torch.Generator().manual_seed(3)).tolist()
    model = transformers.AutoModelForCausalLM.from_pretrained(ref.path).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)[0, 3000:]
    # 2 layers x (K, V) x 2 KV heads x head_dim 16 x 4 bytes = 512 bytes a token: 125 blocks of 16 a rank
    budget = dict(kv_cache_memory=2000 * 512, threads=1, timeout_s=120)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(str(ref.path), **budget) as llm, pytest.raises(UsageError, match=r"needs 3007 KV-cache slots.*--cp 2"):
        llm.generate([prompt], params)
    with LLM(str(ref.path), cp=2, **budget) as llm:
        assert llm.kv_tokens == 2 * 125 * 16
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == want.tolist()


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory):
    """name -> (path, two prompts of 2500 and 1800 tokens, HF's 8 greedy tokens after each) for
    2-layer tiny models with a 4096-token context."""
    import transformers

    built = {}

    def get(name: str):
        if name not in built:
            ref = build_tiny(
                name, tmp_path_factory.mktemp(f"long-{name}"), max_position_embeddings=4096, num_hidden_layers=2
            )
            g = torch.Generator().manual_seed(4)
            prompts = [torch.randint(0, 251, (n,), generator=g).tolist() for n in (2500, 1800)]
            model = transformers.AutoModelForCausalLM.from_pretrained(ref.path).eval()
            want = []
            with torch.no_grad():
                for prompt in prompts:
                    ids = torch.tensor([prompt])
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
                    want.append(out[0, len(prompt) :].tolist())
            built[name] = (str(ref.path), prompts, want)
        return built[name]

    return get


@pytest.mark.parametrize(
    "name, layout",
    [
        ("llama", dict(cp=3)),
        ("llama", dict(cp=4)),
        ("llama", dict(cp=2, tp=2)),
        ("llama", dict(cp=2, pp=2)),
        ("llama", dict(dp=2, cp=2)),
        ("llama", dict(cp=2, max_num_batched_tokens=512)),  # five chunks, each reading all before it
        ("llama", dict(cp=2, cp_attention="ulysses")),
        ("mistral", dict(cp=2)),  # a 7-token window deep into the prompt
    ],
    ids=["cp3", "cp4", "cp2-tp2", "cp2-pp2", "dp2-cp2", "cp2-chunked", "cp2-ulysses", "mistral-cp2"],
)
def test_prompts_of_thousands_of_tokens_match_hf(long_prompts, name, layout):
    path, prompts, want = long_prompts(name)
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout["cp"] * layout.get("tp", 1)
    for tokens, _, _ in run_ranks(world, llm_greedy, path, prompts, 8, **layout):
        assert tokens == want


def test_prefix_cache_hits_on_every_shard(tiny):
    """A second request sharing a first one's prompt finds its group blocks cached (on every cp
    rank at once) and still gives HF's tokens."""
    ref = tiny("llama")
    engine = AsyncLLM(str(ref.path), cp=2, block_size=4, threads=1, timeout_s=60)

    async def one(ids):
        out = []
        async for chunk in engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)):
            out += chunk.token_ids
        return out

    try:
        assert asyncio.run(one(PROMPTS[-1])) == ref.tokens[-1]
        assert asyncio.run(one(PROMPTS[-1])) == ref.tokens[-1]
        hits = engine.stats["prefix_cache_hits"]
    finally:
        engine.shutdown()
    assert hits == 32  # the 33-token prompt's 4 full group blocks of 8 tokens


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
        (dict(compile=True), "compile=True does not work with cp=2"),
        (dict(dp=2, prefill_replicas=1), "prefill_replicas=1 does not work with cp=2"),
    ],
)
def test_what_cp_does_not_run_is_refused(tiny, options, message):
    with pytest.raises(UsageError, match=message):
        LLM(str(tiny("llama").path), cp=2, **options)


def test_a_cp_attention_without_cp_is_refused(tiny):
    with pytest.raises(UsageError, match=r"cp_attention='ulysses' splits attention over cp ranks, and cp=1"):
        LLM(str(tiny("llama").path), cp_attention="ulysses")
