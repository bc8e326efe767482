"""The one multi-rank test harness: a pool of gloo ranks on CPU (or NCCL ranks, one GPU each),
reused across tests.

Starting a rank costs seconds (it imports torch and shardlm), so ranks fork from a
forkserver that imported both once, and ranks of one world size are kept for the
session and run many test functions. ``run_ranks(n, fn, *args)``
calls ``fn(*args)`` on every rank of an n-rank world and returns the list of
results in rank order. ``fn`` must be importable (a module-level function).

A failure on any rank raises in the test with that rank's traceback; the pool is
then torn down (a failed collective can leave peers waiting) and the next test
gets a fresh one. A pool that does not answer within the timeout is killed too,
so a broken collective fails the test instead of hanging the suite.
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import socket
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = float(os.environ.get("SHARDLM_TEST_TIMEOUT", "240"))
MAX_LIVE_POOLS = 2  # ranks hold ~300 MB each; keep at most two world sizes alive
# forkserver, not fork: the test process has run torch ops (OpenMP threads are not fork-safe);
# the server has only imported modules
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["shardlm.engine.llm", "harness.multirank"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, backend: str, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # n ranks share 2 cores; more threads only thrash
    extra = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S),
        **extra,
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world: int, backend: str = "gloo"):
        ctx = _CTX
        self.world = world
        self.tasks = [ctx.SimpleQueue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, backend, port, self.tasks[r], self.results), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        errors_at = 0.0  # when the first rank reported a failure
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                missing = sorted(set(range(self.world)) - set(out) - set(errors))
                if errors and time.monotonic() > min(deadline, errors_at + 5):
                    break  # peers of a failed rank are stuck in a collective: report the failure
                if dead or time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{fn.__name__} on {self.world} ranks: ranks {missing} gave no result "
                        f"({'dead ranks: ' + str(dead) if dead else f'within {timeout:.0f}s'})"
                    ) from None
                continue
            if not ok and not errors:
                errors_at = time.monotonic()
            (out if ok else errors)[rank] = value
        if errors:
            rank = min(errors)
            raise AssertionError(f"{fn.__name__} failed on rank {rank} of {self.world}:\n{errors[rank]}")
        return [out[r] for r in range(self.world)]

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


_pools: OrderedDict[tuple[int, str], RankPool] = OrderedDict()


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world``-rank gloo group."""
    return run_ranks_on("gloo", world, fn, *args, timeout=timeout, **kwargs)


def run_ranks_on(
    backend: str, world: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any
) -> list:
    """``run_ranks`` over a process group of ``backend`` ("gloo", or "nccl": rank r on GPU r)."""
    key = (world, backend)
    pool = _pools.pop(key, None)
    if pool is None:
        while len(_pools) >= MAX_LIVE_POOLS:
            _pools.popitem(last=False)[1].close()
        pool = RankPool(world, backend)
    try:
        result = pool.run(fn, *args, timeout=timeout, **kwargs)
    except BaseException:
        pool.close(graceful=False)
        raise
    if _threads(pool) > MAX_POOL_THREADS:
        pool.close()  # a fresh pool next time: its ranks have piled up process groups (see _threads)
    else:
        _pools[key] = pool  # most recently used last
    return result


MAX_POOL_THREADS = 64
"""Threads a pool rank may have before the pool is replaced. Every process group a test builds
(a ParallelDims mesh makes several) keeps a gloo thread that wakes up on its own, so long-lived
pools pile them up and, idle, take CPU from the test that runs (tests/README.md)."""


def _threads(pool: RankPool) -> int:
    """The most threads any rank of ``pool`` runs (Linux's /proc; 0 elsewhere: never replaced)."""
    counts = []
    for p in pool.procs:
        try:
            counts.append(len(os.listdir(f"/proc/{p.pid}/task")))
        except OSError:
            counts.append(0)
    return max(counts)


@atexit.register
def _close_all() -> None:
    while _pools:
        _pools.popitem()[1].close()


# ---- helpers for functions that run on the ranks ------------------------------------
_dims_cache: dict = {}


def dims(**sizes: int):
    """The built ParallelDims for this layout, created once per rank process.

    Building a mesh creates process groups (a collective over the world), so every
    rank must ask for the same layouts in the same order; caching keeps that cheap.
    """
    from shardlm.parallel.dims import ParallelDims

    key = tuple(sorted(sizes.items()))
    if key not in _dims_cache:
        _dims_cache[key] = ParallelDims(**sizes).build_mesh("cpu")
    return _dims_cache[key]
