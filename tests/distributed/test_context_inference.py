"""Context parallelism at inference (parallel/context_paged.py): every sequence and its KV cache
striped over the cp ranks by runs of a block, queries all-gathered, partial outputs merged at their
owners (or, for a prompt that arrives whole, heads split by Ulysses or keys and values passed
around the ring). Greedy tokens equal HF's at every layout (float32: the merge by log-sum-exp reorders
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


@pytest.mark.parametrize(
    "name", ["mistral", pytest.param("qwen3", marks=pytest.mark.slow), pytest.param("qwen2", marks=pytest.mark.slow)]
)
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


@pytest.mark.parametrize(
    "name, layout",
    [
        ("llama", dict(cp=2)),  # GQA: 2 KV heads of 3 query heads, sent unexpanded
        ("llama", dict(cp=3)),
        pytest.param("llama", dict(cp=2, tp=2), marks=pytest.mark.slow),  # 4 ranks each: ~4 s and ~2 s
        pytest.param("llama", dict(cp=2, pp=2), marks=pytest.mark.slow),
        ("llama", dict(dp=2, cp=2, block_size=2)),
        ("mistral", dict(cp=2)),  # the 7-token window over blocks from both ranks
        ("llama", dict(cp=2, max_num_batched_tokens=8)),  # first chunks by the ring, later ones by pass-Q
    ],
    ids=["llama-cp2", "llama-cp3", "llama-cp2-tp2", "llama-cp2-pp2", "llama-dp2-cp2", "mistral-cp2", "llama-chunked"],
)
def test_ring_prefill_matches_hf(tiny, name, layout):
    """cp_attention="ring": a prompt that arrives whole keeps its queries where their tokens are and
    passes its keys and values around the cp ranks (they are cached striped as ever)."""
    ref = tiny(name)
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout["cp"] * layout.get("tp", 1)
    layout = {"block_size": 4, **layout}
    for tokens, _, _ in run_ranks(world, llm_greedy, str(ref.path), PROMPTS, NEW_TOKENS, cp_attention="ring", **layout):
        assert tokens == ref.tokens


def ring_prefill_on_rank(lengths: list[int], block_size: int, q, k, v, kv_of_q: list[int], window: int | None):
    """One step's fresh prompts of ``lengths`` (q [tokens, q_heads, d], k, v [tokens, kv_heads, d],
    laid back to back) striped over the cp ranks: this rank's ring prefill, as (the step rows it
    computed, their outputs [rows, q_heads, d])."""
    import torch.distributed as dist

    from shardlm.models.attention import GroupedHeads
    from shardlm.parallel.context_paged import ContextShards, owner

    cp, rank = dist.get_world_size(), dist.get_rank()
    owners = [owner(p, block_size, cp) for n in lengths for p in range(n)]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    rows = torch.tensor([i for i, o in enumerate(owners) if o == rank], dtype=torch.long)
    shards = ContextShards.build(dist.group.WORLD, rank, owners, [], "cpu", "ring")
    heads = GroupedHeads(kv_of_q)
    fresh = list(zip(starts, lengths))
    covered, out = shards.ring_prefill(q[rows], k[rows], v[rows], fresh, heads, q.shape[-1] ** -0.5, window)
    return rows[covered], heads.ungroup(out)


RING_CASES = [  # (cp, block size, prompt lengths, KV head of each query head, window)
    (2, 4, [13, 1, 9], [0, 0, 0, 1, 1, 1], None),  # GQA; a 1-token prompt only rank 0 holds
    (3, 2, [3, 20, 7], [0, 0, 1, 1, 1], 5),  # uneven query groups; a window; rank 2 holds none of the first
    (4, 1, [10], [0, 1], None),
    (3, 4, [2], [0, 0], None),  # ranks 1 and 2 hold nothing: empty blocks go round
]


def striped_reference(q, k, v, lengths: list[int], kv_of_q: list[int], window, visible=None):
    """One process's causal attention over each whole prompt laid back to back (SDPA), keys hidden
    where ``visible`` [tokens] is False: [tokens, q_heads, d]."""
    import torch.nn.functional as F

    out, at = [], 0
    for n in lengths:
        pos = torch.arange(n)
        mask = pos[None, :] <= pos[:, None]
        if window is not None:
            mask &= pos[None, :] > pos[:, None] - window
        if visible is not None:
            mask &= visible[at : at + n][None, :]
        qs, ks, vs = (t[at : at + n].transpose(0, 1) for t in (q, k[:, kv_of_q], v[:, kv_of_q]))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=q.shape[-1] ** -0.5))
        at += n
    return torch.cat(out, dim=1).transpose(0, 1)


@pytest.mark.parametrize(
    "cp, block_size, lengths, kv_of_q, window", RING_CASES, ids=[f"cp{c[0]}-bs{c[1]}-w{c[4]}" for c in RING_CASES]
)
def test_ring_prefill_equals_one_process_attention(cp, block_size, lengths, kv_of_q, window):
    """Each rank's ring prefill output for the tokens it owns (striped by runs of a block) equals
    one process's causal attention over each whole prompt (SDPA), within float32 assert_close
    defaults (rtol 1.3e-6, atol 1e-5: the blocks' partial softmaxes merge by log-sum-exp)."""
    g = torch.Generator().manual_seed(cp)
    tokens, d = sum(lengths), 8
    q = torch.randn(tokens, len(kv_of_q), d, generator=g)
    k, v = (torch.randn(tokens, max(kv_of_q) + 1, d, generator=g) for _ in range(2))
    want = striped_reference(q, k, v, lengths, kv_of_q, window)
    covered = torch.zeros(tokens, dtype=torch.long)
    apart = 0.0  # how far the ranks' outputs are from attention over their own keys alone
    for rank, (rows, out) in enumerate(
        run_ranks(cp, ring_prefill_on_rank, lengths, block_size, q, k, v, kv_of_q, window)
    ):
        covered[rows] += 1
        torch.testing.assert_close(out, want[rows], msg=lambda m: f"rank {rank}: {m}")
        if len(rows):
            own = torch.zeros(tokens, dtype=torch.bool)
            own[rows] = True
            alone = striped_reference(q, k, v, lengths, kv_of_q, window, own)[rows]
            apart = max(apart, (alone - want[rows]).abs().max().item())
    assert covered.tolist() == [1] * tokens  # the ranks' shares tile the prompts once
    # it can fail: the other ranks' keys matter (but where one rank holds every token)
    assert apart > 1e-2 or max(lengths) <= block_size


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
        ("llama", dict(cp=3, cp_attention="ring")),  # 1000-odd keys a hop, rank to rank
        ("mistral", dict(cp=2)),  # a 7-token window deep into the prompt
        ("mistral", dict(cp=2, cp_attention="ring")),  # ... that most hops' blocks fall outside
    ],
    ids=[
        "cp3",
        "cp4",
        "cp2-tp2",
        "cp2-pp2",
        "dp2-cp2",
        "cp2-chunked",
        "cp2-ulysses",
        "cp3-ring",
        "mistral-cp2",
        "mistral-cp2-ring",
    ],
)
def test_prompts_of_thousands_of_tokens_match_hf(long_prompts, name, layout):
    path, prompts, want = long_prompts(name)
    world = layout.get("dp", 1) * layout.get("pp", 1) * layout["cp"] * layout.get("tp", 1)
    for tokens, _, _ in run_ranks(world, llm_greedy, path, prompts, 8, **layout):
        assert tokens == want


@pytest.mark.slow  # ~8 s
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


@pytest.mark.parametrize("attention", ["ulysses", "ring"])
def test_a_cp_attention_without_cp_is_refused(tiny, attention):
    with pytest.raises(UsageError, match=rf"cp_attention='{attention}' splits attention over cp ranks, and cp=1"):
        LLM(str(tiny("llama").path), cp_attention=attention)
