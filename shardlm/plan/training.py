"""Training step time and memory of one layout.

Per micro-batch and stage: forward = roofline of the stage's layers on b x s/cp tokens (2 x tokens
x params FLOPs; Kaplan et al. 2020, https://arxiv.org/abs/2001.08361 §2.1) plus the TP collectives
(two all-reduces per layer, or with SP an all-gather and a reduce-scatter of the same volume;
Korthikanti et al. 2022 §4.2.2), the MoE layers' token trip as inference costs it
(``comm.moe_boundary``: dispatch/combine, once a node and a GPU with DeepEP's dispatcher; under
``--kernels fused`` no MoE block faster than Megatron-Core's measured floor, ``_moe_floor``), and the CP KV
ring or Ulysses' all-to-alls (the ring hidden behind attention when it can be); TP's collectives are
waited for, or under ``tp_overlap`` pipelined with their blocks' GEMMs (``comm.pipelined``).
Activations and their collectives stay 16-bit under FP8. Backward costs twice the forward's GEMM
FLOPs and the same communication again: the input gradients as the forward's products, the
weight gradients with their add into the gradient buffer in the roofline (``grad_epilogue_bytes``);
a flash attention core's backward recomputes its scores (``_attention_times``) and the ring passes its
key/value blocks round again with their gradients; recomputation adds a forward (full) or the attention
core with its cp exchanges (selective). FP8 times the linear layers'
GEMMs at its rate and adds their operands' casts (``FP8_CAST_BYTES``) to the memory-bound traffic.

The pipeline turns stage times into a step with the schedule's closed form, exact for uniform
stages (``schedule.simulate`` reproduces each): GPipe and 1F1B (m+p-1)(F+B); interleaved m(F+B) +
(p-1)(F+B)/v; ZB-H1 m(F+B) + (p-1)(F + B_in - B_w) for m >= p. Each micro-batch's hops between
stages (2, or 2v interleaved) carry what the trainer sends (``boundary_bytes``), waited for, or under
``pp_overlap`` hidden behind the interleaved chunks beside them. Data-parallel gradient sync, as
shardlm's trainer sends it (``train/zero.py``): once a step, in float32
(``zero.REDUCED_GRAD_BYTES``), an all-reduce for ZeRO-0, a reduce-scatter and the updated 16-bit
weights' all-gather for ZeRO-1 and 2 (the trainer's ZeRO-2 keeps the whole gradients through
gradient accumulation and reduces in the last backward, as its ZeRO-1 does; DeepSpeed's ZeRO-2
reduce-scatters every micro-batch's instead, Rajbhandari et al. 2019 §7), overlapped with backward
up to DP_OVERLAP_FRACTION. ZeRO-3 all-gathers each layer's parameters for every micro-batch's
forward and backward and reduce-scatters its gradients: per layer, hidden only behind the compute
of the layer its prefetch runs beside (``zero3_exposed``). The memory-bound operators (norms,
activations, residuals, casts, an MoE layer's copies of its routed pairs, the loss, the optimizer
step) move the bytes shardlm's trainer was counted to move (``traffic``), at the device's streaming rate.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from shardlm.plan import comm, traffic
from shardlm.plan import constants as C
from shardlm.plan.activations import RECOMPUTE_MODULES, largest_chunk
from shardlm.plan.errors import PlanError
from shardlm.plan.hardware import Cluster, GpuSpec
from shardlm.plan.layout import Layout
from shardlm.plan.memory import MemoryBreakdown, outer_params, training_memory, weight_bytes
from shardlm.plan.roofline import (
    FP8_KEEPS_AT,
    ModelCosts,
    Step,
    Work,
    backward_products,
    busiest_pairs,
    k_efficiency,
    layer_work,
    touched_params,
)
from shardlm.plan.shard import gemm_shapes, mla_up_projections
from shardlm.plan.zero import PARAM_BYTES, REDUCED_GRAD_BYTES

BACKWARD_FLOPS_RATIO = 2.0
"""Backward = 2x forward FLOPs (gradients w.r.t. inputs and weights; Kaplan et al. 2020 §2.1)."""
ZERO3_REDUCE = ("blocking", "overlapped")
"""How ZeRO-3's gradient reduce-scatters meet backward (``TrainWorkload.zero3_reduce``)."""
GRAD_REDUCE_BYTES = {"fp32": REDUCED_GRAD_BYTES, "bf16": 2}
"""Bytes a parameter's gradient crosses the data-parallel group in (``TrainWorkload.grad_reduce``):
fp32 as shardlm's trainer sends it (``zero.REDUCED_GRAD_BYTES``) and Megatron-LM does by default
for bf16 training; bf16 as Megatron-LM's ``--grad-reduce-in-bf16`` (which the Megatron-FSDP user
guide recommends, docs/discussions/megatron-fsdp-user-guide) and FSDP2's ``reduce_dtype=bfloat16``."""


def grad_epilogue_bytes(kernels: str, a: int, g: int) -> int:
    """Bytes a parameter's weight-gradient product moves into the gradient buffer each micro-batch,
    by whose kernels (``TrainWorkload.kernels``), at ``a`` bytes an activation and ``g`` a reduced
    gradient. fused: the product adds into the gradient buffer in its epilogue, reading and writing it
    (Megatron-LM's ``--gradient-accumulation-fusion``, on by default, into ``main_grad``, float32
    unless the gradients are reduced in bf16; cuBLAS GEMM with beta = 1). shardlm: the product writes
    a fresh gradient in the compute dtype, which autograd then adds into the gradient bucket (that add
    is in ``traffic``'s counted bytes). At a few hundred tokens a GEMM (an MoE expert's share of a
    micro-batch) the float32 read and write outlast the product's FLOPs."""
    return 2 * g if kernels == "fused" else a


