"""The planner against published measurements, each row with its source (collected 2026-11-26 from
the sources' own text; the issue's held-out exam is not here). The layouts are pinned as published
and the planner predicts the throughput (serving at a concurrency: also TTFT and TPOT) the source
reports. ``python tests/unit/test_plan_published.py`` prints the table of docs/plan.md; the test
holds each source's mean and max error to what the planner reaches today, so a change that makes it
worse fails, and ``test_the_validation_meets_its_targets`` holds each class's mean (dense and MoE
training, serving TPOT) to the issue's target."""

from __future__ import annotations

import functools
import json
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

import pytest

from shardlm.plan.catalog import load_model
from shardlm.plan.inference import InferenceWorkload
from shardlm.plan.layout import Layout
from shardlm.plan.memory import kv_bytes_per_seq_token, training_activation_bytes, weight_bytes
from shardlm.plan.planner import PlanRequest, plan
from shardlm.plan.roofline import ModelCosts
from shardlm.plan.training import TrainWorkload
from shardlm.plan.zero import model_states

MEGATRON = "Narayanan et al. 2021, arXiv 2104.04473, Table 1"
ZERO3 = "Narayanan et al. 2021, Table 2, ZeRO-3"
PTDP = "Narayanan et al. 2021, Table 2, PTD-P"
KORTHIKANTI = "Megatron-LM README (Korthikanti et al. 2022 layouts)"
LLAMA3 = "Dubey et al. 2024, arXiv 2407.21783, Table 4"
TRTLLM = "TensorRT-LLM perf-overview.md (H100 SXM, FP8)"
NIM = "NVIDIA NIM 1.8.0 benchmarks, Llama 3.3 70B, 2 x H100, FP8 TP2, 5000/500"
DSV3 = "DeepSeek-V3 pre-training, arXiv 2412.19437 (2,048 H800s, FP8)"
MCORE_MOE = "Megatron-Core MoE README (MCore v0.9), Mixtral 8x7B on H100"
QWEN3_MCORE = "Megatron-MoE-ModelZoo, Qwen3-235B-A22B on 256 H100s"
SHARDLM_H100 = "shardlm train on one H100 (docs/performance.md, 2026-11-26)"
NEMO_DENSE = "Megatron-Bridge performance summary, NeMo 25.11, DGX-H100, FP8, dense"
NEMO_MOE = "Megatron-Bridge performance summary, NeMo 25.11, DGX-H100, FP8, MoE"
NEMO_BW_DENSE = "Megatron-Bridge performance summary, NeMo 25.11, DGX-B200 and GB200, FP8, dense"
NEMO_BW_MOE = "Megatron-Bridge performance summary, NeMo 25.11, DGX-B200, FP8, MoE"
NEMO_2604_MOE = "Megatron-Bridge performance summary, NeMo 26.04.01, DGX-H100, B200 and GB200, FP8, MoE"
MCORE_REPORT = "Megatron-Core MoE report, arXiv 2603.07685, Table 11, H100, GB200 and GB300"
TINYLLAMA = "llama:2048,5632,22,32,4,32000"
"""TinyLlama-1.1B's shape: hidden, intermediate, layers, heads, KV heads, vocabulary."""


@dataclass(frozen=True)
class Row:
    source: str
    what: str  # the row as the source names it
    model: str  # a preset, or "gpt:h,heads,layers" (Megatron's GPT: V 51200)
    gpu: str
    gpus: int
    published: float
    unit: str  # "TFLOP/s/GPU" (Megatron's count, recomputation included), "MFU", "tok/s", "TTFT ms", "TPOT ms"
    pins: dict = field(default_factory=dict)
    global_batch: int = 0
    seq_len: int = 2048
    dtype: str = "bf16"
    io: tuple[int, int] = (0, 0)  # serving: input and output tokens
    concurrency: int | None = None  # serving: requests in flight (closed loop), as the source ran it
    fused_attention: bool = True  # Megatron-LM 2021 materialised the scores (no flash attention yet)
    kernels: str = "fused"  # training: every source ran fused norm, activation, rotary and Adam kernels
    flops_per_token: float = 0.0  # "TFLOP/s/GPU" counted as the source counts it (0: Megatron's GPT formula)
    dispatcher: str = "shardlm"  # MoE: how the source's tokens crossed nodes (plan/comm.py DISPATCHERS)
    zero3_reduce: str = "blocking"  # ZeRO-3: how the source's reduce-scatters met backward (training.ZERO3_REDUCE)
    grad_reduce: str = "fp32"  # the dtype the source's gradients crossed dp in (training.GRAD_REDUCE_BYTES)
    tp_overlap: bool = False  # the source pipelined TP's collectives with its GEMMs (--tp-overlap)
    ep_overlap: bool = False  # the source hid the MoE trip behind another micro-batch (--ep-overlap)
    pp_overlap: bool = False  # the source's interleaved hops behind the chunks beside them (--pp-overlap)
    recompute_modules: tuple[str, ...] = ()  # Megatron's recompute modules beyond --recompute (--recompute-modules)
    mtp: int = 0  # multi-token-prediction modules the source trained (--mtp)
    fp8_recipe: str | None = (
        None  # FP8: the source's scaling recipe (--fp8-recipe; None: Megatron-LM's default, delayed)
    )
    gpus_per_node: int | None = None  # GPUs of the job that share an NVLink domain (None: the catalog's node)


