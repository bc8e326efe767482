"""Collectives and their autograd duals: the one module layers import communication from.

The primitives (broadcast, scatter, gather, reduce, all_gather, all_reduce,
reduce_scatter, all_to_all, send/recv, and the asynchronous ``*_start`` forms
that return a ``Pending``) live in ``collectives.py`` and are re-exported here. This file adds their autograd duals for model-parallel regions:
Megatron-LM's mappings f, g, split and gather (Shoeybi et al. 2019,
https://arxiv.org/abs/1909.08053, sec. 3), sequence parallelism's all-gather /
reduce-scatter pair (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198,
sec. 4.2.2), and the all-to-all of expert parallelism. Each dual is a no-op on a
one-rank group and reads "forward: X; backward: Y", where Y is the adjoint of X.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from shardlm.parallel.collectives import (  # shared argument checks
    Pending,
    ProcessGroup,
    _a2a_sizes,
    _dim,
    _sizes,
    all_gather,
    all_gather_start,
    all_reduce,
    all_reduce_start,
    all_to_all,
    broadcast,
    gather,
    group_rank,
    group_size,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_start,
    scatter,
    send,
    shift,
    split_sizes,
)

__all__ = [
    # primitives (collectives.py)
    "split_sizes",
    "group_size",
    "group_rank",
    "broadcast",
    "scatter",
    "gather",
    "reduce",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "send",
    "recv",
    "isend",
    "irecv",
    "shift",
    "Pending",
    "all_reduce_start",
    "all_gather_start",
    "reduce_scatter_start",
    # autograd duals
    "copy_to_region",
    "reduce_from_region",
    "split_to_region",
    "gather_from_region",
    "all_gather_region",
    "reduce_scatter_region",
    "all_to_all_region",
]


class _Dual(torch.autograd.Function):
    """One autograd Function for every region: forward runs fwd(x), backward runs bwd(grad)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g), None, None


def _region(x: Tensor, fwd, bwd) -> Tensor:
    """A dual's communication (a graph break for torch.compile once ``prepare_compile`` ran)."""
    return _Dual.apply(x, fwd, bwd)


def prepare_compile(groups: Iterable[ProcessGroup]) -> None:
    """Prepare the duals for torch.compile (called by the code that compiles, not at import:
    importing torch._dynamo costs a rank ~1.6 s of start-up it needs only to compile).

    In a compiled inference forward the all-reduce and all-gather of ``groups`` are opaque ops
    in the graph, ``torch.ops.shardlm.all_reduce`` / ``all_gather`` (as vLLM registers its
    collectives), so a tp step is one graph; every other dual is a graph break, since the
    shared-memory path is Python that dynamo should not trace."""
    global _region, _region_opaque
    for group in groups:
        _COMPILED_GROUPS[group.group_name] = group
        _COMPILED_NAMES.add(group.group_name)
    if not _region_opaque:
        _region = torch.compiler.disable(_region)
        _region_opaque = True


# by name, for the ops; weakly, so that they end at exit once their LLM is closed and the world group
# destroyed (launch._end_group); the names apart, a set dynamo can read while it traces (it cannot
# trace a WeakValueDictionary)
_COMPILED_GROUPS: weakref.WeakValueDictionary[str, ProcessGroup] = weakref.WeakValueDictionary()
_COMPILED_NAMES: set[str] = set()
_region_opaque = False  # whether _region is wrapped in torch.compiler.disable yet


def _in_graph(group) -> bool:
    """True while torch.compile traces an inference forward whose group has an op name."""
    return (
        torch.compiler.is_compiling()
        and not torch.is_grad_enabled()
        and group is not None
        and group.group_name in _COMPILED_NAMES
    )


def _all_reduce_op(x: Tensor, group: str) -> Tensor:
    return _summed(x, _COMPILED_GROUPS[group])


def _all_gather_op(x: Tensor, group: str, dim: int, sizes: list[int]) -> Tensor:
    return all_gather(x, _COMPILED_GROUPS[group], dim, sizes)


def _all_gather_fake(x: Tensor, group: str, dim: int, sizes: list[int]) -> Tensor:
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    return x.new_empty(shape)


_LIB = torch.library.Library("shardlm", "FRAGMENT")
_LIB.define("all_reduce(Tensor x, str group) -> Tensor")
_LIB.impl("all_reduce", _all_reduce_op, "CompositeExplicitAutograd")
torch.library.register_fake("shardlm::all_reduce")(lambda x, group: x.new_empty(x.shape))  # contiguous, as the op
_LIB.define("all_gather(Tensor x, str group, int dim, SymInt[] sizes) -> Tensor")
_LIB.impl("all_gather", _all_gather_op, "CompositeExplicitAutograd")
torch.library.register_fake("shardlm::all_gather")(_all_gather_fake)