FP8_CAST_BYTES = {"delayed": (0, 4), "tensorwise": (4, 6), "mxfp8": (4, 4), "blockwise": (4, 4)}
"""Bytes per element an FP8 GEMM's operand costs to make beyond the 16-bit tensor its producer writes
(which the counted traffic holds), by scaling recipe (``TrainWorkload.fp8_recipe``, Megatron-LM's
``--fp8-recipe`` names): (an input a norm writes, any other input or output gradient), on a GPU whose
FP8 GEMMs take only the TN layout (Hopper; ``fp8_cast_bytes`` for the others). Each operand is a
cast that reads the 16-bit tensor and writes its FP8 copy and FP8 transpose (1 byte each; the
transpose for the weight gradient), 4 bytes, as Transformer Engine's quantizers run it
(transformer_engine/pytorch/csrc: ``quantizer.cpp``, ``extensions/normalization.cpp``):

- delayed (per-tensor scales from past steps' amax): a norm feeding a linear (LayerNormLinear)
  writes FP8 itself in place of its 16-bit output (the fully fused kernel);
- tensorwise (current scaling: per-tensor scales from this tensor's amax): an amax pass reads each
  tensor once more before its cast (``Float8CurrentScalingQuantizer::quantize_impl``), 6 bytes; a
  norm writes its 16-bit output with the amax fused and the cast follows, 4;
- mxfp8 (32-element blocks) and blockwise (1 x 128 and 128 x 128 tiles, DeepSeek-V3's §3.3.2): the
  block's scale comes from the block, inside the cast; a norm writes 16-bit and the cast follows
  (without ``NVTE_NORM_FWD_USE_CUDNN``, TE's default, the norm does not quantize).

Megatron-Core's activation (its own fused SwiGLU) writes 16-bit, so the down projection's input is
cast as any other. The blocks' scales (a byte or float32 per 32 to 128 elements) are left out."""
FP8_RECIPES = tuple(FP8_CAST_BYTES)
PER_TENSOR_RECIPES = ("delayed", "tensorwise")
"""The recipes with one scale a tensor, whose FP8 copy transposes as it is (a block-scaled copy's
blocks run along its rows: mxfp8 and blockwise write a second, column-wise one on every GPU)."""


def fp8_cast_bytes(recipe: str | None, gpu: GpuSpec) -> tuple[float, float]:
    """``FP8_CAST_BYTES`` of ``recipe`` (None: delayed) on ``gpu``: where its FP8 GEMMs take any layout
    (``GpuSpec.fp8_gemm_any_layout``: Blackwell) a per-tensor recipe's cast writes no transpose,
    a byte less an element (Transformer Engine's quantizers set the transpose's usage only where
    ``nvte_is_non_tn_fp8_gemm_supported`` is false)."""
    recipe = recipe or "delayed"
    by_norm, other = FP8_CAST_BYTES[recipe]
    if recipe in PER_TENSOR_RECIPES and gpu.fp8_gemm_any_layout:
        return max(0, by_norm - 1), other - 1
    return by_norm, other


def check_fp8_recipe(wl: TrainWorkload, gpu: GpuSpec) -> None:
    """Refuse a recipe the GPU cannot run: MXFP8's block-scaled GEMMs need Blackwell's tensor cores."""
    if wl.fp8_recipe == "mxfp8" and gpu.compute_capability < 10.0:
        has = f"is {gpu.compute_capability:g}" if gpu.compute_capability else "is not a CUDA GPU"
        raise PlanError(
            f"--fp8-recipe mxfp8 needs block-scaled FP8 GEMMs (compute capability 10.0 and up, Blackwell), but "
            f"{gpu.name} {has}; use tensorwise, delayed or blockwise there"
        )


@dataclass(frozen=True, kw_only=True)
class TrainWorkload:
    global_batch: int
    """Sequences per optimizer step over all replicas."""
    seq_len: int
    """Tokens per sequence."""
    dtype: str = "bf16"
    """Compute dtype (mixed precision; master weights and Adam states in fp32)."""
    fused_attention: bool = True
    """Flash/SDPA attention (a log-sum-exp per head and token); False keeps the a x s x s scores."""
    kernels: str = "shardlm"
    """Whose memory-bound kernels move the activations (``traffic.KERNELS``): shardlm's eager
    trainer's counted bytes, or a fused implementation's (Megatron-LM)."""
    prefetch: int = 1
    """ZeRO-3: decoder layers whose all-gathers are in flight while one computes (``shardlm train
    --prefetch``, default 1 on a GPU); 0 gathers each layer when it is needed."""
    dispatcher: str = "shardlm"
    """How MoE tokens travel (``comm.DISPATCHERS``): shardlm's every-pair all-to-all, or DeepEP's
    token-based dispatch (once to each node, then each GPU, holding one of a token's experts)."""
    zero3_reduce: str = "blocking"
    """ZeRO-3's gradient reduce-scatters (``ZERO3_REDUCE``): blocking, each in its layer's backward
    as shardlm's trainer runs them, or overlapped on their own stream behind the next layers'
    backward (FSDP2, Megatron-FSDP's ``--overlap-grad-reduce``)."""
    grad_reduce: str = "fp32"
    """The dtype gradients cross the data-parallel group in (``GRAD_REDUCE_BYTES``): fp32 as shardlm's
    trainer sends them, or bf16 as a peer may (Megatron-LM's ``--grad-reduce-in-bf16``)."""
    tp_overlap: bool = False
    """TP's collectives pipelined with the GEMMs beside them (``comm.pipelined``), as Megatron-LM's
    ``--tp-comm-overlap`` runs them (Transformer Engine's userbuffers: each GEMM in tp chunks, one
    exchanged while another computes; sequence parallelism required, layouts without it wait): the
    attention block's with its QKV and output projections, a dense MLP's with its own; an MoE block's
    experts have no such overlap. False: each waited for, as shardlm's trainer does."""
    ep_overlap: bool = False
    """MoE layers' token trip hidden behind another micro-batch's compute, as Megatron-Core's 1F1B
    all-to-all overlap (``--overlap-moe-expert-parallel-comm``) runs it: each steady-state forward
    merged with another micro-batch's backward on two streams (``_merged_pair``); Megatron allows it
    at ep > 1, with pp > 1 only interleaved and without full recomputation (``ep_overlaps``), and
    other layouts are priced without it. False: each trip waited for, as shardlm's trainer does."""
    pp_overlap: bool = False
    """The interleaved schedule's sends and receives between stages posted ahead and waited for only when
    the chunk that needs them starts, so that each hides behind the chunk computing meanwhile, as
    Megatron-Core runs them (``overlap_p2p_comm``: Megatron-LM's default since its
    ``--no-overlap-p2p-communication``, Megatron-Bridge's wherever vp > 1; interleaved only,
    ``pp_overlaps``); other schedules wait for each hop. False: each waited for, as shardlm's trainer
    waits for each receive."""
    recompute_modules: tuple[str, ...] = ()
    """Megatron-Core's recompute modules added to each layout's recomputation (``RECOMPUTE_MODULES``):
    ``mla_up_proj``, latent attention's up-projections (DeepSeek-V3's own training and recipes), and
    ``mlp``, a dense layer's MLP: their outputs not kept (``LayerShape.recomputed``), their products
    run again in each backward (``_recomputed_work``); layouts under full recomputation recompute them
    anyway. Empty: kept, as shardlm's trainer does."""
    fp8_recipe: str | None = None
    """FP8's scaling recipe (``FP8_RECIPES``), what its operands' casts move (``FP8_CAST_BYTES``);
    fp8 steps only, None: delayed, Megatron-LM's and Transformer Engine's default."""
    mtp: int = 0
    """Multi-token-prediction modules (DeepSeek-V3 §2.2, its ``num_nextn_predict_layers``; Megatron-Core's
    ``--mtp-num-layers``), each on the last stage: a projection of the hidden state joined with the next
    token's embedding, one decoder layer of the last layer's kind and the LM head and loss again
    (``ModelCosts.mtp``). 0: next-token prediction only, as shardlm's trainer runs."""

    def __post_init__(self) -> None:
        comm.check_dispatcher(self.dispatcher)
        if self.zero3_reduce not in ZERO3_REDUCE:
            raise PlanError(
                f"zero3_reduce={self.zero3_reduce!r} is not one of {', '.join(ZERO3_REDUCE)} (blocking: as "
                "shardlm's trainer; overlapped: as FSDP2 and Megatron-FSDP)"
            )
        if self.grad_reduce not in GRAD_REDUCE_BYTES:
            raise PlanError(
                f"grad_reduce={self.grad_reduce!r} is not one of {', '.join(GRAD_REDUCE_BYTES)} (fp32: as "
                "shardlm's trainer; bf16: as Megatron-LM's --grad-reduce-in-bf16)"
            )
        if unknown := sorted(set(self.recompute_modules) - set(RECOMPUTE_MODULES)):
            raise PlanError(
                f"--recompute-modules {','.join(unknown)}: the planner adds {', '.join(RECOMPUTE_MODULES)} "
                "(Megatron-Core's core_attn and moe_act are --recompute selective)"
            )
        if self.fp8_recipe is not None and self.dtype not in FP8_KEEPS_AT:
            raise PlanError(
                f"--fp8-recipe {self.fp8_recipe} scales FP8 GEMMs' operands, but the step computes in {self.dtype}; "
                "add --dtype fp8 or drop --fp8-recipe"
            )
        if self.fp8_recipe not in (None, *FP8_RECIPES):
            raise PlanError(
                f"--fp8-recipe {self.fp8_recipe!r} is not one of {', '.join(FP8_RECIPES)} (Megatron-LM's names)"
            )
        if not isinstance(self.mtp, int) or self.mtp < 0:
            raise PlanError(f"--mtp {self.mtp!r} must be a whole number of modules >= 0, e.g. 1 (DeepSeek-V3's)")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise PlanError(f"--prefetch {self.prefetch!r} must be a whole number of layers >= 0, e.g. 1 (0: off)")


