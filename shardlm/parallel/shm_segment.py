"""One shared-memory segment per process group of one host, and the round protocol on it.

Layout (every rank maps the same file; offsets in bytes)::

    [64 j, 64 j + 64)           rank j's control line: seq, abort, sleeping, then 5 words of the
                                global ranks it found lost (a bit a rank, ranks < 315) (int64 each)
    [hdr + (2 j + p) C, +C)     rank j's slot for parity p (C = slot_bytes, page-aligned)

A collective is a sequence of *rounds*. In round s a rank writes its part into its own
slot of parity s % 2, *publishes* s in its control line, and *waits* until every peer
has published s; then it reads its peers' slots of that parity. The rule that makes
reuse safe: a round's slots are read only after that round's wait and before the
reader publishes s + 1. A rank writes a slot of parity p again in round s + 2, after
its wait in round s + 1 saw every peer publish s + 1, so every read of round s is over.
No data can be stale: a slot is read only after its writer published the round it
wrote it for, and its writer cannot move past s + 1 while a reader is still in s.

Memory ordering: a publish is a plain aligned 8-byte store after the payload stores
(made by a torch kernel that returned before it); a wait reads the flags, then the
payload. This relies on x86-64 TSO: stores become visible in program order, loads are
not reordered with older loads, and the locked instructions of OpenMP's barriers order
the stores of torch's worker threads before the publishing thread's flag (glibc's
non-temporal memcpy ends with ``sfence``). Weakly ordered CPUs (aarch64, POWER) would
need release/acquire fences that Python cannot issue: there the path is off (gloo).

Waiting: spin briefly (a peer on another core arrives within microseconds), then
sleep on this rank's wake socket (an abstract-namespace Unix datagram socket, gone
with the process). Before sleeping a rank sets its ``sleeping`` word, issues a full
fence and checks the flags again; a publisher stores its flag, fences, and sends a
datagram to every peer whose ``sleeping`` word is set. With a fence on both sides
(Dekker's pattern) one of them always sees the other: no wake-up is lost. The fence is
an uncontended CPython lock acquire/release, a locked instruction on x86. So ranks that
outnumber the cores block in the kernel instead of spinning against each other. (No
``sched_yield`` phase between the two: it hands the core to another process for a whole time
slice, while a woken sleeper is scheduled at once; docs/performance.md, "Fast collectives".)

Every 50 ms of waiting a rank checks that the ranks it waits for are alive (``/proc/PID/stat``:
gone, zombie or a reused pid is dead), whether a peer gave up (its abort flag: one that set it and
exited since is reported by its reason, not as dead), and the group's timeout: a dead peer gives
an error that names it. A rank that ends on a lost peer
elsewhere (another host's, over gloo) gives up on its groups here first (``give_up_everywhere``),
with the global ranks it found lost, so that a peer waiting for it names the lost host too, not
the local rank that exited.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import threading
import time
import weakref

import torch

from shardlm.errors import PeerLost

LINE = 64  # bytes per control line: no two ranks' flags share a cache line
PAGE = 4096
_fence_lock = threading.Lock()


class CollectiveError(RuntimeError):
    """A collective on the shared-memory path failed or was misused."""


class PeerFailure(CollectiveError, PeerLost):
    """A peer of the group died, gave up or timed out: the message says which; the run cannot go on.
    ``lost``: the global ranks a peer that gave up had found lost ([] when it did not say)."""

    def __init__(self, message: str, lost: list[int] | None = None):
        super().__init__(message)
        self.lost = lost or []


LOST_WORDS, LOST_BITS = 5, 63
"""Words of a control line (after seq, abort, sleeping) that carry the global ranks its rank found
lost, 63 bits a signed word: ranks 0-314; a larger one is left out (a peer reads a plain give-up
where none is left)."""
_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's mapped segments (give_up_everywhere)


def give_up_everywhere(lost: list[int]) -> None:
    """Mark every shared-memory group of this process given up, with the global ranks ``lost`` it
    found lost elsewhere (a host gone): its peers, waiting on it here, then name those ranks
    instead of this one when it exits (``Segment._check``)."""
    for seg in list(_LIVE):
        seg.give_up(lost)


def fence() -> None:
    """A full memory barrier on x86: CPython's lock is taken with a locked instruction."""
    _fence_lock.acquire()
    _fence_lock.release()


def start_time(pid: int) -> int | None:
    """Start time of a live process in clock ticks since boot; None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # fields 3.. (the name may hold spaces)
    return None if fields[0] in (b"Z", b"X", b"x") else int(fields[19])


def header_bytes(n: int) -> int:
    return -(-n * LINE // PAGE) * PAGE


def wake_address(name: str, j: int) -> bytes:
    """Rank j's wake socket: Linux abstract namespace (leading NUL), nothing on disk."""
    return b"\0" + f"{os.path.basename(name)}-wake{j}".encode()


