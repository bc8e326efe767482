"""Planner time model: alpha-beta collectives, roofline decode, limits."""

import dataclasses
import json

import pytest

from shardlm.plan import comm
from shardlm.plan.catalog import load_model
from shardlm.plan.hardware import Cluster, load_gpu
from shardlm.plan.inference import InferenceWorkload, evaluate
from shardlm.plan.layout import Layout
from shardlm.plan.roofline import ModelCosts
from shardlm.plan.search import search_inference


@pytest.fixture
def two_nodes():
    return Cluster(gpu=load_gpu("h100-sxm"), num_gpus=16, gpus_per_node=8)


def test_ring_all_reduce_inside_a_node(two_nodes):
    g, n, size = two_nodes.gpu, 8, 1e9
    expected = g.collective_launch_s + 2 * (n - 1) * g.intra.alpha_s + 2 * (n - 1) / n * size / g.intra.bandwidth_Bps
    assert comm.all_reduce(size, list(range(8)), two_nodes) == pytest.approx(expected)


def test_hierarchical_all_reduce_across_nodes(two_nodes):
    g, size = two_nodes.gpu, 1e9
    got = comm.all_reduce(size, list(range(16)), two_nodes)
    # reduce-scatter + all-gather over 8 GPUs inside each node, all-reduce of 1/8 across the 2 nodes
    intra = 2 * (7 * g.intra.alpha_s + 7 / 8 * size / g.intra.bandwidth_Bps)
    inter = 2 * g.inter.alpha_s + size / 8 / g.inter.bandwidth_Bps
    assert got == pytest.approx(g.collective_launch_s + intra + inter)
    assert got > comm.all_reduce(size, list(range(8)), two_nodes)
    # one GPU per node: the flat ring runs over the NICs
    assert comm.all_reduce(size, [0, 8], two_nodes) == pytest.approx(
        g.collective_launch_s + 2 * g.inter.alpha_s + size / g.inter.bandwidth_Bps
    )


def test_decode_at_batch_one_is_weight_bandwidth_bound():
    cfg, _ = load_model("llama-3-8b")
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=1, gpus_per_node=8)
    res = evaluate(ModelCosts(cfg), cluster, Layout(), InferenceWorkload(prompt_len=128, output_len=128), batch=1)
    # every weight but the embedding table (a lookup) streams from memory once per token
    weight_time = (8.03e9 - cfg.vocab_size * cfg.hidden_size) * 2 / cluster.gpu.mem_Bps
    assert res.tpot_s == pytest.approx(weight_time, rel=0.02)
    assert res.ttft_s > 0 and res.memory.kv_cache == pytest.approx(32 * 2 * 8 * 128 * 2 * 256)


def test_tpot_limit_caps_the_batch(two_nodes):
    cfg, _ = load_model("llama-3-70b")
    costs = ModelCosts(cfg)
    free = search_inference(
        costs, two_nodes, InferenceWorkload(prompt_len=2048, output_len=256), objective="throughput", fixed={}
    )
    limited = search_inference(
        costs,
        two_nodes,
        InferenceWorkload(prompt_len=2048, output_len=256, max_tpot_s=0.02),
        objective="throughput",
        fixed={},
    )
    best = limited.results[0]
    assert best.tpot_s <= 0.02 and best.batch < free.results[0].batch
    assert best.throughput < free.results[0].throughput


def test_pipeline_does_not_shorten_a_token_but_adds_capacity(two_nodes):
    cfg, _ = load_model("llama-3-70b")
    costs, wl = ModelCosts(cfg), InferenceWorkload(prompt_len=1024, output_len=128)
    tp8 = evaluate(costs, two_nodes, Layout(tp=8, dp=2), wl, batch=1)
    pp2 = evaluate(costs, two_nodes, Layout(tp=8, pp=2), wl, batch=1)
    assert pp2.tpot_s >= tp8.tpot_s * 0.99
    assert pp2.max_batch > 2 * tp8.max_batch


