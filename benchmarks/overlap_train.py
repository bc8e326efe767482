"""Does overlapping ZeRO's communication with compute pay on this host? dp=2 CPU ranks.

For ZeRO-2 (gradient buckets reduced during backward, ``bucket_mb``) and ZeRO-3 (the next
layers' all-gathers in flight, ``prefetch``), each rank builds two trainers of the same model,
one with the overlap off (``bucket_mb=0``: blocking reductions, a layer at a time at ZeRO-2;
``prefetch=0``: each layer gathered when needed) and one with it on (the defaults), and steps
them in turns, so both see the same machine load. Per step and rank it times:

* the step (``Trainer.step``'s seconds);
* the time blocked in ZeRO's communication, split into gradient reductions and weight
  all-gathers: inside a blocking collective of unit.py / zero.py / overlap.py, starting an
  asynchronous one, or waiting for one. With the overlap off this is all of that communication;
  with it on, what compute did not hide (exposed communication). ZeRO-2's all-gather of the
  weights after the optimizer step is blocking in both.

It prints the medians over ``--steps`` timed steps (after one warm-up) of rank 0 and the ratios
on / off. ``step - blocked`` is the compute (and the optimizer) each variant ran: on a CPU the
asynchronous collectives' threads take cores from it.

    python benchmarks/overlap_train.py [--model smollm2] [--batch 4] [--seq-len 128] [--steps 4]
                                       [--stages 2,3]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.multiprocessing as mp
from common import load_note

OFF = {2: {"bucket_mb": 0.0}, 3: {"prefetch": 0}}


class _Waited:
    """A collective in flight whose ``wait()`` is timed into ``spent[kind]``."""

    def __init__(self, pending, spent: dict[str, float], kind: str):
        self.pending, self.spent, self.kind = pending, spent, kind

    def wait(self):
        start = time.perf_counter()
        try:
            return self.pending.wait()
        finally:
            self.spent[self.kind] += time.perf_counter() - start


def _timed(fn, spent: dict[str, float], kind: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        finally:
            spent[kind] += time.perf_counter() - start
        return _Waited(out, spent, kind) if fn.__name__.endswith("_start") else out

    return wrapper


def _count_blocking(spent: dict[str, float]) -> None:
    """Time every collective ZeRO calls (module names, looked up at call time) and every wait."""
    from shardlm.train import overlap, unit, zero

    for module, names, kind in (
        (unit, ("all_gather", "all_gather_start"), "gather"),
        (zero, ("reduce_scatter",), "reduce"),  # ZeRO-3's gradients
        (overlap, ("all_reduce", "all_reduce_start", "reduce_scatter", "reduce_scatter_start"), "reduce"),
    ):
        for name in names:
            setattr(module, name, _timed(getattr(module, name), spent, kind))


def _rank(rank: int, world: int, init: str, args, stage: int, out) -> None:
    from shardlm.train.trainer import TrainConfig, Trainer

    spent = {"reduce": 0.0, "gather": 0.0}
    _count_blocking(spent)
    common = dict(model=args.model, dp=world, zero=stage, threads=1)
    trainers = {
        "off": Trainer(TrainConfig.of(**common, **OFF[stage]), rank=rank, world=world, init_method=init),
        "on": Trainer(TrainConfig.of(**common), rank=rank, world=world, init_method=init),
    }
    vocab = trainers["on"].checkpoint.config.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=g) for _ in range(args.steps + 1)]
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in trainers}
    for i, batch in enumerate(batches):
        for name, trainer in trainers.items():  # in turns: both see the same load
            spent.update(reduce=0.0, gather=0.0)
            seconds = trainer.step(batch)["seconds"]
            if i:  # the first step warms up
                times[name].append((seconds, spent["reduce"], spent["gather"]))
    if rank == 0:
        out.put(times)


def run(args, stage: int) -> None:
    from shardlm.launch import _free_port

    out = mp.get_context("spawn").SimpleQueue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(_rank, args=(2, init, args, stage, out), nprocs=2)
    times = out.get()
    med = {name: [statistics.median(x) for x in zip(*t)] for name, t in times.items()}
    what = "gradient buckets (bucket_mb=25 vs 0)" if stage == 2 else "prefetch (1 layer vs 0)"
    print(f"\nZeRO-{stage}, {what}: medians of {args.steps} steps, rank 0 (seconds)")
    print(f"{'overlap':>8} {'step':>8} {'blocked: reduce':>16} {'gather':>8} {'step - blocked':>15}")
    for name, (step, reduce, gather) in med.items():
        print(f"{name:>8} {step:8.3f} {reduce:16.3f} {gather:8.3f} {step - reduce - gather:15.3f}")
    (step_off, *off), (step_on, *on) = med["off"], med["on"]
    kind = 0 if stage == 2 else 1  # what the overlap is for: ZeRO-2's reductions, ZeRO-3's gathers
    print(
        f"on / off: step {step_on / step_off:.3f}x, exposed {('reduction', 'gather')[kind]} time "
        f"{on[kind] / off[kind]:.3f}x, compute {(step_on - sum(on)) / (step_off - sum(off)):.3f}x",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=4, help="sequences a step, over both ranks")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant (after one warm-up)")
    ap.add_argument("--stages", default="2,3", help="comma list of ZeRO stages: 2, 3")
    args = ap.parse_args()
    print(f"{args.model} float32, dp=2, batch {args.batch} x {args.seq_len} tokens; {load_note()}", flush=True)
    for stage in (int(s) for s in args.stages.split(",")):
        if stage not in OFF:
            raise SystemExit(f"--stages {args.stages}: {stage} is not 2 or 3")
        run(args, stage)


if __name__ == "__main__":
    main()
