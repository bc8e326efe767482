"""``shardlm bench comm``: latency and bandwidth of every collective, per backend, checked.

Definitions are nccl-tests' (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
size is the full buffer (all-gather: the gathered output; reduce-scatter: the input;
all-to-all: what one rank sends), algbw = size / time, and busbw = algbw x factor, the
factor being the fraction of the data each rank must move over its link by the best
algorithm: all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n,
broadcast 1. Time is the median of 5 timed batches, each the slowest rank's mean.

Every (op, size, backend) point is first run once on rank-distinct small integers and
its result compared exactly with the definition (exact in float32 and bfloat16); a
mismatch is reported in the ``ok`` column and fails the run. Reductions are then timed
on zeros, so repeated in-place sums cannot overflow.

``measure(...)`` runs on the ranks of an existing world (e.g. under torchrun);
``bench_comm(...)`` starts its own ranks with ``shardlm.launch.LocalRanks``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardlm.errors import UsageError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
BACKENDS = ("auto", "shm", "gloo", "nccl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def busbw_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


def sizes_between(lo: int, hi: int) -> list[int]:
    """Powers of two from lo to hi bytes (both included when given as powers of two)."""
    out, s = [], max(1, lo)
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def _val(r: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers that differ across ranks: every sum of up to 16 ranks is exact in bf16."""
    i = torch.arange(count)
    return ((i * 3 + r * 5) % 11 - 5).to(dtype)


