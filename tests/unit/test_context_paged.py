"""The pieces of context-parallel inference that need no ranks: the striped layout and the
log-sum-exp merge of partial attention (parallel/context_paged.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlm.parallel.context_paged import local_key_positions, merge_partials, owner, partial_attention


def test_every_position_has_one_owner_and_one_slot():
    bs, cp, blocks = 4, 3, 5
    held = [local_key_positions(blocks, bs, cp, r).tolist() for r in range(cp)]
    assert sorted(p for h in held for p in h) == list(range(blocks * bs * cp))
    assert all(owner(p, bs, cp) == r for r, h in enumerate(held) for p in h)
    assert held[1][:6] == [4, 5, 6, 7, 16, 17]  # rank 1: the second run of each group block of 12


def test_partials_over_disjoint_key_sets_merge_to_whole_attention():
    """Keys dealt at random to three parts (some queries see none of a part's keys: -inf); the
    merged output equals attention over all keys, causal and with a window."""
    g = torch.Generator().manual_seed(0)
    kv, group, n, m, d = 2, 3, 9, 20, 8
    q, k, v = (
        torch.randn(kv, group, n, d, generator=g),
        torch.randn(kv, m, d, generator=g),
        torch.randn(kv, m, d, generator=g),
    )
    q_pos, k_pos = torch.arange(m - n, m), torch.arange(m)
    part = torch.randint(0, 3, (m,), generator=g)
    part[:12] = 0  # the first query (position 11) sees only part 0's keys
    for window in (None, 5):
        outs, lses = zip(
            *(
                partial_attention(q, k[:, part == p], v[:, part == p], q_pos, k_pos[part == p], 0.3, window, tile=4)
                for p in range(3)
            )
        )
        assert torch.isinf(torch.stack(lses)[1:, ..., 0]).all()  # nothing visible: -inf, output 0
        mask = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        want = F.scaled_dot_product_attention(q, k[:, None], v[:, None], attn_mask=mask, scale=0.3)
        torch.testing.assert_close(merge_partials(torch.stack(outs), torch.stack(lses)), want)
        torch.testing.assert_close(outs[0][..., 0, :], want[..., 0, :])  # one part holds the first query's keys
