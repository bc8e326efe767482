"""Collectives and their autograd duals against their definitions, on 2, 3 and 4 gloo ranks.

Every rank's input is a deterministic function of its global rank (``val``), so each
rank computes the expected result itself. Values are small integers, so sums of four
are exact even in bfloat16: every comparison is exact (no cross-rank rounding).
Inputs differ across ranks, and each check asserts that a no-op would have failed.
"""

from __future__ import annotations

import math
from functools import reduce as fold

import pytest
import torch
import torch.distributed as dist

from harness.multirank import dims, run_ranks
from shardlm.parallel import collectives, comm
from shardlm.parallel.comm import group_rank, group_size, split_sizes

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}


def val(seed: int, shape, dtype=torch.float32, salt: int = 0, positive: bool = False) -> torch.Tensor:
    """Small integers that differ across seeds (seed*5 mod 11 is distinct for seeds 0..10)."""
    i = torch.arange(math.prod(shape))
    v = (i + seed + salt) % 3 + 1 if positive else (i * 3 + seed * 5 + salt * 7) % 11 - 5
    return v.reshape(shape).to(dtype)


def eq(got, want) -> None:
    """Exact equality, dtype and shape included."""
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def nontrivial(want, noop) -> None:
    """The expected result differs from what doing nothing would give."""
    assert want.shape != noop.shape or not torch.equal(want, noop), "check would pass for a no-op"


def offsets(sizes):
    return [sum(sizes[:i]) for i in range(len(sizes))]


def a2a_plan(n: int):
    """send[i][j]: rows rank i sends rank j (zeros included, uneven, different per pair)."""
    return [[(i + 2 * j) % 3 for j in range(n)] for i in range(n)]


