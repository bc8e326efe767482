"""Inference time and capacity of one layout: TTFT, TPOT and throughput.

Per stage, a step costs the roofline time of its layers (``roofline.py``) plus the collectives the
runner issues: two all-reduces of the hidden state per layer under TP (Megatron-LM §3), dispatch +
combine all-to-alls per MoE layer under EP (GShard, Lepikhin et al. 2020,
https://arxiv.org/abs/2006.16668 §2.2; ``comm.moe_boundary``, shared with training), and under CP
what the engine's striped KV cache costs (``parallel/context_paged.py``): each rank computes the
tokens it holds (1/cp of a prefill chunk, of a decode batch), attends every query of the step to
its 1/cp of the keys, all-gathers the queries and all-to-alls the float32 partial outputs to their
owners per layer, and all-reduces the sampled rows' hidden states (pass-Q); a prompt's first chunk,
which arrives whole, may instead pass its keys and values around the cp ring
(``cp_attention="ring"``: cp - 1 hops of a rank's K/V per layer, hidden behind the attention as far
as it lasts) or all-to-all q, k, v and the output (Ulysses); the vocab-parallel LM head all-gathers
logits; stages hand hidden states on with send/recv.

A replica serves a batch of B sequences as a round: prefill every prompt (in chunks of
PREFILL_CHUNK_TOKENS), then ``output_len`` decode steps; throughput is the round's output
over its length. TTFT is one prompt's prefill (continuous batching starts a request as soon
as its prefill is done, so it does not wait for the batch's other prompts). With ``pp_overlap`` (vLLM and
shardlm) the batch is cut into pp micro-batches that keep every stage busy; without it the
stages run one after another. DP multiplies throughput.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field, replace

from shardlm.plan import comm
from shardlm.plan import constants as C
from shardlm.plan.disagg import Split, served, split
from shardlm.plan.hardware import Cluster
from shardlm.plan.layout import Layout
from shardlm.plan.memory import MemoryBreakdown, inference_fixed, kv_bytes_per_seq_token
from shardlm.plan.roofline import ModelCosts, Step, Work, kv_element_bytes, layer_work
from shardlm.plan.serving import Replica, Served, closed_loop, open_loop
from shardlm.plan.shard import NOTHING_KEPT

LOGIT_BYTES = 4
"""Logits are gathered in fp32 for sampling."""


@dataclass(frozen=True, kw_only=True)
class InferenceWorkload:
    prompt_len: int
    """Tokens in each prompt."""
    output_len: int
    """Tokens generated per request."""
    batch: int | None = None
    """Sequences per replica; None lets the planner choose (throughput) or uses 1 (latency)."""
    dtype: str = "bf16"
    """Weight and activation dtype."""
    kv_dtype: str | None = None
    """KV-cache dtype (defaults to dtype)."""
    max_ttft_s: float | None = None
    """Upper limit on time to first token."""
    max_tpot_s: float | None = None
    """Upper limit on time per output token."""
    pp_overlap: bool = True
    """Engine keeps pp micro-batches in flight (True for vLLM-style engines)."""
    fused_attention: bool = True
    """Flash/paged attention; False holds a prefill chunk's float32 scores against the prompt."""
    concurrency: int | None = None
    """Serving load, closed loop: requests in flight over all replicas (``--max-concurrency``)."""
    request_rate: float | None = None
    """Serving load, open loop: Poisson arrivals, requests per second over all replicas (``--request-rate``)."""
    cp_attention: str = "pass-q"
    """Under cp, how a prompt that arrives whole (its first chunk) is attended: "pass-q", "ring" or
    "ulysses" (``shardlm generate --cp-attention``); later chunks and decode steps are pass-Q."""
    prefill_replicas: int | None = 0
    """Of the dp replicas, these only prefill and the others only decode (``--prefill-replicas``,
    ``disagg.py``); 0: every replica does both; None: searched, every split of each layout and none
    (``--prefill-replicas auto``)."""
    dispatcher: str = "shardlm"
    """How MoE tokens travel (``comm.DISPATCHERS``): shardlm's every-pair all-to-all, or DeepEP's
    token-based dispatch (once to each node, then each GPU, holding one of a token's experts)."""

    def __post_init__(self) -> None:
        comm.check_dispatcher(self.dispatcher)

    @property
    def loaded(self) -> bool:
        """A serving load is given: TTFT, TPOT and throughput come from ``serving.py``."""
        return self.concurrency is not None or self.request_rate is not None


