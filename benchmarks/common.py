"""Shared by the benchmarks: a batch of SmolLM2 chat prompts and a timed generate."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable

from shardlm import LLM, SamplingParams

QUESTIONS = [
    "Explain tensor parallelism in one paragraph.",
    "What is the capital of France?",
    "Write a haiku about GPUs.",
    "Why is the sky blue?",
    "List three uses of a hash map.",
    "What does a compiler do?",
    "Summarise the plot of Hamlet.",
    "How do vaccines work?",
    "What is gradient descent?",
    "Give two tips for writing clean code.",
    "What is a prime number?",
    "Describe the water cycle.",
    "What is the difference between TCP and UDP?",
    "Who was Ada Lovelace?",
    "What is photosynthesis?",
    "How does a transistor work?",
]


def chat_prompts(llm: LLM, n: int) -> list[list[int]]:
    return [llm.encode_chat([{"role": "user", "content": q}]) for q in (QUESTIONS * 4)[:n]]


def timed(llm: LLM, prompts, max_tokens: int) -> tuple[float, int]:
    """(wall seconds, generated tokens) of one generate; every prompt runs to max_tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    out = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in out)


def load_note() -> str:
    return f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


def in_turns(layouts: dict[str, dict], prompts: int, tokens: int, repeats: int) -> dict[str, tuple[float, list]]:
    """Throughput of each layout (LLM options), all loaded at once and timed in turns, ``repeats``
    rounds, so each sees the same machine load: {name: (median tok/s, per-rank RunStats of the
    median run)}. Idle ranks of the layouts not being timed wait on a socket and use no CPU."""
    runs: dict[str, list] = {name: [] for name in layouts}
    with contextlib.ExitStack() as stack:
        llms = {name: stack.enter_context(LLM("smollm2", **options)) for name, options in layouts.items()}
        for r in range(repeats):
            for name, llm in llms.items():
                wall, n = timed(llm, chat_prompts(llm, prompts), tokens)
                runs[name].append((n / wall, llm.last_rank_stats))
                print(f"  round {r + 1}/{repeats}  {name}: {n / wall:.1f} tok/s  ({load_note()})", flush=True)
    out = {}
    for name, results in runs.items():
        median = statistics.median_low([rate for rate, _ in results])
        out[name] = next((rate, stats) for rate, stats in results if rate == median)
    return out


def spawn_ranks(world: int, target: Callable, *args) -> list:
    """Start ``world`` processes running ``target(rank, world, port, *args, results)``, each of which
    puts ``(rank, result)`` on ``results`` (and sets up its own gloo group on 127.0.0.1:port);
    returns the results in rank order."""
    import sys
    from pathlib import Path

    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test harness's free_port
    from harness.multirank import free_port

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = [o for _, o in sorted(results.get(timeout=3600) for _ in procs)]
    for p in procs:
        p.join()
    return out
