"""Collective primitives over one explicit process group (re-exported by ``comm``).

Every function takes an explicit ``group``: a ``ProcessGroup``, or ``None`` for a
one-rank group (single process). On a one-rank group each is a no-op that returns
the natural single-rank result without communicating. Roots (``src``/``dst``) are
group-local ranks. ``sizes`` lists each rank's extent along ``dim`` for uneven
splits (e.g. 9 heads over 2 ranks: ``split_sizes(9, 2) == [5, 4]``); ``None``
means an even split, except in ``gather``, where ``None`` asks the ranks.
Backends differ (gloo rejects uneven all-gather), so uneven chunks are padded to
the largest, moved as even ones, then trimmed: the same code runs on gloo and NCCL.
Tensors are made contiguous before they are handed to a collective.

CPU tensors of a group whose ranks share this host take the shared-memory path
(``shm.route``) for broadcast, all-reduce (sum), all-gather, reduce-scatter (sum) and
all-to-all; the rest, and every CUDA tensor, go to torch.distributed (gloo / NCCL).

``all_reduce_start``, ``all_gather_start`` and ``reduce_scatter_start`` start the collective and
return a ``Pending`` whose ``wait()`` gives the result, so compute can run while it is in flight
(what ZeRO's gradient buckets and ZeRO-3's prefetch do). They always go to torch.distributed with
``async_op=True`` (gloo's own threads, NCCL's stream): the shared-memory path is work of the
calling thread and has no asynchronous form.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from shardlm.parallel import compress, shm

ProcessGroup = dist.ProcessGroup
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}
# torch 2.13 renamed the single-tensor collectives; older torch only has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- helpers -----------------------------------------------------------------------------
def split_sizes(n: int, parts: int) -> list[int]:
    """Split n into `parts` sizes as even as possible; the first n % parts get one more."""
    if parts < 1 or n < 0:
        raise ValueError(f"split_sizes(n={n}, parts={parts}): need n >= 0 and parts >= 1")
    q, r = divmod(n, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in `group`; None is a one-rank group."""
    n = 1 if group is None else dist.get_world_size(group)
    if n < 1:
        raise ValueError("this rank is not a member of the group it was given; pass a group that contains it")
    return n


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank within `group`; None is a one-rank group (rank 0)."""
    return 0 if group is None else dist.get_rank(group)


def _op(op: str) -> dist.ReduceOp.RedOpType:
    if op not in _OPS:
        raise ValueError(f"op={op!r} is not a reduction; use one of {sorted(_OPS)} ('avg' floats only)")
    return _OPS[op]


def _dim(x: Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _root(root: int, n: int, name: str) -> int:
    if not 0 <= root < n:
        raise ValueError(f"{name}={root} is not a rank of this {n}-rank group; roots are group-local ranks 0..{n - 1}")
    return root


def _sizes(sizes: Sequence[int] | None, n: int, total: int, dim: int) -> list[int]:
    """Per-rank sizes that sum to `total` (even split when None), validated."""
    if sizes is None:
        if total % n:
            raise ValueError(
                f"size {total} along dim {dim} does not split evenly over {n} ranks; "
                f"pass sizes=split_sizes({total}, {n}) = {split_sizes(total, n)} for an uneven split"
            )
        return [total // n] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or sum(sizes) != total or min(sizes) < 0:
        raise ValueError(f"sizes={sizes} must be {n} non-negative ints summing to {total}, the size along dim {dim}")
    return sizes


def _pad0(x: Tensor, m: int) -> Tensor:
    """x padded with zeros along dim 0 to length m, contiguous."""
    if x.size(0) == m:
        return x.contiguous()
    out = x.new_zeros((m, *x.shape[1:]))
    out[: x.size(0)] = x
    return out


def _fast(group: ProcessGroup | None, x: Tensor) -> shm.ShmGroup | None:
    """The group's shared-memory path for x (CPU tensors only), or None for torch.distributed
    (callers have returned already for a one-rank group, None)."""
    return shm.route(group) if group is not None and x.device.type == "cpu" else None


def _bytes(t: Tensor) -> Tensor:
    """A contiguous tensor's storage as flat uint8 (no copy)."""
    return t.view(-1).view(torch.uint8)


def _peer(peer: int, group: ProcessGroup | None, name: str) -> int:
    n = group_size(group)
    if n == 1:
        raise ValueError(f"point-to-point with {name}={peer} in a one-rank group: there is no peer to talk to")
    if _root(peer, n, name) == group_rank(group):
        raise ValueError(f"{name}={peer} is this rank itself; send/recv need a different group rank")
    return peer


