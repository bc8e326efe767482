"""Prometheus metrics of one server (its own registry: no process-wide singletons).

Counted by the server: requests by endpoint and HTTP status, finished requests by
finish reason, prompt / generated / cached-prompt tokens, and the histograms of time
to first token (TTFT), time per output token after the first (TPOT) and end-to-end
latency; generations in flight. Read from the engine at each scrape: waiting and running sequences, requests
in flight, KV blocks used and total, the prefix-cache hit rate, and health.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# seconds; fine at the low end for TPOT, up to minutes for long queues
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "shardlm_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            "shardlm_requests_finished",
            "Generations ended, by finish reason (stop, length, abort = client gone, error = engine failed)",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("shardlm_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("shardlm_generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter(
            "shardlm_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache (as reported in usage)",
            registry=r,
        )
        self.in_flight = Gauge("shardlm_requests_in_flight", "Generations in progress (queued or running)", registry=r)
        self.ttft = Histogram(
            "shardlm_time_to_first_token_seconds",
            "From request arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "shardlm_time_per_output_token_seconds",
            "Mean time between tokens after the first, per request",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "shardlm_e2e_request_latency_seconds",
            "From request arrival to its last token",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(engine))

    def observe(self, *, arrival: float, first: float | None, last: float | None, tokens: int, reason: str) -> None:
        """Record one finished generation (``tokens`` generated, times from time.perf_counter)."""
        self.finished.labels(reason).inc()
        self.generation_tokens.inc(tokens)
        if first is not None:
            self.ttft.observe(first - arrival)
            if tokens > 1 and last is not None:
                self.tpot.observe((last - first) / (tokens - 1))
        if last is not None:
            self.e2e.observe(last - arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges read from ``engine.stats`` at scrape time (the ranks' latest report)."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        e = self.engine
        s = dict(e.stats)
        yield _gauge("shardlm_requests_waiting", "Sequences queued in the schedulers, not yet running", s["waiting"])
        yield _gauge("shardlm_requests_running", "Sequences in the running batch", s["running"])
        yield _gauge("shardlm_max_queue", "Requests in flight beyond which the server answers 429", e.max_queue)
        yield _gauge("shardlm_kv_blocks_used", "KV-cache blocks held by sequences (all replicas)", s["kv_blocks_used"])
        yield _gauge("shardlm_kv_blocks_total", "KV-cache blocks (all replicas)", s["kv_blocks_total"])
        total = s["kv_blocks_total"]
        yield _gauge(
            "shardlm_kv_cache_usage_ratio",
            "kv_blocks_used / kv_blocks_total",
            s["kv_blocks_used"] / total if total else 0.0,
        )
        hits = CounterMetricFamily("shardlm_prefix_cache_hits", "Prompt tokens found in the prefix cache at admission")
        hits.add_metric([], s["prefix_cache_hits"])
        yield hits
        queries = CounterMetricFamily("shardlm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        queries.add_metric([], s["prefix_cache_queries"])
        yield queries
        q = s["prefix_cache_queries"]
        yield _gauge(
            "shardlm_prefix_cache_hit_rate",
            "prefix_cache_hits / prefix_cache_queries since start",
            s["prefix_cache_hits"] / q if q else 0.0,
        )
        for key, doc in (
            ("spec_draft_tokens", "Speculative decoding: draft tokens verified"),
            ("spec_accepted_tokens", "Speculative decoding: draft tokens accepted"),
            ("kv_handoffs", "Disaggregated serving: prompts handed from a prefill to a decode replica"),
            ("kv_transfer_bytes", "Disaggregated serving: KV-cache bytes sent to decode replicas"),
            (
                "handoffs_recomputed",
                "Disaggregated serving: handoffs a decode replica had no free blocks for, recomputed there instead",
            ),
        ):
            family = CounterMetricFamily(f"shardlm_{key}", doc)
            family.add_metric([], s[key])
            yield family
        yield _gauge("shardlm_healthy", "1 while every rank is alive, 0 once one failed", 1.0 if e.healthy else 0.0)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
