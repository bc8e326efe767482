"""Disaggregated prefill/decode pools, as ``shardlm serve --prefill-replicas P`` runs them
(``engine/disagg.py``; DistServe, Zhong et al. 2024, https://arxiv.org/abs/2401.09670;
Splitwise, Patel et al. 2024, https://arxiv.org/abs/2311.18677).

Of a layout's dp replicas, the first P only prefill and the other dp - P only decode; both
pools have the layout's tp x pp (one ``ParallelDims``). A request goes to a prefill replica,
which computes its prompt in chunks beside other prompts (never beside decodes) and samples
the first token, which streams at once; then each rank of the prefill replica sends its shard
of the prompt's KV blocks to the same (pp, tp) rank of a decode replica (``ReplicaLink``, an
asynchronous send: the prefill replica goes on with its next step), and the decode replica
decodes the rest in steps of decodes only. So, with the serving model (``serving.py``)
applied to each pool (its replicas split the load evenly):

    TTFT = the prefill pool's: its queueing + chunks (prompts only)
    TPOT = the decode pool's step (decodes only) + (handoff + the decode pool's wait) / (O - 1)
    handoff = alpha + bytes / link,  bytes = the busiest rank's KV of one prompt (memory.py's count)
    capacity = min(P mu_prefill, (dp - P) mu_decode)

The handoff sits between the first and the second token (the first streams before it leaves),
so it counts in TPOT as ``vllm bench serve`` counts it, (end - first token) / (O - 1). The link
is the node's (NVLink) when every prefill rank and its decode counterparts share a node, the
NIC otherwise (the slowest pair, since a request may go to any decode replica). A closed loop
of C clients splits them between the pools in proportion to the time a request spends in each
(Little's law), found by a fixed-point iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardlm.plan import comm
from shardlm.plan.errors import PlanError
from shardlm.plan.hardware import Cluster
from shardlm.plan.layout import Layout
from shardlm.plan.serving import Replica, Served, closed_loop, open_loop


@dataclass(frozen=True, kw_only=True)
class Split:
    """A layout's replicas split into a prefill and a decode pool, and what each does."""

    prefill_replicas: int
    """P: replicas that only prefill."""
    decode_replicas: int
    """dp - P: replicas that only decode."""
    handoff_bytes: float
    """KV bytes one rank sends for one request (the busiest rank's shard of the prompt's cache)."""
    handoff_s: float
    """Time of that send over the link between the pools."""
    handoff_link: str
    """"node" (inside a node: NVLink) or "nic" (a prefill rank and a decode counterpart on two nodes)."""
    prefill_capacity_requests_per_s: float
    """Requests per second the prefill pool finishes (every replica's step budget full)."""
    decode_capacity_requests_per_s: float
    """Requests per second the decode pool finishes (every slot busy)."""
    prefill: Served | None = None
    """The prefill pool at the load (None without one)."""
    decode: Served | None = None
    """The decode pool at the load; its TTFT is the wait a handed-off request has for a slot."""

    @property
    def bottleneck(self) -> str:
        return "prefill" if self.prefill_capacity_requests_per_s < self.decode_capacity_requests_per_s else "decode"


def check(prefill_replicas: int | None, dp: int, output_len: int) -> None:
    """Refuse a split the engine cannot make or that has nothing to do: no decode replica left
    (``EngineConfig``'s rule), ``dp`` being the largest the pins and GPUs allow; no token left to
    decode after the first, which the prefill replica samples. None: the split is searched (``auto``),
    which needs a layout of two replicas at least."""
    flag, n = ("auto", 1) if prefill_replicas is None else (prefill_replicas, prefill_replicas)
    if output_len < 2:
        raise PlanError(
            f"--prefill-replicas {flag} hands each request to a decode replica after its first token, and "
            f"--output-len {output_len} leaves nothing to decode: drop --prefill-replicas or raise --output-len to 2"
        )
    if not 0 < n < dp:
        lower = "drop it" if prefill_replicas is None else f"lower --prefill-replicas below {dp}"
        raise PlanError(
            f"--prefill-replicas {flag} leaves no replica to decode: a split needs dp > {n} (the {n} prefill "
            f"replica(s) and at least one decode replica), and the largest dp that --gpus and the pins allow is "
            f"{dp}; {lower}, or raise --dp / --gpus"
        )


