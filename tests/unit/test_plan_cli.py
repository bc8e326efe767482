"""`shardlm plan` end to end: search, recommendations, JSON, plots, and bad input (exit 2)."""

import argparse
import itertools
import json
import re
import time

import pytest

from shardlm.plan import cli
from shardlm.plan.catalog import load_model
from shardlm.plan.hardware import Cluster, load_gpu
from shardlm.plan.roofline import ModelCosts
from shardlm.plan.search import search_training
from shardlm.plan.training import TrainWorkload


def run(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_add_parser_registers_plan():
    parser = argparse.ArgumentParser(prog="shardlm")
    sub = parser.add_subparsers(dest="cmd")
    cli.add_parser(sub)
    args = parser.parse_args(["plan", "--model", "smollm2", "--gpu", "h100", "--gpus", "2", "--json"])
    assert args.func is cli.run and args.gpus == 2 and args.json


def test_llama_70b_two_nodes_throughput(capsys):
    code, out, err = run(
        [
            "--model",
            "llama-3-70b",
            "--gpu",
            "h100-sxm",
            "--gpus",
            "16",
            "--gpus-per-node",
            "8",
            "--prompt-len",
            "2048",
            "--output-len",
            "256",
            "--objective",
            "throughput",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    data = json.loads(out)
    best = data["layouts"][0]
    # TP stays inside a node, the winner replicates (DP) for throughput, and the numbers are sane
    assert best["layout"]["tp"] <= 8 and best["layout"]["dp"] >= 2
    assert best["rule_departures"] == []
    assert best["throughput_tokens_per_s"] > 1000 and 0 < best["tpot_s"] < 0.2
    mem = best["memory_bytes"]
    assert mem["total"] <= 80 * 2**30 and mem["weights"] == pytest.approx(70.55e9 * 2 / best["layout"]["tp"], rel=0.02)
    assert any("wins" in line for line in data["explanation"])
    assert any("Runner-up" in line for line in data["explanation"])


def test_latency_prefers_wide_tp_inside_a_node(capsys):
    code, out, err = run(
        ["--model", "llama-3-70b", "--gpu", "h100-sxm", "--gpus", "16", "--objective", "latency", "--json"], capsys
    )
    assert code == 0, err
    best = json.loads(out)["layouts"][0]
    assert best["layout"]["tp"] == 8 and best["batch_per_replica"] == 1


def test_deepseek_v3_uses_expert_parallelism(capsys):
    code, out, err = run(
        ["--model", "deepseek-v3", "--gpu", "h200", "--gpus", "16", "--objective", "throughput", "--json"], capsys
    )
    assert code == 0, err
    best = json.loads(out)["layouts"][0]
    assert best["layout"]["ep"] > 1
    assert best["memory_bytes"]["total"] <= 141 * 2**30


def test_training_plan_and_plots(capsys, tmp_path):
    code, out, err = run(
        [
            "--model",
            "llama-3-8b",
            "--gpu",
            "a100-80g",
            "--gpus",
            "8",
            "--train",
            "--global-batch",
            "64",
            "--seq-len",
            "4096",
            "--pp",
            "2",
            "--plot",
            str(tmp_path),
        ],
        capsys,
    )
    assert code == 0, err
    assert "tokens/s" in out and "zero" in out and "pp2" in out
    for name in ("memory.png", "schedule.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_table_output_for_config_path(capsys, tmp_path):
    from shardlm.plan.catalog import _presets

    path = tmp_path / "config.json"
    path.write_text(_presets()["qwen2.5-72b"].read_text())
    code, out, err = run(["--model", str(path), "--gpu", "a100-80g", "--gpus", "4", "--prompt-len", "512"], capsys)
    assert code == 0, err
    assert "TPOT ms" in out and "tp4" in out


def test_training_search_speed():
    cfg, _ = load_model("llama-3-70b")
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=64, gpus_per_node=8)
    t0 = time.perf_counter()
    res = search_training(
        ModelCosts(cfg), cluster, TrainWorkload(global_batch=512, seq_len=4096), objective="throughput", fixed={}
    )
    assert res.evaluated > 5000 and res.rate > 1000, f"{res.evaluated} layouts at {res.rate:.0f}/s"
    assert time.perf_counter() - t0 < 20
    best = res.results[0]
    assert best.layout.tp <= 8 and best.mfu < 0.7


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--model", "llama3-70b", "--gpu", "h100", "--gpus", "8"], "did you mean 'llama-3-70b'"),
        (["--model", "llama-3-70b", "--gpu", "h10", "--gpus", "8"], "did you mean 'h100-sxm'"),
        (["--model", "llama-3.1-405b", "--gpu", "a100-80g", "--gpus", "4"], "it would fit on"),
        (["--model", "llama-3-70b", "--gpu", "a100-80g", "--gpus", "8", "--tp", "1", "--pp", "1"], "layouts that fit"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "8"], "add --train"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--gpus", "8", "--train", "--prompt-len", "8"], "inference flag"),
        (
            ["--model", "llama-3-8b", "--gpu", "h100", "--gpus", "8", "--objective", "latency", "--max-tpot-ms", "5"],
            "throughput objective",
        ),
        (["--model", "llama-3-8b", "--gpu", "a100-80g", "--gpus", "8", "--dtype", "fp8"], "no fp8"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--gpus", "8", "--tp", "3"], "divide --gpus 8"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--gpus", "12", "--gpus-per-node", "8"], "whole number of nodes"),
        # 256 GB200s run as four NVLink domains of 64 (NVIDIA's Megatron-Bridge rows): the message says how
        (["--model", "llama-3-8b", "--gpu", "gb200", "--gpus", "256"], "say how many with --gpus-per-node (e.g. 64)"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--gpus", "8", "--max-tpot-ms", "0.01"], "meets the limits"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--gpus", "0"], "positive integer"),
        (["--model", "./nope/config.json", "--gpu", "h100", "--gpus", "8"], "does not exist"),
        (["--model", "llama-3-8b", "--gpu", "h100", "--gpus", "8", "--recalibrate"], "this-machine"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, needle, capsys):
    code, _out, err = run(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert needle in err, err


def test_never_fits_says_by_how_much(capsys):
    code, _, err = run(["--model", "llama-3.1-405b", "--gpu", "a100-80g", "--gpus", "4"], capsys)
    assert code == 2
    assert "GiB more than the 80.0 GiB" in err and "16 x a100-80g" in err
    # the full breakdown: every part, summing to the total
    assert "needs 197.4 GiB = weights " in err and " + reserve 8.0 per GPU" in err


def test_405b_two_nodes_follows_tp_inside_pp_across(capsys):
    code, out, err = run(["--model", "llama-3.1-405b", "--gpu", "h100-sxm", "--gpus", "16", "--json"], capsys)
    assert code == 0, err
    best = json.loads(out)["layouts"][0]["layout"]
    assert (best["tp"], best["pp"]) == (8, 2)


def test_departure_is_explained_with_numbers(capsys):
    # batch-1 latency over two nodes: TP16 beats TP8 x PP2 (PP does not shorten a token's path)
    code, out, err = run(
        ["--model", "llama-3.1-405b", "--gpu", "h100-sxm", "--gpus", "16", "--objective", "latency"], capsys
    )
    assert code == 0, err
    assert "departs from 'TP inside a node' because the numbers say so" in out and "tp8 pp2 dp1" in out


def test_etp_and_vpp_pin_what_they_name(capsys):
    base = ["--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--gpus", "8", "--json"]
    code, out, err = run(base + ["--etp", "2"], capsys)
    assert code == 0, err
    layouts = json.loads(out)["layouts"]
    assert layouts and all(d["layout"]["etp"] == 2 for d in layouts)
    train = ["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--train", "--global-batch", "64", "--json"]
    code, out, err = run(train + ["--pp", "4", "--vpp", "4"], capsys)
    assert code == 0, err
    layouts = json.loads(out)["layouts"]
    assert layouts and all((d["layout"]["schedule"], d["layout"]["virtual"]) == ("interleaved", 4) for d in layouts)
    # pinned, chunks may be uneven (32 layers in pp4 x vpp3 = 12 chunks of 2-3), as Megatron places
    # them: planned, and marked, since shardlm's trainer splits equal chunks only
    code, out, err = run(train + ["--pp", "4", "--vpp", "3"], capsys)
    assert code == 0, err
    layouts = json.loads(out)["layouts"]
    assert layouts and all(d["layout"]["virtual"] == 3 for d in layouts)
    assert {d["not_runnable"] for d in layouts} == {"interleaving 32 layers in pp x vpp = 12 uneven chunks"}
    # a pinned micro-batch of any size is searched, not only the sizes the search tries by itself
    small = ["--model", "smollm2-135m", "--gpu", "h100-sxm", "--gpus", "1", "--train", "--global-batch", "16", "--json"]
    code, out, err = run(small + ["--micro-batch", "16"], capsys)
    assert code == 0, err
    layouts = json.loads(out)["layouts"]
    assert layouts and all((d["layout"]["micro_batch"], d["layout"]["num_micro"]) == (16, 1) for d in layouts)
    code, _, err = run(small + ["--micro-batch", "3"], capsys)
    assert code == 2 and "--micro-batch 3 does not divide --global-batch 16" in err, err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--model", "llama-3-8b", "--etp", "2"], "--etp 2 splits experts, but llama has none; drop --etp"),
        (["--model", "llama-3-8b", "--train", "--vpp", "2", "--schedule", "1f1b"], "drop --schedule 1f1b"),
        (["--model", "llama-3-8b", "--train", "--vpp", "1"], "--vpp 1: the interleaved schedule needs 2 or more"),
        (["--model", "llama-3-8b", "--vpp", "2"], "--vpp is a training flag"),
    ],
)
def test_etp_and_vpp_refused_with_a_reason(extra, message, capsys):
    code, _, err = run(["--gpu", "h100-sxm", "--gpus", "8", *extra], capsys)
    assert code == 2 and message in err, err


