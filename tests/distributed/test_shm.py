"""The shared-memory path against gloo and against the definitions, on 2, 3 and 4 ranks.

Float data is random (per-rank seeds), so sums round: float32 results are compared with
gloo at assert_close's float32 defaults, bfloat16 ones with gloo at 2e-2 and *exactly*
with the definition this path promises (the float32 sum of the ranks in rank order,
rounded once). Results must be bitwise equal on every rank. Sizes are odd, and span one
element to 80 KB (400 KB on 64 KiB slots), so the one-round and two-phase all-reduce both run.
Each rank function first asserts that the group really took the shared-memory path, so
no comparison is gloo against itself. The sizes run once with the default slots (one
piece each) and once on a group with 64 KiB slots, where they take up to 19 pieces.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from harness.multirank import dims, run_ranks
from shardlm.parallel import comm, shm
from shardlm.parallel.collectives import _all_gather_single

SIZES = (1, 7, 577, 20_001)  # elements; 20_001 float32 (80 KB) takes the two-phase all-reduce at 3+ ranks
DTYPES = (torch.float32, torch.bfloat16)


def data(seed: int, count: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(count, generator=g).to(dtype)


def defined_sum(ids: list[int], count: int, dtype) -> torch.Tensor:
    acc = data(ids[0], count, dtype).float()
    for j in ids[1:]:
        acc += data(j, count, dtype).float()
    return acc.to(dtype)


def close_to_gloo(got, ref, dtype) -> None:
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    else:
        torch.testing.assert_close(got, ref)


# ---- run on every rank -----------------------------------------------------------------
def ops_vs_gloo(group=None, sizes=SIZES) -> list[torch.Tensor]:
    """Every routed op vs gloo (dist.*, never routed) and vs its definition; returns results."""
    group = group or dist.group.WORLD
    assert shm.route(group) is not None, f"the fast path was not taken: {shm.why_not.get(id(group))}"
    n, r = dist.get_world_size(group), dist.get_rank(group)
    ids = dist.get_process_group_ranks(group)
    outs = []
    for dtype in DTYPES:
        for count in sizes:
            mine = data(ids[r], count, dtype)
            # all-reduce (sum)
            got, ref = comm.all_reduce(mine.clone(), group), mine.clone()
            dist.all_reduce(ref, group=group)
            close_to_gloo(got, ref, dtype)
            want = defined_sum(ids, count, dtype)
            torch.testing.assert_close(
                got, want, rtol=0, atol=0
            ) if dtype == torch.bfloat16 else torch.testing.assert_close(got, want)
            assert not torch.equal(got, mine)
            outs.append(got)
            # all-gather, uneven (rank j holds count + j elements) and even
            shard = data(ids[r], count + r, dtype)
            got = comm.all_gather(shard, group, sizes=[count + j for j in range(n)])
            assert torch.equal(got, torch.cat([data(ids[j], count + j, dtype) for j in range(n)]))
            ref = shard.new_empty(n * count)
            _all_gather_single(ref, shard[:count].contiguous(), group=group)
            assert torch.equal(comm.all_gather(shard[:count], group), ref)
            # broadcast from the last rank, through a non-contiguous view
            x = data(ids[r], 2 * count, dtype).view(count, 2).t()
            comm.broadcast(x, n - 1, group)
            assert torch.equal(x, data(ids[n - 1], 2 * count, dtype).view(count, 2).t())
            # reduce-scatter (sum), uneven
            sizes = comm.split_sizes(count * n + 1, n)
            full = data(ids[r], count * n + 1, dtype)
            got = comm.reduce_scatter(full, group, sizes=sizes)
            total = defined_sum(ids, count * n + 1, dtype)
            lo = sum(sizes[:r])
            torch.testing.assert_close(
                got, total[lo : lo + sizes[r]], rtol=0, atol=0
            ) if dtype == torch.bfloat16 else torch.testing.assert_close(got, total[lo : lo + sizes[r]])
            outs.append(got)
            # all-to-all, uneven: rank i sends (i + 2j) % 3 + count rows to rank j
            send = [(r + 2 * j) % 3 + count for j in range(n)]
            recv = [(j + 2 * r) % 3 + count for j in range(n)]
            x = data(ids[r], sum(send), dtype)
            got = comm.all_to_all(x, group, send)  # recv sizes exchanged on the fast path too
            ref = x.new_empty(sum(recv))
            dist.all_to_all_single(ref, x, recv, send, group=group)
            assert torch.equal(got, ref) and got.numel() == sum(recv)
    return outs


def subgroups_at_once(iters: int = 40) -> None:
    """The two tp groups of dp=2 x tp=2 (and the dp groups) in flight at the same time, with
    per-call data, changing sizes and skewed arrival, checked exactly every call."""
    d = dims(dp=2, tp=2)
    tp, dp = d.tp_group, d.dp_group
    assert shm.route(tp) is not None and shm.route(dp) is not None
    me = dist.get_rank()
    for i in range(iters):
        count = (7, 577, 100_003, 3)[i % 4]  # big after small after big: stale slots would show
        if (i + me) % 3 == 0:
            time.sleep(0.002 * ((i * 7 + me) % 3))  # vary who arrives first
        x = (torch.arange(count) % 13 + 10 * me + i).float()  # exact sums
        tp_ids = dist.get_process_group_ranks(tp)
        want = sum((torch.arange(count) % 13 + 10 * j + i).float() for j in tp_ids)
        assert torch.equal(comm.all_reduce(x, tp), want), f"tp call {i}"
        y = torch.full((count % 5 + 1,), float(me * 100 + i))
        got = comm.all_gather(y, dp)
        assert got.tolist() == [float(j * 100 + i) for j in dist.get_process_group_ranks(dp) for _ in y]


def segment_facts() -> tuple[str, bool, int]:
    """(segment path, mapped by this process, pid) for the world group's fast path."""
    fast = shm.route(dist.group.WORLD)
    assert fast is not None
    with open("/proc/self/maps") as f:
        mapped = any(fast.seg.name in line for line in f)
    return fast.seg.name, mapped, os.getpid()


