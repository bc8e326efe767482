"""Data parallel throughput on SmolLM2: dp=2 replicas vs one, on the same batch of requests.

dp=1 is one process with all cores; dp=2 is two replicas with half the cores each,
each serving the requests routed to it (least outstanding work).

    python benchmarks/data_parallel.py [--prompts 16] [--tokens 48]
"""

from __future__ import annotations

import argparse

from common import chat_prompts, load_note, timed

from shardlm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    print(f"SmolLM2-135M float32, {args.prompts} prompts x {args.tokens} tokens; {load_note()}", flush=True)
    rates = {}
    for dp in (1, 2):
        with LLM("smollm2", dp=dp) as llm:
            wall, tokens = timed(llm, chat_prompts(llm, args.prompts), args.tokens)
        rates[dp] = tokens / wall
        print(f"  dp={dp}: {rates[dp]:.1f} tok/s ({tokens} tokens in {wall:.1f} s)", flush=True)
    print(f"\ndp=2 / dp=1 throughput: {rates[2] / rates[1]:.2f}x   ({load_note()})")


if __name__ == "__main__":
    main()
