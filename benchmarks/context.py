"""Context-parallel attention: ring and Ulysses against all-gather, per rank, with one process as the peer.

SmolLM2's attention shape (9 query heads, 3 KV heads, head dim 64), float32, one sequence of
--seq-len tokens split zig-zag over cp ranks (1 thread each). For each algorithm, a rank's
forward + backward time (median of --repeats) and the bytes it saves for backward (unique
storages seen by autograd's saved-tensor hooks), next to the formula: all-gather keeps the
whole sequence's keys and values (2 x seq x kv_heads x d x 4 bytes) besides its local
queries and output, and SDPA keeps the causal mask it was given, widened to float32 on CPU
(local tokens x seq x 4 bytes: quadratic in the sequence); ring keeps only the local tensors
and its log-sum-exp; Ulysses keeps its 1/cp of the heads' q, k, v and output over the whole
sequence and their log-sum-exp (put in position order, SDPA runs causal with no mask), and nothing
local. Bytes a rank sends in forward, by formula:
all-gather and ring (cp - 1) x its keys and values, Ulysses (cp - 1) / cp of its q, k, v and
output (SmolLM2's 3 KV heads split over cp = 1 or 3 only; at other cp it is reported refused).
The peer is one process attending the whole sequence (SDPA, 1 thread); cp ranks each doing 1/cp
of its work would be cp x as fast.

    python benchmarks/context.py [--seq-len 4096] [--cp 2] [--repeats 3]     # --cp 3 adds Ulysses
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
    for algorithm in algorithms(cp):
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


def algorithms(cp: int) -> list[str]:
    """The cp attention algorithms that run SmolLM2's heads at this cp."""
    from shardlm.parallel.context import ALGORITHMS, ulysses_copies
    from shardlm.parallel.dims import LayoutError

    try:
        ulysses_copies(KV_HEADS, Q_HEADS // KV_HEADS, cp)
    except LayoutError:
        return [a for a in ALGORITHMS if a != "ulysses"]
    return list(ALGORITHMS)


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
    qo_bytes = 2 * Q_HEADS * D * 4  # a token's query and output
    formula = {
        "all-gather": local + (seq - n) * kv_bytes + n * seq * 4,  # + the other keys/values, the mask
        "ring": local + n * Q_HEADS * 4,  # + the log-sum-exp
        # its heads' q, k, v, output and log-sum-exp over the whole sequence (causal: no mask); the
        # local tensors only feed the all-to-all, which keeps nothing
        "ulysses": seq * (qo_bytes + kv_bytes + Q_HEADS * 4) / cp,
    }
    sent = {
        "all-gather": (cp - 1) * n * kv_bytes,
        "ring": (cp - 1) * n * kv_bytes,
        "ulysses": (cp - 1) / cp * n * (qo_bytes + kv_bytes),
    }
    print(
        "\n| algorithm | fwd+bwd s (slowest rank) | vs one process | saved for backward MiB (max rank) "
        "| formula MiB | measured / formula | sent in forward MiB a rank |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in algorithms(cp):
        t = max(r[name][0] for r in ranks)
        held = max(r[name][1] for r in ranks)
        print(
            f"| {name} | {t:.3f} | {alone / t:.2f}x | {held / 2**20:.2f} | {formula[name] / 2**20:.2f} "
            f"| {held / formula[name]:.2f} | {sent[name] / 2**20:.2f} |"
        )
    if "ulysses" not in algorithms(cp):
        print(
            f"| ulysses | refused at cp={cp}: {KV_HEADS} KV heads of {Q_HEADS // KV_HEADS} do not split {cp} ways | | | | | |"
        )
    print(f"| one process (SDPA) | {alone:.3f} | 1.00x | | | | |")
    times = {a: max(r[a][0] for r in ranks) for a in algorithms(cp)}
    saved = {a: max(r[a][1] for r in ranks) for a in algorithms(cp)}
    for a in algorithms(cp):
        if a != "all-gather":
            print(
                f"{a} / all-gather: time {times[a] / times['all-gather']:.2f}x, bytes saved for backward "
                f"{saved[a] / saved['all-gather']:.2f}x ({load_note()})"
            )


if __name__ == "__main__":
    main()
