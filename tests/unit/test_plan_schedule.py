"""Pipeline schedule simulator against the closed-form bubble fractions, and the planner's pricing
of a pipeline's hops between stages."""

from dataclasses import replace

import pytest

from shardlm.plan import cli, comm
from shardlm.plan.catalog import load_model
from shardlm.plan.errors import PlanError
from shardlm.plan.hardware import Cluster, load_gpu
from shardlm.plan.layout import Layout
from shardlm.plan.planner import PlanRequest, plan
from shardlm.plan.roofline import ModelCosts
from shardlm.plan.schedule import bubble_fraction, simulate
from shardlm.plan.training import TrainWorkload, evaluate, warmup_passes

CASES = [(2, 4), (4, 8), (4, 16), (8, 16), (3, 6), (8, 32)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", CASES)
def test_gpipe_and_1f1b_bubble(schedule, p, m):
    # (p-1)/(m+p-1): Huang et al. 2019 §2.3; Narayanan et al. 2021 §2.2.1
    tl = simulate(schedule, stages=p, micro=m, t_f=1.0, t_b=2.0)
    assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction(schedule, p=p, m=m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2), (3, 6, 3), (4, 4, 3)])
def test_interleaved_bubble(p, m, v):
    # Narayanan et al. 2021 §2.2.2: bubble time (p-1)/v of a stage's (F+B) -> (p-1)/(v m + p - 1)
    tl = simulate("interleaved", stages=p, micro=m, t_f=1.0, t_b=2.0, virtual=v)
    assert tl.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p,m", CASES)
def test_zb_h1_bubble_and_memory(p, m):
    # Qi et al. 2023 §3: with T_F = T_B = T_W the bubble is (p-1) T_F, a third of 1F1B's, and
    # no stage holds more than p micro-batches (1F1B's peak on the first stage)
    tl = simulate("zb-h1", stages=p, micro=m, t_f=1.0, t_b=1.0, t_w=1.0)
    assert tl.makespan == pytest.approx(3 * m + p - 1)
    assert tl.bubble_fraction == pytest.approx(bubble_fraction("zb-h1", p=p, m=m))
    assert max(tl.peak_in_flight(s) for s in range(p)) <= p


def test_in_flight_memory_per_schedule():
    p, m = 4, 8
    assert [simulate("1f1b", stages=p, micro=m, t_f=1, t_b=2).peak_in_flight(s) for s in range(p)] == [4, 3, 2, 1]
    assert simulate("gpipe", stages=p, micro=m, t_f=1, t_b=2).peak_in_flight(0) == m
    # interleaved, 2 chunks: 2(p + (p-1)/v) - 1 chunk-activations ~ p + (p-1)/v micro-batches (Korthikanti §4.2.3)
    assert simulate("interleaved", stages=p, micro=m, t_f=1, t_b=2, virtual=2).peak_in_flight(0) == 11


def test_p2p_latency_lengthens_the_step():
    a = simulate("1f1b", stages=4, micro=8, t_f=1.0, t_b=2.0)
    b = simulate("1f1b", stages=4, micro=8, t_f=1.0, t_b=2.0, p2p_s=0.1)
    assert b.makespan > a.makespan


def test_interleaved_needs_multiple_of_p():
    with pytest.raises(PlanError, match="multiple of 4"):
        simulate("interleaved", stages=4, micro=6, t_f=1, t_b=2, virtual=2)


