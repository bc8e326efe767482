"""Start a real ``shardlm serve`` process on 127.0.0.1 (a free port) and read its metrics."""

from __future__ import annotations

import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness.cli import BIN


class ServerProcess:
    """``shardlm serve --port 0 ARGS``; waits for the ``serving ... on URL`` line (or fails with the log)."""

    def __init__(self, *args: str, start_timeout: float = 300):
        self.proc = subprocess.Popen(
            [str(BIN / "shardlm"), "serve", "--port", "0", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        ready = threading.Event()

        def drain() -> None:  # keep reading, so the server never blocks on a full pipe
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                if m := re.search(r"serving \S+ on (http://\S+/v1)", line):
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(start_timeout) or self.url is None:
            self.kill()
            raise RuntimeError(f"shardlm serve did not come up in {start_timeout:.0f} s:\n{self.log}")
        self.ranks = self.rank_pids()

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    def rank_pids(self) -> list[int]:
        """The server's rank processes (its ``python -m shardlm.launch`` children)."""
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid), "-f", "shardlm.launch"], capture_output=True, text=True
        ).stdout
        return sorted(int(p) for p in out.split())

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def get(url: str, timeout: float = 30) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(root: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments dropped)."""
    status, text = get(f"{root}/metrics")
    assert status == 200, text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
