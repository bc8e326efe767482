"""Serving at a load: TTFT, TPOT and throughput of one continuous-batching replica at a
concurrency (closed loop, ``vllm bench serve --max-concurrency``) or an arrival rate (open
loop, Poisson, ``--request-rate``), from the layout's step time ``t(d, p)``: one engine step
of ``d`` decoding sequences and ``p`` prompt tokens (``inference.engine_step``).

The engine (``engine/scheduler.py``: Orca's continuous batching, Yu et al. 2022; Sarathi's
chunked prefill, Agrawal et al. 2023, https://arxiv.org/abs/2308.16369) runs steps of at most
K = max_num_batched_tokens tokens: every decoding sequence feeds one token, prompts take the
rest in chunks of c = min(L, K). A request lives P = ceil(L / c) prefill steps (the last one
samples its first token) and D = O - 1 decode steps. The model is a mean field over steps:
every request at work is in every step, so a tagged request that sees o others finds each of
them prefilling with probability q = P / (P + D), i.e. M ~ Poisson(m = o q) prompt chunks
and r = o (1 - q) decodes beside it, and

    TPOT = E_M t(1 + r, M c)          TTFT = P E_M t(r, (1 + M) c) + waits
    R = TTFT + D TPOT                 X = n / R  (Little's law, n requests at work)

with t affine in chunks past the first (the first may fill compute a memory-bound decode
step leaves idle): E_M t(d, M c) = e^-m t(d, 0) + (1 - e^-m) t(d, c) + (m - 1 + e^-m) delta,
delta = t(d, 2c) - t(d, c). At o = 0 this is a lone prompt and a lone decode step.

A replica holds at most n_max = min(slots, K (P + D) / (L + D)) requests at work: every slot
taken, or every step's budget full; more requests only queue, and its capacity is
mu = n_max / R(n_max - 1). Closed loop, n = C / dp a replica: past n_max the rest wait
(n - n_max) / mu (Little's law on the queue). Open loop, lambda / dp a replica: lambda >= mu
grows the queue without bound (no finite TTFT); otherwise an arrival sees n = lambda R(n)
others (PASTA and Little), waits out the step in progress (its residual life) and, for a
place, Sakasegawa's M/G/c wait with c = n_max and deterministic service (M/D/1's exactly at
c = 1): W = P_w / (2 (mu - lambda)), P_w = rho^(sqrt(2 (c + 1)) - 1) (Sakasegawa 1977,
"An approximation formula L_q = alpha rho^beta / (1 - rho)", Ann. Inst. Stat. Math. 29).

Percentiles (TTFT only; a request's TPOT averages over its D steps): the Poisson quantile of
M, plus the wait's tail P(W > x) = P_w exp(-2 (mu - lambda) x) (M/M/c's, halved by
deterministic service). ``tests/unit/test_plan_serving.py`` holds the model to a step-by-step
simulation of the scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import NormalDist

StepTime = Callable[[float, float], float]
"""Seconds of one engine step of (decoding sequences, prompt tokens)."""


@dataclass(frozen=True, kw_only=True)
class Served:
    """A layout's serving numbers at a load (over all replicas)."""

    ttft_s: float
    """Mean time to first token (inf: the queue grows without bound)."""
    ttft_p50_s: float
    """Median time to first token."""
    ttft_p99_s: float
    """99th-percentile time to first token."""
    tpot_s: float
    """Mean time per output token after the first (0 when a request makes one token)."""
    requests_per_s: float
    """Requests completed per second."""
    output_tokens_per_s: float
    """Output tokens per second (every generated token, the first included, as vLLM counts)."""
    running: float
    """Mean requests at work per replica (prefilling or decoding)."""
    capacity_requests_per_s: float
    """The most requests per second the replicas finish (every slot or every step's budget full)."""
    saturated: bool
    """The arrival rate reaches the capacity: the queue grows without bound."""