def _case(op: str, group, count: int, dtype: torch.dtype, device, timing: bool):
    """(run, expected or None) for one op; count elements of the full buffer (a multiple of n)."""
    from shardlm.parallel import comm

    n, r = dist.get_world_size(group), dist.get_rank(group)
    make = (
        (lambda j, k: torch.zeros(k, dtype=dtype, device=device))
        if timing
        else (lambda j, k: _val(j, k, dtype).to(device))
    )
    if op == "all_reduce":
        x = make(r, count)
        return (lambda: comm.all_reduce(x, group)), (lambda: x), sum(_val(j, count, dtype) for j in range(n))
    if op == "all_gather":
        x = make(r, count // n)
        return (*_keep(lambda: comm.all_gather(x, group)), torch.cat([_val(j, count // n, dtype) for j in range(n)]))
    if op == "reduce_scatter":
        x = make(r, count)
        k = count // n
        want = torch.stack([_val(j, count, dtype) for j in range(n)]).sum(0)[r * k : (r + 1) * k]
        return (*_keep(lambda: comm.reduce_scatter(x, group)), want)
    if op == "all_to_all":
        x, k = make(r, count), count // n
        want = torch.cat([_val(j, count, dtype)[r * k : (r + 1) * k] for j in range(n)])
        return (*_keep(lambda: comm.all_to_all(x, group, [k] * n, [k] * n)), want)
    if op == "broadcast":
        x = make(r, count)
        return (lambda: comm.broadcast(x, 0, group)), (lambda: x), _val(0, count, dtype)
    raise UsageError(f"unknown op {op!r}; pick from {', '.join(OPS)}")


def _keep(fn):
    """(run, result) for an out-of-place op: result() is the last run's output."""
    box = []

    def run():
        box[:] = [fn()]

    return run, (lambda: box[0])


def _timed(run, budget_s: float, world, batches: int = 5) -> float:
    """Seconds per call: the median over ``batches`` timed batches of the slowest rank's mean
    (a median, so a burst of load from other processes does not decide the number)."""
    run()
    t = time.perf_counter()
    run()
    est = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(est, op=dist.ReduceOp.MAX, group=world)  # gloo: the control plane is never timed
    iters = int(min(2000, max(2, budget_s / batches / max(est.item(), 1e-7))))
    times = []
    for _ in range(batches):
        dist.barrier(group=world)
        t = time.perf_counter()
        for _ in range(iters):
            run()
        took = torch.tensor([(time.perf_counter() - t) / iters], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=world)
        times.append(took.item())
    return sorted(times)[batches // 2]


def memcpy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of one torch copy of nbytes (this process's threads), best of repeats."""
    src = torch.ones(max(nbytes, 1 << 20), dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return src.numel() / best


def measure(
    *, ops=OPS, sizes=(8, 1 << 20), backends=("auto", "gloo"), dtype="float32", budget_s=0.05, device="cpu"
) -> dict:
    """Run the benchmark on the ranks of the current world (collective: call it on every rank)."""
    from shardlm.parallel import shm

    world = dist.group.WORLD
    n, elem = dist.get_world_size(), DTYPES[dtype].itemsize
    memcpy = None
    if dist.get_rank() == 0:
        memcpy = memcpy_bandwidth(max(sizes))
    dist.barrier()
    rows, paths = [], {}
    for backend in backends:
        group = dist.new_group(list(range(n)))  # collective; a group per backend, each with its own path
        if backend in ("shm", "gloo"):
            shm.set_backend(group, backend)
        paths[backend] = "nccl" if backend == "nccl" else ("shm" if shm.route(group) is not None else "gloo")
        for op in ops:
            for size in sizes:
                count = max(n, size // elem // n * n)  # a multiple of n elements, as nccl-tests rounds
                run, result, want = _case(op, group, count, DTYPES[dtype], device, timing=False)
                run()
                ok = torch.equal(result().cpu(), want)
                run, _, _ = _case(op, group, count, DTYPES[dtype], device, timing=True)
                sec = _timed(run, budget_s, world)
                flag = torch.tensor([int(ok)])
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=world)
                nbytes = count * elem
                algbw = nbytes / sec / 1e9
                rows.append(
                    dict(
                        op=op,
                        backend=backend,
                        path=paths[backend],
                        bytes=nbytes,
                        count=count,
                        time_us=sec * 1e6,
                        algbw=algbw,
                        busbw=algbw * busbw_factor(op, n),
                        ok=bool(flag.item()),
                    )
                )
    return {
        "rows": rows,
        "paths": paths,
        "memcpy_GBps": memcpy / 1e9 if memcpy else None,
        "ranks": n,
        "dtype": dtype,
        "why_not_shm": next(iter(shm.why_not.values()), None),
    }


class BenchWorker:
    """One rank started by LocalRanks: joins the world, then runs ``measure`` on command."""

    def __init__(self, rank: int, world: int, init_method: str, device: str, timeout_s: float, threads: int | None):
        from shardlm.launch import cpu_threads, init_distributed

        torch.set_num_threads(threads or cpu_threads(world))
        if device == "cuda":
            torch.cuda.set_device(rank)
        init_distributed(rank, world, init_method, device, timeout_s)

    @classmethod
    def spawned(cls, rank: int, world: int, init_method: str, *args) -> BenchWorker:
        return cls(rank, world, init_method, *args)

    def ready_info(self) -> dict:
        return {"pid": os.getpid()}

    def measure(self, options: dict) -> dict:
        return measure(**options)

    def overlap(self, options: dict) -> list[dict]:
        from shardlm.bench.overlap import measure_overlap

        return measure_overlap(**options)


def on_local_ranks(
    ranks: int, method: str, options: dict, *, device: str = "cpu", threads: int | None = None, timeout_s: float = 300.0
):
    """Start ranks with ``shardlm.launch.LocalRanks``, run ``method`` ("measure" or "overlap")
    with ``options`` on each, stop them; returns rank 0's result."""
    from shardlm.launch import LocalRanks

    pool = LocalRanks(ranks, BenchWorker.spawned, (device, timeout_s, threads), timeout_s=timeout_s)
    try:
        pool.collect("ready")
        return pool.call(method, options)[0]
    finally:
        pool.close()


@dataclass
class CommReport:
    ranks: int
    dtype: str
    rows: list[dict]
    paths: dict[str, str]
    memcpy_GBps: float | None
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    why_not_shm: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.rows)

    def table(self) -> str:
        from shardlm.bench.report import comm_table

        return comm_table(self)

    def plot(self, directory: str) -> list[str]:
        from shardlm.bench.report import comm_plots

        return comm_plots(self, directory)


def bench_comm(
    *,
    ranks: int = 2,
    ops=OPS,
    min_bytes: int = 8,
    max_bytes: int = 64 << 20,
    backends=("auto", "gloo"),
    dtype: str = "float32",
    budget_s: float = 0.05,
    threads: int | None = None,
    timeout_s: float = 300.0,
) -> CommReport:
    """Start ``ranks`` local ranks, measure, stop them; returns the report (see ``measure``)."""
    ops, backends = list(ops), list(backends)
    check_options(ranks=ranks, ops=ops, backends=backends, dtype=dtype, min_bytes=min_bytes, max_bytes=max_bytes)
    device = "cuda" if "nccl" in backends else "cpu"
    load_before = os.getloadavg()
    options = dict(
        ops=ops,
        sizes=sizes_between(min_bytes, max_bytes),
        backends=backends,
        dtype=dtype,
        budget_s=budget_s,
        device=device,
    )
    out = on_local_ranks(ranks, "measure", options, device=device, threads=threads, timeout_s=timeout_s)
    return CommReport(
        ranks=ranks,
        dtype=dtype,
        rows=out["rows"],
        paths=out["paths"],
        memcpy_GBps=out["memcpy_GBps"],
        load_before=load_before,
        load_after=os.getloadavg(),
        why_not_shm=out["why_not_shm"] or None,
    )


def check_options(*, ranks, ops, backends, dtype, min_bytes, max_bytes) -> None:
    if ranks < 2:
        raise UsageError(f"--ranks {ranks}: a collective needs at least 2 ranks, e.g. --ranks 2")
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise UsageError(f"unknown op(s) {bad}; pick from {','.join(OPS)}")
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        raise UsageError(f"unknown backend(s) {bad or backends}; pick from {','.join(BACKENDS)}, e.g. auto,gloo")
    if "nccl" in backends and (len(backends) > 1 or not torch.cuda.is_available() or torch.cuda.device_count() < ranks):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise UsageError(
            f"--backend nccl needs {ranks} CUDA GPUs (this host has {have}) and runs alone; "
            f"use --backend auto,gloo on CPU"
        )
    if "shm" in backends:
        from shardlm.parallel.shm_setup import why_not_here

        if why_not_here():
            raise UsageError(f"--backend shm: {why_not_here()}; use --backend auto,gloo")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: pick one of {', '.join(DTYPES)}")
    if not 1 <= min_bytes <= max_bytes:
        raise UsageError(f"--min-bytes {min_bytes} / --max-bytes {max_bytes}: need 1 <= min <= max, e.g. 8 and 64M")
