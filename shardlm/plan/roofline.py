"""Per-layer compute and memory traffic, and their roofline time (Williams, Waterman &
Patterson 2009, "Roofline: An Insightful Visual Performance Model", CACM 52(4)).

Each piece of work is ``max(FLOPs / achievable FLOP/s + GEMM kernels x the GPU's fixed GEMM time,
bytes / achievable bytes/s)`` plus a fixed dispatch cost per operator. The two pieces of a layer that stress different limits
are timed apart: the weight matmuls (weight bytes vs 2 x tokens x params FLOPs) and the
attention core (KV-cache bytes vs 4 x tokens x context x heads x head_dim FLOPs). An MoE layer's
experts run as a grouped GEMM, each at M = its own tokens, reading only the experts some token
touches, on the most loaded ep rank (``routing_imbalance``); ``node_limit`` is how many nodes
a token's experts span under group-limited routing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, cached_property

from shardlm.models.config import ModelConfig
from shardlm.parallel.pipeline import partition_layers, stage_layers
from shardlm.plan import constants as C
from shardlm.plan.hardware import GpuSpec
from shardlm.plan.shard import (
    NOTHING_KEPT,
    Kept16,
    RankLayer,
    active_params,
    gemm_shapes,
    is_moe_layer,
    kept_16bit,
    layer_active_params,
    mixed_bytes,
    rank_layer,
    split_even,
    total_params,
)

OPS_PER_LAYER = 74
"""Tensor operators shardlm's runner issues per decoder layer per decode step (counted with a
TorchDispatchMode over SmolLM2 decode steps: 4 linears, 2 RMSNorms of 5 ops, RoPE, the paged
KV write and attention, and the views between them). On GPUs with CUDA graphs they cost
nothing (GPU_OP_OVERHEAD_S = 0); on CPU each costs the calibrated ``op_overhead_s``."""


def gemm_efficiency(rows: float, half_rows: float) -> float:
    """Share of the large-GEMM rate a GEMM with ``rows`` rows reaches: 1 for huge GEMMs, 1/2 at
    ``half_rows`` (GpuSpec.gemm_half_rows)."""
    return 1.0 if half_rows <= 0 else rows / (rows + half_rows)


FP8_KEEPS_AT = {"fp8": "bf16"}
"""FP8 runs the linear layers' GEMMs at its rate and the rest in 16-bit. Training keeps "the embedding
module, the output head, MoE gating modules, normalization operators, and attention operators" in BF16
or FP32 (DeepSeek-V3, https://arxiv.org/abs/2412.19437 §3.3.1; Transformer Engine's fp8_autocast
likewise covers its Linear layers, not the attention core); serving engines quantize linear layers
and leave the LM head 16-bit (vLLM's Fp8Config quantizes ``LinearBase`` layers, and its
``ParallelLMHead`` is an embedding; TensorRT Model Optimizer's FP8 configs disable the ``*lm_head*``
quantizer). The kept work is timed at the 16-bit rate (``Work.wide_flops``)."""


@dataclass(frozen=True)
class Work:
    flops: float = 0.0
    bytes: float = 0.0
    ops: int = 0
    wide_flops: float = 0.0
    """FLOPs that run at the 16-bit rate when the step's dtype is FP8 (``FP8_KEEPS_AT``)."""
    gemms: float = 0.0
    """GEMM kernels the FLOPs run as, each paying the GPU's fixed time (``GpuSpec.gemm_fixed_s``)."""

    def __add__(self, o: Work) -> Work:
        return Work(
            self.flops + o.flops,
            self.bytes + o.bytes,
            self.ops + o.ops,
            self.wide_flops + o.wide_flops,
            self.gemms + o.gemms,
        )

    def time(self, gpu: GpuSpec, dtype: str, rate: float | None = None) -> float:
        """Seconds on ``gpu``: the FLOPs at the GEMM rate of ``dtype`` (or at ``rate``, FLOP/s) or the
        bytes at the memory bandwidth, whichever is longer, plus the fixed costs."""
        compute = self.flops / (gpu.matmul_flops(dtype) if rate is None else rate) + self.gemms * gpu.gemm_fixed_s(
            dtype
        )
        if self.wide_flops:
            compute += self.wide_flops / gpu.matmul_flops(FP8_KEEPS_AT.get(dtype, dtype))
        return max(compute, self.bytes / gpu.mem_Bps) + self.ops * gpu.op_overhead_s