# ---- run on every rank ---------------------------------------------------------------
def check_primitives(group) -> None:
    """Every primitive on `group` vs its definition, for each dtype."""
    n, r = group_size(group), group_rank(group)
    ids = dist.get_process_group_ranks(group)  # seeds: global ranks, so groups differ too
    root = n - 1  # a non-zero group-local root

    for dtype in DTYPES:

        def V(j, shape, salt=0, positive=False):
            return val(ids[j], shape, dtype, salt, positive)

        # broadcast: every rank gets the root's tensor, in place (also through a transposed view)
        x = V(r, (3, 5))
        assert comm.broadcast(x, root, group) is x
        eq(x, V(root, (3, 5)))
        xt = V(r, (5, 3)).t()
        assert comm.broadcast(xt, root, group) is xt
        eq(xt, V(root, (5, 3)).t())
        if r != root:
            nontrivial(V(root, (3, 5)), V(r, (3, 5)))

        # all-reduce and reduce: op over ranks
        for op, combine in COMBINE.items():
            pos = op == "prod"  # products of 1..3 stay exact in bfloat16
            want = fold(combine, [V(j, (4, 3), positive=pos) for j in range(n)])
            nontrivial(want, V(r, (4, 3), positive=pos))
            x = V(r, (4, 3), positive=pos)
            assert comm.all_reduce(x, group, op) is x
            eq(x, want)
            x = V(r, (4, 3), positive=pos)
            out = comm.reduce(x, root, group, op)
            eq(x, V(r, (4, 3), positive=pos))  # reduce leaves its input alone
            if r == root:
                eq(out, want)
            else:
                assert out is None
        if dtype.is_floating_point:  # the mean divides by n: rounding allowed (bf16 ~2e-2)
            x = V(r, (4, 3))
            torch.testing.assert_close(comm.all_reduce(x, group, "avg"), sum(V(j, (4, 3)) for j in range(n)) / n)

        # scatter: even (sizes=None) and uneven, along a middle dim; only the root's values matter
        for total, sizes in ((3 * n, None), (2 * n + 1, split_sizes(2 * n + 1, n))):
            sz = sizes or [3] * n
            full = V(root, (2, total, 3))
            want = full.narrow(1, offsets(sz)[r], sz[r])
            got = comm.scatter(V(r, (2, total, 3)), root, group, dim=1, sizes=sizes)
            eq(got, want)
            nontrivial(want, V(r, (2, total, 3)))
        with pytest.raises(ValueError, match="split_sizes"):
            comm.scatter(V(r, (2 * n + 1,)), root, group)

        # gather / all-gather: uneven (a zero-size chunk included), sizes exchanged or given
        sizes = [(2 * j + 1) % 4 for j in range(n)]
        sizes[-1] = 0 if n > 2 else sizes[-1]  # n=2: [1, 3]; n=3: [1, 3, 0]; n=4: [1, 3, 1, 0]
        shards = [V(j, (3, sizes[j], 2)) for j in range(n)]
        want = torch.cat(shards, dim=1)
        nontrivial(want, shards[r])
        for given in (None, sizes):
            got = comm.gather(shards[r], root, group, dim=1, sizes=given)
            if r == root:
                eq(got, want)
            else:
                assert got is None
        eq(comm.all_gather(shards[r], group, dim=1, sizes=sizes), want)
        eq(comm.all_gather(shards[r], group, dim=-2, sizes=sizes), want)
        heads = split_sizes(9, n)  # 9 heads over n ranks, the tensor-parallel case
        eq(
            comm.all_gather(V(r, (2, heads[r])), group, dim=-1, sizes=heads),
            torch.cat([V(j, (2, heads[j])) for j in range(n)], dim=-1),
        )
        eq(comm.all_gather(V(r, (2, 3)), group), torch.cat([V(j, (2, 3)) for j in range(n)]))

        # reduce-scatter: chunk r of the sum, even and uneven
        for total, sizes in ((2 * n, None), (2 * n + 1, split_sizes(2 * n + 1, n))):
            sz = sizes or [2] * n
            summed = sum(V(j, (total, 3)) for j in range(n))
            want = summed.narrow(0, offsets(sz)[r], sz[r])
            eq(comm.reduce_scatter(V(r, (total, 3)), group, sizes=sizes), want)
            eq(comm.reduce_scatter(V(r, (total, 3)).t(), group, dim=1, sizes=sizes), want.t())
            nontrivial(want, V(r, (total, 3)).narrow(0, offsets(sz)[r], sz[r]))

        # the asynchronous forms (torch.distributed's async_op): three in flight at once, waited on
        # in reverse order, each the blocking one's result; uneven sizes padded as there
        uneven = split_sizes(2 * n + 1, n)
        summed = sum(V(j, (2 * n + 1, 3)) for j in range(n))
        gathered = [V(j, (2, uneven[j])) for j in range(n)]
        started = [
            comm.all_reduce_start(V(r, (4, 3)), group),
            comm.all_gather_start(gathered[r], group, dim=1, sizes=uneven),
            comm.reduce_scatter_start(V(r, (2 * n + 1, 3)), group, sizes=uneven),
        ]
        wants = [
            sum(V(j, (4, 3)) for j in range(n)),
            torch.cat(gathered, 1),
            summed.narrow(0, offsets(uneven)[r], uneven[r]),
        ]
        for pending, expected in reversed(list(zip(started, wants))):
            eq(pending.wait(), expected)

        # all-to-all: rank r gets, from each j in rank order, the rows j addressed to r
        plan = a2a_plan(n)
        xs = [V(j, (sum(plan[j]), 2)) for j in range(n)]
        want = torch.cat([torch.split(xs[j], plan[j])[r] for j in range(n)])
        nontrivial(want, xs[r])
        recv = [plan[j][r] for j in range(n)]
        eq(comm.all_to_all(xs[r], group, plan[r], recv), want)
        eq(comm.all_to_all(xs[r], group, plan[r]), want)  # recv sizes exchanged
        eq(comm.all_to_all(xs[r].t(), group, plan[r], dim=1), want.t())
        even = V(r, (2 * n, 3))
        eq(comm.all_to_all(even, group), torch.cat([V(j, (2 * n, 3))[2 * r : 2 * r + 2] for j in range(n)]))

        # point-to-point: a ring with isend/irecv, then blocking send/recv from 0 to the last rank
        buf = torch.empty(2, 3, dtype=dtype)
        works = [comm.isend(V(r, (2, 3)), (r + 1) % n, group), comm.irecv(buf, (r - 1) % n, group)]
        for w in works:
            w.wait()
        eq(buf, V((r - 1) % n, (2, 3)))
        nontrivial(buf, V(r, (2, 3)))
        # shift: the same ring in one call, two in flight at once kept apart by their tags
        (got, works), (got2, works2) = comm.shift(V(r, (2, 3)), group), comm.shift(V(r, (5,), salt=1), group, tag=1)
        for w in works + works2:
            w.wait()
        eq(got, V((r - 1) % n, (2, 3)))
        eq(got2, V((r - 1) % n, (5,), salt=1))
        # blocks of uneven sizes (each rank names the one it receives), rank 0's empty: not sent
        got, works = comm.shift(V(r, (r, 3)), group, recv_shape=((r - 1) % n, 3))
        for w in works:
            w.wait()
        eq(got, V((r - 1) % n, ((r - 1) % n, 3)))
        if r == 0:
            comm.send(V(0, (4,)), n - 1, group)
        elif r == n - 1:
            eq(comm.recv((4,), dtype, 0, group), V(0, (4,)))

    # errors are raised before any communication, on every rank alike
    x = val(r, (4,))
    for bad, match in (
        (lambda: comm.all_reduce(x, group, "mean"), "op='mean'"),
        (lambda: comm.broadcast(x, n, group), f"src={n} is not a rank"),
        (lambda: comm.reduce_scatter(torch.zeros(2 * n, 2), group, sizes=[1] * n), "summing to"),
        (lambda: comm.all_gather(x, group, sizes=[5] * n), "this rank's tensor has 4"),
        (lambda: comm.send(x, r, group), "this rank itself"),
    ):
        with pytest.raises(ValueError, match=match):
            bad()


