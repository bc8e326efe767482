"""Where the planner puts each group: the engine's rank order (pp outermost), the slowest group of
each kind costed, and the report saying when a per-layer group leaves its node."""

import pytest

from shardlm.plan import comm
from shardlm.plan.catalog import load_model
from shardlm.plan.hardware import Cluster, load_gpu
from shardlm.plan.inference import InferenceWorkload, stage_step
from shardlm.plan.layout import Layout
from shardlm.plan.planner import PlanRequest, plan
from shardlm.plan.report import text, to_data
from shardlm.plan.roofline import ModelCosts


@pytest.fixture
def two_nodes():
    return Cluster(gpu=load_gpu("h100-sxm"), num_gpus=16, gpus_per_node=8)


def _ep_comm(model: str, lay: Layout, cluster: Cluster) -> float:
    costs = ModelCosts(load_model(model)[0])
    return stage_step(
        costs,
        cluster,
        lay,
        0,
        tokens=256,
        ctx=1024,
        decode=True,
        seqs=256,
        w_bytes=2,
        a_bytes=2,
        kv_bytes=2,
        dtype="bf16",
    ).ep_comm


@pytest.mark.parametrize("model", ["deepseek-v3", "mixtral-8x7b"])
def test_ep_group_that_fits_a_node_is_costed_on_the_node_link_with_pp(model, two_nodes):
    """Issue 24's placement bug: with dp outside pp, the ep group of pp2 x dp8 x ep8 on two nodes of
    8 strode over both stages (ranks 0, 2, ..., 14) and its all-to-all was costed on the NIC; with
    pp outermost (the engine's order) a stage's 8 ranks are one node."""
    lay = Layout(pp=2, dp=8, ep=8)
    engine_groups = lay.group_ranks("ep")  # what the engine builds
    assert all(len({r // 8 for r in g}) == 1 for g in engine_groups), engine_groups
    assert lay.nodes_spanned("ep", 8) == 1
    cfg = load_model(model)[0]
    n_moe = ModelCosts(cfg).stage_kinds(2)[0][1]
    msg = 256 * cfg.num_experts_per_tok * cfg.hidden_size * 2
    intra = n_moe * 2 * comm.all_to_all(msg, list(range(8)), two_nodes)
    across = n_moe * 2 * comm.all_to_all(msg, list(range(0, 16, 2)), two_nodes)
    assert _ep_comm(model, lay, two_nodes) == pytest.approx(intra)
    assert across > 1.5 * intra  # can fail: the old placement's cost is clearly different


def test_the_slowest_group_is_costed_not_rank_zeros(two_nodes):
    """pp2 x dp3 x tp4 on 24 GPUs (nodes of 8): a stage is 12 ranks, so the ep=6 groups are ranks
    0-5 (one node) and 6-11 (two nodes); the all-to-all waits for the second."""
    cluster = Cluster(gpu=two_nodes.gpu, num_gpus=24, gpus_per_node=8)
    lay = Layout(pp=2, dp=3, tp=4, ep=6)
    assert lay.group_ranks("ep")[0] == [0, 1, 2, 3, 4, 5]
    assert lay.slowest_group("ep", 8) in ([6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17])
    assert lay.nodes_spanned("ep", 8) == 2
    assert lay.nodes_spanned("tp", 8) == 1 and lay.nodes_spanned("pp", 8) == 2
    cfg = load_model("qwen3-235b-a22b")[0]
    n_moe = ModelCosts(cfg).stage_kinds(2)[0][1]
    msg = 256 / 4 * cfg.num_experts_per_tok * cfg.hidden_size * 2  # each tp rank its 1/tp share
    slowest = n_moe * 2 * comm.all_to_all(msg, [6, 7, 8, 9, 10, 11], cluster)
    regather = n_moe * comm.all_gather(256 * cfg.hidden_size * 2, [0, 1, 2, 3], cluster)  # tp's tokens again
    assert _ep_comm("qwen3-235b-a22b", lay, cluster) == pytest.approx(slowest + regather)
    assert slowest > 1.5 * n_moe * 2 * comm.all_to_all(msg, [0, 1, 2, 3, 4, 5], cluster)


def test_report_says_when_a_group_crosses_nodes():
    wl = InferenceWorkload(prompt_len=512, output_len=128)
    req = PlanRequest(
        model="qwen3-235b-a22b", gpu="h100-sxm", gpus=16, inference=wl, fixed={"ep": 16, "tp": 1, "pp": 1}
    )
    wide = plan(req)  # dp16 x ep16: the one ep group is all 16 ranks, two nodes
    assert to_data(wide)["layouts"][0]["groups_across_nodes"] == {"ep": 2}
    assert "its ep group spans 2 nodes (costed on the inter-node link)" in text(wide)
    narrow = plan(PlanRequest(model="qwen3-235b-a22b", gpu="h100-sxm", gpus=16, inference=wl, fixed={"ep": 8, "pp": 2}))
    assert all(d["groups_across_nodes"] == {} for d in to_data(narrow)["layouts"])
    assert "inter-node link" not in text(narrow)
