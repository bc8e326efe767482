"""Per-GPU memory of a layout, broken down the way the report prints it.

Inference: weights of the largest rank, the KV cache of the batch, the prefill working set,
communication buffers, and a reserve. Training: ZeRO model states (``zero.py``), activations
of the in-flight micro-batches (``activations.py``), buffers and the reserve.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from shardlm.plan import constants as C
from shardlm.plan.activations import LayerShape, in_flight_microbatches, largest_chunk, layer_activation_bytes
from shardlm.plan.hardware import GIB, gib
from shardlm.plan.layout import Layout
from shardlm.plan.roofline import FP8_KEEPS_AT, ModelCosts, busiest_pairs, kv_bytes_per_token
from shardlm.plan.shard import NOTHING_KEPT, RankLayer, mixed_bytes
from shardlm.plan.zero import GRAD_BYTES, PARAM_BYTES, REDUCED_GRAD_BYTES, ModelStates, model_states

FIELDS = ("weights", "kv_cache", "activations", "gradients", "optimizer", "comm_buffers", "reserve")


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    weights: float = 0.0
    """Parameters held by the rank (bytes)."""
    kv_cache: float = 0.0
    """KV cache of the batch (inference)."""
    activations: float = 0.0
    """Stored activations (training) or the prefill working set (inference)."""
    gradients: float = 0.0
    optimizer: float = 0.0
    comm_buffers: float = 0.0
    """Collective send/receive buffers (NCCL, DDP buckets, ZeRO-3 prefetch)."""
    reserve: float = 0.0
    """CUDA context, allocator slack, workspaces: ``--memory-reserve`` (``Cluster.reserve``)."""

    @property
    def total(self) -> float:
        return sum(getattr(self, f) for f in FIELDS)

    def describe(self) -> str:
        """ "197.4 GiB = weights 176.4 + activations 1.2 + ... + reserve 8.0": every nonzero part."""
        parts = " + ".join(f"{f.replace('_', ' ')} {getattr(self, f) / GIB:,.1f}" for f in FIELDS if getattr(self, f))
        return f"{gib(self.total)} = {parts}"

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["total"] = self.total
        return d


# ---- inference ------------------------------------------------------------------------------


def weight_bytes(costs: ModelCosts, lay: Layout, w_bytes: int, quantized: bool = False) -> float:
    """Weights on the largest rank of the largest stage (``stage_weight_bytes``)."""
    return max(stage_weight_bytes(costs, lay, w_bytes, quantized))


def stage_weight_bytes(costs: ModelCosts, lay: Layout, w_bytes: int, quantized: bool = False) -> list[float]:
    """Weights on the largest rank of each stage. ``quantized``: ``w_bytes`` is a quantized
    checkpoint's linear layers' width; the embedding and LM head stay 16-bit (``roofline.FP8_KEEPS_AT``)
    and so do the modules its quantization_config keeps (``costs.kept``, averaged over the layers)."""
    cfg = costs.cfg
    wide = max(w_bytes, C.BF16_BYTES) if quantized else w_bytes
    kept = costs.kept if quantized else NOTHING_KEPT
    embed = costs.vocab_rows(lay.tp) * cfg.hidden_size * wide

    def layer(rl: RankLayer) -> float:
        mlp = rl.total - rl.attn
        return rl.attn * mixed_bytes(w_bytes, wide, kept.attention) + mlp * mixed_bytes(w_bytes, wide, kept.mlp)

    out = []
    kinds = costs.stage_kinds(lay.pp)
    for s, (n_dense, n_moe) in enumerate(kinds):
        b = n_dense * layer(costs.rank_layer(False, lay.tp)) if n_dense else 0.0
        if n_moe:
            b += n_moe * layer(costs.rank_layer(True, lay.tp, lay.ep, lay.etp))
        if s == 0:
            b += embed
        if s == lay.pp - 1:  # the final norm, the LM head, each multi-token-prediction module's
            # projection (2h to h over tp) and its three norms (the layer's are in its kind), and with
            # them the embedding the modules look the next tokens up in (Megatron-Core builds it on
            # the last stage too)
            b += cfg.hidden_size * wide + (embed if (not cfg.tie_word_embeddings or lay.pp > 1) else 0)
            b += costs.mtp * (2 * cfg.hidden_size * cfg.hidden_size / lay.tp + 3 * cfg.hidden_size) * wide
            b += embed if costs.mtp and lay.pp > 1 else 0
        out.append(b)
    return out


def kv_bytes_per_seq_token(costs: ModelCosts, lay: Layout, kv_bytes: float) -> float:
    """KV bytes one token of one sequence costs on the busiest rank (its stage's layers, /cp)."""
    cfg = costs.cfg
    dense = kv_bytes_per_token(cfg, costs.rank_layer(False, lay.tp), kv_bytes)
    moe = kv_bytes_per_token(cfg, costs.rank_layer(True, lay.tp, lay.ep, lay.etp), kv_bytes) if cfg.is_moe else 0.0
    return max(n_dense * dense + n_moe * moe for n_dense, n_moe in costs.stage_kinds(lay.pp)) / lay.cp


def prefill_working_set(
    costs: ModelCosts, lay: Layout, chunk_tokens: float, a_bytes: int, *, ctx: float, fused_attention: bool = True
) -> float:
    """Transient activations of one prefill chunk in one layer, plus the last-token logits; unfused
    attention also holds the chunk's float32 scores against its ``ctx`` keys, per local head."""
    cfg = costs.cfg
    rl = costs.rank_layer(cfg.is_moe and cfg.first_k_dense == 0, lay.tp, lay.ep, lay.etp)
    width: float = 4 * cfg.hidden_size + (rl.q_heads + 2 * max(rl.kv_heads, 1)) * cfg.head_dim
    ffn = max(costs.cfg.intermediate_size, costs.cfg.moe_intermediate_size * max(cfg.num_experts_per_tok, 1))
    width += (3 if cfg.gated_mlp else 2) * ffn / lay.tp
    scores = 0.0 if fused_attention else chunk_tokens / lay.cp * rl.q_heads * ctx * C.FP32_BYTES
    return chunk_tokens / lay.cp * width * a_bytes + scores


def inference_fixed(
    costs: ModelCosts,
    lay: Layout,
    reserve: float,
    *,
    prompt_len: int,
    batch_hint: int,
    w_bytes: int,
    a_bytes: int,
    fused_attention: bool = True,
) -> MemoryBreakdown:
    """Everything but the KV cache (which decides how many sequences fit)."""
    chunk = min(C.PREFILL_CHUNK_TOKENS, prompt_len * batch_hint)
    act = prefill_working_set(costs, lay, chunk, a_bytes, ctx=prompt_len, fused_attention=fused_attention)
    comm = 2 * chunk / lay.cp * costs.cfg.hidden_size * a_bytes if lay.world_size > 1 else 0.0
    return MemoryBreakdown(
        weights=weight_bytes(costs, lay, w_bytes, quantized=w_bytes < C.BF16_BYTES),
        activations=act,
        comm_buffers=comm,
        reserve=reserve,
    )


# ---- training -------------------------------------------------------------------------------


def layer_shape(
    costs: ModelCosts,
    moe: bool,
    fused_attention: bool = True,
    *,
    kernels: str = "shardlm",
    dtype: str = "bf16",
    modules: frozenset[str] = frozenset(),
) -> LayerShape:
    """One layer's shape for the activation count; ``kernels`` "fused" keeps the gated activation's
    input only, an FP8 ``dtype`` keeps the linear layers' inputs in FP8, ``modules`` are Megatron's
    recompute modules (``LayerShape.recomputed``: those the layer has, up-projections where its
    attention is latent, the MLP where it is dense)."""
    cfg = costs.cfg
    if cfg.is_mla:
        q_dim = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        kv_dim = cfg.num_heads * max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)
    else:
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    ffn = cfg.shared_expert_intermediate_size if moe else cfg.intermediate_size
    # as shardlm trains: fused attention (flash); unfused keeps the a x s x s scores
    return LayerShape(
        hidden=cfg.hidden_size,
        heads=cfg.num_heads,
        q_dim=q_dim,
        kv_dim=kv_dim,
        ffn=ffn,
        gated=cfg.gated_mlp,
        dropout=cfg.dropout,
        flash=fused_attention,
        fused_activation=kernels == "fused",
        fp8_inputs=dtype in FP8_KEEPS_AT,
        recomputed=frozenset(m for m in modules if (m == "mla_up_proj" and cfg.is_mla) or (m == "mlp" and not moe)),
    )


