"""Planner MoE costs: routing imbalance, grouped expert GEMMs at tokens-per-expert, node-limited
all-to-all, one MoE boundary for training and inference (roofline.routing_imbalance,
roofline.layer_work, roofline.node_limit, comm.moe_dispatch, comm.moe_boundary)."""

import argparse
import math
from dataclasses import replace

import numpy as np
import pytest

from shardlm.plan import comm, inference, training
from shardlm.plan.catalog import load_model
from shardlm.plan.errors import PlanError
from shardlm.plan.hardware import Cluster, load_gpu
from shardlm.plan.inference import InferenceWorkload
from shardlm.plan.layout import Layout
from shardlm.plan.roofline import ModelCosts, Step, expected_max_normal, layer_work, node_limit, routing_imbalance
from shardlm.plan.training import TrainWorkload


def test_imbalance_tends_to_one_with_many_tokens_and_exceeds_it_with_few():
    e, k, g = 256, 8, 64  # DeepSeek-V3's experts over ep 64
    assert routing_imbalance(1e12, g, e, k) == pytest.approx(1.0, abs=1e-4)
    factors = [routing_imbalance(t * k, g, e, k) for t in (16, 256, 4096, 65536)]
    assert factors == sorted(factors, reverse=True) and factors[0] > 1.5 and factors[-1] < 1.05
    assert routing_imbalance(1e6, 1, e, k) == 1.0  # one rank holds every expert: nothing to wait for
    assert routing_imbalance(1, 8, 8, 2) == 4.0  # capped: one token's pair on one of 8 ranks (E / k)
    mean, var = 4096 * 2 / 8, 4096 * 2 / 8 * (7 / 8) * (6 / 7)  # the closed form, Mixtral 8 experts top-2
    assert routing_imbalance(4096 * 2, 8, 8, 2) == pytest.approx(1 + expected_max_normal(8) * math.sqrt(var) / mean)
    # E[max of n standard normals]: 0.564 at 2 (1 / sqrt(pi)); below sqrt(2 ln n), its large-n limit
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-4)
    assert [expected_max_normal(n) < math.sqrt(2 * math.log(n)) for n in (8, 64, 1024)] == [True] * 3