@dataclass(kw_only=True)
class TrainResult:
    layout: Layout
    """The layout evaluated (training knobs included)."""
    memory: MemoryBreakdown
    """Per-GPU memory of the busiest rank."""
    fits: bool
    """Whether it fits in device memory."""
    step_s: float = math.inf
    """One optimizer step."""
    tokens_per_s: float = 0.0
    """Training tokens per second over the cluster."""
    mfu: float = 0.0
    """Model FLOPs utilisation against the datasheet peak (6 x active params x tokens)."""
    bubble_fraction: float = 0.0
    """Idle share of the pipeline part of the step."""
    forward_s: float = 0.0
    """One micro-batch forward on the busiest stage."""
    backward_s: float = 0.0
    """One micro-batch backward on the busiest stage (recomputation included)."""
    comm_s: dict | None = None
    """Exposed communication per kind over the step (tp, ep, cp, dp, pp); what recomputation runs again
    is counted as backward's, not here."""
    shortfall_bytes: float = 0.0
    """Memory over the device when it does not fit."""


class StagePass(NamedTuple):
    """One micro-batch's passes on one stage (``_stage``), in seconds."""

    forward: float
    backward: float
    """Recomputation included."""
    weight_grads: float
    """Of ``backward``, the weight gradients' products (ZB-H1 defers them: its W)."""
    tp: float
    """TP communication waited for, both passes."""
    ep: float
    """The MoE layers' token trips of one pass (backward moves the same bytes again)."""
    cp: float
    """CP communication waited for, both passes (not what recomputation runs again: as ``tp`` and ``ep``)."""
    hidden: float
    """What merging its forward with another micro-batch's backward saves (``_merged_pair``)."""
    zero3: float = 0.0
    """ZeRO-3's gathers and reduce-scatters waited for, both passes (``_with_zero3``)."""


