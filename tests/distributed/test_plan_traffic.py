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
    counted again (~2 s a dtype)."""
    from shardlm.train.measure import routed_pair_traffic

    assert traffic.profile("shardlm", table).pair == routed_pair_traffic(dtype)
