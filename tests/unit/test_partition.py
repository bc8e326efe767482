"""Head / row partitioning for tensor parallelism, and the padded GQA head grouping.

Pure integer maths plus index_select on small tensors: every comparison is exact
(``torch.equal``), no tolerance.
"""

from __future__ import annotations

import pytest
import torch

from shardlm.models.attention import GroupedHeads
from shardlm.parallel.comm import split_sizes
from shardlm.parallel.dims import LayoutError
from shardlm.parallel.tensor import partition_heads, shard_range


def _cases(num_heads: int):
    for kv in range(1, num_heads + 1):
        if num_heads % kv == 0:
            for tp in range(1, num_heads + 1):
                yield kv, tp


# ---- split_sizes / shard_range ------------------------------------------------------


@pytest.mark.parametrize("n", list(range(0, 41)) + [151, 49152])
def test_split_sizes_and_shard_range(n):
    for parts in range(1, 11):
        sizes = split_sizes(n, parts)
        assert len(sizes) == parts and sum(sizes) == n
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)  # larger shares first
        # shard_range tiles [0, n) in order with exactly those sizes
        stop = 0
        for i in range(parts):
            r = shard_range(n, parts, i)
            assert r.start == stop and r.stop - r.start == sizes[i], (n, parts, i, r)
            stop = r.stop
        assert stop == n


def test_split_sizes_known_values_and_errors():
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert split_sizes(2, 3) == [1, 1, 0]
    assert shard_range(10, 4, 2) == slice(6, 8)
    with pytest.raises(ValueError, match="parts=0"):
        split_sizes(4, 0)
    with pytest.raises(ValueError, match="n=-1"):
        split_sizes(-1, 2)


# ---- partition_heads ----------------------------------------------------------------


