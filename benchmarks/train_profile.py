"""Where a training step's time goes on a GPU: wall time per step, the GPU's busy time, and the
kernels' time by kind (GEMMs, attention, Triton, NCCL, everything else), with the slowest kernels.

One rank (``Trainer`` on cuda, world size 1), random token ids, a HF model directory; 4 warm-up
steps, then the mean of --steps timed steps, then one step under ``torch.profiler``. Also prints
the planner's prediction for the same run (``shardlm plan --train`` with the layout pinned), so the
two can be held side by side (docs/plan.md).

    python benchmarks/train_profile.py MODEL_DIR [--batch 16] [--seq-len 512] [--compile] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile


def kind(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")):
        return "gemm"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    return "triton" if "triton" in n else "other"


def planned(model_dir: str, batch: int, seq: int) -> dict:
    """The planner's tokens/s and memory (GiB, without its reserve) for this run on an H100."""
    from pathlib import Path

    from shardlm.plan.catalog import load_model
    from shardlm.plan.hardware import Cluster, load_gpu
    from shardlm.plan.layout import Layout
    from shardlm.plan.roofline import ModelCosts
    from shardlm.plan.training import TrainWorkload, evaluate

    cfg, _ = load_model(str(Path(model_dir) / "config.json"))
    cluster = Cluster(gpu=load_gpu("h100-sxm"), num_gpus=1, gpus_per_node=1)
    res = evaluate(
        ModelCosts(cfg), cluster, Layout(micro_batch=batch, num_micro=1), TrainWorkload(global_batch=batch, seq_len=seq)
    )
    return {"tokens_per_s": res.tokens_per_s, "memory_gib": (res.memory.total - res.memory.reserve) / 2**30}


def profiled(model_dir: str, batch: int, seq: int, steps: int = 6, compile: bool = False) -> dict:
    """One rank's training step on the GPU: its wall time (the mean of ``steps`` after 4 warm-up
    steps), then one step under ``torch.profiler``: the kernels' GPU time by kind and the slowest,
    with the planner's prediction for the same run."""
    from shardlm.train.trainer import TrainConfig, Trainer

    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(TrainConfig(model=model_dir, device="cuda", compile=compile))
    vocab = trainer.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, vocab, (batch, seq + 1), generator=gen) for _ in range(3)]
    for i in range(4):
        trainer.step(data[i % 3])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        trainer.step(data[i % 3])
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.step(data[0])
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    by_name: dict[str, tuple[int, float]] = {}
    for e in prof.events():
        # kernels only: the optimizer's own range ("Optimizer.step#...") spans kernels counted already
        if e.device_type != torch.autograd.DeviceType.CUDA or e.name.startswith("Optimizer."):
            continue
        s = e.device_time_total / 1e6
        by_kind[kind(e.name)] = by_kind.get(kind(e.name), 0.0) + s
        n, t = by_name.get(e.name[:90], (0, 0.0))
        by_name[e.name[:90]] = (n + 1, t + s)
    tokens = batch * seq
    out = {
        "device": torch.cuda.get_device_name(),
        "tokens": tokens,
        "step_s": wall,
        "tokens_per_s": tokens / wall,
        "gpu_busy_s": sum(by_kind.values()),
        "kernels": sum(n for n, _ in by_name.values()),
        "by_kind_s": by_kind,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "planned": planned(model_dir, batch, seq),
        "slowest": sorted(((round(t * 1e3, 2), n, k) for k, (n, t) in by_name.items()), reverse=True)[:15],
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/train_profile.py profiles GPU kernels: it needs a CUDA GPU")
    print(json.dumps(profiled(args.model, args.batch, args.seq_len, args.steps, args.compile), indent=1))


if __name__ == "__main__":
    main()