@dataclass(kw_only=True)
class StepTime:
    """One forward step of one stage, split by cause (seconds)."""

    matmul: float = 0.0
    """Weight matmuls (roofline: weight bytes or FLOPs) and per-operator dispatch."""
    attention: float = 0.0
    """Attention core over the KV cache."""
    tp_comm: float = 0.0
    """Tensor-parallel all-reduces."""
    ep_comm: float = 0.0
    """Expert-parallel dispatch and combine."""
    cp_comm: float = 0.0
    """Context parallelism: the queries' all-gather and the partial outputs' all-to-all."""
    head: float = 0.0
    """Embedding all-reduce, LM head and the logits all-gather."""

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.tp_comm + self.ep_comm + self.cp_comm + self.head


@dataclass(kw_only=True)
class InferenceResult:
    layout: Layout
    """The layout evaluated."""
    memory: MemoryBreakdown
    """Per-GPU memory at the chosen batch (busiest rank)."""
    fits: bool
    """Whether the chosen batch fits in device memory."""
    max_batch: int
    """Sequences per replica that fit (0: the layout does not fit at all)."""
    batch: int = 0
    """Sequences per replica the numbers are for."""
    ttft_s: float = math.inf
    """Time to first token of one request (its prompt's prefill)."""
    tpot_s: float = math.inf
    """Time per output token at the chosen batch."""
    throughput: float = 0.0
    """Output tokens per second over all replicas."""
    latency_s: float = math.inf
    """TTFT + output_len x TPOT for one request of the batch."""
    decode_parts: StepTime = field(default_factory=StepTime)
    """Where one decode step's time goes (summed over stages)."""
    shortfall_bytes: float = 0.0
    """How far batch 1 is over the device memory (when it does not fit)."""
    meets_limits: bool = True
    """Within the request's TTFT/TPOT limits."""
    serving: Served | None = None
    """At the workload's load (queueing, prefills sharing steps with decodes); then TTFT, TPOT
    and throughput above are these."""
    split: Split | None = None
    """The prefill and decode pools, with ``prefill_replicas`` (then TTFT, TPOT and throughput above
    are the split's)."""