def _exchange_sizes(own: int, device: torch.device, group: ProcessGroup | None) -> list[int]:
    """Every rank's size along the gathered dim (one small all-gather)."""
    mine = torch.tensor([own], dtype=torch.int64, device=device)
    out = mine.new_empty(group_size(group))
    _all_gather_single(out, mine, group=group)
    return out.tolist()


def _check_own_size(sizes: list[int], n: int, rank: int, own: int) -> None:
    if len(sizes) != n or min(sizes) < 0:
        raise ValueError(f"sizes={sizes} must be {n} non-negative ints, one per rank")
    if sizes[rank] != own:
        raise ValueError(f"sizes[{rank}]={sizes[rank]} but this rank's tensor has {own} along the gathered dim")


class Pending:
    """A collective in flight (a ``*_start`` function's): ``wait()`` blocks until it is done and
    returns its result. Its buffers stay alive, and must stay unchanged, until then."""

    def __init__(self, work: dist.Work | None, result: Callable[[], Tensor], *buffers: Tensor):
        self._work, self._result, self._buffers = work, result, buffers

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
        return self._result()


def _done(x: Tensor) -> Pending:
    """A one-rank group's result, with nothing in flight."""
    return Pending(None, lambda: x)


# ---- primitives ---------------------------------------------------------------------
def broadcast(x: Tensor, src: int, group: ProcessGroup | None) -> Tensor:
    """Every rank's x becomes the root's x (in place; returns x)."""
    n = group_size(group)
    src = _root(src, n, "src")
    if n == 1:
        return x
    buf = x.contiguous()
    if (fast := _fast(group, x)) is not None:
        fast.broadcast(_bytes(buf), src)
    else:
        dist.broadcast(buf, group_src=src, group=group)
    return x if buf is x else x.copy_(buf)


def all_reduce(x: Tensor, group: ProcessGroup | None, op: str = "sum", *, payload: str | None = None) -> Tensor:
    """Every rank's x becomes x_0 (op) x_1 (op) ... (in place on x; returns x).

    payload="bf16" | "int8" sends x in that encoding (sum only; see ``compress.py``): every rank
    all-gathers the encodings, decodes them and sums in float32 in rank order."""
    reduce_op = _op(op)
    if payload is not None:
        compress.check_payload(payload, x)
        if op != "sum":
            raise ValueError(f"payload={payload!r} works with op='sum' only, not op={op!r}; pass payload=None")
    if group_size(group) == 1:
        return x
    if payload is not None:
        return _encoded_all_reduce(x, group, payload)
    buf = x.contiguous()
    if op == "sum" and x.dtype in shm.REDUCIBLE and (fast := _fast(group, x)) is not None:
        fast.all_reduce(buf)
    else:
        dist.all_reduce(buf, op=reduce_op, group=group)
    return x if buf is x else x.copy_(buf)


def all_reduce_start(x: Tensor, group: ProcessGroup | None, op: str = "sum") -> Pending:
    """``all_reduce`` started asynchronously: ``wait()`` returns x, summed (x must be contiguous and
    unchanged until then)."""
    reduce_op = _op(op)
    if group_size(group) == 1:
        return _done(x)
    if not x.is_contiguous():
        raise ValueError("all_reduce_start needs a contiguous tensor: it reduces in place while the caller runs on")
    return Pending(dist.all_reduce(x, op=reduce_op, group=group, async_op=True), lambda: x, x)


def reduce(x: Tensor, dst: int, group: ProcessGroup | None, op: str = "sum") -> Tensor | None:
    """Root gets x_0 (op) x_1 (op) ... in a new tensor (x on one rank), others None; x is unchanged."""
    n, reduce_op = group_size(group), _op(op)
    dst = _root(dst, n, "dst")
    if n == 1:
        return x
    buf = x.clone(memory_format=torch.contiguous_format)  # dist.reduce writes into its buffer; x stays
    dist.reduce(buf, group_dst=dst, op=reduce_op, group=group)
    return buf if group_rank(group) == dst else None


