"""Mixtral, Qwen2-MoE and Qwen3-MoE under every (tp, dp, ep) layout give HF's greedy tokens and logits.

dp = 1 layouts run end to end through the engine (``rankfns.greedy_and_logits``). dp > 1
layouts run at the rank level (``moe_rankfns.dp_greedy_and_logits``): each dp rank serves its
own prompts, a dp rank without prompts joins the expert collectives with empty batches, and
every prompt's tokens and logits are checked on the ranks that served it.

Tolerance: float32 logits within rtol = atol = 1e-4, as for the dense models: the expert
outputs are summed in a different order (all-reduce or all-to-all, then top-k weights) and
move logits by ~1e-5. Tokens must be identical; that is meaningful because the smallest
top-1/top-2 logit gap (>= 1e-3) and the smallest k-th/(k+1)-th router logit gap (>= 5e-4)
of these references are far above those ~1e-5 differences (asserted below).
"""

from __future__ import annotations

import pytest
import torch

from harness.moe_rankfns import dp_greedy_and_logits
from harness.moe_reference import cached_tiny_moe
from harness.multirank import run_ranks
from harness.rankfns import greedy_and_logits, llm_generate, llm_greedy
from harness.reference import NEW_TOKENS, PROMPTS, TINY_MOE_MODELS
from shardlm.parallel.collectives import split_sizes

# (tp, dp, ep) -> prompt indices of each dp rank: uneven shares, and at dp=4 an idle rank
LAYOUTS = {
    (1, 1, 1): None,
    (2, 1, 1): None,
    (2, 1, 2): None,
    (4, 1, 4): None,
    (1, 2, 2): [[1, 3], [0, 2]],
    (2, 2, 2): [[3, 0], [1, 2]],
    (2, 2, 4): [[2], [0, 1, 3]],
    (1, 4, 4): [[3], [1, 2], [], [0]],
}


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    return lambda name: cached_tiny_moe(name, tmp_path_factory)


def expert_elements(cfg) -> int:
    """Routed-expert weight elements of the whole model (gate, up, down of every expert)."""
    dense = set(getattr(cfg, "mlp_only_layers", [])) | set(range(getattr(cfg, "first_k_dense_replace", 0)))
    moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if i not in dense)
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    return moe_layers * experts * 3 * width * cfg.hidden_size


def check_meaningful(ref) -> None:
    assert ref.token_margin > 1e-3 and ref.router_margin > 1e-4, (ref.token_margin, ref.router_margin)
    assert len({tuple(t) for t in ref.tokens}) == len(PROMPTS)  # continuations differ: a mix-up would show


@pytest.mark.parametrize("name", list(TINY_MOE_MODELS))
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda t: "tp{}-dp{}-ep{}".format(*t))
def test_moe_matches_hf(tiny_moe, layout, name):
    ref = tiny_moe(name)
    check_meaningful(ref)
    tp, dp, ep = layout
    if dp == 1:  # end to end through the engine
        results = run_ranks(tp, greedy_and_logits, str(ref.path), tp, PROMPTS, NEW_TOKENS, ep=ep)
        for rank, (tokens, logits, _) in enumerate(results):
            assert tokens == ref.tokens, f"rank {rank} of {layout} disagrees with HF"
            torch.testing.assert_close(logits, ref.logits[-1], rtol=1e-4, atol=1e-4)
        return
    assignment = LAYOUTS[layout]
    results = run_ranks(tp * dp, dp_greedy_and_logits, str(ref.path), tp, dp, ep, PROMPTS, assignment, NEW_TOKENS)
    total = expert_elements(ref.config)
    held = [r[2] for r in results]
    for rank, (tokens, logits, _, path) in enumerate(results):
        d = rank // tp
        assert sorted(tokens) == sorted(logits) == sorted(assignment[d])
        for i in assignment[d]:
            assert tokens[i] == ref.tokens[i], f"prompt {i} on rank {rank} of {layout} disagrees with HF"
            torch.testing.assert_close(logits[i], ref.logits[i], rtol=1e-4, atol=1e-4)
        # the layout really took the path it is meant to test: all-to-all when ep spans dp ranks
        assert path == ("replicated" if tp % ep == 0 else "all_to_all")
    # each rank holds only its ep rank's experts (stage index s folds as s = edp * ep + ep_rank)
    experts = getattr(ref.config, "num_local_experts", None) or ref.config.num_experts
    assert held == [split_sizes(experts, ep)[r % ep] * (total // experts) for r in range(tp * dp)]


@pytest.mark.parametrize(
    "layout", [(1, 2, 2), (2, 2, 4), (1, 4, 4), (2, 2, 2)], ids=lambda t: "tp{}-dp{}-ep{}".format(*t)
)
def test_moe_engine_dp_with_uneven_requests(tiny_moe, layout):
    """Through the public LLM API. Requests of different lengths make the replicas need
    different numbers of steps; with all-to-all dispatch they step in lockstep and an idle
    replica joins the expert collectives with empty batches (DP attention)."""
    ref = tiny_moe("mixtral")
    tp, dp, ep = layout
    max_tokens = [NEW_TOKENS, 3, 17, 1]
    for tokens, load in run_ranks(tp * dp, llm_generate, str(ref.path), PROMPTS, max_tokens, tp=tp, dp=dp, ep=ep):
        assert tokens == [t[:n] for t, n in zip(ref.tokens, max_tokens)]  # greedy: shorter runs are prefixes
        # the expert load is reported, each (token, expert) pair counted once: k per token routed
        routed = sum(len(p) + n - 1 for p, n in zip(PROMPTS, max_tokens))
        assert [sum(layer) for layer in load["expert_tokens"]] == [2 * routed] * len(load["expert_tokens"])


@pytest.mark.parametrize(
    "options",
    [{"speculative_config": {"num_speculative_tokens": 3}}, {"max_num_batched_tokens": 8}],
    ids=["ngram", "chunked"],
)
def test_deepseek_with_drafts_and_chunked_prefill_gives_hf_tokens(tiny_moe, options):
    """MLA verifying n-gram drafts (several new tokens over the cached latents) and prefilling a
    prompt in chunks (a later chunk expands the earlier chunks' latents from the cache)."""
    ref = tiny_moe("deepseek_v3")
    [(tokens, _, _)] = run_ranks(1, llm_greedy, str(ref.path), PROMPTS, NEW_TOKENS, **options)
    assert tokens == ref.tokens
