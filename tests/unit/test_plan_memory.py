"""Planner memory model against published numbers (each test names its source)."""

import pytest

from shardlm.parallel.pipeline import stage_layers
from shardlm.plan.activations import LayerShape, in_flight_microbatches, korthikanti_table2, layer_activation_bytes
from shardlm.plan.catalog import load_model, model_names
from shardlm.plan.shard import active_params, head_split, rank_layer, stage_params, total_params
from shardlm.plan.zero import deepspeed_zero2_bytes, deepspeed_zero3_bytes, model_states

GiB = 2**30


def test_zero_paper_7_5b_on_64_gpus():
    # Rajbhandari et al. 2019, Figure 1: Psi = 7.5B, N_d = 64, K = 12 -> 120 / 31.4 / 16.6 / 1.9 GB
    got = [model_states(7.5e9, dp=64, stage=s).total / 1e9 for s in (0, 1, 2, 3)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


def test_deepspeed_estimator_t5_3b():
    # DeepSpeed's memory estimator for t5-3b (2851M params; largest layer = the 32128 x 1024
    # shared embedding) on 1 node x 8 GPUs prints 15.93 GB (ZeRO-2) and 6.10 GB (ZeRO-3), binary GB
    total, largest = 2851e6, 32128 * 1024
    assert round(deepspeed_zero2_bytes(total, 8) / GiB, 2) == 15.93
    assert round(deepspeed_zero3_bytes(total, largest, 8) / GiB, 2) == 6.10


@pytest.mark.parametrize("sp,recompute,expected", [(False, "none", 66.84), (True, "selective", 12.35)])
def test_korthikanti_175b_figure1(sp, recompute, expected):
    # GPT-3 175B, s=2048, b=1, h=12288, a=96, L=96, t=8; the first stage of the interleaved
    # schedule (p=8, 3 chunks) holds L (1 + (p-1)/(p m)) layers' worth (Korthikanti §4.2.3)
    per_layer = layer_activation_bytes(
        LayerShape.gpt(12288, 96), seq=2048, micro_batch=1, tp=8, sp=sp, recompute=recompute
    )
    assert per_layer == korthikanti_table2(s=2048, b=1, h=12288, a=96, t=8, sp=sp, selective=recompute == "selective")
    layers_per_stage, p, v = 96 // 8, 8, 3
    total = per_layer * layers_per_stage * in_flight_microbatches("interleaved", pp=p, num_micro=64, virtual=v)
    assert round(total / GiB, 2) == expected


def test_table2_rows_and_full_recompute():
    s, b, h, a, t = 2048, 4, 4096, 32, 4
    shape = LayerShape.gpt(h, a)
    sbh = s * b * h
    assert layer_activation_bytes(shape, seq=s, micro_batch=b) == sbh * (34 + 5 * a * s / h)
    assert layer_activation_bytes(shape, seq=s, micro_batch=b, tp=t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer_activation_bytes(shape, seq=s, micro_batch=b, tp=t, recompute="selective") == sbh * (10 + 24 / t)
    assert layer_activation_bytes(shape, seq=s, micro_batch=b, tp=t, recompute="full") == 2 * sbh
    assert layer_activation_bytes(shape, seq=s, micro_batch=b, tp=t, sp=True, recompute="full") == 2 * sbh / t


@pytest.mark.parametrize(
    "name,billions",
    [
        ("llama-3-8b", 8.03),
        ("llama-3-70b", 70.55),
        ("llama-3.1-405b", 405.85),
        ("mixtral-8x7b", 46.70),
        ("mixtral-8x22b", 140.63),
        ("qwen2.5-72b", 72.71),
        ("qwen3-235b-a22b", 235.09),
        ("qwen3-30b-a3b", 30.53),
        ("deepseek-v3", 671.03),
        ("smollm2", 0.1345),
    ],
)
def test_preset_parameter_counts(name, billions):
    # published sizes: Meta (8.03B, 70.6B, 405B), Mistral (46.7B, 141B), Qwen (72.7B, 235B, 30.5B),
    # DeepSeek-V3 report (671B without the MTP module), SmolLM2-135M (134.5M)
    cfg, _ = load_model(name)
    assert total_params(cfg) / 1e9 == pytest.approx(billions, rel=2e-3)


def test_active_params_moe():
    # Mixtral 8x7B: 12.9B active; Qwen3-235B-A22B: 22B; Qwen3-30B-A3B: 3.3B; DeepSeek-V3: 37B (incl. the 0.9B head)
    for name, active in (
        ("mixtral-8x7b", 12.9),
        ("qwen3-235b-a22b", 22.2),
        ("qwen3-30b-a3b", 3.35),
        ("deepseek-v3", 37.5),
    ):
        assert active_params(load_model(name)[0]) / 1e9 == pytest.approx(active, rel=0.01)


def test_every_preset_parses_with_a_source():
    import json

    from shardlm.plan.catalog import _presets

    for name in model_names():
        assert json.loads(_presets()[name].read_text())["_source"].startswith("https://")


def test_uneven_heads_replicate_kv():
    # SmolLM2: 9 query heads, 3 KV heads (3 queries each). tp=4 splits queries 3,2,2,2:
    # rank 2 holds queries 5-6, which read KV heads 1 and 2 -> both replicated there
    assert head_split(9, 3, 4) == [(3, 1), (2, 1), (2, 2), (2, 1)]
    assert head_split(9, 3, 2) == [(5, 2), (4, 2)]
    assert head_split(64, 8, 8) == [(8, 1)] * 8


def test_head_split_matches_the_runtime_partition():
    tensor = pytest.importorskip("shardlm.parallel.tensor")
    for heads, kv, tp in ((9, 3, 4), (9, 3, 2), (9, 3, 9), (32, 8, 3), (14, 2, 4)):
        runtime = [tensor.partition_heads(heads, kv, tp, r) for r in range(tp)]
        assert head_split(heads, kv, tp) == [(p.num_q, p.num_kv) for p in runtime]


def test_largest_rank_is_reported_and_pp_splits_embeddings():
    cfg, _ = load_model("smollm2")
    # tp=4: rank 2 has fewer query heads than rank 0 but more KV heads; the largest total wins
    rl = rank_layer(cfg, 0, tp=4)
    h, d = cfg.hidden_size, cfg.head_dim

    def attn(q, kv):
        return 2 * h + h * d * (q + 2 * kv) + q * d * h

    assert rl.attn + rl.dense == max(attn(q, kv) + 3 * h * r for (q, kv), r in zip(head_split(9, 3, 4), (384,) * 4))
    # tied embeddings: one copy at pp=1, one per end stage at pp=2 (the head sits on the last)
    one = stage_params(cfg, tp=1, pp=1)[0]
    two = stage_params(cfg, tp=1, pp=2)
    embed = cfg.vocab_size * h
    assert sum(two) == one + embed
    first, last = (len(r) for r in stage_layers(cfg, 2))  # the engine's split: 19 + 11 for SmolLM2
    layer = rank_layer(cfg, 0, tp=1).total
    assert two == [first * layer + embed, last * layer + h + embed]  # the last also holds the final norm


def test_mla_kv_cache_and_gqa_kv_cache():
    from shardlm.plan.roofline import kv_bytes_per_token

    ds, _ = load_model("deepseek-v3")
    rl = rank_layer(ds, 10, tp=8)
    assert kv_bytes_per_token(ds, rl, 2) == (512 + 64) * 2  # latent + RoPE key, replicated over tp
    llama, _ = load_model("llama-3-70b")
    assert kv_bytes_per_token(llama, rank_layer(llama, 0, tp=8), 2) == 2 * 1 * 128 * 2  # one KV head per rank
    assert kv_bytes_per_token(llama, rank_layer(llama, 0, tp=16), 2) == 2 * 1 * 128 * 2  # replicated, not halved


def test_expert_parallel_divides_experts():
    cfg, _ = load_model("deepseek-v3")
    assert rank_layer(cfg, 60, tp=8, ep=8).experts == 32
    assert rank_layer(cfg, 60, tp=8, ep=64).experts == 4
    assert rank_layer(cfg, 0, tp=8, ep=64).experts == 0  # first_k_dense layers have no experts


@pytest.mark.parametrize("kv_dtype,engine_dtype", [("bf16", "bfloat16"), ("int8", "int8"), ("fp8", "fp8")])
def test_planner_kv_bytes_equal_the_engines_cache(kv_dtype, engine_dtype):
    """KV bytes a token costs (SmolLM2, one rank): the planner's count against the block size the
    engine allocates per token for --kv-cache-dtype (int8: head_dim + 4 bytes a row for its scale)."""
    import torch

    from shardlm.engine.config import DTYPES, KV_CACHE_DTYPES
    from shardlm.engine.model_runner import ModelRunner
    from shardlm.models.loader import load_model as load_shards
    from shardlm.models.loader import open_checkpoint
    from shardlm.parallel.dims import ParallelDims
    from shardlm.plan.layout import Layout
    from shardlm.plan.memory import kv_bytes_per_seq_token
    from shardlm.plan.roofline import ModelCosts, kv_element_bytes

    ckpt = open_checkpoint("smollm2")
    model = load_shards(ckpt, ParallelDims().build_mesh("cpu"), dtype=torch.bfloat16, layers=range(1))
    per_layer = ModelRunner.kv_bytes_per_block(model, 16, {**DTYPES, **KV_CACHE_DTYPES}[engine_dtype]) / 16
    costs = ModelCosts(ckpt.config)
    planned = kv_bytes_per_seq_token(costs, Layout(), kv_element_bytes(ckpt.config, kv_dtype))
    assert planned == pytest.approx(per_layer * ckpt.config.num_layers, rel=1e-12)


def _costs(name: str):
    from shardlm.plan.roofline import ModelCosts

    return ModelCosts(load_model(name)[0])


def test_full_recomputation_keeps_the_layer_input_only():
    """shardlm's trainer (train.trainer.Recomputed) keeps one s x b x h tensor per layer, the sum of
    the previous output and the residual stream, as Korthikanti et al. §4 count it; the count was
    two tensors before (both handed in apart)."""
    from shardlm.plan.memory import layer_shape

    shape, (s, b) = layer_shape(_costs("llama-3-8b"), False), (4096, 2)
    sbh = s * b * shape.hidden
    assert layer_activation_bytes(shape, seq=s, micro_batch=b, recompute="full") == 2 * sbh
    assert layer_activation_bytes(shape, seq=s, micro_batch=b, tp=4, sp=True, recompute="full") == 2 * sbh / 4


def test_fused_activation_and_fp8_keep_fewer_bytes_so_nvidias_70b_layout_fits():
    """Megatron's fused SwiGLU keeps only its input (gate and up) where shardlm's eager trainer also
    keeps silu(gate); FP8 linears keep their inputs' FP8 copies (1 byte: the QKV, fc1 and down
    inputs), and the output projection one beside the 16-bit attention output. Counted so, the
    layout NVIDIA ran Llama 3 70B in on 80 GB H100s (FP8, tp4 pp8 vp5, no recomputation:
    Megatron-Bridge's performance summary) fits; counted as shardlm saves bf16 it did not."""
    from shardlm.plan.hardware import Cluster, load_gpu
    from shardlm.plan.layout import Layout
    from shardlm.plan.memory import layer_shape
    from shardlm.plan.training import TrainWorkload, evaluate

    costs, (s, b, t) = _costs("llama-3-70b"), (8192, 1, 4)
    eager, fused = layer_shape(costs, False), layer_shape(costs, False, kernels="fused")
    fp8 = layer_shape(costs, False, kernels="fused", dtype="fp8")

    def count(shape, recompute="none"):
        return layer_activation_bytes(shape, seq=s, micro_batch=b, tp=t, sp=True, recompute=recompute)

    sb, h, q, f = s * b, eager.hidden, eager.q_dim, eager.ffn
    assert count(eager) - count(fused) == sb * f * 2 / t  # silu(gate)
    assert count(fused) - count(fp8) == sb * 2 * h / t - sb * q / t + sb * f / t  # QKV, fc1 in; o's copy; down in
    assert count(eager, "selective") == count(fused, "selective")  # the activation recomputed: gate, up only
    lay = Layout(tp=4, pp=8, dp=2, sp=True, zero=1, micro_batch=1, num_micro=64, schedule="interleaved", virtual=5)
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=64, gpus_per_node=8)
    wl = TrainWorkload(global_batch=128, seq_len=s, dtype="fp8", kernels="fused")
    assert evaluate(costs, cluster, lay, wl).fits
    assert not evaluate(costs, cluster, lay, TrainWorkload(global_batch=128, seq_len=s)).fits  # bf16, eager


def test_unfused_attention_keeps_the_scores():
    from shardlm.plan.hardware import Cluster, load_gpu
    from shardlm.plan.layout import Layout
    from shardlm.plan.memory import layer_shape
    from shardlm.plan.training import TrainWorkload, evaluate

    costs, (s, b, t) = _costs("llama-3-8b"), (4096, 1, 4)
    fused, unfused = layer_shape(costs, False), layer_shape(costs, False, fused_attention=False)
    a = fused.heads
    extra = layer_activation_bytes(unfused, seq=s, micro_batch=b, tp=t) - layer_activation_bytes(
        fused, seq=s, micro_batch=b, tp=t
    )
    assert extra == a * s * s * b * 2 / t - a * s * b * 4 / t  # bf16 softmax instead of a float32 log-sum-exp
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=8, gpus_per_node=8)
    lay = Layout(tp=4, dp=2, sp=True, zero=1, micro_batch=1, num_micro=8)
    one = evaluate(costs, cluster, lay, TrainWorkload(global_batch=16, seq_len=s))
    two = evaluate(costs, cluster, lay, TrainWorkload(global_batch=16, seq_len=s, fused_attention=False))
    assert two.memory.activations - one.memory.activations == pytest.approx(32 * extra)
    # and its time: each query's scores over the sequence written, read, written, read (4 x 2 bytes
    # an element) through HBM, in forward and twice in backward: at most that much longer
    scores = 8 * 32 * 3 * s * (32 // t) * s * 8 / cluster.gpu.mem_Bps  # micro-batches, layers, passes
    assert 0.5 * scores < two.step_s - one.step_s <= scores


def test_capacities_are_gib():
    from shardlm.plan.hardware import load_gpu

    # the A100 80GB's nvidia-smi total is 81,920 MiB: datasheet "GB" of HBM are GiB
    assert load_gpu("a100-80g").memory_bytes == 80 * GiB
    assert load_gpu("h200").memory_bytes == 141 * GiB


def test_default_reserve_keeps_a_published_layout_that_the_old_one_rejected():
    """Llama 3 405B's first pre-training stage (Dubey et al. 2024, https://arxiv.org/abs/2407.21783
    Table 4: 8,192 H100 80GB, TP 8, CP 1, PP 16, DP 64, 8,192-token sequences, 32 per DP rank; an
    interleaved schedule, §3.3.2) at 2 chunks per stage, ZeRO-2 and selective recomputation: 71.5 GiB
    counted. The old reserve, 10% of a decimal 80 GB (74.5 GiB usable), rejected it; 2 GiB of an
    80 GiB device keeps it, and --memory-reserve can still ask for more."""
    from shardlm.plan.hardware import Cluster, load_gpu
    from shardlm.plan.layout import Layout
    from shardlm.plan.training import TrainWorkload, evaluate

    gpu, costs = load_gpu("h100-sxm"), _costs("llama-3.1-405b")
    wl = TrainWorkload(global_batch=64 * 32, seq_len=8192)
    lay = Layout(
        tp=8,
        pp=16,
        dp=64,
        sp=True,
        zero=2,
        schedule="interleaved",
        virtual=2,
        micro_batch=1,
        num_micro=32,
        recompute="selective",
    )
    res = evaluate(costs, Cluster(gpu=gpu, num_gpus=8192, gpus_per_node=8), lay, wl)
    counted = res.memory.total - res.memory.reserve
    assert res.fits and res.memory.reserve == 2 * GiB
    assert counted > 0.9 * 80e9  # can fail: what the old default rejected
    strict = Cluster(gpu=gpu, num_gpus=8192, gpus_per_node=8, memory_reserve_bytes=10 * GiB)
    over = evaluate(costs, strict, lay, wl)
    assert not over.fits and over.shortfall_bytes == pytest.approx(counted + 10 * GiB - 80 * GiB)


def test_inference_reserve_is_vllms_and_a_bad_reserve_is_refused():
    from shardlm.plan.errors import PlanError
    from shardlm.plan.hardware import Cluster, load_gpu

    gpu = load_gpu("h100-sxm")
    assert Cluster(gpu=gpu, num_gpus=8, gpus_per_node=8).reserve(train=False) == pytest.approx(8 * GiB)
    with pytest.raises(PlanError, match=r"--memory-reserve 90 GiB must be at least 0 and below the 80 GiB"):
        Cluster(gpu=gpu, num_gpus=8, gpus_per_node=8, memory_reserve_bytes=90 * GiB)


@pytest.mark.parametrize("cp", [2, 4])
def test_planner_kv_per_cp_rank_is_the_striped_caches(cp):
    """SmolLM2, an 8192-token sequence at cp ranks: the planner's KV bytes per rank are what the
    engine's striped cache holds on each rank (its run of every group block: parallel/context_paged.py)."""
    import torch

    from shardlm.engine.model_runner import ModelRunner
    from shardlm.models.loader import load_model as load_shards
    from shardlm.models.loader import open_checkpoint
    from shardlm.parallel.context_paged import local_key_positions, owner
    from shardlm.parallel.dims import ParallelDims
    from shardlm.plan.layout import Layout
    from shardlm.plan.memory import kv_bytes_per_seq_token
    from shardlm.plan.roofline import ModelCosts, kv_element_bytes

    ckpt, bs, tokens = open_checkpoint("smollm2"), 16, 8192
    model = load_shards(ckpt, ParallelDims().build_mesh("cpu"), dtype=torch.bfloat16, layers=range(1))
    per_block = ModelRunner.kv_bytes_per_block(model, bs, torch.bfloat16) * ckpt.config.num_layers
    group_blocks = -(-tokens // (bs * cp))  # the block manager's blocks: one on every cp rank
    for rank in range(cp):
        held = local_key_positions(group_blocks, bs, cp, rank)
        assert sum(owner(p, bs, cp) == rank for p in range(tokens)) == len(held[held < tokens]) == tokens // cp
    planned = kv_bytes_per_seq_token(ModelCosts(ckpt.config), Layout(cp=cp), kv_element_bytes(ckpt.config, "bf16"))
    assert planned * tokens == pytest.approx(group_blocks * per_block, rel=1e-12)


def test_optimizer_offload_leaves_the_model_states_but_adam_on_the_device():
    """ZeRO-Offload (train --offload optimizer): the float32 masters and moments, 12 bytes per owned
    parameter (what the trainer reports as optimizer_offloaded: test_train's CUDA offload test), leave
    the device; weights and gradients stay. The step then moves 4 + 2 bytes per owned parameter over
    PCIe and streams 28 through the host's memory, slower than the device's step (the bytes per
    parameter counted from the trainer's own step: ``plan.traffic``)."""
    from shardlm.plan import constants as C
    from shardlm.plan import traffic
    from shardlm.plan.hardware import Cluster, load_gpu
    from shardlm.plan.layout import Layout
    from shardlm.plan.memory import training_memory
    from shardlm.plan.training import TrainWorkload, evaluate

    costs, gpu = _costs("llama-3-8b"), load_gpu("h100-sxm")
    cluster = Cluster(gpu=gpu, num_gpus=8, gpus_per_node=8)
    lay = Layout(dp=8, zero=1, micro_batch=1, num_micro=8)
    kept, moved = (training_memory(costs, lay.with_(offload=o), 0.0, seq=4096) for o in (False, True))
    assert moved.optimizer == 0 and kept.optimizer == pytest.approx(12 * total_params(costs.cfg) / 8)
    assert (moved.weights, moved.gradients, moved.activations) == (kept.weights, kept.gradients, kept.activations)
    wl = TrainWorkload(global_batch=64, seq_len=4096)
    on, off = (evaluate(costs, cluster, lay.with_(offload=o), wl) for o in (True, False))
    owned = total_params(costs.cfg) / 8
    want = owned * (6 / (128e9 / 2) + 28 / C.HOST_MEM_BPS_PER_GPU)
    device = owned * traffic.profile("shardlm", "bf16").per_param / gpu.mem_Bps
    assert on.step_s - off.step_s == pytest.approx(want - device, rel=1e-6)
    assert on.step_s > off.step_s and "offload" in lay.with_(offload=True).label(training=True)


def test_gpt3_preset_is_korthikantis_layer_and_gpts_size():
    """GPT-3 175B (Brown et al. 2020) in GPT-2's config format: LayerNorm, a GELU MLP of 4h (two
    matrices, not SwiGLU's three), dropout; 175B parameters (174.6B counted with GPT-2's vocabulary);
    its layer is the one Korthikanti et al. count (their Table 2 shape) when attention is unfused;
    the runtime refuses the architecture with the reason and the planner marks it."""
    from shardlm.models.config import ConfigError
    from shardlm.plan.layout import Layout
    from shardlm.plan.memory import layer_shape
    from shardlm.plan.runnable import not_runnable

    cfg, _ = load_model("gpt3-175b")
    assert (cfg.gated_mlp, cfg.dropout, cfg.intermediate_size, cfg.tie_word_embeddings) == (
        False,
        True,
        4 * 12288,
        True,
    )
    assert total_params(cfg) / 1e9 == pytest.approx(175.0, rel=5e-3)
    assert layer_shape(_costs("gpt3-175b"), False, fused_attention=False) == LayerShape.gpt(12288, 96)
    with pytest.raises(ConfigError, match="architecture family 'gpt2' is not runnable yet"):
        cfg.check_supported()
    assert "the gpt2 architecture" in (not_runnable(cfg, Layout(tp=8), train=True, dtype="bf16") or "")


@pytest.mark.parametrize(
    ("tp", "ep", "etp", "share"),
    [
        (1, 8, 1, 1),
        (4, 8, 1, 1 / 4),
        (2, 2, 1, 1 / 2),
        (4, 8, 2, 1 / 2),
        (4, 2, 2, 1 / 2),  # inside the tp group, etp > 1
        (2, 3, 1, 1 / 2),  # neither divides the other: 1/tp of the tokens, as expert.py sends them
        (4, 3, 1, 1 / 4),
        (4, 1, 3, 3 / 4),
    ],
)
def test_routed_activations_count_the_pairs_a_rank_computes(tp, ep, etp, share):
    """A rank keeps the routed experts' activations of the (token, expert) pairs it computes, as the
    time model counts them (the most loaded rank of the ep group's): with the expert group beyond the tp group each tp rank dispatches 1/tp of
    the tokens (and each of an expert's etp ranks computes all of theirs on its rows); inside it each
    rank computes 1/ep of every token's choices. Qwen3-235B-A22B at tp4 pp8 ep8 without recomputation, a layout Megatron-Core
    ran on 80 GB H100s (Megatron-MoE-ModelZoo, best_practice/Qwen3/readme.md: 4,096-token sequences,
    micro-batch 1): every (token, choice) pair on every tp rank counted it at 109 GiB."""
    from shardlm.plan.hardware import Cluster, load_gpu
    from shardlm.plan.layout import Layout
    from shardlm.plan.memory import routed_pairs
    from shardlm.plan.roofline import routing_imbalance
    from shardlm.plan.training import TrainWorkload, evaluate

    cfg = load_model("qwen3-235b-a22b")[0]
    lay = Layout(tp=tp, pp=1, dp=ep * etp, ep=ep, etp=etp, sp=tp > 1)
    mean = 4096 * cfg.num_experts_per_tok * share  # the pairs of an average rank of the ep group
    busiest = routing_imbalance(mean * ep, ep, cfg.num_experts, cfg.num_experts_per_tok)  # as the time model
    assert (busiest > 1) == (ep > 1)
    assert routed_pairs(cfg, lay, 4096) == pytest.approx(mean * busiest)
    # held over 10 layers' routings at once, the busiest rank's excess is that of their sum
    many = routing_imbalance(mean * ep * 10, ep, cfg.num_experts, cfg.num_experts_per_tok)
    assert routed_pairs(cfg, lay, 4096, held=10) == pytest.approx(mean * many) and (many < busiest or ep == 1)
    lay = Layout(tp=4, pp=8, dp=8, ep=8, sp=True, zero=1, schedule="1f1b", micro_batch=1, num_micro=256)
    res = evaluate(_costs("qwen3-235b-a22b"), Cluster(gpu=load_gpu("h100-sxm"), num_gpus=256, gpus_per_node=8), lay,
                   TrainWorkload(global_batch=2048, seq_len=4096))  # fmt: skip
    assert res.fits, res.memory


def _with_quantization(tmp_path, keep: list[str], name: str = "llama-3-8b") -> str:
    import json

    from shardlm.plan.catalog import DATA

    cfg = json.loads((DATA / f"model-{name}.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fbgemm_fp8", "modules_to_not_convert": keep}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_a_quantized_checkpoint_keeps_what_its_config_lists_in_16_bit(tmp_path):
    """FP8 weights: the linear layers at 1 byte, the embedding and LM head at 2 (serving engines
    quantize linear layers only), and the modules the config.json's quantization_config keeps
    unquantized (fbgemm's modules_to_not_convert; compressed-tensors' ignore) at 2, counted by hand."""
    from shardlm.plan.layout import Layout
    from shardlm.plan.memory import weight_bytes
    from shardlm.plan.roofline import ModelCosts

    keep = ["model.layers.0", "layers.31.mlp", "lm_head", *(f"model.layers.{i}.self_attn" for i in range(1, 16))]
    cfg, _ = load_model(_with_quantization(tmp_path, keep))
    costs, lay = ModelCosts(cfg), Layout(tp=2)
    rl = rank_layer(cfg, 0, tp=2)
    mlp = rl.total - rl.attn
    embed = cfg.vocab_size // 2 * cfg.hidden_size
    L = cfg.num_layers
    want = 2 * 2 * embed + 2 * cfg.hidden_size  # embedding, LM head, final norm
    want += rl.attn * (16 * 2 + (L - 16)) + mlp * (2 * 2 + (L - 2))  # attention of layers 0-15, MLP of 0 and 31
    assert weight_bytes(costs, lay, 1, quantized=True) == pytest.approx(want)
    assert costs.kept.attention == 16 / L and costs.kept.mlp == 2 / L
    # unquantized plans and parameter counts ignore the list
    assert weight_bytes(costs, lay, 2) == stage_params(cfg, tp=2, pp=1)[0] * 2
    assert weight_bytes(costs, lay, 1) == stage_params(cfg, tp=2, pp=1)[0]


@pytest.mark.parametrize("entry", ["model.layers.3.self_attn.q_proj", "model.layers.32", "re:.*mlp"])
def test_a_module_the_planner_cannot_place_is_refused(tmp_path, entry, capsys):
    """A kept module the planner cannot count (a single projection, a layer past the last, a regex)
    is refused naming it, not skipped, when a quantized plan needs the list."""
    from shardlm.plan import cli

    path = _with_quantization(tmp_path, [entry])
    argv = ["--model", path, "--gpu", "h100-sxm", "--gpus", "1", "--dtype", "fp8"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert repr(entry) in err and "whole modules" in err
    assert cli.main([*argv[:-2], "--dtype", "bf16"]) == 0  # a 16-bit plan does not read the list


def test_fp8_decode_reads_the_kept_modules_and_the_head_at_16_bit(tmp_path):
    """The time model reads what the memory counts: keeping every layer's attention in 16-bit makes
    an FP8 decode step read those weights at 2 bytes (slower at batch 1, weight-bound)."""
    from shardlm.plan.hardware import Cluster, load_gpu
    from shardlm.plan.inference import InferenceWorkload, evaluate
    from shardlm.plan.layout import Layout
    from shardlm.plan.roofline import ModelCosts

    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=1, gpus_per_node=8)
    wl = InferenceWorkload(prompt_len=128, output_len=128, dtype="fp8", batch=1)
    plain, _ = load_model("llama-3-8b")
    kept, _ = load_model(_with_quantization(tmp_path, [f"model.layers.{i}.self_attn" for i in range(32)]))
    a, b = (evaluate(ModelCosts(c), cluster, Layout(), wl) for c in (plain, kept))
    rl = rank_layer(plain, 0, tp=1)
    extra = 32 * rl.attn  # one more byte a weight
    assert b.memory.weights - a.memory.weights == pytest.approx(extra)
    assert b.tpot_s - a.tpot_s == pytest.approx(extra / cluster.gpu.mem_Bps)


def test_uneven_interleaving_holds_its_largest_chunk_in_flight():
    """The interleaved first stage holds p micro-batches of every chunk and p - 1 more of one: where
    its layers do not split evenly (Llama 3 8B's 32 over pp6: 5 on the first stage, beside the
    embedding, in chunks of 2, 1, 1, 1 at vpp 4), that one is counted at the largest chunk's 2 layers,
    not at 5/4."""
    from shardlm.plan.activations import largest_chunk
    from shardlm.plan.layout import Layout
    from shardlm.plan.memory import training_activation_bytes
    from shardlm.plan.roofline import ModelCosts

    costs = ModelCosts(load_model("llama-3-8b")[0])
    held = sum(costs.stage_kinds(6)[0])
    p, v = 6, 4
    one_f1b = Layout(tp=1, pp=p, dp=1, schedule="1f1b", micro_batch=1, num_micro=12)
    interleaved = Layout(tp=1, pp=p, dp=1, schedule="interleaved", virtual=v, micro_batch=1, num_micro=12)
    stage = training_activation_bytes(costs, one_f1b, 4096) / p  # one micro-batch of the stage's layers
    chunk = largest_chunk(held, v)
    assert held == 5 and chunk == 2 / 5
    assert training_activation_bytes(costs, interleaved, 4096) == pytest.approx(stage * (p + (p - 1) * chunk))
