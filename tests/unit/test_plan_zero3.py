"""Planner: ZeRO-3's per-layer gathers and reduce-scatters, their ring over the dp group and what
the prefetch hides (training.zero3_exposed, comm.ring_gather)."""

import json

import pytest

from shardlm.plan import comm, training
from shardlm.plan.catalog import load_model
from shardlm.plan.errors import PlanError
from shardlm.plan.hardware import Cluster, load_gpu
from shardlm.plan.layout import Layout
from shardlm.plan.roofline import ModelCosts
from shardlm.plan.zero import PARAM_BYTES


def _cluster(n: int) -> Cluster:
    return Cluster(gpu=load_gpu("a100-80g"), num_gpus=n, gpus_per_node=8)


def test_ring_gather_latency_grows_with_the_group_and_moves_at_one_nics_rate():
    g, size = load_gpu("a100-80g"), 3.6e9  # one GPT-3 175B layer in 16 bits
    for n in (16, 384, 1536):
        expected = g.collective_launch_s + (n - 1) * g.inter.alpha_s + (n - 1) / n * size / g.inter.bandwidth_Bps
        assert comm.ring_gather(size, list(range(n)), _cluster(n)) == pytest.approx(expected)
    # inside a node: NVLink; the hierarchical form spreads the bytes over the node's 8 NICs
    assert comm.ring_gather(size, list(range(8)), _cluster(8)) == pytest.approx(
        comm.all_gather(size, list(range(8)), _cluster(8))
    )
    assert comm.ring_gather(size, list(range(16)), _cluster(16)) > 4 * comm.all_gather(
        size, list(range(16)), _cluster(16)
    )


