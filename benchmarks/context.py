"""Context-parallel attention: ring against all-gather, per rank, with one process as the peer.

SmolLM2's attention shape (9 query heads, 3 KV heads, head dim 64), float32, one sequence of
--seq-len tokens split zig-zag over cp ranks (1 thread each). For each algorithm, a rank's
forward + backward time (median of --repeats) and the bytes it saves for backward (unique
storages seen by autograd's saved-tensor hooks), next to the formula: all-gather keeps the
whole sequence's keys and values (2 x seq x kv_heads x d x 4 bytes) besides its local
queries and output, and SDPA keeps the causal mask it was given, widened to float32 on CPU
(local tokens x seq x 4 bytes: quadratic in the sequence); ring keeps only the local tensors
and its log-sum-exp. The peer is one process attending the whole sequence (SDPA, 1 thread);
cp ranks each doing 1/cp of its work would be cp x as fast.

    python benchmarks/context.py [--seq-len 4096] [--cp 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import load_note, spawn_ranks

Q_HEADS, KV_HEADS, D = 9, 3, 64


def saved_bytes(fn) -> tuple[object, int]:
    """(fn(), bytes of the distinct storages autograd saved for backward while it ran)."""
    from shardlm.train.measure import saved_for_backward

    with saved_for_backward() as saved:
        out = fn()
    return out, sum(saved.values())


def attend(algorithm: str, q, k, v, seq: int):
    from shardlm.models.attention import GroupedHeads
    from shardlm.parallel.context import ContextBatch, context_attention

    meta = ContextBatch.build(dist.group.WORLD, 1, seq, algorithm)
    return context_attention(q, k, v, meta, GroupedHeads([h // 3 for h in range(Q_HEADS)]), D**-0.5, None)


def rank_main(rank: int, cp: int, port: int, seq: int, repeats: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    n = seq // cp
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(n, Q_HEADS, D, generator=g, requires_grad=True)
    k, v = (torch.randn(n, KV_HEADS, D, generator=g, requires_grad=True) for _ in range(2))
    out = {}
    for algorithm in ("all-gather", "ring"):
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            dist.barrier()
            start = time.perf_counter()
            o, held = saved_bytes(lambda: attend(algorithm, q, k, v, seq))
            o.backward(torch.ones_like(o))
            times.append(time.perf_counter() - start)
        out[algorithm] = (statistics.median(times[1:]), held)
    results.put((rank, out))
    dist.destroy_process_group()


def one_process(seq: int, repeats: int) -> float:
    torch.set_num_threads(1)
    q = torch.randn(1, Q_HEADS, seq, D, requires_grad=True)
    k, v = (torch.randn(1, KV_HEADS, seq, D, requires_grad=True) for _ in range(2))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    seq, cp = args.seq_len, args.cp
    print(
        f"context-parallel attention, SmolLM2 shape ({Q_HEADS} q / {KV_HEADS} kv heads, d {D}), float32, "
        f"1 x {seq} tokens over cp={cp} ranks x 1 thread; {load_note()}",
        flush=True,
    )
    ranks = spawn_ranks(cp, rank_main, seq, args.repeats)
    alone = one_process(seq, args.repeats)
    n, kv_bytes = seq // cp, 2 * KV_HEADS * D * 4
    local = n * (2 * Q_HEADS * D * 4 + kv_bytes)  # this rank's queries, output, keys and values
    formula = {
        "all-gather": local + (seq - n) * kv_bytes + n * seq * 4,  # + the other keys/values, the mask
        "ring": local + n * Q_HEADS * 4,
    }  # + the log-sum-exp
    print(
        "\n| algorithm | fwd+bwd s (slowest rank) | vs one process | saved for backward MiB (max rank) "
        "| formula MiB | measured / formula |"
    )
    print("|---|---|---|---|---|---|")
    for name in ("all-gather", "ring"):
        t = max(r[name][0] for r in ranks)
        held = max(r[name][1] for r in ranks)
        print(
            f"| {name} | {t:.3f} | {alone / t:.2f}x | {held / 2**20:.2f} | {formula[name] / 2**20:.2f} "
            f"| {held / formula[name]:.2f} |"
        )
    print(f"| one process (SDPA) | {alone:.3f} | 1.00x | | | |")
    ring, gather = (max(r[a][0] for r in ranks) for a in ("ring", "all-gather"))
    saved = max(r["ring"][1] for r in ranks) / max(r["all-gather"][1] for r in ranks)
    print(f"\nring / all-gather: time {ring / gather:.2f}x, bytes saved for backward {saved:.2f}x ({load_note()})")


if __name__ == "__main__":
    main()
