"""The planner's disaggregated prefill/decode pools (``shardlm/plan/disagg.py``, ``plan
--prefill-replicas N`` as ``serve --prefill-replicas N`` runs them): TPOT without prefill
interference, the KV handoff between the pools, capacity = the slower pool, and the refusals."""

from __future__ import annotations

import functools
import json
import math

import pytest

from shardlm.plan import cli, comm
from shardlm.plan.catalog import load_model
from shardlm.plan.hardware import Cluster, load_gpu
from shardlm.plan.inference import InferenceWorkload, evaluate
from shardlm.plan.layout import Layout
from shardlm.plan.memory import kv_bytes_per_seq_token
from shardlm.plan.roofline import ModelCosts

PROMPT, OUT = 8192, 256  # long prompts: each fills a step's whole budget, stalling every decode beside it


@functools.cache
def costs() -> ModelCosts:
    return ModelCosts(load_model("llama-3-8b")[0])


def cluster(per_node: int = 8) -> Cluster:
    return Cluster(gpu=load_gpu("h100-sxm"), num_gpus=4, gpus_per_node=per_node)


def served(split: int, per_node: int = 8, **load):
    wl = InferenceWorkload(prompt_len=PROMPT, output_len=OUT, prefill_replicas=split, **load)
    return evaluate(costs(), cluster(per_node), Layout(tp=1, pp=1, dp=4), wl)


def test_disaggregation_lowers_tpot_where_prefills_stall_the_decodes():
    """At 8 requests/s of 8K prompts over 4 replicas (2 a replica, 64% of the colocated capacity), a
    colocated replica's decodes share many steps with a prompt's 8K-token chunk (~30x a decode step);
    2 decode replicas of 4 never do, so TPOT falls by a third, while TTFT (2 prefill replicas for the
    whole load) rises."""
    both, split = served(0, request_rate=8.0), served(2, request_rate=8.0)
    assert not both.serving.saturated and not split.serving.saturated
    assert split.tpot_s < 0.7 * both.tpot_s, (split.tpot_s, both.tpot_s)
    assert split.ttft_s > both.ttft_s
    # the decode pool's steps carry decodes only: its TPOT is a decode step at its load, plus the handoff
    dec = split.split.decode
    assert dec.tpot_s < split.tpot_s <= dec.tpot_s + (split.split.handoff_s + dec.ttft_s) / (OUT - 1) + 1e-12


def test_kv_handoff_is_the_prompts_cache_over_the_link_between_the_pools():
    """Each rank sends its shard of one prompt's KV (the planner's count) to its decode counterpart:
    NVLink when both replicas share a node, the NIC when they do not; the difference shows up in
    the time after the first token (the first streams before the handoff, as the engine runs it)."""
    near, far = served(1, per_node=8, concurrency=8), served(1, per_node=1, concurrency=8)
    lay = Layout(tp=1, pp=1, dp=4)
    nbytes = kv_bytes_per_seq_token(costs(), lay, 2) * PROMPT
    assert near.split.handoff_bytes == pytest.approx(nbytes) == pytest.approx(far.split.handoff_bytes)
    assert near.split.handoff_link == "node" and far.split.handoff_link == "nic"
    assert near.split.handoff_s == pytest.approx(comm.send_recv(nbytes, 0, 1, cluster(8)))
    assert far.split.handoff_s == pytest.approx(comm.send_recv(nbytes, 0, 1, cluster(1)))
    assert far.split.handoff_s > 5 * near.split.handoff_s
    assert far.ttft_s == pytest.approx(near.ttft_s, rel=1e-3)  # TTFT is the prefill pool's alone
    extra = (far.split.handoff_s - near.split.handoff_s) / (OUT - 1)
    assert far.tpot_s - near.tpot_s == pytest.approx(extra, rel=0.05)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_capacity_is_the_slower_pool(split):
    res = served(split)  # no load: the pools' capacities set the throughput
    s = res.split
    assert (s.prefill_replicas, s.decode_replicas) == (split, 4 - split)
    rps = min(s.prefill_capacity_requests_per_s, s.decode_capacity_requests_per_s)
    assert res.throughput == pytest.approx(rps * OUT)
    over = served(split, request_rate=rps * 1.01)
    assert over.serving.saturated and math.isinf(over.ttft_s)
    assert over.serving.capacity_requests_per_s == pytest.approx(rps)
    assert not served(split, request_rate=rps * 0.9).serving.saturated
    # more prefill replicas: more prefill capacity, less decode capacity
    assert s.prefill_capacity_requests_per_s == pytest.approx(split * served(1).split.prefill_capacity_requests_per_s)


