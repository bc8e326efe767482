"""Collective costs with the alpha-beta model (Hockney 1994; formulas of Thakur,
Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in MPICH",
https://doi.org/10.1177/1094342005051521 §2-4).

A message of n bytes over a link costs ``alpha + n / B``. Groups that fit in one node use the
node's link; groups that span nodes are hierarchical (reduce-scatter inside the node,
all-reduce across nodes on 1/k of the data over each GPU's own NIC, all-gather inside;
Jia et al. 2018, https://arxiv.org/abs/1807.11205 §3.3; NCCL does the same with rings and trees).
"""

from __future__ import annotations

import collections
import functools
import math

from shardlm.models.config import ModelConfig
from shardlm.parallel.expert import experts_span_replicas
from shardlm.plan.errors import PlanError
from shardlm.plan.hardware import Cluster, Link
from shardlm.plan.layout import Layout
from shardlm.plan.roofline import node_limit


def placement(ranks: list[int], cluster: Cluster) -> tuple[int, int]:
    """(ranks per node, nodes) that a group's members occupy."""
    return _placement(tuple(ranks), cluster.gpus_per_node)


@functools.lru_cache(maxsize=65536)
def _placement(ranks: tuple[int, ...], per_node: int) -> tuple[int, int]:
    nodes = collections.Counter(r // per_node for r in ranks)  # Cluster.node_of
    return max(nodes.values()), len(nodes)


def _ring_allreduce(nbytes: float, n: int, link: Link) -> float:
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes / link.bandwidth_Bps


def _tree_allreduce(nbytes: float, n: int, link: Link) -> float:
    # reduce up and broadcast down a binary tree, pipelined (latency-optimal for small messages)
    return 2 * math.ceil(math.log2(n)) * link.alpha_s + 2 * nbytes / link.bandwidth_Bps


def _flat_allreduce(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return min(_ring_allreduce(nbytes, n, link), _tree_allreduce(nbytes, n, link))


def _flat_gather(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather / reduce-scatter of ``nbytes`` in total (each rank holds 1/n)."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * nbytes / link.bandwidth_Bps


def all_reduce(nbytes: float, ranks: list[int], cluster: Cluster) -> float:
    """All-reduce of ``nbytes`` across the group: across nodes a reduce-scatter and an all-gather
    inside each node around each GPU's 1/k shard all-reduced over its own NIC."""
    return _hierarchical(nbytes, ranks, cluster, _flat_allreduce, node_passes=2)


def all_gather(nbytes: float, ranks: list[int], cluster: Cluster) -> float:
    """All-gather (or reduce-scatter) of ``nbytes`` in total across the group: across nodes each
    GPU's 1/k over its own NIC, then gathered inside the node."""
    return _hierarchical(nbytes, ranks, cluster, _flat_gather, node_passes=1)


def _hierarchical(nbytes: float, ranks: list[int], cluster: Cluster, flat, node_passes: int) -> float:
    """A collective over the group: ``flat`` over one link where the group is inside a node or has one
    rank a node (k = 1), else ``node_passes`` gathers over the k ranks of a node and ``flat`` over the
    nodes on 1/k of the bytes."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0
    k, nodes = placement(ranks, cluster)
    g = cluster.gpu
    if nodes == 1 or k == 1:
        return g.collective_launch_s + flat(nbytes, n, g.intra if nodes == 1 else g.inter)
    return g.collective_launch_s + node_passes * _flat_gather(nbytes, k, g.intra) + flat(nbytes / k, nodes, g.inter)


reduce_scatter = all_gather


def ring_gather(nbytes: float, ranks: list[int], cluster: Cluster) -> float:
    """All-gather (or reduce-scatter) of ``nbytes`` in total as one ring over the group in rank
    order: n - 1 steps, each as slow as its slowest hop, so a group that spans nodes pays the NIC's
    latency n - 1 times and moves (n - 1) / n of the bytes at one NIC's rate (the catalog's
    ``nic_gbps`` is per GPU: one NIC each, as on a DGX). Ring is NCCL's only algorithm for these two
    collectives across nodes before 2.23's PAT, and "the latency of ring increases linearly with
    the communicator size" (NCCL maintainers, https://github.com/NVIDIA/nccl/issues/1712,
    https://github.com/NVIDIA/nccl/issues/1594). ``all_gather`` is the hierarchical form instead
    (1/k of the bytes over each of a node's k NICs, latency over k + nodes steps): what NCCL's
    rail-spread channels reach for one large message; ZeRO-3's per-layer gathers are costed here
    (training.zero3_exposed says why)."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0
    _, nodes = placement(ranks, cluster)
    g = cluster.gpu
    return g.collective_launch_s + _flat_gather(nbytes, n, g.inter if nodes > 1 else g.intra)


def all_to_all(nbytes_per_rank: float, ranks: list[int], cluster: Cluster) -> float:
    """Each rank sends ``nbytes_per_rank`` spread evenly over the group (pairwise exchange);
    the share bound for other nodes goes through the NIC while the rest uses the node link."""
    n = len(ranks)
    if n <= 1 or nbytes_per_rank <= 0:
        return 0.0
    k, nodes = placement(ranks, cluster)
    g = cluster.gpu
    intra = (k - 1) * g.intra.alpha_s + (k - 1) / n * nbytes_per_rank / g.intra.bandwidth_Bps
    inter = 0.0
    if nodes > 1:
        inter = (n - k) * g.inter.alpha_s + (n - k) / n * nbytes_per_rank / g.inter.bandwidth_Bps
    return g.collective_launch_s + max(intra, inter)


DISPATCHERS = ("shardlm", "deepep")
"""How a MoE layer's (token, choice) pairs travel. ``shardlm``: every pair is its own copy, as
shardlm's dispatcher (``parallel/expert.py``) and Megatron's all-to-all send them. ``deepep``: a token
crosses IB once to each node that holds one of its experts, whose GPU of the same in-node index
forwards it over NVLink once to each GPU holding one of them, IB and NVLink at once (DeepEP's normal
kernels, HybridEP; DeepSeek-V3, https://arxiv.org/abs/2412.19437 §3.2.2). shardlm runs only the first."""


def check_dispatcher(name: str) -> None:
    """Refuse a dispatcher the model does not know (a workload's ``dispatcher``)."""
    if name not in DISPATCHERS:
        raise PlanError(f"--dispatcher {name!r} is unknown; pick one of {', '.join(DISPATCHERS)}")


def nodes_reached(top_k: float, nodes: int, limited: float | None) -> float:
    """The nodes one token's ``top_k`` experts lie on, over an ep group of ``nodes`` nodes: under
    node-limited routing (DeepSeek-V3 §2.1.2: "each token will be sent to at most M nodes") the
    ``limited`` count of the nodes its M groups lie on (``roofline.node_limit``); otherwise the
    choices taken as spread evenly and independently, the expected number of distinct nodes,
    nodes x (1 - (1 - 1/nodes)^k)."""
    if limited is not None:
        return min(top_k, nodes, limited)
    return nodes * (1 - (1 - 1 / nodes) ** top_k)


def moe_dispatch(
    token_bytes: float,
    top_k: int,
    limited: float | None,
    ranks: list[int],
    cluster: Cluster,
    dispatcher: str = "shardlm",
) -> float:
    """One MoE all-to-all (dispatch, or combine: the same bytes back) of a rank's tokens of
    ``token_bytes`` in all, each to ``top_k`` experts spread evenly over the ``ranks`` of the ep
    group, as ``dispatcher`` (``DISPATCHERS``) sends them. shardlm's: every (token, choice) pair is
    its own copy (``all_to_all`` of top_k x token_bytes). DeepEP's (and HybridEP's) token-based
    dispatch: over the NIC, each of the ``nodes_reached`` nodes but the token's own (a share
    (nodes - 1) / nodes of them) carries one copy; over NVLink, one copy goes to each GPU that holds
    one of its experts (``gpus_reached``), but for the (1 / ranks-per-node) share that is the
    sending GPU itself. Time: the slower of the two."""
    n = len(ranks)
    if n <= 1 or token_bytes <= 0:
        return 0.0
    k, nodes = placement(ranks, cluster)
    if dispatcher == "shardlm":
        return all_to_all(token_bytes * top_k, ranks, cluster)
    g = cluster.gpu
    node_copies = nodes_reached(top_k, nodes, limited)
    inter = 0.0
    if nodes > 1:
        inter = (nodes - 1) * g.inter.alpha_s + node_copies * (nodes - 1) / nodes * token_bytes / g.inter.bandwidth_Bps
    gpu_copies = gpus_reached(top_k, node_copies, k)
    intra = (k - 1) * g.intra.alpha_s + gpu_copies * (k - 1) / k * token_bytes / g.intra.bandwidth_Bps
    return g.collective_launch_s + max(intra, inter)


def gpus_reached(top_k: int, node_copies: float, per_node: int) -> float:
    """The GPUs one token's ``top_k`` experts lie on, over the ``node_copies`` nodes it reaches with
    ``per_node`` GPUs of the group each: its choices spread evenly over those nodes, and within each,
    the expected distinct GPUs of top_k / node_copies even choices (as ``nodes_reached``)."""
    nodes = max(node_copies, 1.0)
    return nodes * nodes_reached(top_k / nodes, per_node, None)


def moe_boundary(
    cfg: ModelConfig,
    cluster: Cluster,
    lay: Layout,
    tokens: float,
    a_bytes: float,
    dispatcher: str = "shardlm",
    *,
    gemm_bytes: float | None = None,
) -> float:
    """One MoE layer's token trip (forward) on a rank holding ``tokens`` tokens of ``a_bytes``
    elements, as ``parallel/expert.py``'s all_to_all path runs it at inference and in training:
    each tp rank takes its 1/tp of the tokens, an expert's etp ranks all-gather theirs (and
    reduce-scatter the partial sums after), every (token, choice) pair goes to its expert's ep rank
    and back (dispatch and combine, ``moe_dispatch``: once a node and a GPU with DeepEP's dispatcher),
    and the tp group all-gathers its tokens again. When ep x etp divides tp the experts sit inside
    the tp group, which holds every token already: no token moves (the block's all-reduce is the
    layer's tp all-reduce). Each of these collectives' autograd dual moves the same bytes (split ->
    all-gather, all-gather -> reduce-scatter, all-to-all -> the reverse all-to-all), so a training
    backward costs this again. With DeepEP and FP8 GEMMs (``gemm_bytes`` 1) the dispatch moves FP8 and
    the combine 16-bit, each way (DeepSeek-V3 §3.3.3: the activation before the up-projections, and
    the gradient before the down-projections, quantized before their dispatch; both combines in
    BF16); the all-to-all dispatcher sends the 16-bit activations (Megatron casts to FP8 inside the
    experts' linear layers)."""
    if not experts_span_replicas(lay.tp, lay.ep, lay.etp):
        return 0.0
    per_node = cluster.gpus_per_node
    share = tokens / lay.tp * cfg.hidden_size * a_bytes  # bytes of one tp rank's tokens
    t = 0.0
    if lay.etp > 1:  # the all-gather in, the reduce-scatter out
        t += 2 * all_gather(share * lay.etp, lay.slowest_group("etp", per_node), cluster)
    if lay.ep > 1:
        limit = node_limit(cfg, lay.nodes_spanned("ep", per_node))
        ep_group = lay.slowest_group("ep", per_node)
        dispatch = share
        if dispatcher == "deepep" and gemm_bytes is not None and gemm_bytes < a_bytes:
            dispatch = share * gemm_bytes / a_bytes
        for trip in (dispatch, share):  # dispatch, combine
            t += moe_dispatch(trip * lay.etp, cfg.num_experts_per_tok, limit, ep_group, cluster, dispatcher)
    if lay.tp > 1:
        t += all_gather(share * lay.tp, lay.slowest_group("tp", per_node), cluster)
    return t


def pipelined(collective_s: float, gemm_s: float, chunks: int) -> float:
    """Exposed time of a collective pipelined with a GEMM in ``chunks`` pieces, each moved while the
    GEMM works on the one before (Megatron-LM's ``--tp-comm-overlap``: Transformer Engine's
    userbuffers split a TP layer's GEMM into tp chunks): max(c, g) + min(c, g) / chunks against the
    GEMM's g alone, one piece never hidden and the rest as far as the GEMM lasts."""
    if collective_s <= 0:
        return 0.0
    return max(0.0, collective_s - gemm_s) + min(collective_s, gemm_s) / max(chunks, 1)


def send_recv(nbytes: float, src: int, dst: int, cluster: Cluster) -> float:
    if nbytes <= 0:
        return 0.0
    link = cluster.gpu.intra if cluster.node_of(src) == cluster.node_of(dst) else cluster.gpu.inter
    return cluster.gpu.collective_launch_s + link.alpha_s + nbytes / link.bandwidth_Bps


BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}
"""nccl-tests' bus bandwidth = algorithm bandwidth (bytes / time) x this factor of the group size
(nccl-tests doc/PERFORMANCE.md), so a link's speed reads the same for every collective."""


def table(cluster: Cluster, sizes: list[int]) -> list[dict]:
    """The modelled time of each collective over all of the cluster's GPUs at each size (bytes as
    nccl-tests counts them: the all-reduce buffer, the all-gather's output, the reduce-scatter's
    input, each rank's all-to-all buffer; send/recv between the first and the last GPU), with
    nccl-tests' algorithm and bus bandwidths."""
    ranks = list(range(cluster.num_gpus))
    n = len(ranks)
    ops = {
        "all_reduce": lambda b: all_reduce(b, ranks, cluster),
        "all_gather": lambda b: all_gather(b, ranks, cluster),
        "reduce_scatter": lambda b: all_gather(b, ranks, cluster),  # the same ring, reversed
        "all_to_all": lambda b: all_to_all(b, ranks, cluster),
        "send_recv": lambda b: send_recv(b, ranks[0], ranks[-1], cluster),
    }
    out = []
    for op, cost in ops.items():
        for size in sizes:
            t = cost(size)
            alg = size / t if t > 0 else math.inf
            out.append(
                {
                    "op": op,
                    "bytes": size,
                    "time_us": t * 1e6,
                    "algbw_GBps": alg / 1e9,
                    "busbw_GBps": alg * BUS_FACTOR[op](n) / 1e9,
                }
            )
    return out
