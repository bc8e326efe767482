"""Prometheus metrics of one server (its own registry: no process-wide singletons).

Counted by the server: requests by endpoint and HTTP status, finished requests by
finish reason, prompt / generated / cached-prompt tokens, and the histograms of time
to first token (TTFT), time per output token after the first (TPOT), end-to-end
latency and queue time (arrival on a replica to its first step); generations in flight.
Read from the engine at each scrape: waiting and running sequences, requests in flight,
KV blocks used and total, the prefix-cache hit rate, preemptions, and health.

Every metric vLLM also has is exported a second time under vLLM's name with its
``model_name`` label (``VLLM_NAMES``: ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:time_to_first_token_seconds``, ...), so dashboards and autoscalers built for vLLM work.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# seconds; fine at the low end for TPOT, up to minutes for long queues
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)

VLLM_NAMES = {  # shardlm's metric -> vLLM's (labels renamed: finish_reason -> finished_reason)
    "shardlm_requests_running": "vllm:num_requests_running",
    "shardlm_requests_waiting": "vllm:num_requests_waiting",
    "shardlm_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "shardlm_prefix_cache_hits": "vllm:prefix_cache_hits",
    "shardlm_prefix_cache_queries": "vllm:prefix_cache_queries",
    "shardlm_num_preemptions": "vllm:num_preemptions",
    "shardlm_prompt_tokens": "vllm:prompt_tokens",
    "shardlm_generation_tokens": "vllm:generation_tokens",
    "shardlm_requests_finished": "vllm:request_success",
    "shardlm_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "shardlm_time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "shardlm_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "shardlm_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "shardlm_spec_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "shardlm_spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


class Metrics:
    def __init__(self, engine, model_name: str = ""):
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
        self.queue = Histogram(
            "shardlm_request_queue_time_seconds",
            "From a request's arrival on its replica to its first step",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        own = _EngineCollector(engine)
        r.register(own)
        served = [self.finished, self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e, self.queue]
        r.register(_VllmNames([own, *served], model_name))

    def observe(
        self,
        *,
        arrival: float,
        first: float | None,
        last: float | None,
        tokens: int,
        reason: str,
        queue: float | None = None,
    ) -> None:
        """Record one finished generation (``tokens`` generated, times from time.perf_counter;
        ``queue``: seconds it waited on its replica)."""
        if queue is not None:
            self.queue.observe(queue)
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
            ("num_preemptions", "Running sequences sent back to the queue (blocks freed, recomputed later)"),
        ):
            family = CounterMetricFamily(f"shardlm_{key}", doc)
            family.add_metric([], s[key])
            yield family
        yield _gauge("shardlm_healthy", "1 while every rank is alive, 0 once one failed", 1.0 if e.healthy else 0.0)


class _VllmNames:
    """The metrics vLLM also has, again under vLLM's names, each sample labelled ``model_name``."""

    def __init__(self, sources: list, model_name: str):
        self.sources, self.model_name = sources, model_name

    def describe(self):
        return []

    def collect(self):
        for source in self.sources:
            for family in source.collect():
                name = VLLM_NAMES.get(family.name)
                if name is None:
                    continue
                alias = Metric(name, family.documentation, family.type)
                for s in family.samples:
                    if s.name.endswith("_created"):
                        continue
                    labels = {("finished_reason" if k == "finish_reason" else k): v for k, v in s.labels.items()}
                    alias.add_sample(
                        name + s.name[len(family.name) :], {**labels, "model_name": self.model_name}, s.value
                    )
                yield alias


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
