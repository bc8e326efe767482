"""The MoE block on ranks: every dispatch path, uneven and empty per-rank batches, EPLB, shard reads.

Each dp rank feeds its own tokens (tp ranks of a dp rank the same ones); some dp ranks
get none and must still join the expert collectives, or their peers would hang (the
harness turns a hang into a timeout failure). Outputs are compared token by token with
HF's own MoE block on all tokens at once.

Tolerance: float32 ``assert_close`` defaults (rtol 1.3e-6, atol 1e-5): partial expert
sums are reduced across ranks in another order than HF's. The random inputs' smallest
k-th/(k+1)-th router logit gap is asserted > 1e-4, so no layout can legitimately pick
other experts than HF does.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_models import expert_elements

from harness.moe_rankfns import block_outputs, eplb_round_trip, read_and_held
from harness.moe_reference import cached_tiny_moe, choice_margin, routers
from harness.multirank import run_ranks
from harness.reference import TINY_MOE_MODELS

MOE_LAYER = {"qwen2_moe": 1, "deepseek_v3": 1, "deepseek_v2": 1}  # their layer 0 is dense
# 4 ranks; counts[d] = tokens of dp rank d (0: idle). The comment names the path taken.
LAYOUTS = [
    dict(tp=1, dp=4, ep=4, counts=[5, 0, 3, 1]),  # all-to-all
    dict(tp=1, dp=4, ep=2, counts=[2, 4, 0, 3]),  # all-to-all, 2 copies of the experts (edp=2)
    dict(tp=2, dp=2, ep=4, counts=[7, 0]),  # all-to-all, each tp rank sends half of its replica's tokens
    dict(tp=2, dp=2, ep=2, counts=[4, 5]),  # replicated inside each tp group, all-reduce
    dict(tp=2, dp=2, ep=2, counts=[0, 9], dispatch="all_to_all"),  # forced all-to-all on the same layout
    dict(tp=2, dp=2, ep=2, etp=2, counts=[3, 0]),  # all-to-all with expert-tensor parallelism
    dict(tp=4, dp=1, ep=2, etp=2, counts=[9]),  # replicated with etp
    dict(tp=1, dp=4, ep=1, etp=4, counts=[1, 0, 5, 3]),  # all-to-all over etp alone
    dict(tp=4, dp=1, ep=1, counts=[9]),  # every rank holds every expert: no communication
    dict(tp=1, dp=4, ep=4, counts=[0, 0, 0, 0]),  # nobody has work: still no mismatch
]


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    return lambda name: cached_tiny_moe(name, tmp_path_factory)


def hf_block(path, name):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return model.model.layers[MOE_LAYER.get(name, 0)].mlp, model


def router_margin(block, x) -> float:
    router = routers(block)[0]
    return choice_margin(router, torch.nn.functional.linear(x, router.weight))


def expected_path(spec) -> str:
    if "dispatch" in spec:
        return spec["dispatch"]
    return "replicated" if spec["tp"] % (spec["ep"] * spec.get("etp", 1)) == 0 else "all_to_all"


@pytest.mark.parametrize("name", list(TINY_MOE_MODELS))
def test_block_every_path_with_empty_ranks_matches_hf(tiny_moe, name):
    ref = tiny_moe(name)
    block, _ = hf_block(ref.path, name)
    x = torch.randn(9, ref.config.hidden_size, generator=torch.Generator().manual_seed(3))
    assert router_margin(block, x) > 1e-4
    with torch.no_grad():
        want = block(x[None])[0]
    assert want.abs().max() > 0.1 and (want[1:] - want[:-1]).abs().max() > 0.1  # not trivially zero/equal
    results = run_ranks(4, block_outputs, str(ref.path), MOE_LAYER.get(name, 0), x, LAYOUTS)
    for rank, per_layout in enumerate(results):
        for spec, (path, y) in zip(LAYOUTS, per_layout):
            d = rank // spec["tp"]
            start, n = sum(spec["counts"][:d]), spec["counts"][d]
            assert path == expected_path(spec), spec
            assert y.shape == (n, ref.config.hidden_size), (spec, rank)
            torch.testing.assert_close(y, want[start : start + n], msg=lambda m: f"{spec}, rank {rank}: {m}")


def skewed_tokens(block, n: int) -> torch.Tensor:
    """Random tokens pushed towards experts 0 and 1, so they get most of the top-2 choices."""
    w = routers(block)[0].weight.detach()
    d = w[0] + w[1]
    return torch.randn(n, w.shape[1], generator=torch.Generator().manual_seed(4)) + 3.0 * d / d.norm()


@pytest.mark.parametrize(
    "spec",
    [
        dict(tp=1, dp=4, ep=4, counts=[24, 0, 20, 20]),  # all-to-all, one idle rank
        dict(tp=2, dp=2, ep=2, counts=[30, 34]),  # replicated inside the tp groups
    ],
    ids=["all_to_all", "replicated"],
)
def test_eplb_keeps_outputs_and_evens_the_load(tiny_moe, spec):
    ref = tiny_moe("mixtral")
    block, _ = hf_block(ref.path, "mixtral")
    x = skewed_tokens(block, sum(spec["counts"]))
    assert router_margin(block, x) > 1e-4
    with torch.no_grad():
        want = block(x[None])[0]
    world = spec["tp"] * spec["dp"]
    results = run_ranks(world, eplb_round_trip, str(ref.path), 0, x, spec, 4)
    pairs = sum(spec["counts"]) * ref.config.num_experts_per_tok
    for rank, (before, after, load0, load1, placement) in enumerate(results):
        d = rank // spec["tp"]
        start, n = sum(spec["counts"][:d]), spec["counts"][d]
        torch.testing.assert_close(before, want[start : start + n])
        torch.testing.assert_close(after, before)  # replicas and moves change where, not what
        # every (token, choice) pair counted exactly once, before and after
        assert sum(load0.expert_tokens[0]) == sum(load1.expert_tokens[0]) == pairs
        assert load0.expert_tokens == load1.expert_tokens  # the same tokens chose the same experts
        assert load0.imbalance[0] > 1.5, load0.rank_tokens  # the skew is real (can-fail guard)
        assert load1.imbalance[0] < load0.imbalance[0] - 0.3, (load0.rank_tokens, load1.rank_tokens)
        assert any(len(placement.replicas(e)) > 1 for e in (0, 1))  # the hot experts were replicated
    assert len({repr(r[4]) for r in results}) == 1  # every rank moved to the same placement


@pytest.mark.parametrize(
    "name, layout",
    [
        ("qwen3_moe", (2, 2, 4, 1)),
        ("qwen3_moe", (2, 2, 2, 2)),
        ("qwen3_moe", (1, 4, 4, 1)),
        ("deepseek_v3", (4, 1, 2, 1)),
    ],
    ids=["tp2-dp2-ep4-etp1", "tp2-dp2-ep2-etp2", "tp1-dp4-ep4-etp1", "deepseek_v3-tp4-ep2"],
)
def test_each_rank_reads_and_holds_only_its_experts(tiny_moe, name, layout):
    """qwen3_moe's 6 experts at ep=4 split 2, 2, 1, 1; DeepSeek-V3 at tp=4: each rank reads its
    heads' rows of q_b and kv_b (the latent's projections whole) and its experts."""
    from shardlm.parallel.collectives import split_sizes

    ref = tiny_moe(name)
    tp, dp, ep, etp = layout
    results = run_ranks(tp * dp, read_and_held, str(ref.path), tp, dp, ep, etp)
    experts = getattr(ref.config, "num_local_experts", None) or ref.config.num_experts
    per_expert = expert_elements(ref.config) // experts  # all layers
    for rank, (read, params, held, slots) in enumerate(results):
        ep_rank = (rank // etp) % ep  # stage index folded as (edp, ep, etp)
        assert read == params, f"rank {rank} read {read} elements but holds {params}"
        assert held == split_sizes(experts, ep)[ep_rank] * per_expert // etp
        start = sum(split_sizes(experts, ep)[:ep_rank])
        assert all(s == tuple(range(start, start + split_sizes(experts, ep)[ep_rank])) for s in slots)
    # the ep ranks of a copy together hold every expert once (can-fail guard: not all on everyone)
    assert sum(r[2] for r in results) == expert_elements(ref.config) * (tp * dp // (ep * etp))
    assert max(r[2] for r in results) < expert_elements(ref.config)