def scatter(
    x: Tensor, src: int, group: ProcessGroup | None, dim: int = 0, sizes: Sequence[int] | None = None
) -> Tensor:
    """Rank i gets chunk i (sizes[i] along dim) of the root's x; every rank passes x's full shape."""
    n, d = group_size(group), _dim(x, dim)
    src, sizes = _root(src, n, "src"), _sizes(sizes, n, x.size(d), d)
    if n == 1:
        return x
    rank, m = group_rank(group), max(sizes)
    y = x.movedim(d, 0)  # [total, ...]
    parts = [_pad0(c, m) for c in torch.split(y, sizes)] if rank == src else None  # n x [max chunk, ...]
    out = y.new_empty((m, *y.shape[1:]))  # [max chunk, ...]
    dist.scatter(out, parts, group_src=src, group=group)
    return out[: sizes[rank]].movedim(0, d).contiguous()


def gather(
    x: Tensor, dst: int, group: ProcessGroup | None, dim: int = 0, sizes: Sequence[int] | None = None
) -> Tensor | None:
    """Root gets cat([x_0, ..., x_{n-1}], dim), others None; sizes=None exchanges the sizes first."""
    n, d, rank = group_size(group), _dim(x, dim), group_rank(group)
    dst = _root(dst, n, "dst")
    if sizes is None:
        sizes = [x.size(d)] if n == 1 else _exchange_sizes(x.size(d), x.device, group)
    sizes = [int(s) for s in sizes]
    _check_own_size(sizes, n, rank, x.size(d))
    if n == 1:
        return x
    m = max(sizes)
    buf = _pad0(x.movedim(d, 0), m)  # [max chunk, ...]
    parts = [torch.empty_like(buf) for _ in range(n)] if rank == dst else None
    dist.gather(buf, parts, group_dst=dst, group=group)
    if parts is None:  # not the root
        return None
    return torch.cat([p[:s] for p, s in zip(parts, sizes)]).movedim(0, d).contiguous()


def all_gather(
    x: Tensor,
    group: ProcessGroup | None,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    *,
    payload: str | None = None,
) -> Tensor:
    """Every rank gets cat([x_0, ..., x_{n-1}], dim); x_i has sizes[i] along dim (None: all equal).

    payload="bf16" | "int8" sends the shards in that encoding (see ``compress.py``)."""
    n, d = group_size(group), _dim(x, dim)
    sizes = [x.size(d)] * n if sizes is None else [int(s) for s in sizes]
    _check_own_size(sizes, n, group_rank(group), x.size(d))
    if payload is not None:
        compress.check_payload(payload, x)
    if n == 1:
        return x
    if payload is not None:
        return _encoded_all_gather(x, group, d, sizes, payload)
    if (fast := _fast(group, x)) is not None:  # no padding: ranks write their own sizes
        y = x.movedim(d, 0).contiguous()  # [own, ...]
        out = y.new_empty((sum(sizes), *y.shape[1:]))  # [sum(sizes), ...]
        row = math.prod(y.shape[1:]) * y.element_size()
        fast.all_gather(_bytes(y), _bytes(out), [s * row for s in sizes])
        return out.movedim(0, d).contiguous()
    return _all_gather_dist(x, group, d, sizes, async_op=False).wait()


def all_gather_start(
    x: Tensor, group: ProcessGroup | None, dim: int = 0, sizes: Sequence[int] | None = None
) -> Pending:
    """``all_gather`` started asynchronously: ``wait()`` returns the gathered tensor."""
    n, d = group_size(group), _dim(x, dim)
    sizes = [x.size(d)] * n if sizes is None else [int(s) for s in sizes]
    _check_own_size(sizes, n, group_rank(group), x.size(d))
    return _done(x) if n == 1 else _all_gather_dist(x, group, d, sizes, async_op=True)


def _all_gather_dist(x: Tensor, group, d: int, sizes: list[int], async_op: bool) -> Pending:
    """torch.distributed's all-gather, uneven shards padded to the largest (gloo needs even ones)."""
    n, m = group_size(group), max(sizes)
    buf = _pad0(x.movedim(d, 0), m)  # [max chunk, ...]
    out = buf.new_empty((n * m, *buf.shape[1:]))  # [n * max chunk, ...]
    work = _all_gather_single(out, buf, group=group, async_op=async_op)

    def result() -> Tensor:
        full = out
        if any(s != m for s in sizes):  # uneven: drop each rank's padding
            full = torch.cat([out[r * m : r * m + s] for r, s in enumerate(sizes)])
        return full.movedim(0, d).contiguous()

    return Pending(work, result, buf, out)


