"""Fast collectives for the CPU ranks of one host, over a shared-memory segment.

``route(group)`` gives the group's ``ShmGroup`` (set up on first use, collectively) or
None (keep gloo); ``collectives.py`` calls it, so every caller of ``comm`` gets the fast
path without asking. It is chosen when every rank of the group is a CPU process of this
host (x86-64 Linux, see ``shm_segment``); ``set_backend(group, "gloo")`` or the
environment variable ``SHARDLM_SHM=0`` (read when a group is first used) keep gloo.

Algorithms (rounds, see ``shm_segment``), every one summing ranks in order 0..n-1 with a
float32 accumulator for 16-bit floats, so all ranks get bitwise the same result and the
two all-reduce algorithms agree bit for bit:

* all-reduce, 2 ranks or small: each rank writes its input, then sums every slot (1 round);
* all-reduce, 3+ ranks and large: reduce-scatter then all-gather (2 rounds per slot-sized
  piece; each rank reads ~(2 + 1/n) x instead of n x the message);
* all-gather / broadcast / all-to-all: write, then copy what is addressed to this rank;
* reduce-scatter: write, then sum this rank's range.

Messages larger than a slot go in slot-sized pieces, one round (or two) each.
"""

from __future__ import annotations

import logging
import os
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from shardlm.parallel.shm_segment import CollectiveError, PeerFailure, Segment
from shardlm.parallel.shm_setup import open_segment

__all__ = ["REDUCIBLE", "CollectiveError", "PeerFailure", "ShmGroup", "route", "set_backend"]

SEGMENT_BYTES = 16 << 20  # per group: slots of 4 MiB at 2 ranks, 2 MiB at 4, 1 MiB at 8 (min 256 KiB)
SMALL_BYTES = 64 << 10  # all-reduce below this (or on 2 ranks) reads every slot in one round
REDUCIBLE = {
    torch.float32: torch.float32,
    torch.float64: torch.float64,
    torch.bfloat16: torch.float32,
    torch.float16: torch.float32,
    torch.int32: torch.int32,
    torch.int64: torch.int64,
}
"""dtype -> accumulator dtype of the sums this path does (others go to gloo)."""