def evaluate(costs: ModelCosts, cluster: Cluster, lay: Layout, wl: TrainWorkload) -> TrainResult:
    costs = costs.with_mtp(wl.mtp)
    cfg, gpu = costs.cfg, cluster.gpu
    cap = gpu.memory_bytes
    mem = training_memory(
        costs,
        lay,
        cluster.reserve(True),
        seq=wl.seq_len,
        fused_attention=wl.fused_attention,
        prefetch=wl.prefetch,
        zero3_reduce=wl.zero3_reduce,
        grad_reduce_bytes=GRAD_REDUCE_BYTES[wl.grad_reduce],
        kernels=wl.kernels,
        dtype=wl.dtype,
        ep_overlap=ep_overlaps(cfg, lay, wl),
        modules=frozenset(wl.recompute_modules),
    )
    if mem.total > cap:
        return TrainResult(layout=lay, memory=mem, fits=False, shortfall_bytes=mem.total - cap)
    # activations, their collectives, the attention core and the LM head stay 16-bit under FP8, which
    # runs only the linear layers' GEMMs at one byte (FP8_KEEPS_AT; as inference's a_bytes)
    a = max(C.BF16_BYTES, C.DTYPE_BYTES[wl.dtype])
    tokens = lay.micro_batch * wl.seq_len / lay.cp
    # one stage of each kind: its dense and MoE layer counts, and whether it runs the LM head
    stages = {(kinds, s == lay.pp - 1): s for s, kinds in enumerate(costs.stage_kinds(lay.pp))}.values()
    p, m, v = lay.pp, lay.num_micro, lay.virtual
    # the 1F1B all-to-all overlap merges every forward but the first stage's warm-up ones with a
    # backward of another micro-batch; each merged chunk pair saves 1/v of its stage's ``hidden``, so
    # the stage that sets the pace is the one slowest with its saving taken off
    merged = m * v - unmerged_passes(lay) if ep_overlaps(costs.cfg, lay, wl) else 0
    priced = (
        (s, _with_zero3(costs, cluster, lay, wl, s, _stage(costs, cluster, lay, wl, s, tokens, a))) for s in stages
    )
    pacing, st = max(priced, key=lambda ps: m * (ps[1].forward + ps[1].backward) - merged * ps[1].hidden / v)
    fwd, bwd, ep_c = st.forward, st.backward, st.ep
    saved = merged * st.hidden / v
    # what of it the trips were (the rest, time the block floor no longer waits, is no communication):
    # each MoE layer saves at most its trips, 2 x ep_c a merged pair over the stage
    saved_ep = min(saved, merged * 2 * ep_c / v)
    p2p = 0.0
    if p > 1:
        pg = lay.slowest_group("pp", cluster.gpus_per_node)
        sent = boundary_bytes(cfg, lay, wl.kernels, tokens, a)
        p2p = max(comm.send_recv(sent, x, y, cluster) for x, y in itertools.pairwise(pg))
    unit = fwd + bwd + 2 * p2p
    hops = m * 2 * p2p  # the hops each micro-batch waits for (an interleaved one makes 2v)
    if p == 1:
        pipe = m * unit
    elif lay.schedule == "interleaved":  # the bubble: p - 1 of the largest chunk's passes, as a share of
        # the pacing stage's (its layers in v chunks; where they do not split evenly they differ by a
        # layer, as Megatron places them)
        chunk = largest_chunk(sum(costs.stage_kinds(p)[pacing]), v)
        if pp_overlaps(lay, wl):  # each steady-state hop behind the chunk's pass beside it; the
            # warm-up's and the drain's waited for (Megatron-Core's default: no
            # --overlap-p2p-communication-warmup-flush)
            warm = warmup_passes(lay)
            hops = 2 * warm * p2p + (m * v - warm) * (max(0.0, p2p - fwd / v) + max(0.0, p2p - bwd / v))
        else:
            hops = m * 2 * v * p2p
        unit = fwd + bwd + hops / m
        pipe = m * unit + (p - 1) * (fwd + bwd) * chunk
    elif lay.schedule == "zb-h1" and m >= p:
        b_w = st.weight_grads  # backward's weight-gradient products, deferred; the rest of it is B
        b_in = bwd - b_w
        pipe = m * unit + (p - 1) * (fwd + b_in - b_w + 2 * p2p)
    else:
        pipe = (m + p - 1) * unit
    pipe -= saved
    bubble = 1 - (m * unit - saved) / pipe
    # data-parallel gradient sync over dp x cp replicas of each weight, in float32 as the trainer sends it
    params = weight_bytes(costs, lay, 1)
    dp_group = lay.slowest_group("dp_cp", cluster.gpus_per_node)
    grad_bytes = params * GRAD_REDUCE_BYTES[wl.grad_reduce]
    dp_c = gathered = 0.0
    if len(dp_group) > 1 and lay.zero == 0:  # gradients accumulate locally; one all-reduce
        dp_c = comm.all_reduce(grad_bytes, dp_group, cluster)
    elif len(dp_group) > 1 and lay.zero in (1, 2):  # each rank its shard of the sums, once a step (the
        # trainer's ZeRO-2 keeps the whole gradients through accumulation too)
        dp_c = comm.reduce_scatter(grad_bytes, dp_group, cluster)
        # then the updated 16-bit weights gathered after the optimizer step, before the next
        # forward can start: nothing runs beside it (train/unit.py after_step)
        gathered = comm.all_gather(params * PARAM_BYTES, dp_group, cluster)
    # the reductions hide behind backward up to DP_OVERLAP_FRACTION; ZeRO-3's gathers and
    # reduce-scatters sit in every micro-batch's passes (zero3_exposed)
    dp_exposed = max(0.0, dp_c - C.DP_OVERLAP_FRACTION * m * bwd) + gathered if lay.zero < 3 else 0.0
    shard = lay.dp * lay.cp if lay.zero >= 1 else 1
    opt = params / shard * traffic.profile(wl.kernels, wl.dtype).per_param / gpu.mem_Bps
    if lay.offload and gpu.host_Bps:  # the owned float32 gradients down and 16-bit weights up over
        # PCIe, and AdamW on the host, bound by its memory
        host = (REDUCED_GRAD_BYTES + PARAM_BYTES) / gpu.host_Bps
        opt = params / shard * (host + C.CPU_ADAM_BYTES_PER_PARAM / C.HOST_MEM_BPS_PER_GPU)
    step_s = pipe + dp_exposed + opt
    tokens_step = wl.global_batch * wl.seq_len
    tps = tokens_step / step_s
    peak = gpu.matmul_flops(wl.dtype) / C.MATMUL_EFFICIENCY if not gpu.calibrated else gpu.matmul_flops(wl.dtype)
    mfu = 6 * costs.active_params * tps / (cluster.num_gpus * peak)
    return TrainResult(
        layout=lay,
        memory=mem,
        fits=True,
        step_s=step_s,
        tokens_per_s=tps,
        mfu=mfu,
        bubble_fraction=bubble,
        forward_s=fwd,
        backward_s=bwd,
        comm_s={
            "tp": m * st.tp,
            "ep": m * 2 * ep_c - saved_ep,
            "cp": m * st.cp,
            "dp": dp_exposed + m * st.zero3,
            "pp": hops,
        },
    )