@pytest.mark.parametrize(("virtual", "chunk"), [(2, 5 / 9), (3, 3 / 9), (4, 3 / 9)])
def test_interleaved_bubble_is_the_largest_chunks(virtual, chunk):
    """Llama 3 8B's 32 layers over pp4 as shardlm's engine splits them, 8, 9, 9 and 6 (the LM head's
    stage takes fewer): the busiest stage's 9 in chunks of 5-4, 3-3-3 or 3-2-2-2 (uneven: as Megatron
    places them). The bubble is p - 1 of that stage's largest chunk's forward and backward: 5/9 of
    its passes at vpp 2, 1/3 at vpp 4, not 1/2 and 1/4."""
    costs = ModelCosts(load_model("llama-3-8b")[0])
    lay = Layout(tp=1, pp=4, dp=2, schedule="interleaved", virtual=virtual, micro_batch=1, num_micro=8)
    res = evaluate(costs, Cluster(gpu=load_gpu("h100-sxm"), num_gpus=8, gpus_per_node=8), lay,
                   TrainWorkload(global_batch=16, seq_len=4096))  # fmt: skip
    m, p = 8, 4
    unit = res.forward_s + res.backward_s + res.comm_s["pp"] / m  # the hops: 2v a micro-batch
    pipe = m * unit / (1 - res.bubble_fraction)
    assert (pipe - m * unit) / ((p - 1) * (res.forward_s + res.backward_s)) == pytest.approx(chunk)


@pytest.mark.parametrize(("kernels", "tensors"), [("shardlm", 2), ("fused", 1)])
@pytest.mark.parametrize("sp", [True, False])
def test_a_stage_boundary_carries_what_the_trainer_sends(kernels, tensors, sp):
    """Between stages each rank sends a micro-batch's hidden state and residual (shardlm's trainer,
    train/schedule.py) or the residual stream alone (Megatron-Core, ``--kernels fused``), 1/tp of
    the tokens under sequence parallelism: the pp time the plan reports is those bytes over the
    slowest pair of stages' link, once each way a micro-batch."""
    cfg = load_model("llama-3-8b")[0]
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=16, gpus_per_node=8)
    lay = Layout(tp=8, pp=2, dp=1, sp=sp, schedule="1f1b", micro_batch=1, num_micro=8)
    res = evaluate(ModelCosts(cfg), cluster, lay, TrainWorkload(global_batch=8, seq_len=4096, kernels=kernels))
    sent = tensors * 4096 / (8 if sp else 1) * cfg.hidden_size * 2
    assert res.comm_s["pp"] == pytest.approx(8 * 2 * comm.send_recv(sent, 0, 8, cluster))


@pytest.mark.parametrize(("nic_slower", "m", "shows"), [(1, 16, False), (1, 8, False), (40, 16, True)])
def test_the_interleaved_hops_hide_behind_the_chunks_with_pp_overlap(nic_slower, m, shows):
    """An interleaved micro-batch makes v hops each way; waited for they cost 2v sends, and with
    ``--pp-overlap`` (Megatron-Core's overlap_p2p_comm) each steady-state hop hides behind the chunk
    pass beside it, so only what it takes beyond that pass shows; the warm-up's and the drain's still
    wait (Megatron's default), at most every pass. Llama 3 70B at tp8 pp8 vpp5 on H100s hides each hop
    whole behind its 2-layer chunks, but at 8 micro-batches its warm-up (46 chunk passes of 40) leaves
    none to hide; over a NIC 40 times slower each hop outlasts the pass beside it, and the rest shows.
    Other schedules wait either way."""
    cfg = load_model("llama-3-70b")[0]
    tp, v = 8, 5
    gpu = load_gpu("h100-sxm")
    gpu = replace(gpu, inter=replace(gpu.inter, bandwidth_Bps=gpu.inter.bandwidth_Bps / nic_slower))
    cluster = Cluster(gpu=gpu, num_gpus=64, gpus_per_node=8)
    lay = Layout(tp=tp, pp=8, dp=1, sp=True, schedule="interleaved", virtual=v, micro_batch=1, num_micro=m)
    wl = TrainWorkload(global_batch=m, seq_len=8192, kernels="fused")
    waited = evaluate(ModelCosts(cfg), cluster, lay, wl)
    hidden = evaluate(ModelCosts(cfg), cluster, lay, replace(wl, pp_overlap=True))
    hop = comm.send_recv(8192 / tp * cfg.hidden_size * 2, 0, tp, cluster)  # the next stage: another node
    assert waited.comm_s["pp"] == pytest.approx(m * 2 * v * hop)
    warm = warmup_passes(lay)
    assert warm == min(2 * 7 + (v - 1) * 8, m * v)  # Megatron-Core's interleaved warm-up, 2(p - 1) + (v - 1)p
    f, b = hidden.forward_s / v, hidden.backward_s / v
    beyond = max(0.0, hop - f) + max(0.0, hop - b)
    assert hidden.comm_s["pp"] == pytest.approx(2 * warm * hop + (m * v - warm) * beyond)
    assert waited.step_s - hidden.step_s == pytest.approx(waited.comm_s["pp"] - hidden.comm_s["pp"])
    assert (beyond > 0) == shows and (hidden.step_s < waited.step_s) == (m * v > warm)
    one_f1b = replace(lay, schedule="1f1b", virtual=1)
    assert evaluate(ModelCosts(cfg), cluster, one_f1b, replace(wl, pp_overlap=True)).step_s == pytest.approx(
        evaluate(ModelCosts(cfg), cluster, one_f1b, wl).step_s
    )