def check_duals(group) -> None:
    """Forward and backward of every *_region on `group` vs their definitions."""
    n, r = group_size(group), group_rank(group)
    ids = dist.get_process_group_ranks(group)

    def V(j, shape, salt=0, dtype=torch.float32):
        return val(ids[j], shape, dtype, salt)

    def run(fn, x, grad):
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(grad)
        return y.detach(), x.grad

    # f (copy): forward identity, backward sum of every rank's upstream gradient
    for dtype in (torch.float32, torch.bfloat16):
        y, gx = run(lambda t: comm.copy_to_region(t, group), V(r, (3, 4), dtype=dtype), V(r, (3, 4), 1, dtype))
        eq(y, V(r, (3, 4), dtype=dtype))
        eq(gx, sum(V(j, (3, 4), 1, dtype) for j in range(n)))
        nontrivial(gx, V(r, (3, 4), 1, dtype))

    # g (reduce): forward sum over ranks (input untouched), backward identity
    x = V(r, (3, 4)).requires_grad_()
    y = comm.reduce_from_region(x, group)
    eq(x.detach(), V(r, (3, 4)))
    y.backward(V(r, (3, 4), 1))
    eq(y.detach(), sum(V(j, (3, 4)) for j in range(n)))
    eq(x.grad, V(r, (3, 4), 1))
    nontrivial(y.detach(), V(r, (3, 4)))

    # split / gather along the last dim, uneven (9 heads style) and even (sizes=None)
    for total, sizes in ((2 * n + 1, split_sizes(2 * n + 1, n)), (2 * n, None)):
        sz, off = sizes or [2] * n, offsets(sizes or [2] * n)
        full = V(0, (2, total))  # the same full tensor on every rank
        y, gx = run(lambda t: comm.split_to_region(t, group, -1, sizes), full, V(r, (2, sz[r]), 1))
        eq(y, full[:, off[r] : off[r] + sz[r]])
        eq(gx, torch.cat([V(j, (2, sz[j]), 1) for j in range(n)], dim=-1))  # backward: all-gather
        nontrivial(gx, torch.zeros_like(full).narrow(1, off[r], sz[r]))

        shard = V(r, (2, sz[r]))
        y, gx = run(lambda t: comm.gather_from_region(t, group, -1, sizes), shard, V(r, (2, total), 1))
        eq(y, torch.cat([V(j, (2, sz[j])) for j in range(n)], dim=-1))
        eq(gx, V(r, (2, total), 1)[:, off[r] : off[r] + sz[r]])  # backward: own chunk, no sum
        eq(comm.split_to_region(y, group, -1, sizes), shard)  # round trip
        nontrivial(y, shard)

    # sequence parallel: all-gather <-> reduce-scatter along dim 0, uneven
    total = 2 * n + 1
    sz = split_sizes(total, n)
    off = offsets(sz)
    y, gx = run(lambda t: comm.all_gather_region(t, group, 0, sz), V(r, (sz[r], 3)), V(r, (total, 3), 1))
    eq(y, torch.cat([V(j, (sz[j], 3)) for j in range(n)]))
    eq(gx, sum(V(j, (total, 3), 1) for j in range(n))[off[r] : off[r] + sz[r]])
    nontrivial(gx, V(r, (total, 3), 1)[off[r] : off[r] + sz[r]])

    y, gx = run(lambda t: comm.reduce_scatter_region(t, group, 0, sz), V(r, (total, 3)), V(r, (sz[r], 3), 1))
    eq(y, sum(V(j, (total, 3)) for j in range(n))[off[r] : off[r] + sz[r]])
    eq(gx, torch.cat([V(j, (sz[j], 3), 1) for j in range(n)]))
    nontrivial(y, V(r, (total, 3))[off[r] : off[r] + sz[r]])

    # all-to-all: backward sends each gradient row back to the rank its forward row came from
    plan = a2a_plan(n)
    recv = [[plan[i][j] for i in range(n)] for j in range(n)]  # recv[j][i]: rows j gets from i
    grads = [V(j, (sum(recv[j]), 2), 1) for j in range(n)]
    want_gx = torch.cat([torch.split(grads[j], recv[j])[r] for j in range(n)])
    for given in (recv[r], None):
        fn = lambda t: comm.all_to_all_region(t, group, plan[r], given)
        y, gx = run(fn, V(r, (sum(plan[r]), 2)), grads[r])
        eq(y, torch.cat([torch.split(V(j, (sum(plan[j]), 2)), plan[j])[r] for j in range(n)]))
        eq(gx, want_gx)
    nontrivial(want_gx, grads[r])