def test_fp8_training_keeps_the_attention_core_and_lm_head_at_bf16(monkeypatch):
    """FP8 speeds up the linear layers' GEMMs only (DeepSeek-V3 §3.3.1 keeps attention and the
    output head in BF16): an FP8 step is slower than one with every matmul at the FP8 rate, and its
    attention core takes as long as bf16's."""
    from shardlm.plan import training

    cfg, _ = load_model("llama-3-8b")
    costs, cluster = ModelCosts(cfg), Cluster(gpu=load_gpu("h100-sxm"), num_gpus=8, gpus_per_node=8)
    lay = Layout(dp=8, zero=1, micro_batch=1, num_micro=8, recompute="full")

    def fwd(dtype: str) -> float:
        wl = training.TrainWorkload(global_batch=64, seq_len=8192, dtype=dtype)
        res = training.evaluate(costs, cluster, lay, wl)
        assert res.fits
        return res.forward_s

    kept, bf16 = fwd("fp8"), fwd("bf16")
    monkeypatch.setattr(training, "FP8_KEEPS_AT", {})
    every = fwd("fp8")
    assert every < kept < bf16
    # at 8K tokens the attention core is a sizeable share (beside it the memory-bound operators
    # take theirs at every dtype: plan/traffic.py)
    assert kept - every > 0.05 * kept


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_gradient_sync_is_what_the_trainer_sends(zero, two_nodes, monkeypatch):
    """shardlm's trainer reduces gradients in float32 (train/unit.py Unit.full_grad), once a step
    whatever the micro-batches (the last backward): ZeRO-0 all-reduces them, ZeRO-1 and 2
    reduce-scatter them and all-gather the updated 16-bit weights after the step. With nothing hidden
    behind backward, the step's dp traffic is exactly that, at 1 and 4 micro-batches a step; with
    backward hiding all it can, the all-gather is left (the trainer runs nothing beside it)."""
    from shardlm.plan import constants, training
    from shardlm.plan.memory import weight_bytes

    monkeypatch.setattr(constants, "DP_OVERLAP_FRACTION", 0.0)
    costs = ModelCosts(load_model("smollm2-135m")[0])
    for m in (1, 4):
        lay = Layout(dp=16, zero=zero, micro_batch=1, num_micro=m)
        res = training.evaluate(costs, two_nodes, lay, training.TrainWorkload(global_batch=16 * m, seq_len=2048))
        params, dp = weight_bytes(costs, lay, 1), lay.slowest_group("dp_cp", 8)
        if zero == 0:
            want = comm.all_reduce(4 * params, dp, two_nodes)
        else:
            want = comm.reduce_scatter(4 * params, dp, two_nodes) + comm.all_gather(2 * params, dp, two_nodes)
        assert res.fits and res.comm_s["dp"] == pytest.approx(want)
        if zero:  # with backward hiding the reductions, the all-gather after the step still waits
            monkeypatch.setattr(constants, "DP_OVERLAP_FRACTION", 1.0)
            wl = training.TrainWorkload(global_batch=16 * m, seq_len=2048)
            hidden = training.evaluate(costs, two_nodes, lay, wl).comm_s["dp"]
            monkeypatch.setattr(constants, "DP_OVERLAP_FRACTION", 0.0)
            assert hidden == pytest.approx(comm.all_gather(2 * params, dp, two_nodes))


def test_memory_bound_operators_cost_what_their_kernels_move(capsys):
    """plan/traffic.py: a small model's step is mostly its norms, activations, loss and Adam; fused
    kernels (--kernels fused, Megatron's) move fewer bytes than shardlm's eager trainer, and the
    difference is the traffic alone (same FLOPs, same layout)."""
    from shardlm.plan import cli, traffic
    from shardlm.plan.training import TrainWorkload
    from shardlm.plan.training import evaluate as train

    cfg, _ = load_model("smollm2-135m")
    costs, cluster = ModelCosts(cfg), Cluster(gpu=load_gpu("h100-sxm"), num_gpus=1, gpus_per_node=1)
    lay = Layout(micro_batch=16, num_micro=1)
    eager, fused = (
        train(costs, cluster, lay, TrainWorkload(global_batch=16, seq_len=512, kernels=k)) for k in traffic.KERNELS
    )
    assert fused.step_s < eager.step_s and eager.mfu < 0.2  # measured on an H100: 10.7% (docs/performance.md)
    shardlm, megatron = traffic.profile("shardlm", "bf16"), traffic.profile("fused", "bf16")
    assert shardlm.forward.hidden > megatron.forward.hidden and shardlm.per_param > megatron.per_param
    argv = ["--model", "smollm2-135m", "--gpu", "h100-sxm", "--gpus", "1", "--train", "--global-batch", "16"]
    argv += ["--seq-len", "512", "--micro-batch", "16", "--json"]
    rates = {}
    for k in traffic.KERNELS:
        assert cli.main([*argv, "--kernels", k]) == 0
        rates[k] = json.loads(capsys.readouterr().out)["layouts"][0]["tokens_per_s"]
    assert rates["fused"] > rates["shardlm"]


def test_moe_layers_move_their_routed_pairs(monkeypatch):
    """plan/traffic.py: an MoE layer copies each routed (token, expert) pair its experts compute
    into expert order and back, forward and backward; the micro-batch's passes grow by exactly those
    bytes (tokens x k / ep pairs a rank, on the busiest rank of the ep group, a hidden row each) at
    the memory's rate."""
    from shardlm.plan import traffic
    from shardlm.plan.roofline import routing_imbalance
    from shardlm.plan.training import TrainWorkload
    from shardlm.plan.training import evaluate as train

    cfg, _ = load_model("mixtral-8x7b")
    costs, cluster = ModelCosts(cfg), Cluster(gpu=load_gpu("h100-sxm"), num_gpus=32, gpus_per_node=8)
    lay = Layout(dp=8, ep=8, pp=4, micro_batch=1, num_micro=1, zero=1)  # 8 MoE layers a stage
    wl = TrainWorkload(global_batch=8, seq_len=4096, kernels="fused")
    counted = train(costs, cluster, lay, wl)
    real = traffic.profile
    monkeypatch.setattr(traffic, "profile", lambda *a: dataclasses.replace(real(*a), pair=(0.0, 0.0)))
    without = train(costs, cluster, lay, wl)
    assert counted.fits
    k = cfg.num_experts_per_tok
    busiest = routing_imbalance(lay.moe_tokens(4096) * k, lay.ep, cfg.num_experts, k)
    assert busiest > 1.01
    rows = cfg.num_layers / lay.pp * lay.moe_tokens(4096) * k / lay.ep * busiest * cfg.hidden_size
    pair = real("fused", "bf16").pair
    assert pair == (8, 8)  # 4 hidden-wide 16-bit rows a pair each way
    passes = lambda r: r.forward_s + r.backward_s  # (the LM head's traffic splits as the layers' does)
    assert passes(counted) - passes(without) == pytest.approx(rows * sum(pair) / cluster.gpu.mem_Bps)


