"""Speculative decoding (n-gram drafts) against plain decoding, SmolLM2, one sequence at a time.

Two kinds of prompt: ones whose answer copies from the prompt (repeat or edit code, quote a
passage), where drafts from the history are often right, and open questions, where they
rarely are. For each, greedy decoding of --max-tokens tokens with and without
``speculative_config={"method": "ngram", "num_speculative_tokens": K}``, both engines loaded at
once and timed in turns (median of --repeats): decode tokens/s (after each first token, so
prefill is left out), the ratio, and the share of drafts accepted (k drafts a step when the
history offers them: a step emits 1 + k x that share tokens on average). The tokens of both
runs are compared (they must be equal).

    python benchmarks/speculative.py [--k 4] [--max-tokens 96] [--repeats 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics

from common import load_note

from shardlm import LLM, SamplingParams

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef neg(a):\n    return -a\n"
PASSAGE = (
    "Tensor parallelism splits every weight matrix of a layer over the ranks of a group, so each rank "
    "stores and multiplies only its slice; two all-reduces per layer combine the partial results."
)
PROMPTS = {
    "copy": [
        "Repeat this code exactly, then add a mul function:\n" + CODE,
        "Quote this passage word for word, then say in one line what it means:\n" + PASSAGE,
        "Rename the function add to plus in this code and print the whole code:\n" + CODE,
    ],
    "open": ["Why is the sky blue?", "Write a haiku about GPUs.", "What does a compiler do?"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    print(
        f"SmolLM2 {args.dtype}, one sequence at a time, {args.max_tokens} new tokens, greedy; {load_note()}", flush=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llms = {
        "plain": LLM("smollm2", dtype=args.dtype),
        "ngram": LLM("smollm2", dtype=args.dtype, speculative_config={"num_speculative_tokens": args.k}),
    }
    rows = []
    try:
        for kind, texts in PROMPTS.items():
            ids = [llms["plain"].encode_chat([{"role": "user", "content": t}]) for t in texts]
            times = {name: [] for name in llms}
            tokens, drafted, accepted = {}, 0, 0
            for r in range(args.repeats + 1):  # the first round warms up and is not timed
                for name, llm in llms.items():
                    out, seconds, decoded = [], 0.0, 0
                    for p in ids:  # one at a time: batch-1 decoding, where drafts pay off most
                        out.append(llm.generate([p], params)[0].token_ids)
                        stats = llm.last_stats  # decoding only: from the first token on
                        seconds, decoded = seconds + stats.decode_s, decoded + stats.decode_tokens
                        if name == "ngram" and r == 0:
                            drafted += stats.draft_tokens
                            accepted += stats.accepted_tokens
                    if r:
                        times[name].append(decoded / seconds)
                    tokens[name] = out
            rate = {name: statistics.median(t) for name, t in times.items()}
            same = tokens["plain"] == tokens["ngram"]
            rows.append((kind, rate["plain"], rate["ngram"], accepted / max(drafted, 1), same))
            print(
                f"  {kind}: plain {rate['plain']:.1f} tok/s, ngram {rate['ngram']:.1f} tok/s ({load_note()})",
                flush=True,
            )
    finally:
        for llm in llms.values():
            llm.close()
    print("\n| prompts | plain decode tok/s | ngram decode tok/s | speed-up | drafts accepted | same tokens |")
    print("|---|---|---|---|---|---|")
    for kind, plain, ngram, acc, same in rows:
        print(f"| {kind} | {plain:.1f} | {ngram:.1f} | {ngram / plain:.2f}x | {acc:.0%} | {same} |")


if __name__ == "__main__":
    main()
