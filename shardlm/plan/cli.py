"""``shardlm plan``: which layout to pick, will it fit, how fast will it be.

``add_parser(subparsers)`` adds the subcommand to shardlm's CLI; ``run(args)`` returns the
exit code (0 ok; 2 bad input, with one line on stderr). ``python -m shardlm.plan.cli`` runs
it stand-alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

from shardlm.args import byte_size
from shardlm.errors import UsageError
from shardlm.plan.catalog import model_names
from shardlm.plan.comm import DISPATCHERS
from shardlm.plan.errors import PlanError
from shardlm.plan.hardware import THIS_MACHINE, gpu_names
from shardlm.plan.inference import InferenceWorkload
from shardlm.plan.layout import CP_ATTENTION, SCHEDULES
from shardlm.plan.search import OBJECTIVES
from shardlm.plan.traffic import KERNELS
from shardlm.plan.training import FP8_RECIPES, GRAD_REDUCE_BYTES, ZERO3_REDUCE, TrainWorkload

TRAIN_ONLY = (
    "global_batch",
    "seq_len",
    "micro_batch",
    "zero",
    "schedule",
    "recompute",
    "sp",
    "vpp",
    "offload",
    "prefetch",
    "kernels",
    "zero3_reduce",
    "tp_overlap",
    "ep_overlap",
    "pp_overlap",
    "recompute_modules",
    "mtp",
    "grad_reduce",
    "fp8_recipe",
)
INFER_ONLY = (
    "prompt_len",
    "output_len",
    "max_ttft_ms",
    "max_tpot_ms",
    "batch",
    "kv_dtype",
    "max_concurrency",
    "request_rate",
    "prefill_replicas",
    "attention_dp",
)
DTYPES = ("bf16", "fp16", "fp8", "fp32")
KV_DTYPES = DTYPES + ("int8",)
ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def prefill_arg(value: str) -> int | str:
    """--prefill-replicas: a number of replicas, or "auto" (searched)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of replicas or auto") from None


def dtype_arg(value: str, allowed: tuple[str, ...] = DTYPES) -> str:
    """A dtype name; torch spellings (bfloat16, float32) are accepted too."""
    v = ALIASES.get(value.lower(), value.lower())
    if v not in allowed:
        raise argparse.ArgumentTypeError(f"unknown dtype {value!r}; pick one of {', '.join(allowed)}")
    return v


def kv_dtype_arg(value: str) -> str:
    """A KV-cache dtype: the model dtypes, or int8 (with a float32 scale per token and head, as
    ``shardlm generate --kv-cache-dtype int8`` stores it)."""
    return dtype_arg(value, KV_DTYPES)


DEFAULTS = {"prompt_len": 1024, "output_len": 256, "global_batch": 512, "seq_len": 4096}
"""Workload defaults when a flag is not given."""


