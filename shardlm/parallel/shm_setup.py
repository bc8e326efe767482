"""Setting up a group's shared-memory segment: who can use it, creating, mapping, unlinking.

Collective over the group (gloo, CPU tensors), once per group:

1. group rank 0 sweeps segments left by dead creators, creates ``/dev/shm/shardlm-PID-RANDOM``
   (mode 0600, ``O_EXCL``) and reserves its pages with ``posix_fallocate``, so a full
   /dev/shm fails here instead of with SIGBUS later; it broadcasts the name;
2. every rank maps it and binds its wake socket; all ranks exchange (mapped?, pid, start
   time, boot id); group rank 0 unlinks the file: from here on nothing is left on disk,
   whatever happens to the ranks (the mappings live until the processes exit);
3. every rank checks what it can see: all mapped, one boot id, each peer's pid alive with
   the start time it reported (one pid namespace, so a dead peer can be detected), and
   each peer's wake socket reachable (one network namespace); the verdict is the
   minimum over ranks, so all ranks agree: everyone uses the segment, or nobody.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import socket

import torch
import torch.distributed as dist

from shardlm.parallel.dims import group_timeout
from shardlm.parallel.shm_segment import Segment, header_bytes, start_time, wake_address

SHM_DIR = "/dev/shm"
PREFIX = "shardlm-"
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def why_not_here() -> str | None:
    """None when this host can run the shared-memory path, else the reason it cannot."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return (
            f"the shared-memory path relies on x86-64 store ordering (TSO); this host is "
            f"{platform.machine()}, so collectives stay on gloo"
        )
    if not os.path.isdir(SHM_DIR) or not os.path.isdir("/proc/self"):
        return f"no {SHM_DIR} or /proc on this host (Linux only), so collectives stay on gloo"
    return None


def boot_id() -> int:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return int(f.read().strip().replace("-", ""), 16) & ((1 << 62) - 1)
    except (OSError, ValueError):
        return 0


def sweep_stale() -> None:
    """Unlink segments whose creator died between creating and unlinking one (ours only)."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            if start_time(int(name.split("-")[1])) is None and os.stat(path).st_uid == os.getuid():
                os.unlink(path)
        except (ValueError, IndexError, OSError):
            pass


def _create(size: int) -> str:
    """A new reserved segment file of `size` bytes; its path, or "" if it cannot be made."""
    sweep_stale()
    path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return ""
    try:
        os.posix_fallocate(fd, 0, size)
        return path
    except OSError:
        os.unlink(path)
        return ""
    finally:
        os.close(fd)


def _map(path: str, size: int) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _bind(path: str, rank: int) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.bind(wake_address(path, rank))
        return s
    except OSError:
        s.close()
        return None


def open_segment(group: dist.ProcessGroup, slot_bytes: int) -> tuple[Segment | None, str]:
    """(segment, "") if every rank of the group can use one, else (None, why) on every rank."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    size = header_bytes(n) + 2 * n * slot_bytes
    local_ok = why_not_here() is None
    path = _create(size) if rank == 0 and local_ok else ""
    buf = torch.zeros(256, dtype=torch.uint8)
    buf[: len(path)] = torch.tensor(list(path.encode()), dtype=torch.uint8)
    dist.broadcast(buf, group_src=0, group=group)
    path = bytes(buf.tolist()).rstrip(b"\0").decode()
    mm = _map(path, size) if path and local_ok else None
    wake = _bind(path, rank) if mm is not None else None
    info = torch.tensor([int(wake is not None), os.getpid(), start_time(os.getpid()) or 0, boot_id()])
    everyone = info.new_empty(4 * n)
    _all_gather(everyone, info, group=group)
    if rank == 0 and path:
        os.unlink(path)  # every rank has tried to map it; the mappings keep it alive until exit
    rows = everyone.view(n, 4).tolist()
    peers = [(r, pid, started) for r, (_, pid, started, _) in zip(dist.get_process_group_ranks(group), rows)]
    why = ""
    if not all(r[0] for r in rows):
        why = f"group ranks {[j for j, r in enumerate(rows) if not r[0]]} could not map {path or 'a segment'}"
    elif len({r[3] for r in rows}) > 1:
        why = "the group's ranks run on different hosts"
    elif any(start_time(pid) != started for _, pid, started in peers):
        why = "the group's ranks do not share a pid namespace, so a dead peer could not be detected"
    else:
        assert wake is not None  # this rank mapped the segment and bound its socket (rows[rank][0])
        try:
            for j in range(n):
                wake.sendto(b"", socket.MSG_DONTWAIT, wake_address(path, j))
        except OSError:
            why = "the group's ranks do not share a network namespace (wake sockets unreachable)"
    verdict = torch.tensor([0 if why else 1])
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
    if not verdict.item():
        if wake is not None:
            wake.close()
        return None, why or why_not_here() or "another rank of the group cannot use shared memory"
    assert mm is not None and wake is not None  # every rank mapped and bound (the verdict)
    seg = Segment(
        mm, n=n, rank=rank, slot_bytes=slot_bytes, peers=peers, timeout_s=group_timeout(group), name=path, wake=wake
    )
    seg._drain()  # the test datagrams
    return seg, ""