def stage_step(
    costs: ModelCosts,
    cluster: Cluster,
    lay: Layout,
    stage: int,
    *,
    tokens: float,
    ctx: float,
    decode: bool,
    seqs: float,
    w_bytes: int,
    a_bytes: int,
    kv_bytes: float,
    dtype: str,
    cp_attention: str = "pass-q",
    dispatcher: str = "shardlm",
) -> StepTime:
    cfg, gpu = costs.cfg, cluster.gpu
    n_dense, n_moe = costs.stage_kinds(lay.pp)[stage]
    out = StepTime()
    tp_group, cp_group = (lay.slowest_group(k, cluster.gpus_per_node) for k in ("tp", "cp"))
    hidden_msg = tokens * cfg.hidden_size * a_bytes
    ar = comm.all_reduce(hidden_msg, tp_group, cluster)
    moe_tokens = lay.moe_tokens(tokens)  # entering one ep group (parallel folding)
    for n, moe in ((n_dense, False), (n_moe, True)):
        if not n:
            continue
        rl = costs.rank_layer(moe, lay.tp, lay.ep, lay.etp)
        step = Step(tokens=tokens, ctx=ctx, decode=decode, seqs=seqs, moe_tokens=moe_tokens)
        work = functools.partial(
            layer_work,
            cfg,
            rl,
            w_bytes=w_bytes,
            a_bytes=a_bytes,
            kv_bytes=kv_bytes,
            ep=lay.ep,
            half_rows=gpu.half_rows(dtype),
            kept=costs.kept if w_bytes < C.BF16_BYTES else NOTHING_KEPT,
            k_half=gpu.half_k(dtype),
        )
        mm, at = work(step)
        if decode and lay.cp > 1:  # a decode token runs through the layers on its owner cp rank only
            mm, _ = work(Step(tokens=tokens / lay.cp, ctx=ctx, decode=True, seqs=seqs, moe_tokens=moe_tokens / lay.cp))
        t_attn = at.time(gpu, dtype)
        out.matmul += n * mm.time(gpu, dtype)
        out.attention += n * t_attn
        out.tp_comm += n * 2 * ar
        if moe:
            out.ep_comm += n * comm.moe_boundary(cfg, cluster, lay, tokens, a_bytes, dispatcher, gemm_bytes=w_bytes)
        if lay.cp > 1 and not decode and cp_attention == "ring":  # K/V hops, overlapped with attention
            kv = tokens * 2 * max(rl.kv_heads, 1) * cfg.head_dim * a_bytes  # this rank's tokens, heads not expanded
            out.cp_comm += n * max(0.0, (lay.cp - 1) * comm.send_recv(kv, cp_group[0], cp_group[1], cluster) - t_attn)
        elif lay.cp > 1 and not decode and cp_attention == "ulysses":  # q, k, v out, the output back
            qkvo = tokens * 2 * (rl.q_heads + max(rl.kv_heads, 1)) * cfg.head_dim * a_bytes
            out.cp_comm += n * comm.all_to_all(qkvo, cp_group, cluster)
        elif lay.cp > 1:  # the engine's pass-Q attention (parallel/context_paged.py), prefill and decode
            queries = tokens if decode else tokens * lay.cp  # the step's queries over the cp group
            gather_q = comm.all_gather(queries * rl.q_heads * cfg.head_dim * a_bytes, cp_group, cluster)
            # every rank sends each query's float32 partial output and log-sum-exp to its owner
            partials = comm.all_to_all(queries * rl.q_heads * (cfg.head_dim + 1) * 4, cp_group, cluster)
            out.cp_comm += n * (gather_q + partials)
    vocab = costs.vocab_rows(lay.tp)
    if stage == 0:  # vocab-parallel embedding: lookup + all-reduce
        out.head += ar
    if stage == lay.pp - 1:
        last = seqs if not decode else tokens  # prefill samples only each sequence's last token
        # the LM head stays 16-bit in a quantized plan (roofline.FP8_KEEPS_AT)
        head = 2 * last * vocab * cfg.hidden_size
        wide = max(w_bytes, C.BF16_BYTES)
        out.head += Work(bytes=vocab * cfg.hidden_size * wide, ops=2, wide_flops=head, gemms=1).time(gpu, dtype)
        out.head += comm.all_gather(last * cfg.vocab_size * LOGIT_BYTES, tp_group, cluster)
        if lay.cp > 1:  # the sampled rows' hidden states to every cp rank (an all-reduce of owned rows)
            out.cp_comm += comm.all_reduce(last * cfg.hidden_size * a_bytes, cp_group, cluster)
    return out


def _sum(parts: list[StepTime]) -> StepTime:
    out = StepTime()
    for p in parts:
        for k in vars(out):
            setattr(out, k, getattr(out, k) + getattr(p, k))
    return out


def boundary_time(cluster: Cluster, lay: Layout, nbytes: float) -> float:
    """Send/recv over every stage boundary, one after another."""
    pp_group = lay.slowest_group("pp", cluster.gpus_per_node)
    return sum(comm.send_recv(nbytes, a, b, cluster) for a, b in itertools.pairwise(pp_group))


def pipeline_time(
    costs, cluster, lay, wl, *, tokens, ctx, decode, seqs, bytes_, whole: bool = False
) -> tuple[float, StepTime]:
    """Time for ``seqs`` sequences to pass every stage once; and the summed per-stage parts.
    ``whole``: the step's prompts arrive whole (attended by ``wl.cp_attention``)."""
    w_bytes, a_bytes, kv_bytes = bytes_
    dtype = wl.dtype
    mb = lay.pp if (wl.pp_overlap and lay.pp > 1 and seqs >= lay.pp) else 1
    parts = [
        stage_step(
            costs,
            cluster,
            lay,
            s,
            tokens=tokens / mb,
            ctx=ctx,
            decode=decode,
            seqs=seqs / mb,
            w_bytes=w_bytes,
            a_bytes=a_bytes,
            kv_bytes=kv_bytes,
            dtype=dtype,
            cp_attention=wl.cp_attention if whole else "pass-q",
            dispatcher=wl.dispatcher,
        )
        for s in range(lay.pp)
    ]
    p2p = boundary_time(cluster, lay, tokens / mb * costs.cfg.hidden_size * a_bytes)
    if mb > 1:  # every stage works on one of mb micro-batches at a time: mb + pp - 1 slots
        total = (mb + lay.pp - 1) * max(p.total for p in parts) + p2p
        if decode:  # steady state: the next step's micro-batches follow without draining
            total = mb * max(p.total for p in parts) + p2p
    else:
        total = sum(p.total for p in parts) + p2p
    return total, _sum(parts)


