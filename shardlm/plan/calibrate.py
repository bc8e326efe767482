"""Measure this machine once (matmul rate, matrix-vector bandwidth, per-op overhead, gloo
all-reduce latency and bandwidth between two local processes) and describe it as a GpuSpec
so the same models predict shardlm's own CPU runs (``--gpu this-machine``).

Results are cached in ``$SHARDLM_CACHE_DIR/calibration.json`` (default ``~/.cache/shardlm``);
``calibrate(force=True)`` / ``shardlm plan --recalibrate`` measures again. Rates are taken at
the thread count each rank will have: ranks split the cores (threads = max(1, cores // ranks)).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import time
from pathlib import Path

import torch

from shardlm.plan.hardware import GpuSpec, Link

SCHEMA = 1
MIN_SECONDS = 0.15
"""Each micro-benchmark repeats until it has run this long (0.03 s in quick mode)."""
ALLREDUCE_SIZES = (1, 64, 576, 4096, 32768, 262144)
"""Floats per all-reduce when fitting alpha and beta (576 = SmolLM2's hidden size)."""


def cache_path() -> Path:
    root = Path(os.environ.get("SHARDLM_CACHE_DIR") or Path.home() / ".cache" / "shardlm")
    return root / "calibration.json"


TRIALS = 5
"""Each measurement is the best of this many trials: other processes on a shared machine only
ever make a trial slower, so the fastest is the closest to what the hardware does."""


def _repeat(fn, min_s: float) -> float:
    """Seconds per call of fn(): the best of TRIALS trials of at least min_s / TRIALS each."""
    fn()
    best = float("inf")
    for _ in range(TRIALS):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_s / TRIALS:
                break
        best = min(best, dt / n)
    return best


def _matmul_flops(dtype: torch.dtype, size: int, min_s: float) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return 2 * size**3 / _repeat(lambda: a @ b, min_s)


def _matvec_Bps(dtype: torch.dtype, rows: int, min_s: float, batch: int = 4) -> float:
    """Effective weight-streaming bandwidth of decode: ``batch`` tokens through a stack of
    linear layers whose weights (16 x rows x 1024) are far larger than the caches, so every
    weight byte comes from memory once per pass, as in a decode step."""
    ws = [torch.randn(rows, 1024, dtype=dtype) for _ in range(16)]
    x = torch.randn(batch, 1024, dtype=dtype)

    def run() -> None:
        for w in ws:
            torch.nn.functional.linear(x, w)

    return sum(w.numel() * w.element_size() for w in ws) / _repeat(run, min_s)


def _op_overhead(min_s: float) -> float:
    """Seconds per small tensor operator: an RMSNorm, a RoPE-like rotate and a few views on a
    [4, 576] activation, the kind of operator a decode step issues dozens of per layer."""
    x, w = torch.randn(4, 576), torch.randn(576)

    def ops() -> None:  # 14 operators
        r = x.pow(2).mean(-1, keepdim=True).add(1e-5).rsqrt()
        y = x * r * w
        a, b = y.view(4, 9, 64).chunk(2, dim=-1)
        z = torch.cat((b.neg(), a), dim=-1).unsqueeze(0).transpose(1, 2)
        z.add(1.0)

    return _repeat(ops, min_s) / 14


def _local(threads: int, quick: bool) -> dict:
    torch.set_num_threads(threads)
    min_s = 0.03 if quick else MIN_SECONDS
    size, rows = (256, 1024) if quick else (1024, 4096)
    return {
        "matmul_flops": {
            "fp32": _matmul_flops(torch.float32, size, min_s),
            "bf16": _matmul_flops(torch.bfloat16, size, min_s),
        },
        "matvec_Bps": {
            "fp32": _matvec_Bps(torch.float32, rows, min_s),
            "bf16": _matvec_Bps(torch.bfloat16, rows, min_s),
        },
        "op_overhead_s": _op_overhead(min_s),
    }


def _pair_worker(rank: int, port: int, quick: bool, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    reps = 10 if quick else 50
    times = {}
    for n in ALLREDUCE_SIZES[: 4 if quick else None]:
        t = torch.ones(n)
        for _ in range(3):
            dist.all_reduce(t)
        best = float("inf")
        for _ in range(TRIALS):  # both ranks agree on the trial boundaries through the collective
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(t)
            best = min(best, (time.perf_counter() - t0) / reps)
        times[n * 4] = best
    dist.barrier()  # both ranks stream memory at once: what each rank gets when two share the machine
    bw = {
        "fp32": _matvec_Bps(torch.float32, 1024 if quick else 4096, 0.03 if quick else MIN_SECONDS),
        "bf16": _matvec_Bps(torch.bfloat16, 1024 if quick else 4096, 0.03 if quick else MIN_SECONDS),
    }
    dist.barrier()
    mm = {
        "fp32": _matmul_flops(torch.float32, 256 if quick else 1024, 0.03 if quick else MIN_SECONDS),
        "bf16": _matmul_flops(torch.bfloat16, 256 if quick else 1024, 0.03 if quick else MIN_SECONDS),
    }
    if rank == 0:
        out.put({"allreduce_s": times, "matvec_Bps": bw, "matmul_flops": mm})
    dist.destroy_process_group()


def _pair(quick: bool) -> dict:
    """All-reduce timings and concurrent bandwidth, two gloo processes of one thread each."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_pair_worker, args=(r, port, quick, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    if q.empty():
        raise RuntimeError("calibration: the two gloo processes did not report; is 127.0.0.1 usable?")
    res = q.get()
    times = res["allreduce_s"]
    small = [t for b, t in times.items() if b <= 4096]
    a = min(small)  # latency: the fastest small message
    big = max(times)
    b = max((times[big] - a) / big, 1e-12)  # bandwidth: what the largest message adds on top
    res["allreduce_fit"] = {"a_s": a, "b_s_per_byte": b}
    res["allreduce_s"] = {str(k): v for k, v in res["allreduce_s"].items()}
    return res


ROUNDS = 3
"""Times each single-process measurement is repeated, spread over the calibration."""


def _best(runs: list[dict]) -> dict:
    """Element-wise best of several measurement dicts (max rate, min overhead)."""
    out = {}
    for k, v in runs[0].items():
        if isinstance(v, dict):
            out[k] = _best([r[k] for r in runs])
        else:
            out[k] = (min if k.endswith("_s") else max)(r[k] for r in runs)
    return out


def _sanitise(local: dict, pair: dict | None, cores: int) -> None:
    """Physical bounds that contention can hide: more threads are never slower than one, and two
    ranks sharing the memory bus each get at least half of what the whole machine streams."""
    one, full = local["1"], local[str(cores)]
    for kind in ("matmul_flops", "matvec_Bps"):
        for dt in one[kind]:
            full[kind][dt] = max(full[kind][dt], one[kind][dt])
            if pair is not None:
                lo, hi = full[kind][dt] / 2, max(one[kind][dt], full[kind][dt] / 2)
                pair[kind][dt] = min(max(pair[kind][dt], lo), hi)


def _mem_total() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 8e9


def calibrate(*, force: bool = False, quick: bool = False) -> dict:
    """The cached measurements, measuring first when there are none (or ``force``)."""
    path = cache_path()
    if path.exists() and not force:
        try:
            data = json.loads(path.read_text())
            if data.get("schema") == SCHEMA and data.get("cores") == os.cpu_count():
                return data
        except (OSError, json.JSONDecodeError):
            pass
    cores = os.cpu_count() or 1
    prev = torch.get_num_threads()
    try:
        # rounds spread each measurement over the whole calibration: a burst of load from other
        # processes then spoils one round, not the result (each number is the best round)
        rounds = [{str(t): _local(t, quick) for t in sorted({1, cores})} for _ in range(ROUNDS)]
        local = {t: _best([r[t] for r in rounds]) for t in rounds[0]}
        pair = _pair(quick) if cores >= 2 else None
        _sanitise(local, pair, cores)
        data = {
            "schema": SCHEMA,
            "cores": cores,
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "quick": quick,
            "memory_bytes": _mem_total(),
            "threads": local,
            "pair": pair,
        }
    finally:
        torch.set_num_threads(prev)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return data


def machine_spec(ranks: int = 1, data: dict | None = None) -> GpuSpec:
    """This machine as one 'GPU' per rank: the rates a rank gets when ``ranks`` share the cores."""
    data = data or calibrate()
    cores = data["cores"]
    threads = max(1, cores // ranks)
    local = data["threads"].get(str(threads)) or data["threads"][str(min(int(t) for t in data["threads"]))]
    oversub = max(1.0, ranks / cores)  # more ranks than cores: they take turns
    pair = data.get("pair")
    bw = dict(local["matvec_Bps"])
    flops = dict(local["matmul_flops"])
    if ranks >= 2 and pair:  # ranks run at once and share the memory bus
        bw, flops = dict(pair["matvec_Bps"]), dict(pair["matmul_flops"])
    fit = pair["allreduce_fit"] if pair else {"a_s": 1e-4, "b_s_per_byte": 1e-9}
    link = Link(alpha_s=fit["a_s"] / 2, bandwidth_Bps=1.0 / fit["b_s_per_byte"])  # ring of 2: 2 alpha + S/B
    return GpuSpec(
        name="this-machine",
        display=f"this machine ({cores} cores, {ranks} rank{'s' * (ranks > 1)})",
        memory_bytes=data["memory_bytes"] / max(ranks, 1),
        flops={k: v / oversub for k, v in flops.items()} | {"float32": flops["fp32"] / oversub},
        mem_Bps=bw["fp32"] / oversub,
        intra=link,
        inter=link,
        gpus_per_node=max(ranks, 1),
        op_overhead_s=local["op_overhead_s"] * oversub,
        collective_launch_s=0.0,
        gemm_half_rows=0.0,
        source=f"measured, cached in {cache_path()}",
        calibrated=data,
    )