def test_imbalance_matches_a_simulated_router():
    """Top-k of E experts uniformly at random per token (balanced in expectation), E / g experts a
    rank: the mean over draws of the most loaded rank's pairs, against the formula."""
    rng = np.random.default_rng(0)
    tokens, e, k, g, draws = 512, 64, 4, 16, 100
    choices = np.argpartition(rng.random((draws, tokens, e)), k, axis=-1)[..., :k]  # k distinct experts a token
    loads = np.stack([np.bincount(c.ravel() // (e // g), minlength=g) for c in choices])
    simulated = loads.max(axis=1).mean() / (tokens * k / g)
    assert simulated == pytest.approx(1.156, abs=0.01)  # 1.5 sigma above the mean of 128 pairs
    assert routing_imbalance(tokens * k, g, e, k) == pytest.approx(simulated, rel=0.02)


def _moe_layer(model: str, ep: int):
    costs = ModelCosts(load_model(model)[0])
    return costs.cfg, costs.rank_layer(True, tp=1, ep=ep)


def test_grouped_gemm_at_few_tokens_per_expert_is_weight_bandwidth_bound():
    cfg, rl = _moe_layer("mixtral-8x7b", ep=1)
    gpu = load_gpu("a100-80g")  # the rows rule (no measured fixed GEMM time: test_plan_time's for those)
    assert gpu.gemm_half_rows > 0
    one = Step(tokens=1, ctx=1024, decode=True, seqs=1, moe_tokens=1)
    mm, _ = layer_work(cfg, rl, one, w_bytes=2, a_bytes=2, kv_bytes=2, ep=1, half_rows=gpu.gemm_half_rows)
    # one token reads the dense weights and its k experts' (not all 8), and its time is those bytes
    weights = (rl.attn + rl.dense + rl.router + cfg.num_experts_per_tok * rl.expert_params) * 2
    assert mm.bytes == pytest.approx(weights, rel=1e-3)
    assert mm.bytes / gpu.mem_Bps > mm.flops / gpu.matmul_flops("bf16")
    assert mm.time(gpu, "bf16") == pytest.approx(mm.bytes / gpu.mem_Bps + mm.ops * gpu.op_overhead_s)
    # each expert's GEMM runs at M = its own tokens: 64 tokens spread over 8 experts pay the small-M
    # efficiency of 16 rows each (k = 2), not that of one GEMM of 128 rows
    many = Step(tokens=64, ctx=1024, decode=True, seqs=64, moe_tokens=64)
    mm64, _ = layer_work(cfg, rl, many, w_bytes=2, a_bytes=2, kv_bytes=2, ep=1, half_rows=gpu.gemm_half_rows)
    expert_flops = mm64.flops - 2 * 64 * (rl.attn + rl.dense + rl.router) / (64 / (64 + gpu.gemm_half_rows))
    per_expert = 64 * 2 / 8 / (1 - (1 - 2 / 8) ** 64)
    assert expert_flops == pytest.approx(2 * 128 * rl.expert_params * (per_expert + gpu.gemm_half_rows) / per_expert)


def test_routing_imbalance_slows_the_expert_gemms_only():
    cfg, rl8 = _moe_layer("mixtral-8x7b", ep=8)
    gpu = load_gpu("h100-sxm")
    step = Step(tokens=4096, ctx=2048, decode=False, seqs=1, moe_tokens=4096 * 8)
    mm, at = layer_work(cfg, rl8, step, w_bytes=2, a_bytes=2, kv_bytes=2, ep=8, half_rows=gpu.gemm_half_rows)
    factor = routing_imbalance(4096 * 8 * 2, 8, 8, 2)
    dense = 2 * 4096 * (rl8.attn + rl8.dense + rl8.router) / (4096 / (4096 + gpu.gemm_half_rows))
    routed = 4096 * 8 * 2 / 8 * factor  # the most loaded rank's pairs, over its one expert
    assert mm.flops - dense == pytest.approx(2 * routed * rl8.expert_params * (routed + gpu.gemm_half_rows) / routed)
    assert at.flops == 4096 * 4 * 2048 * rl8.q_heads * cfg.head_dim  # attention: no factor


def test_deepeps_dispatch_sends_a_token_once_per_node():
    """DeepEP's dispatcher (DeepSeek-V3 §3.2.2) sends a token over IB once per node holding one of
    its experts: the nodes its M groups lie on under node-limited routing, the expected distinct
    nodes of k even choices without it; over NVLink, once to each GPU holding one of its experts. shardlm's
    dispatcher sends every (token, choice) pair, limit or not. The limit is the nodes a token's M
    groups lie on: M where a node holds a group, fewer where it holds several (8 groups on 4 nodes: 4
    picked of 8 miss a node with probability C(6, 4) / C(8, 4) = 15/70), and where a group spans nodes
    the distinct ones of each group's that its k / M choices there reach."""
    dsv3, _ = load_model("deepseek-v3")
    mixtral, _ = load_model("mixtral-8x7b")
    assert node_limit(dsv3, 8) == pytest.approx(4)  # 8 groups = 8 nodes' experts, the best 4 groups ("at most 4 nodes")
    assert node_limit(dsv3, 4) == pytest.approx(4 * (1 - 15 / 70))  # two groups a node
    assert node_limit(dsv3, 16) == pytest.approx(4 * 2 * (1 - (1 / 2) ** 2))  # a group over 2 nodes, 2 choices in each
    assert node_limit(dsv3, 1) is None and node_limit(mixtral, 8) is None  # greedy top-k: no limit
    cluster = Cluster(gpu=load_gpu("h800-sxm"), num_gpus=64, gpus_per_node=8)
    ep, share, g = list(range(64)), 4096 * 7168.0, cluster.gpu
    limited = comm.moe_dispatch(share, 8, 4, ep, cluster, "deepep")
    every_pair = comm.moe_dispatch(share, 8, None, ep, cluster)
    assert every_pair == comm.all_to_all(share * 8, ep, cluster) == comm.moe_dispatch(share, 8, 4, ep, cluster)
    # across IB: 4 nodes' copies, 7/8 of them remote, against 8 pairs' 56/64 remote
    inter = 7 * g.inter.alpha_s + 4 * 7 / 8 * share / g.inter.bandwidth_Bps
    assert limited == pytest.approx(g.collective_launch_s + inter)
    assert limited < 0.6 * every_pair
    # no limit: 8 even choices over 8 nodes reach 8 x (1 - (7/8)^8) = 5.25 nodes
    unlimited = comm.moe_dispatch(share, 8, None, ep, cluster, "deepep")
    reached = 8 * (1 - (7 / 8) ** 8)
    inter = 7 * g.inter.alpha_s + reached * 7 / 8 * share / g.inter.bandwidth_Bps
    assert unlimited == pytest.approx(g.collective_launch_s + inter) and limited < unlimited < every_pair
    # inside one node: 8 even choices over its 8 GPUs reach 5.25 of them, 7/8 remote, where shardlm
    # sends all 8 pairs (7/8 remote)
    node, reached = list(range(8)), 8 * (1 - (7 / 8) ** 8)
    intra = 7 * g.intra.alpha_s + reached * 7 / 8 * share / g.intra.bandwidth_Bps
    assert comm.moe_dispatch(share, 8, 4, node, cluster, "deepep") == pytest.approx(g.collective_launch_s + intra)
    assert comm.moe_dispatch(share, 8, 4, node, cluster) == comm.all_to_all(share * 8, node, cluster) > intra / 0.7


def test_training_costs_deepseek_v3s_all_to_all_node_limited():
    """DeepSeek-V3's published layout (ep 64 over 8 nodes), priced with DeepEP's dispatch: its
    group-limited routing (4 of 8 groups, a node's experts each) costs the dispatch and combine at 4
    nodes' copies over IB; the same model routing greedily at the ~5.3 nodes its 8 choices reach;
    shardlm's dispatcher pays every pair's."""
    cfg, _ = load_model("deepseek-v3")
    cluster = Cluster(gpu=load_gpu("h800-sxm"), num_gpus=2048, gpus_per_node=8)
    lay = Layout(tp=1, pp=16, dp=128, ep=64, zero=1, schedule="zb-h1", micro_batch=1, num_micro=120,
                 recompute="selective")  # fmt: skip
    wl = TrainWorkload(global_batch=15360, seq_len=4096, dtype="fp8", dispatcher="deepep")
    limited = training.evaluate(ModelCosts(cfg), cluster, lay, wl)
    greedy = training.evaluate(
        ModelCosts(replace(cfg, topk_method="greedy", n_group=1, topk_group=1)), cluster, lay, wl
    )
    every_pair = training.evaluate(ModelCosts(cfg), cluster, lay, replace(wl, dispatcher="shardlm"))
    assert limited.fits and greedy.fits
    assert limited.comm_s["ep"] < 0.8 * greedy.comm_s["ep"] < 0.8 * every_pair.comm_s["ep"]
    assert limited.step_s < greedy.step_s < every_pair.step_s


def test_training_and_inference_cost_the_moe_boundary_alike():
    """One function (``comm.moe_boundary``) for both: DeepSeek-V3's layers (four of them) at
    tp2 x dp8 x ep16 over two nodes of 8, 64 tokens a rank. Training's forward + backward is twice
    inference's trip (each collective's dual moves the same bytes), with the same dispatch (DeepEP's
    here: a token crosses IB once per node, not once per (token, choice) pair as shardlm's) and the tp
    group's re-gather; with the experts inside the tp group (tp8 ep8: the replicated dispatch) neither
    moves a token."""
    full, _ = load_model("deepseek-v3")
    cfg = replace(full, num_layers=4)
    costs = ModelCosts(cfg)
    cluster = Cluster(gpu=load_gpu("h800-sxm"), num_gpus=16, gpus_per_node=8)
    lay = Layout(tp=2, dp=8, ep=16)
    wl_inf = InferenceWorkload(prompt_len=1024, output_len=128, dispatcher="deepep")
    inf = inference.evaluate(costs, cluster, lay, wl_inf, batch=64)  # a decode step: 64 tokens
    wl_train = TrainWorkload(global_batch=8, seq_len=64, dispatcher="deepep")
    train = training.evaluate(costs, cluster, lay.with_(micro_batch=1, num_micro=1, zero=1), wl_train)
    assert inf.fits and train.fits
    n_moe = cfg.num_layers - cfg.first_k_dense
    trip = comm.moe_boundary(cfg, cluster, lay, 64, 2, "deepep")
    assert inf.decode_parts.ep_comm == pytest.approx(n_moe * trip) and trip > 0
    assert train.comm_s["ep"] == pytest.approx(2 * inf.decode_parts.ep_comm)
    # the trip: the node-limited dispatch and combine, then the tp group's all-gather
    share = 64 / 2 * cfg.hidden_size * 2
    ep_group, tp_group = lay.slowest_group("ep", 8), lay.slowest_group("tp", 8)
    limited = comm.moe_dispatch(share, cfg.num_experts_per_tok, node_limit(cfg, 2), ep_group, cluster, "deepep")
    assert trip == pytest.approx(2 * limited + comm.all_gather(share * 2, tp_group, cluster))
    every_pair = inference.evaluate(costs, cluster, lay, replace(wl_inf, dispatcher="shardlm"), batch=64)
    assert every_pair.decode_parts.ep_comm > 1.5 * inf.decode_parts.ep_comm
    inside = Layout(tp=8, dp=2, ep=8)
    assert inference.evaluate(costs, cluster, inside, wl_inf, batch=64).decode_parts.ep_comm == 0
    assert training.evaluate(costs, cluster, inside.with_(zero=1), wl_train).comm_s["ep"] == 0


def test_fp8_training_moves_16_bit_activations_and_deepep_dispatches_fp8():
    """FP8 runs the linear layers' GEMMs at one byte; the activations between them stay 16-bit, and
    so do their collectives: the tp all-reduces, the pipeline's sends, the all-to-all dispatcher's
    pairs (Megatron casts inside the experts' linear layers). DeepEP under FP8 dispatches the FP8
    copy and combines in 16 bits, each way (DeepSeek-V3 §3.3.3): its dispatch halves, its combine
    does not."""
    cfg, _ = load_model("deepseek-v3")
    costs = ModelCosts(cfg)
    cluster = Cluster(gpu=load_gpu("h800-sxm"), num_gpus=256, gpus_per_node=8)
    lay = Layout(tp=2, pp=2, dp=64, ep=64, sp=True, zero=1, micro_batch=1, num_micro=8, recompute="full")

    def comm_s(dtype: str, dispatcher: str) -> dict[str, float]:
        wl = TrainWorkload(global_batch=512, seq_len=4096, dtype=dtype, dispatcher=dispatcher)
        result = training.evaluate(costs, cluster, lay, wl)
        assert result.fits
        return result.comm_s

    for dispatcher in ("shardlm", "deepep"):
        bf16, fp8 = comm_s("bf16", dispatcher), comm_s("fp8", dispatcher)
        assert fp8["tp"] == bf16["tp"] and fp8["pp"] == bf16["pp"]
        assert (fp8["ep"] == bf16["ep"]) == (dispatcher == "shardlm")
    tokens = 4096.0
    half = comm.moe_boundary(cfg, cluster, lay, tokens, 2, "deepep", gemm_bytes=1)
    both16, both8 = (
        comm.moe_boundary(cfg, cluster, lay, tokens, 2, "deepep"),
        comm.moe_boundary(cfg, cluster, lay, tokens, 1, "deepep"),
    )
    g16, g8 = (comm.all_gather(tokens * cfg.hidden_size * b, lay.slowest_group("tp", 8), cluster) for b in (2, 1))
    assert half == pytest.approx((both16 - g16) / 2 + (both8 - g8) / 2 + g16)  # FP8 dispatch, 16-bit combine
    assert comm.moe_boundary(cfg, cluster, lay, tokens, 2, "shardlm", gemm_bytes=1) == comm.moe_boundary(
        cfg, cluster, lay, tokens, 2, "shardlm"
    )
    # serving FP8 weights through DeepEP dispatches FP8 too: its decode step's trip is the mixed one
    serve = Layout(tp=1, dp=16, ep=16)
    two_nodes = Cluster(gpu=load_gpu("h800-sxm"), num_gpus=16, gpus_per_node=8)
    fp8 = inference.evaluate(
        costs,
        two_nodes,
        serve,
        InferenceWorkload(prompt_len=1024, output_len=128, dtype="fp8", dispatcher="deepep"),
        64,
    )
    mixed = comm.moe_boundary(cfg, two_nodes, serve, 64, 2, "deepep", gemm_bytes=1)
    assert fp8.fits and fp8.decode_parts.ep_comm == pytest.approx((cfg.num_layers - cfg.first_k_dense) * mixed)
    assert mixed < comm.moe_boundary(cfg, two_nodes, serve, 64, 2, "deepep")


def test_megatrons_moe_block_is_priced_no_faster_than_its_measured_floor(monkeypatch):
    """Under ``--kernels fused`` (Megatron-Core's kernels) no MoE block's pass (the layer but its
    attention's products and core, forward and backward of one micro-batch) is priced faster than
    ``C.MOE_BLOCK_FLOOR_S``, the least Megatron's MoE layer took whatever its work. Qwen3-30B-A3B on
    16 H100s at ep16, one 4,096-token sequence a micro-batch (Megatron-Bridge's H100 layout): its
    blocks are priced under the floor without it, so each of its 48 layers waits the difference; with
    a floor of a second the passes are the 48 floors plus what lies outside the blocks. The floor
    belongs to Megatron's MoE block: shardlm's own kernels (the default) and a dense model are priced
    as before."""
    from shardlm.plan import constants as C

    costs = ModelCosts(load_model("qwen3-30b-a3b")[0])
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=16, gpus_per_node=8)
    lay = Layout(dp=16, ep=16, zero=1, micro_batch=1, num_micro=4)
    fused = TrainWorkload(global_batch=64, seq_len=4096, dtype="fp8", kernels="fused", dispatcher="deepep")

    def passes(wl: TrainWorkload, floor: float, model: ModelCosts = costs) -> float:
        monkeypatch.setattr(C, "MOE_BLOCK_FLOOR_S", floor)
        result = training.evaluate(model, cluster, lay, wl)
        assert result.fits
        return result.forward_s + result.backward_s

    free, floored = passes(fused, 0.0), passes(fused, 9.04e-3)
    assert free < floored < free + 48 * 9.04e-3
    outside = passes(fused, 1.0) - 48 * 1.0  # the attention, the LM head: what no block holds
    assert 0 < outside < free
    assert floored == pytest.approx(outside + 48 * 9.04e-3, rel=1e-9)  # every block below the floor
    assert floored > free + 48 * 4e-3  # HybridEP's blocks are priced at about 3.5 ms
    shardlm = replace(fused, kernels="shardlm")
    assert passes(shardlm, 1.0) == passes(shardlm, 0.0)
    dense = ModelCosts(load_model("smollm2-135m")[0])
    assert passes(fused, 1.0, dense) == passes(fused, 0.0, dense)
    # the floor splits between the passes as they are priced
    monkeypatch.setattr(C, "MOE_BLOCK_FLOOR_S", 9.04e-3)
    assert training._moe_floor(2e-3, 4e-3) == pytest.approx((1e-3 * (9.04 - 6) / 3, 2e-3 * (9.04 - 6) / 3))


def test_the_1f1b_overlap_merges_a_forward_with_another_micro_batchs_backward():
    """``--ep-overlap`` (Megatron-Core's 1F1B all-to-all overlap): every forward but the unmerged
    ones runs beside another micro-batch's backward, each MoE layer's trips hidden behind the pair's
    other work. Qwen3-30B-A3B on 16 H100s at ep16 without a pipeline: 4 micro-batches make 3 merged
    pairs (the first forward and the last backward alone), each saving the stage's ``hidden``; the step
    and the exposed ep time fall by exactly that. Layouts Megatron runs without it (a 1F1B pipeline, full
    recomputation, experts on one rank) are priced as before."""
    costs = ModelCosts(load_model("qwen3-30b-a3b")[0])
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=16, gpus_per_node=8)
    lay = Layout(dp=16, ep=16, zero=1, micro_batch=1, num_micro=4)
    waited = TrainWorkload(global_batch=64, seq_len=4096)
    merged = replace(waited, ep_overlap=True)
    tokens, a = 4096.0, 2
    hidden = training._stage(costs, cluster, lay, merged, 0, tokens, a).hidden
    assert hidden > 0 and training.unmerged_passes(lay) == 1
    before, after = (training.evaluate(costs, cluster, lay, wl) for wl in (waited, merged))
    assert before.step_s - after.step_s == pytest.approx(3 * hidden, rel=1e-9)
    assert before.comm_s["ep"] - after.comm_s["ep"] == pytest.approx(3 * hidden, rel=1e-9)
    for other in (
        replace(lay, dp=8, pp=2, ep=8, num_micro=8),  # a 1F1B pipeline: Megatron merges only interleaved ones
        replace(lay, recompute="full"),
        replace(lay, ep=1),
    ):
        assert (
            training.evaluate(costs, cluster, other, merged).step_s
            == training.evaluate(costs, cluster, other, waited).step_s
        )
    # under Megatron's block floor a pair also saves time the floor no longer waits: not communication,
    # so the ep time keeps only the trips (at ep2 on B200s the blocks sit far under the floor)
    b200 = Cluster(gpu=load_gpu("b200"), num_gpus=16, gpus_per_node=8)
    small = Layout(dp=16, ep=2, zero=1, micro_batch=1, num_micro=8, recompute="selective")
    fused = replace(merged, kernels="fused", dispatcher="deepep")
    floored, apart = (training.evaluate(costs, b200, small, wl) for wl in (fused, replace(fused, ep_overlap=False)))
    assert 0 <= floored.comm_s["ep"] < apart.comm_s["ep"]
    assert apart.step_s - floored.step_s > apart.comm_s["ep"] - floored.comm_s["ep"]
    deeper = Layout(dp=4, pp=4, ep=4, schedule="interleaved", virtual=2, zero=1, micro_batch=1, num_micro=8)
    assert training.unmerged_passes(deeper) == 2 * 3 + 1 * 4 + 1  # the first stage's warm-up and one more
    assert training.unmerged_passes(replace(deeper, num_micro=4)) == 8  # at most every pass
    assert (
        training.evaluate(costs, cluster, deeper, merged).step_s
        < training.evaluate(costs, cluster, deeper, waited).step_s
    )


def test_a_merged_pair_hides_the_trips_behind_the_rest_on_the_sms_deepep_leaves():
    """``training._merged_pair``: the pair takes the longer of its trips and its other work, which runs
    on the SMs DeepEP's 20 leave while they send (132 on an H100: 15% fewer); NCCL's all-to-all is not
    charged; under Megatron's block floor at least the forward's attention and one floor."""
    from shardlm.plan import constants as C

    h100 = load_gpu("h100-sxm")
    assert h100.sms == 132 and load_gpu("b200").sms == 148
    assert training._merged_pair(1e-3, 5e-3, 0.0, False, h100, "deepep") == 5e-3  # the trips longer
    assert training._merged_pair(10e-3, 2e-3, 0.0, False, h100, "deepep") == pytest.approx(10e-3 + 2e-3 * 20 / 132)
    assert training._merged_pair(10e-3, 2e-3, 0.0, False, h100, "shardlm") == 10e-3
    floored = training._merged_pair(3e-3, 1e-3, 1e-3, True, h100, "deepep")
    assert floored == pytest.approx(1e-3 + C.MOE_BLOCK_FLOOR_S)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_a_pair_whose_trips_outlast_the_rest_hides_all_of_the_rest(recompute):
    """What a merged pair hides is the whole rest of both passes: Qwen3-30B-A3B's MoE layers (no dense
    one) with every rank its own node, at 1,024 tokens under ring cp2 (its exchanges not all hidden
    behind attention), no block floor (shardlm's kernels), so each layer's trips outlast the rest of
    its pair. A first stage (no LM head) then saves its forward and backward less the trips, exactly:
    the backward's attention, the ring's backward exchanges and the selective recomputation included
    (``training._stage``'s ``rest``; any of them left out saves less)."""
    costs = ModelCosts(load_model("qwen3-30b-a3b")[0])
    assert costs.stage_kinds(2) == [(0, 24), (0, 24)]
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=32, gpus_per_node=1)
    lay = Layout(dp=8, pp=2, cp=2, ep=8, zero=1, micro_batch=1, num_micro=8, schedule="interleaved", virtual=2)
    wl = TrainWorkload(global_batch=64, seq_len=1024, ep_overlap=True)
    st = training._stage(costs, cluster, replace(lay, recompute=recompute), wl, 0, 512.0, 2)
    assert st.cp > 0 and 2 * st.ep > st.forward + st.backward - 2 * st.ep  # exchanges waited for; the trips longer
    assert st.hidden == pytest.approx(st.forward + st.backward - 2 * st.ep, rel=1e-12)