def test_pp_overlap_is_refused_where_it_does_nothing_and_said_where_it_does_not_apply(capsys):
    """``--pp-overlap`` is refused, naming the pin, beside ``--pp 1`` or a schedule other than the
    interleaved one (and the interleaved schedule where a stage has fewer than two layers to chunk,
    flag or not); a layout priced with it is marked (shardlm's trainer waits for each receive),
    and a pick or a ``--compare`` layout it does not apply to says so."""
    argv = ["--model", "llama-3-70b", "--gpu", "h100-sxm", "--gpus", "64", "--train", "--pp-overlap"]
    for extra, why in (
        (["--pp", "1"], "but --pp 1 is pinned"),
        (["--schedule", "1f1b"], "--schedule 1f1b is pinned"),
        (["--pp", "64", "--schedule", "interleaved"], "80 layers over --pp 64 leave 1 a stage; lower --pp"),
    ):
        assert cli.main([*argv, *extra]) == 2, extra
        assert why in capsys.readouterr().err, extra
    wl = TrainWorkload(global_batch=64, seq_len=8192, pp_overlap=True)
    fixed = dict(tp=8, pp=8, schedule="interleaved", virtual=5)
    res = plan(PlanRequest(model="llama-3-70b", gpu="h100-sxm", gpus=64, train=True, training=wl, fixed=fixed))
    assert "(--pp-overlap; shardlm's trainer waits for each receive)" in (res.not_as_modelled(res.best) or "")
    assert not res.overlap_note()
    against = plan(
        PlanRequest(model="llama-3-70b", gpu="h100-sxm", gpus=64, train=True, training=wl, fixed={}, compare={"pp": 1})
    )
    assert "--pp-overlap does not apply to the compared layout" in against.explanation[-1]
    assert "runs no pipeline, so it has no hops to hide" in against.explanation[-1]
    res.ranked[0] = replace(res.best, layout=res.best.layout.with_(schedule="zb-h1", virtual=1))
    assert "the pick runs the zb-h1 schedule, priced with each hop waited for" in res.overlap_note()[0]


def test_the_search_interleaves_unevenly_and_marks_it():
    """Unpinned, the search tries interleaving wherever every chunk gets a layer, not only where the
    layers divide: DeepSeek-V3's 61 over pp4 are interleaved at vpp 2 and 4 (15-16 layers a stage, as
    Megatron's --pipeline-model-parallel-layout places them), and such a layout is marked not runnable
    by shardlm (its trainer splits pp x vpp equal chunks)."""
    fixed = dict(tp=1, pp=4, cp=1, ep=16, schedule="interleaved")
    wl = TrainWorkload(global_batch=1024, seq_len=4096, dtype="fp8")
    res = plan(PlanRequest(model="deepseek-v3", gpu="b200", gpus=256, train=True, training=wl, fixed=fixed, top=3))
    depths = {r.layout.virtual for r in res.search.results}
    assert depths == {2, 4} and 61 % (4 * 2)
    assert "61 layers in pp x vpp" in (res.not_runnable(res.best) or "")