class ShmGroup:
    """The fast path of one process group; every method is collective over the group."""

    def __init__(self, seg: Segment):
        self.seg, self.n, self.rank = seg, seg.n, seg.rank
        self.seq = 0
        self._typed: dict[tuple[int, int, torch.dtype], Tensor] = {}
        self._views: dict[tuple[int, int, torch.dtype, int], Tensor] = {}
        self._pending = False

    # ---- rounds ---------------------------------------------------------------------
    def _slot(self, j: int, parity: int, dtype: torch.dtype) -> Tensor:
        key = (j, parity, dtype)
        t = self._typed.get(key)
        if t is None:
            with torch.inference_mode(False):  # see Segment: usable by inference and autograd alike
                t = self._typed[key] = self.seg.slots[j][parity].view(dtype)
        return t

    def _view(self, j: int, parity: int, dtype: torch.dtype, k: int) -> Tensor:
        """The first k elements of a slot, cached: slicing costs more than a small copy here."""
        key = (j, parity, dtype, k)
        t = self._views.get(key)
        if t is None:
            if len(self._views) > 512:  # message sizes vary (prefill lengths): stay bounded
                self._views.clear()
            with torch.inference_mode(False):
                t = self._views[key] = self._slot(j, parity, dtype)[:k]
        return t

    def _round(self, op: str) -> int:
        """Publish the next round and wait for every peer to reach it; returns its parity."""
        if self._pending:
            raise CollectiveError(
                f"{op} while an all_reduce_start on this group is not yet waited on; "
                f"call its wait() first (one outstanding call per group)"
            )
        if self.seg.broken:
            raise PeerFailure(
                f"this group's shared-memory path failed earlier ({self.seg.broken}); the group cannot be used again"
            )
        s = self.seq = self.seq + 1
        self.seg.publish(s)
        self.seg.wait(s, op)
        return s & 1

    def _mine(self, dtype: torch.dtype) -> Tensor:
        """This rank's slot for the next round (written before ``_round``)."""
        return self._slot(self.rank, (self.seq + 1) & 1, dtype)

    def _small_all_reduce(self, flat: Tensor) -> None:
        """One round: write, then sum every slot (two ranks: add the peer's; a + b == b + a)."""
        k, dt, n = flat.numel(), flat.dtype, self.n
        self._view(self.rank, (self.seq + 1) & 1, dt, k).copy_(flat)
        p = self._round("all_reduce")
        if n == 2:
            flat.add_(self._view(1 - self.rank, p, dt, k))
        else:
            self._sum(flat, [self._view(j, p, dt, k) for j in range(n)])

    # ---- reductions -----------------------------------------------------------------
    def _sum(self, out: Tensor, parts: list[Tensor]) -> None:
        """out = parts[0] + ... + parts[-1], in rank order, accumulated as REDUCIBLE says."""
        acc = REDUCIBLE[out.dtype]
        if len(parts) == 2 or acc == out.dtype:  # two 16-bit values: one rounding either way
            torch.add(parts[0], parts[1], out=out)
            for p in parts[2:]:
                out.add_(p)
        else:
            tmp = parts[0].to(acc)
            for p in parts[1:]:
                tmp.add_(p)
            out.copy_(tmp)

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum over ranks, in place on contiguous CPU x."""
        flat, n = x if x.dim() == 1 else x.view(-1), self.n
        total, dt = flat.numel(), x.dtype
        per = self.seg.slot_bytes // x.element_size()
        if total <= per and (n == 2 or total * x.element_size() <= SMALL_BYTES):
            self._small_all_reduce(flat)
            return x
        if n == 2 or total * x.element_size() <= SMALL_BYTES:
            for a in range(0, total, per):
                self._small_all_reduce(flat[a : a + per])
            return x
        for a in range(0, total, per):  # reduce-scatter + all-gather per piece
            piece = flat[a : a + per]
            k = piece.numel()
            bounds = _bounds(k, n)
            self._mine(dt)[:k].copy_(piece)
            p = self._round("all_reduce")
            lo, hi = bounds[self.rank], bounds[self.rank + 1]
            self._sum(self._slot(self.rank, 1 - p, dt)[lo:hi], [self._slot(j, p, dt)[lo:hi] for j in range(n)])
            q = self._round("all_reduce")
            for j in range(n):
                piece[bounds[j] : bounds[j + 1]].copy_(self._slot(j, q, dt)[bounds[j] : bounds[j + 1]])
        return x

    def all_reduce_start(self, x: Tensor):
        """Start a sum of contiguous x (at most one slot): write and publish now; the returned
        ``wait()`` waits for the peers and sums into x. Work done in between overlaps with
        the peers' arrival. One outstanding call per group: wait before the next collective."""
        if self._pending or x.numel() * x.element_size() > self.seg.slot_bytes:
            raise CollectiveError(
                "all_reduce_start: one outstanding call per group, of at most "
                f"{self.seg.slot_bytes} bytes; wait() the previous one or use all_reduce"
            )
        flat, dt = x.view(-1), x.dtype
        k = flat.numel()
        self._view(self.rank, (self.seq + 1) & 1, dt, k).copy_(flat)
        s = self.seq = self.seq + 1
        self.seg.publish(s)
        self._pending = True

        def wait() -> Tensor:
            self._pending = False
            self.seg.wait(s, "all_reduce")
            p = s & 1
            self._sum(flat, [self._view(j, p, dt, k) for j in range(self.n)])
            return x

        return wait

    def reduce_scatter(self, x: Tensor, out: Tensor, sizes: list[int]) -> Tensor:
        """out = this rank's range (sizes, in elements) of the sum of every rank's flat x."""
        flat, dt = x.view(-1), x.dtype
        per = self.seg.slot_bytes // x.element_size()
        starts = [sum(sizes[:j]) for j in range(self.n)]
        lo, hi = starts[self.rank], starts[self.rank] + sizes[self.rank]
        for a in range(0, max(flat.numel(), 1), per):
            b = min(a + per, flat.numel())
            self._mine(dt)[: b - a].copy_(flat[a:b])
            p = self._round("reduce_scatter")
            s, e = max(lo, a), min(hi, b)
            if s < e:
                self._sum(out.view(-1)[s - lo : e - lo], [self._slot(j, p, dt)[s - a : e - a] for j in range(self.n)])
        return out

    # ---- data movement (bytes) ---------------------------------------------------------
    def all_gather(self, src: Tensor, out: Tensor, counts: list[int]) -> Tensor:
        """out (uint8) = every rank's src (uint8, counts[j] bytes) back to back, in rank order."""
        offs = [sum(counts[:j]) for j in range(self.n)]
        out[offs[self.rank] : offs[self.rank] + counts[self.rank]].copy_(src)
        C = self.seg.slot_bytes
        for a in range(0, max(max(counts), 1), C):
            mine = src[a : a + C]
            self._mine(torch.uint8)[: mine.numel()].copy_(mine)
            p = self._round("all_gather")
            for j in range(self.n):
                k = min(C, counts[j] - a)
                if j != self.rank and k > 0:
                    out[offs[j] + a : offs[j] + a + k].copy_(self._slot(j, p, torch.uint8)[:k])
        return out

    def broadcast(self, buf: Tensor, src: int) -> Tensor:
        """Every rank's buf (uint8) becomes rank src's."""
        C = self.seg.slot_bytes
        for a in range(0, max(buf.numel(), 1), C):
            piece = buf[a : a + C]
            if self.rank == src:
                self._mine(torch.uint8)[: piece.numel()].copy_(piece)
            p = self._round("broadcast")
            if self.rank != src:
                piece.copy_(self._slot(src, p, torch.uint8)[: piece.numel()])
        return buf

    def all_to_all(self, src: Tensor, out: Tensor, send: list[int], recv: list[int]) -> Tensor:
        """Rank i's bytes [sum(send[:j]), +send[j]) of src land in rank j's out after those of ranks < i.

        Each round carries a header (this rank's send counts) and the next slot's worth of
        src; rounds go on until every rank's src is through (all ranks read every header)."""
        n, me = self.n, self.rank
        hdr = 8 * (n + 1)
        C = self.seg.slot_bytes - hdr
        roff = [sum(recv[:j]) for j in range(n)]
        counts = torch.tensor([*send, src.numel()], dtype=torch.int64).view(torch.uint8)
        a, more = 0, True
        while more:
            mine = self._mine(torch.uint8)
            mine[:hdr].copy_(counts)
            mine[hdr : hdr + max(0, min(C, src.numel() - a))].copy_(src[a : a + C])
            p = self._round("all_to_all")
            more = False
            for j in range(n):
                slot = self._slot(j, p, torch.uint8)
                theirs = slot[:hdr].view(torch.int64).tolist()  # [send counts of rank j..., its total]
                more |= theirs[n] > a + C
                lo = sum(theirs[:me])  # where rank j's bytes for this rank start in its src
                s, e = max(lo, a), min(lo + theirs[me], a + C)
                if s < e:
                    out[roff[j] + s - lo : roff[j] + e - lo].copy_(slot[hdr + s - a : hdr + e - a])
            a += C
        return out


