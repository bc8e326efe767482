"""Steps that a request joins, with compile=True: their prompt tokens computed as decode rows
inside the compiled forward (the default) vs the whole step eager (``runner.prompt_rows`` off),
on the same engine, in turns.

96 SmolLM2 chat prompts with 16-63 output tokens each through one LLM with max_num_seqs=32, so
requests finish at different steps and waiting ones join the running batch (every join a step
with prompt tokens). Prints output tok/s of each round and the best of --repeats.

    python benchmarks/prompt_rows.py [--dtype bfloat16] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

from common import chat_prompts, load_note

from shardlm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    llm = LLM("smollm2", dtype=args.dtype, compile=True, threads=args.threads, max_num_seqs=32)
    prompts = chat_prompts(llm, 64) + chat_prompts(llm, 32)
    params = [
        SamplingParams(temperature=0.0, max_tokens=16 + (i * 7) % 48, ignore_eos=True) for i in range(len(prompts))
    ]
    llm.generate(prompts[:8], params[:8])  # warm-up: compiles both shape classes
    runner = llm.worker.runner
    best = {True: 0.0, False: 0.0}
    for _ in range(args.repeats):
        for rows in (True, False):
            runner.prompt_rows = rows
            start = time.perf_counter()
            out = llm.generate(prompts, params)
            rate = sum(len(o.token_ids) for o in out) / (time.perf_counter() - start)
            best[rows] = max(best[rows], rate)
            print(f"{'prompt rows compiled' if rows else 'joining steps eager':<22} {rate:7.1f} tok/s", flush=True)
    print(
        f"best of {args.repeats}: compiled rows {best[True]:.1f} tok/s, eager {best[False]:.1f}: "
        f"{best[True] / best[False]:.2f}x; {load_note()}"
    )
    llm.close()


if __name__ == "__main__":
    main()
