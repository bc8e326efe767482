"""``shardlm train``: fine-tune a model on a text file over dp x pp x cp x tp ranks with ZeRO.

Each step logs its loss, gradient norm and throughput (one line on stderr; --json: one JSON
object per step on stdout); --plot draws the loss curve.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardlm.args import add_axis_args, axis_options, log
from shardlm.parallel.dims import ParallelDims
from shardlm.train.trainer import AXES as TRAIN_AXES


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="fine-tune on a text file over tp x dp ranks (ZeRO 0-3)",
        description="Next-token training on a text file; the model split over tp ranks, "
        "each batch over dp ranks, the model states sharded by ZeRO.",
    )
    p.add_argument("--data", required=True, help="a UTF-8 text file to train on")
    p.add_argument(
        "--model", default="smollm2", help="'smollm2' (embedded SmolLM2-135M-Instruct), a HF directory, or a .gguf file"
    )
    add_axis_args(p, TRAIN_AXES)  # pp: 1F1B over the --grad-accum micro-batches; cp: zig-zag chunks
    p.add_argument(
        "--cp-attention",
        default="all-gather",
        choices=["all-gather", "ring"],
        help="with cp: all-gather each layer's keys/values (default), or ring attention (blocks "
        "passed rank to rank; a rank never holds the whole sequence's keys/values)",
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
        default=1,
        metavar="N",
        help="ZeRO-3: all-gather the next N layers' weights while one computes (default 1; 0: off)",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=25.0,
        metavar="MB",
        help="ZeRO 0-2: reduce gradients in buckets of about MB MiB, each as soon as backward "
        "completes it, overlapped with the rest (default 25; 0: no overlap)",
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step, over all dp ranks (default 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step on each dp rank (default 1)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="bfloat16 / float16: mixed precision, float32 master weights in the optimizer; float16 "
        "with dynamic loss scaling (default float32)",
    )
    p.add_argument(
        "--recompute",
        default="none",
        choices=["none", "selective", "full"],
        help="selective: recompute the SwiGLU activation in backward (half the MLP's activations); "
        "full: each layer keeps only its inputs and runs its forward again in backward",
    )
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
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
    p.add_argument("--plot", metavar="DIR", default=None, help="write loss.png (loss per step) into DIR")
    p.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from shardlm.errors import UsageError
    from shardlm.launch import LocalRanks, torchrun_env
    from shardlm.models.loader import open_checkpoint
    from shardlm.parallel.context import zigzag_positions
    from shardlm.parallel.pipeline import stage_layers
    from shardlm.train.data import Batches
    from shardlm.train.trainer import TrainConfig, Trainer, check_trainable

    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} must be at least 1, e.g. --steps 20")
    if args.checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every {args.checkpoint_every} must be at least 1, e.g. 100")
    data = Path(args.data)
    if not data.is_file():
        raise UsageError(f"--data {args.data!r} is not a file; give a UTF-8 text file to train on")
    config = TrainConfig(
        model=args.model,
        parallel=ParallelDims.take(axis_options(args)),
        cp_attention=args.cp_attention,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        dtype=args.dtype,
        zero=args.zero,
        prefetch=args.prefetch,
        bucket_mb=args.bucket_mb,
        lr=args.lr,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm or None,
        grad_accum=args.grad_accum,
        threads=args.threads,
        timeout_s=args.timeout,
    )
    ckpt = open_checkpoint(args.model)
    check_trainable(ckpt.config, args.tp)  # here, not first on every rank: one line, no tracebacks
    zigzag_positions(args.seq_len, args.cp, 0)  # the sequence must split into 2 x cp chunks
    stage_layers(ckpt.config, args.pp)  # at most one stage per layer
    tokens = args.batch_size // (args.dp * args.grad_accum) * (args.seq_len // args.cp)  # a micro-batch on a rank
    if args.sequence_parallel and tokens % args.tp:
        raise UsageError(
            f"--sequence-parallel splits a micro-batch's {tokens} tokens on a rank over tp={args.tp} "
            f"evenly; choose --batch-size, --grad-accum and --seq-len so that tp divides them"
        )
    ids = ckpt.tokenizer().encode(data.read_text(encoding="utf-8"))
    batches = Batches(ids, seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed, source=str(data))
    order = {"data": str(data.resolve()), "seq_len": args.seq_len, "batch_size": args.batch_size, "seed": args.seed}
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
    if speaker:
        ring = " ring" if args.cp > 1 and args.cp_attention == "ring" else ""
        layout = f"dp={args.dp}, pp={args.pp}, cp={args.cp}{ring}, tp={args.tp}, ZeRO-{args.zero}"
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
    if env is not None:  # under torchrun: this process is one rank
        trainer = Trainer(config, rank=env["rank"], world=env["world"], init_method="env://")
        step, save, save_state, load_state = trainer.step, trainer.save, trainer.save_state, trainer.load_state
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
    history = []
    try:
        first = 0
        if resume:
            first = load_state(args.checkpoint)
            if speaker:
                log(f"resumed from {args.checkpoint} after step {first}")
        for i in range(first, args.steps):
            s = step(batches(i))
            if args.checkpoint and ((i + 1) % args.checkpoint_every == 0 or i + 1 == args.steps):
                save_state(args.checkpoint)
                if speaker:
                    (state / "batches.json").write_text(json.dumps(order))
            history.append({"step": i + 1, **s})
            if not speaker:
                continue
            tok_s = s["tokens"] / s["seconds"]
            if args.json:
                print(json.dumps({"step": i + 1, **s, "tokens_per_s": tok_s}), flush=True)
            log(
                f"step {i + 1}/{args.steps}  loss {s['loss']:.4f}  grad norm {s['grad_norm']:.3f}  "
                f"{tok_s:.0f} tok/s  {s['seconds']:.2f} s"
            )
        if args.save:
            save(args.save)
            if speaker:
                log(f"saved the trained model to {args.save} (shardlm generate --model {args.save})")
    finally:
        close()
    if speaker and args.plot:
        log(f"wrote {loss_plot(history, args, Path(args.plot))}")
    return 0


def loss_plot(history: list[dict], args, directory: Path) -> Path:
    from shardlm.plan.plot import pyplot

    plt = pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([s["step"] for s in history], [s["loss"] for s in history], marker="o", markersize=3)
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
