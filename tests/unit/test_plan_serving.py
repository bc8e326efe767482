"""The planner's serving model (``shardlm/plan/serving.py``): TTFT, TPOT and throughput at a
concurrency or an arrival rate, its limits, and the model against a step-by-step simulation
that drives the engine's own scheduler (``engine/scheduler.py``) in virtual time, each step
taking the planner's step time for the decodes and prompt tokens the scheduler put in it."""

from __future__ import annotations

import functools
import json
import math
import random
import statistics
from collections import deque

import pytest

from shardlm.engine.block_manager import BlockManager
from shardlm.engine.config import EngineConfig
from shardlm.engine.sampling import SamplingParams
from shardlm.engine.scheduler import Scheduler, SchedulerConfig
from shardlm.engine.sequence import Sequence
from shardlm.plan import cli
from shardlm.plan import constants as C
from shardlm.plan.catalog import load_model
from shardlm.plan.hardware import Cluster, load_gpu
from shardlm.plan.inference import InferenceWorkload, engine_step, evaluate
from shardlm.plan.layout import Layout
from shardlm.plan.roofline import ModelCosts
from shardlm.plan.serving import poisson_quantile

PROMPT, OUT = 1024, 128  # prompt and output tokens of the workload the tests serve


@functools.cache
def llama8b() -> tuple[ModelCosts, Cluster]:
    cfg, _ = load_model("llama-3-8b")
    return ModelCosts(cfg), Cluster(gpu=load_gpu("h100-sxm"), num_gpus=2, gpus_per_node=8)


def served(lay: Layout | None = None, **load):
    costs, cluster = llama8b()
    return evaluate(costs, cluster, lay or Layout(), InferenceWorkload(prompt_len=PROMPT, output_len=OUT, **load))


