"""Prefill/decode disaggregation vs colocated replicas: `shardlm serve --dp 2` with and without
`--prefill-replicas 1`, under the same load in the same run.

Closed-loop load from the official `openai` client (serving.py's load generator): C clients,
each sending its next streamed request when the previous one ends. One long prompt (a
--long-tokens document, unique from its first token so the prefix cache cannot skip it)
comes before every --long-every - 1 short chat questions (6 of 22 prompts at the default
4); every answer is --tokens tokens. Colocated, a long prompt's prefill runs in the same
steps as the other requests' decodes on its replica and stalls them; disaggregated, the
decode replica never prefills, so the gaps between an answer's tokens (ITL) should not see
the long prompts, at the cost of half the decode capacity (TPOT) and every prefill on one
replica (TTFT). The two servers are loaded at
once and measured in turns, level by level; the idle one uses no CPU.

    python benchmarks/disaggregation.py [--levels 4,8] [--tokens 48] [--long-tokens 1024]
                                        [--long-every 4] [--requests-per-client 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import types

from common import QUESTIONS
from serving import row, shardlm_level, start_server


def prompts(tok, long_tokens: int, long_every: int) -> list[list[int]]:
    """The 16 short chat prompts, a long one before each run of ``long_every - 1`` of them."""
    chat = lambda text: tok.encode_chat([{"role": "user", "content": text}])
    body = " ".join(QUESTIONS * 40)
    out = []
    for i, q in enumerate(QUESTIONS):
        if i % (long_every - 1) == 0:
            doc = tok.encode(f"Document {i}: {body}")[:long_tokens]
            out.append(chat(tok.decode(doc) + "\n\nSummarise the document above."))
        out.append(chat(q))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="4,8", help="concurrent clients, comma-separated")
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--long-tokens", type=int, default=1024, help="tokens of a long prompt's document")
    ap.add_argument("--long-every", type=int, default=4, help="one long prompt per n - 1 short ones (n >= 2)")
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each rank (2 ranks per server)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    if args.long_every < 2:
        ap.error(f"--long-every {args.long_every} leaves no short prompt; use 2 or more")

    from shardlm.models.loader import open_checkpoint

    tok = open_checkpoint("smollm2").tokenizer()
    ps = prompts(tok, args.long_tokens, args.long_every)
    long_n = sum(len(p) > 200 for p in ps)
    print(
        f"SmolLM2-135M {args.dtype}, dp=2 x {args.threads} thread(s) per server; {len(ps)} prompts, {long_n} of "
        f"{max(map(len, ps))} tokens, the others {min(map(len, ps))}-{max(len(p) for p in ps if len(p) < 200)}; "
        f"{args.tokens} output tokens each; {os.cpu_count()} cores",
        flush=True,
    )
    base = dict(threads=args.threads, tp=1, dp=2, dtype=args.dtype, device="cpu", compile=False)
    servers = {
        name: start_server(types.SimpleNamespace(**base, prefill_replicas=p))
        for name, p in (("coloc", 0), ("disagg", 1))
    }
    rows = []
    try:
        for _, url in servers.values():  # warm-up
            asyncio.run(shardlm_level(url, ps, 2, 2, 4, False))
        for c in [int(x) for x in args.levels.split(",")]:
            for name, (_, url) in servers.items():
                n = c * args.requests_per_client
                rows.append(row(name, c, *asyncio.run(shardlm_level(url, ps, c, n, args.tokens, False))))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    print(
        f"\n{'C':>3} | {'tok/s coloc / disagg':>22} | {'TTFT p50 s':>19} | {'TTFT p99 s':>19} | "
        f"{'TPOT p50 ms':>17} | {'TPOT p99 ms':>17} | {'ITL p99 ms':>17}"
    )
    for c in sorted({r["clients"] for r in rows}):
        a, b = (next(r for r in rows if r["engine"] == e and r["clients"] == c) for e in ("coloc", "disagg"))
        cols = []
        for key, scale, fmt in (
            ("tok_s", 1, ".1f"),
            ("ttft50", 1, ".2f"),
            ("ttft99", 1, ".2f"),
            ("tpot50", 1e3, ".0f"),
            ("tpot99", 1e3, ".0f"),
            ("itl99", 1e3, ".0f"),
        ):
            x, y = a[key] * scale, b[key] * scale
            cols.append(f"{x:{fmt}} / {y:{fmt}} ({y / x:.2f}x)")
        print(f"{c:>3} | " + " | ".join(cols))
    print(
        "ratios: disaggregated / colocated. TPOT: an answer's time per token after its first; ITL: the gap "
        "between two of its chunks (a decode stalled by a prefill shows there)"
    )


if __name__ == "__main__":
    main()
