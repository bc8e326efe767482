"""Attention-DP in the planner (SGLang's --enable-dp-attention; shardlm's engine runs it as dp
replicas whose MoE experts span them, stepping in lockstep, ``engine/engine.py``): each rank's KV
cache holds its own sequences only, the MoE boundary moves tokens, the replicas' steps are joined,
and ``--attention-dp`` pins it."""

from __future__ import annotations

import functools
import math

import pytest

from shardlm.plan import cli
from shardlm.plan.catalog import load_model
from shardlm.plan.comm import moe_boundary
from shardlm.plan.hardware import Cluster, load_gpu
from shardlm.plan.inference import InferenceWorkload, evaluate
from shardlm.plan.layout import Layout
from shardlm.plan.memory import kv_bytes_per_seq_token
from shardlm.plan.roofline import ModelCosts
from shardlm.plan.runnable import not_runnable
from shardlm.plan.serving import Replica

WL = InferenceWorkload(prompt_len=1024, output_len=256, dtype="fp8")  # 671B in fp8 fits 8 x H200
TP8, ADP = Layout(tp=8, ep=8), Layout(dp=8, ep=8)


@functools.cache
def deepseek() -> tuple[ModelCosts, Cluster]:
    return ModelCosts(load_model("deepseek-v3")[0]), Cluster(gpu=load_gpu("h200"), num_gpus=8, gpus_per_node=8)


def test_deepseek_v3_kv_per_gpu_attention_dp_vs_tp8():
    """MLA's cache is one latent head (512 + 64 values a token and layer), which tp cannot split: at
    tp8 every rank holds every sequence's latent cache; with attention-DP a rank holds its own
    sequences' only. Same per-token bytes on a rank, 8x fewer sequences on it for the same load."""
    costs, cluster = deepseek()
    per_token = (512 + 64) * 61  # fp8: one byte a value, 61 layers
    assert kv_bytes_per_seq_token(costs, TP8, 1) == kv_bytes_per_seq_token(costs, ADP, 1) == per_token
    seqs = 800  # in flight over the 8 GPUs
    tp8 = evaluate(costs, cluster, TP8, WL, batch=seqs)
    adp = evaluate(costs, cluster, ADP, WL, batch=seqs // 8)  # 100 a replica
    assert tp8.memory.kv_cache == pytest.approx(seqs * 1280 * per_token)
    assert tp8.memory.kv_cache == pytest.approx(8 * adp.memory.kv_cache)
    # what the 8 GPUs hold at most: attention-DP's replicated attention weights cost it less than its KV gains
    most_tp8, most_adp = evaluate(costs, cluster, TP8, WL).max_batch, 8 * evaluate(costs, cluster, ADP, WL).max_batch
    assert most_adp > 5 * most_tp8, (most_adp, most_tp8)


def test_the_moe_boundary_moves_tokens_only_when_the_experts_span_replicas():
    """tp8 x ep8: the experts sit inside the tp group, which holds every token (the engine's
    replicated dispatch): no all-to-all. dp8 x ep8: dispatch and combine all-to-alls of the
    replica's tokens; dp8 x etp8: an all-gather in and a reduce-scatter out over the etp group."""
    costs, cluster = deepseek()
    cfg = costs.cfg
    tp8, adp = evaluate(costs, cluster, TP8, WL, batch=64), evaluate(costs, cluster, ADP, WL, batch=64)
    assert tp8.decode_parts.ep_comm == 0
    n_moe = cfg.num_layers - cfg.first_k_dense
    assert adp.decode_parts.ep_comm == pytest.approx(n_moe * moe_boundary(cfg, cluster, ADP, 64, 2))
    assert adp.decode_parts.ep_comm > 0 and moe_boundary(cfg, cluster, Layout(dp=8, etp=8), 64, 2) > 0


def test_lockstep_replicas_share_each_others_prompt_chunks():
    """A step of replicas in lockstep carries a prompt chunk if any of them has one: with chunks
    arriving at m a replica, P(chunk) = 1 - exp(-g m) for g replicas, not 1 - exp(-m)."""

    def step(decodes: float, prompt: float) -> float:
        return 1.0 + prompt / 100

    alone = Replica(step=step, prompt_len=100, output_len=101, budget=1000, slots=64)
    joined = Replica(step=step, prompt_len=100, output_len=101, budget=1000, slots=64, lockstep=8)
    m = 0.05
    assert alone._mean_step(1, m)[0] == pytest.approx(1 + (1 - math.exp(-m)) + (m - 1 + math.exp(-m)))
    assert joined._mean_step(1, m)[0] == pytest.approx(1 + (1 - math.exp(-8 * m)) + (m - 1 + math.exp(-m)))
    # at a load, attention-DP's TPOT carries its neighbours' prompts
    costs, cluster = deepseek()
    loaded = InferenceWorkload(prompt_len=4096, output_len=256, dtype="fp8", concurrency=64)
    adp = evaluate(costs, cluster, ADP, loaded)
    assert adp.tpot_s > evaluate(costs, cluster, ADP, InferenceWorkload(**{**vars(loaded), "concurrency": 8})).tpot_s


def test_attention_dp_runs_in_shardlm_and_is_marked_where_it_does_not():
    cfg = deepseek()[0].cfg
    assert ADP.attention_dp(True) and not TP8.attention_dp(True) and not ADP.attention_dp(False)
    assert not_runnable(cfg, ADP, train=False, dtype="bf16") is None  # engine.py: DP attention in lockstep
    assert "lockstep" in not_runnable(cfg, ADP, train=False, dtype="bf16", prefill_replicas=1)


def run(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_flag_pins_it_and_is_refused_where_it_means_nothing(capsys):
    base = ["--model", "deepseek-v3", "--gpu", "h200", "--gpus", "8", "--dtype", "fp8", "--json", "--top", "50"]
    import json

    for on, want in (("on", True), ("off", False)):
        code, out, _ = run([*base, "--attention-dp", on], capsys)
        layouts = json.loads(out)["layouts"]
        assert code == 0 and layouts and all(d["attention_dp"] is want for d in layouts)
    code, out, _ = run(base[:-3], capsys)
    assert "Attention-DP (#1" in out
    code, _, err = run(["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--attention-dp", "on"], capsys)
    assert code == 2 and "llama has no experts: drop --attention-dp" in err
    code, _, err = run([*base[:8], "--train", "--attention-dp", "on"], capsys)
    assert code == 2 and "--attention-dp is an inference flag" in err