DESCRIPTION = "Which parallel layout to pick, whether it fits, and how fast it will be."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "what",
        nargs="?",
        choices=("comm",),
        help="comm: instead of a plan, the modelled time and nccl-tests' bandwidths of each collective over "
        "--gpus GPUs of --gpu, by message size (--min-bytes to --max-bytes)",
    )
    p.add_argument("--model", help=f"preset ({', '.join(model_names())}) or path to a HF config.json (a plan needs it)")
    p.add_argument(
        "--gpu",
        required=True,
        help=f"GPU from the catalog ({', '.join(gpu_names())}) or '{THIS_MACHINE}' (measured once, cached)",
    )
    p.add_argument("--gpus", type=int, required=True, help="GPUs (ranks) in total")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the GPU's reference system, 8)")
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="throughput",
        help="throughput: most tokens/s; latency: least TTFT + output_len x TPOT at batch 1",
    )
    p.add_argument(
        "--dtype",
        type=dtype_arg,
        metavar="{" + ",".join(DTYPES) + "}",
        help=f"weights/compute dtype (default bf16; float32 on {THIS_MACHINE}); fp8 quantizes the linear layers "
        "but those the model config's quantization_config keeps unquantized",
    )
    p.add_argument(
        "--memory-reserve",
        type=float,
        metavar="GIB",
        help="GiB per GPU kept out of the plan (CUDA context, workspaces, allocator slack); default: 10%% of "
        "the device for inference (vLLM's gpu_memory_utilization 0.9), 2 GiB for training",
    )
    p.add_argument(
        "--attention",
        choices=("fused", "unfused"),
        default="fused",
        help="fused (flash/SDPA: no s x s scores kept, as shardlm runs) or unfused (the a x s x s scores count)",
    )
    g = p.add_argument_group("inference")
    g.add_argument("--prompt-len", type=int, help=f"prompt tokens per request (default {DEFAULTS['prompt_len']})")
    g.add_argument("--output-len", type=int, help=f"generated tokens per request (default {DEFAULTS['output_len']})")
    g.add_argument("--batch", type=int, help="sequences per replica (default: as many as fit / 1 for latency)")
    g.add_argument(
        "--kv-dtype",
        type=kv_dtype_arg,
        metavar="{" + ",".join(KV_DTYPES) + "}",
        help="KV-cache dtype (default: --dtype); int8 counts its scale per token and head as shardlm stores it",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        metavar="C",
        help="serve C requests in flight over all replicas (closed loop, as vllm bench serve --max-concurrency): "
        "TTFT with queueing, TPOT with prefill chunks beside the decodes, throughput",
    )
    g.add_argument(
        "--request-rate",
        type=float,
        metavar="R",
        help="serve Poisson arrivals of R requests/s over all replicas (open loop, as vllm bench serve "
        "--request-rate); a rate over a layout's capacity is reported as such, with no finite TTFT",
    )
    g.add_argument(
        "--prefill-replicas",
        type=prefill_arg,
        metavar="N",
        help="as serve --prefill-replicas: N of the dp replicas only prefill, the others only decode (the KV cache "
        "handed over after the first token); each pool's TTFT/TPOT/capacity, and the colocated pick beside it; "
        "auto: search every split of each layout, and none",
    )
    g.add_argument(
        "--attention-dp",
        choices=("on", "off"),
        help="on: only layouts whose attention is data-parallel beside expert-parallel MoE layers (each replica "
        "its own sequences and KV cache, experts spanning the replicas; SGLang's --enable-dp-attention); off: none "
        "of them (default: both searched)",
    )
    g.add_argument("--max-ttft-ms", type=float, help="throughput objective: keep TTFT under this")
    g.add_argument("--max-tpot-ms", type=float, help="throughput objective: keep time per output token under this")
    p.add_argument(
        "--compare",
        metavar="PINS",
        help="set the pick beside the best layout with these pins, e.g. tp8,pp16 or tp8,pp8,dp16,zero1,interleaved,vpp2: "
        "axis sizes (tp pp dp cp ep etp), zeroN, a schedule name, vppN, mbN (micro-batch)",
    )
    c = p.add_argument_group("plan comm")
    c.add_argument("--min-bytes", type=byte_size, default=1024, help="smallest message (default 1KiB)")
    c.add_argument("--max-bytes", type=byte_size, default=1 << 30, help="largest message (default 1GiB; x8 a row)")
    t = p.add_argument_group("training")
    t.add_argument("--train", action="store_true", help="plan training (mixed-precision Adam) instead of inference")
    t.add_argument("--global-batch", type=int, help=f"sequences per step (default {DEFAULTS['global_batch']})")
    t.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {DEFAULTS['seq_len']})")
    t.add_argument("--micro-batch", type=int, help="pin the micro-batch size")
    t.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="pin the ZeRO stage")
    t.add_argument("--schedule", "--pp-schedule", choices=SCHEDULES, help="pin the pipeline schedule")
    t.add_argument(
        "--vpp", type=int, help="pin the interleaved schedule's model chunks per stage (implies --schedule interleaved)"
    )
    t.add_argument("--recompute", choices=("none", "selective", "full"), help="pin activation recomputation")
    t.add_argument(
        "--offload",
        choices=("optimizer",),
        help="ZeRO-Offload: masters and Adam moments in host memory, the step there (as train's --offload)",
    )
    t.add_argument(
        "--prefetch",
        type=int,
        metavar="N",
        help="ZeRO-3: layers whose all-gathers are in flight while one computes, as train's --prefetch "
        "(default 1; 0: each gathered when needed)",
    )
    t.add_argument("--sp", choices=("on", "off"), help="pin sequence parallelism (default: on whenever tp > 1)")
    t.add_argument(
        "--kernels",
        choices=KERNELS,
        help="whose memory-bound kernels (norms, activations, loss, Adam) move the bytes: shardlm (its eager "
        "trainer's, counted; default) or fused (one read and one write per fused kernel, as Megatron-LM, "
        "whose MoE block takes at least its measured floor a micro-batch's forward and backward)",
    )
    t.add_argument(
        "--zero3-reduce",
        choices=ZERO3_REDUCE,
        help="ZeRO-3's gradient reduce-scatters: blocking (each in its layer's backward, as shardlm's trainer; "
        "default) or overlapped (on their own stream behind the next layers' backward, as FSDP2 and "
        "Megatron-FSDP: for comparing with such runs, shardlm does not reduce so)",
    )
    t.add_argument(
        "--tp-overlap",
        action="store_true",
        default=None,
        help="TP's collectives pipelined with the GEMMs beside them, as Megatron-LM's --tp-comm-overlap (for "
        "comparing with such runs: shardlm's trainer waits for each)",
    )
    t.add_argument(
        "--ep-overlap",
        action="store_true",
        default=None,
        help="MoE layers' all-to-alls hidden behind another micro-batch's compute, as Megatron-Core's 1F1B "
        "all-to-all overlap (--overlap-moe-expert-parallel-comm: ep > 1, pp > 1 only interleaved, no full "
        "recomputation; for comparing with such runs: shardlm's trainer waits for each)",
    )
    t.add_argument(
        "--pp-overlap",
        action="store_true",
        default=None,
        help="the interleaved schedule's sends and receives between stages hidden behind the chunks computing "
        "beside them, as Megatron-Core runs them (overlap_p2p_comm, its default; for comparing with such "
        "runs: shardlm's trainer waits for each receive)",
    )
    t.add_argument(
        "--recompute-modules",
        metavar="M[,M]",
        help="Megatron-Core recompute modules added to each layout's recomputation: mla_up_proj (latent "
        "attention's up-projections, as DeepSeek-V3 trains) and mlp (a dense layer's MLP): less memory, more "
        "time (shardlm's trainer keeps them)",
    )
    t.add_argument(
        "--mtp",
        type=int,
        metavar="N",
        help="multi-token-prediction modules trained after the model, each a projection, one decoder layer "
        "and the LM head again on the last stage, as DeepSeek-V3 trains (1) and Megatron-Core's "
        "--mtp-num-layers (default 0; shardlm's trainer predicts the next token only)",
    )
    t.add_argument(
        "--grad-reduce",
        choices=tuple(GRAD_REDUCE_BYTES),
        help="the dtype gradients cross the data-parallel group in: fp32 (as shardlm's trainer; default) or "
        "bf16 (as Megatron-LM's --grad-reduce-in-bf16: for comparing with such runs, shardlm does not reduce so)",
    )
    t.add_argument(
        "--fp8-recipe",
        choices=FP8_RECIPES,
        help="with --dtype fp8: how the GEMMs' operands are scaled, as Megatron-LM's --fp8-recipe names it, which "
        "sets what their casts move: delayed (default; the norms feeding linears write FP8), tensorwise (current "
        "scaling: an amax pass over each tensor before its cast), mxfp8 or blockwise (per-block scales)",
    )
    p.add_argument(
        "--dispatcher",
        choices=DISPATCHERS,
        help="how MoE tokens travel: shardlm (every (token, expert) pair its own copy, as shardlm and "
        "Megatron's all-to-all send them; default) or deepep (once to each node, then each GPU, holding one of "
        "its experts, as DeepEP and HybridEP: for comparing with such runs, shardlm does not dispatch so)",
    )
    p.add_argument(
        "--cp-attention",
        choices=("pass-q", *CP_ATTENTION),
        help="how attention spans the cp ranks: training: pin ring or ulysses (default: searched); inference: "
        "how a prompt that arrives whole is attended, as generate's --cp-attention (default pass-q)",
    )
    d = p.add_argument_group("pin layout dimensions (the rest are searched)")
    for axis, what in (
        ("tp", "tensor"),
        ("pp", "pipeline"),
        ("dp", "data"),
        ("cp", "context"),
        ("ep", "expert"),
        ("etp", "expert-tensor"),
    ):
        d.add_argument(f"--{axis}", type=int, help=f"{what}-parallel size")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=5, help="layouts to show (default 5)")
    o.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    o.add_argument("--plot", metavar="DIR", help="write memory.png and schedule.png into DIR")
    o.add_argument("--recalibrate", action="store_true", help=f"re-measure {THIS_MACHINE} instead of using the cache")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="pick a parallel layout: memory, latency, throughput of every layout", description=DESCRIPTION
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def _fail(msg: str) -> int:
    print(f"shardlm plan: error: {msg}", file=sys.stderr)
    return 2