def _stage(
    costs: ModelCosts, cluster: Cluster, lay: Layout, wl: TrainWorkload, stage: int, tokens: float, a: int
) -> StagePass:
    """One micro-batch's passes on one stage, its activations at ``a`` bytes and its linear layers'
    weights at the step's dtype."""
    cfg, gpu = costs.cfg, cluster.gpu
    w = C.DTYPE_BYTES[wl.dtype]
    tp_group, cp_group = (lay.slowest_group(k, cluster.gpus_per_node) for k in ("tp", "cp"))
    ar = comm.all_reduce(tokens * cfg.hidden_size * a, tp_group, cluster)
    moe_tokens = lay.moe_tokens(tokens)  # entering one ep group (parallel folding)
    k = cfg.num_experts_per_tok
    f_comp = b_comp = w_comp = f_attn = b_attn = tp_f = tp_b = ep_c = cp_f = cp_b = 0.0
    f_mem = b_mem = 0.0  # the memory-bound operators' traffic (plan/traffic.py), forward and backward
    f_floor = b_floor = 0.0  # what MoE blocks priced under their floor wait for (``_moe_floor``)
    hidden = 0.0  # what merging a forward with another micro-batch's backward saves (``_merged_pair``)
    floored = wl.kernels == "fused" and not gpu.calibrated
    moved = traffic.profile(wl.kernels, wl.dtype, cfg.gated_mlp)
    high = FP8_KEEPS_AT.get(wl.dtype, wl.dtype)  # the attention core's and LM head's rate
    cast = fp8_cast_bytes(wl.fp8_recipe, gpu) if wl.dtype in FP8_KEEPS_AT else (0.0, 0.0)  # an element, by kind
    for n, moe in zip(costs.stage_kinds(lay.pp)[stage], (False, True)):
        if not n:
            continue
        rl = costs.rank_layer(moe, lay.tp, lay.ep, lay.etp)
        step = Step(
            tokens=tokens,
            ctx=wl.seq_len / 2,
            decode=False,
            seqs=lay.micro_batch,
            moe_tokens=moe_tokens,
            scores_bytes=0.0 if wl.fused_attention else unfused_scores_bytes(cfg, wl.seq_len, a),
        )
        k_half = gpu.half_k(wl.dtype)
        mm, at = layer_work(
            cfg, rl, step, w_bytes=w, a_bytes=a, kv_bytes=a, ep=lay.ep, half_rows=gpu.half_rows(wl.dtype), k_half=k_half
        )
        # ring attention runs cp kernel calls a pass, one a hop, the ranks in step: zig-zag's chunks of
        # S / (2 cp) tokens make the diagonal call causal over two chunks and each other call, on the
        # ranks that hold later chunks than the sender (one does every hop), all queries over the
        # sender's first chunk: each hop's slowest call attends S / (2 cp) keys a query
        keys = step.ctx / lay.cp if lay.cp_attention == "ring" else step.ctx
        t_attn, t_attn_b = _attention_times(gpu, at, keys, high, wl.fused_attention)
        t_mm = mm.time(gpu, wl.dtype)
        pairs = busiest_pairs(moe_tokens, lay.ep, cfg.num_experts, k) if moe else 0.0  # the busiest ep rank's
        f_comp += n * t_mm
        # backward: the input gradients (the forward's weight reads, inner dimension each product's
        # output width) and the weight gradients (inner dimension the tokens), whose products add
        # into the gradient buffer (``grad_epilogue_bytes``)
        d_flops, w_flops = backward_products(cfg, rl, step, ep=lay.ep, half_rows=gpu.half_rows(wl.dtype), k_half=k_half)
        dgrad = Work(flops=d_flops, bytes=mm.bytes, ops=mm.ops, gemms=mm.gemms)
        epilogue = grad_epilogue_bytes(wl.kernels, a, GRAD_REDUCE_BYTES[wl.grad_reduce])
        wgrad = Work(flops=w_flops, bytes=touched_params(cfg, rl, step) * epilogue, gemms=mm.gemms)
        t_wgrad = wgrad.time(gpu, wl.dtype)
        t_back = dgrad.time(gpu, wl.dtype) + t_wgrad
        w_comp += n * t_wgrad
        recast = 0.0  # the recomputed products' FP8 inputs cast again, bytes a token
        if wl.recompute_modules and lay.recompute != "full":
            normed_again, other_again = _recomputed_products(cfg, rl, moe, wl.recompute_modules)
            t_back += _recomputed_work(normed_again + other_again, tokens, w, k_half).time(gpu, wl.dtype)
            recast = cast[0] * sum(k for k, _ in normed_again) + cast[1] * sum(k for k, _ in other_again)
        b_comp += n * t_back
        f_attn += n * t_attn
        b_attn += n * t_attn_b
        widths = _traffic_widths(cfg, rl, lay, pairs / tokens)
        mem_f = tokens * moved.forward.per_token(*widths) / gpu.mem_Bps  # one layer's
        mem_b = tokens * moved.backward.per_token(*widths) / gpu.mem_Bps
        if wl.dtype in FP8_KEEPS_AT:  # each FP8 GEMM's input cast in forward, its output's gradient in backward
            normed, cast_f, cast_b = _fp8_cast_widths(cfg, rl, moe, pairs / tokens)
            mem_f += tokens * (normed * cast[0] + cast_f * cast[1]) / gpu.mem_Bps
            mem_b += tokens * (cast_b * cast[1] + recast) / gpu.mem_Bps
        if moe:  # the routed pairs the busiest rank's experts compute, each a hidden row copied there and back
            pair_rows = pairs * cfg.hidden_size
            mem_f += pair_rows * moved.pair[0] / gpu.mem_Bps
            mem_b += pair_rows * moved.pair[1] / gpu.mem_Bps
        f_mem += n * mem_f
        b_mem += n * mem_b
        overlap = wl.tp_overlap and lay.sp  # Megatron's userbuffers need sequence parallelism
        share = _attention_share(rl, pairs / tokens)
        tp_lf = _tp_exposed(ar, t_mm, share, lay.tp, moe, overlap)
        tp_lb = _tp_exposed(ar, t_back, share, lay.tp, moe, overlap)
        tp_f += n * tp_lf
        tp_b += n * tp_lb
        cp_lf = cp_lb = 0.0  # one layer's CP communication waited for, forward and backward
        if lay.cp > 1 and lay.cp_attention == "ulysses":  # q, k, v out and the output back: all-to-alls;
            # backward runs the reverse ones, the same bytes
            qkvo = tokens * 2 * (rl.q_heads + max(rl.kv_heads, 1)) * cfg.head_dim * a
            cp_lf = cp_lb = comm.all_to_all(qkvo, cp_group, cluster)
        elif lay.cp > 1:  # ring attention: KV blocks hidden behind the attention core when possible;
            # backward passes them round again, their gradients alongside, behind its own attention
            kv = tokens * 2 * max(rl.kv_heads, 1) * cfg.head_dim * a
            ring = (lay.cp - 1) * comm.send_recv(kv, cp_group[0], cp_group[1], cluster)
            cp_lf, cp_lb = max(0.0, ring - t_attn), max(0.0, 2 * ring - t_attn_b)
        cp_f += n * cp_lf
        cp_b += n * cp_lb
        redo = 1 + (lay.recompute == "selective")  # the attention core (and its cp exchanges) run again
        if moe:  # dispatch and combine as inference costs them; backward moves the same bytes again
            trip = comm.moe_boundary(cfg, cluster, lay, tokens, a, wl.dispatcher, gemm_bytes=w)
            ep_c += n * trip
            block_f, block_b = (1 - share) * t_mm + mem_f + trip, (1 - share) * t_back + mem_b + trip
            below_f, below_b = _moe_floor(block_f, block_b) if floored else (0.0, 0.0)
            f_floor += n * below_f
            b_floor += n * below_b
            # the layer's forward and backward less the trips: as summed below, selective recomputation's
            # attention core included (full recomputation rules the overlap out, ``ep_overlaps``)
            attn = redo * (t_attn + cp_lf) + t_attn_b + cp_lb  # forward, recomputed, backward
            rest = t_mm + t_back + attn + mem_f + mem_b + tp_lf + tp_lb
            apart = rest + 2 * trip + below_f + below_b
            attention = t_mm + t_attn + mem_f + tp_lf + cp_lf + trip - block_f  # the forward's, before its block
            hidden += n * (apart - _merged_pair(rest, 2 * trip, attention, floored, gpu, wl.dispatcher))
    head_f = head_b = 0.0  # the LM head and loss (never recomputed)
    if stage == lay.pp - 1:  # over every token, once more a multi-token-prediction module, each of which
        # also projects the hidden state joined with the next token's embedding (2h to h, split over tp)
        vocab, h, heads = costs.vocab_rows(lay.tp), cfg.hidden_size, 1 + costs.mtp
        head_work = Work(flops=2 * tokens * vocab * h, bytes=vocab * h * a, gemms=1)
        joins = Work(flops=2 * tokens * 2 * h * h / lay.tp, bytes=2 * h * h / lay.tp * w, gemms=1)
        head = heads * head_work.time(gpu, high) + costs.mtp * joins.time(gpu, wl.dtype)
        ends = heads * tokens * moved.ends_per_token(vocab, h) / gpu.mem_Bps
        share = f_mem / (f_mem + b_mem) if f_mem + b_mem else 1 / 3  # split as the layers' traffic is
        head_f, head_b = head + share * ends, BACKWARD_FLOPS_RATIO * head + (1 - share) * ends
        w_comp += head  # its weight gradient, one of its backward's two products
    layers = f_comp + f_attn + f_mem + tp_f + ep_c + cp_f + f_floor  # the decoder layers' forward
    fwd = layers + head_f
    bwd = b_comp + b_attn + b_mem + head_b + tp_b + ep_c + cp_b + b_floor
    if lay.recompute == "full":  # the layers' forward again
        bwd += layers
    elif lay.recompute == "selective":
        bwd += f_attn + cp_f
    return StagePass(fwd, bwd, w_comp, tp_f + tp_b, ep_c, cp_f + cp_b, hidden)