def test_the_overlap_holds_one_model_chunk_more():
    """Megatron's overlapped warm-up runs one micro-batch more, so an interleaved first stage holds one
    more model chunk (1/v of a stage's activations for a micro-batch) at its peak; without a pipeline
    the merged pairs free one micro-batch's layers as they fill the other's: no more."""
    from shardlm.plan.memory import training_activation_bytes

    costs = ModelCosts(load_model("qwen3-30b-a3b")[0])
    inter = Layout(dp=4, pp=4, ep=4, schedule="interleaved", virtual=2, zero=1, micro_batch=1, num_micro=8)
    flight = 4 + 3 / 2  # p + (p - 1) / v stage-equivalents
    plain, more = (training_activation_bytes(costs, inter, 4096, ep_overlap=o) for o in (False, True))
    assert more - plain == pytest.approx(plain / flight / 2, rel=0.05)  # the routed pairs' share is not linear
    flat = Layout(dp=16, ep=16, zero=1, micro_batch=1, num_micro=4)
    assert training_activation_bytes(costs, flat, 4096, ep_overlap=True) == training_activation_bytes(costs, flat, 4096)


def test_recompute_modules_free_their_outputs_and_run_their_products_again():
    """``--recompute-modules`` (Megatron-Core's): ``mla_up_proj`` keeps neither Q nor K nor V of
    DeepSeek-V3's latent attention (each layer's 2q + 4kv bytes a token, over tp), ``mlp`` none of a
    dense layer's MLP rows (an MoE layer's shared experts are another module); each one's products run
    again in backward, the forward unchanged; full recomputation recomputes them anyway."""
    from shardlm.plan.activations import layer_activation_bytes
    from shardlm.plan.memory import layer_shape

    costs = ModelCosts(load_model("deepseek-v3")[0])
    both = frozenset({"mla_up_proj", "mlp"})
    assert layer_shape(costs, True, modules=both).recomputed == {"mla_up_proj"}
    assert layer_shape(costs, False, modules=both).recomputed == both
    kept, freed = layer_shape(costs, True), layer_shape(costs, True, modules=both)
    gap = layer_activation_bytes(kept, seq=4096, micro_batch=1, tp=2) - layer_activation_bytes(
        freed, seq=4096, micro_batch=1, tp=2
    )
    assert gap == 4096 * (2 * kept.q_dim + 4 * kept.kv_dim) / 2
    dense, no_mlp = layer_shape(costs, False), layer_shape(costs, False, modules=frozenset({"mlp"}))
    gap = layer_activation_bytes(dense, seq=4096, micro_batch=1) - layer_activation_bytes(
        no_mlp, seq=4096, micro_batch=1
    )
    assert gap == 4096 * dense.ffn * dense.gated_row_bytes("none")
    qwen = ModelCosts(load_model("qwen3-30b-a3b")[0])
    assert layer_shape(qwen, True, modules=both).recomputed == frozenset()
    cluster = Cluster(gpu=load_gpu("b200"), num_gpus=256, gpus_per_node=8)
    lay = Layout(dp=16, pp=16, ep=16, zero=1, micro_batch=1, num_micro=64)
    wl = TrainWorkload(global_batch=1024, seq_len=4096, dtype="fp8", kernels="fused", dispatcher="deepep")
    before = training.evaluate(costs, cluster, lay, wl)
    first = training._stage(costs, cluster, lay, wl, 0, 4096.0, 2)  # the stage with the dense layers
    for modules in (("mla_up_proj",), ("mlp",)):
        recomputed = replace(wl, recompute_modules=modules)
        assert training.evaluate(costs, cluster, lay, recomputed).memory.activations < before.memory.activations
        again = training._stage(costs, cluster, lay, recomputed, 0, 4096.0, 2)
        assert again[0] == first[0] and again[1] > first[1], modules
    full = replace(lay, recompute="full")
    up = replace(wl, recompute_modules=("mla_up_proj", "mlp"))
    assert (
        training.evaluate(costs, cluster, full, up).backward_s == training.evaluate(costs, cluster, full, wl).backward_s
    )


