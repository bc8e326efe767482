"""Context-parallel inference: SmolLM2 with one long prompt, its KV cache striped over cp ranks.

1. KV bytes a rank holds for a --kv-tokens sequence at cp 1/2/4: the engine's blocks (a run of each
   group block on every rank, parallel/context_paged.py) next to the formula
   layers x 2 x kv_heads x head_dim x 4 bytes x tokens / cp.
2. One prompt of --tokens tokens, then --new greedy tokens, at cp=2 (1 thread a rank) against two
   peers, the same engine on one rank holding the whole cache: with 1 thread (what each cp rank
   has: one device each, as on GPUs) and with 2 threads (this host's 2 cores, which cp=2 splits):
   time to the first token (the prefill), decode tok/s, and the share of each phase spent in the
   cp collectives (the queries' all-gather, the partial outputs' all-to-all with their merge, the
   sampled rows' all-reduce), timed on rank 0. --repeats rounds, one layout at a time; medians.
   All give the same tokens.
3. With --prefill (or --ulysses): the prefill of the same prompt at cp=--cp (default 3), 1 thread a
   rank, by each --cp-attention: pass-Q, ring, and Ulysses where SmolLM2's 3 KV heads split over cp
   (cp 1 or 3; 3 ranks share this host's 2 cores), against one rank with 1 thread; in turns, medians,
   the same tokens from all.

    python benchmarks/context_inference.py [--tokens 4096] [--new 16] [--kv-tokens 8192] [--repeats 2]
        [--prefill [--cp 3]]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import load_note, spawn_ranks


def kv_table(tokens: int, block_size: int = 16) -> None:
    from shardlm.engine.model_runner import ModelRunner
    from shardlm.models.loader import load_model, open_checkpoint
    from shardlm.parallel.dims import ParallelDims

    ckpt = open_checkpoint("smollm2")
    cfg = ckpt.config
    one_layer = load_model(ckpt, ParallelDims().build_mesh("cpu"), dtype=torch.float32, layers=range(1))
    per_block = ModelRunner.kv_bytes_per_block(one_layer, block_size, torch.float32) * cfg.num_layers
    print(f"KV cache of one {tokens}-token sequence, float32, blocks of {block_size}:")
    for cp in (1, 2, 4):
        held = -(-tokens // (block_size * cp)) * per_block  # group blocks: one block on each cp rank
        formula = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * tokens / cp
        print(
            f"  cp={cp}: {held / 2**20:8.1f} MiB a rank  (formula {formula / 2**20:8.1f} MiB, ratio {held / formula:.4f})"
        )


def rank_run(
    rank: int, world: int, port: int, threads: int, attention: str, tokens: int, new: int, repeats: int, results
) -> None:
    from shardlm.engine.config import EngineConfig
    from shardlm.engine.engine import Request
    from shardlm.engine.sampling import SamplingParams
    from shardlm.engine.worker import Worker
    from shardlm.parallel.context_paged import ContextShards

    comm = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            comm[0] += time.perf_counter() - start
            return out

        return wrapper

    for name in ("gather_queries", "return_outputs", "gather_rows"):
        setattr(ContextShards, name, timed(getattr(ContextShards, name)))
    config = EngineConfig.of(
        model="smollm2",
        cp=world,
        threads=threads,
        cp_attention=attention,
        max_num_batched_tokens=tokens,
        timeout_s=1200,
    )
    worker = Worker(
        config, rank=rank, world=world, local_rank=rank, local_world=world, init_method=f"tcp://127.0.0.1:{port}"
    )
    prompt = torch.randint(100, 40000, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    worker.generate([Request(prompt[:64], SamplingParams(temperature=0.0, max_tokens=2), 0)])  # warm-up
    runs = []
    for _ in range(repeats):
        comm[0], first = 0.0, {}

        def on_token(rid, tok):
            first.setdefault("t", time.perf_counter())
            first.setdefault("comm", comm[0])

        start = time.perf_counter()
        done, _ = worker.generate([Request(prompt, params, 0)], on_token)
        end = time.perf_counter()
        runs.append(
            dict(
                ttft=first["t"] - start,
                decode_tok_s=(new - 1) / (end - first["t"]),
                comm_prefill=first["comm"] / (first["t"] - start),
                comm_decode=(comm[0] - first["comm"]) / (end - first["t"]),
                tokens=done[0].token_ids,
            )
        )
    results.put((rank, runs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--prefill", "--ulysses", action="store_true", help="compare the prefill attentions at --cp instead"
    )
    ap.add_argument("--cp", type=int, default=3, help="--prefill: cp ranks (default 3, where Ulysses runs)")
    args = ap.parse_args()
    kv_table(args.kv_tokens)
    print(f"\nSmolLM2, a {args.tokens}-token prompt + {args.new} new tokens, float32 ({load_note()}):")
    if args.prefill:
        prefill(args)
        return
    layouts = {
        "cp=1, 2 threads": (1, 2, "pass-q"),
        "cp=1, 1 thread": (1, 1, "pass-q"),
        "cp=2, 1 thread a rank": (2, 1, "pass-q"),
    }
    got: dict[str, list] = {name: [] for name in layouts}
    for _ in range(args.repeats):  # one layout at a time, in turns
        for name, (cp, threads, attention) in layouts.items():
            got[name] += spawn_ranks(cp, rank_run, threads, attention, args.tokens, args.new, 1)[0]
            r = got[name][-1]
            print(f"  {name}: first token {r['ttft']:.2f} s, decode {r['decode_tok_s']:.2f} tok/s  ({load_note()})")
    assert len({tuple(runs[0]["tokens"]) for runs in got.values()}) == 1, "every layout gives the same greedy tokens"
    med = {
        name: {
            k: statistics.median(r[k] for r in runs) for k in ("ttft", "decode_tok_s", "comm_prefill", "comm_decode")
        }
        for name, runs in got.items()
    }
    cp2 = med["cp=2, 1 thread a rank"]
    for peer in ("cp=1, 1 thread", "cp=1, 2 threads"):
        one = med[peer]
        print(
            f"cp=2 against {peer}: prefill {one['ttft'] / cp2['ttft']:.2f}x faster ({cp2['ttft']:.2f} s vs "
            f"{one['ttft']:.2f} s), decode {cp2['decode_tok_s'] / one['decode_tok_s']:.2f}x "
            f"({cp2['decode_tok_s']:.2f} vs {one['decode_tok_s']:.2f} tok/s)"
        )
    print(
        f"cp collectives on rank 0 at cp=2: {100 * cp2['comm_prefill']:.1f}% of the prefill, "
        f"{100 * cp2['comm_decode']:.1f}% of a decode step; the same tokens everywhere"
    )


def prefill(args) -> None:
    from shardlm.parallel.context import ulysses_copies
    from shardlm.parallel.dims import LayoutError

    cp = args.cp
    layouts = {"cp=1": (1, "pass-q"), "pass-q": (cp, "pass-q"), "ring": (cp, "ring"), "ulysses": (cp, "ulysses")}
    try:
        ulysses_copies(3, 3, cp)  # SmolLM2: 3 KV heads of 3 query heads
    except LayoutError:
        del layouts["ulysses"]
    got: dict[str, list] = {name: [] for name in layouts}
    print(f"\nprefill at cp={cp} ({cp} ranks x 1 thread on this host's cores) against cp=1, {args.tokens} tokens:")
    for _ in range(args.repeats):  # one layout at a time, in turns
        for name, (n, attention) in layouts.items():
            got[name] += spawn_ranks(n, rank_run, 1, attention, args.tokens, 2, 1)[0]
            print(f"  {name}: first token {got[name][-1]['ttft']:.2f} s  ({load_note()})")
    assert len({tuple(runs[0]["tokens"]) for runs in got.values()}) == 1, "every layout gives the same greedy tokens"
    ttft = {name: statistics.median(r["ttft"] for r in runs) for name, runs in got.items()}
    for name in layouts:
        if name != "cp=1":
            print(
                f"{name} at cp={cp}: {ttft[name]:.2f} s, {ttft['cp=1'] / ttft[name]:.2f}x cp=1's speed "
                f"({ttft['cp=1']:.2f} s), {ttft['pass-q'] / ttft[name]:.2f}x pass-Q's"
            )
    print("the same tokens from every layout")


if __name__ == "__main__":
    main()