def check_noop(group) -> None:
    """On a one-rank group (None or a real one) everything returns its input, uncommunicated."""
    x = val(3, (4, 6))
    for out in (
        comm.broadcast(x, 0, group),
        comm.all_reduce(x, group, "max"),
        comm.reduce(x, 0, group),
        comm.scatter(x, 0, group, dim=1),
        comm.gather(x, 0, group),
        comm.all_gather(x, group, dim=1),
        comm.reduce_scatter(x, group, sizes=[4]),
        comm.all_to_all(x, group, [4], [4]),
        comm.all_reduce_start(x, group).wait(),
        comm.all_gather_start(x, group, dim=1).wait(),
        comm.reduce_scatter_start(x, group, sizes=[4]).wait(),
    ):
        assert out is x
    for region in (
        comm.copy_to_region,
        comm.reduce_from_region,
        comm.split_to_region,
        comm.gather_from_region,
        comm.all_gather_region,
        comm.reduce_scatter_region,
    ):
        t = x.clone().requires_grad_()
        y = region(t, group)
        y.backward(val(4, (4, 6)))
        eq(y.detach(), x)
        eq(t.grad, val(4, (4, 6)))
    assert comm.all_to_all_region(x, group) is x
    with pytest.raises(ValueError, match="one-rank group"):
        comm.send(x, 0, group)
    with pytest.raises(ValueError, match="shift in a one-rank group"):
        comm.shift(x, group)
    for bad in (
        lambda: comm.scatter(x, 0, group, sizes=[3]),
        lambda: comm.all_reduce(x, group, "mean"),
        lambda: comm.broadcast(x, 1, group),
        lambda: comm.all_gather(x, group, sizes=[1, 3]),
    ):
        with pytest.raises(ValueError):  # arguments are checked on one rank too
            bad()


def world_checks() -> None:
    check_primitives(dist.group.WORLD)
    check_duals(dist.group.WORLD)


def subgroup_checks() -> None:
    d = dims(dp=2, tp=2)  # tp groups {0,1},{2,3}; dp groups {0,2},{1,3}: local roots != global
    check_primitives(d.tp_group)
    check_primitives(d.dp_group)
    check_duals(d.dp_group)
    check_noop(dims(dp=4).tp_group)  # a real one-rank ProcessGroup


# ---- tests ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 3, 4])
def world(request) -> int:
    return request.param  # module scope: pytest runs every test of one world size together


def test_primitives_and_duals(world):
    assert run_ranks(world, world_checks) == [None] * world  # every rank ran every check


def test_subgroups_use_group_local_roots():
    assert run_ranks(4, subgroup_checks) == [None] * 4


def test_one_rank_group_is_a_noop_without_a_process_group(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a one-rank group must not communicate")

    for name in (
        "broadcast",
        "all_reduce",
        "reduce",
        "scatter",
        "gather",
        "all_to_all_single",
        "send",
        "recv",
        "isend",
        "irecv",
        "get_world_size",
        "get_rank",
    ):
        monkeypatch.setattr(dist, name, forbidden)
    monkeypatch.setattr(collectives, "_all_gather_single", forbidden)
    monkeypatch.setattr(collectives, "_reduce_scatter_single", forbidden)
    check_noop(None)


def test_split_sizes():
    assert split_sizes(9, 2) == [5, 4]
    assert split_sizes(3, 4) == [1, 1, 1, 0]
    assert split_sizes(12, 4) == [3, 3, 3, 3]
    for n in range(0, 20):
        for parts in range(1, 6):
            s = split_sizes(n, parts)
            assert sum(s) == n and max(s) - min(s) <= 1 and s == sorted(s, reverse=True)
    with pytest.raises(ValueError, match="parts=0"):
        split_sizes(4, 0)
