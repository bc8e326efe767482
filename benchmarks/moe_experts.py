"""A rank's routed experts in training: one forward and backward of the experts block at 1, 8 and 32
experts a rank, the same pairs and FLOPs each, against one expert (the ideal: the same GEMM work
with nothing per expert but its weights).

The block is ``ExpertParallelSwiGLU`` from a trainer's model (``measure.experts_block``: a random
Qwen3-MoE, one rank, float32):
2,048 tokens, each sent to 2 experts given round-robin (4,096 pairs), hidden 1024, expert width 256:
every row computes the same FLOPs, and only the weights (and their gradients) grow with the experts,
3 MiB an expert. Timed in turns,
median of --repeats. A ratio near 1 means the block's cost does not grow with the experts a rank
holds; before its experts loop split the sorted pairs and unbound the weights, each expert's
backward wrote a whole zero gradient of the pairs and of the stacked weights (docs/performance.md).

    python benchmarks/moe_experts.py [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shardlm.parallel.expert import ExpertParallelSwiGLU
from shardlm.train.measure import experts_block, round_robin

TOKENS, K, HIDDEN, WIDTH = 2048, 2, 1024, 256


def step_s(b: ExpertParallelSwiGLU, experts: int) -> float:
    ids = round_robin(TOKENS, K, experts)
    weights = torch.full((TOKENS, K), 1 / K)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    b.zero_grad(set_to_none=True)
    start = time.perf_counter()
    b(x, ids, weights).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = (1, 8, 32)
    with tempfile.TemporaryDirectory() as tmp:
        blocks = {e: experts_block(str(Path(tmp) / str(e)), "float32", e, HIDDEN, WIDTH) for e in counts}
        times: dict[int, list[float]] = {e: [] for e in counts}
        for e in counts:  # warm-up
            step_s(blocks[e], e)
        for _ in range(args.repeats):
            for e in counts:
                times[e].append(step_s(blocks[e], e))
    base = statistics.median(times[1])
    print(f"experts block, forward + backward, {TOKENS * K} pairs, hidden {HIDDEN}, float32, {args.threads} threads")
    print("| experts a rank | ms | vs one expert |")
    print("|---|---|---|")
    for e in counts:
        t = statistics.median(times[e])
        print(f"| {e} | {t * 1e3:.1f} | {t / base:.2f}x |")


if __name__ == "__main__":
    main()
