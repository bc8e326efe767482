"""The measured bubble of each training pipeline schedule next to its formula and the planner's
simulator (plan/schedule.py), on pp CPU ranks.

Each rank builds one trainer per schedule (1F1B, GPipe, interleaved with ``--vpp`` chunks per
stage, ZB-H1) of the same model and steps them in turns, so all see the same machine load. A
trainer records every pipeline operation it runs (``Trainer.timeline``); the time an operation
spends blocked receiving from its neighbour is taken out of it (receives are timed here). Per
schedule it prints, from the median step of ``--steps`` (after one warm-up):

* the measured bubble: the share of the step (first operation to last, over all stages) that
  stages spent not computing, averaged over the stages;
* the closed form for uniform stages: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1)
  interleaved, and for ZB-H1 (p-1)(T_F+T_B-T_W) over the step with the measured times;
* the simulator's bubble for the same orders, fed the measured times of F, B and W;
* the step time against 1F1B's.

On this 2-core host two ranks of one thread each have a core each. The default model is a random
Llama of 12 equal layers (hidden 512) with a 512-token vocabulary, so the stages and chunks are even,
as the formulas assume; ``--model smollm2`` (30 layers, a 49152-token LM head on the last stage) is
the real one, uneven.

    python benchmarks/pipeline_train.py [--model even|smollm2|DIR] [--pp 2] [--micro 4] [--vpp 3]
                                        [--seq-len 128] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from common import load_note, spawn_ranks

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")


def even_model(directory: str) -> str:
    """A random Llama whose layers are the work: 12 layers, hidden 512, a 512-token vocabulary."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    return directory


def _rank(rank: int, world: int, port: int, args, results) -> None:
    from shardlm.train import schedule as stage_io
    from shardlm.train.trainer import TrainConfig, Trainer

    waits: list[tuple[float, float]] = []  # every blocking receive: (start, end)
    recv = stage_io.recv

    def timed_recv(*a, **k):
        start = time.perf_counter()
        try:
            return recv(*a, **k)
        finally:
            waits.append((start, time.perf_counter()))

    stage_io.recv = timed_recv
    init = f"tcp://127.0.0.1:{port}"
    common = dict(model=args.model, pp=world, grad_accum=args.micro, threads=1, max_grad_norm=None)
    trainers = {
        s: Trainer(
            TrainConfig.of(**common, pp_schedule=s, vpp=args.vpp if s == "interleaved" else 1),
            rank=rank,
            world=world,
            init_method=init,
        )
        for s in SCHEDULES
    }
    vocab = trainers["1f1b"].checkpoint.config.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.micro, args.seq_len + 1), generator=g) for _ in range(args.steps + 1)]
    steps: dict[str, list] = {s: [] for s in SCHEDULES}
    for i, batch in enumerate(batches):
        for name, trainer in trainers.items():  # in turns
            waits.clear()
            trainer.step(batch)
            if i:  # the first step warms up
                ops = []
                for kind, micro, chunk, start, end in trainer.timeline:
                    waited = sum(min(b, end) - max(a, start) for a, b in waits if a < end and b > start)
                    ops.append((kind, micro, chunk, start, end, waited))
                steps[name].append(ops)
    results.put((rank, steps))


def _bubble(stages: list[list[tuple]]) -> tuple[float, float]:
    """(the idle share of the step averaged over stages, the step's seconds) of one step's timelines."""
    begin = min(op[3] for ops in stages for op in ops)
    span = max(op[4] for ops in stages for op in ops) - begin
    busy = [sum(end - start - waited for _, _, _, start, end, waited in ops) for ops in stages]
    return sum(span - b for b in busy) / (len(stages) * span), span


def _times(stages: list[list[tuple]], v: int) -> dict[str, float]:
    """Mean compute seconds of F, B and W per micro-batch on a stage (a chunk's times v), from the
    stages after the first (ZB-H1's first stage runs its whole backward as W)."""
    out = {}
    for kind in "FBW":
        got = [end - start - waited for ops in stages[1:] for k, _, _, start, end, waited in ops if k == kind]
        out[kind] = statistics.mean(got) * v if got else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="even", help="even (a random Llama of equal stages), smollm2 or a HF directory")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (ranks)")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches a step (one sequence each)")
    ap.add_argument("--vpp", type=int, default=3, help="chunks per stage of the interleaved schedule")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per schedule (after one warm-up)")
    args = ap.parse_args()
    if args.model == "even":
        args.model = even_model(tempfile.mkdtemp(prefix="pipeline-train-"))
    from shardlm.plan.schedule import bubble_fraction, simulate

    p, m = args.pp, args.micro
    print(f"{args.model} float32, pp={p}, {m} micro-batches of 1 x {args.seq_len} tokens; {load_note()}", flush=True)
    per_rank = spawn_ranks(p, _rank, args)
    rows = {}
    for name in SCHEDULES:
        v = args.vpp if name == "interleaved" else 1
        measured = [_bubble([per_rank[s][name][k] for s in range(p)]) for k in range(args.steps)]
        bubble, span = sorted(measured, key=lambda x: x[1])[len(measured) // 2]  # the median step
        t = _times([per_rank[s][name][0] for s in range(p)], v)
        if name == "zb-h1":
            idle = (p - 1) * (t["F"] + t["B"] - t["W"])
            formula = idle / (m * (t["F"] + t["B"] + t["W"]) + idle)
        else:
            formula = bubble_fraction(name, p=p, m=m, v=v)
        sim = simulate(name, stages=p, micro=m, virtual=v, t_f=t["F"], t_b=t["B"], t_w=t["W"]).bubble_fraction
        rows[name] = (bubble, formula, sim, span, t)
    base = rows["1f1b"][3]
    print(
        f"\n{'schedule':>14} {'bubble':>8} {'formula':>8} {'simulated':>9} {'step s':>7} {'vs 1f1b':>8}   F / B / W s"
    )
    for name, (bubble, formula, sim, span, t) in rows.items():
        label = f"{name} v={args.vpp}" if name == "interleaved" else name
        print(
            f"{label:>14} {bubble:8.3f} {formula:8.3f} {sim:9.3f} {span:7.2f} {base / span:7.2f}x   "
            f"{t['F']:.2f} / {t['B']:.2f} / {t['W']:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
