"""`shardlm bench comm`: it starts its own ranks, checks every result, and reports nccl-tests' numbers.

Behaviour only (no speed is asserted: benchmarks are not tests)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch.distributed as dist

from harness.cli import main_exit
from harness.multirank import run_ranks
from shardlm.bench.comm import OPS, bench_comm, busbw_factor, measure, sizes_between


def test_busbw_factors_are_nccl_tests_definitions():
    assert busbw_factor("all_reduce", 4) == 2 * 3 / 4
    assert busbw_factor("all_gather", 4) == busbw_factor("reduce_scatter", 4) == busbw_factor("all_to_all", 4) == 3 / 4
    assert busbw_factor("broadcast", 4) == 1.0
    assert sizes_between(8, 64) == [8, 16, 32, 64]


@pytest.mark.slow
def test_python_api_every_op_both_backends():
    report = bench_comm(ranks=3, ops=OPS, min_bytes=8, max_bytes=4096, backends=("auto", "gloo"), budget_s=0.002)
    assert report.paths == {"auto": "shm", "gloo": "gloo"}
    assert report.ok and len(report.rows) == len(OPS) * 10 * 2
    for r in report.rows:
        assert r["count"] % 3 == 0 and r["bytes"] == r["count"] * 4  # a multiple of n elements
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
        assert r["busbw"] == pytest.approx(r["algbw"] * busbw_factor(r["op"], 3))
    table = report.table()
    for op in OPS:
        assert f"{op} (GB/s)" in table
    assert "gloo/auto" in table and "memcpy" in table and "WRONG" not in table


def _noop_all_reduce_is_caught():
    from shardlm.parallel import comm

    real = comm.all_reduce
    comm.all_reduce = lambda x, group, *a, **k: x  # a broken collective that does nothing
    try:
        out = measure(ops=["all_reduce", "broadcast"], sizes=[64], backends=["gloo"], budget_s=0.001)
    finally:
        comm.all_reduce = real
    return [(r["op"], r["ok"]) for r in out["rows"]]


def test_a_wrong_result_is_reported():
    got = run_ranks(2, _noop_all_reduce_is_caught)
    assert got[0] == [("all_reduce", False), ("broadcast", True)]


@pytest.mark.slow
def test_cli_json_and_plots(tmp_path):
    """One run (its ranks cost most of it); the table's text is checked through the Python API above."""
    cmd = [
        sys.executable,
        "-m",
        "shardlm.cli",
        "bench",
        "comm",
        "--ranks",
        "2",
        "--ops",
        "all_reduce,all_gather",
        "--min-bytes",
        "8",
        "--max-bytes",
        "1K",
        "--budget",
        "0.002",
        "--json",
        "--plot",
        str(tmp_path),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["paths"] == {"auto": "shm", "gloo": "gloo"} and all(r["ok"] for r in data["rows"])  # both by default
    assert {r["op"] for r in data["rows"]} == {"all_reduce", "all_gather"} and len(data["rows"]) == 2 * 8 * 2
    assert (tmp_path / "latency.png").stat().st_size > 10_000 and (tmp_path / "busbw.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "args,match",
    [
        (["--ranks", "1"], "--ranks 1"),
        (["--ops", "all_reduce,sort"], "unknown op"),
        (["--backend", "mpi"], "unknown backend"),
        (["--backend", "nccl"], "CUDA GPUs"),
        (["--min-bytes", "1M", "--max-bytes", "8"], "min <= max"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, match, capsys):
    """Refused before any rank starts, by the command's own ``main`` in this process (the real
    command's exit and single line are checked once, below)."""
    if "nccl" in args and dist.is_nccl_available():
        import torch

        if torch.cuda.device_count() >= 2:
            pytest.skip("this host can run nccl")
    code, err = main_exit(["bench", "comm", *args], capsys)
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # ~8 s: a CLI process (the refusals themselves are checked in-process above)
def test_the_real_command_refuses_with_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "shardlm.cli", "bench", "comm", "--ranks", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--ranks 1" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