@pytest.mark.parametrize("seq, bound", [(16, True), (8192, False)])
def test_weight_gradients_add_into_the_float32_buffer(seq, bound, monkeypatch):
    """Backward's weight-gradient products add into the float32 gradient each micro-batch
    (Megatron's gradient-accumulation fusion: read and write, 8 bytes a parameter). At a few tokens
    a micro-batch that read and write outlasts the FLOPs and the backward grows by exactly those
    bytes at the memory's rate; at 8K tokens the FLOPs hide them."""
    from shardlm.plan import training
    from shardlm.plan.roofline import gemm_count, k_efficiency, touched_params

    cfg, _ = load_model("llama-3-8b")
    costs, cluster = ModelCosts(cfg), Cluster(gpu=load_gpu("h100-sxm"), num_gpus=8, gpus_per_node=8)
    lay = Layout(dp=8, zero=1, micro_batch=1, num_micro=1, recompute="full")
    wl = training.TrainWorkload(global_batch=8, seq_len=seq, kernels="fused")
    added = training.evaluate(costs, cluster, lay, wl)
    monkeypatch.setattr(training, "grad_epilogue_bytes", lambda kernels, a, g: 0)
    free = training.evaluate(costs, cluster, lay, wl)
    assert added.fits and added.forward_s == free.forward_s
    if not bound:
        assert added.backward_s == pytest.approx(free.backward_s)
        return
    rl = costs.rank_layer(False, 1)
    step = training.Step(tokens=seq, ctx=seq / 2, decode=False, seqs=1, moe_tokens=seq)
    g = cluster.gpu  # the products' own time, which the bytes outlast (the tokens their inner dimension):
    flops = 2 * seq * (rl.attn + rl.dense + rl.router) / k_efficiency(seq, g.half_k("bf16"))
    own = flops / g.matmul_flops("bf16") + gemm_count(cfg, rl, step) * g.gemm_fixed_s("bf16")
    per_layer = touched_params(cfg, rl, step) * 8 / g.mem_Bps - own
    assert added.backward_s - free.backward_s == pytest.approx(cfg.num_layers * per_layer)


@pytest.mark.parametrize(
    ("gpu", "recipe", "by_norm", "other"),
    [
        ("h100-sxm", None, 0, 4),
        ("h100-sxm", "tensorwise", 4, 6),
        ("h100-sxm", "blockwise", 4, 4),
        ("b200", None, 0, 3),
        ("b200", "tensorwise", 3, 5),
        ("b200", "mxfp8", 4, 4),
    ],
)
def test_fp8_training_casts_each_gemm_operand(monkeypatch, gpu, recipe, by_norm, other):
    """FP8 GEMMs need FP8 operands: a cast of each input and of every output gradient, reading the
    16-bit tensor and writing its FP8 copy and transpose, 4 bytes an element. By recipe
    (``training.FP8_CAST_BYTES``): delayed scaling (the default) has the norms that feed the qkv and
    gate-and-up projections write FP8 themselves; current scaling (tensorwise) reads every other tensor
    once more for its amax (6) and casts the norms' 16-bit outputs (4, the amax fused in the norm);
    MXFP8 and blockwise cast them too (4). On Blackwell, whose FP8 GEMMs take any layout, a
    per-tensor recipe writes no transpose (a byte less); a block-scaled one still writes its
    column-wise copy. The passes grow by exactly those bytes at the memory's rate; bf16 casts nothing."""
    from shardlm.plan import training

    cfg, _ = load_model("smollm2-135m")
    costs, cluster = ModelCosts(cfg), Cluster(gpu=load_gpu(gpu), num_gpus=1, gpus_per_node=1)
    lay = Layout(micro_batch=4, num_micro=1)
    tokens = 4 * 2048

    def passes(dtype):
        wl = training.TrainWorkload(
            global_batch=4, seq_len=2048, dtype=dtype, fp8_recipe=recipe if dtype == "fp8" else None
        )
        r = training.evaluate(costs, cluster, lay, wl)
        assert r.fits
        return r.forward_s, r.backward_s

    assert training.fp8_cast_bytes(recipe, cluster.gpu) == (by_norm, other)
    (f8, b8), (f16, b16) = passes("fp8"), passes("bf16")
    monkeypatch.setattr(training, "fp8_cast_bytes", lambda *_: (0, 0))
    (f0, b0), (g16, c16) = passes("fp8"), passes("bf16")
    assert (f16, b16) == (g16, c16)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    per_byte = tokens * cfg.num_layers / cluster.gpu.mem_Bps
    normed, forward, backward = 2 * h, q + i, (q + 2 * kv) + h + 2 * i + h  # qkv's and gate-and-up's inputs
    # the LM head's traffic splits between forward and backward as the layers' does: compare sums
    assert (f8 + b8) - (f0 + b0) == pytest.approx((normed * by_norm + (forward + backward) * other) * per_byte)