def build_request(args):
    from shardlm.plan.planner import PlanRequest

    def given(names: tuple[str, ...]) -> list[str]:
        return [n for n in names if getattr(args, n, None) is not None]

    if not args.model:
        raise PlanError(
            "--model is required for a plan, e.g. --model llama-3-8b (`shardlm plan comm` needs none: it "
            "prints the collective model's table)"
        )

    if args.train and given(INFER_ONLY):
        raise PlanError(
            f"--{given(INFER_ONLY)[0].replace('_', '-')} is an inference flag but --train plans training; "
            f"drop one of them"
        )
    if not args.train and given(TRAIN_ONLY):
        raise PlanError(f"--{given(TRAIN_ONLY)[0].replace('_', '-')} is a training flag; add --train or drop it")
    batch = args.global_batch or DEFAULTS["global_batch"]
    if args.train and args.micro_batch and batch % args.micro_batch:
        raise PlanError(
            f"--micro-batch {args.micro_batch} does not divide --global-batch {batch} (each dp replica's share "
            f"is a whole number of micro-batches); pick a divisor of {batch}"
        )
    zero3_only = [f for f in ("prefetch", "zero3_reduce") if getattr(args, f) is not None]
    if args.train and args.zero is not None and args.zero < 3 and zero3_only:
        flag = zero3_only[0].replace("_", "-")
        raise PlanError(f"--{flag} shapes ZeRO-3's communication, but --zero {args.zero} is pinned; drop one of them")
    if args.train and args.cp_attention == "pass-q":
        raise PlanError("--cp-attention pass-q is an inference attention; with --train pin ring or ulysses")
    if args.objective == "latency" and (args.max_ttft_ms is not None or args.max_tpot_ms is not None):
        raise PlanError(
            "--max-ttft-ms/--max-tpot-ms bound the throughput objective; with --objective latency "
            "the planner already minimises them: drop the limits or use --objective throughput"
        )
    if args.recalibrate and args.gpu != THIS_MACHINE:
        raise PlanError(f"--recalibrate measures {THIS_MACHINE}; it means nothing with --gpu {args.gpu}")
    for name in (
        "gpus",
        "gpus_per_node",
        "prompt_len",
        "output_len",
        "batch",
        "global_batch",
        "seq_len",
        "micro_batch",
        "top",
        "tp",
        "pp",
        "dp",
        "cp",
        "ep",
        "etp",
        "vpp",
        "max_concurrency",
        "prefill_replicas",
    ):
        v = getattr(args, name, None)
        if v is not None and v != "auto" and v < (0 if name == "output_len" else 1):
            raise PlanError(f"--{name.replace('_', '-')} {v}: must be a positive integer")
    if args.max_concurrency is not None and args.request_rate is not None:
        raise PlanError(
            f"--max-concurrency {args.max_concurrency} and --request-rate {args.request_rate:g} are two loads: give "
            f"one (a closed loop of C clients, or Poisson arrivals at R requests/s)"
        )
    if args.request_rate is not None and not (args.request_rate > 0 and math.isfinite(args.request_rate)):
        raise PlanError(
            f"--request-rate {args.request_rate:g}: must be a positive number of requests/s (for as many as the "
            f"layout takes, leave it out: the plan is then at full batch)"
        )
    fixed = {
        k: getattr(args, k)
        for k in ("tp", "pp", "dp", "cp", "ep", "etp", "zero", "schedule", "micro_batch", "recompute", "cp_attention")
        if getattr(args, k, None) is not None and (args.train or k != "cp_attention")  # inference: the workload's
    }
    if args.vpp is not None:
        if args.schedule not in (None, "interleaved"):
            raise PlanError(f"--vpp {args.vpp} sets the interleaved schedule's depth; drop --schedule {args.schedule}")
        if args.vpp < 2:
            raise PlanError(f"--vpp {args.vpp}: the interleaved schedule needs 2 or more chunks per stage")
        fixed["virtual"] = args.vpp
    if args.sp is not None:
        fixed["sp"] = args.sp == "on"
    if args.train and args.tp_overlap and (fixed.get("tp") == 1 or fixed.get("sp") is False):
        pinned = "--tp 1" if fixed.get("tp") == 1 else "--sp off"
        raise PlanError(
            f"--tp-overlap pipelines TP's collectives under sequence parallelism (as Megatron-LM requires), "
            f"but {pinned} is pinned; drop one of them"
        )
    if getattr(args, "attention_dp", None) is not None:
        fixed["attention_dp"] = args.attention_dp == "on"
    if getattr(args, "offload", None):
        fixed["offload"] = True
    mesh = [fixed.get(a, 1) for a in ("tp", "pp", "dp", "cp")]
    prod = mesh[0] * mesh[1] * mesh[2] * mesh[3]
    if args.gpus % prod:
        raise PlanError(
            f"pinned dims tp x pp x dp x cp = {prod} do not divide --gpus {args.gpus}; "
            f"their product must divide the GPU count"
        )
    if all(a in fixed for a in ("tp", "pp", "dp", "cp")) and prod != args.gpus:
        raise PlanError(f"tp x pp x dp x cp = {prod} but --gpus is {args.gpus}; they must be equal")
    dtype = args.dtype or ("fp32" if args.gpu == THIS_MACHINE else "bf16")
    if args.recalibrate:
        from shardlm.plan.calibrate import calibrate

        calibrate(force=True)
    common = dict(
        compare=None if args.compare is None else parse_pins(args.compare, train=args.train),
        model=args.model,
        gpu=args.gpu,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        objective=args.objective,
        fixed=fixed,
        top=args.top,
        memory_reserve_gib=args.memory_reserve,
    )
    if args.train:
        wl = TrainWorkload(
            global_batch=args.global_batch or DEFAULTS["global_batch"],
            seq_len=args.seq_len or DEFAULTS["seq_len"],
            dtype=dtype,
            fused_attention=args.attention == "fused",
            prefetch=1 if args.prefetch is None else args.prefetch,
            kernels=args.kernels or "shardlm",
            dispatcher=args.dispatcher or "shardlm",
            zero3_reduce=args.zero3_reduce or "blocking",
            grad_reduce=args.grad_reduce or "fp32",
            tp_overlap=bool(args.tp_overlap),
            ep_overlap=bool(args.ep_overlap),
            pp_overlap=bool(args.pp_overlap),
            recompute_modules=tuple(
                sorted({m.strip() for m in (args.recompute_modules or "").split(",") if m.strip()})
            ),
            mtp=args.mtp or 0,
            fp8_recipe=args.fp8_recipe,
        )
        return PlanRequest(train=True, training=wl, **common)

    def ms(v: float | None) -> float | None:
        return None if v is None else v / 1e3

    wl = InferenceWorkload(
        prompt_len=args.prompt_len or DEFAULTS["prompt_len"],
        output_len=DEFAULTS["output_len"] if args.output_len is None else args.output_len,
        batch=args.batch,
        dtype=dtype,
        kv_dtype=args.kv_dtype,
        max_ttft_s=ms(args.max_ttft_ms),
        max_tpot_s=ms(args.max_tpot_ms),
        fused_attention=args.attention == "fused",
        concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        prefill_replicas=None if args.prefill_replicas == "auto" else args.prefill_replicas or 0,
        cp_attention=args.cp_attention or "pass-q",
        dispatcher=args.dispatcher or "shardlm",
    )
    return PlanRequest(train=False, inference=wl, **common)