def routed_pairs(cfg, lay: Layout, tokens: float, held: float = 1) -> float:
    """The (token, expert) pairs a rank computes for a micro-batch of ``tokens`` per tp group, as
    the time model counts them (``Layout.moe_tokens``): inside the tp group 1/ep of every token's
    choices, beyond it etp/tp of them; on the most loaded rank of the ep group over ``held``
    routings whose pairs it holds at once (layers, micro-batches: ``busiest_pairs`` of them all,
    a layer's share of it; the time model waits for each layer's busiest instead)."""
    return busiest_pairs(lay.moe_tokens(tokens) * held, lay.ep, cfg.num_experts, cfg.num_experts_per_tok) / held


def training_activation_bytes(
    costs: ModelCosts,
    lay: Layout,
    seq: int,
    fused_attention: bool = True,
    *,
    kernels: str = "shardlm",
    dtype: str = "bf16",
    ep_overlap: bool = False,
    modules: frozenset[str] = frozenset(),
) -> float:
    """Activations the first stage holds at its peak (Korthikanti et al. 2022 §4); ``ep_overlap``: under
    Megatron-Core's 1F1B all-to-all overlap, whose warm-up runs one model chunk more
    (``training.unmerged_passes``; its merged pairs free a micro-batch's layers as they fill another's)."""
    cfg = costs.cfg
    shape = {
        moe: layer_shape(costs, moe, fused_attention, kernels=kernels, dtype=dtype, modules=modules)
        for moe in (False, True)
    }
    s = seq // lay.cp
    total = 0.0
    n_dense, n_moe = costs.stage_kinds(lay.pp)[0]

    def per_layer(moe: bool) -> float:
        return layer_activation_bytes(
            shape[moe],
            seq=s,
            micro_batch=lay.micro_batch,
            tp=lay.tp,
            sp=lay.sp,
            recompute=lay.recompute,
        )

    if n_dense:
        total += n_dense * per_layer(False)
    held = n_dense + n_moe  # the stage's layers in v chunks (the largest in flight once more: largest_chunk)
    flight = in_flight_microbatches(lay.schedule, pp=lay.pp, num_micro=lay.num_micro, virtual=lay.virtual, held=held)
    flight += largest_chunk(held, lay.virtual) if ep_overlap and lay.pp > 1 else 0.0
    if n_moe:
        per = per_layer(True)
        if lay.recompute != "full":  # routed experts: what a gated MLP keeps for each pair this rank
            # computes (LayerShape.gated_row_bytes; selective recomputation leaves the experts' activation
            # kept: the trainer sets it on the dense MLP only), and the pair's input and output rows
            rows = costs.rank_layer(True, lay.tp, lay.ep, lay.etp).expert_params // (3 * cfg.hidden_size)
            moe_shape = shape[True]
            pair = moe_shape.gated_row_bytes("none") * rows + (moe_shape.linear_in + 2) * cfg.hidden_size
            per += routed_pairs(cfg, lay, s * lay.micro_batch, n_moe * flight) * pair
        total += n_moe * per
    return total * flight