def slot_bytes(n: int) -> int:
    """Bytes per rank and parity for an n-rank group: larger slots mean fewer rounds for a large
    message (each round needs every rank on a core), within SEGMENT_BYTES of /dev/shm per group."""
    return max(256 << 10, min(4 << 20, SEGMENT_BYTES // (2 * n) // 4096 * 4096))


def _bounds(k: int, n: int) -> list[int]:
    """n + 1 cut points splitting k elements as evenly as possible."""
    q, r = divmod(k, n)
    cuts = [0]
    for j in range(n):
        cuts.append(cuts[-1] + q + (j < r))
    return cuts


# ---- which groups use it ---------------------------------------------------------------------
LOG = logging.getLogger("shardlm.shm")
_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ProcessGroup -> ShmGroup | None
_policy: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ProcessGroup -> "auto" | "shm" | "gloo"
why_not: dict[int, str] = {}
"""id(group) -> why the last set-up of that group kept gloo (for the benchmark and errors)."""


def route(group: dist.ProcessGroup) -> ShmGroup | None:
    """The group's fast path, or None for gloo. The first call on a group is collective."""
    try:
        return _groups[group]
    except KeyError:
        pass
    return _setup(group, _policy.get(group, "auto"), None)


def _setup(group: dist.ProcessGroup, policy: str, slot: int | None) -> ShmGroup | None:
    fast = None
    if policy != "gloo" and (policy == "shm" or os.environ.get("SHARDLM_SHM", "1") != "0"):
        if "gloo" not in str(dist.get_backend(group)):
            why_not[id(group)] = f"the group's backend is {dist.get_backend(group)}, not gloo"
        else:
            seg, why = open_segment(group, slot or slot_bytes(dist.get_world_size(group)))
            fast = ShmGroup(seg) if seg is not None else None
            if why:
                why_not[id(group)] = why
    _groups[group] = fast
    LOG.debug(
        "collectives of ranks %s: %s",
        dist.get_process_group_ranks(group),
        "shared memory" if fast is not None else f"gloo ({why_not.get(id(group), 'turned off')})",
    )
    return fast


def set_backend(group: dist.ProcessGroup, backend: str, *, slot: int | None = None) -> ShmGroup | None:
    """Choose the group's path for CPU tensors: "auto" (shm where it can), "shm" (raise if it
    cannot), "gloo"; ``slot``: bytes per rank slot (default ``slot_bytes(n)``). Collective over
    the group (every rank must call it, before the group's first collective); returns the path."""
    if backend not in ("auto", "shm", "gloo"):
        raise ValueError(f"backend={backend!r}: use 'auto', 'shm' or 'gloo'")
    if slot is not None and (slot < 4096 or slot % 4096):
        raise ValueError(f"slot={slot}: use a positive multiple of 4096 bytes, e.g. {1 << 20}")
    if group in _groups:
        raise ValueError("set_backend must come before the group's first collective (its path is chosen then)")
    _policy[group] = backend
    fast = _setup(group, backend, slot)
    if backend == "shm" and fast is None:
        raise CollectiveError(
            f"backend='shm' is not possible for this group: {why_not.get(id(group))}; use backend='auto' or 'gloo'"
        )
    return fast
