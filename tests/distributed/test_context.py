"""Context-parallel attention (parallel/context.py) against one process's attention over the whole sequence.

Each cp rank holds the zig-zag share of every sequence; its output and its gradients of q, k and v
must equal those rows of full causal attention (SDPA and autograd in this process). Tolerance:
float32 assert_close defaults; the ring's online softmax sums blocks in another order (~1e-7).
Ulysses runs where the heads split over cp and is refused, naming the sizes that work, elsewhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.multirank import run_ranks
from harness.rankfns import context_attention_grads
from shardlm.models.attention import GroupedHeads
from shardlm.parallel.context import ulysses_copies
from shardlm.parallel.dims import LayoutError


def reference(q, k, v, grad, kv_of_q, window):
    """Full attention of q [b, s, q_heads, d] over k, v [b, s, kv_heads, d] and its gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    idx = torch.tensor(kv_of_q)
    seq = q.shape[1]
    pos = torch.arange(seq)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k[:, :, idx].transpose(1, 2),
        v[:, :, idx].transpose(1, 2),
        attn_mask=mask,
        scale=q.shape[-1] ** -0.5,
    ).transpose(1, 2)
    o.backward(grad)
    return o.detach(), q.grad, k.grad, v.grad


CASES = [  # (cp, kv head of each query head, sliding window)
    (2, [0, 0, 1, 1], None),
    (3, [0, 0, 0, 1, 1], None),  # uneven query groups: padded to the largest
    (4, [0, 1], None),
    (2, [0, 0, 1, 1], 5),  # a sliding window hides whole blocks
    (3, [0, 0], 7),
    (2, [0, 0, 1, 1], 2),  # a window narrower than a key tile: some tiles see no key of some rows
    (4, [0, 0, 1, 1], None),  # Ulysses: each KV head's query group split over two ranks
    (2, [0, 0, 0, 0], 3),  # Ulysses: one KV head, copied to both ranks
]


@pytest.mark.parametrize(
    "algorithm,tile",
    [("all-gather", None), ("ring", None), ("ring", (3, 2)), ("ulysses", None)],
    ids=["all-gather", "ring", "ring-tiles3x2", "ulysses"],
)  # many tiles, the last ones partial
@pytest.mark.parametrize("cp,kv_of_q,window", CASES, ids=[f"cp{c}-q{len(h)}kv{max(h) + 1}-w{w}" for c, h, w in CASES])
def test_context_attention_matches_full(algorithm, tile, cp, kv_of_q, window):
    heads = GroupedHeads(kv_of_q)
    if algorithm == "ulysses" and heads.num_kv % cp and (cp % heads.num_kv or heads.per_kv % (cp // heads.num_kv)):
        with pytest.raises(LayoutError, match=f"cp={cp}: Ulysses splits attention heads"):
            ulysses_copies(heads.num_kv, heads.per_kv, cp)
        return
    g = torch.Generator().manual_seed(cp)
    b, seq, d = 2, 4 * cp * 2, 8
    q = torch.randn(b, seq, len(kv_of_q), d, generator=g)
    k, v = (torch.randn(b, seq, max(kv_of_q) + 1, d, generator=g) for _ in range(2))
    grad = torch.randn(q.shape, generator=g)
    want = reference(q, k, v, grad, kv_of_q, window)
    covered = torch.zeros(seq, dtype=torch.int64)
    for rank, (pos, *got) in enumerate(
        run_ranks(cp, context_attention_grads, algorithm, q, k, v, grad, kv_of_q, window, tile)
    ):
        covered[pos] += 1
        for name, x, ref in zip(("output", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(x, ref[:, pos], msg=lambda m: f"rank {rank} {name}: {m}")
    assert covered.tolist() == [1] * seq  # the ranks' shares tile the sequence once
    # it can fail: the keys of other ranks matter (attention over the local share alone differs)
    local = reference(q[:, pos], k[:, pos], v[:, pos], grad[:, pos], kv_of_q, window)[0]
    assert (local - want[0][:, pos]).abs().max() > 1e-2


def test_ring_needs_known_algorithm():
    from shardlm.parallel.context import ContextBatch

    with pytest.raises(ValueError, match="cp attention 'rings' is not one of"):
        ContextBatch.build(None, 1, 8, "rings")


def test_ring_in_bfloat16_is_as_close_as_sdpa():
    """bfloat16 inputs: ring attention's scores are float32 (as SDPA's), so its output is as close
    to the float32 result as bfloat16 SDPA's own (rounded scores were 2x further, measured)."""
    g = torch.Generator().manual_seed(9)
    b, seq, d, kv_of_q = 1, 512, 64, [0, 0, 0, 1, 1, 1]
    q = torch.randn(b, seq, 6, d, generator=g) * 3
    k, v = (torch.randn(b, seq, 2, d, generator=g) * 3 for _ in range(2))
    grad = torch.randn(q.shape, generator=g)
    exact = reference(q, k, v, grad, kv_of_q, None)[0]
    sdpa = reference(*(t.bfloat16() for t in (q, k, v, grad)), kv_of_q, None)[0].float()
    limit = 1.25 * (sdpa - exact).abs().max()
    for pos, out, *_ in run_ranks(
        2, context_attention_grads, "ring", *(t.bfloat16() for t in (q, k, v, grad)), kv_of_q, None, (64, 64)
    ):
        assert out.dtype == torch.bfloat16
        assert (out.float() - exact[:, pos]).abs().max() <= limit
