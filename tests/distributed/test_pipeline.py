"""Pipeline and data parallelism, composed with tensor parallelism on one mesh.

Every factorisation (dp, pp, tp) of world sizes 1..6 and 8 gives HF transformers' first
16 greedy tokens (identical, float32) for a batch of prompts of different lengths, on
tiny random Llama and Qwen2 models with 6 layers; the real SmolLM2 at the layouts the
issue names. Stage partitioning and replica routing are pure and tested exhaustively.
"""

from __future__ import annotations

import itertools

import pytest

from harness.multirank import run_ranks
from harness.rankfns import llm_greedy
from harness.reference import PROMPTS
from shardlm.errors import UsageError
from shardlm.models.config import ModelConfig
from shardlm.parallel.data import assign
from shardlm.parallel.dims import factorisations
from shardlm.parallel.pipeline import partition_layers, stage_layers

HEADS = {"llama": 6, "qwen2": 6}
LAYERS = 6
TOKENS = 16  # greedy tokens compared per prompt (of HF's NEW_TOKENS): enough for every stage to
# pass its KV cache through many decode steps, half the suite time of the full 32 on 2 cores


def hf_prefix(ref) -> list[list[int]]:
    return [t[:TOKENS] for t in ref.tokens]


def layouts(world: int) -> list[tuple[int, int, int]]:
    return [(dp, pp, tp) for dp, pp, tp in factorisations(world, 3) if tp <= 6 and pp <= LAYERS]


MATRIX = [(name, *layout) for world in range(1, 7) for layout in layouts(world) for name in HEADS]


@pytest.mark.parametrize("name, dp, pp, tp", MATRIX, ids=[f"{n}-dp{d}pp{p}tp{t}" for n, d, p, t in MATRIX])
def test_every_layout_matches_hf(tiny, name, dp, pp, tp):
    ref = tiny(name)
    results = run_ranks(dp * pp * tp, llm_greedy, str(ref.path), PROMPTS, TOKENS, dp=dp, pp=pp, tp=tp)
    for rank, (tokens, _, _) in enumerate(results):
        assert tokens == hf_prefix(ref), f"rank {rank} of dp={dp} pp={pp} tp={tp} disagrees with HF"
    assert len({tuple(t) for t in hf_prefix(ref)}) == len(PROMPTS)  # distinct answers: a mix-up would show


@pytest.mark.parametrize("dp, pp, tp", layouts(8))
def test_world_of_8_matches_hf(tiny, dp, pp, tp):
    ref = tiny("llama")
    for tokens, _, _ in run_ranks(8, llm_greedy, str(ref.path), PROMPTS, TOKENS, dp=dp, pp=pp, tp=tp):
        assert tokens == hf_prefix(ref)


def test_each_stage_holds_only_its_layers(tiny):
    """pp=3: each stage's parameters are its two layers (+ embedding first, + head last)."""
    ref = tiny("llama")  # tied embeddings: the first and the last stage both hold the table
    results = run_ranks(3, llm_greedy, str(ref.path), PROMPTS[:1], 2, pp=3)
    ranges = [layers for _, _, layers in results]
    assert ranges == [range(0, 2), range(2, 4), range(4, 6)]
    bytes_per_stage = [own[0] for _, own, _ in results]  # under SPMD each rank reports itself
    ((_, (one,), _),) = run_ranks(1, llm_greedy, str(ref.path), PROMPTS[:1], 2)
    middle = bytes_per_stage[1]
    assert middle < one / 3  # two of six layers and no embedding
    # first and last carry the embedding table (251 x 96 floats) besides their layers
    assert bytes_per_stage[0] > middle and bytes_per_stage[2] > middle
    assert sum(bytes_per_stage) == one + 251 * 96 * 4  # each layer once; the tied table twice


# pp x tp on the real model: tp=2 splits its 9 heads unevenly, tp=3 evenly
# (make test keeps pp2 with uneven tp; the others, ~7 s each, are in the slow tier)
@pytest.mark.parametrize(
    "dp, pp, tp",
    [(1, 2, 2), *(pytest.param(*lay, marks=pytest.mark.slow) for lay in ((1, 2, 1), (1, 3, 3), (2, 2, 1)))],
)
def test_smollm2_layouts_match_hf(smollm2, dp, pp, tp):
    path, prompts, ref, _ = smollm2
    for tokens, _, _ in run_ranks(dp * pp * tp, llm_greedy, path, prompts, TOKENS, dp=dp, pp=pp, tp=tp):
        assert tokens == hf_prefix(ref)


# ---- pure functions --------------------------------------------------------------------


def brute_force(costs, stages, first, last):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        stage = [sum(costs[bounds[s] : bounds[s + 1]]) for s in range(stages)]
        stage[0] += first
        stage[-1] += last
        best = min(best, max(stage))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_partition_is_optimal_and_contiguous(seed):
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 9)
    costs = [rng.randint(1, 9) for _ in range(n)]
    stages = rng.randint(1, n)
    first, last = rng.randint(0, 20), rng.randint(0, 20)
    parts = partition_layers(costs, stages, first_extra=first, last_extra=last)
    assert [i for r in parts for i in r] == list(range(n)) and all(len(r) for r in parts)
    got = [sum(costs[i] for i in r) for r in parts]
    got[0] += first
    got[-1] += last
    assert max(got) == brute_force(costs, stages, first, last)


def test_smollm2_stages_count_the_head_as_work():
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
        }
    )
    # per token, a layer does 3.54M multiply-adds and the LM head 28.3M; the embedding lookup ~0
    assert [len(r) for r in stage_layers(cfg, 2)] == [19, 11]
    three = [len(r) for r in stage_layers(cfg, 3)]
    assert three == [12, 13, 5]  # costliest stage 13 layer-equivalents: the least possible, ceil(38 / 3)
    assert [len(r) for r in stage_layers(cfg, 3, (10, 10, 10))] == [10, 10, 10]
    with pytest.raises(UsageError, match="summing to the model's 30 layers"):
        stage_layers(cfg, 3, (10, 10, 9))
    with pytest.raises(UsageError, match="pp=31 needs at least one layer per stage.*use pp <= 30"):
        stage_layers(cfg, 31)


def test_routing_goes_to_least_outstanding_work():
    assert assign([10, 1, 1, 1], 2) == [0, 1, 1, 1]
    assert assign([5, 5, 5, 5], 2) == [0, 1, 0, 1]
    assert assign([3, 8, 2, 2, 2], 3) == [0, 1, 2, 2, 0]  # loads 3,8,2 -> 3,8,4 -> 5,8,4
    assert assign([], 4) == []