def kv_element_bytes(cfg: ModelConfig, dtype: str) -> float:
    """Bytes a KV-cache element of ``dtype`` takes on average: int8 carries a float32 scale per
    token and head (shardlm's --kv-cache-dtype int8: head_dim + 4 bytes a row; for MLA one
    scale per latent row)."""
    if dtype == "int8":
        row = cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim
        return 1 + 4 / row
    return C.DTYPE_BYTES[dtype]


def kv_bytes_per_token(cfg: ModelConfig, rl: RankLayer, kv_bytes: float) -> float:
    """KV-cache bytes one token adds to one layer on one rank: 2 x KV heads x head_dim (GQA),
    or the compressed latent plus the RoPE key (MLA, replicated on every tp rank;
    DeepSeek-V2 §2.1.2, https://arxiv.org/abs/2405.04434)."""
    if cfg.is_mla:
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * kv_bytes
    return 2 * rl.kv_heads * cfg.head_dim * kv_bytes


def attention_flops_per_query(cfg: ModelConfig, rl: RankLayer, ctx: float, decode: bool) -> float:
    """FLOPs of QK^T and PV for one query token over ``ctx`` keys, on one rank."""
    if cfg.is_mla:
        if decode:  # absorbed form: scores over latent+rope, values over the latent
            return 2 * ctx * rl.q_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        return 2 * ctx * rl.q_heads * (qk + cfg.v_head_dim)
    return 4 * ctx * rl.q_heads * cfg.head_dim


def expected_experts_touched(local: int, total: int, top_k: int, tokens: float) -> float:
    """Local experts at least one of ``tokens`` tokens is routed to, with uniform routing:
    each expert is missed by one token with probability 1 - k/E."""
    if local == 0:
        return 0.0
    return local * (1.0 - (1.0 - top_k / total) ** tokens)