def handoff(lay: Layout, cluster: Cluster, prefill_replicas: int, nbytes: float) -> tuple[float, str]:
    """(seconds, link) of one request's KV handoff: every rank of a prefill replica sends its
    shard to the same (pp, tp) rank of a decode replica at once; the slowest pair sets the time."""
    ranks = lay.groups("dp")  # [one row per (pp, cp, tp) position, dp]: counterparts share a row
    nodes = ranks // cluster.gpus_per_node
    crossing = np.argwhere(nodes[:, :prefill_replicas, None] != nodes[:, None, prefill_replicas:])
    across = len(crossing) > 0
    g, i, j = crossing[0] if across else (0, 0, 0)
    src, dst = int(ranks[g, i]), int(ranks[g, prefill_replicas + j])
    return comm.send_recv(nbytes, src, dst, cluster), "nic" if across else "node"


def split(
    prefill: Replica,
    decode: Replica,
    *,
    lay: Layout,
    cluster: Cluster,
    prefill_replicas: int,
    kv_bytes_per_token: float,
    concurrency: float | None = None,
    request_rate: float | None = None,
) -> Split:
    """The two pools, at a load when one is given (``prefill`` runs prompts only and samples the
    first token: output_len 1; ``decode`` has ``prompts=False``)."""
    p, d = prefill_replicas, lay.dp - prefill_replicas
    nbytes = kv_bytes_per_token * prefill.prompt_len
    h, link = handoff(lay, cluster, p, nbytes)
    pools: tuple[Served | None, Served | None] = (None, None)
    if request_rate is not None:
        pools = open_loop(prefill, request_rate, p), open_loop(decode, request_rate, d)
    elif concurrency is not None:
        pools = _closed(prefill, decode, concurrency, p, d, h)
    return Split(
        prefill_replicas=p,
        decode_replicas=d,
        handoff_bytes=nbytes,
        handoff_s=h,
        handoff_link=link,
        prefill_capacity_requests_per_s=p * prefill.capacity(),
        decode_capacity_requests_per_s=d * decode.capacity(),
        prefill=pools[0],
        decode=pools[1],
    )


def _closed(prefill: Replica, decode: Replica, clients: float, p: int, d: int, h: float) -> tuple[Served, Served]:
    """C clients between the pools: each pool holds the share of them that a request's time
    there is of its whole stay (Little's law), the handoff counted with neither."""
    steps = decode.decode_steps
    t_p, t_d = prefill.at(0)[0], steps * decode.at(0)[1]
    share = t_p / (t_p + h + t_d)
    for _ in range(60):
        sp = closed_loop(prefill, max(clients * share, 1e-9), p)
        sd = closed_loop(decode, max(clients * (1 - share), 1e-9), d)
        t_p, t_d = sp.ttft_s, sd.ttft_s + steps * sd.tpot_s
        new = t_p / (t_p + t_d) if t_p + t_d > 0 else share
        if abs(new - share) < 1e-5:
            break
        share = (share + new) / 2  # damped: each pool's time grows with its share
    return sp, sd


def served(s: Split, output_len: int) -> Served:
    """The whole split as one ``Served`` (what the report's columns show)."""
    assert s.prefill is not None and s.decode is not None
    p, dec = s.prefill, s.decode
    steps = max(output_len - 1, 1)
    tpot = dec.tpot_s + (s.handoff_s + dec.ttft_s) / steps
    saturated = p.saturated or dec.saturated
    rps = min(p.requests_per_s, dec.requests_per_s)
    inf = math.inf
    return Served(
        ttft_s=inf if saturated else p.ttft_s,
        ttft_p50_s=inf if saturated else p.ttft_p50_s,
        ttft_p99_s=inf if saturated else p.ttft_p99_s,
        tpot_s=tpot,
        requests_per_s=rps,
        output_tokens_per_s=rps * output_len,
        running=dec.running,
        capacity_requests_per_s=min(s.prefill_capacity_requests_per_s, s.decode_capacity_requests_per_s),
        saturated=saturated,
    )