def evaluate(
    costs: ModelCosts, cluster: Cluster, lay: Layout, wl: InferenceWorkload, batch: int | None = None
) -> InferenceResult:
    if wl.prefill_replicas is None:
        raise ValueError("evaluate() costs one split: prefill_replicas None (auto) is for search_inference")
    w_bytes = C.DTYPE_BYTES[wl.dtype]
    a_bytes = max(2, w_bytes)  # fp8 weights still compute in 16-bit activations
    kv_bytes = kv_element_bytes(costs.cfg, wl.kv_dtype or wl.dtype)
    bytes_ = (w_bytes, a_bytes, kv_bytes)
    cap = cluster.gpu.memory_bytes
    seq_len = wl.prompt_len + wl.output_len
    fixed = inference_fixed(
        costs,
        lay,
        cluster.reserve(False),
        prompt_len=wl.prompt_len,
        batch_hint=batch or wl.batch or 1,
        w_bytes=w_bytes,
        a_bytes=a_bytes,
        fused_attention=wl.fused_attention,
    )
    per_seq = kv_bytes_per_seq_token(costs, lay, kv_bytes) * seq_len
    free = cap - fixed.total
    max_batch = int(free // per_seq) if free > 0 else 0
    if max_batch < 1:
        mem = MemoryBreakdown(**{**vars(fixed), "kv_cache": per_seq})
        return InferenceResult(layout=lay, memory=mem, fits=False, max_batch=0, shortfall_bytes=mem.total - cap)
    b = min(batch or wl.batch or max_batch, max_batch)
    if (batch or wl.batch or 0) > max_batch:
        mem = MemoryBreakdown(**{**vars(fixed), "kv_cache": per_seq * (batch or wl.batch or 0)})
        return InferenceResult(layout=lay, memory=mem, fits=False, max_batch=max_batch, shortfall_bytes=mem.total - cap)
    # TTFT: one prompt's prefill (chunked); a round's prefill work: all b prompts
    chunk = min(C.PREFILL_CHUNK_TOKENS, wl.prompt_len)
    chunks = math.ceil(wl.prompt_len / chunk)  # a prompt's

    def prefill(step: float, whole: bool = False) -> float:
        """A prefill step of ``step`` tokens; averaged over a prompt's chunks under cp, where its first
        arrives whole (``wl.cp_attention``) and the later ones read its cache (pass-Q)."""
        t = pipeline_time(
            costs,
            cluster,
            lay,
            wl,
            tokens=step / lay.cp,
            ctx=wl.prompt_len / 2,
            decode=False,
            seqs=max(1.0, step / wl.prompt_len),
            bytes_=bytes_,
            whole=whole,
        )[0]
        if whole or lay.cp == 1 or wl.cp_attention == "pass-q":
            return t
        return (prefill(step, whole=True) + (chunks - 1) * t) / chunks

    ttft = chunks * prefill(chunk)
    round_chunk = min(C.PREFILL_CHUNK_TOKENS, b * wl.prompt_len)
    prefill_round = math.ceil(b * wl.prompt_len / round_chunk) * prefill(round_chunk)
    ctx = (wl.prompt_len + wl.output_len / 2) / lay.cp
    tpot, parts = pipeline_time(costs, cluster, lay, wl, tokens=b, ctx=ctx, decode=True, seqs=b, bytes_=bytes_)
    cycle = prefill_round + wl.output_len * tpot
    res = InferenceResult(
        layout=lay,
        memory=MemoryBreakdown(**{**vars(fixed), "kv_cache": per_seq * b}),
        fits=True,
        max_batch=max_batch,
        batch=b,
        ttft_s=ttft,
        tpot_s=tpot,
        latency_s=ttft + wl.output_len * tpot,
        throughput=lay.dp * b * wl.output_len / cycle,
        decode_parts=parts,
    )
    if wl.prefill_replicas:
        slots = int(free // (per_seq / seq_len * wl.prompt_len))
        disaggregate(res, costs, cluster, wl, bytes_, wl.prefill_replicas, prefill_slots=slots)
    elif wl.loaded:
        serve_at_load(res, costs, cluster, wl, bytes_)
    res.meets_limits = (wl.max_ttft_s is None or res.ttft_s <= wl.max_ttft_s) and (
        wl.max_tpot_s is None or res.tpot_s <= wl.max_tpot_s
    )
    return res


def engine_step(
    costs, cluster, lay: Layout, wl: InferenceWorkload, bytes_, decodes: float, prompt_tokens: float
) -> float:
    """One step of the engine's continuous batching: ``decodes`` sequences decoding a token each
    (context prompt_len + output_len / 2) and ``prompt_tokens`` prompt tokens (their chunks attend
    to half a prompt on average). Alone, each is ``evaluate``'s decode step or prefill chunk;
    together their tokens go through every weight matmul and collective in one pass, as the engine
    runs them, and the decodes add their attention over the cache."""
    if decodes <= 0 and prompt_tokens <= 0:
        return 0.0  # nothing to run: no step
    dec_ctx = (wl.prompt_len + wl.output_len / 2) / lay.cp
    dec = functools.partial(pipeline_time, costs, cluster, lay, wl, ctx=dec_ctx, decode=True, bytes_=bytes_)
    if prompt_tokens <= 0:
        return dec(tokens=decodes, seqs=decodes)[0]
    tokens = prompt_tokens + decodes
    total, _ = pipeline_time(
        costs,
        cluster,
        lay,
        wl,
        tokens=tokens / lay.cp,
        ctx=wl.prompt_len / 2 * prompt_tokens / tokens,  # the prompt rows' keys, spread over all rows
        decode=False,
        seqs=max(1.0, prompt_tokens / wl.prompt_len) + decodes,
        bytes_=bytes_,
    )
    return total + (dec(tokens=decodes, seqs=decodes)[1].attention if decodes > 0 else 0.0)


def serve_at_load(res: InferenceResult, costs, cluster, wl: InferenceWorkload, bytes_) -> None:
    """TTFT, TPOT and throughput at the workload's concurrency or arrival rate (``serving.py``),
    with ``res.batch`` sequences a replica and the engine's chunked-prefill budget."""
    lay = res.layout
    rep = Replica(
        step=functools.partial(engine_step, costs, cluster, lay, wl, bytes_),
        prompt_len=wl.prompt_len,
        output_len=wl.output_len,
        budget=C.PREFILL_CHUNK_TOKENS,
        slots=res.batch,
        lockstep=lay.dp if lay.attention_dp(costs.cfg.is_moe) else 1,
    )
    if wl.request_rate is not None:
        s = open_loop(rep, wl.request_rate, lay.dp)
    else:
        assert wl.concurrency is not None  # wl.loaded
        s = closed_loop(rep, wl.concurrency, lay.dp)
    res.serving = s
    res.ttft_s, res.tpot_s, res.throughput = s.ttft_s, s.tpot_s, s.output_tokens_per_s
    res.latency_s = s.ttft_s + wl.output_len * s.tpot_s


def disaggregate(
    res: InferenceResult, costs, cluster, wl: InferenceWorkload, bytes_, prefill_replicas: int, *, prefill_slots: int
) -> None:
    """TTFT, TPOT and throughput with ``prefill_replicas`` of the dp replicas prefilling and the
    rest decoding (``disagg.py``): at the workload's load, or without one the pools' capacities
    (the slower sets the throughput), a lone prompt's TTFT and a full decode step's TPOT."""
    lay = res.layout
    step = functools.partial(engine_step, costs, cluster, lay, wl, bytes_)
    pre = Replica(  # samples the first token, then hands the request off
        step=step, prompt_len=wl.prompt_len, output_len=1, budget=C.PREFILL_CHUNK_TOKENS, slots=max(prefill_slots, 1)
    )
    dec = replace(pre, output_len=wl.output_len, slots=res.batch, prompts=False)
    s = split(
        pre,
        dec,
        lay=lay,
        cluster=cluster,
        prefill_replicas=prefill_replicas,
        kv_bytes_per_token=kv_bytes_per_seq_token(costs, lay, bytes_[2]),
        concurrency=wl.concurrency,
        request_rate=wl.request_rate,
    )
    res.split = s
    steps = max(wl.output_len - 1, 1)
    if wl.loaded:
        res.serving = served(s, wl.output_len)
        res.ttft_s, res.tpot_s, res.throughput = res.serving.ttft_s, res.serving.tpot_s, res.serving.output_tokens_per_s
    else:
        res.ttft_s = pre.at(0)[0]
        res.tpot_s = dec.at(res.batch - 1)[1] + s.handoff_s / steps
        rps = min(s.prefill_capacity_requests_per_s, s.decode_capacity_requests_per_s)
        res.throughput = rps * wl.output_len
    res.latency_s = res.ttft_s + wl.output_len * res.tpot_s