def _attention_times(gpu, at: Work, keys: float, dtype: str, fused: bool) -> tuple[float, float]:
    """(forward, backward) seconds of a layer's attention core ``at`` where each query attends ``keys``
    keys: a ``fused`` (flash) kernel on the GPU's measured curve (``GpuSpec.attention_rate``; its
    backward recomputes the scores, ``C.FLASH_BACKWARD_RATIO`` forwards' FLOPs); unfused products, or
    a GPU with no curve, at the GEMM rate with a backward of ``BACKWARD_FLOPS_RATIO`` forwards."""
    fwd, bwd = gpu.attention_rate(keys, False, dtype), gpu.attention_rate(keys, True, dtype)
    if not fused or fwd is None or bwd is None:
        t = at.time(gpu, dtype)
        return t, BACKWARD_FLOPS_RATIO * t
    return at.time(gpu, dtype, rate=fwd), replace(at, flops=C.FLASH_BACKWARD_RATIO * at.flops).time(
        gpu, dtype, rate=bwd
    )


def _merged_pair(rest: float, trips: float, attention: float, floored: bool, gpu, dispatcher: str) -> float:
    """One MoE layer's forward of a micro-batch merged with its backward of another, as Megatron-Core's
    1F1B all-to-all overlap runs them (arXiv 2603.07685 §4.2.3: the compute on one stream, the
    dispatches and combines on another, the backward's weight gradients split off to fill the gaps):
    the ``trips`` of both passes hidden behind their ``rest`` (everything else of both), whose
    kernels run on the SMs DeepEP leaves them while it sends (``C.DEEPEP_SMS``). Under the block floor
    (``floored``) the pair takes at least the forward's ``attention`` (its layer but the MoE block) and
    one floor: the host waits for the forward's token counts, which follow its attention, then launches
    both passes' blocks; the backward's attention, with no such wait, runs while it launches."""
    carve = C.DEEPEP_SMS / gpu.sms if dispatcher == "deepep" and gpu.sms else 0.0
    pair = max(trips, rest + trips * carve)
    return max(pair, attention + C.MOE_BLOCK_FLOOR_S) if floored else pair


def _recomputed_products(cfg, rl, moe: bool, modules) -> tuple[list, list]:
    """(K, N) of the products a layer's recompute ``modules`` (``TrainWorkload.recompute_modules``) run
    again in backward, as (those whose input a norm writes, the others): latent attention's
    up-projections (the query's from its latent, the keys' and values' from theirs) and a dense
    layer's MLP, its gate-and-up after its norm (``shard.gemm_shapes``)."""
    normed = list(mla_up_projections(cfg, rl)) if "mla_up_proj" in modules and cfg.is_mla else []
    other = []
    if "mlp" in modules and not moe:
        gate_up, down = gemm_shapes(cfg, rl)["dense"]
        normed.append(gate_up)
        other.append(down)
    return normed, other


def _recomputed_work(products, tokens: float, w_bytes: int, k_half: float) -> Work:
    """``products`` (K, N) over ``tokens``, run again, each at its inner dimension's efficiency
    (``k_efficiency``)."""
    return Work(
        flops=2 * tokens * sum(k * n / k_efficiency(k, k_half) for k, n in products),
        bytes=sum(k * n for k, n in products) * w_bytes + tokens * sum(k + n for k, n in products) * C.BF16_BYTES,
        gemms=len(products),
    )


def warmup_passes(lay: Layout) -> int:
    """Forwards the first stage runs before its first backward, in model chunks: Megatron-Core's
    interleaved warm-up, 2(p - 1) + (v - 1)p (schedules.py ``get_pp_rank_microbatches``), at most
    every pass; as many backwards drain after its last forward."""
    p, v = lay.pp, lay.virtual
    return min(2 * (p - 1) + (v - 1) * p, lay.num_micro * v)


def unmerged_passes(lay: Layout) -> int:
    """Forwards (and as many backwards) the 1F1B all-to-all overlap leaves unmerged on the first stage,
    in model chunks: the warm-up (``warmup_passes``) and the one micro-batch more Megatron-Core adds so
    that no merged pair is one micro-batch's forward and backward; without a pipeline the first
    forward and the last backward (§4.2.3). At most every pass."""
    warm = warmup_passes(lay) + 1 if lay.pp > 1 else 1
    return min(warm, lay.num_micro * lay.virtual)


