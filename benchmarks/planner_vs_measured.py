"""Planner vs measured: shardlm's own decode throughput on SmolLM2, on this machine.

What it measures: for every tp x pp layout of SmolLM2-135M that fits this machine (ranks <=
--max-ranks), it runs ``LLM("smollm2", tp=..., pp=..., dtype="float32").generate`` on a batch of
--batch prompts of --prompt-len tokens with greedy decoding of --output-len tokens, and takes
the engine's decode rate (decode tokens / decode seconds, from ``llm.last_stats``; prefill is
excluded; best of --repeats runs). What it predicts: ``shardlm plan --gpu this-machine`` for
the same layout and batch (roofline of each layer with the measured matmul rate, matrix-vector
bandwidth and per-op cost, plus gloo all-reduce alpha-beta; ranks split the cores). It prints
both, the error of each layout and the mean absolute error (target <= 25%). Layouts the engine
refuses are listed as skipped. Run it on a quiet
machine: other processes slow the measured runs (the load average is printed per layout).

    python benchmarks/planner_vs_measured.py [--batch 4] [--output-len 64] [--recalibrate]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

TARGET_MAE = 0.25


def predict(ranks: int, tp: int, pp: int, *, batch: int, prompt_len: int, output_len: int) -> float:
    """Predicted decode tokens/s (whole batch) for one layout, from the calibrated planner."""
    from shardlm.plan.calibrate import machine_spec
    from shardlm.plan.catalog import load_model
    from shardlm.plan.hardware import Cluster
    from shardlm.plan.inference import InferenceWorkload, evaluate
    from shardlm.plan.layout import Layout
    from shardlm.plan.roofline import ModelCosts

    cfg, _ = load_model("smollm2")
    cluster = Cluster(gpu=machine_spec(ranks), num_gpus=ranks, gpus_per_node=ranks)
    # shardlm keeps pp micro-batches in flight, like the planner's default
    wl = InferenceWorkload(prompt_len=prompt_len, output_len=output_len, batch=batch, dtype="fp32")
    res = evaluate(ModelCosts(cfg), cluster, Layout(tp=tp, pp=pp), wl, batch=batch)
    return batch / res.tpot_s


def measure(tp: int, pp: int, *, batch: int, prompt_len: int, output_len: int, repeats: int) -> float | str:
    """Measured decode tokens/s (the best of ``repeats`` runs: the calibration takes the best of
    its trials too, and other processes only ever slow a run down), or why it could not run."""
    from shardlm import LLM, SamplingParams
    from shardlm.errors import UsageError

    try:
        llm = LLM("smollm2", tp=tp, pp=pp, dtype="float32")
    except UsageError as e:
        return f"skipped: {str(e).split(';')[0]}"
    try:
        prompts = [[1 + (7 * i + j) % 1000 for j in range(prompt_len)] for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))  # warm-up
        best = 0.0
        for _ in range(repeats):
            llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
            best = max(best, llm.last_stats.decode_tok_s)
        return best
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4, help="prompts decoded together (default 4)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--output-len", type=int, default=64, help="tokens generated per prompt (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="generate runs per layout; the best counts (default 3)")
    ap.add_argument("--max-ranks", type=int, default=os.cpu_count() or 1, help="largest world tried (default: cores)")
    ap.add_argument("--recalibrate", action="store_true", help="measure the machine again before predicting")
    args = ap.parse_args(argv)

    from shardlm.plan.calibrate import calibrate

    t0 = time.perf_counter()
    cal = calibrate(force=args.recalibrate)
    print(
        f"calibration: {'measured' if args.recalibrate else 'cached or measured'} in {time.perf_counter() - t0:.1f} s "
        f"({cal['cores']} cores, torch {cal['torch']})"
    )
    layouts = [
        (tp, pp)
        for ranks in range(1, args.max_ranks + 1)
        for tp in range(1, ranks + 1)
        for pp in (ranks // tp,)
        if tp * pp == ranks
    ]
    print(f"\nSmolLM2-135M float32, batch {args.batch}, prompt {args.prompt_len}, decode {args.output_len} tokens\n")
    print(f"{'layout':10s} {'predicted tok/s':>16s} {'measured tok/s':>15s} {'error':>8s}  load")
    errors, busy = [], []
    for tp, pp in layouts:
        kw = dict(batch=args.batch, prompt_len=args.prompt_len, output_len=args.output_len)
        pred = predict(tp * pp, tp, pp, **kw)
        load = os.getloadavg()[0]  # other processes on the machine skew what is measured
        meas = measure(tp, pp, repeats=args.repeats, **kw)
        if isinstance(meas, str):
            print(f"tp{tp} pp{pp:<5d} {pred:16.1f} {meas}")
            continue
        err = pred / meas - 1
        errors.append(abs(err))
        busy.append(load > (os.cpu_count() or 1) + 0.5)
        print(f"tp{tp} pp{pp:<5d} {pred:16.1f} {meas:15.1f} {err * 100:+7.1f}%  {load:.1f}")
    if not errors:
        print("\nno layout ran; nothing to compare")
        return 1
    mae = sum(errors) / len(errors)
    verdict = "within" if mae <= TARGET_MAE else "OVER"
    print(
        f"\nmean absolute error {mae * 100:.1f}% over {len(errors)} layouts "
        f"({verdict} the {TARGET_MAE * 100:.0f}% target)"
    )
    if any(busy):
        print(
            f"warning: the 1-minute load average exceeded the {os.cpu_count()} cores during a measurement; other "
            f"processes were competing for the CPU, so measured rates (and a calibration taken then) are unreliable"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