LOSS_BYTES_PER_LOGIT = C.BF16_BYTES + 2 * C.FP32_BYTES
"""Bytes per logit at the loss's peak, as shardlm's vocab-parallel cross-entropy holds them
(``train/loss.py``): the 16-bit logits, their float32 copy and its exponentials in the forward (the
float32 softmax, kept for backward, then its gradient and the 16-bit copy the LM head's backward
takes: as many). Checked against the peak memory of two H100 runs (docs/plan.md, "Validation:
memory")."""


def loss_bytes(costs: ModelCosts, lay: Layout, seq: int) -> float:
    """The last stage's working set for one micro-batch's logits and loss (the rank's vocab rows)."""
    return lay.micro_batch * seq / lay.cp * costs.vocab_rows(lay.tp) * LOSS_BYTES_PER_LOGIT


ZERO3_GRAD_BYTES = GRAD_BYTES + REDUCED_GRAD_BYTES
"""Bytes a parameter of a ZeRO-3 layer holds in backward as it is reduce-scattered: its 16-bit
gradient and the float32 copy that is summed (``train/zero.py``, ``_Gather.backward``)."""


def outer_params(costs: ModelCosts, lay: Layout, stage: int) -> float:
    """Parameters of ``stage``'s ZeRO unit outside its layers: the embedding on the first stage,
    the LM head on the last (one matrix when they are tied on one stage), and with multi-token
    prediction the embedding on the last stage too (``weight_bytes``)."""
    embed = costs.vocab_rows(lay.tp) * costs.cfg.hidden_size
    first, last = stage == 0, stage == lay.pp - 1
    mtp_embed = last and costs.mtp > 0 and lay.pp > 1
    return embed * (first + (last and (not costs.cfg.tie_word_embeddings or lay.pp > 1)) + mtp_embed)