@pytest.mark.parametrize("num_heads", range(1, 17))
def test_partition_heads_every_layout(num_heads):
    checked = 0
    for kv, tp in _cases(num_heads):
        q_per_kv = num_heads // kv
        parts = [partition_heads(num_heads, kv, tp, r) for r in range(tp)]
        # query heads: covered exactly once, in rank order
        covered = [h for p in parts for h in range(p.q.start, p.q.stop)]
        assert covered == list(range(num_heads)), (num_heads, kv, tp)
        sizes = [p.num_q for p in parts]
        assert min(sizes) >= 1  # every rank gets at least one query head
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), sizes
        assert sizes == split_sizes(num_heads, tp)
        for r, p in enumerate(parts):
            assert p.q == shard_range(num_heads, tp, r)
            assert p.q_per_kv == q_per_kv
            # KV range is exactly the KV heads this rank's query heads read
            read = sorted({h // q_per_kv for h in range(p.q.start, p.q.stop)})
            assert list(range(p.kv.start, p.kv.stop)) == read, (num_heads, kv, tp, r, p)
            assert p.num_kv == len(read)
            # local_kv_of_q: each local query head -> index of its KV head among the local ones
            local = p.local_kv_of_q()
            assert len(local) == p.num_q
            for i, h in enumerate(range(p.q.start, p.q.stop)):
                assert local[i] == h // q_per_kv - p.kv.start
                assert 0 <= local[i] < p.num_kv
            assert set(local) == set(range(p.num_kv))  # no KV head held for nothing
            assert local == sorted(local)
            checked += 1
    assert checked > 0


def test_partition_heads_uneven_gqa_known_values():
    # can-fail guard with concrete numbers: 9 heads over 3 KV heads, tp=2.
    # rank 0 gets q 0..4 (KV 0,1), rank 1 gets q 5..8 (KV 1,2): KV head 1 held by both.
    p0, p1 = (partition_heads(9, 3, 2, r) for r in range(2))
    assert (p0.q, p0.kv) == (slice(0, 5), slice(0, 2))
    assert (p1.q, p1.kv) == (slice(5, 9), slice(1, 3))
    assert p0.local_kv_of_q() == [0, 0, 0, 1, 1]
    assert p1.local_kv_of_q() == [0, 1, 1, 1]
    # MHA (kv == heads) and MQA (kv == 1)
    assert partition_heads(4, 4, 2, 1).kv == slice(2, 4)
    assert partition_heads(4, 1, 4, 3).kv == slice(0, 1)


@pytest.mark.parametrize("num_heads,kv,tp", [(1, 1, 2), (3, 1, 4), (9, 3, 10), (16, 8, 32)])
def test_tp_larger_than_heads_is_a_layout_error(num_heads, kv, tp):
    with pytest.raises(LayoutError) as err:
        partition_heads(num_heads, kv, tp, 0)
    msg = str(err.value)
    assert f"tp={tp}" in msg, msg
    assert f"{num_heads} attention heads" in msg, msg
    assert f"tp <= {num_heads}" in msg, msg  # a valid choice is suggested
    # the suggestion really is valid
    partition_heads(num_heads, kv, num_heads, num_heads - 1)


# ---- GroupedHeads -------------------------------------------------------------------


def _check_grouping(local_kv_of_q: list[int], lead=(3,), d=4):
    num_q = len(local_kv_of_q)
    heads = GroupedHeads(local_kv_of_q)
    num_kv = max(local_kv_of_q) + 1
    group = max(local_kv_of_q.count(j) for j in range(num_kv))
    assert (heads.num_kv, heads.per_kv) == (num_kv, group)
    # distinct non-zero values per head, so a misplaced head or a non-zero pad is visible
    q = torch.arange(1, 1 + num_q * d * int(torch.tensor(lead).prod()), dtype=torch.float32)
    q = q.reshape(*lead, num_q, d)
    g = heads.group_q(q)
    assert g.shape == (*lead, num_kv * group, d)
    # each grouped slot j*group + s holds a query head of KV head j, in order, then zero padding
    for j in range(num_kv):
        members = [h for h in range(num_q) if local_kv_of_q[h] == j]
        for s in range(group):
            slot = g[..., j * group + s, :]
            if s < len(members):
                assert torch.equal(slot, q[..., members[s], :]), (local_kv_of_q, j, s)
            else:
                assert torch.equal(slot, torch.zeros_like(slot)), (local_kv_of_q, j, s)
    back = heads.ungroup(g)
    assert torch.equal(back, q)
    return heads


@pytest.mark.parametrize("local", [[0, 0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 1, 2, 2, 2], [0, 1, 1, 2], [0, 0, 0]])
def test_grouped_heads_roundtrip_irregular(local):
    heads = _check_grouping(local)
    assert heads.uniform == (len({local.count(j) for j in set(local)}) == 1)


def test_grouped_heads_pads_with_zero_known_layout():
    # can-fail guard: [0,0,0,1,1] must produce exactly one padding slot, at the end
    heads = GroupedHeads([0, 0, 0, 1, 1])
    assert not heads.uniform and heads.per_kv == 3
    q = torch.ones(2, 5, 4)
    g = heads.group_q(q)
    assert g.shape == (2, 6, 4)
    assert torch.equal(g[:, 5], torch.zeros(2, 4)) and torch.equal(g[:, :5], torch.ones(2, 5, 4))
    # a grouped output with the padding slot poisoned: ungroup must drop it
    o = g.clone()
    o[:, 5] = float("nan")
    assert torch.equal(heads.ungroup(o), q)


def test_grouped_heads_roundtrip_for_every_partition():
    # every local_kv_of_q the partitioner can produce (heads 1..16) groups and ungroups exactly
    n = 0
    for num_heads in range(1, 17):
        for kv, tp in _cases(num_heads):
            for r in range(tp):
                _check_grouping(partition_heads(num_heads, kv, tp, r).local_kv_of_q(), lead=(2,), d=2)
                n += 1
    assert n > 1000
