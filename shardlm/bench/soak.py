"""A serving soak: many concurrent clients against a live ``shardlm serve``, some of them rude.

``soak(url, ...)`` sends ``requests`` completions from ``concurrency`` threads (stdlib HTTP, so it
measures the server and nothing else): mixed prompt and answer lengths, half of them streamed; a
``disconnect`` share hang up after their first streamed chunk; a ``malformed`` share are requests
the server must refuse (bad JSON, a negative max_tokens, a wrong type, an unknown model, no
prompt). Every other request must come back complete. The server's /metrics must tell the same
story as the clients (requests by status, generations by finish reason), and after the run no
request is in flight and no KV block is held.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

WORDS = [
    "the",
    "model",
    "splits",
    "every",
    "weight",
    "matrix",
    "over",
    "the",
    "ranks",
    "of",
    "a",
    "group",
    "and",
    "sums",
    "the",
    "partial",
    "results",
]
MALFORMED = (
    b"{not json",
    json.dumps({"prompt": "hi", "max_tokens": -1}).encode(),
    json.dumps({"prompt": "hi", "temperature": "hot"}).encode(),
    json.dumps({"prompt": "hi", "model": "no-such-model"}).encode(),
    json.dumps({"max_tokens": 4}).encode(),
)


@dataclass
class SoakResult:
    outcomes: Counter = field(default_factory=Counter)
    """Per request: "complete", "hung_up" (this client closed mid-stream), "refused" (4xx for a
    malformed request), or "lost: ..." (anything else: a 5xx, a dropped connection, a truncated
    stream, a malformed request accepted)."""
    statuses: Counter = field(default_factory=Counter)
    """HTTP status codes the clients saw."""
    seconds: float = 0.0
    tokens: int = 0

    @property
    def lost(self) -> int:
        return sum(n for k, n in self.outcomes.items() if k.startswith("lost"))


def _request(
    i: int, rng: random.Random, model: str, disconnect: float, malformed: float, words: int, tokens: int
) -> tuple[str, bytes, bool]:
    """(kind, body, streamed) of request ``i``: a prompt of 1..words words, 1..tokens new tokens."""
    roll = rng.random()
    if roll < malformed:
        return "malformed", MALFORMED[i % len(MALFORMED)], False
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, words)))
    stream = roll < malformed + disconnect or rng.random() < 0.5
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(1, tokens), "temperature": 0, "stream": stream}
    body["ignore_eos"] = True  # the asked length, so the mix of lengths is the one drawn
    kind = "hang_up" if roll < malformed + disconnect else "normal"
    return kind, json.dumps(body).encode(), stream


def _one(url: str, kind: str, body: bytes, stream: bool, result: SoakResult, lock: threading.Lock) -> None:
    req = urllib.request.Request(f"{url}/completions", data=body, headers={"Content-Type": "application/json"})
    outcome, tokens = "lost: no answer", 0
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            status = r.status
            if kind == "malformed":
                outcome = f"lost: malformed request answered {status}"
            elif not stream:
                answer = json.loads(r.read())
                tokens = answer["usage"]["completion_tokens"]
                outcome = "complete" if answer["choices"][0].get("finish_reason") else "lost: no finish_reason"
            else:
                done = False
                for raw in r:
                    line = raw.decode().strip()
                    if kind == "hang_up" and line.startswith("data:"):
                        outcome = "hung_up"
                        break  # closing the response drops the connection mid-stream
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data:"):
                        tokens += 1  # a chunk per token
                if kind != "hang_up":
                    outcome = "complete" if done else "lost: stream ended without [DONE]"
    except urllib.error.HTTPError as e:
        status = e.code
        outcome = "refused" if kind == "malformed" and 400 <= e.code < 500 else f"lost: HTTP {e.code}"
    except (OSError, ValueError) as e:
        status = 0
        outcome = f"lost: {type(e).__name__}"
    with lock:
        result.outcomes[outcome] += 1
        result.statuses[status] += 1
        result.tokens += tokens


def soak(
    url: str,
    *,
    model: str,
    requests: int = 1000,
    concurrency: int = 64,
    disconnect: float = 0.1,
    malformed: float = 0.05,
    words: int = 200,
    tokens: int = 48,
    seed: int = 0,
    progress=None,
) -> SoakResult:
    """Run the soak against ``url`` (the server's /v1 root): prompts of 1..``words`` words, answers of
    1..``tokens`` tokens; ``progress(done, total)`` is called as requests finish."""
    rng = random.Random(seed)
    plan = [_request(i, rng, model, disconnect, malformed, words, tokens) for i in range(requests)]
    result, lock, next_i = SoakResult(), threading.Lock(), iter(range(requests))
    done = [0]

    def worker() -> None:
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            _one(url, *plan[i], result, lock)
            with lock:
                done[0] += 1
                if progress is not None:
                    progress(done[0], requests)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.seconds = time.perf_counter() - start
    return result


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample of ``name`` with these labels (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = (
        rf"^{re.escape(name)}(?:\{{{re.escape(want)}\}})? ([0-9.e+-]+)$"
        if want
        else rf"^{re.escape(name)} ([0-9.e+-]+)$"
    )
    m = re.search(pattern, text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def rss_bytes(pids: list[int]) -> int:
    """Resident memory of these processes, summed (Linux)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += sum(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
        except OSError:
            pass
    return total