def zero3_buffers(
    costs: ModelCosts, lay: Layout, prefetch: int, reduce: str, reduced: int = REDUCED_GRAD_BYTES
) -> float:
    """What a ZeRO-3 rank holds beyond its shards at the activations' peak (the start of backward):
    the gathered 16-bit weights of 1 + ``prefetch`` layers (of an MoE layer's experts only the
    current one's: the trainer gathers them when met, ``train/zero.py``) and of its outer unit
    (gathered for the whole forward, and again for backward), the outer unit's whole 16-bit
    gradient (on the first stage reduced only when the embedding's backward ends it; on a last
    stage of pp > 1, holding the LM head alone, reduce-scattered right after the head's backward,
    so with the float32 copy it sends: ``ZERO3_GRAD_BYTES``), and the layer being
    reduce-scattered (``ZERO3_GRAD_BYTES``), a second beside it when ``reduce`` is "overlapped"
    (priced as FSDP2 and Megatron-FSDP run it, which prefetch the experts with the rest of a layer,
    as ``training.zero3_exposed`` does). ``reduced``: the bytes a gradient is sent in; a 16-bit
    gradient is sent as it is (no float32 copy beside it)."""
    sent = GRAD_BYTES + (reduced if reduced != GRAD_BYTES else 0)  # a layer's gradient while it is sent
    rl = costs.rank_layer(costs.cfg.is_moe, lay.tp, lay.ep, lay.etp)
    experts = 0 if reduce == "overlapped" else rl.experts * rl.expert_params  # those gathered only when met
    layer, gathered = rl.total, (1 + prefetch) * (rl.total - experts) + experts
    first = (PARAM_BYTES + GRAD_BYTES) * outer_params(costs, lay, 0)
    last = (PARAM_BYTES + sent) * outer_params(costs, lay, lay.pp - 1) if lay.pp > 1 else 0.0
    in_flight = 2 if reduce == "overlapped" else 1
    return PARAM_BYTES * gathered + max(first, last) + in_flight * sent * layer