def _gpt3(n: int, micro_batch: int, prefetch: int = 1):
    cfg, _ = load_model("gpt3-175b")
    costs, cluster = ModelCosts(cfg), _cluster(n)
    lay = Layout(dp=n, zero=3, micro_batch=micro_batch, num_micro=1536 // n // micro_batch, recompute="full")
    wl = training.TrainWorkload(global_batch=1536, seq_len=2048, prefetch=prefetch)
    return costs, cluster, lay, training.evaluate(costs, cluster, lay, wl)


def test_zero3_exposed_per_layer():
    """Narayanan et al. 2021's Table 2 run at 1,536 GPUs: each layer's gather (~170 ms over one
    200 Gb/s NIC) against layers of f = G/2 forward, b = 2G backward: the forward waits
    G + (L - 1)(G - f), the backward only its first gather and the reduce-scatters, G + L R; with
    no prefetch, all of it. R moves the float32 gradients the trainer reduces (train/zero.py
    _Gather.backward), twice G's 16-bit weights. The embedding and LM head are one more unit, never
    prefetched."""
    costs, cluster, lay, res = _gpt3(1536, 1)
    cfg, layers, dp = costs.cfg, costs.cfg.num_layers, list(range(1536))
    layer, embed = costs.rank_layer(False, 1).total, costs.vocab_rows(1) * cfg.hidden_size
    g = comm.ring_gather(layer * PARAM_BYTES, dp, cluster)
    r = comm.ring_gather(layer * 4, dp, cluster)
    assert cfg.tie_word_embeddings  # GPT's LM head is its embedding: one unit's gather
    g_rest, r_rest = (comm.ring_gather(embed * n, dp, cluster) for n in (PARAM_BYTES, 4))
    f, b = g / 2, 2 * g
    e_f, e_b = training.zero3_exposed(costs, cluster, lay, 0, layers * f, layers * b, prefetch=1)
    assert e_f == pytest.approx(g + (layers - 1) * (g - f) + g_rest)
    assert e_b == pytest.approx(g + layers * r + g_rest + r_rest)
    e_f, e_b = training.zero3_exposed(costs, cluster, lay, 0, layers * f, layers * b, prefetch=0)
    assert (e_f, e_b) == pytest.approx((layers * g + g_rest, layers * (g + r) + g_rest + r_rest))
    assert res.comm_s["dp"] > 0.5 * res.step_s  # communication-bound, as published (44 TFLOP/s/GPU)


def test_zero3_overlapped_reduce_scatters_wait_only_beyond_the_backward_beside_them():
    """FSDP2 and Megatron-FSDP reduce-scatter on their own stream behind the next layers' backward:
    per layer the link carries that R and the next gather G beside one layer's backward b, and only
    the last R has nothing after it. The forward is the blocking form's."""
    costs, cluster, lay, _ = _gpt3(1536, 1)
    cfg, layers, dp = costs.cfg, costs.cfg.num_layers, list(range(1536))
    layer, embed = costs.rank_layer(False, 1).total, costs.vocab_rows(1) * cfg.hidden_size
    g = comm.ring_gather(layer * PARAM_BYTES, dp, cluster)
    r = comm.ring_gather(layer * 4, dp, cluster)
    g_rest, r_rest = (comm.ring_gather(embed * n, dp, cluster) for n in (PARAM_BYTES, 4))
    for b in (2 * g, 4 * g):  # G + R = 3 G: partly hidden, then wholly
        args = (costs, cluster, lay, 0, layers * g / 2, layers * b)
        blocking, overlapped = (training.zero3_exposed(*args, prefetch=1, reduce=x) for x in training.ZERO3_REDUCE)
        assert overlapped[0] == blocking[0]
        assert overlapped[1] == pytest.approx(g + (layers - 1) * max(0, g + r - b) + r + g_rest + r_rest)
        assert overlapped[1] < blocking[1]
        e_b = training.zero3_exposed(*args, prefetch=0, reduce="overlapped")[1]
        assert e_b == pytest.approx(layers * g + (layers - 1) * max(0, r - b) + r + g_rest + r_rest)


def test_zero3_per_gpu_throughput_falls_as_dp_grows_at_a_fixed_batch():
    """Fixed global batch: each GPU's compute halves as dp doubles while its gathers do not
    (Table 2: 144, 88, 44 TFLOP/s/GPU at 384, 768, 1,536 GPUs); the old model held it flat."""
    mfu = [_gpt3(n, mb)[3].mfu for n, mb in ((384, 4), (768, 2), (1536, 1))]
    assert mfu[0] > 1.3 * mfu[1] > 1.3**2 * mfu[2]
    assert mfu[0] / mfu[2] > 2.5
    # a prefetch hides what a layer's compute covers: no prefetch is slower
    assert _gpt3(384, 4, prefetch=0)[3].step_s > 1.2 * _gpt3(384, 4)[3].step_s


def test_prefetch_flag_is_honoured_or_refused(capsys):
    from shardlm.plan import cli

    base = ["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "16", "--train", "--zero", "3", "--json"]
    steps = []
    for prefetch in ("1", "0"):
        assert cli.main([*base, "--tp", "1", "--pp", "1", "--prefetch", prefetch]) == 0
        steps.append(json.loads(capsys.readouterr().out)["layouts"][0]["step_s"])
    assert steps[1] > steps[0]  # nothing prefetched: every gather waits
    assert cli.main([*base, "--prefetch", "-1"]) == 2
    assert "--prefetch -1 must be a whole number of layers >= 0" in capsys.readouterr().err
    assert cli.main(["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--prefetch", "1"]) == 2
    assert "--prefetch is a training flag" in capsys.readouterr().err


def test_zero3_reduce_flag_is_honoured_or_refused(capsys):
    from shardlm.plan import cli

    base = ["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "64", "--train", "--zero", "3", "--json"]
    base += ["--tp", "1", "--pp", "1", "--global-batch", "256"]  # a layer's backward outlasts its G + R
    base += ["--recompute", "full"]  # the same layout for both: overlapped holds a second layer's gradient
    steps = {}
    for reduce in ("blocking", "overlapped"):
        assert cli.main([*base, "--zero3-reduce", reduce]) == 0
        steps[reduce] = json.loads(capsys.readouterr().out)["layouts"][0]["step_s"]
    assert steps["overlapped"] < 0.9 * steps["blocking"]
    with pytest.raises(SystemExit):
        cli.main([*base, "--zero3-reduce", "async"])
    assert "invalid choice: 'async'" in capsys.readouterr().err
    assert cli.main(["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--zero3-reduce", "overlapped"]) == 2
    assert "--zero3-reduce is a training flag" in capsys.readouterr().err
    for flag in (["--zero3-reduce", "overlapped"], ["--prefetch", "0"]):
        assert (
            cli.main(["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "64", "--train", "--zero", "1", *flag])
            == 2
        )
        assert f"{flag[0]} shapes ZeRO-3's communication, but --zero 1 is pinned" in capsys.readouterr().err
    with pytest.raises(PlanError, match="zero3_reduce='async' is not one of blocking, overlapped"):
        training.TrainWorkload(global_batch=8, seq_len=128, zero3_reduce="async")


def test_zero3_memory_holds_gathered_weights_and_the_gradients_being_reduced():
    """Beyond its shards, at the start of backward: the gathered 16-bit weights of the layer and the
    1 + --prefetch layers, and of the outer unit (embedding and LM head, gathered through forward),
    the outer unit's whole 16-bit gradient (reduced when the embedding's backward ends; at pp > 1 the
    last stage's head right after its backward), and the
    gradient of the layer being reduce-scattered: 16 bits and its float32 copy (shardlm's trainer:
    tests/distributed/test_train.py checks it sends that copy); overlapped, a second layer's beside
    it. No gradient buckets (stage 3 has none)."""
    from shardlm.plan.memory import ZERO3_GRAD_BYTES, training_memory

    costs = ModelCosts(load_model("llama-3-8b")[0])
    lay = Layout(dp=64, zero=3, micro_batch=1, num_micro=4)
    layer = costs.rank_layer(False, 1, 1, 1).total
    outer = 2 * 128256 * 4096  # untied embedding and LM head, both on the one stage
    for prefetch in (0, 1, 2):
        for reduce, grads in (("blocking", 1), ("overlapped", 2)):
            mem = training_memory(costs, lay, 0.0, seq=4096, prefetch=prefetch, zero3_reduce=reduce)
            held = PARAM_BYTES * ((1 + prefetch) * layer + outer) + 2 * outer + grads * ZERO3_GRAD_BYTES * layer
            assert mem.comm_buffers == pytest.approx(held)
    assert ZERO3_GRAD_BYTES == 6
    # pp2: the LM head alone on the last stage, its gradient reduce-scattered right after the head's
    # backward (16 bits and the float32 copy sent), more than the embedding's on the first
    head = training_memory(costs, Layout(dp=8, pp=2, zero=3), 0.0, seq=4096).comm_buffers
    assert head == pytest.approx(
        PARAM_BYTES * 2 * layer + (PARAM_BYTES + ZERO3_GRAD_BYTES) * outer / 2 + ZERO3_GRAD_BYTES * layer
    )
    # an MoE layer's experts are gathered when met, never prefetched
    moe = ModelCosts(load_model("mixtral-8x7b")[0])
    lay, rl = Layout(dp=8, ep=8, zero=3), moe.rank_layer(True, 1, 8, 1)
    experts, outer = rl.experts * rl.expert_params, moe.vocab_rows(1) * 4096 * 2
    mem = training_memory(moe, lay, 0.0, seq=4096, prefetch=2).comm_buffers
    gathered = 3 * (rl.total - experts) + experts
    assert experts > 0 and mem == pytest.approx(
        PARAM_BYTES * (gathered + outer) + 2 * outer + ZERO3_GRAD_BYTES * rl.total
    )
    # priced as FSDP2 / Megatron-FSDP: the experts prefetched with the rest of the layer
    mem = training_memory(moe, lay, 0.0, seq=4096, prefetch=2, zero3_reduce="overlapped").comm_buffers
    assert mem == pytest.approx(PARAM_BYTES * (3 * rl.total + outer) + 2 * outer + 2 * ZERO3_GRAD_BYTES * rl.total)


def test_zero3_moe_experts_are_gathered_when_met_so_their_gathers_always_wait():
    """shardlm's trainer prefetches a layer's dense unit only and gathers an MoE layer's experts
    (over the ranks holding the same expert slices) when it meets them: with compute long enough to
    hide every prefetched gather, the experts' gathers of every layer still wait, forward and
    backward; with no prefetch everything waits, as before. FSDP2 and Megatron-FSDP (priced under
    --zero3-reduce overlapped) prefetch the experts with the rest."""
    from shardlm.plan.memory import outer_params
    from shardlm.plan.zero import REDUCED_GRAD_BYTES

    moe, cluster = ModelCosts(load_model("mixtral-8x7b")[0]), _cluster(16)
    lay = Layout(dp=16, ep=8, zero=3)  # two copies of each expert slice, one a node
    rl, layers = moe.rank_layer(True, 1, 8, 1), moe.cfg.num_layers
    experts = rl.experts * rl.expert_params
    dp, edp = lay.slowest_group("dp_cp", 8), lay.slowest_group("edp", 8)
    assert len(edp) == 2
    g_d, g_e = (
        comm.ring_gather(n * PARAM_BYTES, grp, cluster) for n, grp in ((rl.total - experts, dp), (experts, edp))
    )
    r = sum(
        comm.ring_gather(n * REDUCED_GRAD_BYTES, grp, cluster) for n, grp in ((rl.total - experts, dp), (experts, edp))
    )
    rest = outer_params(moe, lay, 0)
    g_rest, r_rest = (comm.ring_gather(rest * n, dp, cluster) for n in (PARAM_BYTES, REDUCED_GRAD_BYTES))
    long = 1e3 * layers  # seconds of compute: every prefetched gather hides
    e_f, e_b = training.zero3_exposed(moe, cluster, lay, 0, long, long, prefetch=1)
    assert g_e > 0 and e_f == pytest.approx(g_d + layers * g_e + g_rest)
    assert e_b == pytest.approx(g_d + layers * (g_e + r) + g_rest + r_rest)
    e_f, _ = training.zero3_exposed(moe, cluster, lay, 0, long, long, prefetch=0)
    assert e_f == pytest.approx(layers * (g_d + g_e) + g_rest)
    # priced as FSDP2 / Megatron-FSDP (--zero3-reduce overlapped): the experts prefetched too
    e_f, _ = training.zero3_exposed(moe, cluster, lay, 0, long, long, prefetch=1, reduce="overlapped")
    assert e_f == pytest.approx(g_d + g_e + g_rest)


def test_gradients_reduced_in_bf16_move_half_the_bytes_and_are_marked(capsys):
    """--grad-reduce bf16 (Megatron-LM's --grad-reduce-in-bf16) sends each gradient in 2 bytes: ZeRO-1's
    reduce-scatter moves half of fp32's, ZeRO-3's reduce-scatters too, and a ZeRO-3 layer being sent
    holds no float32 copy beside its 16-bit gradient. shardlm's trainer reduces in float32, so a
    layout priced so is marked; a dtype it does not know is refused."""
    from shardlm.plan import cli, constants
    from shardlm.plan.memory import weight_bytes, zero3_buffers
    from shardlm.plan.planner import PlanRequest, plan
    from shardlm.plan.training import TrainWorkload, evaluate, zero3_exposed

    costs = ModelCosts(load_model("llama-3-8b")[0])
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=16, gpus_per_node=8)
    lay = Layout(dp=16, zero=1, micro_batch=1, num_micro=1)
    dp = lay.slowest_group("dp_cp", 8)
    params = weight_bytes(costs, lay, 1)
    with pytest.MonkeyPatch.context() as mp:  # nothing hidden behind backward: the traffic itself
        mp.setattr(constants, "DP_OVERLAP_FRACTION", 0.0)
        for reduce, per in (("fp32", 4), ("bf16", 2)):
            res = evaluate(costs, cluster, lay, TrainWorkload(global_batch=16, seq_len=2048, grad_reduce=reduce))
            want = comm.reduce_scatter(per * params, dp, cluster) + comm.all_gather(PARAM_BYTES * params, dp, cluster)
            assert res.fits and res.comm_s["dp"] == pytest.approx(want)
    z3 = Layout(dp=16, zero=3, micro_batch=1, num_micro=1)
    long = 10.0  # layers that hide every gather: what is left is the reduce-scatters
    f32, b16 = (zero3_exposed(costs, cluster, z3, 0, long, long, prefetch=1, grad_bytes=g)[1] for g in (4, 2))
    assert b16 < f32
    rl = costs.rank_layer(False, 1)
    assert zero3_buffers(costs, z3, 1, "blocking", 4) - zero3_buffers(costs, z3, 1, "blocking", 2) == pytest.approx(
        4 * rl.total
    )
    wl = TrainWorkload(global_batch=64, seq_len=2048, grad_reduce="bf16")
    res = plan(PlanRequest(model="llama-3-8b", gpu="h100-sxm", gpus=16, train=True, training=wl, fixed=dict(dp=16)))
    assert "16-bit gradient reductions" in (res.not_as_modelled(res.best) or "")
    with pytest.raises(PlanError, match="grad_reduce='fp16' is not one of fp32, bf16"):
        TrainWorkload(global_batch=64, seq_len=2048, grad_reduce="fp16")
    argv = ["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "16", "--train", "--dp", "16"]
    assert cli.main([*argv, "--grad-reduce", "bf16"]) == 0
    assert "16-bit gradient reductions (--grad-reduce bf16" in capsys.readouterr().out
    assert cli.main([a for a in argv if a != "--train"] + ["--grad-reduce", "bf16"]) == 2  # serving sends no gradients
    assert "--grad-reduce is a training flag; add --train or drop it" in capsys.readouterr().err