def die_mid_call(victim: int, after_rounds: int, out_dir: str, count: int) -> None:
    """The victim is SIGKILLed inside a collective (its payload written, its flag not yet
    published) after some rounds; every survivor records the error it got, and how fast."""
    group = dist.new_group(list(range(dist.get_world_size())))  # a fresh group: the world stays usable
    fast = shm.set_backend(group, "shm")
    rank = dist.get_rank()
    if rank == victim:
        publish, left = fast.seg.publish, [after_rounds]

        def dying_publish(seq):
            left[0] -= 1
            if left[0] < 0:
                os.kill(os.getpid(), signal.SIGKILL)
            publish(seq)

        fast.seg.publish = dying_publish
    start = time.perf_counter()
    try:
        for _ in range(20):
            comm.all_reduce(torch.ones(count), group)
        msg = "no error"
    except shm.CollectiveError as e:
        msg = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{time.perf_counter() - start:.3f}\n{fast.seg.name}\n{msg}")
    try:  # and the group stays failed: no later call can hang on it
        comm.all_reduce(torch.ones(3), group)
    except shm.CollectiveError as e:
        assert "failed earlier" in str(e)
    else:
        raise AssertionError("a failed group was used again without an error")


def agreement_on_fallback() -> tuple[bool, bool]:
    """One rank that cannot use shared memory makes the whole group keep gloo, and say why."""
    from shardlm.parallel import shm_setup

    real = shm_setup.why_not_here
    if dist.get_rank() == 1:
        shm_setup.why_not_here = lambda: "test: this rank is on an aarch64 host"
    try:
        g = dist.new_group(list(range(dist.get_world_size())))
        x = torch.arange(5.0) + dist.get_rank()
        comm.all_reduce(x, g)  # still correct, over gloo
        assert x.tolist() == [sum(range(dist.get_world_size())) + dist.get_world_size() * i for i in range(5)]
        auto = shm.route(g) is None
        with pytest.raises(shm.CollectiveError, match="not possible for this group"):
            shm.set_backend(dist.new_group(list(range(dist.get_world_size()))), "shm")
        forced = shm.set_backend(dist.new_group(list(range(dist.get_world_size()))), "gloo") is None
        return auto, forced
    finally:
        shm_setup.why_not_here = real


# ---- tests ---------------------------------------------------------------------------
def ops_vs_gloo_small_slots() -> list[torch.Tensor]:
    group = dist.new_group(list(range(dist.get_world_size())))
    assert shm.set_backend(group, "shm", slot=64 << 10).seg.slot_bytes == 64 << 10
    return ops_vs_gloo(group, SIZES + (100_003,))  # up to 7 pieces


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("slots", ["default", "64KiB"])
def test_every_op_matches_gloo_and_the_definition(world, slots):
    results = run_ranks(world, ops_vs_gloo if slots == "default" else ops_vs_gloo_small_slots)
    for other in results[1:]:  # every rank got bitwise the same sums
        for a, b in zip(results[0][::2], other[::2]):
            assert torch.equal(a, b)


def test_two_tp_groups_at_once_dp2_tp2():
    assert run_ranks(4, subgroups_at_once) == [None] * 4