def test_multi_token_prediction_modules_sit_on_a_balanced_last_stage():
    """``--mtp N`` (DeepSeek-V3's multi-token prediction): each module is one more layer of the last
    layer's kind, a projection and the LM head again, on the last stage; the layers are split so that
    no stage's products a token exceed the least possible, the last stage taking fewer (DeepSeek-V3 at
    pp8: 4 layers and the module), ties going to later stages. It costs time and the last stage's
    weights, and shardlm's trainer does not run it."""
    from shardlm.plan.memory import weight_bytes
    from shardlm.plan.runnable import not_runnable

    cfg = load_model("deepseek-v3")[0]
    plain = ModelCosts(cfg)
    mtp = plain.with_mtp(1)
    assert plain.with_mtp(0) is plain and plain.with_mtp(1) is mtp and mtp.mtp == 1
    kinds = mtp.stage_kinds(8)
    assert kinds == [(3, 5), (0, 8), (0, 8), (0, 8), (0, 8), (0, 8), (0, 9), (0, 5)]
    assert sum(n for k in kinds for n in k) == cfg.num_layers + 1
    assert plain.stage_kinds(8)[-1][1] + 1 > kinds[-1][1]  # the module's stage gave layers away
    lay = Layout(dp=16, pp=8, ep=16, zero=1, micro_batch=1, num_micro=64)
    h = cfg.hidden_size
    assert (
        weight_bytes(mtp, replace(lay, pp=1, dp=128), 2) - weight_bytes(plain, replace(lay, pp=1, dp=128), 2)
        > 2 * h * h * 2
    )
    cluster = Cluster(gpu=load_gpu("b200"), num_gpus=128, gpus_per_node=8)
    wl = TrainWorkload(global_batch=1024, seq_len=4096, dtype="fp8", kernels="fused", dispatcher="deepep")
    one = training.evaluate(plain, cluster, replace(lay, recompute="full"), wl)
    two = training.evaluate(plain, cluster, replace(lay, recompute="full"), replace(wl, mtp=1))
    assert one.fits and two.fits and two.step_s > one.step_s
    # each module's own cost on the last stage: one more layer (the second module's less the first's is a
    # layer and a module's head and projection alike), the head and the projection again
    tokens, a = 4096.0, 2
    f0, f1, f2 = (
        training._stage(plain.with_mtp(n), cluster, replace(lay, pp=1, dp=128), wl, 0, tokens, a)[0] for n in (0, 1, 2)
    )
    assert f2 - f1 == pytest.approx(f1 - f0, rel=1e-3)
    mean = f0 / (cfg.num_layers + 1)  # a layer's forward, the LM head's taken as one more layer
    assert f1 - f0 > 1.5 * mean  # a layer and an LM head, which costs DeepSeek-V3 more than a layer
    assert not_runnable(cfg, lay, train=True, dtype="fp32", mtp=1).startswith("1 multi-token-prediction module")
    with pytest.raises(PlanError, match="--mtp -1 must be a whole number"):
        TrainWorkload(global_batch=8, seq_len=128, mtp=-1)


