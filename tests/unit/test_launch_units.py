"""launch.peer_failure: gloo's errors for a lost peer become one line naming the host and ranks."""

from __future__ import annotations

import pytest

from shardlm import launch


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