def reduce_scatter(
    x: Tensor, group: ProcessGroup | None, dim: int = 0, sizes: Sequence[int] | None = None, op: str = "sum"
) -> Tensor:
    """Rank i gets chunk i (sizes[i] along dim) of x_0 (op) x_1 (op) ...; every x has the full shape."""
    n, d, reduce_op = group_size(group), _dim(x, dim), _op(op)
    sizes = _sizes(sizes, n, x.size(d), d)
    if n == 1:
        return x
    y = x.movedim(d, 0)  # [total, ...]
    if op == "sum" and x.dtype in shm.REDUCIBLE and (fast := _fast(group, x)) is not None:
        y = y.contiguous()
        row = math.prod(y.shape[1:])
        out = y.new_empty((sizes[group_rank(group)], *y.shape[1:]))  # [own chunk, ...]
        fast.reduce_scatter(y, out, [s * row for s in sizes])
        return out.movedim(0, d).contiguous()
    return _reduce_scatter_dist(x, group, d, sizes, reduce_op, async_op=False).wait()


def reduce_scatter_start(
    x: Tensor, group: ProcessGroup | None, dim: int = 0, sizes: Sequence[int] | None = None, op: str = "sum"
) -> Pending:
    """``reduce_scatter`` started asynchronously: ``wait()`` returns this rank's chunk of the sum
    (x must stay unchanged until then)."""
    n, d, reduce_op = group_size(group), _dim(x, dim), _op(op)
    sizes = _sizes(sizes, n, x.size(d), d)
    return _done(x) if n == 1 else _reduce_scatter_dist(x, group, d, sizes, reduce_op, async_op=True)


def _reduce_scatter_dist(x: Tensor, group, d: int, sizes: list[int], reduce_op, async_op: bool) -> Pending:
    """torch.distributed's reduce-scatter, uneven chunks padded to the largest."""
    y, m = x.movedim(d, 0), max(sizes)  # [total, ...]
    if any(s != m for s in sizes):  # uneven: pad every chunk to the largest
        buf = torch.cat([_pad0(c, m) for c in torch.split(y, sizes)])  # [n * max chunk, ...]
    else:
        buf = y.contiguous()
    out = buf.new_empty((m, *buf.shape[1:]))  # [max chunk, ...]
    work = _reduce_scatter_single(out, buf, op=reduce_op, group=group, async_op=async_op)
    own = sizes[group_rank(group)]
    return Pending(work, lambda: out[:own].movedim(0, d).contiguous(), buf, out)


def all_to_all(
    x: Tensor,
    group: ProcessGroup | None,
    send_sizes: Sequence[int] | None = None,
    recv_sizes: Sequence[int] | None = None,
    dim: int = 0,
) -> Tensor:
    """Rank i sends chunk j (send_sizes[j] along dim) of x to rank j; gets cat of what each rank sent it."""
    n, d = group_size(group), _dim(x, dim)
    send, recv = _a2a_sizes(x, group, send_sizes, recv_sizes, d)
    if n == 1:
        return x
    y = x.movedim(d, 0).contiguous()  # [sum(send), ...]
    out = y.new_empty((sum(recv), *y.shape[1:]))  # [sum(recv), ...]
    if (fast := _fast(group, x)) is not None:
        row = math.prod(y.shape[1:]) * y.element_size()
        fast.all_to_all(_bytes(y), _bytes(out), [s * row for s in send], [s * row for s in recv])
        return out.movedim(0, d).contiguous()
    dist.all_to_all_single(out, y, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out.movedim(0, d).contiguous()


def _a2a_sizes(x: Tensor, group, send_sizes, recv_sizes, d: int) -> tuple[list[int], list[int]]:
    """(send, recv) sizes: send defaults to even; recv=None asks each peer what it sends here."""
    n = group_size(group)
    send = _sizes(send_sizes, n, x.size(d), d)
    if recv_sizes is not None:
        recv = [int(s) for s in recv_sizes]
    elif n == 1:
        recv = send
    else:
        counts = torch.tensor(send, dtype=torch.int64, device=x.device)
        if (fast := _fast(group, counts)) is not None:
            got = counts.new_empty(n)
            fast.all_to_all(_bytes(counts), _bytes(got), [8] * n, [8] * n)
        else:
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts, group=group)  # got[j] = what rank j sends to this rank
        recv = got.tolist()
    if len(recv) != n or min(recv) < 0 or (n == 1 and recv != send):
        raise ValueError(f"recv_sizes={recv} must be {n} non-negative ints, one per rank (one rank: = send_sizes)")
    return send, recv


