"""A shortened serving soak (benchmarks/soak.py runs the full 1000 x 64): dp2 x tp2 under mixed,
partly rude load loses no request, refuses every malformed one with a 4xx, and its /metrics,
memory and KV cache come back to where they were."""

from __future__ import annotations

import re
import time

import pytest

from harness.server_harness import ServerProcess, get
from shardlm.bench.soak import metric, rss_bytes, soak


@pytest.mark.slow
def test_soak_loses_nothing_and_returns_to_baseline():
    server = ServerProcess("--dp", "2", "--tp", "2", "--threads", "1", "--kv-cache-memory", "128MiB")
    try:
        model = re.search(r"serving (\S+) on", server.log).group(1)
        pids = [server.proc.pid, *server.ranks]
        mix = dict(model=model, requests=64, concurrency=16, disconnect=0.1, malformed=0.05, words=40, tokens=16)
        soak(server.url, **mix, seed=1)  # warm-up: the same mix, so first-touched KV pages count as baseline
        time.sleep(1)
        rss0, before = rss_bytes(pids), get(f"{server.root}/metrics")[1]
        r = soak(server.url, **mix)
        time.sleep(1)
        rss1, after = rss_bytes(pids), get(f"{server.root}/metrics")[1]
    finally:
        server.kill()
    assert r.lost == 0, r.outcomes
    assert r.outcomes["refused"] > 0 and r.outcomes["hung_up"] > 0 and r.outcomes["complete"] > 45, r.outcomes
    delta = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)
    assert delta("shardlm_requests_total", endpoint="/v1/completions", status="200") == r.statuses[200]
    refused = sum(n for s, n in r.statuses.items() if 400 <= s < 500)
    assert refused == r.outcomes["refused"]
    finished = sum(delta("shardlm_requests_finished_total", finish_reason=f) for f in ("stop", "length", "abort"))
    assert finished == r.statuses[200]  # every accepted generation ended, and once
    assert delta("shardlm_requests_finished_total", finish_reason="abort") <= r.outcomes["hung_up"]
    assert metric(after, "shardlm_requests_in_flight") == 0 and metric(after, "shardlm_kv_cache_usage_ratio") == 0
    assert rss1 < 1.1 * rss0, (rss0, rss1)  # no growth with the requests served (measured: see benchmarks/soak.py)
