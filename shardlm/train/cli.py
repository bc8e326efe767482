"""``shardlm train``: fine-tune a model on a text file over dp x pp x cp x tp ranks with ZeRO.

Each step logs its loss, gradient norm and throughput (one line on stderr; --json: one JSON
object per step on stdout); --plot draws the loss curve.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardlm.args import LOG, add_axis_args, add_config_file, axis_options, log
from shardlm.parallel.context import ALGORITHMS
from shardlm.parallel.dims import ParallelDims
from shardlm.parallel.schedules import PIPELINE_SCHEDULES
from shardlm.train.progress import StepReport, flops_per_token, peak_flops
from shardlm.train.trainer import AXES as TRAIN_AXES


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="fine-tune on a text file over tp x dp ranks (ZeRO 0-3)",
        description="Next-token training on a text file; the model split over tp ranks, "
        "each batch over dp ranks, the model states sharded by ZeRO.",
    )
    p.add_argument("--data", default=None, help="a UTF-8 text file to train on (required)")
    add_config_file(p)
    p.add_argument(
        "--model", default="smollm2", help="'smollm2' (embedded SmolLM2-135M-Instruct), a HF directory, or a .gguf file"
    )
    add_axis_args(p, TRAIN_AXES)  # pp: --pp-schedule over the --grad-accum micro-batches; cp: zig-zag chunks
    p.add_argument(
        "--pp-schedule",
        default=None,
        choices=list(PIPELINE_SCHEDULES),
        help="with pp: the pipeline schedule over the --grad-accum micro-batches: 1f1b (default), gpipe, "
        "interleaved (--vpp chunks of layers per stage; --grad-accum a multiple of pp) or zb-h1 (zero "
        "bubble: weight gradients deferred into the bubbles)",
    )
    p.add_argument(
        "--vpp",
        type=int,
        default=1,
        metavar="V",
        help="chunks of layers per pipeline stage for the interleaved schedule (implies --pp-schedule "
        "interleaved; the layers must split into pp x V equal chunks)",
    )
    p.add_argument(
        "--cp-attention",
        default="all-gather",
        choices=list(ALGORITHMS),
        help="with cp: all-gather each layer's keys/values (default), ring attention (blocks "
        "passed rank to rank; a rank never holds the whole sequence's keys/values), or ulysses "
        "(all-to-alls that split the heads over cp ranks for attention)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with tp: split activations between the tp regions by tokens (norms on 1/tp of them)",
    )
    p.add_argument(
        "--zero",
        type=int,
        default=1,
        choices=[0, 1, 2, 3],
        help="ZeRO stage: 0 plain dp, 1 optimizer state sharded (default), 2 + gradients, 3 + weights",
    )
    p.add_argument(
        "--prefetch",
        type=int,
        default=None,
        metavar="N",
        help="ZeRO-3: all-gather the next N layers' weights while one computes (0: off; default 1 on a "
        "GPU, 0 on CPU ranks, whose blocking shared-memory collectives are faster)",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        metavar="MB",
        help="ZeRO 0-2: reduce gradients in buckets of about MB MiB, each as soon as backward "
        "completes it, overlapped with the rest (0: no overlap; default 25 on a GPU, 0 on CPU ranks)",
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step, over all dp ranks (default 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step on each dp rank (default 1)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="bfloat16 / float16: mixed precision, float32 master weights in the optimizer; float16 "
        "with dynamic loss scaling; auto (default): bfloat16 on a GPU, float32 on CPU ranks",
    )
    p.add_argument(
        "--offload",
        default=None,
        choices=["optimizer"],
        help="ZeRO-Offload: on a GPU, float32 masters and AdamW moments in CPU memory, the step run there "
        "(CPU ranks: nothing moves)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each decoder layer's forward and backward (a one-time compile, then fused kernels)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto (default): cuda when this host has a GPU per rank (rank r on GPU r, NCCL), else cpu",
    )
    p.add_argument(
        "--recompute",
        default="none",
        choices=["none", "selective", "full"],
        help="selective: recompute the SwiGLU activation in backward (half the MLP's activations); "
        "full: each layer keeps only its inputs and runs its forward again in backward",
    )
    p.add_argument(
        "--aux-loss-coef",
        type=float,
        default=0.0,
        help="MoE: weight of the load-balancing loss (HF's router_aux_loss_coef; default 0: none)",
    )
    p.add_argument(
        "--bias-update-rate",
        type=float,
        default=0.0,
        help="DeepSeek-V3: move each expert's correction bias by this much a step towards balance (default 0: off)",
    )
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's peak learning rate (default 1e-4)")
    p.add_argument(
        "--lr-schedule",
        default="constant",
        choices=["constant", "linear", "cosine"],
        help="after the warm-up: constant (default), or a linear / cosine decay to --lr-min x lr at the last step",
    )
    p.add_argument("--warmup-steps", type=int, default=0, help="steps of linear warm-up up to --lr (default 0)")
    p.add_argument("--lr-min", type=float, default=0.0, help="where a decay ends, as a fraction of --lr (default 0)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    p.add_argument("--seed", type=int, default=0, help="order of the windows (default 0)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / ranks)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait before the run fails")
    p.add_argument(
        "--save",
        metavar="DIR",
        default=None,
        help="after training, write the model as a HF directory (safetensors, config, tokenizer)",
    )
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        default=None,
        help="keep the training state (each rank's shards and AdamW state) in DIR, every "
        "--checkpoint-every steps and at the end; if DIR holds one, resume from it",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=100,
        metavar="N",
        help="steps between training-state saves (default 100)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="every N steps and at the end, the loss on held-out text: the last --eval-fraction of --data, "
        "never trained on (default 0: off)",
    )
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.05,
        metavar="F",
        help="the share of --data's tokens (its tail) held out for --eval-every (default 0.05)",
    )
    p.add_argument("--plot", metavar="DIR", default=None, help="write loss.png (loss per step) into DIR")
    p.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    import torch

    from shardlm.errors import UsageError
    from shardlm.launch import LocalRanks, resolve_device, torchrun_env
    from shardlm.models.loader import open_checkpoint
    from shardlm.parallel.context import zigzag_positions
    from shardlm.parallel.pipeline import stage_layers
    from shardlm.train.data import Batches
    from shardlm.train.trainer import TrainConfig, Trainer, check_trainable, train_dtype

    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} must be at least 1, e.g. --steps 20")
    if args.eval_every < 0:
        raise UsageError(f"--eval-every {args.eval_every} must be 0 (off) or a number of steps, e.g. 50")
    if not 0 < args.eval_fraction < 1:
        raise UsageError(f"--eval-fraction {args.eval_fraction} must be in (0, 1), e.g. 0.05")
    if args.checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every {args.checkpoint_every} must be at least 1, e.g. 100")
    if args.data is None:
        raise UsageError('give the text to train on: --data FILE (or data = "FILE" in the --config file)')
    data = Path(args.data)
    if not data.is_file():
        raise UsageError(f"--data {args.data!r} is not a file; give a UTF-8 text file to train on")
    schedule = args.pp_schedule or ("interleaved" if args.vpp > 1 else "1f1b")  # Megatron: a vpp means interleaved
    config = TrainConfig(
        model=args.model,
        parallel=ParallelDims.take(axis_options(args)),
        pp_schedule=schedule,
        vpp=args.vpp,
        cp_attention=args.cp_attention,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        aux_loss_coef=args.aux_loss_coef,
        bias_update_rate=args.bias_update_rate,
        dtype=args.dtype,
        device=args.device,
        compile=args.compile,
        offload=args.offload,
        zero=args.zero,
        prefetch=args.prefetch,
        bucket_mb=args.bucket_mb,
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        lr_min=args.lr_min,
        total_steps=args.steps,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm or None,
        grad_accum=args.grad_accum,
        threads=args.threads,
        timeout_s=args.timeout,
    )
    ckpt = open_checkpoint(args.model)
    check_trainable(  # once here: one line
        ckpt.config, args.tp, cp=args.cp, cp_attention=args.cp_attention, pp=args.pp, pp_schedule=schedule, vpp=args.vpp
    )
    zigzag_positions(args.seq_len, args.cp, 0)  # the sequence must split into 2 x cp chunks
    stage_layers(ckpt.config, args.pp)  # at most one stage per layer
    tokens = args.batch_size // (args.dp * args.grad_accum) * (args.seq_len // args.cp)  # a micro-batch on a rank
    if args.sequence_parallel and tokens % args.tp:
        raise UsageError(
            f"--sequence-parallel splits a micro-batch's {tokens} tokens on a rank over tp={args.tp} "
            f"evenly; choose --batch-size, --grad-accum and --seq-len so that tp divides them"
        )
    ids = ckpt.tokenizer().encode(data.read_text(encoding="utf-8"))
    held_out: list = []
    if args.eval_every:  # the text's tail, never trained on: its windows do not overlap the training ones
        cut = int(len(ids) * (1 - args.eval_fraction))
        ids, tail = ids[:cut], ids[cut:]
        where = f"the last {args.eval_fraction:g} of {data}'s tokens (--eval-fraction)"
        held_out = Batches(tail, seq_len=args.seq_len, batch_size=args.batch_size, source=where).in_order()
    batches = Batches(ids, seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed, source=str(data))
    order = {"data": str(data.resolve()), "seq_len": args.seq_len, "batch_size": args.batch_size, "seed": args.seed}
    if args.eval_every:
        order["eval_fraction"] = args.eval_fraction
    state = Path(args.checkpoint or ".") / "state"
    resume = args.checkpoint is not None and (state / "meta.json").is_file()
    if resume:  # before any rank starts
        saved = json.loads((state / "batches.json").read_text()) if (state / "batches.json").is_file() else order
        if saved != order:  # the steps ahead would not be the batches the saved ones were followed by
            raise UsageError(
                f"the training state in {args.checkpoint!r} was trained on {saved}, this run asks "
                f"for {order}; resume with the same --data, --seq-len, --batch-size and --seed"
            )
    env = torchrun_env()
    speaker = env is None or env["rank"] == 0
    world = config.dims().world_size
    device = resolve_device(args.device, env["local_world"] if env else world)  # as every rank resolves it
    dtype = train_dtype(args.dtype, device)
    if speaker and args.offload and device == "cpu":
        log("--offload optimizer: CPU ranks keep the optimizer in CPU memory already; nothing moves")
    if speaker:
        ring = f" {args.cp_attention}" if args.cp > 1 and args.cp_attention != "all-gather" else ""
        layout = f"dp={args.dp}, pp={args.pp}, cp={args.cp}{ring}, tp={args.tp}, ZeRO-{args.zero}, {device}, {dtype}"
        log(
            f"training {args.model} ({ckpt.config.family}, {ckpt.config.num_layers} layers) on {world} "
            f"rank{'s' if world > 1 else ''} ({layout}); "
            f"{len(ids)} tokens of {data.name}: {len(batches.windows)} windows of {args.seq_len}, "
            f"{batches.per_epoch} steps an epoch"
        )
    # the same four calls, on this rank (torchrun) or on every rank this process started
    step: Callable[[Any], dict]
    save: Callable[[str], Any]
    save_state: Callable[[str], Any]
    load_state: Callable[[str], int]
    evaluate: Callable[[Any], dict]
    if env is not None:  # under torchrun: this process is one rank
        trainer = Trainer(config, rank=env["rank"], world=env["world"], init_method="env://")
        step, save, save_state, load_state = trainer.step, trainer.save, trainer.save_state, trainer.load_state
        evaluate = trainer.evaluate
        close = lambda: None
    else:
        ranks = LocalRanks(world, Trainer.spawned, (config,), timeout_s=config.timeout_s)
        close = ranks.close
        try:
            infos = ranks.collect("ready")
        except BaseException:
            close()
            raise
        if speaker:
            log(f"loaded; parameters per rank (before ZeRO): {', '.join(str(i['params']) for i in infos)}")
        # as lists: a tensor on a pipe would go by torch's shared-memory handles, which these ranks cannot open
        step = lambda b: ranks.call("step", b.tolist())[0]
        save = lambda d: ranks.call("save", d)[0]
        save_state = lambda d: ranks.call("save_state", d)
        load_state = lambda d: ranks.call("load_state", d)[0]
        evaluate = lambda b: ranks.call("evaluate", b.tolist())[0]
    history: list[dict] = []
    evals: list[dict] = []  # held-out loss after some steps (--eval-every)
    report = None
    try:
        first = 0
        if resume:
            first = load_state(args.checkpoint)
            if speaker:
                log(f"resumed from {args.checkpoint} after step {first}")
        if speaker:
            bar = sys.stderr.isatty() and not args.json and LOG.isEnabledFor(logging.INFO)
            peak = peak_flops(torch.cuda.get_device_name() if device == "cuda" else "cpu", dtype, world)
            report = StepReport(args.steps, first, flops_per_token(ckpt.config, args.seq_len), peak, world, bar)
        for i in range(first, args.steps):
            s = step(batches(i))
            if args.checkpoint and ((i + 1) % args.checkpoint_every == 0 or i + 1 == args.steps):
                save_state(args.checkpoint)
                if speaker:
                    (state / "batches.json").write_text(json.dumps(order))
            history.append({"step": i + 1, **s})
            if report is not None:
                if args.json:
                    print(json.dumps({"step": i + 1, **s, **report.numbers(s)}), flush=True)
                report.step(i + 1, s)
            if args.eval_every and ((i + 1) % args.eval_every == 0 or i + 1 == args.steps):
                results = [evaluate(b) for b in held_out]  # collective: every rank evaluates
                tokens = sum(r["tokens"] for r in results)
                loss = sum(r["loss"] * r["tokens"] for r in results) / tokens
                evals.append({"step": i + 1, "loss": loss})
                if report is not None:
                    if args.json:
                        print(json.dumps({"step": i + 1, "eval_loss": loss, "eval_tokens": tokens}), flush=True)
                    report.note(f"eval after step {i + 1}: loss {loss:.4f} on {tokens} held-out tokens")
        if args.save:
            save(args.save)
            if speaker:
                log(f"saved the trained model to {args.save} (shardlm generate --model {args.save})")
    finally:
        if report is not None:
            report.close()
        close()
    if speaker and args.plot:
        log(f"wrote {loss_plot(history, evals, args, Path(args.plot))}")
    return 0


def loss_plot(history: list[dict], evals: list[dict], args, directory: Path) -> Path:
    from shardlm.plan.plot import pyplot

    plt = pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([s["step"] for s in history], [s["loss"] for s in history], marker="o", markersize=3, label="training")
    if evals:
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], marker="s", label="held out (--eval-every)")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean next-token cross-entropy)")
    ax.set_title(
        f"{args.model}: dp={args.dp} pp={args.pp} cp={args.cp} tp={args.tp} ZeRO-{args.zero}, "
        f"batch {args.batch_size} x {args.seq_len}"
    )
    ax.grid(alpha=0.3)
    path = directory / "loss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
