"""Pipeline parallel throughput on SmolLM2: micro-batched pp=2 vs one micro-batch vs pp=1.

A batch of chat prompts, each generating --tokens tokens, in the same run:
* pp=1: one process, all cores;
* pp=2, 1 micro-batch: the whole batch walks stage 0 then stage 1, the other one idle;
* pp=2, m micro-batches: m batches in flight, so both stages work at once.
Each stage's measured idle fraction (1 - its compute time / wall time) is printed next
to the formula for one pass, (p - 1) / (m + p - 1). The layouts are loaded together and
timed in turns (--repeats rounds, median), since this machine's speed drifts by 20-30%.
The batch is 64 by default: micro-batches smaller than ~16 rows make each matmul less
efficient on CPU (float32 GFLOPS here: 8 at 1 row, 22 at 8, 57 at 32), which eats the gain.

    python benchmarks/pipeline.py [--prompts 64] [--tokens 48] [--micro-batches 2,4] [--repeats 3]
"""

from __future__ import annotations

import argparse

from common import in_turns, load_note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--micro-batches", default="2,4")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the layouts in turns (median reported)")
    args = ap.parse_args()
    runs = [("pp=1", dict(pp=1), 1), ("pp=2, 1 micro-batch", dict(pp=2, micro_batches=1), 1)]
    runs += [
        (f"pp=2, {m} micro-batches", dict(pp=2, micro_batches=m), m) for m in map(int, args.micro_batches.split(","))
    ]
    print(f"SmolLM2-135M float32, {args.prompts} prompts x {args.tokens} tokens; {load_note()}", flush=True)
    measured = in_turns({name: layout for name, layout, _ in runs}, args.prompts, args.tokens, args.repeats)
    rows = []
    for name, layout, m in runs:
        rate, stats = measured[name]
        p = layout["pp"]
        rows.append((name, rate, [1 - s.busy_s / s.elapsed_s for s in stats], (p - 1) / (m + p - 1)))
    base = {name: rate for name, rate, _, _ in rows}
    print(f"\n{'layout':<24} {'tok/s':>7} {'vs pp=1':>8} {'vs 1 mb':>8}  idle per stage (measured | formula)")
    for name, rate, idle, formula in rows:
        stages = " ".join(f"{f:.0%}" for f in idle)
        print(
            f"{name:<24} {rate:>7.1f} {rate / base['pp=1']:>7.2f}x {rate / base['pp=2, 1 micro-batch']:>7.2f}x"
            f"  {stages} | {formula:.0%}"
        )
    print(f"\n{load_note()} after the run")


if __name__ == "__main__":
    main()