@dataclass(frozen=True, kw_only=True)
class Replica:
    """One replica's engine: its step time and the workload's shape."""

    step: StepTime
    """t(d, p) in seconds."""
    prompt_len: int
    """L: tokens per prompt."""
    output_len: int
    """O: tokens generated per request."""
    budget: int
    """K: tokens per step (max_num_batched_tokens)."""
    slots: int
    """Sequences the replica runs at once (its batch: what fits in KV memory)."""
    lockstep: int = 1
    """Replicas that step together (attention-DP: an MoE layer's all-to-all joins every replica's
    step, ``engine/engine.py``), so a prompt chunk on any of them stretches the step of all: a step
    carries a chunk with probability 1 - exp(-lockstep x m) instead of 1 - exp(-m)."""
    prompts: bool = True
    """False: a decode replica of a disaggregated split (``disagg.py``): its requests arrive
    prefilled, so a request lives its D decode steps only and no step carries a prompt."""
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    """``at``'s answers by the others seen (the open loop's bisection asks for points again)."""

    @property
    def chunk(self) -> int:
        """c: prompt tokens a step takes of one prompt (as ``evaluate``'s lone prefill counts them)."""
        return min(self.prompt_len, self.budget)

    @property
    def prefill_steps(self) -> int:
        """P: steps a prompt's chunks take; the last one samples the first token (0: no prompts)."""
        return math.ceil(self.prompt_len / self.chunk) if self.prompts else 0

    @property
    def decode_steps(self) -> int:
        """D: steps of the tokens after the first."""
        return max(self.output_len - 1, 0)

    @property
    def n_max(self) -> float:
        """Requests at work past which more only queue: all slots, or a full budget every step."""
        p, d = self.prefill_steps, self.decode_steps
        tokens = (self.prompt_len if self.prompts else 0) + d  # a request's tokens over its p + d steps
        return max(1.0, min(float(self.slots), self.budget * (p + d) / tokens))

    def _mean_step(self, decodes: float, m: float) -> tuple[float, float]:
        """E_M t(decodes, M c) and E_M t^2 for M ~ Poisson(m) chunks, t affine past the first chunk."""
        c = self.chunk
        a, b = self.step(decodes, 0.0), self.step(decodes, c)
        delta = self.step(decodes, 2.0 * c) - b
        p0 = math.exp(-m * self.lockstep)  # no chunk on this replica, nor on one it steps with
        busy = 1.0 - p0
        extra = m - (1.0 - math.exp(-m))  # E[M] - P(M >= 1): this replica's chunks past the first
        mean = p0 * a + busy * b + extra * delta
        b_bar = b + (extra / busy if busy > 0 else 0.0) * delta  # a step with prompts, on average
        return mean, p0 * a * a + busy * b_bar * b_bar

    def at(self, others: float) -> tuple[float, float, float, float, float]:
        """(TTFT without waits, TPOT, residence R, E t, E t^2 over steps) for a request seeing ``others``."""
        if others not in self._memo:
            self._memo[others] = self._at(others)
        return self._memo[others]

    def _at(self, others: float) -> tuple[float, float, float, float, float]:
        p, d = self.prefill_steps, self.decode_steps
        q = p / (p + d)
        m, r = others * q, others * (1 - q)
        ttft = p * self._prefill_step(r, m)
        tpot, t2 = self._mean_step(1 + r, m) if d else (0.0, 0.0)
        mean_t, mean_t2 = (tpot, t2) if d else self._mean_step(r, m)
        return ttft, tpot, ttft + d * tpot, mean_t, mean_t2

    def _prefill_step(self, decodes: float, m: float) -> float:
        """E_M t(decodes, (1 + M) c): the tagged prompt's chunk and M others'."""
        c = self.chunk
        b = self.step(decodes, c)
        return b + m * (self.step(decodes, 2.0 * c) - b)

    def ttft_quantile(self, others: float, p: float) -> float:
        """TTFT (no waits) at the p-quantile of the chunks M beside the tagged prompt."""
        steps, d = self.prefill_steps, self.decode_steps
        if not steps:
            return 0.0
        m = others * steps / (steps + d)
        return steps * self._prefill_step(others - m, poisson_quantile(m, p))

    def capacity(self) -> float:
        """mu: requests per second with n_max at work."""
        n = self.n_max
        return n / self.at(n - 1)[2]


