"""Serving soak: 1000 requests at 64 concurrent against `shardlm serve --dp 2 --tp 2`, with mixed
prompt (1-200 words) and answer (1-48 tokens) lengths, 10% of clients hanging up mid-stream and
5% malformed requests (shardlm/bench/soak.py). Prints what every request came to (0 lost is the
target), the statuses, the server's /metrics against the clients' counts, and the server's
resident memory and KV blocks before and after, against a warm-up of the same mix at the same
concurrency (2 x concurrency requests).

    python benchmarks/soak.py [--requests 1000] [--concurrency 64] [--dp 2] [--tp 2] [--threads 1]
                              [--kv-cache-memory 512MiB]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
import urllib.request

from shardlm.bench.soak import metric, rss_bytes, soak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-cache-memory", default="512MiB", help="per rank (default 512MiB)")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "shardlm.cli", "serve", "--port", "0", "--dp", str(args.dp), "--tp", str(args.tp)]
    # a KV cache the warm-up fills once: the cache is allocated up front but resident only as blocks
    # are first used, and freed blocks go to the back of the free list, so a large cache would
    # show as "growth" for as long as untouched blocks remain
    cmd += ["--threads", str(args.threads), "--kv-cache-memory", args.kv_cache_memory]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    url, lines = None, []
    for line in server.stderr:
        lines.append(line)
        if m := re.search(r"serving (\S+) on (http://\S+/v1)", line):
            model, url = m.group(1), m.group(2)
            break
    if url is None:
        sys.exit("the server did not start:\n" + "".join(lines))
    threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()
    ranks = [
        int(p) for p in subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
    ]
    pids = [server.pid, *ranks]
    scrape = lambda: urllib.request.urlopen(url.removesuffix("/v1") + "/metrics").read().decode()
    try:
        # warm-up: the same mix at the same concurrency, so the KV pages a full batch first touches
        # (the cache is allocated up front, resident as it is used) are part of the baseline
        soak(url, model=model, requests=2 * args.concurrency, concurrency=args.concurrency, seed=1)
        time.sleep(1)
        rss0, front0, before = rss_bytes(pids), rss_bytes([server.pid]), scrape()
        last = [0.0]

        def progress(done: int, total: int) -> None:
            if time.monotonic() - last[0] > 5 or done == total:
                last[0] = time.monotonic()
                print(f"  {done}/{total} requests", file=sys.stderr, flush=True)

        r = soak(url, model=model, requests=args.requests, concurrency=args.concurrency, progress=progress)
        time.sleep(1)
        rss1, front1, after = rss_bytes(pids), rss_bytes([server.pid]), scrape()
    finally:
        server.terminate()
        server.wait(timeout=60)
    delta = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)
    print(
        f"{args.requests} requests at {args.concurrency} concurrent in {r.seconds:.1f} s "
        f"({args.requests / r.seconds:.1f} req/s, {r.tokens / r.seconds:.0f} tok/s)"
    )
    print(f"outcomes: {dict(r.outcomes)}  lost: {r.lost}")
    print(f"statuses: {dict(r.statuses)}")
    ok = delta("shardlm_requests_total", endpoint="/v1/completions", status="200")
    print(
        f"/metrics: 200s {ok:.0f} (clients {r.statuses[200]}), "
        f"aborted {delta('shardlm_requests_finished_total', finish_reason='abort'):.0f} "
        f"(clients hung up {r.outcomes['hung_up']}), in flight {metric(after, 'shardlm_requests_in_flight'):.0f}, "
        f"KV usage {metric(after, 'shardlm_kv_cache_usage_ratio'):.3f}"
    )
    print(
        f"resident memory of server + ranks: {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB "
        f"({rss1 / rss0:.3f}x the warmed-up baseline); the HTTP process alone: "
        f"{front0 / 2**20:.0f} -> {front1 / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
