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
    "error, traced",
    [
        (PeerFailure("shared-memory collective failed: all_reduce: group rank 1 (global rank 1, pid 7) died"), False),
        (RuntimeError("[pair.cc:553] Connection closed by peer [192.0.2.2]:28855."), False),
        (ValueError("a bug"), True),
    ],
)
def test_a_rank_reports_a_lost_peer_in_one_line_and_anything_else_with_its_traceback(monkeypatch, error, traced):
    """obey: the driver prints what a rank sends; a traceback of the collective that saw a peer die is noise."""
    monkeypatch.setattr(launch, "HOSTS", [])
    ours, theirs = Pipe()
    theirs.send(("step", None))
    with pytest.raises(type(error)):
        launch.obey(launch.DriverLink(ours), _Failing(error), rank=0)
    assert theirs.recv() == ("ready", None)
    kind, report = theirs.recv()
    assert kind == "error" and ("Traceback" in report) == traced
    assert ("a bug" if traced else ("died" if isinstance(error, PeerFailure) else "lost the peer")) in report
