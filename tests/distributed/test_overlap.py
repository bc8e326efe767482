"""ZeRO's communication overlaps compute (train/overlap.py): the order of events in a step.

Equal losses (test_train.py, every layout against HF) show the overlapped reductions and
prefetched gathers give the right numbers; these show they happen early. A step is logged on
each of two dp ranks (harness/overlap_rankfns.py): decoder layers' forward and backward, each
micro-batch's backward, and every all-gather and gradient reduction, started or waited on. With
the feature off (prefetch=0, bucket_mb=0) each test fails: nothing is started asynchronously.
"""

from __future__ import annotations

import pytest
import torch

from harness.multirank import run_ranks
from harness.overlap_rankfns import step_events

LAYERS = 6  # the tiny Llama's; a layer is 0.31 MiB of float32 gradients


@pytest.fixture(scope="module")
def setup(tiny):
    batch = torch.randint(0, 251, (4, 17), generator=torch.Generator().manual_seed(0))
    return str(tiny("llama").path), batch


def in_flight(log: list[tuple], kind: str) -> int:
    """The most collectives of ``kind`` started and not yet waited on at any point."""
    live = peak = 0
    for event in log:
        if event[:2] == (kind, "start"):
            live += 1
        elif event[:2] == (kind, "wait"):
            live -= 1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("prefetch", [1, 2])
def test_zero3_gathers_the_next_layers_while_one_computes(setup, prefetch):
    """Forward: layer i+1's all-gather starts before layer i's forward ends; backward: layer
    i-1's re-gather starts before layer i's backward ends; never more than ``prefetch`` in
    flight; still every unit gathered exactly twice a step."""
    path, batch = setup
    for log in run_ranks(2, step_events, path, batch, dp=2, zero=3, prefetch=prefetch):
        starts = [i for i, e in enumerate(log) if e[:2] == ("gather", "start")]
        for i in range(LAYERS - 1):
            first = next(j for j in starts if log[j][2] == i + 1)
            assert first < log.index(("fwd", i, "end")), (i, log)
        for i in range(1, LAYERS):
            again = [j for j in starts if log[j][2] == i - 1 and j > log.index(("backward", "begin", True))]
            assert again and again[0] < log.index(("bwd", i, "end")), (i, log)
        assert in_flight(log, "gather") == prefetch, log
        gathered = sorted(e[2] for e in log if e[0] == "gather" and e[1] != "wait")
        assert gathered == sorted(list(range(LAYERS + 1)) * 2)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_gradient_buckets_are_reduced_during_backward(setup, zero):
    """bucket_mb=0.5 holds one layer (0.31 MiB), the last with the embedding's unit: the first
    bucket's reduction starts before the last layer to run backward (layer 0) begins its
    backward, and is waited on only after more backward ran; at most two in flight; each
    bucket reduced once."""
    path, batch = setup
    for log in run_ranks(2, step_events, path, batch, dp=2, zero=zero, bucket_mb=0.5):
        starts = [i for i, e in enumerate(log) if e[:2] == ("reduce", "start")]
        assert [log[i][2] for i in starts] == [(5,), (4,), (3,), (2,), (1,), (0, 6)], log
        assert starts[0] < log.index(("bwd", 0, "begin")), log
        assert log.index(("reduce", "wait", (5,))) > log.index(("bwd", 4, "begin")), log
        assert in_flight(log, "reduce") == 2, log
        assert not [e for e in log if e[:2] == ("reduce", "now")], log


def test_gradient_accumulation_reduces_in_the_last_backward_only(setup):
    """grad_accum=2 at ZeRO-2: the first micro-batch's backward reduces nothing (DDP's no_sync);
    the second reduces every bucket once."""
    path, batch = setup
    for log in run_ranks(2, step_events, path, batch, dp=2, zero=2, grad_accum=2, bucket_mb=0.5):
        first = log[log.index(("backward", "begin", False)) : log.index(("backward", "end", False))]
        assert ("bwd", 0, "end") in first and not [e for e in first if e[0] == "reduce"], first
        second = log[log.index(("backward", "begin", True)) :]
        assert len([e for e in second if e[:2] == ("reduce", "start")]) == LAYERS, second