def test_recomputed_modules_cast_their_fp8_inputs_again(monkeypatch):
    """``--recompute-modules mlp`` runs a dense layer's MLP again in backward, and under FP8 its inputs'
    casts with it: the gate-and-up's (its norm's output, 4 bytes an element under current scaling on
    an H100) and the down projection's (6). SmolLM2-135M on one H100, 4K tokens."""
    from shardlm.plan import training

    cfg = load_model("smollm2-135m")[0]
    costs, cluster = ModelCosts(cfg), Cluster(gpu=load_gpu("h100-sxm"), num_gpus=1, gpus_per_node=1)
    lay = Layout(micro_batch=1, num_micro=1)

    def both(modules) -> float:
        wl = training.TrainWorkload(
            global_batch=1, seq_len=4096, dtype="fp8", fp8_recipe="tensorwise", recompute_modules=modules
        )
        r = training.evaluate(costs, cluster, lay, wl)
        assert r.fits
        return r.forward_s + r.backward_s  # the LM head's traffic splits as the layers' does: the sum

    cast = both(("mlp",)) - both(())
    monkeypatch.setattr(training, "fp8_cast_bytes", lambda *_: (0, 0))
    uncast = both(("mlp",)) - both(())
    per_layer = 4 * cfg.hidden_size + 6 * cfg.intermediate_size  # the gate-and-up's input, the down's
    assert cast - uncast == pytest.approx(4096 * cfg.num_layers * per_layer / cluster.gpu.mem_Bps)


def test_fp8_recipe_is_refused_outside_fp8_by_unknown_name_and_where_the_gpu_lacks_it():
    from shardlm.plan.errors import PlanError
    from shardlm.plan.training import TrainWorkload, check_fp8_recipe

    with pytest.raises(PlanError, match="add --dtype fp8"):
        TrainWorkload(global_batch=4, seq_len=2048, fp8_recipe="mxfp8")
    with pytest.raises(PlanError, match="not one of delayed, tensorwise, mxfp8, blockwise"):
        TrainWorkload(global_batch=4, seq_len=2048, dtype="fp8", fp8_recipe="current")
    mxfp8 = TrainWorkload(global_batch=4, seq_len=2048, dtype="fp8", fp8_recipe="mxfp8")
    with pytest.raises(PlanError, match="h100-sxm is 9; use tensorwise, delayed or blockwise"):
        check_fp8_recipe(mxfp8, load_gpu("h100-sxm"))
    with pytest.raises(PlanError, match="mi300x is not a CUDA GPU"):
        check_fp8_recipe(mxfp8, load_gpu("mi300x"))
    check_fp8_recipe(mxfp8, load_gpu("gb300"))
    assert [load_gpu(g).fp8_gemm_any_layout for g in ("a100-80g", "h200", "b200", "gb300")] == [0, 0, 1, 1]


def test_gemms_follow_the_measured_k_curves():
    """A GEMM slows down at a small inner dimension K (GpuSpec.gemm_half_k): the catalog's curves
    reproduce the shape of the tables they are taken from within 4% (up to each table's own
    large-size rate, which MATMUL_EFFICIENCY replaces): DeepGEMM's H800 FP8 table (README, M = 4096:
    TFLOPS at (N, K), each over its last wave of 128 x 128 tiles on 132 SMs) and XLA's measured sm_90
    bf16 table (matmul_interpolator_data.h, M = N = 4096). A layer's products are timed GEMM by GEMM
    with it: forward at each product's K, the input gradient at its N, the weight gradient at the
    tokens. A GPU without a measured curve has no K term."""
    import math
    import statistics

    from shardlm.plan import constants as C
    from shardlm.plan.roofline import Step, backward_products, gemm_efficiency, k_efficiency, layer_work
    from shardlm.plan.shard import gemm_shapes

    def same_shape(model: list[float], published: list[float]) -> None:
        ratios = [m / p for m, p in zip(model, published)]
        assert all(r == pytest.approx(statistics.mean(ratios), rel=0.04) for r in ratios)

    h800, h100 = load_gpu("h800-sxm"), load_gpu("h100-sxm")
    deepgemm = ((2112, 7168, 1058), (24576, 1536, 990), (32768, 512, 590), (7168, 16384, 1358),
                (4096, 7168, 1304), (7168, 2048, 1025))  # fmt: skip
    waves = [(t := 32 * math.ceil(n / 128)) / (math.ceil(t / 132) * 132) for n, _, _ in deepgemm]
    same_shape([w * k_efficiency(k, h800.half_k("fp8")) for w, (_, k, _) in zip(waves, deepgemm)],
               [tf for _, _, tf in deepgemm])  # fmt: skip
    xla = ((256, 399), (512, 552), (1024, 685), (2048, 736), (4096, 780))
    same_shape([k_efficiency(k, h100.half_k("bf16")) for k, _ in xla], [tf for _, tf in xla])
    assert load_gpu("a100-80g").half_k("bf16") == 0 and k_efficiency(2048, 0) == 1.0

    cfg, _ = load_model("llama-3-8b")
    rl = ModelCosts(cfg).rank_layer(False, 1)
    t = 4096.0
    step = Step(tokens=t, ctx=t / 2, decode=False, seqs=1, moe_tokens=t)
    kw = dict(ep=1, half_rows=C.GEMM_HALF_ROWS)
    eff = gemm_efficiency(t, C.GEMM_HALF_ROWS)
    shapes = gemm_shapes(cfg, rl)
    assert sum(k * n for k, n in shapes["attn"] + shapes["dense"]) == pytest.approx(rl.attn + rl.dense, rel=1e-3)
    k_half = h100.half_k("fp8")
    forward = layer_work(cfg, rl, step, w_bytes=1, a_bytes=2, kv_bytes=2, k_half=k_half, **kw)[0].flops
    dgrad, weight = backward_products(cfg, rl, step, k_half=k_half, **kw)
    for got, inner in ((forward, lambda k, n: k), (dgrad, lambda k, n: n)):
        want = sum(2 * t * k * n / k_efficiency(inner(k, n), k_half) for k, n in shapes["attn"] + shapes["dense"])
        # (norms' parameters ride with the products, at the part's mean slowdown)
        assert got * eff == pytest.approx(want, rel=1e-3)
    assert weight == pytest.approx(2 * t * (rl.attn + rl.dense) / k_efficiency(t, k_half))
    bf16 = {layer_work(cfg, rl, step, w_bytes=2, a_bytes=2, kv_bytes=2, **kw)[0].flops}
    bf16 |= set(backward_products(cfg, rl, step, **kw))
    assert len(bf16) == 1 and bf16.pop() == pytest.approx(2 * t * (rl.attn + rl.dense) / eff)