def test_the_overlap_recompute_module_and_mtp_flags_are_refused_where_they_do_nothing(capsys):
    """Each flag is refused, naming the value, where the model or a pinned layout leaves it nothing
    to do; a layout priced with one is marked: shardlm's trainer runs none of them."""
    from shardlm.plan import cli
    from shardlm.plan.planner import PlanRequest, plan

    argv = ["--gpu", "h100-sxm", "--gpus", "16", "--train"]
    cases = (
        (["--model", "llama-3-8b", "--ep-overlap"], "the model has no experts"),
        (["--model", "qwen3-30b-a3b", "--ep-overlap", "--ep", "1"], "but --ep 1 is pinned"),
        (["--model", "qwen3-30b-a3b", "--ep-overlap", "--recompute", "full"], "but --recompute full is pinned"),
        (["--model", "qwen3-30b-a3b", "--ep-overlap", "--pp", "2", "--schedule", "1f1b"], "only interleaved"),
        (["--model", "qwen3-30b-a3b", "--recompute-modules", "mla_up_proj"], "the model has none"),
        (["--model", "qwen3-30b-a3b", "--recompute-modules", "mlp"], "every layer of the model is MoE"),
        (
            ["--model", "deepseek-v3", "--recompute-modules", "moe_act"],
            "core_attn and moe_act are --recompute selective",
        ),
        (["--model", "deepseek-v3", "--recompute-modules", "mlp", "--recompute", "full"], "--recompute full is pinned"),
        (["--model", "deepseek-v3", "--mtp", "-1"], "--mtp -1 must be a whole number"),
    )
    for extra, why in cases:
        assert cli.main([*argv, *extra]) == 2, extra
        assert why in capsys.readouterr().err, extra
    assert cli.main(["--model", "qwen3-30b-a3b", "--gpu", "h100-sxm", "--gpus", "16", "--ep-overlap"]) == 2
    assert "--ep-overlap is a training flag" in capsys.readouterr().err
    wl = TrainWorkload(global_batch=64, seq_len=4096, ep_overlap=True)
    res = plan(
        PlanRequest(model="qwen3-30b-a3b", gpu="h100-sxm", gpus=16, train=True, training=wl, fixed=dict(ep=16, pp=1))
    )
    assert "the all-to-alls behind another micro-batch (--ep-overlap" in (res.not_as_modelled(res.best) or "")
    assert not res.overlap_note()
    # a pick Megatron does not overlap (experts on one rank) is said to be priced without, not left silent
    res.ranked[0] = replace(res.best, layout=res.best.layout.with_(ep=1))
    assert "--ep-overlap does not apply to the pick" in res.overlap_note()[0]