class Segment:
    """This rank's mapping of its group's segment, and the publish/wait of rounds."""

    def __init__(
        self,
        mm: mmap.mmap,
        *,
        n: int,
        rank: int,
        slot_bytes: int,
        peers: list[tuple[int, int, int]],
        timeout_s: float,
        name: str,
        wake: socket.socket,
    ):
        self.n, self.rank, self.slot_bytes, self.name = n, rank, slot_bytes, name
        self.peers = peers  # per group rank: (global rank, pid, start time)
        self.timeout_s = timeout_s
        self.wake = wake
        self.addresses = [wake_address(name, j) for j in range(n)]
        self.ctl = memoryview(mm).cast("q")  # int64 words: rank j's seq at 8 j, abort 8 j + 1, sleeping 8 j + 2
        # never inference tensors, even when the first collective runs under inference_mode: a
        # later collective in a backward pass writes into them, which torch forbids for those
        with torch.inference_mode(False):
            self.mem = torch.frombuffer(mm, dtype=torch.uint8)  # [bytes]
            hdr = header_bytes(n)
            self.slots = [
                [self.mem[hdr + (2 * j + p) * slot_bytes : hdr + (2 * j + p + 1) * slot_bytes] for p in (0, 1)]
                for j in range(n)
            ]
        self.others = [8 * j for j in range(n) if j != rank]
        cores = len(os.sched_getaffinity(0))
        self.spin_s = 30e-6 if n <= cores else 2e-6  # spinning steals a core a peer may need
        self.broken: str | None = None
        _LIVE.add(self)

    def publish(self, seq: int) -> None:
        ctl = self.ctl
        ctl[8 * self.rank] = seq
        fence()  # the flag store before the loads of the sleeping words (see the module doc)
        for i in self.others:
            if ctl[i + 2]:
                self._poke(i // 8)

    def _poke(self, j: int) -> None:
        try:
            self.wake.sendto(b"", socket.MSG_DONTWAIT, self.addresses[j])
        except OSError:  # its queue is full (it has wake-ups waiting already) or it is gone
            pass

    def wait(self, seq: int, op: str) -> None:
        """Return once every peer has published ``seq``; raise CollectiveError if one cannot."""
        ctl = self.ctl
        for i in self.others:
            if ctl[i] < seq:
                return self._wait_slow(seq, op)
        return None

    def _wait_slow(self, seq: int, op: str) -> None:
        ctl, me = self.ctl, 8 * self.rank
        start = time.perf_counter()
        spin_until, check_at = start + self.spin_s, start + 0.05
        pending = self.others
        while time.perf_counter() < spin_until:
            pending = [i for i in pending if ctl[i] < seq]
            if not pending:
                return
        try:
            while True:
                ctl[me + 2] = seq  # "sleeping": publishers will poke this rank
                fence()
                pending = [i for i in pending if ctl[i] < seq]
                if not pending:
                    return
                now = time.perf_counter()
                if now >= check_at:
                    check_at = now + 0.05
                    self._check(pending, seq, op, now - start)
                if select.select([self.wake], [], [], max(0.0, check_at - now))[0]:
                    self._drain()
        finally:
            ctl[me + 2] = 0

    def _drain(self) -> None:
        try:
            while True:
                self.wake.recv(16, socket.MSG_DONTWAIT)
        except OSError:
            pass

    def _check(self, pending: list[int], seq: int, op: str, waited: float) -> None:
        """Raise if a pending peer died without giving up (the cause), if a peer gave up (it may have
        exited since: its reason, not its death), or after the group's timeout."""
        for i in pending:
            j = i // 8
            if not self.ctl[i + 1] and start_time(self.peers[j][1]) != self.peers[j][2]:
                self.fail(
                    f"{op}: group rank {j} ({self._who(j)}) died while this rank waited for it "
                    f"(call {seq} on this group, after {waited:.2f} s); the run cannot go on, stop it"
                )
        for j in range(self.n):
            if j != self.rank and self.ctl[8 * j + 1]:
                lost = self._lost(j)
                why = f"found global ranks {lost} lost" if lost else "had an error of its own"
                self.fail(
                    f"{op}: group rank {j} ({self._who(j)}) {why} and gave up on this group; see that rank's error",
                    lost,
                )
        if waited > self.timeout_s:
            late = ", ".join(f"group rank {i // 8} ({self._who(i // 8)})" for i in pending)
            self.fail(
                f"{op}: {late} did not reach call {seq} on this group within the group's timeout of "
                f"{self.timeout_s:.0f} s; it is alive but stuck or busy elsewhere (raise the timeout, "
                f"e.g. --timeout, if it is only slow)"
            )

    def _who(self, j: int) -> str:
        rank, pid, _ = self.peers[j]
        return f"global rank {rank}, pid {pid}"

    def _lost(self, j: int) -> list[int]:
        """The global ranks group rank ``j`` found lost when it gave up (its control line)."""
        base = 8 * j + 3
        return [LOST_BITS * w + b for w in range(LOST_WORDS) for b in range(LOST_BITS) if (self.ctl[base + w] >> b) & 1]

    def give_up(self, lost: list[int] | None = None) -> None:
        """Mark the group unusable and tell the peers (abort flag and a wake-up), with the global
        ranks this rank found lost elsewhere."""
        base = 8 * self.rank + 3
        for r in lost or []:
            if r < LOST_BITS * LOST_WORDS:
                self.ctl[base + r // LOST_BITS] |= 1 << (r % LOST_BITS)
        self.ctl[8 * self.rank + 1] = 1
        fence()  # the lost ranks and the flag before the wake-ups
        for i in self.others:
            self._poke(i // 8)

    def fail(self, msg: str, lost: list[int] | None = None) -> None:
        """Mark the group unusable, tell the peers, raise."""
        self.broken = msg
        self.give_up(lost)
        raise PeerFailure(f"shared-memory collective failed: {msg}", lost)