def test_each_gemm_pays_the_measured_fixed_time():
    """A GEMM takes its FLOPs at the large-GEMM rate (on the K curve) plus a fixed time of its own
    (GpuSpec.gemm_fixed_us): the catalog's Hopper bf16 value reproduces XLA's measured sm_90 table
    (matmul_interpolator_data.h, TFLOPS at (M, N, K); the table's own large-GEMM rate of its fit,
    880 TFLOPS) within 26% from 256 to 4,096 a side, where the same curve without it is off by up to
    3.8x. A dtype with a measured fixed time drops the rows rule of thumb (GpuSpec.half_rows), which
    the fixed time replaces; the others keep it. A layer pays it once a GEMM kernel: attention's, the dense MLP's, the
    router's and each touched expert's own, in every pass."""
    from shardlm.plan import constants as C
    from shardlm.plan.roofline import Step, Work, gemm_count, layer_work

    h100, a100 = load_gpu("h100-sxm"), load_gpu("a100-80g")
    fixed, k_half = h100.gemm_fixed_s("bf16"), h100.half_k("bf16")
    xla = {(4096, 4096, 4096): 780, (4096, 4096, 1024): 685, (2048, 2048, 2048): 641, (1024, 1024, 4096): 473,
           (512, 4096, 4096): 662, (4096, 512, 1024): 378, (1024, 1024, 1024): 253, (512, 2048, 1024): 242,
           (2048, 512, 512): 150, (256, 4096, 4096): 418}  # fmt: skip

    def error(m: int, n: int, k: int, t0: float) -> float:
        flops = 2 * m * n * k
        return flops / (flops / (880e12 * k / (k + k_half)) + t0) / (xla[m, n, k] * 1e12) - 1

    assert all(abs(error(*mnk, fixed)) < 0.26 for mnk in xla)
    assert sum(abs(error(*mnk, 0.0)) > 0.5 for mnk in xla) >= 5
    assert h100.half_rows("bf16") == 0 and fixed == pytest.approx(5.9e-6)
    assert h100.half_rows("fp32") == C.GEMM_HALF_ROWS and h100.gemm_fixed_s("fp32") == 0  # none measured
    assert a100.half_rows("bf16") == C.GEMM_HALF_ROWS and a100.gemm_fixed_s("bf16") == 0

    cfg, _ = load_model("qwen3-235b-a22b")
    costs = ModelCosts(cfg)
    for ep, local in ((8, 16), (32, 4)):
        rl = costs.rank_layer(True, 2, ep)
        step = Step(tokens=4096, ctx=2048, decode=False, seqs=1, moe_tokens=4096 * ep)
        assert gemm_count(cfg, rl, step) == pytest.approx(2 + 1 + 2 * local)  # qkv and o, the router, 2 an expert
        mm, _ = layer_work(cfg, rl, step, w_bytes=2, a_bytes=2, kv_bytes=2, ep=ep, half_rows=0, k_half=k_half)
        assert mm.gemms == gemm_count(cfg, rl, step)
        assert mm.time(h100, "bf16") == pytest.approx(
            max(mm.flops / h100.matmul_flops("bf16") + mm.gemms * fixed, mm.bytes / h100.mem_Bps)
        )
    assert Work(flops=1e9, gemms=3).time(a100, "bf16") == Work(flops=1e9).time(a100, "bf16")