def test_ulysses_is_searched_where_the_heads_split_and_costed_as_two_all_to_alls(capsys):
    """Llama-3-8B (32 query, 8 KV heads) at cp=2: ring and Ulysses both searched, and Ulysses'
    cp time is its all-to-all of q, k, v and output per layer, forward and (reversed) backward;
    SmolLM2's 3 KV heads do not split over cp=2, so it is not offered there."""
    from shardlm.plan import comm
    from shardlm.plan.layout import Layout
    from shardlm.plan.search import ulysses_fits
    from shardlm.plan.training import evaluate

    train = ["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--train", "--cp", "2", "--json"]
    cfg = load_model("llama-3-8b")[0]
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=8, gpus_per_node=8)
    wl = TrainWorkload(global_batch=8, seq_len=32768)
    found = search_training(ModelCosts(cfg), cluster, wl, objective="throughput", fixed={"cp": 2})
    assert {r.layout.cp_attention for r in found.results} == {"ring", "ulysses"}
    code, out, err = run(train + ["--global-batch", "8", "--seq-len", "32768", "--cp-attention", "ulysses"], capsys)
    assert code == 0 and {d["layout"]["cp_attention"] for d in json.loads(out)["layouts"]} == {"ulysses"}, err
    assert not ulysses_fits(load_model("smollm2-135m")[0], 1, 2) and ulysses_fits(load_model("smollm2-135m")[0], 1, 3)

    lay = Layout(tp=4, cp=2, sp=True, zero=1, micro_batch=1, num_micro=8, cp_attention="ulysses")
    ulysses, ring = (evaluate(ModelCosts(cfg), cluster, lay.with_(cp_attention=a), wl) for a in ("ulysses", "ring"))
    tokens = 32768 / 2  # a micro-batch's tokens on a cp rank; a tp rank's 8 query and 2 KV heads, bf16
    a2a = comm.all_to_all(tokens * 2 * (32 // 4 + 8 // 4) * 128 * 2, lay.slowest_group("cp", 8), cluster)
    assert ulysses.comm_s["cp"] == pytest.approx(8 * 2 * 32 * a2a, rel=1e-9)  # 8 micro-batches, fwd + bwd, 32 layers
    assert ring.comm_s["cp"] != ulysses.comm_s["cp"]


def test_inference_cp_attention_costs_a_whole_prompt_as_the_engine_attends_it(capsys):
    """Llama-3-8B at tp4 x cp2, a 4096-token prompt (one chunk: it arrives whole). `--cp-attention
    ring` costs cp - 1 = 1 hop of a rank's keys and values a layer (2 KV heads of a tp rank, not
    expanded), less the attention it hides behind, in place of pass-Q's query all-gather and partial
    outputs' all-to-all; ulysses its all-to-alls; decode steps stay pass-Q (the same TPOT)."""
    from dataclasses import replace

    from shardlm.plan import comm
    from shardlm.plan.inference import InferenceWorkload, evaluate, stage_step
    from shardlm.plan.layout import Layout

    cfg = load_model("llama-3-8b")[0]
    costs, cluster, lay = (
        ModelCosts(cfg),
        Cluster(gpu=load_gpu("h100-sxm"), num_gpus=8, gpus_per_node=8),
        Layout(tp=4, cp=2),
    )
    wl = InferenceWorkload(prompt_len=4096, output_len=64, batch=1)
    got = {a: evaluate(costs, cluster, lay, replace(wl, cp_attention=a)) for a in ("pass-q", "ring", "ulysses")}
    assert got["ring"].tpot_s == got["ulysses"].tpot_s == got["pass-q"].tpot_s
    assert got["ring"].ttft_s < got["pass-q"].ttft_s  # 32 query heads to 8 KV heads: the ring moves less
    assert len({r.ttft_s for r in got.values()}) == 3

    # 4 GPUs a node: the cp pair crosses nodes, and a hop outlasts a layer's attention
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=8, gpus_per_node=4)
    step = dict(tokens=2048, ctx=2048, decode=False, seqs=1, w_bytes=2, a_bytes=2, kv_bytes=2, dtype="bf16")
    ring, passq = (stage_step(costs, cluster, lay, 0, cp_attention=a, **step) for a in ("ring", "pass-q"))
    group = lay.slowest_group("cp", 4)
    hop = comm.send_recv(2048 * 2 * (8 // 4) * 128 * 2, group[0], group[1], cluster)  # bf16 K and V
    sampled = comm.all_reduce(cfg.hidden_size * 2, group, cluster)  # the last token's row to both cp ranks
    assert hop > ring.attention / 32
    assert ring.cp_comm == pytest.approx(32 * (hop - ring.attention / 32) + sampled, rel=1e-9)
    assert (ring.attention, ring.matmul) == (passq.attention, passq.matmul) and ring.cp_comm < passq.cp_comm

    plan = ["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gpus-per-node", "4"]
    pinned = [*plan, "--tp", "4", "--cp", "2", "--prompt-len", "4096", "--json"]
    ttft = {}
    for a in ("pass-q", "ring"):
        code, out, err = run([*pinned, "--cp-attention", a], capsys)
        assert code == 0, err
        ttft[a] = json.loads(out)["layouts"][0]["ttft_s"]
    assert ttft["ring"] < ttft["pass-q"]
    code, _, err = run([*plan, "--train", "--cp-attention", "pass-q"], capsys)
    assert code == 2 and "--cp-attention pass-q is an inference attention" in err, err


def test_layouts_shardlm_cannot_run_are_marked_with_the_reason(capsys, monkeypatch):
    """Sequence parallelism with MoE is marked, zero-bubble picks (which the trainer runs) are not;
    a pick that is marked is followed by the best layout shardlm runs (Mixtral on 16 H100s: the
    rule-following pick has SP; and a rule made up here). Latent attention under cp at inference,
    fp8 GEMMs: marked too. Without the marks the JSON has no reasons and the text no asterisks."""
    from shardlm.plan import planner

    mixtral = ["--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--gpus", "16", "--train"]
    code, out, err = run(mixtral, capsys)
    assert code == 0 and "1  tp2 pp1 dp8 ep8 sp zero1 mb1x64 *" in out, err
    assert "2  tp1 pp2 dp4 cp2 ep4 zero1 zb-h1 mb1x128 " in out  # zero-bubble runs: no mark
    assert "the best it runs is #2, tp1 pp2 dp4 cp2 ep4 zero1 zb-h1 mb1x128." in out
    code, out, err = run([*mixtral, "--tp", "2"], capsys)  # tp > 1 searches sp: every layout marked
    assert code == 0 and "1  tp2 pp1 dp8 ep8 sp zero1 mb1x64 *" in out, err
    assert "* not runnable by shardlm yet: sequence parallelism with MoE or latent-attention layers" in out
    assert (
        "The pick is not runnable by shardlm yet (sequence parallelism with MoE or latent-attention layers); none ranked runs"
        in out
    )
    train = ["--model", "llama-3-70b", "--gpu", "h100-sxm", "--gpus", "64", "--train"]
    code, out, err = run([*train, "--json"], capsys)
    assert code == 0 and not any(d["not_runnable"] for d in json.loads(out)["layouts"]), err
    monkeypatch.setattr(planner, "not_runnable", lambda cfg, lay, **_: "made up" if lay.schedule == "zb-h1" else None)
    code, out, err = run(train, capsys)
    assert code == 0 and "zb-h1 mb1x64 rc-selective *" in out, err
    assert "The pick is not runnable by shardlm yet (made up); the best it runs is #" in out
    # a pick priced with a peer's mechanism (~) names the best layout that runs as priced: not one
    # refused (*), as #2-#4 are made here
    monkeypatch.setattr(planner, "not_runnable", lambda cfg, lay, **_: "made up" if lay.pp == 2 else None)
    monkeypatch.setattr(
        planner, "not_as_modelled", lambda cfg, lay, *_, **__: "a peer's" if lay.pp == 4 and lay.tp == 2 else None
    )
    code, out, err = run(train, capsys)
    assert code == 0 and "1  tp2 pp4 dp8 sp zero2 zb-h1 mb1x64 rc-selective ~" in out, err
    assert re.search(r"^2  tp2 pp2 [^\n]* \*  ", out, re.M), out  # a pp2 layout, refused
    named = re.search(r"The pick is priced with a peer's: shardlm runs it without, slower than shown; "
                      r"the best it runs as priced is #(\d+), (tp\d+ pp\d+)", out)  # fmt: skip
    assert named and int(named[1]) > 2 and named[2] not in ("tp2 pp4", "tp2 pp2", "tp1 pp2", "tp4 pp2"), out
    monkeypatch.undo()
    code, out, err = run(["--model", "deepseek-v3", "--gpu", "h100-sxm", "--gpus", "64", "--cp", "2", "--json"], capsys)
    reasons = {d["not_runnable"] for d in json.loads(out)["layouts"]}
    assert code == 0 and reasons == {"context parallelism with latent attention (its cache is not striped yet)"}, err
    code, out, err = run(["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--dtype", "fp8"], capsys)
    assert code == 0 and "* not runnable by shardlm yet: fp8 weights and GEMMs" in out, err


def test_layouts_modelled_with_a_peers_mechanism_are_marked(capsys):
    """--zero3-reduce overlapped, --dispatcher deepep and --kernels fused price a published run's
    mechanism, which shardlm's trainer and engine lack: each layout it applies to is marked with
    the flag (ZeRO-3 layouts; MoE layouts with ep > 1, whose tokens DeepEP sends once a GPU; every training
    layout), the others are not. The mark is apart from "not runnable": shardlm runs them, slower."""

    def reasons(argv):
        code, out, err = run([*argv, "--json"], capsys)
        assert code == 0, err
        layouts = json.loads(out)["layouts"]
        assert not any(d["not_runnable"] for d in layouts)
        return [(d["layout"], d["not_as_modelled"]) for d in layouts]

    llama = ["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "16", "--train"]
    assert not any(why for _, why in reasons([*llama, "--zero", "3"]))
    marked = reasons([*llama, "--zero", "3", "--zero3-reduce", "overlapped"])
    assert marked and all("--zero3-reduce overlapped" in why for _, why in marked)
    assert all("--kernels fused" in why for _, why in reasons([*llama, "--kernels", "fused"]))
    mixtral = ["--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--gpus", "16", "--dispatcher", "deepep"]
    marked = reasons([*mixtral, "--gpus-per-node", "4", "--ep", "8"])  # every ep group across two nodes
    assert marked and all(why is not None and "--dispatcher deepep" in why for _, why in marked)
    assert not any(why for _, why in reasons([*mixtral, "--ep", "1"]))
    one_node = reasons([*mixtral[:5], "8", *mixtral[6:]])  # inside a node too: once to each GPU
    assert all((why is not None) == (lay["ep"] > 1) for lay, why in one_node), one_node
    assert any(lay["ep"] > 1 for lay, _ in one_node), one_node

    code, out, err = run([*llama, "--kernels", "fused", "--top", "3"], capsys)
    assert code == 0, err
    table = out.splitlines()
    assert sum(" ~" in line for line in table) == 3 and not any(" *" in line for line in table), out
    assert "~ runs slower in shardlm than shown, priced with fused memory-bound kernels" in out
    assert "The pick is priced with fused memory-bound kernels" in out and "none ranked runs" not in out
    assert "not runnable by shardlm yet" not in out


def test_plan_comm_prints_the_collective_model_as_nccl_tests_does(capsys):
    """Rows by op and size; bus bandwidth = algorithm bandwidth x nccl-tests' factor; inside one
    node a large all-reduce's bus bandwidth approaches the NVLink figure the model uses."""
    from shardlm.plan.hardware import load_gpu

    code, out, err = run(["comm", "--gpu", "h100-sxm", "--gpus", "8", "--max-bytes", "1G", "--json"], capsys)
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"}
    ar = [r for r in rows if r["op"] == "all_reduce"]
    assert [r["bytes"] for r in ar] == [1024 * 8**i for i in range(7)]
    assert all(a["time_us"] < b["time_us"] for a, b in itertools.pairwise(ar))
    for r in rows:
        factor = {"all_reduce": 2 * 7 / 8, "send_recv": 1.0}.get(r["op"], 7 / 8)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor)
    link = load_gpu("h100-sxm").intra.bandwidth_Bps / 1e9
    assert 0.8 * link < ar[-1]["busbw_GBps"] <= link
    code, out, err = run(["comm", "--gpu", "h100-sxm", "--gpus", "16"], capsys)
    assert code == 0 and "2 node(s) of 8" in out and "all_to_all" in out, err
    code, _, err = run(["--gpu", "h100-sxm", "--gpus", "8"], capsys)
    assert code == 2 and "--model is required for a plan" in err


def test_h800_gb200_and_gb300_are_in_the_catalog():
    """H800: the H100's compute with NVLink cut to 400 GB/s, so the same tp8 all-reduce is slower;
    GB200 NVL72: one 72-GPU NVLink domain, so a group of 72 never leaves the 'node'; GB300 NVL72:
    GB200's dense rates and domain, 288 GB a GPU and an 800 Gb/s NIC (ConnectX-8)."""
    from shardlm.plan import comm

    h100, h800, gb200 = (load_gpu(n) for n in ("h100-sxm", "h800", "gb200"))
    assert h800.matmul_flops("bf16") == h100.matmul_flops("bf16") and h800.memory_bytes == h100.memory_bytes
    eight = [Cluster(gpu=g, num_gpus=8, gpus_per_node=8) for g in (h100, h800)]
    t100, t800 = (comm.all_reduce(1 << 30, list(range(8)), c) for c in eight)
    assert t800 > 2 * t100
    rack = Cluster(gpu=gb200, num_gpus=144, gpus_per_node=gb200.gpus_per_node)
    assert gb200.gpus_per_node == 72 and rack.node_of(71) == 0 and rack.node_of(72) == 1
    gb300 = load_gpu("gb300")
    assert gb300.matmul_flops("fp8") == gb200.matmul_flops("fp8") and gb300.gpus_per_node == 72
    assert (
        gb300.memory_bytes == 288 * 2**30 > gb200.memory_bytes
        and gb300.inter.bandwidth_Bps == 2 * gb200.inter.bandwidth_Bps
    )


def test_compare_sets_a_pinned_layout_beside_the_pick_in_numbers(capsys):
    """--compare: the best layout with those pins (what pinning them finds) beside the pick, by how
    much and why (bubble, communication per group, compute, memory); the pick itself says so; one
    that cannot fit gives its memory breakdown; a bad pin is one line."""
    train = ["--model", "llama-3-70b", "--gpu", "h100-sxm", "--gpus", "64", "--train"]
    code, out, err = run([*train, "--compare", "tp8,pp8", "--json"], capsys)
    assert code == 0, err
    got = json.loads(out)
    theirs, last = got["compared"], got["explanation"][-1]
    code, out, err = run([*train, "--tp", "8", "--pp", "8", "--json"], capsys)
    pinned = json.loads(out)["layouts"][0]
    assert theirs["layout"]["label"] == pinned["layout"]["label"] and theirs["tokens_per_s"] == pinned["tokens_per_s"]
    assert last.startswith(f"Compared: {theirs['layout']['label']} (the best with tp=8,pp=8): ")
    pick = got["layouts"][0]["tokens_per_s"]
    assert f"{(theirs['tokens_per_s'] / pick - 1) * 100:+.0f}% tokens/s" in last and "tp communication" in last
    code, out, err = run(["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--compare", "tp1"], capsys)
    assert code == 0 and "Compared: tp1 pp1 dp8, the best with tp=1, is the pick itself." in out, err
    code, out, err = run(["--model", "llama-3-70b", "--gpu", "h100-sxm", "--gpus", "8", "--compare", "tp1,pp1"], capsys)
    assert code == 0 and "(the closest with tp=1,pp=1) does not fit: " in out and "weights 131" in out, err
    code, out, err = run(
        ["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--compare", "tp2,zero1"], capsys
    )
    assert code == 2 and "'zero1' is not a pin" in err and err.count("\n") == 1


def test_the_title_names_the_training_dtype_and_fp8_recipe(capsys):
    """A training plan says what it priced: its dtype, and under FP8 the recipe its casts are priced by
    (the default, delayed scaling, named too: current scaling's casts cost more)."""
    base = ["--model", "smollm2-135m", "--gpu", "b200", "--gpus", "8", "--train", "--top", "1"]
    for extra, named in (
        ([], "tokens, bf16; objective"),
        (["--dtype", "fp8"], "tokens, fp8 (--fp8-recipe delayed); objective"),
        (["--dtype", "fp8", "--fp8-recipe", "tensorwise"], "tokens, fp8 (--fp8-recipe tensorwise); objective"),
    ):
        code, out, err = run(base + extra, capsys)
        assert code == 0 and named in out.splitlines()[0], (out, err)
