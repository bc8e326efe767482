"""BlockManager: paged KV bookkeeping and prefix caching (pure Python, exact comparisons).

Sequences are admitted the way the scheduler does it (``reuse_prefix``, ``grow``,
``count_lookup``) and "computed" by advancing ``num_computed`` and calling ``commit``,
as ``Scheduler.update`` does after a step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardlm.engine.block_manager import BlockManager, block_hash
from shardlm.engine.sampling import SamplingParams
from shardlm.engine.sequence import Sequence

A = list(range(100, 114))  # 14 tokens: with block_size 4, three full blocks and 2 more


def admit(bm: BlockManager, tokens: list[int], sid: int = 0) -> Sequence:
    seq = Sequence(sid, tokens, SamplingParams(temperature=0.0, max_tokens=4))
    bm.reuse_prefix(seq)
    assert bm.can_grow(seq, seq.num_tokens)
    bm.grow(seq, seq.num_tokens)
    bm.count_lookup(seq)
    return seq


def compute(bm: BlockManager, seq: Sequence) -> Sequence:
    """Feed the whole prompt, as a step would, and name its full blocks."""
    seq.num_computed = seq.num_tokens
    bm.commit(seq)
    return seq


def test_a_shared_prefix_reuses_exactly_its_full_blocks():
    bm = BlockManager(16, 4)
    a = compute(bm, admit(bm, A))
    assert a.block_table == [0, 1, 2, 3] and a.num_cached == 0
    b = admit(bm, A[:8] + [7, 7, 7, 7, 7, 7], sid=1)  # the first 2 full blocks are A's
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2:] == [4, 5]
    assert b.num_computed == b.num_cached == 8
    assert bm.ref_counts[:6] == [2, 2, 1, 1, 1, 1]
    c = admit(bm, A[:12] + [7], sid=2)  # 3 full blocks match
    assert c.block_table[:3] == a.block_table[:3] and c.num_computed == c.num_cached == 12
    assert bm.ref_counts[:3] == [3, 3, 2]
    # can-fail guard: a different first token shares nothing
    d = admit(bm, [0] + A[1:], sid=3)
    assert d.num_cached == 0 and set(d.block_table).isdisjoint(a.block_table)


def test_the_block_holding_the_last_token_is_never_reused():
    bm = BlockManager(16, 4)
    compute(bm, admit(bm, A[:12]))  # exactly 3 full blocks, all named
    assert len(bm.hash_of) == 3
    b = admit(bm, A[:12], sid=1)  # the same prompt: its last token must still be computed
    assert b.num_cached == 8 and len(set(b.block_table) & set(range(3))) == 2
    assert b.block_table[2] not in (0, 1, 2)  # its third block is its own, written afresh
    c = admit(bm, A[:4], sid=2)
    assert c.num_cached == 0
    e = admit(bm, A[:5], sid=3)  # one token past the first block: that block is reused
    assert e.num_cached == 4 and e.block_table[0] == 0


def test_hashes_are_chained_so_only_a_whole_equal_prefix_matches():
    bm = BlockManager(32, 4)
    a = compute(bm, admit(bm, A))
    blocks = [A[0:4], A[4:8], A[8:12]]
    # the same later blocks after a different first block: nothing
    assert admit(bm, [9, 9, 9, 9] + A[4:], sid=1).num_cached == 0
    # A's blocks in another order: nothing (block 1's content at position 0 does not match)
    assert admit(bm, blocks[1] + blocks[0] + blocks[2] + [1], sid=2).num_cached == 0
    # A's first block twice: only the first is found (the second is at another position)
    x = admit(bm, blocks[0] + blocks[0] + [1], sid=3)
    assert x.num_cached == 4 and x.block_table[0] == a.block_table[0]
    # the hash itself: same content, different predecessor -> different name
    h0 = block_hash(0, blocks[0])
    assert block_hash(h0, blocks[1]) != block_hash(block_hash(0, [9, 9, 9, 9]), blocks[1])
    assert block_hash(0, blocks[0]) != block_hash(h0, blocks[0])
    assert block_hash(h0, blocks[1]) == block_hash(block_hash(0, list(A[0:4])), blocks[1])


def test_freed_blocks_stay_findable_until_handed_out_again():
    bm = BlockManager(6, 2)
    a = compute(bm, admit(bm, A[:7]))  # blocks 0..3; 0, 1, 2 full and named, 3 holds 1 token
    assert a.block_table == [0, 1, 2, 3] and set(bm.hash_of) == {0, 1, 2}
    bm.free(a)
    assert bm.ref_counts == [0] * 6 and bm.num_free == 6
    # never-used blocks first, then the freed ones, least recently freed first; a sequence
    # frees its tail first, so its prefix (the likeliest to be shared) is evicted last
    assert list(bm.free_ids) == [4, 5, 3, 2, 1, 0]
    b = admit(bm, A[:7], sid=1)  # the same prompt finds its first 3 blocks again, while free
    assert b.block_table[:3] == [0, 1, 2] and b.num_cached == 6 and b.block_table[3] == 4
    assert list(bm.free_ids) == [5, 3]
    bm.free(b)
    assert list(bm.free_ids) == [5, 3, 4, 2, 1, 0]
    # handing blocks out evicts their names: 5, 3, 4 carry none, 2 does
    other = admit(bm, [1] * 8, sid=2)
    assert other.block_table == [5, 3, 4, 2] and set(bm.hash_of) == {0, 1}
    bm.free(other)
    c = admit(bm, A[:7], sid=3)  # the chain now stops after block 1
    assert c.block_table[:2] == [0, 1] and c.num_cached == 4
    assert c.block_table[2:] == [2, 4]  # block 2 comes back as a fresh block, written anew


def test_never_used_blocks_go_out_in_increasing_order_before_any_freed_one():
    """ModelRunner._zero_new_blocks relies on this: a high-water mark of zeroed blocks."""
    bm = BlockManager(8, 2)
    a = admit(bm, [1, 2, 3])
    b = admit(bm, [4, 5, 6, 7, 8], sid=1)
    assert a.block_table == [0, 1] and b.block_table == [2, 3, 4]
    bm.free(a)
    c = admit(bm, [9] * 6, sid=2)
    assert c.block_table == [5, 6, 7]  # 0 and 1 are free, but never-used ones go first
    d = admit(bm, [8] * 3, sid=3)
    assert d.block_table == [1, 0]


def test_blocks_freed_earlier_go_out_first():
    bm = BlockManager(4, 2)
    a, b = admit(bm, [1, 2]), admit(bm, [3, 4], sid=1)
    c = admit(bm, [5, 6, 7, 8], sid=2)
    bm.free(b)
    bm.free(c)
    bm.free(a)
    assert list(bm.free_ids) == [1, 3, 2, 0]
    assert admit(bm, [0] * 7, sid=3).block_table == [1, 3, 2, 0]


def test_hit_and_query_counters():
    bm = BlockManager(32, 4)
    compute(bm, admit(bm, A))
    assert (bm.hits, bm.queries) == (0, 14)
    admit(bm, A[:9], sid=1)  # 8 cached of 9
    admit(bm, [5] + A[1:], sid=2)  # 0 of 14
    admit(bm, A[:12] + [0, 0], sid=3)  # 12 of 14
    assert (bm.hits, bm.queries) == (20, 14 + 9 + 14 + 14)


def test_concurrent_equal_blocks_keep_the_first_name_and_consistent_counts():
    bm = BlockManager(16, 4)
    a = admit(bm, A[:9])
    b = admit(bm, A[:9], sid=1)  # admitted before a's blocks were named: nothing to share
    assert b.num_cached == 0 and set(a.block_table).isdisjoint(b.block_table)
    compute(bm, a)
    compute(bm, b)
    assert bm.hash_of == {a.block_table[0]: a.block_hashes[0], a.block_table[1]: a.block_hashes[1]}
    assert b.block_hashes == a.block_hashes  # b knows the names; the cache keeps a's blocks
    c = admit(bm, A[:9], sid=2)
    assert c.block_table[:2] == a.block_table[:2]
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    tail = a.block_table[2]
    bm.free(a)
    assert [bm.ref_counts[x] for x in c.block_table[:2]] == [1, 1] and bm.ref_counts[tail] == 0
    assert tail in bm.free_ids and c.block_table[0] not in bm.free_ids


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(16, 4, prefix_caching=False)
    a = compute(bm, admit(bm, A))
    b = admit(bm, A, sid=1)
    assert bm.hash_of == {} and bm.block_of == {} and a.block_hashes == []
    assert b.num_cached == b.num_computed == 0 and set(a.block_table).isdisjoint(b.block_table)
    assert bm.ref_counts.count(1) == 8 and (bm.hits, bm.queries) == (0, 28)
    # can-fail guard: the same calls with caching on do share
    on = BlockManager(16, 4)
    compute(on, admit(on, A))
    assert admit(on, A, sid=1).num_cached == 12


def test_sizes_and_errors():
    bm = BlockManager(3, 4)
    s = Sequence(0, [1] * 5, SamplingParams(temperature=0.0))
    assert bm.blocks_needed(s, 5) == 2 and bm.can_grow(s, 12) and not bm.can_grow(s, 13)
    bm.grow(s, 5)
    assert bm.blocks_needed(s, 8) == 0 and bm.blocks_needed(s, 9) == 1 and bm.num_used == 2
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(0, 4)


_HASHES = """
import json, sys, types
sys.modules["shardlm.engine.sequence"] = types.SimpleNamespace(Sequence=object)  # no torch needed
from shardlm.engine.block_manager import block_hash
h, out = 0, []
for block in ([1, 2, 3, 4], [0, 0, 0, 0], [151_000, 7, 2**40, 5], [5, 4, 3, 2]):
    h = block_hash(h, block)
    out.append(h)
print(json.dumps({"chain": out, "str": hash("shardlm")}))
"""


def test_block_hash_is_the_same_in_every_process():
    """Ranks compute prefix-cache names in separate processes; they must agree whatever
    PYTHONHASHSEED each got (hash randomisation covers str and bytes, not int tuples)."""
    got = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _HASHES],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        got.append(json.loads(out.stdout))
    h, here = 0, []
    for block in ([1, 2, 3, 4], [0, 0, 0, 0], [151_000, 7, 2**40, 5], [5, 4, 3, 2]):
        h = block_hash(h, block)
        here.append(h)
    assert got[0]["chain"] == got[1]["chain"] == here
    assert len(set(here)) == 4
    # can-fail guard: the two seeds really did change hashing (of strings)
    assert got[0]["str"] != got[1]["str"]
