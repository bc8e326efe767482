"""Batch-1 decode speed of SmolLM2: shardlm vs HF transformers, measured in the same run.

For each dtype it prints tokens/s of HF ``generate`` on the same weights (HF loads the
same GGUF), of shardlm (tp=1) eager (``enforce_eager``), on a GPU with CUDA graphs (its
default), and with ``compile=True`` (decode steps through torch.compile; on a GPU inside the
graphs), their ratios to HF, and the floor: the time of the model's own
matrix-vector products alone, run back to back on its real shapes (every weight byte
read once per token at the bandwidth these kernels reach). The engines are timed the
same way, as wall time of (1 + N) generated tokens minus that of 1 token, so prefill
and the first token do not count; they are loaded together and timed in turns, best
of --repeats turns, so drifts in this machine's speed hit them alike. The compiled
engine compiles on its warm-up (tens of seconds the first time, then from the disk cache).

A second table puts tensor parallelism on this host against one process: shardlm tp=2
(two rank processes, one thread each, collectives on the shared-memory path) against
tp=1 with two threads, in the same run; and, unless --no-gloo, tp=2 with the shared-memory
path off (``SHARDLM_SHM=0``: gloo), to show what the fast path buys. The three engines are
loaded together and measured in turns (best of --repeats), so other load hits them alike.

    python benchmarks/decode.py [--tokens 64] [--dtypes float32,bfloat16] [--repeats 3]
                                [--no-tp2] [--no-gloo] [--tp-only] [--no-compile] [--tp-compile]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from shardlm import LLM, SamplingParams
from shardlm.parallel.tensor import linear

PROMPT = "Explain tensor parallelism in one paragraph."


def decode_rate(run, tokens: int) -> float:
    """tokens/s of decode alone: (t(1 + tokens) - t(1)) over `tokens`."""
    t0 = time.perf_counter()
    run(1)
    t1 = time.perf_counter()
    run(1 + tokens)
    t2 = time.perf_counter()
    return tokens / ((t2 - t1) - (t1 - t0))


def best_in_turns(runs: dict, tokens: dict | int, repeats: int) -> dict[str, float]:
    """Best decode tok/s of each engine ({name: run(n)}), timed in turns after one warm-up each."""
    for run in runs.values():
        run(4)  # warm-up (and, for a compiled engine, its compile)
    best = dict.fromkeys(runs, 0.0)
    for _ in range(repeats):
        for name, run in runs.items():
            n = tokens if isinstance(tokens, int) else tokens[name]
            best[name] = max(best[name], decode_rate(run, n))
    return best


def floor_rate(model, repeats: int) -> tuple[float, float]:
    """(tokens/s if a token cost only its matvecs, GB/s those matvecs reach)."""
    weights = [m.weight for m in model.modules() if hasattr(m, "weight") and m.weight.dim() == 2]
    weights = list({id(w): w for w in weights}.values())  # a tied head is read for the LM head only once
    xs = [torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    best = float("inf")
    for _ in range(repeats + 1):
        synchronize()
        t0 = time.perf_counter()
        for x, w in zip(xs, weights):
            linear(x, w)
        synchronize()
        best = min(best, time.perf_counter() - t0)
    return 1.0 / best, nbytes / best / 1e9


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def runner(llm: LLM, ids: list[int]):
    def run(n: int) -> None:
        llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))

    return run


def tp2_rates(dtype: str, ids: list[int], args) -> tuple[float, float, float | None]:
    """(tok/s at tp=1 with two threads, at tp=2 on the shared-memory path, at tp=2 over gloo or None).

    All three engines are loaded at once and measured in turns, best of --repeats turns, so
    a burst of load from other processes hits each of them alike."""
    engines = {"tp1": LLM("smollm2", dtype=dtype, threads=2, compile=args.tp_compile)}
    for name, shm in (("shm", "1"), ("gloo", "0")):
        if name == "gloo" and args.no_gloo:
            continue
        os.environ["SHARDLM_SHM"] = shm  # read by the rank processes when their groups are first used
        try:
            engines[name] = LLM("smollm2", dtype=dtype, tp=2, compile=args.tp_compile)
        finally:
            os.environ.pop("SHARDLM_SHM")
    try:
        tokens = {name: args.tokens if name != "gloo" else max(8, args.tokens // 4) for name in engines}
        best = best_in_turns({name: runner(llm, ids) for name, llm in engines.items()}, tokens, args.repeats)
    finally:
        for llm in engines.values():
            llm.close()
    return best["tp1"], best["shm"], best.get("gloo")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-tp2", action="store_true", help="skip the tp=2 rows")
    ap.add_argument("--no-gloo", action="store_true", help="skip the tp=2 row over gloo")
    ap.add_argument("--tp-only", action="store_true", help="only the tp=2 vs tp=1 table (no HF)")
    ap.add_argument("--no-compile", action="store_true", help="skip shardlm with compile=True")
    ap.add_argument("--tp-compile", action="store_true", help="the tp=2 vs tp=1 engines with compile=True")
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where shardlm and HF run (cuda: no tp=2 table, which is about CPU ranks on one host)",
    )
    args = ap.parse_args()
    if args.device == "cuda":
        args.no_tp2 = True
        if args.tp_only:
            ap.error("--tp-only compares CPU ranks on this host; drop --device cuda")

    from transformers import AutoModelForCausalLM

    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(
        f"torch {torch.__version__}, {where}; SmolLM2-135M, batch 1, "
        f"{args.tokens} decode tokens, best of {args.repeats} turns",
        flush=True,
    )
    rows, tp_rows = [], []
    load = os.getloadavg()[0]
    for dtype in args.dtypes.split(","):
        llm = LLM("smollm2", dtype=dtype, device=args.device)
        ids = llm.encode_chat([{"role": "user", "content": PROMPT}])
        if args.tp_only:
            tp_rows.append((dtype, *tp2_rates(dtype, ids, args)))
            continue
        floor, gbs = floor_rate(llm.worker.model, args.repeats)
        path = llm.checkpoint.path
        hf = (
            AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype))
            .eval()
            .to(args.device)
        )
        x = torch.tensor([ids], device=args.device)

        def theirs(n: int, hf=hf, x=x) -> None:
            with torch.inference_mode():
                hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, min_new_tokens=n)

        engines = (
            {"eager": llm}
            if args.device == "cpu"
            else {"eager": LLM("smollm2", dtype=dtype, device="cuda", enforce_eager=True), "graphs": llm}
        )
        if not args.no_compile:
            engines["compiled"] = LLM("smollm2", dtype=dtype, compile=True, device=args.device)
        best = best_in_turns(
            {"hf": theirs} | {name: runner(e, ids) for name, e in engines.items()}, args.tokens, args.repeats
        )
        rows.append((dtype, best["hf"], best["eager"], best.get("graphs"), best.get("compiled"), floor, gbs))
        del hf, llm, engines
        if not args.no_tp2:
            tp_rows.append((dtype, *tp2_rates(dtype, ids, args)))

    if rows:
        print(
            f"\n{'dtype':<9} {'HF tok/s':>9} {'eager':>7} {'ratio':>6} {'graphs':>7} {'ratio':>6} "
            f"{'compiled':>9} {'ratio':>6} {'floor':>7} {'GB/s':>6} {'best/floor':>11} {'HF/floor':>9}"
        )
        for dtype, ref, eager, graphs, comp, floor, gbs in rows:
            g = f"{graphs:>7.1f} {graphs / ref:>5.2f}x" if graphs else f"{'-':>7} {'-':>6}"
            c = f"{comp:>9.1f} {comp / ref:>5.2f}x" if comp else f"{'-':>9} {'-':>6}"
            top = max(eager, graphs or 0.0, comp or 0.0)
            print(
                f"{dtype:<9} {ref:>9.1f} {eager:>7.1f} {eager / ref:>5.2f}x {g} {c} {floor:>7.1f} {gbs:>6.1f} "
                f"{top / floor:>10.0%} {ref / floor:>9.0%}"
            )
        print(
            "\nratios are to HF; floor: tokens/s if a token cost only its matrix-vector products "
            "(every weight byte once)"
        )
    if tp_rows:
        print(f"\n{'dtype':<9} {'tp=1 x2 thr':>11} {'tp=2 shm':>9} {'ratio':>6} {'tp=2 gloo':>10} {'ratio':>6}")
        for dtype, one, two, gloo in tp_rows:
            g = f"{gloo:>10.1f} {gloo / one:>5.2f}x" if gloo else f"{'-':>10} {'-':>6}"
            print(f"{dtype:<9} {one:>11.1f} {two:>9.1f} {two / one:>5.2f}x {g}")
        print(
            f"tok/s of batch-1 decode{' compiled' if args.tp_compile else ''}; tp=2: two rank processes of one "
            "thread each; "
            f"load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
        )


if __name__ == "__main__":
    main()