def test_cli_reports_the_pools_and_the_colocated_layout(capsys):
    argv = [
        "--model",
        "llama-3-8b",
        "--gpu",
        "h100-sxm",
        "--gpus",
        "4",
        "--tp",
        "1",
        "--dp",
        "4",
        "--prompt-len",
        str(PROMPT),
    ]
    argv += ["--output-len", str(OUT), "--request-rate", "2", "--prefill-replicas", "1", "--top", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "1 prefill + 3 decode replicas" in out and "KV handoff" in out and "Colocated" in out
    assert cli.main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["layouts"][0]["disaggregated"]
    assert d["prefill_replicas"] == 1 and d["decode_replicas"] == 3 and d["handoff_link"] == "node"
    assert d["decode"]["tpot_s"] > 0 and d["bottleneck"] in ("prefill", "decode")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--train"], "--prefill-replicas is an inference flag but --train plans training"),
        (
            ["--dp", "2", "--prefill-replicas", "2"],
            "--prefill-replicas 2 leaves no replica to decode: a split needs "
            "dp > 2 (the 2 prefill replica(s) and at least one decode replica), and the largest dp that --gpus and the "
            "pins allow is 2; lower --prefill-replicas below 2, or raise --dp / --gpus",
        ),
        (["--prefill-replicas", "4"], "--prefill-replicas 4 leaves no replica to decode: a split needs dp > 4"),
        (["--prefill-replicas", "5"], "the largest dp that --gpus and the pins allow is 4; lower --prefill-replicas"),
        (["--tp", "4", "--prefill-replicas", "1"], "the largest dp that --gpus and the pins allow is 1"),
        (
            ["--output-len", "1", "--prefill-replicas", "1"],
            "--output-len 1 leaves nothing to decode: drop --prefill-replicas or raise --output-len to 2",
        ),
        (["--prefill-replicas", "0"], "--prefill-replicas 0: must be a positive integer"),
    ],
)
def test_refusals(extra, message, capsys):
    argv = ["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "4", *extra]
    if "--train" in extra:
        argv += ["--prefill-replicas", "1"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("output_len, fixed", [(1, {}), (OUT, {"dp": 2})])
def test_the_planner_refuses_a_split_it_cannot_make_not_only_the_cli(output_len, fixed):
    """One refusal (``disagg.check``), where the search meets the split: a plan asked for
    through the library is refused as the command line's is."""
    from shardlm.plan.errors import PlanError
    from shardlm.plan.planner import PlanRequest, plan

    wl = InferenceWorkload(prompt_len=PROMPT, output_len=output_len, prefill_replicas=2)
    req = PlanRequest(model="llama-3-8b", gpu="h100-sxm", gpus=4, inference=wl, fixed=fixed)
    why = "leaves nothing to decode" if output_len == 1 else "the largest dp that --gpus and the pins allow is 2"
    with pytest.raises(PlanError, match=why):
        plan(req)


def test_split_layouts_shardlm_cannot_run_are_marked():
    from shardlm.plan.runnable import not_runnable

    cfg = costs().cfg
    assert "cp" in not_runnable(cfg, Layout(dp=2, cp=2), train=False, dtype="bf16", prefill_replicas=1)
    assert not_runnable(cfg, Layout(dp=2, cp=2), train=False, dtype="bf16") is None
    moe = load_model("mixtral-8x7b")[0]
    lockstep = Layout(dp=4, tp=1, ep=4)  # experts over the replicas: they step together
    assert "lockstep" in not_runnable(moe, lockstep, train=False, dtype="bf16", prefill_replicas=1)
    assert not_runnable(moe, Layout(dp=2, tp=2, ep=2), train=False, dtype="bf16", prefill_replicas=1) is None


def _auto(prompt: int, out: int, **load):
    """The plan with the split searched (--prefill-replicas auto) on tp1 x dp4, and each split pinned."""
    from shardlm.plan.planner import PlanRequest, plan

    def best(split):
        wl = InferenceWorkload(prompt_len=prompt, output_len=out, prefill_replicas=split, **load)
        req = PlanRequest(model="llama-3-8b", gpu="h100-sxm", gpus=4, inference=wl, fixed={"tp": 1, "dp": 4})
        return plan(req).best

    return best(None), [best(n) for n in range(4)]


def test_auto_picks_the_best_split_or_none():
    """At 8 requests/s of 8K prompts (where prefills stall the decodes) every split serves the load,
    so the lowest latency wins: the search's pick is the best of colocated and the three pinned
    splits, and it is a split. 256 clients of 128-token prompts and 512-token answers: a prefill
    pool would idle, and colocated serves the most tokens/s: the pick is not split."""
    picked, pinned = _auto(PROMPT, OUT, request_rate=8.0)
    latency = [r.latency_s for r in pinned]
    assert picked.split is not None and picked.split.prefill_replicas == latency.index(min(latency))
    assert picked.latency_s == pytest.approx(min(latency)) and min(latency) < latency[0]
    picked, pinned = _auto(128, 512, concurrency=256)
    tps = [r.throughput for r in pinned]
    assert tps.index(max(tps)) == 0 and picked.split is None
    assert picked.throughput == pytest.approx(tps[0])


def test_auto_splits_only_what_the_engine_splits_and_says_so(capsys):
    """cp > 1 layouts are tried colocated only (the engine refuses to split them); the command line
    takes auto, reports the pick's pools, and refuses auto where no layout has two replicas."""
    from shardlm.plan.planner import PlanRequest, plan

    wl = InferenceWorkload(prompt_len=PROMPT, output_len=OUT, prefill_replicas=None, request_rate=8.0)
    req = PlanRequest(model="llama-3-8b", gpu="h100-sxm", gpus=4, inference=wl, fixed={"tp": 1, "cp": 2}, top=5)
    assert all(r.split is None for r in plan(req).ranked)
    argv = ["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "4", "--tp", "1", "--dp", "4"]
    argv += ["--prompt-len", str(PROMPT), "--output-len", str(OUT), "--request-rate", "8", "--prefill-replicas", "auto"]
    assert cli.main([*argv, "--json", "--top", "1"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["workload"]["prefill_replicas"] is None and d["layouts"][0]["disaggregated"]["decode_replicas"] >= 1
    assert cli.main(["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "4", "--tp", "4", "--prefill-replicas",
                     "auto"]) == 2  # fmt: skip
    assert "--prefill-replicas auto leaves no replica to decode" in capsys.readouterr().err