@cache
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] = integral of x n phi(x) Phi(x)^(n-1) dx (midpoint
    rule over [-10, 10]); about sqrt(2 ln n) for large n, below it for every n (the Gaussian
    maximal inequality, Boucheron, Lugosi & Massart 2013, "Concentration Inequalities", §2.5): 1.42
    against 2.04 at n = 8, 2.41 against 2.88 at 64."""
    dx = 0.01
    xs = (-10 + (i + 0.5) * dx for i in range(2000))
    return sum(
        x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1) * dx
        for x in xs
    )


def busiest_pairs(tokens: float, ep: int, experts: int, top_k: int) -> float:
    """The (token, choice) pairs of ``tokens`` tokens routed over ``ep`` ranks that the most loaded
    rank computes (``routing_imbalance``): the pairs its expert GEMMs run on and whose activations
    it holds."""
    pairs = tokens * top_k
    return pairs / ep * routing_imbalance(pairs, ep, experts, top_k)


def routing_imbalance(pairs: float, groups: int, experts: int, top_k: int) -> float:
    """Expected load of the most loaded of ``groups`` expert groups (ranks, or experts when a rank
    holds one) over the mean, when ``pairs`` (token, choice) pairs are routed balanced in
    expectation (an auxiliary loss or V3's bias keeps every expert's expected share 1/E): the step
    waits for that group, so its expert GEMMs run on mean x this factor tokens.

    A group's load is a sum over tokens of the choices that land on its E/g experts (k of E
    without replacement: hypergeometric), mean mu = pairs / g and variance
    sigma^2 = mu (1 - 1/g) (E - k) / (E - 1); by the central limit theorem about normal, so the
    most loaded of g is mu + sigma E[max of g standard normals] (``expected_max_normal``), which
    tends to mu + sqrt(2 mu ln g) as g grows: for m balls in n bins, m >> n ln n, the maximum is with
    high probability m/n + sqrt(2 (m/n) ln n) (1 + o(1)) (Raab & Steger 1998, "Balls into Bins - A
    Simple and Tight Analysis", RANDOM '98, LNCS 1518). No constant is fitted: the factor -> 1 as the tokens per
    group grow, and is capped where one group takes every pair it can (each token once per
    expert: min(g, E / k)). Real routers correlate tokens (a sequence's tokens favour the same
    experts), so this is the least imbalance balanced routing leaves; no published load figure
    for the validation runs is used (the DeepSeek-V3 report and the Mixtral paper plot expert loads
    per domain of the Pile, not a step's most loaded rank)."""
    if groups <= 1 or pairs <= 0 or experts <= top_k:
        return 1.0
    mean = pairs / groups
    var = mean * (1 - 1 / groups) * (experts - top_k) / (experts - 1)
    return min(1.0 + expected_max_normal(groups) * math.sqrt(var) / mean, groups, experts / top_k)


def node_limit(cfg: ModelConfig, nodes: int) -> float | None:
    """The nodes one token's experts lie on, expected, when the experts are laid out in order over
    an ep group of ``nodes`` nodes, under group-limited routing (the top-k among the ``topk_group``
    best of ``n_group`` groups: DeepSeek-V3's node-limited routing, its 8 groups being its 8 nodes'
    experts, §2.1.2), the groups taken as chosen evenly and each reached (as the choices are in
    ``comm.nodes_reached``): with whole groups on each node, the nodes holding one of its M groups,
    n (1 - C(G - G/n, M) / C(G, M)) (M where each node holds one group; fewer where a node holds
    several); with each group over r = n / G nodes, in each of its M groups the distinct ones of those
    r its k / M choices there reach, M r (1 - (1 - 1/r)^(k/M)) (M again at r = 1). None: not limited
    (greedy top-k, or groups that do not fall on node boundaries)."""
    if cfg.topk_method != "group_limited" or cfg.n_group <= 1 or nodes <= 1:
        return None
    groups, picked = cfg.n_group, min(cfg.topk_group, cfg.n_group)
    if groups % nodes == 0:  # whole groups on each node: the nodes none of the picked groups is on
        missed = math.comb(groups - groups // nodes, picked) / math.comb(groups, picked)
        return nodes * (1 - missed)
    if nodes % groups == 0:  # each group over r = nodes / n_group nodes, k / M choices in each
        r = nodes // groups
        return picked * r * (1 - (1 - 1 / r) ** (cfg.num_experts_per_tok / picked))
    return None


@dataclass(frozen=True, kw_only=True)
class Step:
    """What one forward step asks of one layer on one rank."""

    tokens: float
    """Query tokens this rank processes (B for decode, chunk/cp for prefill)."""
    ctx: float
    """Keys each query attends to on this rank (average)."""
    decode: bool
    """Decode (one new token per sequence) rather than prefill."""
    seqs: float
    """Sequences in the step (decode reads each one's KV once)."""
    moe_tokens: float
    """Tokens entering the rank's expert-parallel group (for experts touched and routed FLOPs)."""
    scores_bytes: float = 0.0
    """Unfused attention: bytes of the score matrix each query moves per head (0: fused, flash-style)."""


def touched_params(cfg: ModelConfig, rl: RankLayer, step: Step) -> float:
    """Weights of one layer a step's matrix products use on the rank: the dense ones and the routed
    experts some token reaches (``expected_experts_touched``)."""
    touched = expected_experts_touched(rl.experts, cfg.num_experts, cfg.num_experts_per_tok, step.moe_tokens)
    return rl.attn + rl.dense + rl.router + touched * rl.expert_params


def gemm_count(cfg: ModelConfig, rl: RankLayer, step: Step) -> float:
    """GEMM kernels one pass of a layer's products launches on the rank: attention's and the dense
    MLP's (``gemm_shapes``), the router's, and each touched expert's own (a grouped GEMM on Hopper runs
    one GEMM an expert: Transformer Engine's grouped linear issues a cuBLAS call per expert across its
    streams, and shardlm's experts loop one product per expert)."""
    shapes = gemm_shapes(cfg, rl)
    count: float = len(shapes["attn"]) + len(shapes["dense"]) + (1 if rl.router else 0)
    if rl.experts:
        touched = expected_experts_touched(rl.experts, cfg.num_experts, cfg.num_experts_per_tok, step.moe_tokens)
        count += touched * len(shapes["expert"])
    return count


def k_efficiency(k: float, k_half: float) -> float:
    """Share of the large-K rate a GEMM with inner dimension ``k`` reaches: k / (k + ``k_half``)
    (``GpuSpec.gemm_half_k``, measured per GPU and dtype); 1 where ``k_half`` is 0."""
    return 1.0 if k_half <= 0 else k / (k + k_half)


@cache
def _k_slowdown(shapes: tuple[tuple[int, int], ...], k_half: float, grad: str) -> float:
    """Time of a part's products over their time at a K-independent rate: each weighted by its
    FLOPs (K x N); the forward's inner dimension is K, the input gradient's N. Cached: a search asks
    for the same few parts at every layout."""
    if k_half <= 0 or not shapes:
        return 1.0
    inner = (lambda kn: kn[1]) if grad == "input" else (lambda kn: kn[0])
    return sum(k * n / k_efficiency(inner((k, n)), k_half) for k, n in shapes) / sum(k * n for k, n in shapes)


def _products(
    cfg: ModelConfig,
    rl: RankLayer,
    step: Step,
    *,
    ep: int,
    half_rows: float,
    kept: Kept16,
    k_half: float,
    grads: tuple[str, ...],
) -> list[tuple[float, float]]:
    """(FLOPs at the step's rate, FLOPs at the 16-bit rate) of one layer's products on the largest
    rank, in large-GEMM-equivalent FLOPs, for each pass in ``grads``: "" the forward (inner dimension
    each product's K), "input" the input gradients (its N), "weight" the weight gradients (the tokens).
    The token dimension slows small GEMMs by ``half_rows``, the inner one by ``k_half``
    (``k_efficiency``, the GPU's measured curve); an MoE layer's experts each run at their own tokens,
    on the most loaded ep rank (``routing_imbalance``); ``kept`` is timed at the 16-bit rate without
    the K term."""
    shapes = gemm_shapes(cfg, rl)
    eff = gemm_efficiency(step.tokens, half_rows)
    routed = per_expert = 0.0
    if rl.experts:
        k = cfg.num_experts_per_tok
        touched = expected_experts_touched(rl.experts, cfg.num_experts, k, step.moe_tokens)
        # (token, choice) pairs the most loaded ep rank's experts take: a grouped GEMM, each local
        # expert at M = its own tokens (weight-bandwidth bound at small M: ``touched`` experts' bytes)
        routed = busiest_pairs(step.moe_tokens, ep, cfg.num_experts, k)
        per_expert = routed / max(touched, 1e-9)
    wide = 2 * step.tokens * (rl.attn * kept.attention + (rl.dense + rl.router) * kept.mlp) / eff
    if routed:
        wide += 2 * routed * rl.expert_params * kept.mlp / gemm_efficiency(per_expert, half_rows)
    out = []
    for grad in grads:

        def rate(tokens: float, part: str) -> float:  # a FLOP's time over its large-GEMM time
            if grad == "weight" and k_half > 0:  # the tokens are the inner dimension
                return 1 / k_efficiency(tokens, k_half)
            return _k_slowdown(shapes[part], k_half, grad) / gemm_efficiency(tokens, half_rows)

        narrow = rl.attn * (1 - kept.attention) * rate(step.tokens, "attn")
        narrow += rl.dense * (1 - kept.mlp) * rate(step.tokens, "dense") + rl.router * (1 - kept.mlp) / eff
        flops = 2 * step.tokens * narrow
        if routed:
            flops += 2 * routed * rl.expert_params * (1 - kept.mlp) * rate(per_expert, "expert")
        out.append((flops, wide))
    return out


def backward_products(
    cfg: ModelConfig, rl: RankLayer, step: Step, *, ep: int, half_rows: float, k_half: float = 0.0
) -> tuple[float, float]:
    """FLOPs of one layer's input-gradient and weight-gradient products on the largest rank, each
    timed at its own inner dimension (``_products``)."""
    (dgrad, _), (wgrad, _) = _products(
        cfg, rl, step, ep=ep, half_rows=half_rows, kept=NOTHING_KEPT, k_half=k_half, grads=("input", "weight")
    )
    return dgrad, wgrad


def layer_work(
    cfg: ModelConfig,
    rl: RankLayer,
    step: Step,
    *,
    w_bytes: int,
    a_bytes: int,
    kv_bytes: float,
    ep: int,
    half_rows: float,
    kept: Kept16 = NOTHING_KEPT,
    k_half: float = 0.0,
) -> tuple[Work, Work]:
    """(matmul work, attention-core work) of one layer's forward on the largest rank: the products'
    FLOPs as ``_products`` charges them, the weights they read (``kept``: the shares of attention and
    MLP a quantized checkpoint keeps 16-bit, their bytes at 2, averaged over the layers)."""
    h = cfg.hidden_size
    wide = max(w_bytes, C.BF16_BYTES)
    ((flops, wide_flops),) = _products(cfg, rl, step, ep=ep, half_rows=half_rows, kept=kept, k_half=k_half, grads=("",))
    attn_p, mlp_p = rl.attn, rl.dense + rl.router
    expert_p = touched_params(cfg, rl, step) - attn_p - mlp_p
    wbytes = attn_p * mixed_bytes(w_bytes, wide, kept.attention) + (mlp_p + expert_p) * mixed_bytes(
        w_bytes, wide, kept.mlp
    )
    act = step.tokens * h * a_bytes * 8  # residual stream in/out of the ~8 elementwise ops
    matmul = Work(
        flops=flops, bytes=wbytes + act, ops=OPS_PER_LAYER - 1, wide_flops=wide_flops, gemms=gemm_count(cfg, rl, step)
    )
    per_tok = kv_bytes_per_token(cfg, rl, kv_bytes)
    kv_read = (step.seqs * step.ctx if step.decode else step.tokens) * per_tok
    kv_write = step.tokens * per_tok
    attn = Work(
        flops=step.tokens * attention_flops_per_query(cfg, rl, step.ctx, step.decode),
        bytes=kv_read + kv_write + step.tokens * rl.q_heads * step.scores_bytes,
        ops=1,
    )
    return matmul, attn


class ModelCosts:
    """Caches the rank shares of a model per (tp, ep, etp) so the search stays fast."""

    def __init__(self, cfg: ModelConfig, mtp: int = 0):
        self.cfg = cfg
        self.mtp = mtp
        """Multi-token-prediction modules trained after the model (``TrainWorkload.mtp``), on the last
        stage: each one decoder layer of the last layer's kind (``stage_kinds``), a projection of the
        two hidden states it joins and the LM head again."""
        self._rl: dict[tuple, RankLayer] = {}
        self._stages: dict[int, list[tuple[int, int]]] = {}
        self._with_mtp: dict[int, ModelCosts] = {}

    def with_mtp(self, mtp: int) -> ModelCosts:
        """These costs with ``mtp`` multi-token-prediction modules (self where it already has them)."""
        if mtp == self.mtp:
            return self
        if mtp not in self._with_mtp:
            self._with_mtp[mtp] = ModelCosts(self.cfg, mtp)
        return self._with_mtp[mtp]

    def rank_layer(self, moe: bool, tp: int, ep: int = 1, etp: int = 1) -> RankLayer:
        key = (moe, tp, ep, etp)
        if key not in self._rl:  # any layer of the kind: layers of one kind are alike
            layer = self.cfg.num_layers - 1 if moe else 0
            self._rl[key] = rank_layer(self.cfg, layer, tp=tp, ep=ep, etp=etp)
        return self._rl[key]

    def stage_kinds(self, pp: int) -> list[tuple[int, int]]:
        """(dense layers, MoE layers) per pipeline stage, split as shardlm's engine splits them
        (``stage_layers``); with multi-token-prediction modules (``mtp``: each a layer of the last
        layer's kind, as DeepSeek-V3's) on the last stage, split to balance each stage's products a
        token with the LM head and the modules on the last (``_mtp_split``), as the runs that train
        them lay their pipelines out (Megatron-Core's ``--pipeline-model-parallel-layout``)."""
        if pp not in self._stages:
            out = []
            for layers in self._mtp_split(pp) if self.mtp else stage_layers(self.cfg, pp):
                moe = sum(1 for i in layers if is_moe_layer(self.cfg, i))
                out.append((len(layers) - moe, moe))
            dense, moe = out[-1]
            last_moe = is_moe_layer(self.cfg, self.cfg.num_layers - 1)
            out[-1] = (dense + (0 if last_moe else self.mtp), moe + (self.mtp if last_moe else 0))
            self._stages[pp] = out
        return self._stages[pp]

    def _mtp_split(self, pp: int) -> list[range]:
        """The layers of each stage balancing each one's products a token (a layer's attention, dense
        MLP, router and top-k experts; the LM head's; each multi-token-prediction module's layer,
        projection of 2h to h and LM head) with the head and the modules on the last stage."""
        cfg = self.cfg
        head = cfg.vocab_size * cfg.hidden_size
        module = layer_active_params(cfg, cfg.num_layers - 1) + 2 * cfg.hidden_size**2 + head
        work = [float(layer_active_params(cfg, i)) for i in range(cfg.num_layers)]
        counts = [len(r) for r in partition_layers(work, pp, last_extra=head + self.mtp * module)]
        # where stages before the last differ by a layer, the later ones take it: they hold fewer
        # micro-batches in flight (the layers' products are alike, so the costliest stage is the same)
        counts[:-1] = sorted(counts[:-1])
        starts = [sum(counts[:s]) for s in range(pp)]
        return [range(a, a + n) for a, n in zip(starts, counts)]

    @cached_property
    def kept(self) -> Kept16:
        """What a quantized plan keeps 16-bit (``shard.kept_16bit``: the config's quantization_config)."""
        return kept_16bit(self.cfg)

    @cached_property
    def active_params(self) -> int:
        return active_params(self.cfg)

    @cached_property
    def total_params(self) -> int:
        return total_params(self.cfg)

    def vocab_rows(self, tp: int) -> int:
        return split_even(self.cfg.vocab_size, tp)[0]