def check_flags(cfg, wl: TrainWorkload, fixed: dict) -> None:
    """Refuse a model-specific flag the model or the pinned layout leaves nothing to do for."""
    if wl.ep_overlap and not cfg.is_moe:
        raise PlanError("--ep-overlap hides MoE layers' all-to-alls, but the model has no experts; drop it")
    if wl.ep_overlap and (fixed.get("ep") == 1 or fixed.get("recompute") == "full"):
        pinned = "--ep 1" if fixed.get("ep") == 1 else "--recompute full"
        raise PlanError(
            f"--ep-overlap needs experts over more than one rank and no full recomputation (as Megatron-Core "
            f"requires), but {pinned} is pinned; drop one of them"
        )
    if wl.ep_overlap and fixed.get("pp", 1) > 1 and fixed.get("schedule", "interleaved") != "interleaved":
        raise PlanError(
            f"--ep-overlap runs a pipeline only interleaved (as Megatron-Core requires), but --schedule "
            f"{fixed['schedule']} is pinned with --pp {fixed['pp']}; pin --vpp N or drop --schedule"
        )
    if wl.pp_overlap and (fixed.get("pp") == 1 or fixed.get("schedule", "interleaved") != "interleaved"):
        pinned = "--pp 1" if fixed.get("pp") == 1 else f"--schedule {fixed['schedule']}"
        raise PlanError(
            f"--pp-overlap hides the interleaved schedule's hops between stages (as Megatron-Core runs them), "
            f"but {pinned} is pinned; pin --vpp N or drop --pp-overlap"
        )
    pp = fixed.get("pp", 1)
    if fixed.get("schedule") == "interleaved" and "virtual" not in fixed and cfg.num_layers // pp < 2:
        raise PlanError(
            f"--schedule interleaved splits each stage's layers into 2 or more chunks, but {cfg.num_layers} layers "
            f"over --pp {pp} leave {cfg.num_layers // pp} a stage; lower --pp or pin another --schedule"
        )
    if wl.recompute_modules and fixed.get("recompute") == "full":
        raise PlanError(
            f"--recompute-modules {','.join(wl.recompute_modules)} adds modules to a layout's recomputation, but "
            "--recompute full is pinned, which recomputes every layer whole; drop one of them"
        )
    if "mla_up_proj" in wl.recompute_modules and not cfg.is_mla:
        raise PlanError(
            "--recompute-modules mla_up_proj recomputes latent attention's up-projections, but the model has "
            "none; drop it"
        )
    if "mlp" in wl.recompute_modules and all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        raise PlanError(
            "--recompute-modules mlp recomputes a dense layer's MLP, but every layer of the model is MoE; drop it"
        )


def boundary_bytes(cfg, lay: Layout, kernels: str, tokens: float, a: int) -> float:
    """Bytes one rank sends the next stage for a micro-batch's ``tokens`` (and its gradient back):
    the residual stream alone where the next layer's norm reads it (Megatron-Core, ``--kernels
    fused``), or the layer's output and the residual apart, as shardlm's trainer sends them for its
    fused add-norm (``train/schedule.py``); with sequence parallelism each tp rank holds and sends
    its 1/tp of the tokens, each pair of ranks over its own links."""
    tensors = 1 if kernels == "fused" else 2
    return tensors * tokens / (lay.tp if lay.sp else 1) * cfg.hidden_size * a


def pp_overlaps(lay: Layout, wl: TrainWorkload) -> bool:
    """Whether ``wl.pp_overlap`` applies to ``lay``: Megatron-Core overlaps the hops between stages in
    its interleaved schedule only."""
    return wl.pp_overlap and lay.pp > 1 and lay.schedule == "interleaved"


def ep_overlaps(cfg, lay: Layout, wl: TrainWorkload) -> bool:
    """Whether ``wl.ep_overlap`` applies to ``lay``: Megatron-Core allows its 1F1B all-to-all overlap
    with experts over more than one rank, a pipeline only interleaved, and no full recomputation
    (TransformerConfig's checks)."""
    interleaved_or_none = lay.pp == 1 or lay.schedule == "interleaved"
    return wl.ep_overlap and cfg.is_moe and lay.ep > 1 and interleaved_or_none and lay.recompute != "full"


def _moe_floor(forward: float, backward: float) -> tuple[float, float]:
    """What an MoE block priced at ``forward`` and ``backward`` seconds (its router, experts and
    their trip, the layer's memory-bound traffic: the layer but its attention's products and core)
    waits beyond them under Megatron-Core's floor (``C.MOE_BLOCK_FLOOR_S``), split between the
    passes as they are priced."""
    below = C.MOE_BLOCK_FLOOR_S - forward - backward
    if below <= 0:
        return 0.0, 0.0
    return below * forward / (forward + backward), below * backward / (forward + backward)


def _tp_exposed(ar: float, t_pass: float, share: float, tp: int, moe: bool, overlap: bool) -> float:
    """One pass's exposed TP time for a layer of two blocks, each with one all-reduce's worth of
    collectives ``ar``: waited for, or (``overlap``) pipelined with the block's GEMMs, attention's
    ``share`` of the pass's ``t_pass`` and the dense MLP's rest; an MoE block's always wait."""
    if not overlap:
        return 2 * ar
    mlp = ar if moe else comm.pipelined(ar, (1 - share) * t_pass, tp)
    return comm.pipelined(ar, share * t_pass, tp) + mlp


def _attention_share(rl, pairs: float) -> float:
    """Attention's share of a layer's product FLOPs on the rank: its projections against the dense
    MLP, the router and ``pairs`` routed (token, choice) pairs a token of the rank."""
    return rl.attn / (rl.attn + rl.dense + rl.router + pairs * rl.expert_params)


def _traffic_widths(cfg, rl, lay: Layout, pairs: float) -> tuple[float, float, float, float]:
    """(hidden, intermediate, query, KV) widths one rank's share of a layer's traffic scales with:
    the hidden states whole on every tp rank (1/tp of the tokens with SP), the rest split; an MoE
    layer adds its routed experts' rows per token: ``pairs``, the (token, choice) pairs the busiest
    ep rank computes per token of this rank (0 for a dense layer), each expert's rows over etp (as
    ``layer_work`` prices their GEMMs)."""
    h = cfg.hidden_size
    hidden = h / lay.tp if lay.sp else h
    per_row = 3 if cfg.gated_mlp else 2  # a gated MLP's gate, up and down projections; else up and down
    inter = rl.dense / (per_row * h)
    inter += pairs * cfg.moe_intermediate_size / lay.etp
    return hidden, inter, rl.q_heads * cfg.head_dim, rl.kv_heads * cfg.head_dim


def _fp8_cast_widths(cfg, rl, moe: bool, pairs: float) -> tuple[float, float, float]:
    """Widths per token that an FP8 layer casts on one rank, from its products' (K, N)
    (``shard.gemm_shapes``), as Megatron-Core lays its modules on Transformer Engine's: (the forward's
    inputs a norm writes, its other inputs, the backward's output gradients; ``FP8_CAST_BYTES`` an
    element by kind). A norm writes the inputs of the linears it is fused with (LayerNormLinear): the
    qkv projection's, latent attention's up-projections' (their latents' norms), a dense layer's
    gate-and-up's. The others: the attention output into o_proj, the activation into the down
    projection, latent attention's down-projections (after a norm of their own), an MoE layer's shared
    experts' input (its norm stands alone: the router reads it too) and both of each routed pair's
    expert (its row copied into expert order, its activation). Backward: every product's output
    gradient. ``pairs``: routed pairs per token; the router stays 16-bit."""
    shapes = gemm_shapes(cfg, rl)
    attn, dense = shapes["attn"], shapes["dense"]
    normed = sum(k for k, _ in mla_up_projections(cfg, rl)) if cfg.is_mla else attn[0][0]
    normed += dense[0][0] if dense and not moe else 0
    every = sum(k for part in ("attn", "dense") for k, _ in shapes[part]) + pairs * sum(k for k, _ in shapes["expert"])
    bwd = sum(n for part in ("attn", "dense") for _, n in shapes[part]) + pairs * sum(n for _, n in shapes["expert"])
    return normed, every - normed, bwd