def _own(x: Tensor, group, d: int, sizes: list[int]) -> Tensor:
    """This rank's chunk of the full x along dim d."""
    rank = group_rank(group)
    return x.narrow(d, sum(sizes[:rank]), sizes[rank]).contiguous()


def _shard_sizes(x: Tensor, group, dim: int, sizes) -> tuple[int, list[int]]:
    """(dim, per-rank sizes) when x is this rank's shard (None: every shard like x)."""
    d = _dim(x, dim)
    return d, [x.size(d)] * group_size(group) if sizes is None else [int(s) for s in sizes]


def _summed(x: Tensor, group) -> Tensor:
    """Out-of-place all-reduce: x may be saved by autograd or shared with another branch."""
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group)


def copy_to_region(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """forward: identity; backward: all-reduce (sum) the gradient over group (Megatron's f)."""
    if group_size(group) == 1 or _in_graph(group):  # compiled inference: no backward to keep
        return x
    return _region(x, lambda t: t.view_as(t), lambda g: _summed(g, group))


def reduce_from_region(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """forward: all-reduce (sum, out of place) over group; backward: identity (Megatron's g)."""
    if group_size(group) == 1:
        return x
    if group is not None and _in_graph(group):
        return torch.ops.shardlm.all_reduce(x, group.group_name)
    return _region(x, lambda t: _summed(t, group), lambda g: g)


def split_to_region(x: Tensor, group: ProcessGroup | None, dim: int = -1, sizes: Sequence[int] | None = None) -> Tensor:
    """forward: keep this rank's chunk of the full x along dim; backward: all-gather."""
    if group_size(group) == 1:
        return x
    d = _dim(x, dim)
    sizes = _sizes(sizes, group_size(group), x.size(d), d)
    return _region(x, lambda t: _own(t, group, d, sizes), lambda g: all_gather(g, group, d, sizes))


def gather_from_region(
    x: Tensor, group: ProcessGroup | None, dim: int = -1, sizes: Sequence[int] | None = None
) -> Tensor:
    """forward: all-gather the shards along dim; backward: split (keep this rank's chunk)."""
    if group_size(group) == 1:
        return x
    d, sizes = _shard_sizes(x, group, dim, sizes)
    if group is not None and _in_graph(group):
        return torch.ops.shardlm.all_gather(x, group.group_name, d, sizes)
    return _region(x, lambda t: all_gather(t, group, d, sizes), lambda g: _own(g, group, d, sizes))


def all_gather_region(
    x: Tensor, group: ProcessGroup | None, dim: int = 0, sizes: Sequence[int] | None = None
) -> Tensor:
    """forward: all-gather along dim (sequence parallel's g); backward: reduce-scatter (sum)."""
    if group_size(group) == 1:
        return x
    d, sizes = _shard_sizes(x, group, dim, sizes)
    return _region(x, lambda t: all_gather(t, group, d, sizes), lambda g: reduce_scatter(g, group, d, sizes))


def reduce_scatter_region(
    x: Tensor, group: ProcessGroup | None, dim: int = 0, sizes: Sequence[int] | None = None
) -> Tensor:
    """forward: reduce-scatter (sum) along dim (sequence parallel's g-bar); backward: all-gather."""
    if group_size(group) == 1:
        return x
    d = _dim(x, dim)
    sizes = _sizes(sizes, group_size(group), x.size(d), d)
    return _region(x, lambda t: reduce_scatter(t, group, d, sizes), lambda g: all_gather(g, group, d, sizes))


def all_to_all_region(
    x: Tensor,
    group: ProcessGroup | None,
    send_sizes: Sequence[int] | None = None,
    recv_sizes: Sequence[int] | None = None,
    dim: int = 0,
) -> Tensor:
    """forward: all-to-all (send_sizes out, recv_sizes in); backward: the reverse all-to-all."""
    if group_size(group) == 1:
        return x
    send, recv = _a2a_sizes(x, group, send_sizes, recv_sizes, _dim(x, dim))
    return _region(
        x, lambda t: all_to_all(t, group, send, recv, dim), lambda g: all_to_all(g, group, recv, send, dim)
    )  # rows go back where they came from