def simulate(res, *, concurrency: int | None = None, rate: float | None = None, requests: int, seed: int = 0) -> dict:
    """One replica of ``res`` (its batch as max_num_seqs, the engine's token budget, KV blocks for
    every slot) fed by ``concurrency`` clients or Poisson arrivals at ``rate``, in virtual time.
    Closed-loop clients start at random times over one request's life and ask for OUT/2 to 3 OUT/2
    tokens (OUT on average), so their requests drift apart as real ones do: requests of one length
    that finish in the same step come back in the same step, clumped for ever (a benchmark of
    identical requests runs in such waves). The first quarter of the requests is dropped as warm-up."""
    costs, cluster = llama8b()
    wl = InferenceWorkload(prompt_len=PROMPT, output_len=OUT)
    step = functools.cache(functools.partial(engine_step, costs, cluster, res.layout, wl, (2, 2, 2)))
    slots = res.batch
    blocks = BlockManager(slots * -(-(PROMPT + OUT) // 16), 16, prefix_caching=False)
    sched = Scheduler(blocks, SchedulerConfig(max_num_seqs=slots, max_num_batched_tokens=C.PREFILL_CHUNK_TOKENS))
    rng = random.Random(seed)
    ids = iter(range(10**9))
    life = (concurrency or 0) / res.serving.requests_per_s if concurrency else 0.0  # Little's law
    arrivals = deque(sorted(rng.uniform(0, life) for _ in range(concurrency or 0)))
    if rate is not None:
        arrivals.append(rng.expovariate(rate))
    t, times, done = 0.0, {}, []
    while len(done) < requests:
        while arrivals and arrivals[0] <= t:
            i = next(ids)
            out = OUT if rate is not None else rng.randint(OUT // 2, 3 * OUT // 2)
            seq = Sequence(i, [i % 30000 + 1] * PROMPT, SamplingParams(max_tokens=out, ignore_eos=True))
            sched.add(seq)
            times[seq.id] = [arrivals.popleft(), None]
            if rate is not None:
                arrivals.append(times[seq.id][0] + rng.expovariate(rate))
        if not sched.has_work():
            t = arrivals[0]
            continue
        batch = sched.schedule()
        decodes = sum(1 for s, n in zip(batch.seqs, batch.counts) if s.is_decoding and n == 1)
        t += step(float(decodes), float(batch.num_tokens() - decodes))
        for s, last in zip(batch.seqs, batch.samples()):
            if last and times[s.id][1] is None:
                times[s.id][1] = t
        for s in sched.update(batch, [0 if last else None for last in batch.samples()]):
            done.append((*times.pop(s.id), t, len(s.output_ids)))
            if concurrency is not None:
                arrivals.appendleft(t)
    kept = done[len(done) // 4 :]
    return {
        "ttft": statistics.mean(first - arrival for arrival, first, _, _ in kept),
        "tpot": statistics.mean((end - first) / (n - 1) for _, first, end, n in kept),
        "tokens_per_s": sum(n for *_, n in kept[1:]) / (kept[-1][2] - kept[0][2]),
    }


def test_the_planner_budget_is_the_engine_default():
    assert C.PREFILL_CHUNK_TOKENS == EngineConfig().max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens


def test_one_request_at_a_time_is_a_lone_prompt_and_a_lone_decode_step():
    lone = served(batch=1)
    for lay in (Layout(), Layout(dp=2)):  # two clients on two replicas: each alone on its own
        res = served(lay, concurrency=lay.dp)
        s = res.serving
        assert s.ttft_s == pytest.approx(lone.ttft_s, rel=1e-9) and s.ttft_p99_s == pytest.approx(lone.ttft_s)
        assert s.tpot_s == pytest.approx(lone.tpot_s, rel=1e-9)
        assert s.requests_per_s == pytest.approx(lay.dp / (lone.ttft_s + (OUT - 1) * lone.tpot_s))
        assert res.ttft_s == s.ttft_s and res.throughput == s.output_tokens_per_s == s.requests_per_s * OUT
    # a trickle of arrivals finds the replica idle: the lone prompt, within its decode steps' share
    assert served(request_rate=0.01).ttft_s == pytest.approx(lone.ttft_s, rel=0.01)


def test_a_one_token_answer_has_no_tpot_and_its_throughput_is_its_requests():
    costs, cluster = llama8b()
    for load in ({"concurrency": 4}, {"request_rate": 2.0}):
        for out in (0, 1):
            wl = InferenceWorkload(prompt_len=PROMPT, output_len=out, **load)
            s = evaluate(costs, cluster, Layout(), wl).serving
            assert s.tpot_s == 0 and s.ttft_s > 0 and s.output_tokens_per_s == pytest.approx(s.requests_per_s * out)


def test_poisson_quantile_exact_then_normal():
    for m in (0.0, 0.3, 2.5, 40.0):
        cdf = lambda k: sum(math.exp(-m) * m**i / math.factorial(i) for i in range(k + 1))
        for p in (0.5, 0.99):
            k = poisson_quantile(m, p)
            assert cdf(k) >= p and (k == 0 or cdf(k - 1) < p)
    assert abs(poisson_quantile(99.99, 0.99) - poisson_quantile(100.01, 0.99)) <= 1  # no jump where it switches
    assert poisson_quantile(5000.0, 0.99) == pytest.approx(5000 + 2.326 * 5000**0.5, abs=2)


def test_ttft_grows_with_the_rate_and_the_queue_diverges_at_capacity():
    capacity = served(request_rate=1).serving.capacity_requests_per_s
    rates = [capacity * f for f in (0.1, 0.3, 0.5, 0.7, 0.9, 0.99)]
    runs = [served(request_rate=r).serving for r in rates]
    ttfts = [s.ttft_s for s in runs]
    assert ttfts == sorted(ttfts) and ttfts[-1] > 3 * ttfts[0], ttfts
    assert all(not s.saturated and s.requests_per_s == pytest.approx(r) for s, r in zip(runs, rates))
    assert [s.tpot_s for s in runs] == sorted(s.tpot_s for s in runs)
    over = served(request_rate=capacity * 1.01)
    assert over.serving.saturated and math.isinf(over.ttft_s) and math.isinf(over.serving.ttft_p99_s)
    assert over.throughput == pytest.approx(capacity * OUT)  # what it finishes, not what is offered


def test_throughput_saturates_with_concurrency_and_the_rest_queue():
    runs = [served(concurrency=c).serving for c in (1, 4, 16, 64, 256)]
    rps = [s.requests_per_s for s in runs]
    assert rps == sorted(rps) and rps[-1] < runs[-1].capacity_requests_per_s * 1.0001
    assert rps[1] / rps[0] > 3.5  # batching is nearly free at first
    n_max = served(concurrency=10**5).serving.running
    at, over = served(concurrency=2 * math.ceil(n_max)).serving, served(concurrency=4 * math.ceil(n_max)).serving
    assert at.requests_per_s == pytest.approx(over.requests_per_s) == pytest.approx(at.capacity_requests_per_s)
    # Little's law on the queue: twice the excess clients wait (about) twice as long
    excess = 2 * math.ceil(n_max) - n_max
    assert (over.ttft_s - at.ttft_s) == pytest.approx((2 * math.ceil(n_max)) / at.requests_per_s, rel=1e-6)
    assert at.ttft_s > excess / at.requests_per_s


def test_prefill_chunks_raise_the_tpot_of_the_decodes_beside_them():
    costs, cluster = llama8b()
    wl = InferenceWorkload(prompt_len=PROMPT, output_len=OUT)
    step = functools.partial(engine_step, costs, cluster, Layout(), wl, (2, 2, 2))
    assert step(64.0, float(PROMPT)) > 2 * step(64.0, 0.0)  # a 1,024-token chunk rides in a 64-decode step
    res = served(concurrency=64)
    decodes_alone = evaluate(costs, cluster, Layout(), wl, batch=64).tpot_s
    assert res.tpot_s > 1.3 * decodes_alone, (res.tpot_s, decodes_alone)


@pytest.mark.parametrize(
    "load",
    [{"concurrency": 1}, {"concurrency": 16}, {"concurrency": 96}, {"rate": 0.3}, {"rate": 0.8}],
    ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()),
)
def test_model_matches_a_simulation_of_the_engine_scheduler(load):
    if "rate" in load:
        capacity = served(request_rate=1).serving.capacity_requests_per_s
        res = served(request_rate=load["rate"] * capacity)
        sim = simulate(res, rate=load["rate"] * capacity, requests=2500)
    else:
        res = served(concurrency=load["concurrency"])
        sim = simulate(res, concurrency=load["concurrency"], requests=max(300, 8 * load["concurrency"]))
    s = res.serving
    # deterministic (one seed); the tolerances hold the model's means to the simulation's
    assert s.tpot_s == pytest.approx(sim["tpot"], rel=0.05)
    assert s.output_tokens_per_s == pytest.approx(sim["tokens_per_s"], rel=0.05)
    assert s.ttft_s == pytest.approx(sim["ttft"], rel=0.25), (s.ttft_s, sim["ttft"])


def plan_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    base = ["--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "2"]
    if "--train" not in argv:
        base += ["--prompt-len", str(PROMPT), "--output-len", str(OUT)]
    code = cli.main(base + argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_rate_and_concurrency_in_the_table_and_json(capsys):
    code, out, err = plan_cli(["--request-rate", "5", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["workload"]["request_rate"] == 5 and data["workload"]["concurrency"] is None
    for item in data["layouts"]:
        s = item["serving"]
        assert s["requests_per_s"] == pytest.approx(5) and s["output_tokens_per_s"] == pytest.approx(5 * OUT)
        assert item["throughput_tokens_per_s"] == s["output_tokens_per_s"] and item["ttft_s"] == s["ttft_s"]
        assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"] and s["tpot_s"] > 0 and not s["saturated"]
        assert s["capacity_requests_per_s"] > 5
    code, out, err = plan_cli(["--max-concurrency", "64"], capsys)
    assert code == 0, err
    assert "64 requests in flight" in out.splitlines()[0] and "req/s" in out and "p99 TTFT" in out
    assert "slots busy per replica" in out


def test_cli_rate_over_capacity_says_the_queue_grows_without_bound(capsys):
    code, out, err = plan_cli(["--request-rate", "1000", "--top", "2"], capsys)
    assert code == 0, err
    assert "unbounded" in out and "1000 requests/s is over its capacity of" in out
    assert "the queue grows without bound (no finite TTFT)" in out
    code, out, err = plan_cli(["--request-rate", "1000", "--json"], capsys)
    first = json.loads(out)["layouts"][0]
    assert first["ttft_s"] is None and first["serving"]["ttft_s"] is None and first["serving"]["saturated"]
    # a TTFT limit no layout can meet at that rate is refused as any unmet limit is
    code, out, err = plan_cli(["--request-rate", "1000", "--max-ttft-ms", "500"], capsys)
    assert code == 2 and "meets the limits" in err


def test_cli_prompt_only_requests_plan(capsys):
    """--output-len 0 (prefill only): 0 output tokens/s is a score, not a missing one."""
    code, out, err = plan_cli(["--output-len", "0", "--max-concurrency", "8", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["layouts"][0]["throughput_tokens_per_s"] == 0


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--train", "--request-rate", "5"], "--request-rate is an inference flag"),
        (["--train", "--max-concurrency", "5"], "--max-concurrency is an inference flag"),
        (["--request-rate", "5", "--max-concurrency", "8"], "two loads: give one"),
        (["--request-rate", "0"], "--request-rate 0: must be a positive number"),
        (["--request-rate", "inf"], "must be a positive number"),
        (["--max-concurrency", "0"], "--max-concurrency 0: must be a positive integer"),
    ],
)
def test_cli_refuses_a_load_it_cannot_honour(argv, needle, capsys):
    code, _, err = plan_cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and needle in err, err