def inference_then_backward() -> list[torch.Tensor]:
    """A group's first collectives under inference_mode (generation), then duals in a backward
    pass on the same group and sizes (training): the cached slot views must accept the writes."""
    group = dims(dp=1, tp=2).tp_group
    assert shm.route(group) is not None
    me = dist.get_rank()
    x = torch.arange(6.0) + 10 * me
    with torch.inference_mode():
        comm.all_reduce(x.clone(), group)
        comm.reduce_scatter(x.clone(), group)
        comm.all_gather(x[:3].clone(), group)
    leaf = x.clone().requires_grad_()
    y = comm.all_gather_region(comm.reduce_scatter_region(leaf, group), group)
    y.backward(torch.ones(6))
    return [y.detach(), leaf.grad]


def test_inference_then_training_on_one_group():
    """Generation, then training in the same processes (an RL loop) on the same shared memory."""
    for y, grad in run_ranks(2, inference_then_backward):
        assert y.tolist() == [10.0, 12.0, 14.0, 16.0, 18.0, 20.0]  # sum of the two ranks' x
        assert grad.tolist() == [2.0] * 6  # each rank's chunk's gradient gathered, then summed back


def test_segment_unlinked_while_mapped():
    facts = run_ranks(3, segment_facts)
    names = {name for name, _, _ in facts}
    assert len(names) == 1 and all(mapped for _, mapped, _ in facts)  # one segment, mapped by all
    assert not os.path.exists(names.pop())  # ... and already gone from /dev/shm


@pytest.mark.parametrize("world,victim,rounds,count", [(2, 1, 0, 576), (3, 0, 5, 300_007)])
def test_peer_killed_mid_call_is_an_error_not_a_hang(tmp_path, world, victim, rounds, count):
    with pytest.raises((TimeoutError, AssertionError), match=rf"dead ranks: \[{victim}\]|died"):
        run_ranks(world, die_mid_call, victim, rounds, str(tmp_path), count, timeout=60)
    for rank in set(range(world)) - {victim}:
        took, name, msg = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 2)
        assert f"group rank {victim}" in msg and "died" in msg, msg
        assert float(took) < 10, f"rank {rank} needed {took} s to notice"
        assert not os.path.exists(name)
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith("shardlm-") and name.endswith(f)]
    assert not leftovers


def give_up_on_a_lost_host(out_dir: str) -> None:
    """Rank 1 finds global ranks 5 and 300 lost elsewhere (a host's, over gloo; 400 is beyond what a
    control line holds), gives up on its groups here and exits; rank 0 records what it got while
    waiting for it (the relay ``cli`` makes before a rank ends on a lost host)."""
    from shardlm.parallel.shm_segment import PeerFailure, give_up_everywhere

    group = dist.new_group([0, 1])
    fast = shm.set_backend(group, "shm")
    comm.all_reduce(torch.ones(3), group)
    if dist.get_rank() == 1:
        give_up_everywhere([5, 300, 400])
        os._exit(0)
    try:
        comm.all_reduce(torch.ones(3), group)
        got = "no error"
    except PeerFailure as e:
        got = f"{e.lost}\n{e}"
    with open(os.path.join(out_dir, "rank0.txt"), "w") as f:
        f.write(f"{fast.seg.name}\n{got}")


def test_a_rank_that_gives_up_on_a_lost_host_is_named_with_it_not_as_dead(tmp_path):
    """Before it exits, a rank that lost a host tells its shared-memory peers which global ranks it
    lost: a peer waiting for it reports those, not that a local rank died."""
    with pytest.raises((TimeoutError, AssertionError)):  # rank 1 exits without reporting
        run_ranks(2, give_up_on_a_lost_host, str(tmp_path), timeout=60)
    name, lost, msg = (tmp_path / "rank0.txt").read_text().split("\n", 2)
    assert lost == "[5, 300]" and "group rank 1" in msg and "found global ranks [5, 300] lost" in msg, msg
    assert "died" not in msg and not os.path.exists(name)


def test_one_rank_that_cannot_makes_the_group_keep_gloo():
    assert run_ranks(2, agreement_on_fallback) == [(True, True)] * 2


def test_stale_segments_of_dead_creators_are_swept(tmp_path):
    import subprocess
    import sys

    from shardlm.parallel.shm_setup import SHM_DIR, sweep_stale

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = os.path.join(SHM_DIR, f"shardlm-{dead.pid}-test")
    live = os.path.join(SHM_DIR, f"shardlm-{os.getpid()}-test")
    for p in (stale, live):
        open(p, "wb").close()
    try:
        sweep_stale()
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for p in (stale, live):
            if os.path.exists(p):
                os.unlink(p)


def test_other_architectures_keep_gloo(monkeypatch):
    from shardlm.parallel import shm_setup

    monkeypatch.setattr(shm_setup.platform, "machine", lambda: "aarch64")
    assert "x86-64" in shm_setup.why_not_here() and "aarch64" in shm_setup.why_not_here()
    monkeypatch.setattr(shm_setup.platform, "machine", lambda: "x86_64")
    assert shm_setup.why_not_here() is None
