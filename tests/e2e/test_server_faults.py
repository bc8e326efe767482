"""`shardlm serve` under faults: a full queue (429), a killed rank (errors, 503, clean exit), bad flags."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

import openai
import pytest

from harness.cli import main_exit
from harness.server_harness import BIN, ServerProcess, alive, get, wait_for


def serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "shardlm"), "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.slow  # ~7 s
def test_a_busy_port_fails_at_once_with_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        start = time.monotonic()
        r = serve("--port", str(port))
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port 0" in r.stderr
    assert "Traceback" not in r.stderr and "loading" not in r.stderr  # refused before any rank started
    assert time.monotonic() - start < 60


def test_a_busy_port_is_refused_before_any_rank_starts(capsys):
    """The same refusal as the real command's above, by ``main`` in this process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        code, err = main_exit(["serve", "--port", str(port)], capsys)
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "--port 0" in err, err
    assert "Traceback" not in err and "loading" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp", "10"], "tp=10 is larger than the model's 9 attention heads"),
        (["--max-queue", "0"], "--max-queue 0 must be at least 1"),
        (["--kv-cache-memory", "lots"], "is not a size"),
        (["--prefill-replicas", "1"], "prefill_replicas=1 must leave at least one of the dp=1 replicas to decode"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args, message, capsys):
    """Refused before any rank starts, by the command's own ``main`` in this process (the real
    command is run once, by test_a_busy_port_fails_at_once_with_exit_2)."""
    code, err = main_exit(["serve", "--port", "0", *args], capsys)
    assert code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.slow
def test_queue_full_then_a_killed_rank_fails_requests_and_exits_cleanly():
    """tp=2, --max-queue 1: a second request gets 429. Then rank 1 is killed mid-stream: the stream ends
    with an error event, /health and new requests answer 503, and the server exits 1 with the reason
    after --grace seconds, its rank processes gone."""
    server = ServerProcess(
        "--tp",
        "2",
        "--threads",
        "1",
        "--max-queue",
        "1",
        "--grace",
        "5",
        "--kv-cache-memory",
        "128MiB",
        "--max-model-len",
        "1024",
    )
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        assert len(server.ranks) == 2 and all(alive(p) for p in server.ranks)
        stream = client.completions.create(
            model="smollm2",
            prompt="Once upon a time",
            max_tokens=900,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        it = iter(stream)
        got = [next(it).choices[0].text for _ in range(3)]  # tp=2 serves
        with pytest.raises(openai.RateLimitError) as full:
            client.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
        assert full.value.status_code == 429 and "max_queue=1" in full.value.message

        os.kill(server.ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError) as failed:
            for chunk in it:
                got.append(chunk.choices[0].text)
        assert time.monotonic() - killed < 60
        # rank 1's death, also where rank 0's report that its peer died reaches the driver first
        # (the driver waits for the lost peer's own: launch.LocalRanks.cause)
        died = r"rank 1 died \(killed by SIGKILL\)"
        assert re.search(died, str(failed.value)), failed.value
        assert len(got) < 900

        status, body = get(f"{server.root}/health")
        assert status == 503 and "rank 1" in body
        with pytest.raises(openai.InternalServerError) as dead:
            client.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
        assert dead.value.status_code == 503
        code = server.wait(timeout=60)
        assert code == 1, server.log
        assert re.search(died, server.log) and "the server stopped (all ranks ended)" in server.log
        assert "Traceback" not in server.log
        wait_for(lambda: not any(alive(p) for p in server.ranks), 10, "the rank processes to end")
    finally:
        server.kill()