def training_memory(
    costs: ModelCosts,
    lay: Layout,
    reserve: float,
    *,
    seq: int,
    fused_attention: bool = True,
    prefetch: int = 1,
    zero3_reduce: str = "blocking",
    grad_reduce_bytes: int = REDUCED_GRAD_BYTES,
    kernels: str = "shardlm",
    dtype: str = "bf16",
    ep_overlap: bool = False,
    modules: frozenset[str] = frozenset(),
) -> MemoryBreakdown:
    edp = lay.dp * lay.tp // (lay.ep * lay.etp) * lay.cp  # copies of each expert
    expert = costs.rank_layer(True, lay.tp, lay.ep, lay.etp) if costs.cfg.is_moe else None

    def states(stage: int, params: float) -> tuple[ModelStates, ModelStates]:
        """A stage's dense and expert states (the experts over their own copies)."""
        experts = costs.stage_kinds(lay.pp)[stage][1] * expert.experts * expert.expert_params if expert else 0.0
        return (
            model_states(params - experts, dp=lay.dp * lay.cp, stage=lay.zero),
            model_states(experts, dp=edp, stage=lay.zero),
        )

    def held(pair: tuple[ModelStates, ModelStates]) -> float:
        return sum(m.weights + m.gradients + (0.0 if lay.offload else m.optimizer) for m in pair)

    # the stage whose states are largest: parameters (the largest stage) and experts (the stage with
    # the most) may lie on different stages
    dense_states, expert_states = max(
        (states(s, params) for s, params in enumerate(stage_weight_bytes(costs, lay, 1))), key=held
    )
    if lay.zero == 3:
        comm = zero3_buffers(costs, lay, prefetch, zero3_reduce, grad_reduce_bytes)
    else:
        comm = 2 * C.DDP_BUCKET_BYTES if lay.dp * lay.cp > 1 else 0.0  # two gradient buckets in flight
    return MemoryBreakdown(
        weights=dense_states.weights + expert_states.weights,
        gradients=dense_states.gradients + expert_states.gradients,
        optimizer=0.0 if lay.offload else dense_states.optimizer + expert_states.optimizer,  # offload: on the host
        activations=_peak_activations(
            costs, lay, seq, fused_attention, kernels=kernels, dtype=dtype, ep_overlap=ep_overlap, modules=modules
        ),
        comm_buffers=comm,
        reserve=reserve,
    )


def _peak_activations(
    costs: ModelCosts,
    lay: Layout,
    seq: int,
    fused_attention: bool,
    *,
    kernels: str,
    dtype: str,
    ep_overlap: bool,
    modules: frozenset[str],
) -> float:
    """The larger of the first stage's activations at its peak and the last stage's: its layers'
    activations for the micro-batches in flight there (1F1B and ZB-H1: one, its backward follows
    its forward at once; GPipe: all; interleaved: ((v - 1) p + 1) / v stage-equivalents, a chunk
    more under the all-to-all overlap), the float32 softmax each of those keeps for the loss's
    backward, and one loss's working set."""
    first = training_activation_bytes(
        costs, lay, seq, fused_attention, kernels=kernels, dtype=dtype, modules=modules, ep_overlap=ep_overlap
    )
    if lay.pp == 1:  # one micro-batch's loss working set; each multi-token-prediction module's softmax kept
        return first + loss_bytes(costs, lay, seq) * (1 + costs.mtp * C.FP32_BYTES / LOSS_BYTES_PER_LOGIT)
    p, v = lay.pp, lay.virtual
    flight = {"gpipe": lay.num_micro, "interleaved": ((v - 1) * p + 1) / v}.get(lay.schedule, 1)
    flight += 1 / v if ep_overlap else 0.0
    one = replace(lay, pp=1, num_micro=1)
    per_layer = training_activation_bytes(
        costs, one, seq, fused_attention, kernels=kernels, dtype=dtype, modules=modules
    )
    per_layer /= sum(costs.stage_kinds(1)[0])  # the layers, the multi-token-prediction modules' too
    last_layers = sum(costs.stage_kinds(lay.pp)[-1])
    loss = loss_bytes(costs, lay, seq)
    softmax = loss * C.FP32_BYTES / LOSS_BYTES_PER_LOGIT  # kept per micro-batch until its backward
    kept = (1 + costs.mtp) * softmax  # and each multi-token-prediction module's
    return max(first, flight * (per_layer * last_layers + kept) + loss - softmax)
