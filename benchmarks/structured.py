"""Structured outputs: decode speed with and without a JSON schema, SmolLM2, the same prompts.

A batch of --batch chat prompts asking for a person as JSON, greedy, decoded with and without
``structured_outputs=StructuredOutputsParams(json=SCHEMA)`` (one engine, timed in turns, median of
--repeats): decode tokens/s (after each first token, so prefill is left out) and their ratio.
Then the grammar's own cost: the JSON answers' tokens replayed through a fresh ``Guide`` (mask,
then advance, as the sampler does), microseconds per token, and its share of a decode step.

    python benchmarks/structured.py [--batch 8] [--max-tokens 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import load_note

from shardlm import LLM, SamplingParams, StructuredOutputsParams
from shardlm.engine.structured import Guide

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "skills"],
    "additionalProperties": False,
}
JOBS = ["teacher", "pilot", "chef", "farmer", "nurse", "painter", "miner", "judge", "baker", "sailor", "poet", "clerk"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"SmolLM2 float32, batch {args.batch}, up to {args.max_tokens} new tokens, greedy; {load_note()}", flush=True)
    convs = [[{"role": "user", "content": f"Describe a {JOBS[i % len(JOBS)]} as JSON."}] for i in range(args.batch)]
    runs = {
        "free": SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
        "schema": SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(json=SCHEMA)
        ),
    }
    with LLM("smollm2", max_model_len=1024) as llm:
        rates: dict[str, list[float]] = {name: [] for name in runs}
        answers = {}
        for r in range(args.repeats + 1):  # the first round warms up (and builds the grammar's vocabulary)
            for name, params in runs.items():
                outs = llm.chat(convs, params)
                stats = llm.last_stats
                if r:
                    rates[name].append(stats.decode_tokens / stats.decode_s)
                answers[name] = outs
        rate = {name: statistics.median(v) for name, v in rates.items()}
        tokens = [o.token_ids for o in answers["schema"]]
        guide_us = mask_cost(llm, tokens)
    step_us = 1e6 * args.batch / rate["schema"]  # one decode step of the batch
    print(f"decode tok/s: free {rate['free']:.1f}, json schema {rate['schema']:.1f}: "
          f"{rate['schema'] / rate['free']:.2f}x")  # fmt: skip
    print(f"grammar: {guide_us:.0f} us per token (mask + advance), {args.batch * guide_us / step_us:.1%} of a decode step "
          f"of {args.batch} sequences ({load_note()})")  # fmt: skip
    mean_len = statistics.mean(len(t) for t in tokens)
    print(f"answers: {mean_len:.0f} tokens on average, e.g. {answers['schema'][0].text!r}")


def mask_cost(llm: LLM, answers: list[list[int]]) -> float:
    """Microseconds per token to mask the logits and advance the grammar, over these answers."""
    vocab = llm.checkpoint.config.vocab_size
    spec = StructuredOutputsParams(json=SCHEMA)
    logits = torch.zeros(vocab)
    n, seconds = 0, 0.0
    for tokens in answers:
        guide = Guide(spec, llm.tokenizer, vocab, [])
        start = time.perf_counter()
        for t in tokens:
            guide.mask(logits)
            guide.advance(t)
        seconds += time.perf_counter() - start
        n += len(tokens)
    return 1e6 * seconds / max(n, 1)


if __name__ == "__main__":
    main()