def send(x: Tensor, dst: int, group: ProcessGroup | None, tag: int = 0) -> None:
    """Send x to group rank dst (blocking); pairs with recv on dst (gloo also matches the tag)."""
    dist.send(x.contiguous(), group_dst=_peer(dst, group, "dst"), group=group, tag=tag)


def recv(
    shape: Sequence[int],
    dtype: torch.dtype,
    src: int,
    group: ProcessGroup | None,
    device: torch.device | str = "cpu",
    tag: int = 0,
) -> Tensor:
    """A new tensor of shape/dtype/device holding what group rank src sent (blocking)."""
    buf = torch.empty(tuple(shape), dtype=dtype, device=device)
    dist.recv(buf, group_src=_peer(src, group, "src"), group=group, tag=tag)
    return buf


def isend(x: Tensor, dst: int, group: ProcessGroup | None, tag: int = 0) -> dist.Work:
    """Start sending x (contiguous, unchanged until wait()) to group rank dst; returns the work handle."""
    if not x.is_contiguous():
        raise ValueError("isend needs a contiguous tensor: a temporary copy could be freed before the send ends")
    work = dist.isend(x, group_dst=_peer(dst, group, "dst"), group=group, tag=tag)
    assert work is not None  # torch returns None only to ranks outside the group
    return work


def irecv(buf: Tensor, src: int, group: ProcessGroup | None) -> dist.Work:
    """Start receiving from group rank src into contiguous buf; buf is valid after wait()."""
    if not buf.is_contiguous():
        raise ValueError("irecv needs a contiguous buffer to receive into")
    work = dist.irecv(buf, group_src=_peer(src, group, "src"), group=group)
    assert work is not None  # torch returns None only to ranks outside the group
    return work


def shift(
    x: Tensor, group: ProcessGroup | None, tag: int = 0, recv_shape: Sequence[int] | None = None
) -> tuple[Tensor, list[dist.Work]]:
    """One step around the ring: send x to group rank + 1 and receive rank - 1's x (same shape and
    dtype, or ``recv_shape`` where the blocks differ) into a new buffer, valid once every returned
    handle is waited on. Both directions go out as one batch (NCCL groups them, so a ring of sends
    cannot deadlock); ``tag`` keeps two shifts in flight at once apart on backends that match by
    tag. An empty block is neither sent nor received (both ends know its shape)."""
    n, rank = group_size(group), group_rank(group)
    if n == 1:
        raise ValueError("shift in a one-rank group: there is no ring to pass x around")
    x = x.contiguous()
    buf = x.new_empty(x.shape if recv_shape is None else tuple(recv_shape))
    ops = []
    if x.numel():
        ops.append(dist.P2POp(dist.isend, x, group=group, group_peer=(rank + 1) % n, tag=tag))
    if buf.numel():
        ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=(rank - 1) % n, tag=tag))
    return buf, dist.batch_isend_irecv(ops) if ops else []


# ---- lower-precision payloads (encodings in compress.py) ------------------------------------


def _encoded_all_reduce(x: Tensor, group, payload: str) -> Tensor:
    """x (in place) = sum over ranks of decode(encode(x_j)), float32 in rank order."""
    n, k = group_size(group), compress.encoded_bytes(x.numel(), payload)
    everyone = all_gather(compress.encode(x, payload), group)  # [n * k] uint8
    acc = compress.decode(everyone[:k], payload, x.numel()).clone()
    for j in range(1, n):
        acc += compress.decode(everyone[j * k : (j + 1) * k], payload, x.numel())
    return x.copy_(acc.view(x.shape))


def _encoded_all_gather(x: Tensor, group, dim: int, sizes: Sequence[int], payload: str) -> Tensor:
    """cat over ranks of decode(encode(x_j)) along dim, in x's dtype; sizes[j] = x_j's extent."""
    y = x.movedim(dim, 0)  # [own, ...]
    rest = y.shape[1:]
    row = math.prod(rest)
    counts = [compress.encoded_bytes(s * row, payload) for s in sizes]
    everyone = all_gather(compress.encode(y, payload), group, sizes=counts)  # [sum(counts)] uint8
    parts, at = [], 0
    for s, c in zip(sizes, counts):
        parts.append(compress.decode(everyone[at : at + c], payload, s * row).view(s, *rest))
        at += c
    return torch.cat(parts).to(x.dtype).movedim(0, dim).contiguous()
