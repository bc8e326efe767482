"""The planner's memory-bound traffic (plan/traffic.py) is what shardlm's trainer moves: the
coefficients recounted from training steps of tiny models (shardlm.train.measure), and used by the
training time model."""

from __future__ import annotations

import pytest

from shardlm.plan import traffic


@pytest.mark.slow
@pytest.mark.parametrize("dtype,table", [("bfloat16", "bf16"), ("float32", "fp32")])
def test_traffic_constants_are_the_trainers_count(dtype, table):
    """Counted again (~8 s a dtype): a change to the trainer's operators that moves other bytes,
    or a constant edited by hand, fails here."""
    from shardlm.train.measure import traffic_coefficients

    planner = traffic.profile("shardlm", table)
    none, full = traffic_coefficients(dtype, "none"), traffic_coefficients(dtype, "full")
    fields = lambda t: [t.hidden, t.intermediate, t.query, t.kv, t.const]
    forward = [f - n for f, n in zip(full["layer"], none["layer"])]
    assert fields(planner.forward) == forward
    assert [f + b for f, b in zip(fields(planner.forward), fields(planner.backward))] == none["layer"]
    assert list(planner.ends) == none["ends"] == full["ends"]
    assert planner.per_param == round(none["per_param"])


@pytest.mark.slow
@pytest.mark.parametrize("dtype,table", [("bfloat16", "bf16"), ("float32", "fp32")])
def test_routed_pair_traffic_is_the_trainers_count(dtype, table):
    """An MoE layer's bytes per routed (token, expert) pair and hidden unit, forward and backward,
    counted again (~4 s a dtype), the same whether a rank holds one expert or eight: each pair's row
    is copied into expert order and back once (``_experts`` splits the sorted pairs; indexing each
    expert's rows out of the whole tensor moved 2.3x these bytes at 4 experts, 4.3x at 8)."""
    from shardlm.train.measure import routed_pair_traffic

    assert traffic.profile("shardlm", table).pair == routed_pair_traffic(dtype, 1) == routed_pair_traffic(dtype, 8)


def test_a_ranks_experts_cost_their_weights_once_each():
    """An expert's weights are a view of the stacked ones (``unbind``): backward writes each weight
    gradient once, so the block's bytes grow with the experts a rank holds by their weights alone.
    Indexed per expert (``w13[s]``), each expert's gradient was a whole zero w13: bytes that grew
    with the square of the experts."""
    from shardlm.train.measure import experts_block_traffic

    backward = {e: experts_block_traffic("float32", e, hidden=64, k=1)[1] for e in (1, 4, 8)}
    grown = {e: backward[e] - backward[1] for e in (4, 8)}
    assert grown[8] / grown[4] == pytest.approx(7 / 3, rel=0.05)  # linear in the experts (squared: 63 / 15)


def test_a_ranks_experts_launch_twelve_kernels_each_a_pass():
    """Each expert a rank holds adds 4 kernels to the experts block's forward (its two products,
    SiLU, SiLU(gate) x up) and 8 to its backward (four products, SiLU's gradient, the multiply's two,
    and gate's and up's gradients joined), whatever its tokens: on a GPU, host work per expert that
    the planner does not price (docs/plan.md, "What the MoE rows share"). A change that launches
    more per expert fails here."""
    from shardlm.train.measure import experts_block_pass

    def kernels(experts: int) -> tuple[int, int]:
        forward, backward = experts_block_pass("float32", experts, hidden=64, k=2, tokens=256)
        return forward.kernels, backward.kernels

    (f8, b8), (f32, b32) = kernels(8), kernels(32)
    assert ((f32 - f8) / 24, (b32 - b8) / 24) == (4, 8)