def test_tp_overlap_pipelines_the_collectives_with_the_gemms(capsys):
    """--tp-overlap (Megatron-LM's --tp-comm-overlap) prices each block's TP collectives pipelined with
    that block's GEMMs in tp chunks: max(c, g) + min(c, g) / tp against g, so all but one chunk hides
    while the GEMMs last: attention's with its projections, a dense MLP's with its own; an MoE block's
    wait (no userbuffers in the experts' grouped GEMMs), and so does every layout without sequence
    parallelism (Megatron requires it). Without the flag they are waited for, as shardlm's trainer
    does; a layout priced with it is marked not runnable as modelled; the flag is a training one, and
    refused beside a pinned --tp 1 or --sp off."""
    from shardlm.plan import cli, training
    from shardlm.plan.planner import PlanRequest, plan
    from shardlm.plan.runnable import not_as_modelled

    assert comm.pipelined(1.0, 3.0, 4) == 0.25 and comm.pipelined(3.0, 1.0, 4) == 2.25
    assert comm.pipelined(0.0, 1.0, 4) == 0.0
    cfg, _ = load_model("llama-3-70b")
    costs = ModelCosts(cfg)
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=64, gpus_per_node=8)
    lay = Layout(tp=4, pp=8, dp=2, sp=True, zero=1, micro_batch=1, num_micro=64, recompute="selective")
    waited = training.evaluate(costs, cluster, lay, training.TrainWorkload(global_batch=128, seq_len=8192))
    piped = training.evaluate(
        costs, cluster, lay, training.TrainWorkload(global_batch=128, seq_len=8192, tp_overlap=True)
    )
    assert waited.fits and piped.fits
    assert 0 < piped.comm_s["tp"] < 0.5 * waited.comm_s["tp"]
    no_sp = lay.with_(sp=False)
    assert (
        training.evaluate(
            costs, cluster, no_sp, training.TrainWorkload(global_batch=128, seq_len=8192, tp_overlap=True)
        ).comm_s
        == training.evaluate(costs, cluster, no_sp, training.TrainWorkload(global_batch=128, seq_len=8192)).comm_s
    )
    moe_costs = ModelCosts(load_model("qwen3-235b-a22b")[0])
    moe = Layout(tp=2, pp=8, dp=4, ep=8, sp=True, zero=1, micro_batch=1, num_micro=16, recompute="full")
    moe_cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=64, gpus_per_node=8)
    moe_wl = training.TrainWorkload(global_batch=64, seq_len=4096)
    moe_waited = training.evaluate(moe_costs, moe_cluster, moe, moe_wl).comm_s["tp"]
    moe_piped = training.evaluate(moe_costs, moe_cluster, moe, dataclasses.replace(moe_wl, tp_overlap=True)).comm_s[
        "tp"
    ]
    assert moe_waited / 2 < moe_piped < moe_waited  # attention's half hides, the experts' block waits
    assert piped.step_s < waited.step_s
    hidden = waited.comm_s["tp"] - piped.comm_s["tp"]  # per micro-batch: m x 2 x the stage's mean pass
    assert waited.step_s - piped.step_s == pytest.approx(hidden, rel=0.25)
    res = plan(
        PlanRequest(
            model="llama-3-70b",
            gpu="h100-sxm",
            gpus=64,
            train=True,
            training=training.TrainWorkload(global_batch=128, seq_len=8192, tp_overlap=True),
            fixed=dict(tp=4, pp=8),
        )
    )
    assert "TP collectives pipelined with the GEMMs" in (res.not_as_modelled(res.best) or "")
    piped_wl = training.TrainWorkload(global_batch=128, seq_len=8192, tp_overlap=True)
    assert not_as_modelled(cfg, lay, piped_wl, train=True, cluster=cluster)  # priced faster than shardlm runs
    assert not_as_modelled(cfg, no_sp, piped_wl, train=True, cluster=cluster) is None  # priced as it runs
    argv = ["--model", "llama-3-70b", "--gpu", "h100-sxm", "--gpus", "64", "--tp", "4", "--pp", "8"]
    assert cli.main([*argv, "--tp-overlap"]) == 2
    assert "--tp-overlap is a training flag; add --train or drop it" in capsys.readouterr().err
    for pin in (["--sp", "off"], ["--tp", "1", "--pp", "8"]):
        argv = ["--model", "llama-3-70b", "--gpu", "h100-sxm", "--gpus", "64", "--train", "--tp-overlap", *pin]
        assert cli.main(argv) == 2
        assert "--tp-overlap pipelines TP's collectives under sequence parallelism" in capsys.readouterr().err


ATTENTION_TABLES = {  # cuDNN's causal bf16 SDPA, head dim 128 (NVIDIA/cudnn-frontend, benchmark/sdpa_benchmark_training/):
    # GPU: (forward, backward) TFLOP/s at sequences of 2k, 4k, 8k, 16k and 32k, FLOPs counted as
    # flash-attention's benchmarks count them (causal halved, a backward 2.5 forwards); the bound each
    # catalog curve holds
    "h200": ((484, 591, 644, 673, 688), (370, 474, 541, 579, 581), 0.03),  # results/h200_919_only_cudnn, 9.19.1
    "gb200": ((1097, 1408, 1574, 1708, 1622), (885, 1148, 1332, 1328, 1226), 0.09),  # results/llama3.1/gb200, 9.22
    "gb300": ((1373, 1703, 1856, 1915, 1953), (967, 1248, 1435, 1507, 1490), 0.04),  # results/llama3.1/gb300, 9.22
    "b200": ((479, 856, 1171, 1332, 1419), (371, 701, 943, 1075, 1109), 0.11),  # artifacts, cuDNN 9.13
}


@pytest.mark.parametrize("gpu", list(ATTENTION_TABLES))
def test_attention_runs_on_the_measured_cudnn_curves(gpu):
    """The attention core's rate (GpuSpec.attention_rate) follows cuDNN's measured tables over the
    keys a causal query attends (half its sequence), forward and backward, within each fit's bound;
    the H100 SXM and H800 share the H200's die and clocks and its curve. Other dtypes (fp32) and
    GPUs with no table (A100) have none: the GEMM rate stands in."""
    spec = load_gpu(gpu)
    forward, backward, bound = ATTENTION_TABLES[gpu]
    for passes, backward_pass in ((forward, False), (backward, True)):
        for seq, tflops in zip((2048, 4096, 8192, 16384, 32768), passes):
            assert spec.attention_rate(seq / 2, backward_pass, "bf16") == pytest.approx(tflops * 1e12, rel=bound)
    if gpu == "h200":
        assert load_gpu("h100-sxm").attention == load_gpu("h800-sxm").attention == spec.attention
    assert spec.attention_rate(4096, False, "fp32") is None
    assert load_gpu("a100-80g").attention_rate(4096, False, "bf16") is None


