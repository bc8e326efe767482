"""Speculative decoding against plain decoding, SmolLM2, one sequence at a time.

Drafts from the sequence's history (n-gram lookup), from SmolLM2's own first --layers layers
(``layer_skip``), and from a draft model: SmolLM2 itself (the only model of its vocabulary
here, so the row bounds what a draft model can give: every draft right, each costing a
forward of the whole model). Two kinds of prompt: ones whose answer copies from the prompt
(repeat or edit code, quote a passage), where drafts from the history are often right, and
open questions, where they rarely are. For each, greedy decoding of --max-tokens tokens with
and without each ``speculative_config``, every engine loaded at once and timed in turns
(median of --repeats): decode tokens/s (after each first token, so prefill is left out), the
ratio to plain, and the share of drafts accepted. The tokens of every run are compared with
plain decoding's (they must be equal).

    python benchmarks/speculative.py [--k 4] [--draft-k 3] [--layers 24] [--max-tokens 96]
        [--repeats 3] [--prompts 3] [--methods ngram,layer_skip,draft_model] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
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


def configs(args) -> dict[str, dict]:
    """The speculative_config of each method asked for."""
    every = {
        "ngram": {"num_speculative_tokens": args.k},
        "layer_skip": {"method": "layer_skip", "num_layers": args.layers, "num_speculative_tokens": args.draft_k},
        "draft_model": {"model": "smollm2", "num_speculative_tokens": args.draft_k},
    }
    return {name: every[name] for name in args.methods.split(",")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens of ngram")
    ap.add_argument("--draft-k", type=int, default=3, help="num_speculative_tokens of layer_skip and draft_model")
    ap.add_argument("--layers", type=int, default=24, help="layer_skip's num_layers (SmolLM2 has 30)")
    ap.add_argument("--methods", default="ngram,layer_skip,draft_model")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3, help="prompts of each kind")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    print(
        f"SmolLM2 {args.dtype}, one sequence at a time, {args.max_tokens} new tokens, greedy; {load_note()}", flush=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    specs = configs(args)
    llms = {"plain": LLM("smollm2", dtype=args.dtype)}
    llms.update({name: LLM("smollm2", dtype=args.dtype, speculative_config=c) for name, c in specs.items()})
    rows = []
    try:
        for kind, texts in PROMPTS.items():
            ids = [llms["plain"].encode_chat([{"role": "user", "content": t}]) for t in texts[: args.prompts]]
            times: dict[str, list[float]] = {name: [] for name in llms}
            tokens, drafted, accepted = {}, dict.fromkeys(llms, 0), dict.fromkeys(llms, 0)
            for r in range(args.repeats + 1):  # the first round warms up and is not timed
                for name, llm in llms.items():
                    out, seconds, decoded = [], 0.0, 0
                    for p in ids:  # one at a time: batch-1 decoding, where drafts pay off most
                        out.append(llm.generate([p], params)[0].token_ids)
                        stats = llm.last_stats  # decoding only: from the first token on
                        seconds, decoded = seconds + stats.decode_s, decoded + stats.decode_tokens
                        if r == 0:
                            drafted[name] += stats.draft_tokens
                            accepted[name] += stats.accepted_tokens
                    if r:
                        times[name].append(decoded / seconds)
                    tokens[name] = out
            rate = {name: statistics.median(t) for name, t in times.items()}
            for name in specs:
                same = tokens["plain"] == tokens[name]
                rows.append((kind, name, rate["plain"], rate[name], accepted[name] / max(drafted[name], 1), same))
            print(
                f"  {kind}: " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in rate.items()) + f" ({load_note()})",
                flush=True,
            )
    finally:
        for llm in llms.values():
            llm.close()
    print("\n| prompts | drafts | plain decode tok/s | with drafts tok/s | speed-up | drafts accepted | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for kind, name, plain, spec, acc, same in rows:
        what = f"{name} ({json.dumps(specs[name])})"
        print(f"| {kind} | {what} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x | {acc:.0%} | {same} |")


if __name__ == "__main__":
    main()