def test_model_states_are_the_largest_stages_and_mtp_keeps_an_embedding_on_the_last():
    """Each stage's states are counted with its own experts (over their copies) and the largest is
    kept: DeepSeek-V3 at pp8 ep32 on 256 B200s holds 9 MoE layers on its seventh stage, whose experts,
    one copy each, keep all their Adam states (the first stage, whose 5 were counted, is not the
    largest). With multi-token prediction the last stage holds an embedding beside the LM head, which
    the modules look the next tokens up in (Megatron-Core builds it there)."""
    from shardlm.plan.memory import outer_params, stage_weight_bytes, training_memory
    from shardlm.plan.zero import ADAM_STATE_BYTES

    cfg = load_model("deepseek-v3")[0]
    costs = ModelCosts(cfg, mtp=1)
    lay = Layout(dp=32, pp=8, ep=32, zero=1, micro_batch=1, num_micro=128, schedule="interleaved", virtual=2)
    assert max(moe for _, moe in costs.stage_kinds(8)) == 9 and costs.stage_kinds(8)[0][1] == 5
    rl = costs.rank_layer(True, 1, 32, 1)
    mem = training_memory(costs, lay, 0.0, seq=4096, kernels="fused", dtype="fp8")
    assert mem.optimizer >= 9 * rl.experts * rl.expert_params * ADAM_STATE_BYTES
    embed = costs.vocab_rows(1) * cfg.hidden_size
    assert outer_params(costs, lay, 7) == 2 * embed and outer_params(ModelCosts(cfg), lay, 7) == embed
    assert stage_weight_bytes(costs, lay, 1)[-1] > 2 * embed + costs.stage_kinds(8)[-1][1] * rl.total