def run(args: argparse.Namespace) -> int:
    from shardlm.plan.planner import make_cluster, plan
    from shardlm.plan.report import print_table, to_json

    if args.what == "comm":
        return run_comm(args)
    try:
        req = build_request(args)
        make_cluster(req).gpu.matmul_flops((req.training or req.inference).dtype)  # fp8 on a GPU without it
        result = plan(req)
    except UsageError as e:
        return _fail(str(e))
    try:
        if args.json:
            print(to_json(result))
        else:
            print_table(result)
    except BrokenPipeError:  # `shardlm plan ... | head`
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (stays open: the interpreter flushes stdout at exit)
    if args.plot:
        from shardlm.plan.plot import write_plots

        paths = write_plots(result, args.plot)
        if not args.json:
            print("plots: " + ", ".join(str(p) for p in paths))
    return 0


def run_comm(args: argparse.Namespace) -> int:
    """``shardlm plan comm``: the collective model's table, comparable row by row with nccl-tests'."""
    from shardlm.plan import comm
    from shardlm.plan.planner import cluster_for

    if args.gpus < 2:
        return _fail(f"--gpus {args.gpus}: a collective needs 2 or more GPUs")
    if not 0 < args.min_bytes <= args.max_bytes:
        return _fail(f"--min-bytes {args.min_bytes} and --max-bytes {args.max_bytes}: need 0 < min <= max")
    try:
        cluster = cluster_for(args.gpu, args.gpus, args.gpus_per_node)
    except UsageError as e:
        return _fail(str(e))
    gpu = cluster.gpu
    sizes = []
    size = args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= 8
    rows = comm.table(cluster, sizes)
    if args.json:
        print(json.dumps({"gpu": gpu.name, "gpus": args.gpus, "gpus_per_node": cluster.gpus_per_node, "rows": rows}))
        return 0
    print(
        f"modelled collectives over {args.gpus} x {gpu.name} ({cluster.num_nodes} node(s) of {cluster.gpus_per_node})"
    )
    print(f"{'op':<15}{'bytes':>14}{'time us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}")
    for r in rows:
        print(f"{r['op']:<15}{r['bytes']:>14,}{r['time_us']:>12.1f}{r['algbw_GBps']:>12.2f}{r['busbw_GBps']:>12.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardlm plan", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def parse_pins(spec: str, *, train: bool) -> dict:
    """``--compare``'s pins ("tp8,pp16,zero1,interleaved,vpp2") as search pins."""
    out: dict = {}
    for token in filter(None, (t.strip().lower() for t in spec.split(","))):
        m = re.fullmatch(r"(tp|pp|dp|cp|ep|etp|zero|vpp|mb)(\d+)", token)
        if m and (m.group(1) not in ("zero", "vpp", "mb") or train):
            key = {"vpp": "virtual", "mb": "micro_batch"}.get(m.group(1), m.group(1))
            out[key] = int(m.group(2))
            if key == "virtual":
                out["schedule"] = "interleaved"
        elif token in SCHEDULES and train:
            out["schedule"] = token
        else:
            knobs = ", zeroN, vppN, mbN or a schedule (" + ", ".join(SCHEDULES) + ")" if train else ""
            raise PlanError(
                f"--compare {spec}: {token!r} is not a pin; give axis sizes (tp8, pp16, dp4, cp2, ep8, etp2){knobs}"
            )
    if out.get("zero", 0) > 3:
        raise PlanError(f"--compare {spec}: ZeRO stages are 0-3")
    return out


if __name__ == "__main__":
    sys.exit(main())
