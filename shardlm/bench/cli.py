"""``shardlm bench comm``: the collective benchmark from the command line.

``add_parser(subparsers)`` adds ``bench`` to shardlm's CLI; ``run(args)`` returns the exit
code (0 ok; 1 a result was wrong; 2 bad input, one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

from shardlm.args import byte_size


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_parser(subparsers) -> argparse.ArgumentParser:
    from shardlm.bench.comm import BACKENDS, OPS

    p = subparsers.add_parser(
        "bench",
        help="measure collectives (and more) on this host",
        description="Benchmarks that measure against a peer in the same run.",
    )
    sub = p.add_subparsers(dest="bench", required=True)
    c = sub.add_parser(
        "comm",
        help="latency and bus bandwidth of every collective, per backend",
        description="Per op and size: time, algorithm and bus bandwidth (nccl-tests definitions), "
        "each result checked; the first backend is compared with the others.",
    )
    c.add_argument("--ranks", type=int, default=2, help="ranks to start on this host (default 2)")
    c.add_argument("--ops", type=_names, default=list(OPS), help=f"comma list from {','.join(OPS)} (default: all)")
    c.add_argument("--min-bytes", type=byte_size, default=8, help="smallest message, e.g. 8 (default)")
    c.add_argument("--max-bytes", type=byte_size, default=64 << 20, help="largest message, e.g. 64M (default)")
    c.add_argument(
        "--backend",
        type=_names,
        default=["auto", "gloo"],
        help=f"comma list from {','.join(BACKENDS)}; the first is compared with the rest "
        f"(default auto,gloo; auto = shm where the ranks share this host)",
    )
    c.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    c.add_argument("--budget", type=float, default=0.05, help="seconds of timed calls per point (default 0.05)")
    c.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    c.add_argument("--plot", metavar="DIR", default=None, help="write latency.png and busbw.png into DIR")
    c.add_argument("--json", action="store_true", help="print the report as one JSON object")
    c.set_defaults(func=run)
    o = sub.add_parser(
        "overlap",
        help="can tp decode hide its all-reduces? (two-batch overlap, 2 ranks)",
        description="A SmolLM2-shaped tp=2 decode step: compute only, all-reduce waited at once, "
        "and two-batch overlap, per path (shm, gloo) and batch.",
    )
    o.add_argument(
        "--batches",
        type=lambda t: [int(b) for b in _names(t)],
        default=[1, 8, 64],
        help="comma list of batch sizes (default 1,8,64)",
    )
    o.add_argument("--repeats", type=int, default=5, help="best of this many (default 5)")
    o.set_defaults(func=run_overlap)
    q = sub.add_parser(
        "payload",
        help="error of bf16 / int8 all-reduce payloads on SmolLM2",
        description="SmolLM2 float32 with its row-parallel sums emulated at --tp and sent as "
        "float32, bf16 or int8: per-call error, logit error, greedy tokens kept.",
    )
    q.add_argument("--tp", type=int, default=2, help="ranks whose partial sums are emulated (default 2)")
    q.add_argument("--tokens", type=int, default=32, help="greedy tokens compared (default 32)")
    q.set_defaults(func=run_payload)
    return p


def run_overlap(args: argparse.Namespace) -> int:
    import os

    from shardlm.bench.comm import on_local_ranks
    from shardlm.bench.overlap import overlap_table

    before = os.getloadavg()[0]
    rows = on_local_ranks(2, "overlap", dict(batches=args.batches, repeats=args.repeats))
    print(overlap_table(rows))
    print(
        f"ms per decode step, best of {args.repeats}; load average {before:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    return 0


def run_payload(args: argparse.Namespace) -> int:
    from shardlm.bench.payload import payload_errors, payload_table

    print(payload_table(payload_errors(tp=args.tp, tokens=args.tokens)))
    return 0


def run(args: argparse.Namespace) -> int:
    from shardlm.bench.comm import bench_comm

    report = bench_comm(
        ranks=args.ranks,
        ops=args.ops,
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes,
        backends=args.backend,
        dtype=args.dtype,
        budget_s=args.budget,
        threads=args.threads,
    )
    if args.json:
        print(json.dumps(dict(vars(report).items())))
    else:
        print(report.table())
    if args.plot:
        for path in report.plot(args.plot):
            print(f"wrote {path}", file=sys.stderr)
    if not report.ok:
        bad = [f"{r['op']} {r['bytes']} B ({r['backend']})" for r in report.rows if not r["ok"]]
        print(f"shardlm: error: wrong results: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="shardlm")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    from shardlm.errors import UsageError

    try:
        sys.exit(ns.func(ns))
    except UsageError as e:
        print(f"shardlm: error: {e}", file=sys.stderr)
        sys.exit(2)