def _with_zero3(
    costs: ModelCosts, cluster: Cluster, lay: Layout, wl: TrainWorkload, stage: int, t: StagePass
) -> StagePass:
    """``_stage``'s times with ZeRO-3's exposed gathers and reduce-scatters added to forward and
    backward (they sit in each micro-batch's passes, so the pipeline's bubble grows with them too)."""
    if lay.zero < 3 or lay.dp * lay.cp == 1:
        return t
    e_f, e_b = zero3_exposed(
        costs,
        cluster,
        lay,
        stage,
        t.forward,
        t.backward,
        wl.prefetch,
        wl.zero3_reduce,
        GRAD_REDUCE_BYTES[wl.grad_reduce],
    )
    return t._replace(forward=t.forward + e_f, backward=t.backward + e_b, zero3=e_f + e_b)


def zero3_exposed(
    costs: ModelCosts,
    cluster: Cluster,
    lay: Layout,
    stage: int,
    fwd: float,
    bwd: float,
    prefetch: int,
    reduce: str = "blocking",
    grad_bytes: int = REDUCED_GRAD_BYTES,
) -> tuple[float, float]:
    """ZeRO-3's communication one micro-batch waits for on ``stage`` (forward, backward), as
    shardlm's trainer runs it (shardlm/train/zero.py; Rajbhandari et al. 2019 §5.3): each decoder
    layer is a unit whose weights are all-gathered over the dp x cp ranks (G) for its forward and
    again for its backward, and whose gradients are reduce-scattered (R) right after its backward
    (blocking, in autograd's backward of the gather); the embedding and LM head form one more unit
    (never prefetched), and so do an MoE layer's experts, over the ranks holding the same expert
    slices: the trainer gathers them when it meets them, so their gathers always wait in full (not
    so under ``reduce`` "overlapped", priced as FSDP2 and Megatron-FSDP run it: they prefetch the
    experts with the rest of the layer). With
    ``prefetch`` >= 1 the next layer's (dense) gather is in flight while one
    computes (``overlap.Prefetch``), so per layer only what the link needs beyond that layer's
    compute waits: on L layers of f forward and b backward each,

        forward  = G + (L - 1) max(0, G - f) + E
        backward = G + (L - 1) max(0, G - b) + L R + E

    with G a layer's dense gather and E the stage's expert gathers (the first gather has nothing to
    hide behind); deeper prefetch adds nothing once every layer
    is alike, since one link carries the gathers in turn. With ``prefetch`` 0 all of it waits:
    L G and L (G + R). G and R are one ring over the group (``comm.ring_gather``): the latency
    grows with the group (n - 1 steps), and across nodes the bytes go at one NIC's rate per GPU.
    G moves the 16-bit weights, R the gradients at ``grad_bytes`` a parameter (``GRAD_REDUCE_BYTES``:
    float32 as shardlm's trainer sends them, twice G's bytes).

    ``reduce`` "overlapped" (FSDP2, Megatron-FSDP): each reduce-scatter runs on its own stream
    while the layers below compute their backward. The one link then carries a layer's R and the
    next gather together beside one layer's backward, and only the last R has nothing after it:

        backward = G + (L - 1) max(0, G + R - b) + R    (no prefetch: L G + (L - 1) max(0, R - b) + R,
                                                         each gather at the whole link's rate: optimistic)"""
    cfg = costs.cfg
    dp_group = lay.slowest_group("dp_cp", cluster.gpus_per_node)
    # the ranks holding the same expert slices: edp (x cp, whose ranks the planner's groups leave out)
    edp_group = lay.slowest_group("edp", cluster.gpus_per_node) if cfg.is_moe else []
    n_dense, n_moe = costs.stage_kinds(lay.pp)[stage]
    layers = n_dense + n_moe
    if layers == 0:
        return 0.0, 0.0

    def unit(moe: bool, per_param: int) -> tuple[float, float]:  # one layer's rings: (its dense parts over
        # dp x cp, its experts over their own copies)
        rl = costs.rank_layer(moe, lay.tp, lay.ep, lay.etp)
        experts = rl.experts * rl.expert_params
        return comm.ring_gather((rl.total - experts) * per_param, dp_group, cluster), comm.ring_gather(
            experts * per_param, edp_group, cluster
        )

    def mean_layer(per_param: int, experts: bool) -> float:  # a mean layer's gather, with or without its experts
        dense, moe = unit(False, per_param), unit(True, per_param)
        return (n_dense * dense[0] + n_moe * (moe[0] + experts * moe[1])) / layers

    overlapped = reduce == "overlapped"  # FSDP2 and Megatron-FSDP prefetch every unit, the experts' too
    g, r = mean_layer(PARAM_BYTES, overlapped), mean_layer(grad_bytes, True)  # 16-bit weights, reduced grads
    expert_gathers = 0.0 if overlapped else n_moe * unit(True, PARAM_BYTES)[1]  # when met: never prefetched
    rest = outer_params(costs, lay, stage)
    g_rest = comm.ring_gather(rest * PARAM_BYTES, dp_group, cluster)
    r_rest = comm.ring_gather(rest * grad_bytes, dp_group, cluster)
    f, b = fwd / layers, bwd / layers
    if prefetch >= 1:
        e_f = g + (layers - 1) * max(0.0, g - f)
        if reduce == "overlapped":
            e_b = g + (layers - 1) * max(0.0, g + r - b) + r
        else:
            e_b = g + (layers - 1) * max(0.0, g - b) + layers * r
    else:
        e_f = layers * g
        e_b = layers * g + ((layers - 1) * max(0.0, r - b) + r if reduce == "overlapped" else layers * r)
    return e_f + expert_gathers + g_rest, e_b + expert_gathers + g_rest + r_rest


def unfused_scores_bytes(cfg, seq_len: int, a: int) -> float:
    """Bytes of the score matrix one query moves per head in an unfused attention's forward: its
    row over the whole sequence (the causal mask is applied, not skipped) written by QK^T, read and
    written by the (fused scale-mask-)softmax, read by PV (4 x a bytes an element), and with
    dropout its 1-byte mask written and the dropped probabilities written and read (+5)."""
    return seq_len * (4 * a + (5 if cfg.dropout else 0))