def test_a_flash_backward_recomputes_the_scores():
    """Training times a layer's attention core on the GPU's measured curve (training._attention_times):
    the backward's FLOPs are 2.5 forwards' (the scores recomputed, C.FLASH_BACKWARD_RATIO) at the
    backward's rate; unfused attention (its products, the scores kept) and a GPU with no curve run at
    the GEMM rate, the backward twice the forward. A step reads it: Llama 3 8B at 8,192 tokens on an
    H100 is slower on the measured curve than at the GEMM rate, mostly in backward."""
    from shardlm.plan import constants as C
    from shardlm.plan.roofline import Work
    from shardlm.plan.training import TrainWorkload, _attention_times
    from shardlm.plan.training import evaluate as train

    h100, keys, core = load_gpu("h100-sxm"), 4096.0, Work(flops=1e12, ops=1)
    fwd, bwd = _attention_times(h100, core, keys, "bf16", True)
    overhead = h100.op_overhead_s
    assert fwd == pytest.approx(1e12 / h100.attention_rate(keys, False, "bf16") + overhead)
    assert bwd == pytest.approx(C.FLASH_BACKWARD_RATIO * 1e12 / h100.attention_rate(keys, True, "bf16") + overhead)
    gemm = 1e12 / h100.matmul_flops("bf16") + overhead
    for gpu, fused in ((h100, False), (load_gpu("a100-80g"), True)):
        fwd, bwd = _attention_times(gpu, core, keys, "bf16", fused)
        assert bwd == pytest.approx(2 * fwd) and (gpu is not h100 or fwd == pytest.approx(gemm))

    costs = ModelCosts(load_model("llama-3-8b")[0])
    lay = Layout(dp=8, zero=3, micro_batch=1, num_micro=4, recompute="selective")
    wl = TrainWorkload(global_batch=32, seq_len=8192)
    measured = train(costs, Cluster(gpu=h100, num_gpus=8, gpus_per_node=8), lay, wl)
    bare = dataclasses.replace(h100, attention={})
    at_gemm_rate = train(costs, Cluster(gpu=bare, num_gpus=8, gpus_per_node=8), lay, wl)
    slower = measured.forward_s - at_gemm_rate.forward_s  # cuDNN's forward under the GEMM rate here
    # the backward's recomputed scores at its own, slower rate: far more than its two forwards' worth
    # (and selective recomputation's forward) would add
    assert slower > 0 and measured.backward_s - at_gemm_rate.backward_s > 12 * slower  # 8x at a ratio of 2


def test_ring_attention_runs_each_call_over_a_peers_keys(monkeypatch):
    """Ring attention (training cp) runs cp kernel calls a pass, one a hop, each over a peer's chunk of
    the keys: the measured curve is read at S / (2 cp) keys a query, what each hop's slowest call
    attends under zig-zag sharding (the ranks holding later chunks than the sender attend all their
    queries to its first chunk), not the whole sequence's; Ulysses attends the whole sequence with 1/cp
    of the heads."""
    from shardlm.plan import training
    from shardlm.plan.training import TrainWorkload
    from shardlm.plan.training import evaluate as train

    seen = []
    real = training._attention_times
    monkeypatch.setattr(
        training, "_attention_times", lambda gpu, at, keys, *a: seen.append(keys) or real(gpu, at, keys, *a)
    )
    costs = ModelCosts(load_model("llama-3-8b")[0])
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=8, gpus_per_node=8)
    for attention, keys in (("ring", 8192 / 2 / 4), ("ulysses", 8192 / 2)):
        seen.clear()
        lay = Layout(dp=2, cp=4, zero=3, micro_batch=1, num_micro=4, recompute="selective", cp_attention=attention)
        train(costs, cluster, lay, TrainWorkload(global_batch=8, seq_len=8192))
        assert seen and set(seen) == {keys}


