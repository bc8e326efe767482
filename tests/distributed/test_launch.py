"""The driver's watch over its ranks: a rank that compiles for minutes says so and is not
taken for a hung one; a silent rank still ends the run; a peer that never joins ends start-up."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from multiprocessing.connection import Pipe
from pathlib import Path

import pytest

from shardlm import launch
from shardlm.engine import model_runner
from shardlm.errors import RankFailure


def driver_of_one_rank(timeout_s: float):
    """A LocalRanks over one in-process "rank" (the other end of a pipe), whose driver
    gives up after ``timeout_s`` plus its 30 s margin without news."""
    ranks = object.__new__(launch.LocalRanks)
    mine, theirs = Pipe(duplex=True)
    ranks.world, ranks.timeout_s, ranks.conns, ranks.procs = 1, timeout_s - 30, [mine], []
    return ranks, launch.DriverLink(theirs)


class BusyWorker:
    """A rank's worker whose one job sends busy news every 0.5 s for 4 s (a long compile)."""

    def ready_info(self) -> dict:
        return {}

    def work(self, answer: int) -> int:
        for _ in range(8):
            launch.busy("compiling the decode step")
            time.sleep(0.5)
        return answer


def busy_worker(rank: int, world: int, init_method: str) -> BusyWorker:
    return BusyWorker()


def test_a_busy_rank_is_not_taken_for_a_hung_one(monkeypatch):
    """A real rank process sends news for 4 s to a driver that gives up after 2 s of silence."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    )
    ranks = launch.LocalRanks(1, busy_worker, (), timeout_s=60)
    try:
        ranks.collect("ready")
        ranks.timeout_s = 2.0 - 30  # from now on, 2 s of silence end the run
        assert ranks.call("work", 42) == [42]
    finally:
        ranks.close()


def test_a_silent_rank_still_ends_the_run():
    ranks, _ = driver_of_one_rank(timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[0\] sent nothing for 1s"):
        ranks.collect("done")
    assert time.monotonic() - start < 5


def test_a_compile_tells_the_driver(monkeypatch):
    """Every rank's compile sends busy news (only rank 0 prints), through launch.busy."""
    mine, theirs = Pipe(duplex=True)
    monkeypatch.setattr(launch, "_driver", launch.DriverLink(theirs))
    monkeypatch.setattr(model_runner, "PROGRESS_EVERY_S", 0.1)
    with model_runner.announced("the decode step for one sequence", False):
        time.sleep(0.35)
    news = []
    while mine.poll(0):
        news.append(mine.recv())
    assert len(news) >= 2 and set(news) == {("busy", "compiling the decode step for one sequence")}


# rank 0 of two joins; its peer never does ("none"), or reaches the store but never starts its
# process group ("half": the case of a host lost during start-up under torchrun)
_JOIN = """
import datetime, sys, threading, time
import torch.distributed as dist
from shardlm.launch import init_distributed
from shardlm.errors import RankFailure
port, peer = int(sys.argv[1]), sys.argv[2]
def half():
    time.sleep(0.5)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=10))
    time.sleep(30)
if peer == "half":
    threading.Thread(target=half, daemon=True).start()
try:
    init_distributed(0, 2, f"tcp://127.0.0.1:{port}", "cpu", 1)
except RankFailure as e:
    print(e)
"""


@pytest.mark.parametrize(("peer", "named"), [("none", "1 of 2 ranks"), ("half", "ranks [1]")])
def test_a_peer_that_never_joins_ends_start_up_with_one_line(peer, named):
    """``init_process_group`` waiting for a peer that never comes ends after --timeout with one
    line naming who is missing (torch's own error is a DistStoreError about store keys)."""
    out = subprocess.run(
        [sys.executable, "-c", _JOIN, str(launch._free_port()), peer], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.startswith(f"rank 0: {named} did not join the process group within "), out
    assert "(--timeout): their process or host was lost or never started" in out.stdout, out