def _tok_s(source: str, what: str, model: str, gpu: str, gpus: int, tok_s: float, *, tp: int, pp: int, vp: int,
           ep: int, mb: int, recompute: str, cp: int = 1, offload: bool = False, **workload) -> Row:  # fmt: skip
    """A tokens/s-per-GPU row of a Megatron-Core run: its layout pinned (ZeRO-1, the distributed
    optimizer; interleaved when ``vp`` > 1; its optimizer states on the host with ``offload``; ring
    attention where ``cp`` > 1, Megatron-LM's default ``--cp-comm-type p2p``: the sources name no other),
    ``workload`` the rest of the Row (batch, dtype, ...)."""
    pins = dict(tp=tp, pp=pp, cp=cp, dp=gpus // (tp * pp * cp), ep=ep, micro_batch=mb, zero=1, recompute=recompute)
    pins |= dict(schedule="interleaved", virtual=vp) if vp > 1 else dict(schedule="1f1b") if pp > 1 else {}
    pins |= dict(offload=True) if offload else {}
    pins |= dict(cp_attention="ring") if cp > 1 else {}  # Megatron-LM's default --cp-comm-type p2p
    return Row(source, what, model, gpu, gpus, tok_s, "tok/s/GPU", pins, pp_overlap=vp > 1, **workload)


def _gpt(h: int, heads: int, layers: int, gpus: int, batch: int, tflops: float, tp: int, pp: int, **kw) -> Row:
    pins = dict(tp=tp, pp=pp, dp=gpus // (tp * pp), recompute="full", zero=0)
    pins |= {"schedule": "interleaved"} if pp > 1 else {}
    source = MEGATRON if "micro_batch" not in kw else ZERO3 if kw.get("zero") == 3 else PTDP
    return Row(source, f"{h}h {layers}L, tp{tp} pp{pp}, {gpus} GPUs", f"gpt:{h},{heads},{layers}", "a100-80g", gpus,
               tflops, "TFLOP/s/GPU", {**pins, **kw}, batch, fused_attention=False)  # fmt: skip


MCORE_REPORT_ROWS = (  # what, model, GPU, GPUs, dtype, global batch, micro-batch, tp, pp, vp, ep, recompute, its modules, 1F1B overlap, tokens/s/GPU
    ("DeepSeek-V3, 1,024 H100s, FP8, tp2 pp8 vp4 ep64, DeepEP", "deepseek-v3", "h100-sxm", 1024, "fp8", 8192, 1, 2, 8, 4, 64, "none", "mla_up_proj,mlp", True, 1_412),
    ("DeepSeek-V3, 256 GB200s, BF16, pp8 vp4 ep32, HybridEP", "deepseek-v3", "gb200", 256, "bf16", 4096, 1, 1, 8, 4, 32, "none", "mlp", False, 3_298),
    ("Qwen3-235B, 256 GB200s, BF16, pp4 vp12 ep32, HybridEP", "qwen3-235b-a22b", "gb200", 256, "bf16", 8192, 1, 1, 4, 12, 32, "selective", "", True, 5_100),
    ("DeepSeek-V3, 256 GB300s, MXFP8, pp4 vp4 ep64, HybridEP", "deepseek-v3", "gb300", 256, "fp8", 8192, 1, 1, 4, 4, 64, "none", "", True, 4_730),
    ("Qwen3-235B, 256 GB300s, MXFP8, pp4 vp6 ep64 mb2, HybridEP", "qwen3-235b-a22b", "gb300", 256, "fp8", 3072, 2, 1, 4, 6, 64, "none", "", False, 6_583),
    ("Qwen3-235B, 256 H100s, BF16, tp2 pp8 vp4 ep32, DeepEP", "qwen3-235b-a22b", "h100-sxm", 256, "bf16", 2048, 1, 2, 8, 4, 32, "selective", "", True, 2_132),
)  # fmt: skip
"""The Megatron-Core MoE report's rows on GPUs the catalog holds (ROWS below says what each ran)."""

NEMO_2604_ROWS = (  # what, model, GPU, GPUs, global batch, micro-batch, tp, pp, vp, ep, dispatcher, 1F1B overlap, tokens/s/GPU
    ("H100: Qwen3-235B, tp2 pp8 vp4 ep32", "qwen3-235b-a22b", "h100-sxm", 256, 8192, 1, 2, 8, 4, 32, "shardlm", True, 1_712),
    ("B200: Qwen3-235B, pp8 ep8", "qwen3-235b-a22b", "b200", 256, 8192, 1, 1, 8, 1, 8, "shardlm", False, 3_776),
    ("B200: DeepSeek-V3, pp8 vp2 ep32, DeepEP", "deepseek-v3", "b200", 256, 4096, 1, 1, 8, 2, 32, "deepep", True, 3_328),
    ("H100: Qwen3-30B-A3B, 16 GPUs, ep16, HybridEP", "qwen3-30b-a3b", "h100-sxm", 16, 1024, 1, 1, 1, 1, 16, "deepep", False, 8_960),
    ("B200: Qwen3-30B-A3B, 8 GPUs, ep8 mb4, HybridEP", "qwen3-30b-a3b", "b200", 8, 512, 4, 1, 1, 1, 8, "deepep", False, 27_136),
    ("GB200: Qwen3-30B-A3B, 8 GPUs, ep8 mb4, HybridEP", "qwen3-30b-a3b", "gb200", 8, 512, 4, 1, 1, 1, 8, "deepep", False, 26_112),
)  # fmt: skip
"""Megatron-Bridge's 26.04.01 MoE rows (ROWS below says what each ran)."""


ROWS = [
    # Table 1 (weak scaling; interleaved schedule, full recomputation, A100 80GB, s 2048, V 51200)
    _gpt(2304, 24, 24, 32, 512, 137, 1, 1),
    _gpt(3072, 32, 30, 64, 512, 138, 2, 1),
    _gpt(4096, 32, 36, 128, 512, 142, 4, 1),
    _gpt(6144, 48, 40, 256, 1024, 135, 8, 1),
    _gpt(8192, 64, 48, 512, 1536, 138, 8, 2),
    _gpt(10240, 80, 60, 1024, 1792, 140, 8, 4),
    _gpt(12288, 96, 80, 1536, 2304, 148, 8, 8),
    _gpt(16384, 128, 96, 1920, 2160, 155, 8, 16),
    _gpt(20480, 128, 105, 2520, 2520, 163, 8, 35),
    _gpt(25600, 160, 128, 3072, 3072, 163, 8, 64),
    # Table 2: 174.6B (GPT-3's sizes), global batch 1536: ZeRO-3 without model parallelism, then PTD-P
    _gpt(12288, 96, 96, 384, 1536, 144, 1, 1, zero=3, micro_batch=4),
    _gpt(12288, 96, 96, 768, 1536, 88, 1, 1, zero=3, micro_batch=2),
    _gpt(12288, 96, 96, 1536, 1536, 44, 1, 1, zero=3, micro_batch=1),
    _gpt(12288, 96, 96, 384, 1536, 153, 8, 12, micro_batch=1),
    _gpt(12288, 96, 96, 768, 1536, 149, 8, 12, micro_batch=1),
    _gpt(12288, 96, 96, 1536, 1536, 141, 8, 12, micro_batch=1),
    # MFU at dp=1, selective recomputation with sequence parallelism (Korthikanti et al. Table 3)
    *(
        Row(
            KORTHIKANTI,
            what,
            f"gpt:{h},{a},{n}",
            "a100-80g",
            gpus,
            mfu,
            "MFU",
            dict(tp=8, pp=pp, dp=1, recompute="selective", micro_batch=mb, zero=0)
            | (dict(schedule="interleaved") if pp > 1 else {}),
            batch,
            fused_attention=False,  # 2022: before Megatron-LM used flash attention
        )
        for what, h, a, n, pp, gpus, batch, mb, mfu in (
            ("22B", 6144, 64, 48, 1, 8, 4, 4, 0.415),
            ("175B", 12288, 96, 96, 8, 64, 64, 1, 0.514),
            ("530B", 20480, 128, 105, 35, 280, 280, 1, 0.560),
            ("1T", 25600, 160, 128, 64, 512, 512, 1, 0.563),
        )
    ),
    # Llama 3 405B pre-training on H100: 8K sequences, 16M tokens a step, no recomputation, FSDP
    # that keeps the weights after forward (ZeRO-2), the interleaved schedule at a depth the paper
    # does not give, with 7-layer first and last stages. Zero-bubble stands in: interleaving without
    # recomputation does not fit the planner's memory count (v2: 81.7 GiB of activations, 90.3 of 80)
    *(
        Row(
            LLAMA3,
            f"{gpus} GPUs, tp8 pp16 dp{dp}",
            "llama-3.1-405b",
            "h100-sxm",
            gpus,
            tflops,
            "TFLOP/s/GPU",
            dict(tp=8, pp=16, dp=dp, cp=1, recompute="none", schedule="zb-h1", zero=2),
            2048,
            8192,
        )
        for gpus, dp, tflops in ((8192, 64, 430), (16384, 128, 400))
    ),
    # serving: total output tokens/s at an unbounded request rate, FP8, uniform lengths
    *(
        Row(
            TRTLLM,
            f"{name} tp{tp} {i}/{o}",
            model,
            "h100-sxm",
            tp,
            tps,
            "tok/s",
            dict(tp=tp, pp=1, dp=1),
            dtype="fp8",
            io=(i, o),
        )
        for name, model, tp, results in (
            ("Llama 3.1 8B", "llama-3-8b", 1, (28312, 15220, 9305, 3459)),
            ("Llama 3.3 70B", "llama-3-70b", 2, (6378, 4205, 3082, 898)),
            ("Llama 3.1 405B", "llama-3.1-405b", 8, (3627, 2919, 2296, 610)),
        )
        for (i, o), tps in zip(((128, 128), (1000, 1000), (2048, 2048), (5000, 500)), results)
    ),
    # serving at a concurrency (AIPerf's closed loop, fixed lengths): TTFT, ITL (= TPOT), output tokens/s,
    # https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance, "Llama-3.3-70b-instruct Results",
    # "Version: 1.8.0", "2 x H100 80G", "fp8 TP2", "5000 Input Tokens / 500 Output Tokens"; NIM's own
    # engine settings (its token budget, batch limit) are not given: the planner uses shardlm's
    *(
        Row(
            f"{NIM}, {what}",
            f"C={c}",
            "llama-3-70b",
            "h100-sxm",
            2,
            value,
            unit,
            dict(tp=2, pp=1, dp=1),
            dtype="fp8",
            io=(5000, 500),
            concurrency=c,
        )
        for c, ttft, itl, tps in (
            (1, 406.77, 18.58, 51.67),
            (5, 546.7, 21.83, 218.48),
            (25, 688.69, 38.75, 623.4),
            (50, 834.51, 59.73, 814.37),
            (100, 7996.25, 92.91, 917.26),
            (150, 34794.22, 92.86, 920.9),
            (200, 61680.22, 93.06, 920.54),
            (250, 88605.32, 93.2, 920.12),
        )
        for what, value, unit in (("TTFT", ttft, "TTFT ms"), ("TPOT", itl, "TPOT ms"), ("tok/s", tps, "tok/s"))
    ),
]


def _mcore_flops_per_token(h: int, layers: int, heads: int, groups: int, ffn: int, topk: int, vocab: int, s: int):
    """Megatron-LM's FLOPs per token (megatron/training/training.py num_floating_point_operations,
    the count behind MCore's TFLOP/s): 12 l h^2 ((1 + g/a + s/h) + ffn/h x topk x 3/2 (SwiGLU) + V/(2 l h))."""
    return 12 * layers * h * h * ((1 + groups / heads + s / h) + ffn / h * topk * 1.5 + vocab / (2 * layers * h))


ROWS += [
    # MoE pre-training, the published layout pinned. DeepSeek-V3: "training DeepSeek-V3 on each
    # trillion tokens requires only 180K H800 GPU hours, i.e., 3.7 days on our cluster with 2048 H800
    # GPUs" (§1, Table 1: pre-training 2,664K GPU hours for 14.8T tokens; also the repository's
    # README), "16-way Pipeline Parallelism (PP), 64-way Expert Parallelism (EP) spanning 8 nodes,
    # and ZeRO-1 Data Parallelism (DP)" and no TP (§3.2), FP8 GEMMs (§3.3), 4K sequences, batch
    # 15,360 after a ramp over the first 469B tokens (§4.2): 1e12 / (180e3 x 3600) = 1,543 tokens/s
    # per GPU, a wall-clock average over the whole run. DualPipe (§3.2.1) is not a planner schedule:
    # the search picks one; the 14B-parameter MTP module is not in the preset.
    Row(
        DSV3,
        "pp16 ep64 dp128 zero1, 180K GPU-hours per 1T tokens",
        "deepseek-v3",
        "h800-sxm",
        2048,
        1e12 / (180e3 * 3600),
        "tok/s/GPU",
        dict(tp=1, pp=16, dp=128, ep=64, zero=1, schedule="zb-h1"),
        global_batch=15360,
        seq_len=4096,
        dtype="fp8",
        dispatcher="deepep",  # a token over IB once per node, at most 4 (§3.2.2), DeepEP's origin
        recompute_modules=("mla_up_proj",),  # "we recompute all RMSNorm operations and MLA up-projections" (§3.2.3)
        mtp=1,  # "we set D to 1" (§2.2, §4.2)
        fp8_recipe="blockwise",  # 1 x 128 activation tiles, 128 x 128 weight blocks (§3.3.2)
    ),
    # Mixtral 8x7B: "With MCore v0.9, we've achieved remarkable performance of 468 TFLOPS for Mixtral
    # 8X7B bf16 training" (https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/transformer/moe/README.md),
    # with its "Reference Best Parallel Mapping" (of MCore v0.8): 64 GPUs, dropless, all-to-all
    # dispatcher, BF16, SEQ LEN 4096, TP 1, EP 8, PP 4, VP 8, MBS 1, GBS 256, on "8xH100 80GB HBM3,
    # NVLink 4th Generation, InfiniBand 8x400 Gbit/s"; the distributed optimizer (ZeRO-1) as its
    # example script runs it. TFLOP/s as Megatron counts them (_mcore_flops_per_token).
    Row(
        MCORE_MOE,
        "tp1 pp4 ep8 dp16 vpp8 mb1, 64 GPUs",
        "mixtral-8x7b",
        "h100-sxm",
        64,
        468,
        "TFLOP/s/GPU",
        dict(tp=1, pp=4, dp=16, ep=8, schedule="interleaved", virtual=8, micro_batch=1, zero=1),
        global_batch=256,
        seq_len=4096,
        flops_per_token=_mcore_flops_per_token(4096, 32, 32, 8, 14336, 2, 32000, 4096),
        pp_overlap=True,  # Megatron-LM's default (--no-overlap-p2p-communication turns it off)
    ),
    # Qwen3-235B-A22B in Megatron-Core (https://github.com/yanring/Megatron-MoE-ModelZoo, file
    # best_practice/Qwen3/readme.md, "Performance Results"): 256 H100s, "NVLink 4th Generation,
    # InfiniBand 8x50 GB/s", BF16, SEQ LEN 4096, GBS 2048, each row's TP/EP/PP/VPP/DP/FSDP/MBS and
    # step time; tokens/s per GPU = 2048 x 4096 / (step x 256). Recompute "norm, act" (layernorm and
    # the MoE activation) is pinned as the planner's selective (the attention core and the gated
    # activation); ETP 1. Interleaving 94 layers over pp8 x vpp4 or pp32 x vpp3 takes uneven chunks
    # (Megatron's pipeline layouts; a pinned --vpp allows them). The "+1f1b overlap" row hides the
    # all-to-all behind another micro-batch's compute (--ep-overlap; the pair's gain is checked in
    # test_the_overlap_gain_is_priced_as_measured). Qwen3-Next-80B-A3B (linear attention) is not a
    # preset and is left out.
    *(
        Row(
            QWEN3_MCORE,
            what,
            "qwen3-235b-a22b",
            "h100-sxm",
            256,
            2048 * 4096 / (step * 256),
            "tok/s/GPU",
            dict(tp=tp, pp=pp, dp=256 // (tp * pp), ep=ep, micro_batch=mb, zero=zero, recompute=rc)
            | (dict(schedule="interleaved", virtual=vpp) if vpp > 1 else {}),
            global_batch=2048,
            seq_len=4096,
            dispatcher=dispatcher,  # the all-to-all row: every pair, as shardlm's
            ep_overlap="1F1B" in what,
            pp_overlap=vpp > 1,  # Megatron-LM's default for the interleaved schedule
            zero3_reduce="overlapped",  # the Megatron-FSDP row: --overlap-grad-reduce (model_configs/.../Qwen3-235B-A22B.yaml)
            # and, Megatron-FSDP's only, --grad-reduce-in-bf16: its user guide's recommended flags
            # (Megatron-LM docs/discussions/megatron-fsdp-user-guide, as its DeepSeek-V3 example script
            # runs); the source's table does not list the row's flags (fp32: -29%)
            grad_reduce="bf16" if zero == 3 else "fp32",
        )
        for what, tp, pp, vpp, ep, mb, zero, rc, dispatcher, step in (
            (
                "tp2 pp8 vpp4 ep32 dp16 mb1, norm + act recompute, DeepEP",
                2,
                8,
                4,
                32,
                1,
                1,
                "selective",
                "deepep",
                19.7,
            ),
            ("the same + 1F1B all-to-all overlap (DeepEP)", 2, 8, 4, 32, 1, 1, "selective", "deepep", 17.6),
            ("tp2 ep8 dp128 FSDP mb4, full recompute, DeepEP", 2, 1, 1, 8, 4, 3, "full", "deepep", 17.6),
            (
                "tp2 pp32 vpp3 ep8 dp4 mb1, norm + act recompute, all-to-all",
                2,
                32,
                3,
                8,
                1,
                1,
                "selective",
                "shardlm",
                24.2,
            ),
            ("tp4 pp8 vpp4 ep8 dp8 mb1, DeepEP", 4, 8, 4, 8, 1, 1, "none", "deepep", 29.0),
        )
    ),
    # this project's own trainer, eager, bfloat16, one GPU (docs/performance.md, "On a GPU"): SmolLM2-135M's
    # shape at 16 x 512 tokens (`shardlm train`, median of steps 6-20) and TinyLlama-1.1B's at 4 x 2048
    # (benchmarks/train_profile.py); random weights; its counted memory-bound traffic (--kernels shardlm)
    *(
        Row(
            SHARDLM_H100,
            what,
            model,
            "h100-sxm",
            1,
            tok_s,
            "tok/s/GPU",
            dict(tp=1, pp=1, dp=1, micro_batch=batch),
            global_batch=batch,
            seq_len=seq,
            kernels="shardlm",
        )
        for what, model, batch, seq, tok_s in (
            ("SmolLM2-135M's shape, 16 x 512", "smollm2-135m", 16, 512, 116_051),
            ("TinyLlama-1.1B's shape, 4 x 2048", TINYLLAMA, 4, 2048, 39_157),
        )
    ),
    # NVIDIA's Megatron-Bridge performance summary (github.com/NVIDIA-NeMo/Megatron-Bridge,
    # docs/performance-summary.md, "25.11 NeMo Container", DGX-H100): pre-training tokens/s per GPU
    # with FP8 current scaling (per-tensor, every layer FP8). Each row's settings are its recipe's at
    # the release tag v0.2.0 (scripts/performance/configs/{llama3,llama31,qwen3}/workload_base_configs.py
    # and *_llm_pretrain.py): the distributed optimizer, gradients reduced in bf16
    # (grad_reduce_in_fp32 = False), no recomputation; the MoE row's token dispatcher all-to-all (no
    # DeepEP) with forced-balanced routing ("In MoE training benchmarks, we force-balance the token
    # distribution among experts"); the 70B and 405B rows overlap TP's collectives with the GEMMs
    # (tp_comm_overlap, userbuffers: --tp-overlap), the MoE row does not (tp_comm_overlap=False) but
    # overlaps its all-to-all (overlap_moe_expert_parallel_comm: --ep-overlap). Llama 3 8B's row (FSDP in the table) ran Megatron-FSDP
    # (optim_grads_params) before 2025-11-21 and plain DDP with 5 of 32 layers recomputed after; the
    # table's FSDP is pinned. GPT-OSS 120B (attention sinks, alternating windows) and Qwen3-30B-A3B
    # (its table row's micro-batch and interleaving differ from the tagged recipe) are left out.
    *(
        Row(
            NEMO_DENSE if ep == 1 else NEMO_MOE,
            what,
            model,
            "h100-sxm",
            gpus,
            tok_s,
            "tok/s/GPU",
            dict(tp=tp, pp=pp, cp=cp, dp=gpus // (tp * pp * cp), ep=ep, micro_batch=1, zero=zero, recompute="none")
            | (dict(schedule="interleaved", virtual=vp) if vp > 1 else {})
            | (dict(cp_attention="ring") if cp > 1 else {}),  # Megatron-LM's default --cp-comm-type p2p
            global_batch=gbs,
            seq_len=seq,
            dtype="fp8",
            zero3_reduce="overlapped",  # Megatron-FSDP's overlapped reduce-scatters (the 8B row)
            grad_reduce="bf16",
            tp_overlap=tp > 1 and ep == 1,  # the 70B and 405B recipes (tp_comm_overlap)
            ep_overlap=ep > 1,  # the MoE recipe (overlap_moe_expert_parallel_comm)
            pp_overlap=vp > 1,  # Megatron-Bridge's wherever vp > 1 (overlap_p2p_comm)
            fp8_recipe="tensorwise",  # the table's FP8-CS (current scaling), the recipes' fp8_cs
        )
        for what, model, gpus, gbs, seq, tp, pp, cp, vp, ep, zero, tok_s in (
            ("Llama 3 8B, 8 GPUs, FSDP", "llama-3-8b", 8, 128, 8192, 1, 1, 1, 1, 1, 3, 14_451),
            ("Llama 3 70B, 64 GPUs, tp4 pp8 vp5", "llama-3-70b", 64, 128, 8192, 4, 8, 1, 5, 1, 1, 1_602),
            ("Llama 3.1 405B, 1,024 GPUs, tp8 pp8 cp2 vp8", "llama-3.1-405b", 1024, 512, 8192, 8, 8, 2, 8, 1, 1, 292),
            ("Qwen3-235B, 256 GPUs, tp2 pp8 vp4 ep32", "qwen3-235b-a22b", 256, 2048, 4096, 2, 8, 1, 4, 32, 1, 1_575),
        )
    ),
    # The same table's Blackwell rows whose tagged recipes match them (the GB200 70B, 405B, DeepSeek-V3
    # and Qwen3 rows ran layouts or batches no v0.2.x config holds). FP8: current scaling for Llama,
    # MXFP8 (32-element blocks) for the MoE rows; no recomputation pinned: the 8B rows capture the
    # whole step in CUDA graphs and keep every activation, the 405B row overlaps TP (userbuffers),
    # DeepSeek-V3's recomputes only MLA's up-projections (--recompute-modules mla_up_proj) and
    # carries its MTP layer (--mtp 1); the MoE rows dispatch all-to-all (no DeepEP) with
    # forced-balanced routing, and Qwen3's overlaps it (--ep-overlap). Qwen3's table row says VP2,
    # its tagged recipe VP4: the table's is pinned.
    *(
        _tok_s(
            NEMO_BW_DENSE if ep == 1 else NEMO_BW_MOE,
            what,
            model,
            gpu,
            gpus,
            tok_s,
            tp=tp,
            pp=pp,
            cp=cp,
            vp=vp,
            ep=ep,
            mb=mb,
            recompute="none",
            global_batch=gbs,
            seq_len=seq,
            dtype="fp8",
            grad_reduce="bf16",
            tp_overlap=tp > 1,
            ep_overlap=model.startswith("qwen3"),
            recompute_modules=("mla_up_proj",) if model == "deepseek-v3" else (),
            mtp=int(model == "deepseek-v3"),  # the recipes' MTP layer (mtp_num_layers 1)
            fp8_recipe="tensorwise" if ep == 1 else "mxfp8",  # the table's FP8-CS and FP8-MX
        )
        for what, model, gpu, gpus, gbs, seq, mb, tp, pp, cp, vp, ep, tok_s in (
            ("GB200: Llama 3 8B, 8 GPUs, mb2", "llama-3-8b", "gb200", 8, 128, 8192, 2, 1, 1, 1, 1, 1, 31_508),
            ("B200: Llama 3 8B, 8 GPUs, mb2", "llama-3-8b", "b200", 8, 128, 8192, 2, 1, 1, 1, 1, 1, 30_624),
            ("B200: Llama 3.1 405B, tp4 pp8 cp2 vp8", "llama-3.1-405b", "b200", 128, 64, 8192, 1, 4, 8, 2, 8, 1, 661),
            ("B200: DeepSeek-V3, pp16 ep8", "deepseek-v3", "b200", 256, 2048, 4096, 1, 1, 16, 1, 1, 8, 2_139),
            ("B200: Qwen3-235B, pp8 vp2 ep8", "qwen3-235b-a22b", "b200", 64, 1024, 4096, 1, 1, 8, 1, 2, 8, 3_269),
        )
    ),
    # The same summary five months on (its archive, "26.04.01 NeMo Container"), the MoE rows on GPUs the
    # catalog holds, each with its recipe at the release tag v0.4.2 (scripts/performance/configs/
    # {qwen,deepseek}/*_workload_base_configs.py, the "V2" variants the table ran): no recomputation
    # but DeepSeek-V3's (MLA's up-projections and its MLPs: --recompute-modules mla_up_proj,mlp; its MTP
    # layer, --mtp 1), gradients reduced in bf16, forced-balanced routing. Qwen3 on H100: the all-to-all
    # dispatcher, its overlap on (moe_a2a_overlap: --ep-overlap); Qwen3 on B200: the all-to-all
    # dispatcher, no overlap, no CUDA graphs; DeepSeek-V3 on B200: DeepEP, the all-to-all overlap and
    # CUDA graphs of attention, router and preprocessing (the graphs not modelled). DeepSeek-V3's B200 layout
    # moved from 25.11's pp16 ep8 (2,139 above) to pp8 vp2 ep32 (docs/plan.md: the planner prices that
    # move the other way). Qwen3-30B-A3B (added in stop 45, its preset new): H100 FP8 on 16 GPUs at ep16,
    # B200 and GB200 MXFP8 on 8 at ep8 with micro-batches of 4, each with HybridEP (the flex dispatcher:
    # a token once to each node holding one of its experts, --dispatcher deepep), no recomputation (the
    # common Qwen3 settings clear the recipe's), the Blackwell rows with CUDA graphs of the router and
    # preprocessing (B200's of attention too; not modelled). The other GB200 rows are left out: the
    # source does not say how many of a 256-GPU job's GPUs share an NVLink domain (--gpus-per-node);
    # 8 GPUs share one whatever its size.
    *(
        _tok_s(
            NEMO_2604_MOE,
            what,
            model,
            gpu,
            gpus,
            tok_s,
            tp=tp,
            pp=pp,
            vp=vp,
            ep=ep,
            mb=mb,
            recompute="none",
            global_batch=gbs,
            seq_len=4096,
            dtype="fp8",
            grad_reduce="bf16",
            dispatcher=dispatcher,
            ep_overlap=overlap,
            recompute_modules=("mla_up_proj", "mlp") if model == "deepseek-v3" else (),
            mtp=int(model == "deepseek-v3"),  # the recipes' MTP layer (mtp_num_layers 1)
            # H100's FP8 the configs' FP8_CS (as 25.11's table names it), Blackwell's the table's MXFP8
            fp8_recipe="tensorwise" if gpu == "h100-sxm" else "mxfp8",
        )
        for what, model, gpu, gpus, gbs, mb, tp, pp, vp, ep, dispatcher, overlap, tok_s in NEMO_2604_ROWS
    ),
    # NVIDIA's Megatron-Core MoE technical report (arXiv 2603.07685, "Scalable Training of
    # Mixture-of-Experts Models with Megatron Core", Megatron-Core v0.16; added in stop 46, after
    # C.MOE_BLOCK_FLOOR_S: held out from it): Table 11's tokens/s per GPU at 4,096 tokens with
    # forced-balanced routing, each row's layout from Appendix B's Table 20 and settings from B.2 (its
    # 128K-token run left out). DeepSeek-V3 on H100:
    # Table 20 says PP4, Table 17 and the pipeline layout it gives ("Et*3|(tt|)*29m|L": 32 virtual
    # stages = pp8 x vp4) say PP8: pp8 is pinned. Dispatchers: DeepEP on H100, HybridEP on GB200 (both
    # --dispatcher deepep). GB200: "EP64 stays entirely within the NVLink domain" (§9.2.2), so 64 of the
    # job's GPUs share one (--gpus-per-node 64). Recomputation: Qwen3's "moe_act, layernorm" pinned as
    # the planner's selective (as the ModelZoo rows above); DeepSeek-V3's modules as B.2 gives them
    # ("up_proj, mlp on H100", "mlp on GB200", none on GB300: --recompute-modules) and its MTP layer (the
    # "m" of its pipeline layout: --mtp 1); the 1F1B all-to-all overlap as B.2 (--ep-overlap: DeepSeek-V3
    # on H100 and GB300, Qwen3 on GB200 and H100). Not modelled, so priced without: CUDA graphs of
    # attention, router and preprocessing (GB200 and GB300; Qwen3 on H100), and the memory savers (FP8
    # primary weights, BF16 moments) but DeepSeek-V3's optimizer offload on GB200 (Table 18, and §9.2.2:
    # on GB200 "optimizer state offloading ... reduces the need for fine-grained recomputation to just
    # mlp", the BF16 row's one module; the planner's offload pin). GB300
    # (added to the catalog with these rows) as GB200, 64 GPUs to a domain. Left out, as they do not fit
    # the planner's memory count as pinned: Qwen3 on GB200 in MXFP8 (pp4 vp6 ep64, three sequences a
    # micro-batch, 6,212: 263 GiB a GPU on a 186 GiB part; the run offloads activations, §4.1.5) and
    # DeepSeek-V3 on GB200 in MXFP8 (pp4 vp4 ep64, 4,020: 189 GiB; the run offloads optimizer states).
    *(
        _tok_s(
            MCORE_REPORT,
            what,
            model,
            gpu,
            gpus,
            tok_s,
            tp=tp,
            pp=pp,
            vp=vp,
            ep=ep,
            mb=mb,
            recompute=rc,
            global_batch=gbs,
            seq_len=4096,
            dtype=dtype,
            dispatcher="deepep",
            gpus_per_node=64 if gpu in ("gb200", "gb300") else None,
            ep_overlap=overlap,
            recompute_modules=tuple(modules.split(",")) if modules else (),
            mtp=int(model == "deepseek-v3"),  # the MTP layer of its pipeline layout
            offload=model == "deepseek-v3" and gpu == "gb200",  # Table 18, §9.2.2: "optimizer state offloading"
            # H100's FP8: DeepSeek-style blockwise, as the ModelZoo's script for the layout runs "fp8"
            fp8_recipe="mxfp8" if "MXFP8" in what else "blockwise" if dtype == "fp8" else None,
        )
        for what, model, gpu, gpus, dtype, gbs, mb, tp, pp, vp, ep, rc, modules, overlap, tok_s in MCORE_REPORT_ROWS
    ),
]

# each source's mean and max relative error today (rounded up); a change that raises one fails
BOUNDS = {
    # "stop 48's boundary bytes": a pipeline stage's hops priced at the bytes sent (training.boundary_bytes:
    # 1/tp under SP), not the whole activation; "stop 48's pipeline": that, Megatron-Core's interleaved hops
    # behind the chunks beside them (--pp-overlap) and uneven interleaving searched (docs/plan.md, "The
    # pipeline's boundary")
    # before the memory-bound operators' traffic (plan/traffic.py, --kernels fused here) was counted:
    # 9% / 16%; before the unfused attention's score traffic: 25% and 63% (small models too fast)
    # 7% / 14% while the LM head was recomputed under full recomputation (neither trainer does)
    # 8% / 16% since stop 48's boundary bytes; interleaved rows at the depth the search prices
    # best (uneven where the layers do not divide), not dropped to zero-bubble
    MEGATRON: (0.09, 0.16),
    # 18% / 29% with 16-bit reduce-scatters (the trainer sends float32); 168% / 339% when ZeRO-3's
    # gathers were taken as hidden over 8 NICs a node; 8% / 13% before the traffic was counted
    ZERO3: (0.08, 0.14),
    # 5% / 7% before the traffic was counted; 4% / 6% before stop 48's boundary bytes
    PTDP: (0.10, 0.14),
    # 7% / 12% before the traffic was counted (it predicts a little lower); 8% / 12% priced at zero-bubble
    # before the interleaved schedule was pinned and stop 48's boundary bytes
    KORTHIKANTI: (0.07, 0.11),  # 530B -11%: the search's uneven 2-1 chunks
    # 4% / 6% with ZeRO-2's reduce-scatter every micro-batch (the trainer: once a step); 4% / 5% while the
    # all-gather after the step was taken as hidden (shardlm's trainer waits for it; docs/plan.md)
    # 4% / 7% before the measured K curves (GpuSpec.gemm_half_k: the attention output's K = 2048 a rank);
    # 5% / 9% before each GEMM's measured fixed time replaced the rows rule (GpuSpec.gemm_fixed_us)
    # 4% / 4% before the attention core ran on cuDNN's measured curves (GpuSpec.attention; its backward recomputes the scores)
    # 4% / 5% while ZB-H1's deferred W was half of backward (the attention core's backward, which has no
    # weights, is B: training.StagePass.weight_grads); zero-bubble stands in for Meta's interleaving
    LLAMA3: (0.07, 0.12),
    # 18% / 35% and NIM's 35% / 59%, 14% / 21%, 21% / 28% while FP8 plans read the LM head at one byte;
    # 17% / 31% and NIM's 32% / 59%, 15% / 21%, 20% / 26% before the measured K curves (GpuSpec.gemm_half_k);
    # 11% / 20% and NIM's 28% / 56%, 12% / 21%, 16% / 26% while the rows rule slowed decode batches of
    # ~1,000 rows to 0.89 of the large rate (the measured tables: ~0.96; GpuSpec.gemm_fixed_us replaced it)
    TRTLLM: (0.14, 0.28),
    f"{NIM}, TTFT": (0.29, 0.57),  # low at C = 5-50: fixed-length clients arrive in waves (docs/plan.md)
    f"{NIM}, TPOT": (0.13, 0.21),
    f"{NIM}, tok/s": (0.17, 0.26),
    # +11% before node-limited routing (a token over IB once per node, at most 4) halved the exposed
    # all-to-all; DualPipe's overlap of the rest is not modelled (docs/plan.md)
    # 47% before the traffic was counted; 42% before the routed pairs' copies; 37% before FP8's casts;
    # 31% before the measured K curves; 25% before the fused activation's and FP8's saved inputs were
    # counted as such (memory.layer_shape), when its unpinned recomputation had to be selective to fit;
    # 28% while FP8 training's activations crossed its all-to-all at one byte both ways (DeepEP: FP8
    # dispatch, 16-bit combine)
    # 13% before its MLA up-projections were recomputed (--recompute-modules mla_up_proj, §3.2.3); the same
    # with its MTP module (--mtp 1: the balanced stages absorb it)
    # 11% before the attention core ran on cuDNN's measured curves (GpuSpec.attention; its backward recomputes the scores)
    # 6% while ZB-H1's deferred W was half of backward
    DSV3: (0.02, 0.02),
    # 25% before routing imbalance (the most loaded ep rank sets the pace); 24% before the traffic
    # 17% before the routed pairs' copies (plan/traffic.py); 16% before the measured K curves
    # +20% since stop 48's pipeline
    # 20% before the attention core ran on cuDNN's measured curves (GpuSpec.attention; its backward recomputes the scores)
    MCORE_MOE: (0.18, 0.18),
    # added 2026-11-26; its fastest published layouts are predicted slowest and the reverse (docs/plan.md);
    # 51% / 102% with the DeepEP rows priced as every pair's all-to-all; 47% / 102% before uneven
    # interleaving chunks (the rows fell back to zero-bubble); 41% / 88% before the routed pairs'
    # copies and the FSDP row's overlapped reduce-scatters (-39% -> -29%); 34% / 81% before the weight
    # gradients' float32 read and write (training.grad_epilogue_bytes: tp4 ep8's 512 tokens an expert)
    # 33% / 75% before the measured K curves; 31% / 71% with the FSDP row's gradients reduced in fp32;
    # 26% / 71% before each GEMM's measured fixed time (GpuSpec.gemm_fixed_us: 16 experts a rank at ep8)
    # 24% / 62% before Megatron's MoE block floor (C.MOE_BLOCK_FLOOR_S: tp2 pp32 ep8 +39% -> +15%,
    # tp4 pp8 ep8 +62% -> -18%; the ep32 rows +10%, -2% -> +4%, -7%); the "+1F1B" row -7% -> +6% since
    # the overlap is priced (--ep-overlap: the pair's gain +13%, published +12%, test_the_overlap_gain_...)
    # 10% / 18% before stop 48's boundary bytes
    # 14% / 29% since stop 48's pipeline
    # 14% / 29% before the attention core ran on cuDNN's measured curves (GpuSpec.attention; its backward recomputes the scores)
    QWEN3_MCORE: (0.13, 0.26),
    # the 135M model is launch-bound: 3,430 kernels a step, the GPU idle 19% of it (GPU_OP_OVERHEAD_S = 0)
    # 19% / 33% before the measured K curves; 15% / 28% before each GEMM's measured fixed time
    # 12% / 24% before the attention core ran on cuDNN's measured curves (GpuSpec.attention; its backward recomputes the scores)
    SHARDLM_H100: (0.12, 0.20),
    # added 2026-11-27: +19% (8B, FSDP), -0%, +3% (--tp-overlap, as the recipes; +0%, +4% while it hid a
    # layer's collectives behind all its GEMMs); -11%, -12% with TP's
    # collectives exposed; +6%, +8% while FP8 training moved one-byte activations; 70B's layout (no
    # recomputation) did not fit before the fused activation and FP8 copies were counted
    # 7% / 19% (70B -1%, 405B +3%) before stop 48's boundary bytes: the
    # whole activation over the NIC each hop had priced 11-18% of the interleaved rows' steps
    # 25% / 34% since stop 48's pipeline
    # 25% / 34% before the attention core ran on cuDNN's measured curves (GpuSpec.attention; its backward recomputes the scores) (8B +19%, 70B +23%, 405B +34%)
    # 20% / 29% before their FP8 recipe, current scaling, was priced (--fp8-recipe tensorwise: an amax pass
    # over each cast tensor, the norms' outputs cast; 8B +11%, 70B +17%, 405B +29%)
    NEMO_DENSE: (0.16, 0.25),
    # the all-to-all exposed (the recipe overlaps it with another micro-batch's compute); +30% while FP8
    # training moved one-byte activations; -13% before the overlap was priced (--ep-overlap)
    # +20% before stop 48's boundary bytes
    NEMO_MOE: (0.26, 0.26),  # +26% with --pp-overlap
    # added 2026-11-27: the 8B rows +39% (GB200), +31% (B200), 405B -1%
    # 405B +23% since stop 48's boundary bytes
    # 405B +31% with --pp-overlap; 33% / 39% before the attention core ran on cuDNN's measured curves
    # (GpuSpec.attention; its backward recomputes the scores): 405B +21%, the 8B rows +27%, +12%
    # 20% / 27% before their FP8 recipe, current scaling, was priced (--fp8-recipe tensorwise); 17% / 23%
    # while Blackwell's per-tensor casts wrote a transpose (its FP8 GEMMs take any layout); 19% / 25%
    # before the 405B row's cp ran the ring (Megatron-LM's default), not Ulysses (405B +20% -> +17%)
    NEMO_BW_DENSE: (0.18, 0.25),
    # added 2026-11-27: DeepSeek-V3 +99%, Qwen3 +96% (its all-to-all exposed; the run overlaps it); Qwen3
    # +18% since Megatron's MoE block floor (C.MOE_BLOCK_FLOOR_S; DeepSeek-V3's blocks lie above it);
    # since Qwen3's overlap is priced (--ep-overlap) +28%, and DeepSeek-V3 +96% with its MLA up-projections
    # recomputed, +89% with its MTP module (--mtp 1)
    # +77% since DeepSeek-V3's pipeline is pinned 1F1B as the recipe ran it (zero-bubble before)
    # 54% / 77% before the attention core ran on cuDNN's measured curves (GpuSpec.attention; its backward recomputes the scores)
    NEMO_BW_MOE: (0.45, 0.62),  # Qwen3 +30% with --pp-overlap
    # added 2026-11-27 (stop 44): Qwen3 H100 -19% (its overlap exposed), B200 +76%; DeepSeek-V3 B200 -17%
    # (38% / 77%); 2026-11-27 (stop 45) its Qwen3-30B-A3B rows: H100 ep16 +94%, B200 +46%, GB200 +59%
    # (53% / 95%); since Megatron's MoE block floor (stop 46): Qwen3 B200 +5%, Qwen3-30B-A3B -9%, +8%, +15%;
    # since the overlap is priced (--ep-overlap, stop 47): Qwen3 H100 -19% -> +16%, DeepSeek-V3 B200 -17% -> +30%
    # with its recompute modules (--recompute-modules mla_up_proj,mlp: without them it no longer fits, the
    # overlap holding a chunk more), +17% with its MTP module (--mtp 1); +33% since its 4 nodes' trip is
    # priced at the 3.14 nodes its 4 groups lie on (roofline.node_limit, the report's Table 7 at ep32)
    # 16% / 39% since stop 48's pipeline
    # 16% / 39% before the attention core ran on cuDNN's measured curves (GpuSpec.attention; its backward recomputes the scores)
    NEMO_2604_MOE: (0.12, 0.21),
    # added in stop 46, held out from Megatron's MoE block floor (C.MOE_BLOCK_FLOOR_S), without which it reads
    # 17% / 25% (+12%, +21%, +12%, +21%, +25%, -14%): DeepSeek-V3 on GB300 +21% -> +9%, Qwen3 on GB300 +25% -> +6%; Qwen3 on GB200 in
    # BF16 +12% -> -28% and on H100 -14% -> -19% (both run with the 1F1B all-to-all overlap, not modelled, as
    # was DeepSeek-V3 on GB300); since the overlap is priced (--ep-overlap) and DeepSeek-V3's MLA up-projections
    # recomputed (stop 47): DeepSeek-V3 on H100 +12% -> +55%, on GB200 +21% -> +18%, on GB300 +9% -> +26%; Qwen3
    # on GB200 -28% -> -20%, on H100 -19% -> -7% (22% / 55%; docs/plan.md, "The 1F1B all-to-all overlap"); with
    # DeepSeek-V3's MTP module (--mtp 1) and B.2's recompute modules: +39%, +8%, +21%
    # DeepSeek-V3 on H100 +45% since stop 48's boundary bytes
    # 20% / 51% since stop 48's pipeline
    # 20% / 51% before the attention core ran on cuDNN's measured curves (GpuSpec.attention; its backward recomputes the scores)
    MCORE_REPORT: (0.17, 0.42),
}


@cache
def _config(model: str) -> str:
    """A preset, a Llama config.json (``llama:...``) or a GPT-2-format one for Megatron's GPT sizes."""
    if model.startswith("llama:"):
        h, f, layers, heads, kv, vocab = map(int, model[6:].split(","))
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
               "intermediate_size": f, "num_hidden_layers": layers, "num_attention_heads": heads,
               "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 4096}  # fmt: skip
        path = Path(tempfile.mkdtemp(prefix="plan-published-")) / "config.json"
        path.write_text(json.dumps(cfg))
        return str(path)
    if not model.startswith("gpt:"):
        return model
    h, heads, layers = map(int, model[4:].split(","))
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": h, "n_head": heads,
           "n_layer": layers, "n_positions": 2048, "vocab_size": 51200, "resid_pdrop": 0.1}  # fmt: skip
    path = Path(tempfile.mkdtemp(prefix="plan-published-")) / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _megatron_flops(row: Row) -> float:
    """Megatron's FLOPs per step (recomputation included): 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    h, _, layers = map(int, row.model[4:].split(","))
    s, v = row.seq_len, 51200
    return 96 * row.global_batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


_plans: dict[int, tuple[Row, object]] = {}


def planned(row: Row):
    """The planner's plan for the row (its pins, its workload): ``.best`` is what ``predict`` reads.
    Cached with the row itself, so that no later row can take its id."""
    hit = _plans.get(id(row))
    if hit is None or hit[0] is not row:
        hit = _plans[id(row)] = (row, _plan(row))
    return hit[1]


def _plan(row: Row):
    cluster = dict(gpu=row.gpu, gpus=row.gpus, gpus_per_node=row.gpus_per_node)
    common = dict(model=_config(row.model), objective="throughput", top=1, **cluster)
    if row.io != (0, 0):
        wl = InferenceWorkload(prompt_len=row.io[0], output_len=row.io[1], dtype=row.dtype, concurrency=row.concurrency)
        return plan(PlanRequest(train=False, inference=wl, fixed=row.pins, **common))
    wl = TrainWorkload(
        global_batch=row.global_batch,
        seq_len=row.seq_len,
        dtype=row.dtype,
        fused_attention=row.fused_attention,
        kernels=row.kernels,
        dispatcher=row.dispatcher,
        zero3_reduce=row.zero3_reduce,
        grad_reduce=row.grad_reduce,
        tp_overlap=row.tp_overlap,
        ep_overlap=row.ep_overlap,
        pp_overlap=row.pp_overlap,
        recompute_modules=row.recompute_modules,
        mtp=row.mtp,
        fp8_recipe=row.fp8_recipe,
    )
    return plan(PlanRequest(train=True, training=wl, fixed=dict(row.pins), **common))


def predict(row: Row) -> float:
    """The planner's number for the row, in the row's unit (its best within the pins: ``planned``)."""
    best = planned(row).best
    if row.io != (0, 0):
        return {"tok/s": best.throughput, "TTFT ms": best.ttft_s * 1e3, "TPOT ms": best.tpot_s * 1e3}[row.unit]
    if row.unit == "MFU":
        return best.mfu
    if row.unit == "tok/s/GPU":
        return best.tokens_per_s / row.gpus
    if row.flops_per_token:
        return row.flops_per_token * best.tokens_per_s / row.gpus / 1e12
    if row.model.startswith("gpt:"):
        return _megatron_flops(row) / (best.step_s * row.gpus) / 1e12
    return best.mfu * best_peak(row)


def best_peak(row: Row) -> float:
    """Datasheet dense bf16 TFLOP/s (what MFU divides by)."""
    from shardlm.plan.hardware import datasheet_flops, load_gpu

    flops = datasheet_flops(load_gpu(row.gpu).display, "bf16")
    assert flops is not None
    return flops / 1e12


def errors() -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for row in ROWS:
        out.setdefault(row.source, []).append(predict(row) / row.published - 1)
    return out


# ---- memory: per-GPU bytes the sources state or logged, against the planner's count ------------

ZERO_FIG1 = "Rajbhandari et al. 2019 (ZeRO), arXiv 1910.02054, Figure 1"
KORTHIKANTI_MEM = "Korthikanti et al. 2022, arXiv 2205.05198, 175B activations"
VLLM_KV = "vllm-project/vllm#21348, Qwen3-235B-A22B-FP8 on 4 x H100, tp4, KV cache"
VLLM_WEIGHTS = "vllm-project/vllm#6746, Llama 3.1 405B FP8 on 8 x H100, tp8, weights"
GIB = 2**30


@dataclass(frozen=True)
class MemRow:
    source: str
    what: str
    published: float
    unit: str  # "GB" (10^9 bytes, as ZeRO's figure counts) or "GiB" (vLLM's and SGLang's logs: bytes / 2^30)
    bytes_: Callable[[], float]  # the planner's count, in bytes

    def predicted(self) -> float:
        return self.bytes_() / (1e9 if self.unit == "GB" else GIB)


def _zero(stage: int) -> float:
    """Model states of Psi = 7.5B on N_d = 64 under ZeRO-``stage`` (the planner's (2 + 2 + 12) Psi split)."""
    return model_states(7.5e9, dp=64, stage=stage).total


def _korthikanti(sp: bool, recompute: str) -> float:
    """The first stage's activations of GPT-3 175B at tp8 pp8, the interleaved schedule at 3 chunks
    (Korthikanti §4.2.3: the first stage holds L (1 + (p - 1) / (p m)) layers' worth), s 2048, b 1,
    unfused attention (2022), through the planner's training count."""
    lay = Layout(tp=8, pp=8, dp=1, sp=sp, recompute=recompute, schedule="interleaved", virtual=3, num_micro=64)
    return training_activation_bytes(_costs("gpt3-175b"), lay, 2048, fused_attention=False)


def _kv_per_token(model: str, tp: int) -> float:
    """KV-cache bytes one token costs a rank, bf16 (both engines' default for an FP8 checkpoint)."""
    return kv_bytes_per_seq_token(_costs(model), Layout(tp=tp), 2)


@cache
def _meta_405b_fp8() -> str:
    """The llama-3.1-405b preset with the quantization_config of Meta's FP8 checkpoint
    (meta-llama/Llama-3.1-405B-Instruct-FP8, fbgemm_fp8): layers 0 and 125 whole, the LM head and
    every other layer's self_attn left unquantized, as the recipe that made it lists them
    (https://github.com/huggingface/huggingface-llama-recipes, llama-405B-FP8.py)."""
    from shardlm.plan.catalog import DATA

    cfg = json.loads((DATA / "model-llama-3.1-405b.json").read_text())
    keep = ["model.layers.0", "model.layers.125", "lm_head", *(f"model.layers.{i}.self_attn" for i in range(1, 125))]
    cfg["quantization_config"] = {"quant_method": "fbgemm_fp8", "modules_to_not_convert": keep}
    path = Path(tempfile.mkdtemp(prefix="plan-published-")) / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@cache
def _costs(model: str) -> ModelCosts:
    return ModelCosts(load_model(_config(model))[0])


def _one_gpu_training(model: str, batch: int, seq: int) -> float:
    """The planner's memory for one rank training ``batch`` x ``seq`` tokens a step, without its reserve."""
    from shardlm.plan.memory import training_memory

    return training_memory(_costs(model), Layout(micro_batch=batch, num_micro=1, zero=1), 0.0, seq=seq).total


MEM_ROWS = [
    # "the memory consumption of the 7.5B model ... 120GB ... 31.4GB ... 16.6GB ... 1.9GB" with K = 12
    # and N_d = 64 (Figure 1: baseline, P_os, P_os+g, P_os+g+p), decimal GB
    *(MemRow(ZERO_FIG1, f"7.5B, N_d 64, {name}", gb, "GB", functools.partial(_zero, stage))
      for stage, name, gb in ((0, "baseline", 120), (1, "P_os", 31.4), (2, "P_os+g", 16.6), (3, "P_os+g+p", 1.9))),
    # GPT-3 175B on tp8 x pp8: 66.84 GiB of activations on the first stage without SP or recomputation,
    # 12.35 GiB with SP and selective recomputation (their Table 2 counts at the Figure 1 configuration)
    MemRow(KORTHIKANTI_MEM, "tp8 pp8 interleaved x3, no SP, no recomputation", 66.84, "GiB",
           functools.partial(_korthikanti, False, "none")),
    MemRow(KORTHIKANTI_MEM, "tp8 pp8 interleaved x3, SP + selective recomputation", 12.35, "GiB",
           functools.partial(_korthikanti, True, "selective")),
    # https://github.com/vllm-project/vllm/issues/21348 (2025-07-22), `vllm serve Qwen3-235B-A22B-FP8
    # --tensor-parallel-size 4` on 4 H100s: "Available KV cache memory: 8.11 GiB", "GPU KV cache size:
    # 178,880 tokens"; SGLang --tp 4 on the same GPUs: "KV Cache is allocated. #tokens: 367404, K size:
    # 8.23 GB, V size: 8.23 GB" (SGLang's GB are 2^30 bytes). The planner: the tokens x its bytes per token.
    MemRow(VLLM_KV, "vLLM: 178,880 tokens", 8.11, "GiB", lambda: 178_880 * _kv_per_token("qwen3-235b-a22b", 4)),
    MemRow(VLLM_KV, "SGLang: K of 367,404 tokens", 8.23, "GiB",
           lambda: 367_404 * _kv_per_token("qwen3-235b-a22b", 4) / 2),
    # https://github.com/vllm-project/vllm/issues/6746 (2024-07-24), Meta-Llama-3.1-405B-Instruct-FP8 with
    # --tensor-parallel-size 8 on 8 H100s: "Loading model weights took 57.7520 GB" (vLLM's GB: 2^30 bytes).
    # Meta's FP8 checkpoint keeps the attention layers and the first and last blocks in bf16 (Dubey et al.
    # 2024 §6.2), its config.json's quantization_config listing them (_meta_405b_fp8); the embedding and
    # LM head are 16-bit in every quantized plan (roofline.FP8_KEEPS_AT).
    MemRow(VLLM_WEIGHTS, "tp8, --dtype fp8", 57.752, "GiB",
           lambda: weight_bytes(ModelCosts(load_model(_meta_405b_fp8())[0]), Layout(tp=8), 1, quantized=True)),
    # torch.cuda.max_memory_allocated() of the two training rows above (SHARDLM_H100)
    MemRow(SHARDLM_H100, "SmolLM2-135M's shape, 16 x 512", 10.437, "GiB",
           functools.partial(_one_gpu_training, "smollm2-135m", 16, 512)),
    MemRow(SHARDLM_H100, "TinyLlama-1.1B's shape, 4 x 2048", 30.845, "GiB",
           functools.partial(_one_gpu_training, TINYLLAMA, 4, 2048)),
]  # fmt: skip

MEM_BOUNDS = {  # each source's mean and max relative error today (rounded up)
    ZERO_FIG1: (0.005, 0.014),  # the figure rounds to 0.1 GB: 1.875 -> 1.9
    KORTHIKANTI_MEM: (0.001, 0.001),
    VLLM_KV: (0.007, 0.012),
    # 18.2% while every weight counted at one byte (the checkpoint's quantization_config unread, the
    # embedding and LM head taken as FP8)
    VLLM_WEIGHTS: (0.019, 0.019),
    SHARDLM_H100: (0.008, 0.011),  # -37% / -8% before the loss's working set (memory.LOSS_BYTES_PER_LOGIT)
}


def mem_errors() -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for row in MEM_ROWS:
        out.setdefault(row.source, []).append(row.predicted() / row.published - 1)
    return out


@pytest.mark.parametrize("source", list(MEM_BOUNDS))
def test_memory_within_todays_error(source):
    errs = [abs(e) for e in mem_errors()[source]]
    mean_bound, max_bound = MEM_BOUNDS[source]
    assert statistics.mean(errs) <= mean_bound and max(errs) <= max_bound, (source, errs)


@pytest.mark.parametrize("source", list(BOUNDS))
def test_each_source_within_todays_error(source):
    errs = [abs(e) for e in errors()[source]]
    mean_bound, max_bound = BOUNDS[source]
    assert statistics.mean(errs) <= mean_bound and max(errs) <= max_bound, (source, errs)


MOE_SOURCES = (DSV3, MCORE_MOE, QWEN3_MCORE, NEMO_MOE, NEMO_BW_MOE, NEMO_2604_MOE, MCORE_REPORT)


TARGETS = {
    "dense training": ((MEGATRON, ZERO3, PTDP, KORTHIKANTI, LLAMA3, SHARDLM_H100, NEMO_DENSE, NEMO_BW_DENSE), 0.10),
    "MoE training": (MOE_SOURCES, 0.25),
    "serving TPOT": ((f"{NIM}, TPOT",), 0.20),
}
"""The issue's targets: each class's mean absolute error over its rows (memory: within 3% a source,
``test_memory_within_todays_error``)."""


def test_every_training_source_has_a_target():
    """The targets test covers every training source: each is dense or MoE in ``TARGETS``."""
    training = {row.source for row in ROWS if row.io == (0, 0)}
    classified = set(TARGETS["dense training"][0]) | set(TARGETS["MoE training"][0])
    assert training == classified, training ^ classified


MISSED: dict[str, str] = {}
"""Targets the validation misses today, each with why: the test is expected to fail (strict: it
fails when the target is met, to drop the entry)."""


@pytest.mark.parametrize(
    "what",
    [pytest.param(w, marks=pytest.mark.xfail(reason=MISSED[w], strict=True)) if w in MISSED else w for w in TARGETS],
)
def test_the_validation_meets_its_targets(what):
    """Dense training within 10% mean, MoE training within 25%, serving TPOT within 20%, over every
    row collected. MoE reads 43% without Megatron's MoE block floor (``C.MOE_BLOCK_FLOOR_S``)."""
    sources, target = TARGETS[what]
    errs = [abs(e) for source in sources for e in errors()[source]]
    assert statistics.mean(errs) <= target, (what, statistics.mean(errs))


def test_the_overlap_gain_is_priced_as_measured():
    """The ModelZoo's Qwen3-235B pair is one run twice, tp2 pp8 vpp4 ep32 with DeepEP on 256 H100s,
    without and with Megatron-Core's 1F1B all-to-all overlap: 19.7 s and 17.6 s a step, +12%. The
    planner's gain (``--ep-overlap``, ``training._merged_pair``) is +17% (+14% before the attention
    core ran at cuDNN's measured rates, ``GpuSpec.attention``: the other micro-batch's backward
    attention, now slower, is what the pair hides under the floor). Its blocks sit at Megatron's floor,
    so the gain rests on what the other micro-batch hides of it: none (each pair waiting for both
    passes' attention and a floor) prices 0%, all of it (a floor alone) +22% (docs/plan.md, "The 1F1B
    all-to-all overlap")."""
    without, overlapped = (
        r for r in ROWS if r.source == QWEN3_MCORE and "DeepEP" in r.what and r.pins["pp"] == 8 and r.pins["tp"] == 2
    )
    assert not without.ep_overlap and overlapped.ep_overlap and without.pins == overlapped.pins
    published = overlapped.published / without.published - 1  # 19.7 s / 17.6 s - 1
    assert predict(overlapped) / predict(without) - 1 == pytest.approx(published, abs=0.06)


FP8_PAIR = "Megatron-Bridge performance summary archive, NeMo 25.11, DGX-GB300, DeepSeek-V3 (w/o MTP)"
"""The one published run twice in two precisions (docs/performance-summary-archive.md, "25.11 NeMo
Container", DGX-GB300): DeepSeek-V3 without its MTP layer on 256 GB300s, global batch 4,096 of 4,096
tokens, micro-batch 1, pp2 vp4 ep32: 3,848 tokens/s a GPU in BF16, 4,357 in MXFP8, +13%."""


@pytest.mark.parametrize(("dispatcher", "overlap"), [("shardlm", False), ("deepep", True)])
def test_the_fp8_gain_is_over_credited_by_at_most_todays_error(dispatcher, overlap):
    """FP8's gain on the one pair (``FP8_PAIR``) is priced at +23% to +29% (the source does not give the
    recipe's dispatcher or overlap: two readings; +24% to +27% before the attention core ran at cuDNN's
    measured rates, which under the overlap's floor the FP8 step hides more of), where it measured +13%:
    the planner credits FP8 with about twice its gain. This is why its FP8 rows read fast (+16% signed, against +3%
    for BF16: docs/plan.md, "FP8 is priced fast"); the test holds today's error and fails if it grows.
    MXFP8's casts (``--fp8-recipe mxfp8``, as the run) moved it under a point.
    Not fitted: the pair is not a validation row, and no constant was set from it."""
    gains = {}
    for dtype in ("bf16", "fp8"):
        row = _tok_s(FP8_PAIR, f"GB300, {dtype}", "deepseek-v3", "gb300", 256, 1.0, tp=1, pp=2, vp=4, ep=32, mb=1,
                     recompute="none", global_batch=4096, seq_len=4096, dtype=dtype, grad_reduce="bf16",
                     dispatcher=dispatcher, ep_overlap=overlap, recompute_modules=("mla_up_proj",),
                     gpus_per_node=64, fp8_recipe="mxfp8" if dtype == "fp8" else None)  # fmt: skip
        gains[dtype] = predict(row)
    published = 4357 / 3848 - 1
    priced = gains["fp8"] / gains["bf16"] - 1
    assert -0.05 <= priced - published <= 0.17, priced  # and not below: FP8 gains what it measured


MX_PAIRS = (("GB200: Llama 3 8B, 8 GPUs, mb2", 29_789), ("B200: Llama 3 8B, 8 GPUs, mb2", 29_521),
            ("B200: Llama 3.1 405B, tp4 pp8 cp2 vp8", 624))  # fmt: skip
"""The performance summary's MXFP8 runs of three of its FP8-CS rows (``NEMO_BW_DENSE``; "25.11 NeMo
Container", the numbers in parentheses: "32x32 for both weights and activations"), each 3.6% to 5.6%
slower than current scaling on the same layout."""


def test_mxfp8_against_current_scaling_is_priced_within_todays_error():
    """MXFP8 against current scaling on the same runs (``MX_PAIRS``): the planner prices MXFP8 0.3% to
    1.1% faster (its casts need no amax pass, though they write a column-wise copy where Blackwell's
    per-tensor ones write none: ``training.fp8_cast_bytes``), where the table measured it 3.6% to 5.6%
    slower: nothing in the planner makes a block-scaled GEMM slower than a per-tensor one
    (docs/plan.md, "FP8's recipes"). The test holds today's error and fails if it grows, or if the
    planner ever prices MXFP8 slower than measured."""
    for what, mx in MX_PAIRS:
        cs = next(r for r in ROWS if r.source == NEMO_BW_DENSE and r.what == what)
        assert cs.fp8_recipe == "tensorwise"
        published = mx / cs.published - 1
        priced = predict(replace(cs, published=mx, fp8_recipe="mxfp8")) / predict(cs) - 1
        assert 0 <= priced - published <= 0.09, (what, priced, published)


# ---- communication: one MoE all-to-all, measured alone, against ``comm.moe_dispatch`` ------------------

TRIP = "Megatron-Core MoE report, arXiv 2603.07685, Table 7, H100 and GB200"
TRIP_ROWS = (  # GPU, ep, dispatcher (deepep: HybridEP; shardlm: every pair, as all-to-all), dispatch us, combine us
    ("h100-sxm", 8, "deepep", 661, 624), ("h100-sxm", 16, "deepep", 1485, 1688),
    ("h100-sxm", 32, "deepep", 3064, 3088), ("h100-sxm", 64, "deepep", 4626, 4398),
    ("h100-sxm", 8, "shardlm", 1265, 1277), ("h100-sxm", 16, "shardlm", 5774, 5628),
    ("h100-sxm", 32, "shardlm", 8059, 7815), ("h100-sxm", 64, "shardlm", 9164, 8727),
    ("gb200", 8, "deepep", 391, 353), ("gb200", 16, "deepep", 578, 527),
    ("gb200", 32, "deepep", 612, 646), ("gb200", 64, "deepep", 675, 744),
    ("gb200", 8, "shardlm", 735, 741), ("gb200", 16, "shardlm", 743, 765),
    ("gb200", 32, "shardlm", 769, 758), ("gb200", 64, "shardlm", 930, 827),
)  # fmt: skip
"""The report's "EP Scaling Performance for HybridEP and all-to-all": DeepSeek-V3's shape (hidden
7,168, 256 experts, top-8), 4,096 tokens a rank in BF16, communication latency alone. Its GB200 groups
sit in one NVLink domain (64 GPUs of the job to one here); the planner prices a combine as the
dispatch's bytes back, so each row's two figures are held to one price. The planner's DeepSeek-V3
preset routes node-limited (4 of 8 groups, on the nodes they lie on: ``roofline.node_limit``), which
the table does not state; its ep32 figures (two groups a node) agree with it."""


def trip_us(gpu: str, ep: int, dispatcher: str) -> float:
    """The planner's one-way trip (``comm.moe_dispatch``) for a TRIP_ROWS row, in microseconds."""
    from shardlm.plan import comm
    from shardlm.plan.hardware import Cluster, load_gpu
    from shardlm.plan.roofline import node_limit

    cfg, _ = load_model("deepseek-v3")
    per_node = 64 if gpu == "gb200" else 8
    cluster = Cluster(gpu=load_gpu(gpu), num_gpus=max(ep, per_node), gpus_per_node=per_node)
    lay = Layout(ep=ep, dp=ep)
    limit = node_limit(cfg, lay.nodes_spanned("ep", per_node))
    group = lay.slowest_group("ep", per_node)
    return 1e6 * comm.moe_dispatch(
        4096 * cfg.hidden_size * 2, cfg.num_experts_per_tok, limit, group, cluster, dispatcher
    )


def trip_errors() -> list[float]:
    return [trip_us(g, ep, d) / us - 1 for g, ep, d, *pair in TRIP_ROWS for us in pair]


def test_the_moe_trip_is_priced_as_measured():
    """Each dispatch and combine of the report's Table 7 within 25%, the mean within 10% (9.3% on
    2026-11-28; 11.0% and 36% while node-limited routing was taken to reach its M = 4 nodes even where
    a node holds two of the 8 groups, as at ep32 on H100s, where the 4 groups lie on 3.14 nodes:
    ``roofline.node_limit``; 19.7% and 86% while DeepEP's token-based dispatch sent every (token,
    choice) pair over NVLink, where it sends a token once to each GPU holding one of its experts:
    ``comm.gpus_reached``)."""
    errs = [abs(e) for e in trip_errors()]
    assert statistics.mean(errs) <= 0.10 and max(errs) <= 0.25, errs


def print_table() -> None:
    print("| source | row | published | predicted | error |\n|---|---|---|---|---|")
    for row in ROWS:
        p = predict(row)
        fmt = (
            (lambda x: f"{x * 100:.1f}%")
            if row.unit == "MFU"
            else (lambda x: f"{x:,.1f}" if x < 100 and row.unit.endswith("ms") else f"{x:,.0f}")
        )
        print(
            f"| {row.source} | {row.what} | {fmt(row.published)} {row.unit} | {fmt(p)} | {p / row.published - 1:+.0%} |"
        )
    print("\n| source | rows | mean abs error | max abs error |\n|---|---|---|---|")
    for source, errs in errors().items():
        a = [abs(e) for e in errs]
        print(f"| {source} | {len(a)} | {statistics.mean(a):.0%} | {max(a):.0%} |")
    print(
        f"\n{TRIP}\n\n| GPU | ep | dispatcher | dispatch us | combine us | predicted us | errors |\n|---|---|---|---|---|---|---|"
    )
    for g, ep, d, *pair in TRIP_ROWS:
        p = trip_us(g, ep, d)
        print(
            f"| {g} | {ep} | {d} | {pair[0]:,} | {pair[1]:,} | {p:,.0f} | {p / pair[0] - 1:+.0%}, {p / pair[1] - 1:+.0%} |"
        )
    a = [abs(e) for e in trip_errors()]
    print(f"\nmean abs error {statistics.mean(a):.1%}, max {max(a):.0%}")
    print("\nMemory\n\n| source | row | published | predicted | error |\n|---|---|---|---|---|")
    for m in MEM_ROWS:
        err = m.predicted() / m.published - 1
        print(f"| {m.source} | {m.what} | {m.published:,.2f} {m.unit} | {m.predicted():,.2f} | {err:+.1%} |")
    print("\n| source | rows | mean abs error | max abs error |\n|---|---|---|---|")
    for source, errs in mem_errors().items():
        a = [abs(e) for e in errs]
        print(f"| {source} | {len(a)} | {statistics.mean(a):.1%} | {max(a):.1%} |")


if __name__ == "__main__":
    print_table()
