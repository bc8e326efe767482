"""Serving throughput and latency: `shardlm serve` under load vs HF transformers batched `generate`.

A real server process on 127.0.0.1 gets closed-loop load from the official `openai` client:
C clients (C = 1, 8, 32) each send a streamed request as soon as their previous one
finished, 2 x C requests in all per level (bounded in count and time). Every request is
one of 16 chat prompts (as token ids) and generates exactly --tokens tokens (ignore_eos), so
both engines do the same work. With --until-eos answers end at EOS instead (at most --tokens):
the usual serving case, where a static batch waits for its longest answer. Per level: output
tokens/s (all tokens / wall time), TTFT and TPOT (time per output token after the first)
p50 / p99, measured by the client.

HF runs the same prompts in the same run as static batches of C (left padding, attention
mask, greedy, min_new_tokens = max_new_tokens unless --until-eos); its TTFT is a batch's
generate with one new token, its TPOT the rest of the batch's time over tokens - 1.
shardlm's ranks use --threads threads each; HF as many threads in all (or each count of
--hf-threads; the ratio is taken against the fastest). Levels alternate shardlm / HF so both
see the same machine load, which is printed.

    python benchmarks/serving.py [--tokens 64] [--levels 1,8,32] [--threads 1] [--tp 1] [--dp 1]
                                 [--dtype bfloat16] [--compile] [--enforce-eager] [--hf-threads 1,2]
                                 [--until-eos] [--no-hf] [--plot serving.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import re
import subprocess
import sys
import threading
import time

import torch
from common import QUESTIONS

REQUEST_TIMEOUT_S = 600


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "shardlm.cli",
        "serve",
        "--port",
        "0",
        "--threads",
        str(args.threads),
        "--tp",
        str(args.tp),
        "--dp",
        str(args.dp),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--kv-cache-memory",
        "512MiB",
        "--max-model-len",
        "2048",
        "--prefill-replicas",
        str(getattr(args, "prefill_replicas", 0)),
    ]
    cmd += ["--compile"] if args.compile else []
    cmd += ["--enforce-eager"] if args.enforce_eager else []
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        for line in proc.stderr:
            if m := re.search(r"serving \S+ on (http://\S+/v1)", line):
                found.append(m.group(1))
                ready.set()
            elif "KV cache" in line or "error" in line:
                print("  server: " + line.rstrip(), flush=True)
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(300) or not found:
        proc.kill()
        raise SystemExit("shardlm serve did not start")
    return proc, found[0]


async def shardlm_level(url: str, prompts: list[list[int]], clients: int, requests: int, tokens: int, until_eos: bool):
    """(wall seconds, generated tokens, [ttft], [tpot], [itl]) of `requests` streamed requests, `clients` at
    a time; itl: every gap between two chunks of tokens of one answer (inter-token latency)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    todo = iter(range(requests))
    ttft, tpot, itl, counts = [], [], [], []

    async def one_client() -> None:
        for i in todo:
            start = time.perf_counter()
            first = last = None
            n = 0
            stream = await client.completions.create(
                model="smollm2",
                prompt=prompts[i % len(prompts)],
                max_tokens=tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": not until_eos, "return_token_ids": True},
            )
            async for chunk in stream:
                got = len((chunk.choices[0].model_extra or {}).get("token_ids") or [])
                if got:
                    now = time.perf_counter()
                    if last is not None:
                        itl.append(now - last)
                    last = now
                    first = first or last
                    n += got
            counts.append(n)
            ttft.append(first - start)
            if n > 1:
                tpot.append((last - first) / (n - 1))

    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*[one_client() for _ in range(clients)]), REQUEST_TIMEOUT_S)
    wall = time.perf_counter() - start
    await client.close()
    return wall, sum(counts), ttft, tpot, itl