def test_recompute_module_names_are_read_as_given():
    """``--recompute-modules`` takes names separated by commas, spaces and empty names dropped."""
    from shardlm.plan import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    argv = ["--model", "deepseek-v3", "--gpu", "h100-sxm", "--gpus", "8", "--train"]
    args = parser.parse_args([*argv, "--recompute-modules", " mlp, ,mla_up_proj,"])
    assert cli.build_request(args).training.recompute_modules == ("mla_up_proj", "mlp")


def test_the_stage_that_sets_the_pace_is_the_slowest_with_its_overlap_saving_taken_off():
    """Under ``--ep-overlap`` each stage saves by its own MoE layers: Qwen3-235B at tp2 pp8 vpp4 ep32
    on 256 H100s (the ModelZoo's layout) has its slowest stage before the saving (more MoE layers)
    save more than the last one (fewer layers and the LM head), which then sets the pace."""
    costs = ModelCosts(load_model("qwen3-235b-a22b")[0])
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=256, gpus_per_node=8)
    lay = Layout(tp=2, sp=True, pp=8, dp=16, ep=32, zero=1, micro_batch=1, num_micro=128,
                 schedule="interleaved", virtual=4, recompute="selective")  # fmt: skip
    wl = TrainWorkload(global_batch=2048, seq_len=4096, kernels="fused", dispatcher="deepep", ep_overlap=True)
    merged = lay.num_micro * lay.virtual - training.unmerged_passes(lay)
    passes = [training._stage(costs, cluster, lay, wl, s, 4096.0, 2) for s in range(lay.pp)]
    before = max(range(lay.pp), key=lambda s: passes[s][0] + passes[s][1])
    after = max(
        range(lay.pp), key=lambda s: lay.num_micro * (passes[s][0] + passes[s][1]) - merged * passes[s].hidden / 4
    )
    assert before != after == lay.pp - 1
    assert training.evaluate(costs, cluster, lay, wl).forward_s == passes[after][0]
