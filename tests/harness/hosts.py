"""Two "hosts" on this machine: network + UTS + mount namespaces joined by a veth pair.

Each host is a network namespace (its own interfaces and ports) holding one end of a veth pair,
addressed from 192.0.2.0/24 (TEST-NET-1, RFC 5737: documentation only, never routed), and every
command runs there in a fresh UTS namespace (its own hostname) and mount namespace (its own
/dev/shm tmpfs, and an /etc/hosts that names both hosts, which torchrun's rendezvous resolves).
So processes on host A cannot see host B's shared memory or reach its loopback: what two real
machines would not share, these do not either. They still share one kernel, one pid space and
one boot id, which is what a host identity must not rely on.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN); ``TwoHosts.available()`` says why not where it cannot.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ADDRESSES = {"A": "192.0.2.1", "B": "192.0.2.2"}
BIN = Path(sys.executable).parent


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class TwoHosts:
    """Host "A" and host "B" (``hostname`` shardlm-a / shardlm-b); ``start(host, argv)`` runs a
    command on one of them. ``close()`` kills what runs there and removes both namespaces."""

    def __init__(self, directory: Path):
        tag = f"{os.getpid() % 100000}"
        self.ns = {h: f"shlm{h.lower()}{tag}" for h in ADDRESSES}
        self.dev = {h: f"shlm{h.lower()}{tag}v" for h in ADDRESSES}
        self.hostname = {h: f"shardlm-{h.lower()}" for h in ADDRESSES}
        self.hosts_file = directory / "hosts"
        self.hosts_file.write_text(
            "127.0.0.1 localhost\n" + "".join(f"{ADDRESSES[h]} {self.hostname[h]}\n" for h in ADDRESSES)
        )
        self.procs: list[subprocess.Popen] = []
        try:
            for h in ADDRESSES:
                _ip("netns", "add", self.ns[h])
            _ip("link", "add", self.dev["A"], "type", "veth", "peer", "name", self.dev["B"])
            for h, addr in ADDRESSES.items():
                _ip("link", "set", self.dev[h], "netns", self.ns[h])
                _ip("-n", self.ns[h], "addr", "add", f"{addr}/24", "dev", self.dev[h])
                _ip("-n", self.ns[h], "link", "set", self.dev[h], "up")
                _ip("-n", self.ns[h], "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def available() -> str | None:
        """None when namespaces can be made here, else why not (a skip reason)."""
        probe = f"shlmprobe{os.getpid() % 100000}"
        try:
            r = _ip("netns", "add", probe, check=False)
        except FileNotFoundError:
            return "no `ip` command (iproute2) to make network namespaces"
        if r.returncode:
            return f"cannot make a network namespace here ({r.stderr.strip()}): needs root / CAP_NET_ADMIN"
        _ip("netns", "del", probe, check=False)
        return None

    def start(self, host: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """Run ``argv`` on ``host`` (stdout and stderr captured as text)."""
        env = {**os.environ, "GLOO_SOCKET_IFNAME": self.dev[host], **(env or {})}
        setup = (
            f"mount -t tmpfs none /dev/shm && mount --bind {shlex.quote(str(self.hosts_file))} /etc/hosts "
            f"&& hostname {self.hostname[host]} && exec {shlex.join(argv)}"
        )
        cmd = ["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "--mount", "--propagation", "private"]
        proc = subprocess.Popen(
            [*cmd, "sh", "-c", setup], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.procs.append(proc)
        return proc

    def torchrun(
        self, host: str, nproc: int, args: list[str], port: int = 29555, entry: tuple = ("-m", "shardlm.cli"), **kw
    ) -> subprocess.Popen:
        """``shardlm ARGS`` (or ``entry``: a script) under torchrun, one node of two, the rendezvous on host A."""
        return self.start(
            host,
            [
                str(BIN / "torchrun"),
                "--nnodes", "2", "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDRESSES['A']}:{port}", "--rdzv-id", "shardlm-test",
                *entry, *args,
            ],
            **kw,
        )  # fmt: skip

    def pids(self, host: str) -> list[int]:
        """Every process running in ``host``'s network namespace."""
        out = _ip("netns", "pids", self.ns[host], check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self, host: str) -> None:
        """SIGKILL every process of ``host``: the machine is gone."""
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def unplug(self) -> None:
        """Take the link down on both sides: a network partition (processes keep running)."""
        for h in ADDRESSES:
            _ip("-n", self.ns[h], "link", "set", self.dev[h], "down", check=False)

    def plug(self) -> None:
        """Bring the link back up after ``unplug``."""
        for h in ADDRESSES:
            _ip("-n", self.ns[h], "link", "set", self.dev[h], "up", check=False)

    def close(self) -> None:
        for h in ADDRESSES:
            self.kill(h)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while any(self.pids(h) for h in ADDRESSES) and time.monotonic() < deadline:
            time.sleep(0.1)
        for h in ADDRESSES:
            _ip("netns", "del", self.ns[h], check=False)  # also removes the veth pair


def report(out: dict[str, tuple[int, str, str]]) -> str:
    """Each host's exit status and the end of its stderr: an assertion's message (pytest cuts the
    repr of the whole dict in the middle, where the first failure usually is)."""
    return "\n".join(f"host {h}: exit {code}\n{err[-3000:]}" for h, (code, _, err) in out.items())


def both(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, tuple[int, str, str]]:
    """Wait for a command started on both hosts: {host: (exit status, stdout, stderr)}."""
    out = {}
    deadline = time.monotonic() + timeout
    for h, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            stderr += f"\n[test harness: killed after {timeout:.0f} s]"
        out[h] = (p.returncode, stdout, stderr)
    return out