def hf_level(
    model, prompts: list[list[int]], clients: int, requests: int, tokens: int, pad: int, eos: list[int] | None
):
    """The same requests as static batches of `clients` through HF generate (to EOS when `eos` is given:
    a batch runs until its longest answer ends; each answer counts its tokens up to its first EOS)."""
    ttft, tpot, total, wall = [], [], 0, 0.0
    for b in range(0, requests, clients):
        batch = [prompts[i % len(prompts)] for i in range(b, min(b + clients, requests))]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)

        def run(n: int) -> tuple[float, torch.Tensor]:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=n,
                    pad_token_id=pad,
                    **({"eos_token_id": eos} if eos else {"min_new_tokens": n}),
                )
            return time.perf_counter() - t0, out[:, width:]

        first, _ = run(1)
        full, out = run(tokens)
        wall += full
        lengths = [_until_eos(row.tolist(), eos) for row in out] if eos else [tokens] * len(batch)
        total += sum(lengths)
        ttft += [first] * len(batch)
        tpot += [(full - first) / max(1, out.shape[1] - 1)] * len(batch)
    return wall, total, ttft, tpot


def _until_eos(ids: list[int], eos: list[int]) -> int:
    return next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else float("nan")


def row(
    name: str,
    clients: int,
    wall: float,
    tokens: int,
    ttft: list[float],
    tpot: list[float],
    itl: list[float] | None = None,
) -> dict:
    r = {
        "engine": name,
        "clients": clients,
        "tok_s": tokens / wall,
        "tokens": tokens,
        "wall": wall,
        "ttft50": pct(ttft, 50),
        "ttft99": pct(ttft, 99),
        "tpot50": pct(tpot, 50),
        "tpot99": pct(tpot, 99),
        "itl99": pct(itl or [], 99),
    }
    print(
        f"  {name:<8} C={clients:<3} {r['tok_s']:7.1f} tok/s  ({tokens} tokens in {wall:5.1f} s)  "
        f"TTFT p50 {r['ttft50']:.2f} s p99 {r['ttft99']:.2f} s  TPOT p50 {r['tpot50'] * 1e3:.0f} ms "
        f"p99 {r['tpot99'] * 1e3:.0f} ms"
        + (f"  ITL p99 {r['itl99'] * 1e3:.0f} ms" if itl else "")
        + f"   load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    return r


def plot(rows: list[dict], path: str, title: str) -> None:
    """Output tok/s, TTFT p50 and TPOT p50 against concurrent clients, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (key, label, scale) in zip(
        axes, (("tok_s", "output tokens/s", 1), ("ttft50", "TTFT p50 (s)", 1), ("tpot50", "TPOT p50 (ms)", 1e3))
    ):
        for engine in dict.fromkeys(r["engine"] for r in rows):
            pts = [(r["clients"], r[key] * scale) for r in rows if r["engine"] == engine]
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=engine)
        ax.set_xscale("log", base=2)
        levels = sorted({r["clients"] for r in rows})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--levels", default="1,8,32", help="concurrent clients, comma-separated")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each of the server's ranks")
    ap.add_argument(
        "--hf-threads",
        default=None,
        help="HF torch threads, comma-separated (default: the server's total, tp x dp x threads); "
        "the ratio is taken against the fastest",
    )
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the server and HF run")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="shardlm serve --compile (its two decode graphs compile during the warm-up)",
    )
    ap.add_argument("--enforce-eager", action="store_true", help="shardlm serve --enforce-eager (no CUDA graphs)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF rows")
    ap.add_argument("--plot", default=None, metavar="PNG", help="also draw tok/s, TTFT and TPOT per level")
    ap.add_argument(
        "--until-eos",
        action="store_true",
        help="answers end at EOS (at most --tokens) instead of all being --tokens long",
    )
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    from shardlm.models.loader import open_checkpoint

    ckpt = open_checkpoint("smollm2")
    tok = ckpt.tokenizer()
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    load0 = os.getloadavg()
    total = args.threads * args.tp * args.dp
    hf_threads = [int(t) for t in (args.hf_threads or str(total)).split(",")]
    print(
        f"SmolLM2-135M {args.dtype} on {args.device}, {len(prompts)} chat prompts of {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, {'up to ' if args.until_eos else ''}{args.tokens} output tokens each; "
        f"shardlm tp={args.tp} dp={args.dp} x {args.threads} thread(s), HF {args.hf_threads or total} thread(s); "
        f"{os.cpu_count()} cores, load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}",
        flush=True,
    )
    torch.set_num_threads(hf_threads[0])
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        with contextlib.redirect_stderr(io.StringIO()):  # HF's GGUF conversion progress bar
            hf = (
                AutoModelForCausalLM.from_pretrained(
                    ckpt.path.parent, gguf_file=ckpt.path.name, dtype=getattr(torch, args.dtype)
                )
                .eval()
                .to(args.device)
            )
        pad = tok.special_tokens.get("pad_token") and tok.backend.token_to_id(tok.special_tokens["pad_token"])
        pad = pad if pad is not None else tok.eos_token_ids[0]
        eos = list(tok.eos_token_ids) if args.until_eos else None
        hf_level(hf, prompts, 2, 2, 2, pad, eos)  # warm-up
    proc, url = start_server(args)
    rows = []
    try:
        # warm-up: one sequence, then several (the two compiled shape classes); on a GPU every level
        # once, so that its batch sizes' CUDA graphs are captured before it is measured
        cpu = args.device == "cpu"
        for clients in (1, 2) if cpu else levels:
            asyncio.run(shardlm_level(url, prompts, clients, clients, 4 if cpu else args.tokens, False))
        for c in levels:
            n = c * args.requests_per_client
            rows.append(row("shardlm", c, *asyncio.run(shardlm_level(url, prompts, c, n, args.tokens, args.until_eos))))
            for t in hf_threads if hf is not None else ():
                torch.set_num_threads(t)
                rows.append(row(f"HF x{t}", c, *hf_level(hf, prompts, c, n, args.tokens, pad, eos)))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    load1 = os.getloadavg()
    print(
        f"\n{'C':>3} {'shardlm tok/s':>13} {'HF tok/s':>9} {'ratio':>6} | {'TTFT p50/p99 s':>15} "
        f"{'HF':>11} | {'TPOT p50/p99 ms':>15} {'HF':>11}"
    )
    for c in levels:
        s = next(r for r in rows if r["engine"] == "shardlm" and r["clients"] == c)
        h = max(
            (r for r in rows if r["engine"].startswith("HF") and r["clients"] == c),
            key=lambda r: r["tok_s"],
            default=None,
        )
        hf_cols = (
            (
                f"{h['tok_s']:>9.1f} {s['tok_s'] / h['tok_s']:>5.2f}x",
                f"{h['ttft50']:.2f}/{h['ttft99']:.2f}",
                f"{h['tpot50'] * 1e3:.0f}/{h['tpot99'] * 1e3:.0f}",
            )
            if h
            else (f"{'-':>9} {'-':>6}", "-", "-")
        )
        print(
            f"{c:>3} {s['tok_s']:>13.1f} {hf_cols[0]} | {s['ttft50']:>7.2f}/{s['ttft99']:<7.2f} {hf_cols[1]:>11} | "
            f"{s['tpot50'] * 1e3:>7.0f}/{s['tpot99'] * 1e3:<7.0f} {hf_cols[2]:>11}"
        )
    print(
        f"target: shardlm >= 3x HF output tok/s at 32 concurrent; load average {load0[0]:.2f} at the start, "
        f"{load1[0]:.2f} at the end ({os.cpu_count()} cores)"
    )
    if args.plot:
        plot(
            rows,
            args.plot,
            f"SmolLM2-135M {args.dtype}, {'up to ' if args.until_eos else ''}{args.tokens} tokens "
            f"per request; shardlm tp={args.tp} dp={args.dp}",
        )


if __name__ == "__main__":
    main()