def poisson_quantile(m: float, p: float) -> int:
    """Smallest k with P(M <= k) >= p, M ~ Poisson(m) (past m = 100, the normal approximation:
    exp(-m) would underflow for large m)."""
    if m > 100:
        return max(0, math.ceil(m + NormalDist().inv_cdf(p) * math.sqrt(m) - 0.5))
    k, term = 0, math.exp(-m)
    cdf = term
    while cdf < p and k < 10_000:
        k += 1
        term *= m / k
        cdf += term
    return k


def closed_loop(rep: Replica, concurrency: float, replicas: int) -> Served:
    """``concurrency`` clients over ``replicas`` replicas, each sending its next request when the last ends."""
    n = concurrency / replicas
    n_max = rep.n_max
    at_work = min(n, n_max)
    others = max(0.0, at_work - 1)
    ttft, tpot, residence, _, _ = rep.at(others)
    x = at_work / residence  # requests per second per replica
    wait = 0.0
    if n > n_max:  # the rest queue: Little's law on the queue at the capacity
        x = rep.capacity()
        wait = (n - n_max) / x
    return Served(
        ttft_s=ttft + wait,
        ttft_p50_s=rep.ttft_quantile(others, 0.5) + wait,
        ttft_p99_s=rep.ttft_quantile(others, 0.99) + wait,
        tpot_s=tpot,
        requests_per_s=x * replicas,
        output_tokens_per_s=x * replicas * rep.output_len,
        running=at_work,
        capacity_requests_per_s=rep.capacity() * replicas,
        saturated=False,
    )


def open_loop(rep: Replica, rate: float, replicas: int) -> Served:
    """Poisson arrivals at ``rate`` requests per second over ``replicas`` replicas (split evenly)."""
    lam, mu, n_max = rate / replicas, rep.capacity(), rep.n_max
    if lam >= mu:  # the queue grows without bound: no finite TTFT
        _, tpot, _, _, _ = rep.at(n_max - 1)
        inf = math.inf
        return Served(
            ttft_s=inf,
            ttft_p50_s=inf,
            ttft_p99_s=inf,
            tpot_s=tpot,
            requests_per_s=mu * replicas,
            output_tokens_per_s=mu * replicas * rep.output_len,
            running=n_max,
            capacity_requests_per_s=mu * replicas,
            saturated=True,
        )
    lo, hi = 0.0, n_max  # n = lam R(n): R grows with n, so one crossing
    if lam * rep.at(hi)[2] <= hi:
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if lam * rep.at(mid)[2] > mid else (lo, mid)
    n = hi
    ttft, tpot, _, mean_t, mean_t2 = rep.at(n)
    residual = (1 - math.exp(-n)) * mean_t2 / (2 * mean_t) if mean_t > 0 else 0.0  # the step in progress
    rho = lam / mu
    p_wait = rho ** (math.sqrt(2 * (n_max + 1)) - 1)
    drain = 2 * (mu - lam)  # the wait's exponential tail rate (M/M/c's, halved: deterministic service)

    def wait_quantile(p: float) -> float:
        return 0.0 if p_wait <= 1 - p else math.log(p_wait / (1 - p)) / drain

    return Served(
        ttft_s=ttft + residual + p_wait / drain,
        ttft_p50_s=rep.ttft_quantile(n, 0.5) + residual + wait_quantile(0.5),
        ttft_p99_s=rep.ttft_quantile(n, 0.99) + residual + wait_quantile(0.99),
        tpot_s=tpot,
        requests_per_s=rate,
        output_tokens_per_s=rate * rep.output_len,
        running=n,
        capacity_requests_per_s=mu * replicas,
        saturated=False,
    )
