"""Data parallel throughput on SmolLM2: dp=2 replicas vs one, on the same batch of requests.

dp=1 is one process with all cores; dp=2 is two replicas with half the cores each,
each serving the requests routed to it (least outstanding work). Both are loaded together
and timed in turns (--repeats rounds, median).

    python benchmarks/data_parallel.py [--prompts 16] [--tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse

from common import in_turns, load_note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the layouts in turns (median reported)")
    args = ap.parse_args()
    print(f"SmolLM2-135M float32, {args.prompts} prompts x {args.tokens} tokens; {load_note()}", flush=True)
    measured = in_turns({"dp=1": dict(dp=1), "dp=2": dict(dp=2)}, args.prompts, args.tokens, args.repeats)
    rates = {dp: measured[f"dp={dp}"][0] for dp in (1, 2)}
    print(f"\ndp=1 {rates[1]:.1f} tok/s, dp=2 {rates[2]:.1f} tok/s (medians)")
    print(f"\ndp=2 / dp=1 throughput: {rates[2] / rates[1]:.2f}x   ({load_note()})")


if __name__ == "__main__":
    main()
