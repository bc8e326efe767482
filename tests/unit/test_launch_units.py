"""launch.peer_failure: gloo's errors for a lost peer become one line naming the host and ranks; a
rank reports such a failure to its driver in that line, any other with its traceback."""

from __future__ import annotations

from multiprocessing import Pipe

import pytest

from shardlm import launch
from shardlm.parallel.shm_segment import PeerFailure


@pytest.mark.parametrize(
    "text",
    [
        "[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [192.0.2.2]:28855. This is typically caused",
        "[/gloo/transport/tcp/pair.cc:589] Read error [192.0.2.2]:51488: Connection reset by peer",
    ],
)
def test_a_closed_connection_names_the_lost_host(monkeypatch, text):
    monkeypatch.setattr(launch, "HOSTS", [("a", "192.0.2.1")] * 2 + [("b", "192.0.2.2")] * 2)
    assert launch.peer_failure(RuntimeError(text)).startswith("lost host b (192.0.2.2, ranks [2, 3]): ")


def test_a_rank_relaying_a_peers_lost_host_names_that_host(monkeypatch):
    """A shared-memory peer that gave up on a lost host (PeerFailure.lost): its ranks' host, as the
    peer's own line names it; the error's ranks are the ones lost_ranks reads from gloo's error."""
    monkeypatch.setattr(launch, "HOSTS", [("a", "192.0.2.1")] * 2 + [("b", "192.0.2.2")] * 2)
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [192.0.2.2]:28855.")
    assert launch.lost_ranks(closed) == [2, 3] and launch.lost_ranks(RuntimeError("out of memory")) == []
    line = launch.relayed_failure(PeerFailure("group rank 1 ... found global ranks [2, 3] lost", [2, 3]))
    assert (
        line == "lost host b (192.0.2.2, ranks [2, 3]), found by a rank of this host that then stopped; the run stops"
    )
    assert launch.relayed_failure(PeerFailure("group rank 1 died")) is None  # it said nothing: its own message
    assert launch.relayed_failure(PeerFailure("x", [7])) is None  # a rank the run does not have


def test_a_timeout_names_the_other_hosts_and_other_errors_pass(monkeypatch):
    monkeypatch.setattr(launch, "HOSTS", [("here", "192.0.2.1"), ("there", "192.0.2.2")])
    monkeypatch.setattr(launch.socket, "gethostname", lambda: "here")
    line = launch.peer_failure(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation"))
    assert line.startswith("a peer rank (on there) did not answer a recv for 15 s (--timeout)")
    assert launch.peer_failure(RuntimeError("CUDA out of memory")) is None


class _Failing:
    """A worker whose ``step`` raises the given error."""

    def __init__(self, error: BaseException):
        self.error = error

    def ready_info(self):
        return None

    def step(self, payload):
        raise self.error


@pytest.mark.parametrize(
    "error, kind, says",
    [
        (
            PeerFailure("shared-memory collective failed: all_reduce: group rank 1 (global rank 1, pid 7) died"),
            "lost",
            "died",
        ),
        (RuntimeError("[pair.cc:553] Connection closed by peer [192.0.2.2]:28855."), "lost", "lost the peer"),
        (ValueError("a bug"), "error", "a bug"),
        (OSError("Connection reset by peer"), "error", "Connection reset"),  # not a collective's
    ],
)
def test_a_rank_reports_a_lost_peer_in_one_line_and_anything_else_with_its_traceback(monkeypatch, error, kind, says):
    """obey: the driver prints what a rank sends; a traceback of the collective that saw a peer die is noise."""
    monkeypatch.setattr(launch, "HOSTS", [])
    ours, theirs = Pipe()
    theirs.send(("step", None))
    with pytest.raises(type(error)):
        launch.obey(launch.DriverLink(ours), _Failing(error), rank=0)
    assert theirs.recv() == ("ready", None)
    got, report = theirs.recv()
    assert got == kind and ("Traceback" in report) == (kind == "error") and says in report


def _ranks(n: int):
    """A driver's LocalRanks over ``n`` socket pairs, without processes: (ranks, the ranks' ends)."""
    ranks = object.__new__(launch.LocalRanks)
    pairs = [Pipe() for _ in range(n)]
    ranks.conns, ranks.procs, ranks.hosts = [a for a, _ in pairs], {}, {}
    return ranks, [b for _, b in pairs]


def test_a_driver_told_of_a_lost_peer_reports_the_peers_own_failure():
    """Rank 0 lost rank 1: rank 1's death or error, if it comes within the grace, is what the run
    reports (the CI flake: whichever reached the driver first was reported); else rank 0's line."""
    ranks, ends = _ranks(3)
    ends[1].close()  # rank 1 died
    assert ranks.cause(0, "lost", "group rank 1 died\n") == "rank 1 died (connection lost)"
    ranks, ends = _ranks(3)
    ends[2].send(("lost", "group rank 1 died"))  # another rank that only saw it too: not the cause
    ends[1].send(("error", "Traceback ...\nValueError: a bug\n"))
    assert ranks.cause(0, "lost", "group rank 1 died") == "rank 1 failed:\nTraceback ...\nValueError: a bug"
    ranks, ends = _ranks(3)
    ends[2].send(("lost", "group rank 0 gave up"))  # rank 2 saw it too and exited: not the cause
    ends[2].close()
    assert ranks.cause(0, "lost", "group rank 1 timed out") == "rank 0 failed:\ngroup rank 1 timed out"
    ranks, ends = _ranks(2)
    start = launch.time.monotonic()
    assert ranks.cause(0, "lost", "group rank 1 timed out") == "rank 0 failed:\ngroup rank 1 timed out"
    assert launch.LOST_GRACE_S <= launch.time.monotonic() - start < launch.LOST_GRACE_S + 1
    assert ranks.cause(1, "error", "Traceback: x\n") == "rank 1 failed:\nTraceback: x"  # an error: at once