@pytest.mark.parametrize(("forward", "backward", "waited"), [(0.5, 1.5, 1.0), (0.5, 2.5, 0.5), (1.5, 1.5, 0.5)])
def test_ring_attention_hides_each_pass_exchanges_behind_that_pass_attention(monkeypatch, forward, backward, waited):
    """The ring passes a rank's key/value blocks round cp - 1 hops in forward, behind the forward's
    attention; backward passes them round again with their gradients (twice the bytes), behind the
    backward's attention (a flash backward's, 2.5 forwards' FLOPs). Llama-3-8B at tp4 cp2, one ring R:
    attention of ``forward`` R and ``backward`` R a layer leaves ``waited`` R of both passes exposed."""
    from shardlm.plan import comm, training
    from shardlm.plan.training import TrainWorkload
    from shardlm.plan.training import evaluate as train

    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=8, gpus_per_node=8)
    lay = Layout(tp=4, cp=2, sp=True, zero=1, micro_batch=1, num_micro=8)
    g = lay.slowest_group("cp", 8)
    ring = comm.send_recv(16384 * 2 * (8 // 4) * 128 * 2, g[0], g[1], cluster)  # a rank's tokens, 2 KV heads
    monkeypatch.setattr(training, "_attention_times", lambda *_: (forward * ring, backward * ring))
    got = train(ModelCosts(load_model("llama-3-8b")[0]), cluster, lay, TrainWorkload(global_batch=8, seq_len=32768))
    assert got.comm_s["cp"] == pytest.approx(8 * 32 * waited * ring, rel=1e-9)  # 8 micro-batches, 32 layers


def test_zero_bubble_defers_only_the_weight_gradients(monkeypatch):
    """ZB-H1 (Qi et al. 2023, arXiv 2401.10241) splits backward into B, the input gradients, and W, the
    weight gradients, deferred into the drain: its bubble is (p - 1)(F + B - W) against 1F1B's
    (p - 1)(F + B + W), on the stage that sets the pace. W is the weight-gradient products and the LM
    head's (``StagePass.weight_grads``); the attention core has no weights, so its backward, however
    long, is all B. Llama-3-8B at pp4 on one H100 node, 8K tokens."""
    from shardlm.plan import training
    from shardlm.plan.training import TrainWorkload
    from shardlm.plan.training import evaluate as train

    costs = ModelCosts(load_model("llama-3-8b")[0])
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=8, gpus_per_node=8)
    lay = Layout(dp=2, pp=4, zero=1, micro_batch=1, num_micro=8, schedule="zb-h1")
    wl = TrainWorkload(global_batch=16, seq_len=8192)

    def gap() -> tuple[float, float]:  # 1F1B's step less ZB-H1's, and the pacing stage's W
        passes = [training._stage(costs, cluster, lay, wl, s, 8192.0, 2) for s in range(4)]
        pacing = max(passes, key=lambda st: st.forward + st.backward)
        one_f_one_b = train(costs, cluster, lay.with_(schedule="1f1b"), wl)
        return one_f_one_b.step_s - train(costs, cluster, lay, wl).step_s, pacing.weight_grads

    saved, w = gap()
    assert saved == pytest.approx(2 * 3 * w, rel=1e-9)
    # W is each layer's weight-gradient products (inner dimension the tokens; their add into the
    # gradient buffer) and, on the last stage, the LM head's one
    from shardlm.plan.roofline import Step, Work, backward_products, touched_params

    gpu, tokens = cluster.gpu, 8192.0
    rl = costs.rank_layer(False, 1, 1, 1)
    step = Step(tokens=tokens, ctx=4096, decode=False, seqs=1, moe_tokens=tokens)
    _, w_flops = backward_products(
        costs.cfg, rl, step, ep=1, half_rows=gpu.half_rows("bf16"), k_half=gpu.half_k("bf16")
    )
    epilogue = training.grad_epilogue_bytes(wl.kernels, 2, 4)
    layer = Work(flops=w_flops, bytes=touched_params(costs.cfg, rl, step) * epilogue, gemms=4).time(
        gpu, "bf16"
    )  # qkv, o, gate-and-up, down
    kinds = costs.stage_kinds(4)
    assert training._stage(costs, cluster, lay, wl, 1, tokens, 2).weight_grads == pytest.approx(sum(kinds[1]) * layer)
    head = Work(flops=2 * tokens * costs.vocab_rows(1) * 4096, bytes=costs.vocab_rows(1) * 4096 * 2, gemms=1)
    last = training._stage(costs, cluster, lay, wl, 3, tokens, 2).weight_grads
    assert last == pytest.approx(sum(kinds[3]) * layer + head.time(gpu, "bf16"))
    real = training._attention_times
    monkeypatch.setattr(training, "_attention_times", lambda *a: tuple(3 * t for t in real(*a)))
    assert gap() == pytest.approx((saved, w), rel=1e-12)  # a slower attention backward moves no W


def test_fp8_casts_the_inputs_no_fused_norm_writes():
    """Megatron-Core lays latent attention as norm, two down-projections (plain linears), then each
    latent's norm fused with its up-projection; an MoE layer's norm stands alone (the router reads it),
    so its shared experts' input is cast like any other. DeepSeek-V3: the norm-written inputs are the
    latents (1,536 and 512 wide) and, in a dense layer, the gate-and-up's (7,168); everything else,
    both down-projections' 7,168-wide input included, is cast."""
    from shardlm.plan.training import _fp8_cast_widths

    cfg = load_model("deepseek-v3")[0]
    costs = ModelCosts(cfg)
    for moe in (False, True):
        rl = costs.rank_layer(moe, 1, 1, 1)
        normed, other, _ = _fp8_cast_widths(cfg, rl, moe, 0.0)
        assert normed == cfg.q_lora_rank + cfg.kv_lora_rank + (0 if moe else cfg.hidden_size)
        shared = cfg.hidden_size if moe else 0  # the shared experts' input
        assert other - shared == 2 * cfg.hidden_size + rl.q_heads * cfg.v_head_dim + (
            rl.dense // (3 * cfg.hidden_size)
        ), moe
    # DeepSeek-V2-Lite's shape: no query latent, the query projected from the norm's output directly
    # (a plain linear after the standalone norm): only the keys' and values' latent is norm-written
    lite = dataclasses.replace(cfg, q_lora_rank=0)
    rl = ModelCosts(lite).rank_layer(True, 1, 1, 1)
    normed, other, _ = _fp8_cast_widths(lite, rl, True, 0.0)
    assert normed == lite.kv_lora_rank
    assert other == 3 * lite.hidden_size + rl.q_heads * lite.v_head_dim + rl.dense // (3 * lite.hidden_size)
